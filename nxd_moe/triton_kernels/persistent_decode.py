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
bodies are the multi-kernel path's own (:func:`~nxd_moe.triton_kernels.grouped_gemm._gate_up_tile`,
``_down_tile``, :func:`~nxd_moe.triton_kernels.combine._combine_token`), so both paths compute the same function;
the combine sums in a fixed order (no atomics on outputs: bitwise reproducible). Counters live in a small
per-device buffer that the last program out resets, so the next launch -- or the next replay of a captured CUDA
graph -- starts from zero; shapes are static and nothing is read on the host.

Triton's interpreter runs programs one after another; the first takes every item in order, so the same kernel
runs (and is tested) on a CPU.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.triton_kernels.combine import _combine_token, combine_width
from nxd_moe.triton_kernels.grouped_gemm import ACTIVATIONS, _down_tile, _gate_up_tile, _stored, epilogue_arguments
from nxd_moe.triton_kernels.routing_metadata import max_tiles

# Slots of the synchronisation buffer (int32); per-tile counters (routed tiles, then shared-expert tiles) follow.
NEXT_ITEM = tl.constexpr(0)
ROUTER_DONE = tl.constexpr(1)
LAYOUT_READY = tl.constexpr(2)
DOWN_DONE = tl.constexpr(3)
FINISHED = tl.constexpr(4)
NUM_TILES = tl.constexpr(5)
TIMED_OUT = tl.constexpr(6)
TILE_COUNTERS = tl.constexpr(8)
# Spins (each one atomic read of L2, ~1 us) before a wait gives up and flags TIMED_OUT: seconds, far beyond any
# real wait, so that a bug shows up as a flagged wrong result instead of a hung GPU.
MAX_SPINS = tl.constexpr(1 << 22)
# The most (token, expert) pairs one program sorts into tiles; larger problems use the multi-kernel path.
MAX_PAIRS = 1024
# Elements of one routing chunk (tokens x experts, int64 sort keys).
ROUTE_ELEMENTS = 4096


