"""Attention of one new token per sequence over its KV cache, split along the keys (flash decoding), with grouped
query heads read from the cache as they are stored.

At decode a query row is one token, so a kernel that gives each (sequence, head) one program -- or that first
repeats the cache's key/value heads for the query heads of a group, which is what transformers' SDPA path does under
``torch.compile`` with a mask -- leaves most multiprocessors idle and, for the repeat, writes and reads the cache
``G`` times over; the longer the context, the more it costs. Here a program takes one key/value head of one sequence
(all ``G`` query heads of its group as the rows of one tile, so the cache is read once) and one slice of the keys:

1. :func:`_split_kernel`, grid ``(B * Hkv, splits)``: over its slice of keys, ``s = q k^T * scale + mask``, the
   running maximum ``m``, the sum ``l`` of ``exp(s - m)`` and the unnormalised ``sum exp(s - m) v`` (fp32);
2. :func:`_combine_kernel`, grid ``(B * Hq,)``: the splits merged (``exp(m_i - max m)`` weights; fixed order),
   divided by the merged sum, stored in the output's dtype.

The number of splits is chosen from the shapes alone (enough programs to fill the GPU, at least one key block per
split), so a shape always runs the same launches: a CUDA graph captures them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nxd_moe.gpu_info import multiprocessors
from nxd_moe.triton_kernels import interpreting
from nxd_moe.triton_kernels.tile_math import tile_dot

__all__ = ["decode_attention", "decode_attention_op", "num_splits"]

BLOCK_N = 64  # keys per step of a split (the tile's columns)
# Programs the split kernel aims for, per multiprocessor: enough to hide a key block's load latency.
PROGRAMS_PER_SM = 2


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, stats_ptr,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                  stride_mb, stride_mn, kv_heads, keys, keys_per_split, scale,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """One (sequence, key/value head, key slice): the slice's maximum, sum and unnormalised output, per query head
    of the group (``acc (B, Hq, SPLITS, D)``, ``stats (2, B, Hq, SPLITS)``, fp32)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // kv_heads
    h = pid % kv_heads
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = h * GROUP + rows
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, keys)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), tl.float32)
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        ok = n < end
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + n[:, None] * stride_kn + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tile_dot(q, tl.trans(k), tl.zeros((GROUP_PAD, BLOCK_N), tl.float32), PRECISION, INTERPRET) * scale
        if HAS_MASK:
            s += tl.load(mask_ptr + b * stride_mb + n * stride_mn, mask=ok, other=0.0).to(tl.float32)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # rows whose keys so far are all masked with -inf stay at m = -inf, total = 0 (not exp(-inf + inf) = NaN)
        m_finite = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_finite[:, None])
        alpha = tl.exp(m - m_finite)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + n[:, None] * stride_vn + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        total = total * alpha + tl.sum(p, axis=1)
        # p rounded to the cache's dtype for the tensor cores, as flash attention does
        acc = tile_dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, INTERPRET)
        m = m_new
    slot = (b * kv_heads * GROUP + heads) * SPLITS + split
    tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(stats_ptr + slot, m, mask=row_ok)
    tl.store(stats_ptr + tl.num_programs(0) * GROUP * SPLITS + slot, total, mask=row_ok)


