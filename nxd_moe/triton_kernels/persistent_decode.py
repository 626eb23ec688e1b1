"""A decode step in one launch: a persistent kernel that runs the whole MoE layer's expert work as a queue of items.

At decode sizes (``T <= 64`` tokens, a few hundred (token, expert) pairs) the separate kernels of
:mod:`~nxd_moe.triton_kernels.backend` -- routing, metadata, gate/up, down, combine, plus a router and a shared
expert in torch -- each pay a launch and a ramp-up, which is most of the time when the whole step streams
25-700 MB of weights. Here one launch of a few programs per multiprocessor takes work items from one atomic
counter, in a fixed global order:

1. router items (only when the router is fused in, :func:`moe_decode`): fp32 logits of every token for a slice of
   experts and of ``H``, written as partial sums;
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

Triton's interpreter runs programs one after another; the first takes every item in order, so the same kernel
runs (and is tested) on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.gpu_info import multiprocessors
from nxd_moe.layer_parts import RouterParts, SharedParts
from nxd_moe.triton_kernels import in_compiled_graph_call, interpreting
from nxd_moe.triton_kernels.combine import combine_token, combine_width
from nxd_moe.triton_kernels.grouped_gemm import (
    ACTIVATIONS,
    down_tile,
    epilogue_arguments,
    gate_up_tile,
    stored_operands,
)
from nxd_moe.triton_kernels.launch_configs import l2_bytes
from nxd_moe.triton_kernels.router import activation, top_k_rounds
from nxd_moe.triton_kernels.routing_metadata import max_tiles

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
# The most (token, expert) pairs one program sorts into tiles; larger problems use the multi-kernel path.
MAX_PAIRS = 1024
# Elements of one routing chunk (tokens x experts: int64 sort keys, fp32 logits).
ROUTE_ELEMENTS = 1024
# Item types in a TRACE record.
ROUTER_ITEM, LAYOUT_ITEM, SHARED_GATE_UP, GATE_UP, SHARED_DOWN, DOWN, COMBINE, ROUTE_ITEM, DOWN_PREFETCH = range(9)
# Lines of weights one down-prefetch step asks L2 for (8 per thread at 4 warps); an L2 line is 128 bytes.
PREFETCH_LANES = tl.constexpr(1024)
L2_LINE_BYTES = 128


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
def _decode_kernel(
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
    HAS_ADDEND: tl.constexpr, TRACE: tl.constexpr, PAIR_TILES: tl.constexpr, DOWN_PREFETCH: tl.constexpr,
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
        routed_dn = tiles * dn_cols * split
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
                gate_up_tile(tile, j % shared_gu_cols, x_ptr, sh_gate_ptr, sh_up_ptr, sh_gate_ptr, sh_gate_ptr,
                              sh_gate_ptr, affinity_ptr, sh_act_ptr, row_token_ptr, tile_expert_ptr, num_tokens,
                              hidden, shared_inter, shared_inter, num_experts, hidden, 0, s_shg_k, s_shg_n,
                              0, 0, 0, 0, shared_inter, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, SHARED_ACT, True, False,
                              False, False, False, False, False, False, False, PRECISION, INTERPRET, False, 0,
                              BLOCK_M, GU_N, GU_K, True)
                _signal(sync_ptr, TILE_COUNTERS + (max_tile_count + tile) * TILE_STRIDE)
            else:
                j = item - first_routed
                if j < routed_gu:
                    kind = 3
                    tile = j // gu_cols
                    if PAIR_TILES and ROUTER:  # the pair's expert (and affinity) from the routing items
                        _wait_at_least(sync_ptr, ROUTE_DONE, route_items, INTERPRET)
                        started = _now(item, INTERPRET)
                    gu_up_ptr = gu_ptr + inter * s_gu_n  # interleaved weights read both halves from gu_ptr
                    gate_up_tile(tile, j % gu_cols, x_ptr, gu_ptr, gu_up_ptr, gu_ptr, gu_scale_ptr,
                                  gu_bias_ptr, affinity_ptr, act_ptr, row_token_ptr, tile_expert, 0,
                                  hidden, inter, inter_actual, num_experts, hidden, s_gu_e, s_gu_k, s_gu_n,
                                  s_gus_e, s_gus_k, s_gus_n, s_gub_e, inter, scaling, act_bias, gate_lower,
                                  gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER,
                                  GATE_UPPER, UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, PRECISION, INTERPRET, False,
                                  FORMAT, BLOCK_M, GU_N, GU_K, False, GATE_UP_INTERLEAVED)
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
                    _wait_at_least(sync_ptr, DOWN_DONE, routed_dn + shared_dn, INTERPRET)
                    started = _now(item, INTERPRET)
                    combine_token(j // combine_cols, j % combine_cols, y_ptr, pair_row_ptr, index_ptr,
                                   affinity_ptr, addend_ptr, out_ptr, num_rows, hidden, top_k, num_experts, split,
                                   num_rows * hidden, hidden, top_k, top_k, 1, hidden, hidden, PRESCALE,
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


def launch_multiprocessors(device: torch.device) -> int:
    """The multiprocessors a launch fills: the GPU's; one on a CPU, where Triton's interpreter runs the programs one
    after another."""
    return multiprocessors(device) if device.type == "cuda" else 1


_SYNC: dict[tuple[str, int, int], torch.Tensor] = {}


def _stream_key(device: torch.device) -> tuple[str, int, int]:
    """``(type, index, stream)`` of the stream that launches on ``device`` now. Counters and scratch are per stream:
    launches on one stream run one after another, launches on two streams may overlap (e.g. a CUDA-graph warm-up on
    a side stream while the default stream still runs an eager call) and must not share them."""
    if device.type != "cuda":
        return device.type, device.index or 0, 0
    index = torch.cuda.current_device() if device.index is None else device.index
    return device.type, index, torch.cuda.current_stream(index).cuda_stream


def _sync_buffer(device: torch.device, slots: int) -> torch.Tensor:
    """The current stream's counter buffer on ``device``: zeros, and every launch leaves it zeroed (grown on demand,
    never shrunk)."""
    key = _stream_key(device)
    buffer = _SYNC.get(key)
    if buffer is None or buffer.numel() < slots:
        buffer = torch.zeros(max(slots, 4096), dtype=torch.int32, device=device)
        _SYNC[key] = buffer
    return buffer


def counters(device: torch.device) -> torch.Tensor | None:
    """The counter buffer of the current stream on ``device`` (None before the first launch there); for tests and
    diagnostics."""
    return _SYNC.get(_stream_key(torch.device(device)))


def timed_out(device: torch.device) -> bool:
    """Whether a wait of a persistent decode launch on ``device`` (any stream) ever gave up (a bug: its result was
    wrong). Reads the device (host sync); for tests."""
    on_device = _stream_key(torch.device(device))[:2]
    return any(bool(buffer[TIMED_OUT.value]) for key, buffer in _SYNC.items() if key[:2] == on_device)


def applies(num_tokens: int, top_k: int) -> bool:
    """Whether a decode of this size runs in one launch (one program sorts all pairs into tiles)."""
    return num_tokens * top_k <= MAX_PAIRS


def pair_row_tokens(num_tokens: int, top_k: int, block_m: int, device: torch.device) -> torch.Tensor:
    """``row_token (T*k*BLOCK_M,)`` of pair tiles: tile ``p`` holds pair ``p`` (token ``p // k``) in its first row,
    the other rows are padding (-1). Static: pair tiles need no sort, so their gate/up items start streaming the
    expert's weights as soon as the pair's expert is known."""
    rows = torch.full((num_tokens * top_k, block_m), -1, dtype=torch.int64, device=device)
    rows[:, 0] = torch.arange(num_tokens * top_k, device=device) // top_k
    return rows.view(-1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# Per-call tensors, weights, scratch, then the sizes that follow T: the kernel's runtime arguments in order.
_RUNTIME = ("x", "index", "mask", "affinities", "padding", "logits", "addend", "out", "router_w", "router_b", "gu",
            "gu_scale", "gu_bias", "dn", "dn_scale", "dn_bias", "sh_gate", "sh_up", "sh_down", "part", "sort",
            "row_token", "tile_expert", "pair_row", "act", "y", "sh_act", "sh_y", "sync", "trace")


# Plans of at most this many tokens keep their scratch between launches (see ``_Plan.keeps_scratch``).
KEPT_SCRATCH_TOKENS = 64


class _Plan:
    """Everything about one launch that follows from static shapes -- grid, sizes, constexprs, scratch buffers
    (shared by all layers of that shape on one stream: launches on one stream run one after another) -- and, after
    the first launch, the compiled kernel, relaunched directly: Triton's per-call argument binding would otherwise
    be most of a decode step's host time."""

    def __init__(self, x, weights: ExpertWeights, config: dict, num_experts: int, top_k: int, prescale: bool,
                 router: RouterParts | None, shared: SharedParts | None, has_addend: bool, trace: bool):
        device, dtype = x.device, x.dtype
        num_tokens, hidden = x.shape
        block_m, gate_up, down = config["block_m"], config["gate_up"], config["down"]
        gu, gu_scale, gu_scale_strides, fmt, gu_k = stored_operands(weights.gate_up_proj, gate_up["BLOCK_K"])
        dn, dn_scale, dn_scale_strides, _, dn_k = stored_operands(weights.down_proj, down["BLOCK_K"])
        inter = weights.down_proj.shape[1]
        scalars, epilogue = epilogue_arguments(weights.activation, inter, weights.gate_up_bias is not None, prescale)
        pair_tiles = bool(config.get("pair_tiles", False))
        tile_bound = num_tokens * top_k if pair_tiles else max_tiles(num_tokens * top_k, num_experts, block_m)
        num_rows = tile_bound * block_m
        k_per_split = _cdiv(_cdiv(inter, down["SPLIT_K"]), dn_k) * dn_k
        split = _cdiv(inter, k_per_split)
        gu_n, dn_n = gate_up["BLOCK_N"], down["BLOCK_N"]
        shared_inter = shared.gate.shape[1] if shared is not None else 0
        shared_tiles = _cdiv(num_tokens, block_m) if shared is not None else 0
        combine_h = max(min(256, _pow2(hidden)), combine_width(num_tokens, hidden, top_k))
        route_e, route_chunk = 16, config.get("router_chunk", min(512, _pow2(hidden)))
        if not (isinstance(route_chunk, int) and route_chunk >= 16 and route_chunk == _pow2(route_chunk)):
            raise ValueError(f"decode config: router_chunk must be a power of two >= 16, got {route_chunk!r}")
        route_parts = _cdiv(hidden, route_chunk) if router is not None else 0
        num_router_items = route_parts * _cdiv(num_experts, route_e)
        dn_cols = _cdiv(hidden, dn_n)
        route_tokens = max(1, min(_pow2(num_tokens), ROUTE_ELEMENTS // max(2, _pow2(num_experts))))
        route_items = _cdiv(num_tokens, route_tokens) if router is not None else 0
        down_prefetch = config.get("down_prefetch", False)
        if not isinstance(down_prefetch, bool):
            raise ValueError(f"decode config: down_prefetch must be a bool, got {down_prefetch!r}")
        capacity = launch_multiprocessors(device) * config["programs_per_sm"]
        gate_up_items = tile_bound * _cdiv(inter, gu_n) + shared_tiles * _cdiv(max(shared_inter, 1), gu_n)
        # As many prefetch items as programs the gate/up items leave idle: they run alongside the gate/up phase.
        prefetch_items = max(1, capacity - gate_up_items) if down_prefetch else 0
        max_items = (num_router_items + route_items + 1 + shared_tiles * (_cdiv(max(shared_inter, 1), gu_n) + dn_cols)
                     + tile_bound * (_cdiv(inter, gu_n) + dn_cols * split) + num_tokens * _cdiv(hidden, combine_h)
                     + prefetch_items)
        self.programs = min(max_items, capacity)
        # One expert's down weight as addressed (its strides' span, in stored elements) in 128-byte lines; at most
        # half the L2 is prefetched: the gate/up weights stream through the rest meanwhile.
        slab = 1 + sum((size - 1) * stride for size, stride in zip(dn.shape[1:], dn.stride()[1:]))
        line = L2_LINE_BYTES // dn.element_size()
        cap_lines = l2_bytes(device) // 2 // L2_LINE_BYTES
        self.sync_slots = TILE_COUNTERS.value + 2 * tile_bound * TILE_STRIDE.value
        block_p = max(16, _pow2(num_tokens * top_k))
        block_e = max(2, _pow2(num_experts))
        route_t = max(16, _pow2(num_tokens))
        self.sizes = (num_tokens, num_rows, max_items, tile_bound, self.programs)
        self.scratch_shapes = dict(
            part=((max(route_parts, 1), num_tokens, num_experts), torch.float32), sort=((block_p,), torch.int32),
            row_token=((num_rows,), torch.int64), tile_expert=((tile_bound,), torch.int32),
            pair_row=((num_tokens, top_k), torch.int64), act=((num_rows, inter), dtype),
            y=((split, num_rows, hidden), dtype if split == 1 else torch.float32),
            sh_act=((max(shared_tiles * block_m, 1), max(shared_inter, 1)), dtype),
            sh_y=((max(shared_tiles * block_m, 1), hidden), dtype))
        if router is not None:  # the routing the kernel writes; only logits and expert_index are returned
            self.scratch_shapes.update(mask=((num_tokens, num_experts), torch.uint8),
                                       affinities=((num_tokens, num_experts), torch.float32))
        if trace:
            self.scratch_shapes.update(trace=((max_items, 4), torch.int64))
        self.sync = self.scratch = self.trace = None  # made on the first launch outside a compiled graph
        # Only decode-sized plans keep their scratch: a decode loop launches the same few shapes step after step, so
        # keeping them saves the allocator calls in a host-bound step; a prefill-sized launch (prompt lengths vary,
        # each its own plan) kept its scratch -- 20 MiB at 256 tokens of a small model -- for ever, once per length.
        self.keeps_scratch = trace or num_tokens <= KEPT_SCRATCH_TOKENS
        shared_strides = (0, 0, 0, 0) if shared is None else (*shared.gate.stride(), *shared.down.stride())
        self.constexprs = dict(
            hidden=hidden, inter=inter, inter_actual=scalars[0], shared_inter=shared_inter, num_experts=num_experts,
            top_k=top_k, k_per_split=k_per_split, split=split, num_router_items=num_router_items,
            **dict(zip(("s_gu_e", "s_gu_k", "s_gu_n"), gu.stride())),
            **dict(zip(("s_gus_e", "s_gus_k", "s_gus_n"), gu_scale_strides)),
            s_gub_e=weights.gate_up_bias.stride(0) if weights.gate_up_bias is not None else 0,
            **dict(zip(("s_dn_e", "s_dn_k", "s_dn_n"), dn.stride())),
            **dict(zip(("s_dns_e", "s_dns_k", "s_dns_n"), dn_scale_strides)),
            s_dnb_e=weights.down_bias.stride(0) if weights.down_bias is not None else 0,
            **dict(zip(("s_shg_k", "s_shg_n", "s_shd_k", "s_shd_n"), shared_strides)),
            **dict(zip(("scaling", "act_bias", "gate_lower", "gate_upper", "up_lower", "up_upper"), scalars[1:])),
            **epilogue, PRECISION="ieee" if dtype == torch.float32 else "tf32", INTERPRET=interpreting(),
            # The down bias is its own: an expert-parallel rank's slice of the intermediate dimension other than the
            # first has a gate/up bias but adds no down bias (the slices' outputs are summed).
            FORMAT=fmt, DOWN_BIAS=weights.down_bias is not None, ROUTER=router is not None,
            ROUTER_BIAS=router is not None and router.bias is not None,
            SIGMOID=router is not None and router.sigmoid, ACT_OVER_TOPK=router is not None and router.act_over_topk,
            NORMALIZE=router is not None and router.normalize,
            HAS_PADDING=router is not None and router.padding is not None, SHARED=shared is not None,
            SHARED_ACT=ACTIVATIONS[shared.hidden_act] if shared is not None else 0, HAS_ADDEND=has_addend,
            TRACE=trace, PAIR_TILES=pair_tiles, DOWN_PREFETCH=down_prefetch, PREFETCH_ITEMS=prefetch_items,
            SLAB_LINES=_cdiv(slab, line) if down_prefetch else 0, LINE=line if down_prefetch else 0,
            CAP_LINES=cap_lines if down_prefetch else 0, BLOCK_M=block_m, GU_N=gu_n, GU_K=gu_k, DN_N=dn_n, DN_K=dn_k,
            ROUTE_T=route_t,
            ROUTE_E=route_e, ROUTE_H=min(128, route_chunk), ROUTE_CHUNK=route_chunk, ROUTE_PARTS=route_parts,
            ROUTE_TOKENS=route_tokens, BLOCK_E=block_e,
            BLOCK_P=block_p, COMBINE_P=_pow2(top_k), COMBINE_H=combine_h)
        self.options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
        self.pair_row_token = (num_tokens, top_k, block_m) if pair_tiles else None
        self.compiled = None

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, dict]:
        """``(counters, scratch)`` for a launch: the plan's own, made once and reused by every launch on its stream
        (the last program out leaves the counters zeroed) -- or, inside a compiled graph's op, fresh zeroed counters
        and scratch for this call alone (:func:`~nxd_moe.triton_kernels.compiled_graph_call` says why)."""
        if in_compiled_graph_call() or (self.scratch is None and _capturing(device)):
            # A plan's first launch inside a CUDA-graph capture: what it would keep is allocated from the graph's
            # pool, where another graph sharing the pool may have left its temporaries, and its zeroing (the
            # counters, the pair tiles' rows) would run only when that graph replays -- so a graph replayed before
            # it, or the pool's next owner, would read garbage. Per-call buffers, made inside the graph, instead.
            return (torch.zeros(self.sync_slots, dtype=torch.int32, device=device),
                    self._new_scratch(device))
        if not self.keeps_scratch:  # from the caching allocator, returned to it when the launch's op ends
            return _sync_buffer(device, self.sync_slots), self._new_scratch(device)
        if self.scratch is None:
            self.sync = _sync_buffer(device, self.sync_slots)
            self.scratch = self._new_scratch(device)
            self.trace = self.scratch.get("trace")
        return self.sync, self.scratch

    def _new_scratch(self, device: torch.device) -> dict:
        scratch = {name: torch.empty(shape, dtype=dtype, device=device)
                   for name, (shape, dtype) in self.scratch_shapes.items()}
        if "trace" in scratch:
            scratch["trace"].zero_()  # the rows of items a launch does not run stay 0
        if self.pair_row_token is not None:
            scratch["row_token"].copy_(pair_row_tokens(*self.pair_row_token, device))
        return scratch

    def launch(self, tensors: dict) -> None:
        args = [tensors.get(name, None) for name in _RUNTIME]
        fill = tensors["x"]
        args = [fill if a is None else a for a in args]
        args += self.sizes
        knobs = getattr(triton, "knobs", None)
        hooked = knobs is None or any(_hooked(getattr(knobs.runtime, hook))
                                      for hook in ("launch_enter_hook", "launch_exit_hook"))
        if self.compiled is None or hooked:
            compiled = _decode_kernel[(self.programs,)](*args, **self.constexprs, **self.options)
            if not interpreting() and not hooked:
                self.compiled = compiled
                names = _decode_kernel.arg_names[len(args):]
                self.constexpr_values = [self.constexprs[name] for name in names]
            return
        device = tensors["x"].device
        stream = triton.runtime.driver.active.get_current_stream(device.index)
        compiled = self.compiled
        compiled.run(self.programs, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *self.constexpr_values)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (None, or since Triton 3.5 an empty ``HookChain``, when not)."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_PLANS: dict[tuple, _Plan] = {}
# id(config) -> (config, its contents as a key): plans are keyed by what a launch configuration says, not by which
# dict says it (every backend builds its own dicts; keyed by identity, each new layer made new plans and kept their
# scratch for ever). The config is held, so its id is not reused while it is here.
_CONFIG_KEYS: dict[int, tuple[dict, tuple]] = {}


def _frozen(value):
    return tuple(sorted((k, _frozen(v)) for k, v in value.items())) if isinstance(value, dict) else value


def _config_key(config: dict) -> tuple:
    entry = _CONFIG_KEYS.get(id(config))
    if entry is None or entry[0] is not config:
        entry = _CONFIG_KEYS[id(config)] = (config, _frozen(config))
    return entry[1]


TRACE_PLANS = False  # set (by benchmarks) to give new plans a per-item timing record, see `last_trace`


def _aligned(*tensors) -> tuple:
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _plan(x, weights: ExpertWeights, config: dict, num_experts: int, top_k: int, prescale: bool,
          router: RouterParts | None, shared: SharedParts | None, has_addend: bool, per_call: tuple) -> _Plan:
    gu, dn = weights.gate_up_proj, weights.down_proj
    stored = [getattr(w, "weight", w) for w in (gu, dn)]
    key = (x.shape, x.dtype, _stream_key(x.device), num_experts, top_k, prescale, _config_key(config),
           weights.format, tuple(type(w) for w in (gu, dn)),
           weights.activation, weights.gate_up_bias is not None, weights.down_bias is not None,
           tuple(s.stride() for s in stored), _aligned(*stored, *per_call),
           None if router is None else (router.weight.shape, router.bias is not None, router.sigmoid,
                                        router.act_over_topk, router.normalize, router.padding is not None),
           None if shared is None else (shared.gate.shape, shared.gate.stride(), shared.down.stride(),
                                        shared.hidden_act, _aligned(shared.gate, shared.up, shared.down)),
           has_addend, TRACE_PLANS)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _Plan(x, weights, config, num_experts, top_k, prescale, router, shared, has_addend, TRACE_PLANS)
        _PLANS[key] = plan
    return plan


def last_trace() -> torch.Tensor | None:
    """``(items, 4)`` int64 of the most recently built traced plan: fetch time, start of work (after waits), end
    (globaltimer ns), ``program * 16 + item kind`` (see ``ROUTER_ITEM`` ...); rows of unused items are 0."""
    traced = [p for p in _PLANS.values() if p.trace is not None]
    return traced[-1].trace if traced else None


def _weight_tensors(weights: ExpertWeights) -> dict:
    gu, gu_scale, *_ = stored_operands(weights.gate_up_proj, 64)
    dn, dn_scale, *_ = stored_operands(weights.down_proj, 64)
    return dict(gu=gu, gu_scale=gu_scale, gu_bias=weights.gate_up_bias, dn=dn, dn_scale=dn_scale,
                dn_bias=weights.down_bias)


def selective_loading(hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights, config: dict,
                      addend: torch.Tensor | None = None) -> torch.Tensor:
    """The backend seam's selective loading in one launch: ``hidden_states (T, H)`` and a built
    :class:`~nxd_moe.experts.routing_inputs.Routing` -> ``(T, H)`` (``+ addend``)."""
    x = hidden_states.contiguous()
    index = routing.expert_index.contiguous()
    mask = routing.expert_mask.contiguous()
    affinities = routing.affinities.contiguous()
    addend = None if addend is None else addend.contiguous()
    num_experts = mask.shape[1]
    plan = _plan(x, weights, config, num_experts, index.shape[1], routing.prescale, None, None, addend is not None,
                 (x, index, mask, affinities, addend))
    sync, scratch = plan.buffers(x.device)
    out = torch.empty_like(x)
    plan.launch(dict(x=x, index=index, mask=mask, affinities=affinities, addend=addend, out=out, sync=sync,
                     **_weight_tensors(weights), **scratch))
    return out


def moe_decode(hidden_states: torch.Tensor, router: RouterParts, weights: ExpertWeights, config: dict,
               prescale: bool, shared: SharedParts | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router, routing, routed experts, shared expert and combine in one launch: ``hidden_states (T, H)`` ->
    ``(output (T, H), router_logits (T, E) fp32, expert_index (T, k) int64)``."""
    x = hidden_states.contiguous()
    num_tokens = x.shape[0]
    num_experts = router.weight.shape[0]
    padding = None if router.padding is None else router.padding.contiguous()
    plan = _plan(x, weights, config, num_experts, router.top_k, prescale, router, shared, shared is not None,
                 (x, padding))
    sync, scratch = plan.buffers(x.device)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    index = torch.empty(num_tokens, router.top_k, dtype=torch.int64, device=x.device)
    out = torch.empty_like(x)
    tensors = dict(x=x, index=index, padding=padding, logits=logits, out=out, router_w=router.weight,
                   router_b=router.bias, sync=sync, **_weight_tensors(weights), **scratch)
    if shared is not None:
        tensors.update(sh_gate=shared.gate, sh_up=shared.up, sh_down=shared.down, addend=scratch["sh_y"])
    plan.launch(tensors)
    return out, logits, index