@triton.jit
def _wait_at_least(sync_ptr, slot, target):
    """Spin until counter ``slot`` reaches ``target`` (acquire: what the signalling items wrote is visible)."""
    seen = tl.atomic_add(sync_ptr + slot, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(sync_ptr + slot, 0, sem="acquire")
        spins += 1
    if seen < target:
        tl.atomic_xchg(sync_ptr + TIMED_OUT, 1)


@triton.jit
def _signal(sync_ptr, slot):
    """Count one finished item on ``slot``: every thread's stores first (barrier), then a release increment."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + slot, 1, sem="release")


@triton.jit
def _router_part(item, x_ptr, w_ptr, part_ptr, num_tokens, hidden, num_experts, stride_xt, stride_we,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_H: tl.constexpr):
    """``part[c, t, e] = sum over h in chunk c of x[t, h] * W[e, h]`` for one slice of experts, in fp32 (fp32
    products, as the router's fp32 ``F.linear``)."""
    expert_blocks = tl.cdiv(num_experts, BLOCK_E)
    chunk = item // expert_blocks
    experts = (item % expert_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    expert_ok = experts < num_experts
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(chunk * CHUNK_H, tl.minimum(chunk * CHUNK_H + CHUNK_H, hidden), BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + hs[None, :], mask=token_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[None, :] * stride_we + hs[:, None], mask=h_ok[:, None] & expert_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(part_ptr + (chunk * num_tokens + tokens[:, None]) * num_experts + experts[None, :], acc,
             mask=token_ok[:, None] & expert_ok[None, :])


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _route(part_ptr, num_parts, bias_ptr, padding_ptr, logits_ptr, index_ptr, mask_ptr, affinity_ptr,
           num_tokens, num_experts, top_k, HAS_BIAS: tl.constexpr, HAS_PADDING: tl.constexpr,
           SIGMOID: tl.constexpr, ACT_OVER_TOPK: tl.constexpr, NORMALIZE: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The router's output and :func:`~nxd_moe.experts.routing_inputs.build_routing` for every token: logits
    ``(T, E)``, ``expert_index (T, k)`` (largest logit first; ties to the lower expert), the k-hot mask and the
    affinities (activation over all experts or only the chosen ones, zeroed off the mask, L1-normalised)."""
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    ks = tl.arange(0, BLOCK_K)
    for t0 in range(0, num_tokens, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        token_ok = tokens < num_tokens
        ok = token_ok[:, None] & expert_ok[None, :]
        at = tokens[:, None] * num_experts + experts[None, :]
        logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for part in range(0, num_parts):
            logits += tl.load(part_ptr + part * num_tokens * num_experts + at, mask=ok, other=0.0,
                              cache_modifier=".cg")
        if HAS_BIAS:
            logits += tl.load(bias_ptr + experts, mask=expert_ok, other=0.0)[None, :]
        tl.store(logits_ptr + at, logits, mask=ok)
        # Sort keys: the logit's bits made order-preserving as a signed integer, above the inverted expert id.
        bits = logits.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) << 32
        key = key | (num_experts - 1 - experts).to(tl.int64)[None, :]
        key = tl.where(expert_ok[None, :], key, -9223372036854775807 - 1)
        top = tl.topk(key, BLOCK_K, dim=1)
        chosen_index = (num_experts - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
        tl.store(index_ptr + tokens[:, None] * top_k + ks[None, :], chosen_index.to(tl.int64),
                 mask=token_ok[:, None] & (ks < top_k)[None, :])
        chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for j in tl.static_range(BLOCK_K):
            expert_j = tl.sum(tl.where(ks[None, :] == j, chosen_index, 0), axis=1)
            chosen = chosen | ((experts[None, :] == expert_j[:, None]) & (j < top_k))
        if ACT_OVER_TOPK:
            scope = chosen
        else:
            scope = ok
        if SIGMOID:
            affinity = tl.sigmoid(logits)
        else:
            peak = tl.max(tl.where(scope, logits, float("-inf")), axis=1)
            weight = tl.where(scope, tl.exp(logits - peak[:, None]), 0.0)
            affinity = weight / tl.maximum(tl.sum(weight, axis=1), 1e-30)[:, None]  # rows past T: 0, not 0/0
        if HAS_PADDING:
            chosen = chosen & (tl.load(padding_ptr + tokens, mask=token_ok, other=0) != 0)[:, None]
        affinity = tl.where(chosen, affinity, 0.0)
        if NORMALIZE:
            norm = tl.sum(tl.abs(affinity), axis=1)
            affinity = affinity / tl.maximum(norm, 1e-12)[:, None]
        tl.store(mask_ptr + at, chosen.to(tl.uint8), mask=ok)
        tl.store(affinity_ptr + at, affinity, mask=ok)


@triton.jit
def _layout(index_ptr, mask_ptr, sort_ptr, row_token_ptr, tile_expert_ptr, pair_row_ptr, sync_ptr,
            num_pairs, top_k, num_experts, num_rows, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout` of the valid pairs, in one program: pairs
    sorted by (expert, pair), each expert's run cut into ``BLOCK_M``-row tiles, packed; ``row_token = -1`` on
    padding rows; ``pair_row = num_rows`` for pairs without a row; the tile count in the ``NUM_TILES`` slot."""
    for r0 in range(0, num_rows, BLOCK_P):
        rows = r0 + tl.arange(0, BLOCK_P)
        tl.store(row_token_ptr + rows, tl.full((BLOCK_P,), -1, tl.int64), mask=rows < num_rows)
    pairs = tl.arange(0, BLOCK_P)
    in_range = pairs < num_pairs
    expert = tl.load(index_ptr + pairs, mask=in_range, other=0, cache_modifier=".cg").to(tl.int32)
    token = pairs // top_k
    real = in_range & (tl.load(mask_ptr + token * num_experts + expert, mask=in_range, other=0,
                               cache_modifier=".cg") != 0)
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
    x_ptr, stride_xt, index_ptr, mask_ptr, affinity_ptr,
    router_w_ptr, router_b_ptr, padding_ptr, part_ptr, logits_ptr,
    gu_ptr, gu_scale_ptr, gu_bias_ptr, s_gu_e, s_gu_k, s_gu_n, s_gus_e, s_gus_k, s_gus_n, s_gub_e,
    dn_ptr, dn_scale_ptr, dn_bias_ptr, s_dn_e, s_dn_k, s_dn_n, s_dns_e, s_dns_k, s_dns_n, s_dnb_e,
    sh_gate_ptr, sh_up_ptr, sh_down_ptr, s_shg_k, s_shg_n, s_shd_k, s_shd_n,
    sort_ptr, row_token_ptr, tile_expert_ptr, pair_row_ptr, act_ptr, y_ptr, sh_act_ptr, sh_y_ptr, sync_ptr,
    addend_ptr, stride_at, out_ptr,
    num_tokens, hidden, inter, inter_actual, shared_inter, num_experts, top_k, num_rows, k_per_split, split,
    num_router_items, router_parts, max_items, max_tile_count, num_slots, num_programs,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FORMAT: tl.constexpr,
    ROUTER: tl.constexpr, ROUTER_BIAS: tl.constexpr, SIGMOID: tl.constexpr, ACT_OVER_TOPK: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_PADDING: tl.constexpr, SHARED: tl.constexpr, SHARED_ACT: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK_M: tl.constexpr, GU_N: tl.constexpr, GU_K: tl.constexpr, DN_N: tl.constexpr, DN_K: tl.constexpr,
    ROUTE_T: tl.constexpr, ROUTE_E: tl.constexpr, ROUTE_H: tl.constexpr, ROUTE_CHUNK: tl.constexpr,
    ROUTE_TOKENS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_P: tl.constexpr,
    COMBINE_P: tl.constexpr, COMBINE_H: tl.constexpr,
):
    gu_cols = tl.cdiv(inter, GU_N)
    dn_cols = tl.cdiv(hidden, DN_N)
    if SHARED:
        shared_tiles = tl.cdiv(num_tokens, BLOCK_M)
        shared_gu_cols = tl.cdiv(shared_inter, GU_N)
    else:
        shared_tiles = 0
        shared_gu_cols = 1
    shared_gu = shared_tiles * shared_gu_cols
    shared_dn = shared_tiles * dn_cols
    combine_cols = tl.cdiv(hidden, COMBINE_H)
    first_routed = num_router_items + 1 + shared_gu
    item = tl.atomic_add(sync_ptr + NEXT_ITEM, 1)
    running = item < max_items
    while running:
        tiles = item * 0
        if item >= first_routed:
            _wait_at_least(sync_ptr, LAYOUT_READY, 1)
            tiles = tl.load(sync_ptr + NUM_TILES, cache_modifier=".cg")
        routed_gu = tiles * gu_cols
        routed_dn = tiles * dn_cols * split
        if item < first_routed + routed_gu + shared_dn + routed_dn + num_tokens * combine_cols:
            if item < num_router_items:
                if ROUTER:
                    _router_part(item, x_ptr, router_w_ptr, part_ptr, num_tokens, hidden, num_experts, stride_xt,
                                 hidden, ROUTE_T, ROUTE_E, ROUTE_H, ROUTE_CHUNK)
                    _signal(sync_ptr, ROUTER_DONE)
            elif item == num_router_items:
                if ROUTER:
                    _wait_at_least(sync_ptr, ROUTER_DONE, num_router_items)
                    _route(part_ptr, router_parts, router_b_ptr, padding_ptr, logits_ptr, index_ptr, mask_ptr,
                           affinity_ptr, num_tokens, num_experts, top_k, ROUTER_BIAS, HAS_PADDING, SIGMOID,
                           ACT_OVER_TOPK, NORMALIZE, ROUTE_TOKENS, BLOCK_E, BLOCK_TOPK)
                    tl.debug_barrier()
                _layout(index_ptr, mask_ptr, sort_ptr, row_token_ptr, tile_expert_ptr, pair_row_ptr, sync_ptr,
                        num_tokens * top_k, top_k, num_experts, num_rows, BLOCK_P, BLOCK_M)
                _signal(sync_ptr, LAYOUT_READY)
            elif item < first_routed:
                # (only with SHARED: otherwise first_routed is the layout item's successor)
                j = item - num_router_items - 1
                tile = j // shared_gu_cols
                _gate_up_tile(tile, j % shared_gu_cols, x_ptr, sh_gate_ptr, sh_up_ptr, sh_gate_ptr, sh_gate_ptr,
                              sh_gate_ptr, affinity_ptr, sh_act_ptr, row_token_ptr, tile_expert_ptr, num_tokens,
                              hidden, shared_inter, shared_inter, num_experts, stride_xt, 0, s_shg_k, s_shg_n,
                              0, 0, 0, 0, shared_inter, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, SHARED_ACT, True, False,
                              False, False, False, False, False, False, False, PRECISION, INTERPRET, False, 0,
                              BLOCK_M, GU_N, GU_K, True)
                _signal(sync_ptr, TILE_COUNTERS + max_tile_count + tile)
            else:
                j = item - first_routed
                if j < routed_gu:
                    tile = j // gu_cols
                    _gate_up_tile(tile, j % gu_cols, x_ptr, gu_ptr, gu_ptr + inter * s_gu_n, gu_ptr, gu_scale_ptr,
                                  gu_bias_ptr, affinity_ptr, act_ptr, row_token_ptr, tile_expert_ptr, 0,
                                  hidden, inter, inter_actual, num_experts, stride_xt, s_gu_e, s_gu_k, s_gu_n,
                                  s_gus_e, s_gus_k, s_gus_n, s_gub_e, inter, scaling, act_bias, gate_lower,
                                  gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER,
                                  GATE_UPPER, UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, PRECISION, INTERPRET, False,
                                  FORMAT, BLOCK_M, GU_N, GU_K, False)
                    _signal(sync_ptr, TILE_COUNTERS + tile)
                elif j < routed_gu + shared_dn:
                    j -= routed_gu
                    tile = j // dn_cols
                    _wait_at_least(sync_ptr, TILE_COUNTERS + max_tile_count + tile, shared_gu_cols)
                    _down_tile(tile, j % dn_cols, 0, sh_act_ptr, sh_down_ptr, sh_down_ptr, sh_down_ptr,
                               sh_down_ptr, sh_y_ptr, row_token_ptr, tile_expert_ptr, num_tokens, shared_inter,
                               hidden, shared_inter, shared_inter, 0, s_shd_k, s_shd_n, 0, 0, 0, 0, 0, hidden,
                               False, PRECISION, INTERPRET, False, 0, BLOCK_M, DN_N, DN_K, True)
                    _signal(sync_ptr, DOWN_DONE)
                elif j < routed_gu + shared_dn + routed_dn:
                    j -= routed_gu + shared_dn
                    part = j // split
                    tile = part // dn_cols
                    _wait_at_least(sync_ptr, TILE_COUNTERS + tile, gu_cols)
                    _down_tile(tile, part % dn_cols, j % split, act_ptr, dn_ptr, dn_ptr, dn_scale_ptr, dn_bias_ptr,
                               y_ptr, row_token_ptr, tile_expert_ptr, 0, inter, hidden, k_per_split, inter,
                               s_dn_e, s_dn_k, s_dn_n, s_dns_e, s_dns_k, s_dns_n, s_dnb_e, num_rows * hidden,
                               hidden, HAS_BIAS, PRECISION, INTERPRET, False, FORMAT, BLOCK_M, DN_N, DN_K, False)
                    _signal(sync_ptr, DOWN_DONE)
                else:
                    j -= routed_gu + shared_dn + routed_dn
                    _wait_at_least(sync_ptr, DOWN_DONE, routed_dn + shared_dn)
                    _combine_token(j // combine_cols, j % combine_cols, y_ptr, pair_row_ptr, index_ptr,
                                   affinity_ptr, addend_ptr, out_ptr, num_rows, hidden, top_k, num_experts, split,
                                   num_rows * hidden, hidden, top_k, top_k, 1, stride_at, hidden, PRESCALE,
                                   HAS_ADDEND, COMBINE_P, COMBINE_H)
            item = tl.atomic_add(sync_ptr + NEXT_ITEM, 1)
            running = item < max_items
        else:
            running = False
    # The last program out resets the counters (all others are done with them) for the next launch.
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + FINISHED, 1, sem="acq_rel") == num_programs - 1:
        slots = tl.arange(0, 1024)
        for s0 in range(0, num_slots, 1024):
            keep = (s0 + slots == TIMED_OUT) | (s0 + slots >= num_slots)
            tl.store(sync_ptr + s0 + slots, tl.zeros((1024,), tl.int32), mask=~keep)


class RouterParts(NamedTuple):
    """A top-k router fused into the launch: ``logits = x @ weight.T (+ bias)`` in fp32, ``expert_index`` its
    top-k, affinities ``sigmoid`` or ``softmax`` of the logits (over the chosen ``k`` only when
    ``act_over_topk``), then :func:`~nxd_moe.experts.routing_inputs.build_routing` (``padding (T,)``: token is
    real; ``normalize``: L1 over the chosen)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    sigmoid: bool
    act_over_topk: bool
    normalize: bool
    padding: torch.Tensor | None


class SharedParts(NamedTuple):
    """A dense GLU expert every token goes through, fused into the launch: ``down(act(x @ gate) * (x @ up))``
    with ``gate``, ``up (H, I_s)`` and ``down (I_s, H)`` as ``(K, N)`` views of the stored weights (any
    strides) and ``hidden_act`` a name in :data:`~nxd_moe.triton_kernels.grouped_gemm.ACTIVATIONS`."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    hidden_act: str


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


_SYNC: dict[tuple[str, int], torch.Tensor] = {}


def _device_key(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda" and device.index is None:
        return device.type, torch.cuda.current_device()
    return device.type, device.index or 0


def _sync_buffer(device: torch.device, slots: int) -> torch.Tensor:
    """The device's counter buffer: zeros, and every launch leaves it zeroed (grown on demand, never shrunk).
    Launches that share it must not overlap: one stream per device."""
    key = _device_key(device)
    buffer = _SYNC.get(key)
    if buffer is None or buffer.numel() < slots:
        buffer = torch.zeros(max(slots, 4096), dtype=torch.int32, device=device)
        _SYNC[key] = buffer
    return buffer


def counters(device: torch.device) -> torch.Tensor | None:
    """The counter buffer of ``device`` (None before the first launch there); for tests and diagnostics."""
    return _SYNC.get(_device_key(torch.device(device)))


def timed_out(device: torch.device) -> bool:
    """Whether a wait of a persistent decode launch on ``device`` ever gave up (a bug: its result was wrong).
    Reads the device (host sync); for tests."""
    buffer = counters(device)
    return buffer is not None and bool(buffer[TIMED_OUT.value])


def applies(num_tokens: int, top_k: int) -> bool:
    """Whether a decode of this size runs in one launch (one program sorts all pairs into tiles)."""
    return num_tokens * top_k <= MAX_PAIRS


def _launch(x: torch.Tensor, weights: ExpertWeights, config: dict, num_experts: int, top_k: int,
            index: torch.Tensor, mask: torch.Tensor, affinities: torch.Tensor, prescale: bool,
            router: RouterParts | None, logits: torch.Tensor | None, shared: SharedParts | None,
            addend: torch.Tensor | None) -> torch.Tensor:
    """One launch of :func:`_decode_kernel`; ``index``, ``mask``, ``affinities`` (and ``logits``) are read, or
    written first when ``router`` is given."""
    device, dtype = x.device, x.dtype
    num_tokens, hidden = x.shape
    block_m, gate_up, down = config["block_m"], config["gate_up"], config["down"]
    gu_stored, gu_scale, gu_scale_strides, fmt, gu_k = _stored(weights.gate_up_proj, gate_up["BLOCK_K"])
    dn_stored, dn_scale, dn_scale_strides, _, dn_k = _stored(weights.down_proj, down["BLOCK_K"])
    inter = weights.down_proj.shape[1]
    scalars, constexprs = epilogue_arguments(weights.activation, inter, weights.gate_up_bias is not None, prescale)
    num_pairs = num_tokens * top_k
    tile_bound = max_tiles(num_pairs, num_experts, block_m)
    num_rows = tile_bound * block_m
    k_per_split = triton.cdiv(triton.cdiv(inter, down["SPLIT_K"]), dn_k) * dn_k
    split = triton.cdiv(inter, k_per_split)
    gu_n, dn_n = gate_up["BLOCK_N"], down["BLOCK_N"]
    shared_inter = shared.gate.shape[1] if shared is not None else 0
    shared_tiles = triton.cdiv(num_tokens, block_m) if shared is not None else 0
    combine_h = combine_width(num_tokens, hidden, top_k)
    route_e = max(16, min(32, triton.next_power_of_2(num_experts)))
    route_chunk = config.get("ROUTE_CHUNK", 256)
    router_parts = triton.cdiv(hidden, route_chunk) if router is not None else 0
    num_router_items = router_parts * triton.cdiv(num_experts, route_e)
    dn_cols = triton.cdiv(hidden, dn_n)
    max_items = (num_router_items + 1 + shared_tiles * (triton.cdiv(max(shared_inter, 1), gu_n) + dn_cols)
                 + tile_bound * (triton.cdiv(inter, gu_n) + dn_cols * split)
                 + num_tokens * triton.cdiv(hidden, combine_h))
    programs = min(max_items, _multiprocessors(device) * config["programs_per_sm"])
    num_slots = TILE_COUNTERS.value + 2 * tile_bound
    sync = _sync_buffer(device, num_slots)
    block_p = max(16, triton.next_power_of_2(num_pairs))
    block_e = max(2, triton.next_power_of_2(num_experts))
    route_t = max(16, triton.next_power_of_2(num_tokens))
    sort = torch.empty(block_p, dtype=torch.int32, device=device)
    row_token = torch.empty(num_rows, dtype=torch.int64, device=device)
    tile_expert = torch.empty(tile_bound, dtype=torch.int32, device=device)
    pair_row = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    act = torch.empty(num_rows, inter, dtype=dtype, device=device)
    y = torch.empty(split, num_rows, hidden, dtype=dtype if split == 1 else torch.float32, device=device)
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    if shared is not None:
        shared_act = torch.empty(shared_tiles * block_m, shared_inter, dtype=dtype, device=device)
        # The shared expert's rows are the combine's addend.
        addend = torch.empty(shared_tiles * block_m, hidden, dtype=dtype, device=device)
        sh_gate, sh_up, sh_down = shared.gate, shared.up, shared.down
    else:
        shared_act = sh_gate = sh_up = sh_down = x
    part = (torch.empty(router_parts, num_tokens, num_experts, dtype=torch.float32, device=device)
            if router is not None else x)
    gu_bias = weights.gate_up_bias if weights.gate_up_bias is not None else x
    dn_bias = weights.down_bias if weights.down_bias is not None else x
    padding = router.padding if router is not None else None
    _decode_kernel[(programs,)](
        x, x.stride(0), index, mask, affinities,
        router.weight if router is not None else x,
        router.bias if router is not None and router.bias is not None else x,
        padding.view(torch.uint8) if padding is not None else x, part, logits if logits is not None else x,
        gu_stored, gu_scale, gu_bias, *gu_stored.stride(), *gu_scale_strides, gu_bias.stride(0),
        dn_stored, dn_scale, dn_bias, *dn_stored.stride(), *dn_scale_strides, dn_bias.stride(0),
        sh_gate, sh_up, sh_down, sh_gate.stride(0), sh_gate.stride(1), sh_down.stride(0), sh_down.stride(1),
        sort, row_token, tile_expert, pair_row, act, y, shared_act, addend if shared is not None else x, sync,
        addend if addend is not None else x, addend.stride(0) if addend is not None else 0, out,
        num_tokens, hidden, inter, scalars[0], shared_inter, num_experts, top_k, num_rows, k_per_split, split,
        num_router_items, router_parts, max_items, tile_bound, num_slots, programs, *scalars[1:],
        FORMAT=fmt, ROUTER=router is not None, ROUTER_BIAS=router is not None and router.bias is not None,
        SIGMOID=router is not None and router.sigmoid, ACT_OVER_TOPK=router is not None and router.act_over_topk,
        NORMALIZE=router is not None and router.normalize, HAS_PADDING=padding is not None,
        SHARED=shared is not None, SHARED_ACT=ACTIVATIONS[shared.hidden_act] if shared is not None else 0,
        HAS_ADDEND=addend is not None, BLOCK_M=block_m, GU_N=gu_n, GU_K=gu_k, DN_N=dn_n, DN_K=dn_k,
        ROUTE_T=route_t, ROUTE_E=route_e, ROUTE_H=64, ROUTE_CHUNK=route_chunk,
        ROUTE_TOKENS=max(1, min(route_t, ROUTE_ELEMENTS // block_e)), BLOCK_E=block_e,
        BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_P=block_p, COMBINE_P=triton.next_power_of_2(top_k),
        COMBINE_H=combine_h, PRECISION="ieee" if dtype == torch.float32 else "tf32",
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=config["num_warps"],
        num_stages=config["num_stages"], **constexprs)
    return out


def selective_loading(hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights, config: dict,
                      addend: torch.Tensor | None = None) -> torch.Tensor:
    """The backend seam's selective loading in one launch: ``hidden_states (T, H)`` and a built
    :class:`~nxd_moe.experts.routing_inputs.Routing` -> ``(T, H)`` (``+ addend``)."""
    num_experts = routing.expert_mask.shape[1]
    return _launch(hidden_states.contiguous(), weights, config, num_experts, routing.expert_index.shape[1],
                   routing.expert_index.contiguous(), routing.expert_mask.contiguous().view(torch.uint8),
                   routing.affinities.contiguous(), routing.prescale, None, None, None, addend)


def moe_decode(hidden_states: torch.Tensor, router: RouterParts, weights: ExpertWeights, config: dict,
               prescale: bool, shared: SharedParts | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router, routing, routed experts, shared expert and combine in one launch: ``hidden_states (T, H)`` ->
    ``(output (T, H), router_logits (T, E) fp32, expert_index (T, k) int64)``."""
    x = hidden_states.contiguous()
    num_tokens = x.shape[0]
    num_experts = router.weight.shape[0]
    device = x.device
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    index = torch.empty(num_tokens, router.top_k, dtype=torch.int64, device=device)
    mask = torch.empty(num_tokens, num_experts, dtype=torch.uint8, device=device)
    affinities = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    out = _launch(x, weights, config, num_experts, router.top_k, index, mask, affinities, prescale, router, logits,
                  shared, None)
    return out, logits, index
