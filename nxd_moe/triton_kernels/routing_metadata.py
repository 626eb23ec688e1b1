"""Routing metadata on the device in two kernels: per-expert counts, then every layout the experts need.

From ``expert_index (T, k)`` and ``expert_mask (T, E)`` (a pair is real when its token is not padding) the
second kernel writes, with no host sync and no data-dependent shape (so one CUDA graph serves any routing):

- NxD's :class:`~nxd_moe.experts.token_mapping.BlockMapping` for block size ``B`` -- ``block_to_expert``,
  ``token_position_to_id`` (``-1`` padding), ``conditions``, ``token_slot`` -- identical to the torch
  implementation (a token's rank inside its expert is its token order);
- the GPU tiling of the same assignment, :class:`TileLayout`: each expert's pairs in ``BLOCK_M``-row tiles,
  experts in order, packed without empty tiles in between, and the number of tiles in use as a device scalar.
  The tiles, not the blocks, are what the GEMMs iterate over, so ``B`` (a Trainium tuning knob) never costs
  GPU work: empty blocks and the empty tail of a block are simply not in the tile list.

The pairs are cut in chunks; the first kernel counts each expert's pairs per chunk (and in total), the second
runs one program per (expert, chunk) -- each knows from those counts where its expert's blocks and tiles start
and how many of its pairs come before the chunk -- plus a row of programs for padded pairs and the unused tail.
``E * T * k`` comparisons in all, spread over ``E * chunks`` programs. The layout is deterministic: the only
atomics are integer additions of the totals.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nxd_moe.experts.token_mapping import BlockMapping

# Pairs one program scans. 4096 compiled to 255 registers with spills on sm_90 (a 4096-wide int64 scan on 4
# warps); 1024 to 77 and no spills, with four times the programs to hide the latency (H100 times of both:
# benchmarks/gpu_prefill.py --layout-chunks).
PAIR_CHUNK = 1024
# Up to this many (expert, pair) comparisons, the layout kernel counts by itself (one launch instead of two).
COUNT_HERE_ELEMENTS = 32768


class TileLayout(NamedTuple):
    """The GPU kernels' view of one routing: rows grouped in ``block_m``-row tiles of one expert.

    - ``row_token (R,)`` int64: token of each row, ``-1`` for padding rows (never loaded);
    - ``tile_expert (R / block_m,)`` int32: expert of each tile (only the first ``num_tiles`` are meaningful);
    - ``num_tiles (1,)`` int32: tiles in use, on the device (kernels past it exit at once);
    - ``pair_row (T, k')`` int64: the row of each (token, pair), ``R`` for pairs that have none.
    """

    row_token: torch.Tensor
    tile_expert: torch.Tensor
    num_tiles: torch.Tensor
    pair_row: torch.Tensor
    block_m: int

    @property
    def num_rows(self) -> int:
        return self.row_token.shape[0]


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case tiles: every expert used has one partial tile, ``ceil(P / block_m) + min(E, P)``."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


@triton.jit
def _count_kernel(expert_index_ptr, expert_mask_ptr, partial_ptr, counts_ptr, num_pairs, top_k, num_experts,
                  num_chunks, CHUNK: tl.constexpr):
    """Program ``(e, c)``: real pairs of expert ``e`` in chunk ``c`` -> ``partial[e, c]``, added into
    ``counts[e]`` (an integer sum: the same whatever order the programs run in)."""
    expert = tl.program_id(0)
    chunk = tl.program_id(1)
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = pair < num_pairs
    chosen = tl.load(expert_index_ptr + pair, mask=in_range, other=-1)
    real = tl.load(expert_mask_ptr + (pair // top_k) * num_experts + chosen, mask=in_range & (chosen == expert),
                   other=0)
    found = tl.sum(real.to(tl.int64), axis=0)
    tl.store(partial_ptr + expert * num_chunks + chunk, found)
    tl.atomic_add(counts_ptr + expert, found)


@triton.jit
def _expert_chunk_layout(expert, chunk, rank_base, block_start, tile_start, expert_index_ptr, expert_mask_ptr,
                         token_position_to_id_ptr, token_slot_ptr, row_token_ptr, pair_row_ptr,
                         num_pairs, top_k, num_experts, block_size, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``(e, c)``: the slot and row of each of expert ``e``'s pairs in chunk ``c`` (rank = token order)."""
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = pair < num_pairs
    chosen = tl.load(expert_index_ptr + pair, mask=in_range, other=-1)
    token = pair // top_k
    mine = in_range & (chosen == expert)
    mine = mine & (tl.load(expert_mask_ptr + token * num_experts + chosen, mask=mine, other=0) != 0)
    rank = rank_base + tl.cumsum(mine.to(tl.int64), axis=0) - 1
    slot = block_start * block_size + rank
    row = tile_start * BLOCK_M + rank
    tl.store(token_position_to_id_ptr + slot, token.to(tl.int64), mask=mine)
    tl.store(token_slot_ptr + pair, slot, mask=mine)
    tl.store(row_token_ptr + row, token.to(tl.int64), mask=mine)
    tl.store(pair_row_ptr + pair, row, mask=mine)


@triton.jit
def _expert_padding(expert, count, block_start, tile_start, block_to_expert_ptr, token_position_to_id_ptr,
                    conditions_ptr, row_token_ptr, tile_expert_ptr, block_size, BLOCK_M: tl.constexpr,
                    CHUNK: tl.constexpr):
    """Program ``(e, 0)``: expert ``e``'s blocks and tiles, and the empty end of its last ones."""
    my_blocks = (count + block_size - 1) // block_size
    my_tiles = (count + BLOCK_M - 1) // BLOCK_M
    for start in range(count, my_blocks * block_size, CHUNK):
        empty = start + tl.arange(0, CHUNK)
        tl.store(token_position_to_id_ptr + block_start * block_size + empty, tl.full((CHUNK,), -1, tl.int64),
                 mask=empty < my_blocks * block_size)
    tile_rows = count + tl.arange(0, BLOCK_M)
    tl.store(row_token_ptr + tile_start * BLOCK_M + tile_rows, tl.full((BLOCK_M,), -1, tl.int64),
             mask=tile_rows < my_tiles * BLOCK_M)
    for start in range(0, my_blocks, CHUNK):
        blocks_here = start + tl.arange(0, CHUNK)
        keep = blocks_here < my_blocks
        tl.store(block_to_expert_ptr + block_start + blocks_here, tl.full((CHUNK,), 0, tl.int64) + expert, mask=keep)
        tl.store(conditions_ptr + block_start + blocks_here, tl.full((CHUNK,), 1, tl.int32), mask=keep)
    for start in range(0, my_tiles, CHUNK):
        tiles_here = start + tl.arange(0, CHUNK)
        tl.store(tile_expert_ptr + tile_start + tiles_here, tl.full((CHUNK,), 0, tl.int32) + expert,
                 mask=tiles_here < my_tiles)


@triton.jit
def _tail_layout(chunk, block_start, tile_start, expert_index_ptr, expert_mask_ptr, block_to_expert_ptr,
                 token_position_to_id_ptr, conditions_ptr, token_slot_ptr, num_tiles_ptr, pair_row_ptr,
                 num_pairs, top_k, num_experts, block_size, num_blocks, num_rows, CHUNK: tl.constexpr):
    """Programs ``(E, c)``: the pairs of padded tokens in chunk ``c``; ``(E, 0)`` also the blocks nobody needs
    (last expert, inactive), their slots, and the tile count."""
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = pair < num_pairs
    chosen = tl.load(expert_index_ptr + pair, mask=in_range, other=0)
    real = tl.load(expert_mask_ptr + (pair // top_k) * num_experts + chosen, mask=in_range, other=1) != 0
    padded = in_range & ~real
    num_slots = num_blocks * block_size
    tl.store(token_slot_ptr + pair, tl.full((CHUNK,), 0, tl.int64) + num_slots, mask=padded)
    tl.store(pair_row_ptr + pair, tl.full((CHUNK,), 0, tl.int64) + num_rows, mask=padded)
    if chunk == 0:
        for start in range(block_start, num_blocks, CHUNK):
            tail_blocks = start + tl.arange(0, CHUNK)
            keep = tail_blocks < num_blocks
            tl.store(block_to_expert_ptr + tail_blocks, tl.full((CHUNK,), 0, tl.int64) + num_experts - 1, mask=keep)
            tl.store(conditions_ptr + tail_blocks, tl.full((CHUNK,), 0, tl.int32), mask=keep)
        for start in range(block_start * block_size, num_slots, CHUNK):
            tail_slots = start + tl.arange(0, CHUNK)
            tl.store(token_position_to_id_ptr + tail_slots, tl.full((CHUNK,), -1, tl.int64),
                     mask=tail_slots < num_slots)
        tl.store(num_tiles_ptr, tile_start.to(tl.int32))


@triton.jit
def _layout_kernel(expert_index_ptr, expert_mask_ptr, partial_ptr, counts_ptr,
                   block_to_expert_ptr, token_position_to_id_ptr, conditions_ptr, token_slot_ptr,
                   row_token_ptr, tile_expert_ptr, num_tiles_ptr, pair_row_ptr,
                   num_pairs, top_k, num_experts, num_chunks, block_size, num_blocks, num_rows,
                   BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr,
                   COUNT_HERE: tl.constexpr):
    expert = tl.program_id(0)
    chunk = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    if COUNT_HERE:
        # One chunk (decode sizes): every program counts all experts itself, which saves a launch.
        pair = tl.arange(0, CHUNK)
        in_range = pair < num_pairs
        chosen = tl.load(expert_index_ptr + pair, mask=in_range, other=-1)
        real = tl.load(expert_mask_ptr + (pair // top_k) * num_experts + chosen, mask=in_range, other=0) != 0
        hits = (experts[:, None] == chosen[None, :]) & (real & in_range)[None, :]
        counts = tl.sum(hits.to(tl.int64), axis=1)
        if (expert < num_experts) & (chunk == 0):
            tl.store(counts_ptr + expert, tl.sum(tl.where(experts == expert, counts, 0), axis=0))
    else:
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    before = experts < expert
    block_start = tl.sum(tl.where(before, (counts + block_size - 1) // block_size, 0), axis=0)
    tile_start = tl.sum(tl.where(before, (counts + BLOCK_M - 1) // BLOCK_M, 0), axis=0)
    if expert < num_experts:
        chunks = tl.arange(0, BLOCK_C)
        rank_base = tl.sum(tl.load(partial_ptr + expert * num_chunks + chunks, mask=chunks < chunk, other=0), axis=0)
        _expert_chunk_layout(expert, chunk, rank_base, block_start, tile_start, expert_index_ptr, expert_mask_ptr,
                             token_position_to_id_ptr, token_slot_ptr, row_token_ptr, pair_row_ptr,
                             num_pairs, top_k, num_experts, block_size, BLOCK_M, CHUNK)
        if chunk == 0:
            count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
            _expert_padding(expert, count, block_start, tile_start, block_to_expert_ptr, token_position_to_id_ptr,
                            conditions_ptr, row_token_ptr, tile_expert_ptr, block_size, BLOCK_M, CHUNK)
    else:
        _tail_layout(chunk, block_start, tile_start, expert_index_ptr, expert_mask_ptr, block_to_expert_ptr,
                     token_position_to_id_ptr, conditions_ptr, token_slot_ptr, num_tiles_ptr, pair_row_ptr,
                     num_pairs, top_k, num_experts, block_size, num_blocks, num_rows, CHUNK)


def routing_layout(expert_mask: torch.Tensor, expert_index: torch.Tensor, block_size: int, num_blocks: int,
                   block_m: int, pair_chunk: int = PAIR_CHUNK) -> tuple[BlockMapping, TileLayout]:
    """``expert_mask (T, E)`` bool, ``expert_index (T, k)`` -> the NxD block mapping and the GPU tiles.

    ``block_m`` is a power of two >= 16 (the GEMMs' row tile); ``pair_chunk`` (a power of two) the pairs one
    program scans. Two launches (one at decode sizes), no host sync.
    """
    num_tokens, num_experts = expert_mask.shape
    top_k = expert_index.shape[1]
    num_pairs = num_tokens * top_k
    device = expert_mask.device
    expert_index = expert_index.contiguous()
    expert_mask = expert_mask.contiguous()
    chunk = min(pair_chunk, triton.next_power_of_2(num_pairs))
    num_chunks = triton.cdiv(num_pairs, chunk)
    block_e = triton.next_power_of_2(num_experts)
    count_here = num_chunks == 1 and block_e * chunk <= COUNT_HERE_ELEMENTS
    partial = torch.empty(num_experts, num_chunks, dtype=torch.int64, device=device)
    counts = (torch.empty if count_here else torch.zeros)(num_experts, dtype=torch.int64, device=device)
    if not count_here:
        _count_kernel[(num_experts, num_chunks)](expert_index, expert_mask, partial, counts, num_pairs, top_k,
                                                 num_experts, num_chunks, CHUNK=chunk)
    num_rows = max_tiles(num_pairs, num_experts, block_m) * block_m
    i64 = dict(dtype=torch.int64, device=device)
    block_to_expert = torch.empty(num_blocks, **i64)
    token_position_to_id = torch.empty(num_blocks * block_size, **i64)
    conditions = torch.empty(num_blocks, dtype=torch.int32, device=device)
    token_slot = torch.empty(num_tokens, top_k, **i64)
    row_token = torch.empty(num_rows, **i64)
    tile_expert = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    pair_row = torch.empty(num_tokens, top_k, **i64)
    _layout_kernel[(num_experts + 1, num_chunks)](
        expert_index, expert_mask, partial, counts, block_to_expert, token_position_to_id, conditions, token_slot,
        row_token, tile_expert, num_tiles, pair_row, num_pairs, top_k, num_experts, num_chunks, block_size,
        num_blocks, num_rows, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_C=triton.next_power_of_2(num_chunks),
        CHUNK=chunk, COUNT_HERE=count_here)
    mapping = BlockMapping(block_to_expert, token_position_to_id, conditions, token_slot, counts, block_size)
    return mapping, TileLayout(row_token, tile_expert, num_tiles, pair_row, block_m)
