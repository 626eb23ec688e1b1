"""The device side of the one-launch decode (:mod:`~nxd_moe.triton_kernels.persistent_decode` plans and launches
it): :func:`decode_kernel`, a persistent kernel whose programs take the whole MoE layer's expert work as work items
from one atomic counter, in a fixed global order:

1. router items (only when the router is fused in,
   :func:`~nxd_moe.triton_kernels.persistent_decode.moe_decode`): fp32 logits of every token for a slice of experts
   and of ``H``, written as partial sums;
2. one routing item: the logits summed (fixed order), top-k, affinities (softmax / sigmoid, over all experts or
   the chosen ones), padding, L1 normalisation -- the router's and
   :func:`~nxd_moe.experts.routing_inputs.build_routing`'s outputs -- then the tile layout: the valid pairs sorted
   by expert in ``BLOCK_M``-row tiles (the same :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout` the
   multi-kernel path builds), padding pairs in no tile;
3. shared-expert gate/up items (they need nothing from the routing, so they run while it is computed);
4. routed gate/up items ``(tile, column slice)``, 5. shared-expert down items, 6. routed down items ``(tile,
   column slice, K split)``, 7. combine items ``(token, column slice)``.

An item waits (spinning on a counter) only for items earlier in the order -- a down item for its tile's gate/up
items, a combine item for every down item -- and items are handed out in that order, so everything waited for is
already held by a running program: no deadlock, whatever the number of programs that fit on the GPU. The tile
bodies are the multi-kernel path's own (:func:`~nxd_moe.triton_kernels.grouped_gemm.gate_up_tile`,
``down_tile``, :func:`~nxd_moe.triton_kernels.combine.combine_token`), so both paths compute the same function;
the combine sums in a fixed order (no atomics on outputs: bitwise reproducible). Counters live in a small
per-device buffer that the last program out resets, so the next launch -- or the next replay of a captured CUDA
graph -- starts from zero; shapes are static and nothing is read on the host.

Small decodes (launch config ``pair_tiles``; the rule's choice at ``T = 1``) skip the sort: tile ``p`` is pair
``p`` -- its one row the token ``p // k`` (static, written once with the scratch), its expert the routing's own
``expert_index[p]`` -- so gate/up items wait only for the routing items (not at all through the seam) and the
layout item merely marks which pairs are real, for the combine. A token's k experts are distinct, so at ``T = 1``
no weight is read twice. ``router_chunk`` (``H`` per router item) spreads the fused router's weight read over more
items. ``down_prefetch`` adds items right after the routed gate/up items, as many as programs the gate/up items
leave idle, that ask L2 for equal slices of the tiles' experts' down weights (at most half the L2) without waiting
for them, so the down items read L2 instead of HBM; nothing waits for them and they write nothing.

``fused_mlp`` merges the routed gate/up and down items: item ``(tile, column slice j)`` computes its ``GU_N``
activated columns and then, at once, their share of the down projection for the whole of ``H`` -- the partial sums
over intermediate slice ``j`` (K split ``j``, fp32), summed by the combine in order. No item waits between gate/up
and down, every program streams gate/up and then down weights from its first microsecond, and at ``T = 1`` one
wave of items reads the chosen experts once (issue 37's "split the active experts' rows and down K across every
SM"). Unquantized weights only. Fused items of pair tiles with the router fused in do not wait for the routing item
either: each finds its pair's expert from the router items' partial logits itself (:func:`_pair_expert`, the routing
item's sums and order, so the same expert) and starts streaming as soon as the router items are done; the routing
item still writes the layer's routing outputs, which only the combine reads.

Triton's interpreter runs programs one after another; the first takes every item in order, so the same kernel
runs (and is tested) on a CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nxd_moe.triton_kernels.combine import combine_token
from nxd_moe.triton_kernels.grouped_gemm import down_tile, gate_up_tile, tile_rows
from nxd_moe.triton_kernels.router import activation, order_bits, top_k_rounds
from nxd_moe.triton_kernels.tile_math import tile_dot

# The synchronisation buffer (int32). Each global counter has its own 128-byte line, each tile counter its own
# 32-byte sector: polled words never share a sector with the item queue's counter.
NEXT_ITEM = tl.constexpr(0)
ROUTER_DONE = tl.constexpr(32)
LAYOUT_READY = tl.constexpr(64)
DOWN_DONE = tl.constexpr(96)
FINISHED = tl.constexpr(128)
NUM_TILES = tl.constexpr(160)
TIMED_OUT = tl.constexpr(192)
ROUTE_DONE = tl.constexpr(224)
TILE_COUNTERS = tl.constexpr(256)
TILE_STRIDE = tl.constexpr(8)
# Polls (each one L2 read after a short sleep) before a wait gives up and flags TIMED_OUT: seconds, far beyond any
# real wait, so that a bug shows up as a flagged wrong result instead of a hung GPU.
MAX_SPINS = tl.constexpr(1 << 22)
# Lines of weights one down-prefetch step asks L2 for (8 per thread at 4 warps).
PREFETCH_LANES = tl.constexpr(1024)


@triton.jit
def _now(like, INTERPRET: tl.constexpr):
    """The GPU's global nanosecond timer (0 under the interpreter); ``like``: any scalar, orders the read."""
    if INTERPRET:
        return like.to(tl.int64) * 0
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _pause(like, INTERPRET: tl.constexpr):
    """A short sleep between polls, so that spinning programs leave L2 to the ones doing work."""
    if INTERPRET:
        return like
    return tl.inline_asm_elementwise("nanosleep.u32 100;\nmov.b32 $0, $1;", "=r,r", [like], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _wait_at_least(sync_ptr, slot, target, INTERPRET: tl.constexpr):
    """Poll counter ``slot`` until it reaches ``target``; then one acquire read, which orders this program's later
    reads after everything the signalling items wrote before their release increments."""
    seen = tl.load(sync_ptr + slot, volatile=True)
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.load(sync_ptr + slot + _pause(spins, INTERPRET) * 0, volatile=True)
        spins += 1
    seen = tl.atomic_add(sync_ptr + slot, 0, sem="acquire")
    if seen < target:
        tl.atomic_xchg(sync_ptr + TIMED_OUT, 1)


@triton.jit
def _signal(sync_ptr, slot):
    """Count one finished item on ``slot``: every thread's stores first (barrier), then a release increment."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + slot, 1, sem="release")


@triton.jit
def _prefetch_down(piece, w_ptr, tile_expert_ptr, tiles, stride_e, PIECES: tl.constexpr, SLAB_LINES: tl.constexpr,
                   LINE: tl.constexpr, CAP_LINES: tl.constexpr, INTERPRET: tl.constexpr):
    """Ask L2 to fetch, and keep (``evict_last``), piece ``piece`` of ``PIECES`` equal slices of the down weights
    of tiles ``0 .. tiles`` -- each tile's expert's ``SLAB_LINES`` lines of ``LINE`` elements from ``w_ptr + expert
    * stride_e``, in tile order, at most ``CAP_LINES`` lines in all -- without waiting for them: the down items that
    read them later hit L2. Under the interpreter the lines' first elements are read and dropped (nothing to
    prefetch into; the addresses are still exercised)."""
    total = tl.minimum(tiles * SLAB_LINES, CAP_LINES)
    per_piece = (total + PIECES - 1) // PIECES
    begin = piece * per_piece
    end = tl.minimum(begin + per_piece, total)
    for first in range(begin, end, PREFETCH_LANES):
        lines = first + tl.arange(0, PREFETCH_LANES)
        ok = lines < end
        expert = tl.load(tile_expert_ptr + lines // SLAB_LINES, mask=ok, other=0, cache_modifier=".cg")
        at = w_ptr + tl.where(ok, expert.to(tl.int64) * stride_e + (lines % SLAB_LINES).to(tl.int64) * LINE, 0)
        if INTERPRET:
            tl.load(at, mask=ok)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\nmov.u32 $0, 0;", "=r,l", [at],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _slice_down(rows, row_ok, expert, part, act_ptr, w_ptr, bias_ptr, y_ptr, num_rows, inter, hidden, stride_we,
                stride_wk, stride_wn, stride_be, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y[part, rows] = act[rows, part's BLOCK_K columns] @ W[expert, those rows, :]`` (+ the down bias in part 0)
    for every column of ``H``: the down projection's partial sums over one slice of the intermediate dimension, the
    second half of a ``FUSED_MLP`` item (which has just stored that slice of ``act (R, I)`` for ``rows``). The slice
    is read past L1 (``.cg``): a line of it may have been cached there by an earlier item of a neighbouring slice."""
    ks = part * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < inter
    a = tl.load(act_ptr + rows[:, None] * inter + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                cache_modifier=".cg")
    lanes = tl.arange(0, BLOCK_N)
    w_ptrs = w_ptr + expert * stride_we + ks[:, None] * stride_wk + lanes[None, :] * stride_wn
    y_ptrs = y_ptr + part * num_rows * hidden + rows[:, None] * hidden + lanes[None, :]
    for column in range(0, tl.cdiv(hidden, BLOCK_N)):
        col_ok = column * BLOCK_N + lanes < hidden
        w = tl.load(w_ptrs + column * BLOCK_N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tile_dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, INTERPRET)
        if HAS_BIAS:
            if part == 0:
                acc += tl.load(bias_ptr + expert * stride_be + column * BLOCK_N + lanes, mask=col_ok,
                               other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs + column * BLOCK_N, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _router_part(item, x_ptr, w_ptr, part_ptr, num_tokens, stride_xt, hidden: tl.constexpr,
                 num_experts: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                 CHUNK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """``part[c, t, e] = sum over h in chunk c of x[t, h] * W[e, h]`` for one slice of experts: the router's fp32
    ``F.linear``, with fp32 accuracy from three TF32 tensor-core products (``tf32x3``). ``W`` rows are read along
    ``H``, as stored."""
    expert_blocks = tl.cdiv(num_experts, BLOCK_E)
    chunk = item // expert_blocks
    experts = (item % expert_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    expert_ok = experts < num_experts
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    # Unrolled: the chunk's loads are all in flight at once (a loop here ran one load latency per step).
    for step in tl.static_range(CHUNK_H // BLOCK_H):
        hs = chunk * CHUNK_H + step * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + hs[None, :], mask=token_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None] * hidden + hs[None, :], mask=expert_ok[:, None] & h_ok[None, :],
                    other=0.0)
        if INTERPRET:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")
    tl.store(part_ptr + (chunk * num_tokens + tokens[:, None]) * num_experts + experts[None, :], acc,
             mask=token_ok[:, None] & expert_ok[None, :])


@triton.jit
def _pair_expert(pair, part_ptr, bias_ptr, num_tokens, num_experts: tl.constexpr, top_k: tl.constexpr,
                 NUM_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr):
    """The expert of ``pair`` (token ``pair // k``, its ``pair % k``-th choice) from the router items' partial
    logits, without waiting for the routing item: the logits summed as :func:`_route` sums them (the same terms in
    the same order, so the same fp32 values) and ranked by :func:`top_k_rounds`' order (larger logit first, ties to
    the lower expert), so it is the ``expert_index[pair]`` that item writes. The rank of each expert is the count of
    experts ahead of it: one ``(E, E)`` comparison instead of k dependent rounds."""
    token = pair // top_k
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    at = token * num_experts + experts
    logits = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for part in tl.static_range(NUM_PARTS):
        logits += tl.load(part_ptr + part * num_tokens * num_experts + at, mask=expert_ok, other=0.0,
                          cache_modifier=".cg")
    if HAS_BIAS:
        logits += tl.load(bias_ptr + experts, mask=expert_ok, other=0.0)
    bits = order_bits(logits)
    mine, theirs = bits[:, None], bits[None, :]
    ahead = ((theirs > mine) | ((theirs == mine) & (experts[None, :] < experts[:, None]))) & expert_ok[None, :]
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    return tl.sum(tl.where(expert_ok & (rank == pair % top_k), experts, 0), axis=0)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _route(t0, part_ptr, bias_ptr, padding_ptr, logits_ptr, index_ptr, mask_ptr, affinity_ptr, num_tokens,
           num_experts: tl.constexpr, top_k: tl.constexpr, NUM_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_PADDING: tl.constexpr, SIGMOID: tl.constexpr, ACT_OVER_TOPK: tl.constexpr, NORMALIZE: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """The router's output and :func:`~nxd_moe.experts.routing_inputs.build_routing` for tokens ``t0 ..
    t0 + BLOCK_T``: logits ``(T, E)``, ``expert_index (T, k)`` (largest logit first; ties to the lower expert), the
    k-hot mask and the affinities (activation over all experts or only the chosen ones, zeroed off the mask,
    L1-normalised)."""
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    tokens = t0 + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    ok = token_ok[:, None] & expert_ok[None, :]
    at = tokens[:, None] * num_experts + experts[None, :]
    logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for part in tl.static_range(NUM_PARTS):  # unrolled: the part loads are issued together
        logits += tl.load(part_ptr + part * num_tokens * num_experts + at, mask=ok, other=0.0,
                          cache_modifier=".cg")
    if HAS_BIAS:
        logits += tl.load(bias_ptr + experts, mask=expert_ok, other=0.0)[None, :]
    tl.store(logits_ptr + at, logits, mask=ok)
    chosen = top_k_rounds(logits, experts, expert_ok, index_ptr, tokens, token_ok, num_experts, top_k)
    if ACT_OVER_TOPK:
        affinity = activation(logits, chosen, SIGMOID)
    else:
        affinity = activation(logits, ok, SIGMOID)
    if HAS_PADDING:
        chosen = chosen & (tl.load(padding_ptr + tokens, mask=token_ok, other=0) != 0)[:, None]
    affinity = tl.where(chosen, affinity, 0.0)
    if NORMALIZE:
        norm = tl.sum(tl.abs(affinity), axis=1)
        affinity = affinity / tl.maximum(norm, 1e-12)[:, None]
    tl.store(mask_ptr + at, chosen.to(tl.uint8), mask=ok)
    tl.store(affinity_ptr + at, affinity, mask=ok)


@triton.jit
def _real_pairs(index_ptr, mask_ptr, num_pairs, top_k: tl.constexpr, num_experts: tl.constexpr,
                BLOCK_P: tl.constexpr):
    """``(pairs, in_range, expert, real)`` of the ``(T, k)`` pairs: ``real`` where the routing's mask keeps the pair
    (not a padding token's, not dropped)."""
    pairs = tl.arange(0, BLOCK_P)
    in_range = pairs < num_pairs
    expert = tl.load(index_ptr + pairs, mask=in_range, other=0, cache_modifier=".cg").to(tl.int32)
    token = pairs // top_k
    real = in_range & (tl.load(mask_ptr + token * num_experts + expert, mask=in_range, other=0,
                               cache_modifier=".cg") != 0)
    return pairs, in_range, expert, real


@triton.jit
def _pair_layout(index_ptr, mask_ptr, pair_row_ptr, sync_ptr, num_pairs, num_rows, top_k: tl.constexpr,
                 num_experts: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The layout of pair tiles (tile ``p`` is pair ``p``, its one row ``p * BLOCK_M``; see ``pair_row_tokens``):
    only which pairs are real follows the routing, so only the combine waits for this."""
    pairs, in_range, _, real = _real_pairs(index_ptr, mask_ptr, num_pairs, top_k, num_experts, BLOCK_P)
    tl.store(pair_row_ptr + pairs, tl.where(real, pairs * BLOCK_M, num_rows).to(tl.int64), mask=in_range)
    tl.store(sync_ptr + NUM_TILES, num_pairs)


@triton.jit
def _layout(index_ptr, mask_ptr, sort_ptr, row_token_ptr, tile_expert_ptr, pair_row_ptr, sync_ptr,
            num_pairs, num_rows, top_k: tl.constexpr, num_experts: tl.constexpr, BLOCK_P: tl.constexpr,
            BLOCK_M: tl.constexpr):
    """The :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout` of the valid pairs, in one program: pairs
    sorted by (expert, pair), each expert's run cut into ``BLOCK_M``-row tiles, packed; ``row_token = -1`` on
    padding rows; ``pair_row = num_rows`` for pairs without a row; the tile count in the ``NUM_TILES`` slot."""
    for r0 in range(0, num_rows, BLOCK_P):
        rows = r0 + tl.arange(0, BLOCK_P)
        tl.store(row_token_ptr + rows, tl.full((BLOCK_P,), -1, tl.int64), mask=rows < num_rows)
    pairs, in_range, expert, real = _real_pairs(index_ptr, mask_ptr, num_pairs, top_k, num_experts, BLOCK_P)
    key = tl.sort(tl.where(real, expert, num_experts) * BLOCK_P + pairs)
    tl.store(sort_ptr + pairs, key)
    tl.debug_barrier()
    previous = tl.load(sort_ptr + pairs - 1, mask=pairs > 0, other=-1, cache_modifier=".cg")
    sorted_expert = key // BLOCK_P
    sorted_pair = key % BLOCK_P
    sorted_real = sorted_expert < num_experts
    first = (pairs == 0) | (previous // BLOCK_P != sorted_expert)
    rank = pairs - tl.associative_scan(tl.where(first, pairs, 0), 0, _max_combine)
    new_tile = sorted_real & (rank % BLOCK_M == 0)
    tile = tl.cumsum(new_tile.to(tl.int32), axis=0) - 1
    row = tile * BLOCK_M + rank % BLOCK_M
    tl.store(row_token_ptr + row, (sorted_pair // top_k).to(tl.int64), mask=sorted_real)
    tl.store(pair_row_ptr + sorted_pair, tl.where(sorted_real, row, num_rows).to(tl.int64),
             mask=sorted_pair < num_pairs)
    tl.store(tile_expert_ptr + tile, sorted_expert, mask=new_tile)
    tl.store(sync_ptr + NUM_TILES, tl.sum(new_tile.to(tl.int32), axis=0))


@triton.jit
def decode_kernel(
    x_ptr, index_ptr, mask_ptr, affinity_ptr, padding_ptr, logits_ptr, addend_ptr, out_ptr,
    router_w_ptr, router_b_ptr, gu_ptr, gu_scale_ptr, gu_bias_ptr, dn_ptr, dn_scale_ptr, dn_bias_ptr,
    sh_gate_ptr, sh_up_ptr, sh_down_ptr,
    part_ptr, sort_ptr, row_token_ptr, tile_expert_ptr, pair_row_ptr, act_ptr, y_ptr, sh_act_ptr, sh_y_ptr, sync_ptr,
    trace_ptr, num_tokens, num_rows, max_items, max_tile_count, num_programs,
    hidden: tl.constexpr, inter: tl.constexpr, inter_actual: tl.constexpr, shared_inter: tl.constexpr,
    num_experts: tl.constexpr, top_k: tl.constexpr, k_per_split: tl.constexpr, split: tl.constexpr,
    num_router_items: tl.constexpr,
    s_gu_e: tl.constexpr, s_gu_k: tl.constexpr, s_gu_n: tl.constexpr, s_gus_e: tl.constexpr, s_gus_k: tl.constexpr,
    s_gus_n: tl.constexpr, s_gub_e: tl.constexpr, s_dn_e: tl.constexpr, s_dn_k: tl.constexpr, s_dn_n: tl.constexpr,
    s_dns_e: tl.constexpr, s_dns_k: tl.constexpr, s_dns_n: tl.constexpr, s_dnb_e: tl.constexpr,
    s_shg_k: tl.constexpr, s_shg_n: tl.constexpr, s_shd_k: tl.constexpr, s_shd_n: tl.constexpr,
    scaling: tl.constexpr, act_bias: tl.constexpr, gate_lower: tl.constexpr, gate_upper: tl.constexpr,
    up_lower: tl.constexpr, up_upper: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, FORMAT: tl.constexpr, DOWN_BIAS: tl.constexpr, ROUTER: tl.constexpr,
    ROUTER_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    ACT_OVER_TOPK: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_PADDING: tl.constexpr, SHARED: tl.constexpr, SHARED_ACT: tl.constexpr,
    HAS_ADDEND: tl.constexpr, TRACE: tl.constexpr, PAIR_TILES: tl.constexpr, FUSED_MLP: tl.constexpr,
    DOWN_PREFETCH: tl.constexpr,
    PREFETCH_ITEMS: tl.constexpr, SLAB_LINES: tl.constexpr, LINE: tl.constexpr, CAP_LINES: tl.constexpr,
    BLOCK_M: tl.constexpr, GU_N: tl.constexpr, GU_K: tl.constexpr, DN_N: tl.constexpr, DN_K: tl.constexpr,
    ROUTE_T: tl.constexpr, ROUTE_E: tl.constexpr, ROUTE_H: tl.constexpr, ROUTE_CHUNK: tl.constexpr,
    ROUTE_PARTS: tl.constexpr, ROUTE_TOKENS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr, COMBINE_P: tl.constexpr, COMBINE_H: tl.constexpr,
):
    gu_cols = (inter + GU_N - 1) // GU_N
    dn_cols = (hidden + DN_N - 1) // DN_N
    if SHARED:
        shared_tiles = (num_tokens + BLOCK_M - 1) // BLOCK_M
        shared_gu_cols = (shared_inter + GU_N - 1) // GU_N
    else:
        shared_tiles = num_tokens * 0
        shared_gu_cols = 1
    shared_dn = shared_tiles * dn_cols
    combine_cols = (hidden + COMBINE_H - 1) // COMBINE_H
    if ROUTER:
        route_items = (num_tokens + ROUTE_TOKENS - 1) // ROUTE_TOKENS
    else:
        route_items = num_tokens * 0
    layout_item = num_router_items + route_items
    first_routed = layout_item + 1 + shared_tiles * shared_gu_cols
    if PAIR_TILES:  # tile p is pair p: its expert is the routing's own index, no tile layout to wait for
        tile_expert = index_ptr
    else:
        tile_expert = tile_expert_ptr
    # Fused items of pair tiles find their expert themselves (nothing else of theirs reads the routing's outputs:
    # the down half is in the same item; pre-scaling would need the affinity; E > 128 would need a larger rank).
    SELF_ROUTED: tl.constexpr = FUSED_MLP and PAIR_TILES and ROUTER and not PRESCALE and BLOCK_E <= 128
    item = tl.atomic_add(sync_ptr + NEXT_ITEM, 1)
    running = item < max_items
    while running:
        fetched = _now(item, INTERPRET)
        tiles = item * 0
        if item >= first_routed:
            if PAIR_TILES:
                tiles = num_tokens * top_k
            else:
                _wait_at_least(sync_ptr, LAYOUT_READY, 1, INTERPRET)
                tiles = tl.load(sync_ptr + NUM_TILES, volatile=True)
        routed_gu = tiles * gu_cols
        if FUSED_MLP:  # a routed item's down partial sums are its own: no down items, one signal per item
            routed_dn = tiles * 0
            down_signals = routed_gu + shared_dn
        else:
            routed_dn = tiles * dn_cols * split
            down_signals = routed_dn + shared_dn
        first_down = routed_gu  # the down-prefetch items, if any, come between
        if DOWN_PREFETCH:
            first_down = routed_gu + PREFETCH_ITEMS
        if item < first_routed + first_down + shared_dn + routed_dn + num_tokens * combine_cols:
            started = fetched
            if item < num_router_items:
                kind = 0
                if ROUTER:
                    _router_part(item, x_ptr, router_w_ptr, part_ptr, num_tokens, hidden, hidden, num_experts,
                                 ROUTE_T, ROUTE_E, ROUTE_H, ROUTE_CHUNK, INTERPRET)
                    _signal(sync_ptr, ROUTER_DONE)
            elif item < layout_item:
                kind = 7
                if ROUTER:
                    _wait_at_least(sync_ptr, ROUTER_DONE, num_router_items, INTERPRET)
                    started = _now(item, INTERPRET)
                    _route((item - num_router_items) * ROUTE_TOKENS, part_ptr, router_b_ptr, padding_ptr,
                           logits_ptr, index_ptr, mask_ptr, affinity_ptr, num_tokens, num_experts, top_k,
                           ROUTE_PARTS, ROUTER_BIAS, HAS_PADDING, SIGMOID, ACT_OVER_TOPK, NORMALIZE, ROUTE_TOKENS,
                           BLOCK_E)
                    _signal(sync_ptr, ROUTE_DONE)
            elif item == layout_item:
                kind = 1
                if ROUTER:
                    _wait_at_least(sync_ptr, ROUTE_DONE, route_items, INTERPRET)
                    started = _now(item, INTERPRET)
                if PAIR_TILES:
                    _pair_layout(index_ptr, mask_ptr, pair_row_ptr, sync_ptr, num_tokens * top_k, num_rows, top_k,
                                 num_experts, BLOCK_P, BLOCK_M)
                else:
                    _layout(index_ptr, mask_ptr, sort_ptr, row_token_ptr, tile_expert_ptr, pair_row_ptr, sync_ptr,
                            num_tokens * top_k, num_rows, top_k, num_experts, BLOCK_P, BLOCK_M)
                _signal(sync_ptr, LAYOUT_READY)
            elif item < first_routed:
                # (only with SHARED: otherwise first_routed is the layout item's successor)
                kind = 2
                j = item - layout_item - 1
                tile = j // shared_gu_cols
                rows, token, row_ok, expert = tile_rows(tile, row_token_ptr, tile_expert_ptr, num_tokens, BLOCK_M,
                                                        True)
                gate_up_tile(rows, token, row_ok, expert, j % shared_gu_cols, x_ptr, sh_gate_ptr, sh_up_ptr,
                             sh_gate_ptr, sh_gate_ptr, sh_gate_ptr, affinity_ptr, sh_act_ptr, hidden, shared_inter,
                             shared_inter, num_experts, hidden, 0, s_shg_k, s_shg_n, 0, 0, 0, 0, shared_inter, 1.0,
                             0.0, 0.0, 0.0, 0.0, 0.0, SHARED_ACT, True, False, False, False, False, False, False,
                             False, False, PRECISION, INTERPRET, False, 0, BLOCK_M, GU_N, GU_K, False)
                _signal(sync_ptr, TILE_COUNTERS + (max_tile_count + tile) * TILE_STRIDE)
            else:
                j = item - first_routed
                if j < routed_gu:
                    kind = 3
                    tile = j // gu_cols
                    if SELF_ROUTED:  # the pair's expert from the router items' logits, as the routing item finds it
                        _wait_at_least(sync_ptr, ROUTER_DONE, num_router_items, INTERPRET)
                        started = _now(item, INTERPRET)
                        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
                        token = tl.load(row_token_ptr + rows)  # static: pair tiles' one row, written with the scratch
                        row_ok = token >= 0
                        token = tl.where(row_ok, token, 0)
                        expert = _pair_expert(tile, part_ptr, router_b_ptr, num_tokens, num_experts, top_k,
                                              ROUTE_PARTS, ROUTER_BIAS, BLOCK_E).to(tl.int64)
                    else:
                        if PAIR_TILES and ROUTER:  # the pair's expert (and affinity) from the routing items
                            _wait_at_least(sync_ptr, ROUTE_DONE, route_items, INTERPRET)
                            started = _now(item, INTERPRET)
                        rows, token, row_ok, expert = tile_rows(tile, row_token_ptr, tile_expert, 0, BLOCK_M, False)
                    gu_up_ptr = gu_ptr + inter * s_gu_n  # interleaved weights read both halves from gu_ptr
                    gate_up_tile(rows, token, row_ok, expert, j % gu_cols, x_ptr, gu_ptr, gu_up_ptr, gu_ptr,
                                 gu_scale_ptr, gu_bias_ptr, affinity_ptr, act_ptr, hidden, inter, inter_actual,
                                 num_experts, hidden, s_gu_e, s_gu_k, s_gu_n, s_gus_e, s_gus_k, s_gus_n, s_gub_e, inter,
                                 scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU,
                                 HAS_BIAS, PRESCALE, GATE_LOWER, GATE_UPPER, UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS,
                                 PRECISION, INTERPRET, False, FORMAT, BLOCK_M, GU_N, GU_K, GATE_UP_INTERLEAVED)
                    if FUSED_MLP:
                        kind = 9
                        tl.debug_barrier()  # the activated slice, stored by every thread, read back by all
                        _slice_down(rows, row_ok, expert, j % gu_cols, act_ptr, dn_ptr, dn_bias_ptr, y_ptr, num_rows,
                                    inter, hidden, s_dn_e, s_dn_k, s_dn_n, s_dnb_e, DOWN_BIAS, PRECISION, INTERPRET,
                                    BLOCK_M, GU_N, DN_N)
                        _signal(sync_ptr, DOWN_DONE)
                    else:
                        _signal(sync_ptr, TILE_COUNTERS + tile * TILE_STRIDE)
                elif j < first_down:  # (only with DOWN_PREFETCH)
                    kind = 8
                    if DOWN_PREFETCH:
                        if PAIR_TILES and ROUTER:
                            _wait_at_least(sync_ptr, ROUTE_DONE, route_items, INTERPRET)
                            started = _now(item, INTERPRET)
                        _prefetch_down(j - routed_gu, dn_ptr, tile_expert, tiles, s_dn_e, PREFETCH_ITEMS, SLAB_LINES,
                                       LINE, CAP_LINES, INTERPRET)
                elif j < first_down + shared_dn:
                    kind = 4
                    j -= first_down
                    tile = j // dn_cols
                    _wait_at_least(sync_ptr, TILE_COUNTERS + (max_tile_count + tile) * TILE_STRIDE, shared_gu_cols,
                                   INTERPRET)
                    started = _now(item, INTERPRET)
                    down_tile(tile, j % dn_cols, 0, sh_act_ptr, sh_down_ptr, sh_down_ptr, sh_down_ptr,
                               sh_down_ptr, sh_y_ptr, row_token_ptr, tile_expert_ptr, num_tokens, shared_inter,
                               hidden, shared_inter, shared_inter, 0, s_shd_k, s_shd_n, 0, 0, 0, 0, 0, hidden,
                               False, PRECISION, INTERPRET, False, 0, BLOCK_M, DN_N, DN_K, True)
                    _signal(sync_ptr, DOWN_DONE)
                elif j < first_down + shared_dn + routed_dn:
                    kind = 5
                    j -= first_down + shared_dn
                    part = j // split
                    tile = part // dn_cols
                    _wait_at_least(sync_ptr, TILE_COUNTERS + tile * TILE_STRIDE, gu_cols, INTERPRET)
                    started = _now(item, INTERPRET)
                    down_tile(tile, part % dn_cols, j % split, act_ptr, dn_ptr, dn_ptr, dn_scale_ptr, dn_bias_ptr,
                               y_ptr, row_token_ptr, tile_expert, 0, inter, hidden, k_per_split, inter,
                               s_dn_e, s_dn_k, s_dn_n, s_dns_e, s_dns_k, s_dns_n, s_dnb_e, num_rows * hidden,
                               hidden, DOWN_BIAS, PRECISION, INTERPRET, False, FORMAT, BLOCK_M, DN_N, DN_K, False)
                    _signal(sync_ptr, DOWN_DONE)
                else:
                    kind = 6
                    j -= first_down + shared_dn + routed_dn
                    if PAIR_TILES:  # which pairs are real (pair_row)
                        _wait_at_least(sync_ptr, LAYOUT_READY, 1, INTERPRET)
                    _wait_at_least(sync_ptr, DOWN_DONE, down_signals, INTERPRET)
                    started = _now(item, INTERPRET)
                    combine_token(j // combine_cols, j % combine_cols, y_ptr, pair_row_ptr, index_ptr,
                                   affinity_ptr, addend_ptr, out_ptr, num_rows, hidden, top_k, num_experts,
                                   num_rows * hidden, hidden, top_k, top_k, 1, hidden, hidden, split, PRESCALE,
                                   HAS_ADDEND, COMBINE_P, COMBINE_H)
            if TRACE:
                at = trace_ptr + item.to(tl.int64) * 4
                tl.store(at, fetched)
                tl.store(at + 1, started)
                tl.store(at + 2, _now(item, INTERPRET))
                tl.store(at + 3, tl.program_id(0).to(tl.int64) * 16 + kind)
            item = tl.atomic_add(sync_ptr + NEXT_ITEM, 1)
            running = item < max_items
        else:
            running = False
    # The last program out resets the counters it used (all others are done with them) for the next launch.
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + FINISHED, 1, sem="acq_rel") == num_programs - 1:
        lanes = tl.arange(0, 1024)
        used = tl.load(sync_ptr + NUM_TILES, volatile=True)
        for t0 in range(0, used, 1024):
            tl.store(sync_ptr + TILE_COUNTERS + (t0 + lanes) * TILE_STRIDE, 0, mask=t0 + lanes < used)
        for t0 in range(0, shared_tiles, 1024):
            tl.store(sync_ptr + TILE_COUNTERS + (max_tile_count + t0 + lanes) * TILE_STRIDE, 0,
                     mask=t0 + lanes < shared_tiles)
        for slot in tl.static_range(0, 192, 32):  # NEXT_ITEM .. NUM_TILES; TIMED_OUT stays set
            tl.store(sync_ptr + slot, 0)
        tl.store(sync_ptr + ROUTE_DONE, 0)
