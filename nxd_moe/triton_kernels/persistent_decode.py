"""A decode step in one launch: a persistent kernel that runs the whole MoE layer's expert work as a queue of items
-- the host side, which plans and launches it.

At decode sizes (``T <= 64`` tokens, a few hundred (token, expert) pairs) the separate kernels of
:mod:`~nxd_moe.triton_kernels.backend` -- routing, metadata, gate/up, down, combine, plus a router and a shared
expert in torch -- each pay a launch and a ramp-up, which is most of the time when the whole step streams
25-700 MB of weights. Here one launch of a few programs per multiprocessor takes work items -- router, routing,
layout, gate/up, down-prefetch, down and combine items -- from one atomic counter, in a fixed global order (the
kernel and its items: :mod:`~nxd_moe.triton_kernels.persistent_decode_kernel`).

This module holds the launches: :func:`selective_loading` (the backend seam's ``hidden_states (T, H)`` and a built
routing -> ``(T, H)``) and :func:`moe_decode` (router to combine); the launch plans (``_Plan``: grid, sizes,
constexprs, scratch buffers and, after the first launch, the compiled kernel -- one per static shape, in
``_PLANS``); the per-stream counter buffers (:func:`counters`, :func:`timed_out`); :func:`applies` (which decode
sizes run in one launch) and :func:`pair_row_tokens` (the static rows of pair tiles).
"""

from __future__ import annotations

import torch
import triton

from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.gpu_info import multiprocessors
from nxd_moe.layer_parts import RouterParts, SharedParts
from nxd_moe.triton_kernels import in_compiled_graph_call, interpreting
from nxd_moe.triton_kernels.combine import combine_width
from nxd_moe.triton_kernels.grouped_gemm import ACTIVATIONS, epilogue_arguments, stored_operands
from nxd_moe.triton_kernels.launch_configs import l2_bytes
from nxd_moe.triton_kernels.persistent_decode_kernel import TILE_COUNTERS, TILE_STRIDE, TIMED_OUT, decode_kernel
from nxd_moe.triton_kernels.routing_metadata import max_tiles

# The most (token, expert) pairs one program sorts into tiles; larger problems use the multi-kernel path.
MAX_PAIRS = 1024
# Elements of one routing chunk (tokens x experts: int64 sort keys, fp32 logits).
ROUTE_ELEMENTS = 1024
# Item types in a TRACE record (the `kind` values decode_kernel writes).
(ROUTER_ITEM, LAYOUT_ITEM, SHARED_GATE_UP, GATE_UP, SHARED_DOWN, DOWN, COMBINE, ROUTE_ITEM, DOWN_PREFETCH,
 FUSED_MLP_ITEM) = range(10)
# The most partial sums (pairs x K splits x columns) one combine item loads at once.
COMBINE_ELEMENTS = 16384
# An L2 line, the unit the down prefetch asks L2 for.
L2_LINE_BYTES = 128


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
        gu_n, dn_n = gate_up["BLOCK_N"], down["BLOCK_N"]
        fused_mlp = config.get("fused_mlp", False)
        if not isinstance(fused_mlp, bool):
            raise ValueError(f"decode config: fused_mlp must be a bool, got {fused_mlp!r}")
        if fused_mlp and fmt != 0:
            raise ValueError(f"decode config: fused_mlp runs unquantized weights only, got {weights.format}")
        # A fused item's down partial sums span its gate/up columns: one K split per gate/up column slice.
        k_per_split = gu_n if fused_mlp else _cdiv(_cdiv(inter, down["SPLIT_K"]), dn_k) * dn_k
        split = _cdiv(inter, k_per_split)
        shared_inter = shared.gate.shape[1] if shared is not None else 0
        shared_tiles = _cdiv(num_tokens, block_m) if shared is not None else 0
        # At most COMBINE_ELEMENTS partial sums per combine item (they are loaded at once): narrower columns when
        # there are many K splits, so the combine still spreads over the GPU.
        combine_h = max(16, min(max(min(256, _pow2(hidden)), combine_width(num_tokens, hidden, top_k)),
                                _pow2(COMBINE_ELEMENTS // (_pow2(top_k) * split) + 1) // 2))
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
        if down_prefetch and fused_mlp:
            raise ValueError("decode config: down_prefetch and fused_mlp exclude each other (a fused item reads its "
                             "down weights itself, right after its gate/up weights)")
        capacity = launch_multiprocessors(device) * config["programs_per_sm"]
        gate_up_items = tile_bound * _cdiv(inter, gu_n) + shared_tiles * _cdiv(max(shared_inter, 1), gu_n)
        # As many prefetch items as programs the gate/up items leave idle: they run alongside the gate/up phase.
        prefetch_items = max(1, capacity - gate_up_items) if down_prefetch else 0
        max_items = (num_router_items + route_items + 1 + shared_tiles * (_cdiv(max(shared_inter, 1), gu_n) + dn_cols)
                     + tile_bound * (_cdiv(inter, gu_n) + (0 if fused_mlp else dn_cols * split))
                     + num_tokens * _cdiv(hidden, combine_h)
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
            TRACE=trace, PAIR_TILES=pair_tiles, FUSED_MLP=fused_mlp, DOWN_PREFETCH=down_prefetch,
            PREFETCH_ITEMS=prefetch_items,
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
            compiled = decode_kernel[(self.programs,)](*args, **self.constexprs, **self.options)
            if not interpreting() and not hooked:
                self.compiled = compiled
                names = decode_kernel.arg_names[len(args):]
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