@triton.jit
def _combine_kernel(acc_ptr, stats_ptr, out_ptr, heads, stride_ob, stride_oh, rows_total,
                    D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One (sequence, query head): its splits merged, normalised and stored in the output's dtype."""
    row = tl.program_id(0)
    b = row // heads
    h = row % heads
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < SPLITS
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m = tl.load(stats_ptr + row * SPLITS + s, mask=s_ok, other=float("-inf"))
    total = tl.load(stats_ptr + rows_total * SPLITS + row * SPLITS + s, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    top = tl.max(m, axis=0)
    # a split with no key (m = -inf) weighs 0
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * total, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def num_splits(batch: int, kv_heads: int, keys: int, multiprocessors: int) -> int:
    """Key slices per (sequence, key/value head): enough programs for ``PROGRAMS_PER_SM`` per multiprocessor, each
    slice at least one ``BLOCK_N`` key block."""
    wanted = math.ceil(PROGRAMS_PER_SM * multiprocessors / (batch * kv_heads))
    return max(1, min(wanted, math.ceil(keys / BLOCK_N)))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, splits: int | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for one query token per sequence.

    ``query (B, Hq, 1, D)``; ``key``, ``value (B, Hkv, L, D)`` (``Hq`` a multiple of ``Hkv``: query head ``i`` reads
    key/value head ``i // (Hq / Hkv)``; any strides with a contiguous last dimension, e.g. a slice of a larger cache);
    ``mask``: additive, broadcastable to ``(B, 1, 1, L)`` (its heads and query dimensions of size 1), or None.
    Returns ``(B, 1, Hq, D)`` in ``query``'s dtype -- transformers' attention-output layout. ``splits``: key slices
    per (sequence, key/value head) (default :func:`num_splits`)."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if length != 1:
        raise ValueError(f"decode_attention: query (B, Hq, 1, D) expected, got {tuple(query.shape)}")
    if key.shape != (batch, kv_heads, keys, dim) or value.shape != key.shape:
        raise ValueError(f"decode_attention: key and value must be (B={batch}, Hkv, L, D={dim}); got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if heads % kv_heads:
        raise ValueError(f"decode_attention: query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if keys < 1:
        raise ValueError("decode_attention: key must hold at least one position")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("decode_attention: query, key and value need a contiguous last dimension")
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != keys \
                or mask.shape[0] not in (1, batch):
            raise ValueError(f"decode_attention: mask must broadcast as (B={batch}, 1, 1, L={keys}); got "
                             f"{tuple(mask.shape)}")
    if splits is None:
        # Triton's interpreter: as if 2 multiprocessors -- a few splits, so that tests see them merged
        splits = num_splits(batch, kv_heads, keys, multiprocessors(query.device) if query.is_cuda else 2)
    elif not 1 <= splits <= keys:
        raise ValueError(f"decode_attention: splits must be in [1, {keys}], got {splits}")
    group = heads // kv_heads
    keys_per_split = math.ceil(math.ceil(keys / splits) / BLOCK_N) * BLOCK_N
    acc = torch.empty(batch * heads * splits * dim, device=query.device, dtype=torch.float32)
    stats = torch.empty(2 * batch * heads * splits, device=query.device, dtype=torch.float32)
    out = torch.empty(batch, 1, heads, dim, device=query.device, dtype=query.dtype)
    mask_strides = (0, 0) if mask is None else (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(3))
    d_pad = max(16, triton.next_power_of_2(dim))
    _split_kernel[(batch * kv_heads, splits)](
        query, key, value, query if mask is None else mask, acc, stats,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *mask_strides, kv_heads, keys, keys_per_split, scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, D_PAD=d_pad, BLOCK_N=BLOCK_N,
        HAS_MASK=mask is not None, SPLITS=splits, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        INTERPRET=interpreting())
    _combine_kernel[(batch * heads,)](
        acc, stats, out, heads, out.stride(0), out.stride(2), batch * heads,
        D=dim, D_PAD=d_pad, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits))
    return out


def _decode_attention_fake(query, key, value, mask, scale):
    batch, heads, _, dim = query.shape
    return query.new_empty(batch, 1, heads, dim)


# What a compiled graph calls: one opaque op (the kernels take the views they are given: exact strides).
decode_attention_op = torch.library.custom_op(
    "nxd_moe::decode_attention", lambda query, key, value, mask, scale: decode_attention(query, key, value, mask,
                                                                                        scale),
    mutates_args=(), schema="(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor",
    tags=(torch.Tag.needs_exact_strides,))
decode_attention_op.register_fake(_decode_attention_fake)
