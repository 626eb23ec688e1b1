"""The top-k combine as a deterministic reverse gather: ``out[t] = sum_j w[t, j] * y[row[t, j]]``.

Each program owns one token and a slice of ``H``, loads all of that token's expert rows at once (and the split-K
partial sums of each row, all in flight together, added in a fixed order) and sums them in a fixed order, so the
result is bitwise reproducible -- unlike a scatter-add. The weight of pair ``j`` is read straight from the
routing's ``(T, E)`` affinities at the pair's expert (or is 1 when the affinity already scaled the expert's
input), so no per-pair weight tensor is materialised. An optional ``(T, H)`` addend (the shared experts' output)
joins the same sum. Pairs without a row (padded tokens, dropped pairs) are excluded with a select, never
multiplied by a zero weight, so a NaN row cannot leak into another token. Accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements one program holds: (pairs per token, padded to a power of two) x (columns).
TILE_ELEMENTS = 8192


@triton.jit
def combine_token(token, column, y_ptr, pair_row_ptr, pair_expert_ptr, affinity_ptr, addend_ptr, out_ptr,
                   num_rows, hidden, pairs_per_token, num_experts,
                   stride_ys, stride_yr, stride_rt, stride_et, stride_ej, stride_at, stride_ot,
                   NUM_SPLITS: tl.constexpr, PRESCALED: tl.constexpr, HAS_ADDEND: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[token, column slice]``: the token's rows in a fixed order (see the module docstring)."""
    token = token.to(tl.int64)
    cols = column * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    pairs = tl.arange(0, BLOCK_P)
    pair_ok = pairs < pairs_per_token
    row = tl.load(pair_row_ptr + token * stride_rt + pairs, mask=pair_ok, other=num_rows)
    has_row = row < num_rows
    if PRESCALED:
        weight = tl.full((BLOCK_P,), 1.0, tl.float32)
    else:
        expert = tl.load(pair_expert_ptr + token * stride_et + pairs * stride_ej, mask=has_row, other=0)
        weight = tl.load(affinity_ptr + token * num_experts + expert, mask=has_row, other=0.0).to(tl.float32)
    mask = has_row[:, None] & col_ok[None, :]
    offsets = tl.where(has_row, row, 0)[:, None] * stride_yr + cols[None, :]
    value = tl.zeros((BLOCK_P, BLOCK_H), dtype=tl.float32)
    # Unrolled: the partial sums' loads are issued together (a loop waited one L2 latency per split).
    for s in tl.static_range(NUM_SPLITS):
        value += tl.load(y_ptr + s * stride_ys + offsets, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the model dtype first, as an unsplit down projection would have stored it.
    value = value.to(out_ptr.dtype.element_ty).to(tl.float32)
    # A select, not a multiply by 0: the row of a padded pair is never part of the sum.
    out = tl.sum(tl.where(mask, weight[:, None] * value, 0.0), axis=0)
    if HAS_ADDEND:
        out += tl.load(addend_ptr + token * stride_at + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _combine_kernel(y_ptr, pair_row_ptr, pair_expert_ptr, affinity_ptr, addend_ptr, out_ptr,
                    num_rows, hidden, pairs_per_token, num_experts,
                    stride_ys, stride_yr, stride_rt, stride_et, stride_ej, stride_at, stride_ot,
                    NUM_SPLITS: tl.constexpr, PRESCALED: tl.constexpr, HAS_ADDEND: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    combine_token(tl.program_id(0), tl.program_id(1), y_ptr, pair_row_ptr, pair_expert_ptr, affinity_ptr,
                   addend_ptr, out_ptr, num_rows, hidden, pairs_per_token, num_experts, stride_ys,
                   stride_yr, stride_rt, stride_et, stride_ej, stride_at, stride_ot, NUM_SPLITS, PRESCALED,
                   HAS_ADDEND, BLOCK_P, BLOCK_H)


def combine_width(num_tokens: int, hidden: int, pairs_per_token: int) -> int:
    """Columns one combine program sums: the whole row while it fits, narrower at decode so the work still
    spreads over the GPU."""
    block_p = triton.next_power_of_2(pairs_per_token)
    return max(16, min(triton.next_power_of_2(hidden), TILE_ELEMENTS // block_p,
                       triton.next_power_of_2(triton.cdiv(num_tokens * hidden, 256))))


def combine_rows(rows: torch.Tensor, pair_row: torch.Tensor, pair_expert: torch.Tensor, affinities: torch.Tensor,
                 prescaled: bool, out_dtype: torch.dtype, addend: torch.Tensor | None = None) -> torch.Tensor:
    """``rows (S, R, H)`` split-K partials of each expert row, ``pair_row (T, K)`` (``R`` = no row),
    ``pair_expert (T, K)`` the expert of each pair, ``affinities (T, E)`` -> ``(T, H)`` in ``out_dtype``.

    ``prescaled``: the affinity already scaled the expert input, so every pair weighs 1. ``addend (T, H)``
    (the shared experts' output) is added in the same pass, before the one rounding.
    """
    num_splits, num_rows, hidden = rows.shape
    num_tokens, pairs_per_token = pair_row.shape
    affinities = affinities.contiguous()
    pair_row = pair_row.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=rows.device)
    if addend is not None:
        if addend.shape != out.shape:
            raise ValueError(f"addend must be (T, H) = {tuple(out.shape)}, got {tuple(addend.shape)}")
        addend = addend if addend.stride(1) == 1 else addend.contiguous()
    block_p = triton.next_power_of_2(pairs_per_token)
    block_h = combine_width(num_tokens, hidden, pairs_per_token)
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    _combine_kernel[grid](
        rows, pair_row, pair_expert, affinities, out if addend is None else addend, out, num_rows, hidden,
        pairs_per_token, affinities.shape[1], rows.stride(0), rows.stride(1), pair_row.stride(0),
        pair_expert.stride(0), pair_expert.stride(1), 0 if addend is None else addend.stride(0), out.stride(0),
        NUM_SPLITS=num_splits, PRESCALED=prescaled, HAS_ADDEND=addend is not None, BLOCK_P=block_p, BLOCK_H=block_h)
    return out
