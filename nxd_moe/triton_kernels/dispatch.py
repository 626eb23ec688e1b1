"""The static all-to-all's bookkeeping as three kernels (GPU), so that a decode step's dispatch and combine cost
two collectives and three launches instead of dozens of small tensor ops.

The parallel layer (:mod:`nxd_moe.parallel.all_to_all`) sends every destination rank a buffer of ``U`` rows -- the
rows it needs first, padding after. Here, for ``U`` owned rows and ``M`` destinations (block rank ``r`` serves EP
rank ``r // TP``):

- :func:`destination_slots`: ``slot (U, M)`` int32 -- the row's place in destination ``r``'s buffer, ``-1`` if it
  does not go there -- and ``source_row (M * U,)`` int32 -- the row in each buffer slot, ``-1`` for padding. One
  program per destination scans the rows in order (a running count), so valid rows keep their order.
- :func:`pack_for_destinations`: the ``(M * U, row_bytes)`` byte buffer, one row per slot laid out as
  :func:`nxd_moe.parallel.payload.pack` lays out ``[hidden, expert ids (int32, -1 where the destination does not
  compute the pair), weights (fp32)]``; padding slots are zeros with every id ``-1``.
- :func:`combine_from_destinations`: ``out[u] = sum_r returned[r * U + slot[u, r]]`` over the destinations the row
  went to, in rank order, accumulated in fp32: deterministic.

Torch equivalents live beside the callers; the tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slots_kernel(owner_ptr, slot_ptr, source_ptr, num_rows, num_ranks, tensor_parallel,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr):
    rank = tl.program_id(0)
    ep = rank // tensor_parallel
    ks = tl.arange(0, BLOCK_K)
    carry = 0
    for start in range(0, num_rows, BLOCK_U):
        rows = start + tl.arange(0, BLOCK_U)
        row_ok = rows < num_rows
        owner = tl.load(owner_ptr + rows[:, None] * TOP_K + ks[None, :],
                        mask=row_ok[:, None] & (ks[None, :] < TOP_K), other=-1)
        hit = (tl.max((owner == ep).to(tl.int32), axis=1) > 0) & row_ok
        count = hit.to(tl.int32)
        place = carry + tl.cumsum(count, axis=0) - count
        tl.store(slot_ptr + rows * num_ranks + rank, tl.where(hit, place, -1), mask=row_ok)
        tl.store(source_ptr + rank * num_rows + place, rows, mask=hit)
        carry += tl.sum(count, axis=0)
    for start in range(0, num_rows, BLOCK_U):
        places = start + tl.arange(0, BLOCK_U)
        tl.store(source_ptr + rank * num_rows + places, tl.full((BLOCK_U,), -1, tl.int32),
                 mask=(places >= carry) & (places < num_rows))


def destination_slots(owner: torch.Tensor, num_ranks: int, tensor_parallel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``owner (U, k)`` EP rank computing each pair (``-1``: none) -> ``slot (U, M)``, ``source_row (M * U,)``."""
    num_rows, top_k = owner.shape
    owner = owner.contiguous()
    slot = torch.empty(num_rows, num_ranks, dtype=torch.int32, device=owner.device)
    source = torch.empty(num_ranks * num_rows, dtype=torch.int32, device=owner.device)
    block_u = min(1024, triton.next_power_of_2(max(num_rows, 16)))
    _slots_kernel[(num_ranks,)](owner, slot, source, num_rows, num_ranks, tensor_parallel, TOP_K=top_k,
                                BLOCK_K=triton.next_power_of_2(top_k), BLOCK_U=block_u)
    return slot, source


@triton.jit
def _pack_kernel(rows_ptr, experts_ptr, weights_ptr, owner_ptr, source_ptr, send_ptr, num_rows, hidden,
                 tensor_parallel, stride_row, row_bytes, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    slot = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    row = tl.load(source_ptr + slot).to(tl.int64)
    real = row >= 0
    value = tl.load(rows_ptr + tl.where(real, row, 0) * stride_row + cols, mask=col_ok & real, other=0.0)
    base = send_ptr + slot * row_bytes
    tl.store(base.to(rows_ptr.dtype) + cols, value, mask=col_ok)
    if tl.program_id(1) == 0:
        ks = tl.arange(0, BLOCK_K)
        k_ok = (ks < TOP_K) & real
        ep = (slot // num_rows) // tensor_parallel
        expert = tl.load(experts_ptr + tl.where(real, row, 0) * TOP_K + ks, mask=k_ok, other=-1)
        owner = tl.load(owner_ptr + tl.where(real, row, 0) * TOP_K + ks, mask=k_ok, other=-1)
        weight = tl.load(weights_ptr + tl.where(real, row, 0) * TOP_K + ks, mask=k_ok, other=0.0)
        ids = (base + hidden * rows_ptr.dtype.element_ty.primitive_bitwidth // 8).to(tl.pointer_type(tl.int32))
        tl.store(ids + ks, tl.where(owner == ep, expert, -1).to(tl.int32), mask=ks < TOP_K)
        tl.store((ids + TOP_K).to(tl.pointer_type(tl.float32)) + ks, weight.to(tl.float32), mask=ks < TOP_K)


def pack_for_destinations(rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor,
                          source_row: torch.Tensor, tensor_parallel: int) -> torch.Tensor:
    """``rows (U, H)``, ``experts / weights / owner (U, k)``, ``source_row (M * U,)`` -> ``(M * U, row_bytes)``
    uint8, each row ``[hidden | ids int32 | weights fp32]`` (``H * itemsize`` must be a multiple of 4)."""
    num_rows, hidden = rows.shape
    top_k = experts.shape[1]
    item = rows.element_size()
    if (hidden * item) % 4:
        raise ValueError(f"pack_for_destinations: a row's hidden part ({hidden} x {item} bytes) must be a multiple "
                         "of 4 bytes")
    row_bytes = hidden * item + 8 * top_k
    slots = source_row.numel()
    send = torch.empty(slots, row_bytes, dtype=torch.uint8, device=rows.device)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    block_h = min(1024, triton.next_power_of_2(hidden))
    _pack_kernel[(slots, triton.cdiv(hidden, block_h))](
        rows, experts.contiguous(), weights.to(torch.float32).contiguous(), owner.contiguous(), source_row, send,
        num_rows, hidden, tensor_parallel, rows.stride(0),
        row_bytes, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_H=block_h)
    return send


@triton.jit
def _combine_kernel(returned_ptr, slot_ptr, out_ptr, num_rows, hidden, num_ranks, stride_ret, stride_out,
                    BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for rank in range(0, num_ranks):
        place = tl.load(slot_ptr + row * num_ranks + rank).to(tl.int64)
        sent = place >= 0
        at = rank * num_rows + tl.where(sent, place, 0)
        acc += tl.load(returned_ptr + at * stride_ret + cols, mask=col_ok & sent, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def combine_from_destinations(returned: torch.Tensor, slot: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``returned (M * U, H)`` partial outputs in the buffers' order, ``slot (U, M)`` -> ``(U, H)``."""
    num_rows, num_ranks = slot.shape
    hidden = returned.shape[1]
    returned = returned if returned.stride(1) == 1 else returned.contiguous()
    out = torch.empty(num_rows, hidden, dtype=out_dtype, device=returned.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_rows, triton.cdiv(hidden, block_h))](
        returned, slot.contiguous(), out, num_rows, hidden, num_ranks, returned.stride(0), out.stride(0),
        BLOCK_H=block_h)
    return out
