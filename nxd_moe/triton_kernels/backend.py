"""``ExpertMLPsV2(..., backend="triton")``: every expert algorithm as the same three GPU kernels.

Each mode only decides which rows exist -- a :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout` -- and
then runs gate/up GEMM (token gather + activation fused) -> down GEMM -> deterministic combine:

- blockwise: the layout comes from the routing-metadata kernels together with NxD's ``BlockMapping`` (which the
  front end reports in its stats), tiles of ``block_m`` rows independent of the Trainium block size;
- selective loading: the same kernels with decode-sized tiles, so each chosen expert's weights are streamed
  once per tile of its tokens;
- capacity factor: first come first served (shared with the torch backend), each expert's ``C`` slots tiled;
- all-experts: every token in every expert's tiles; the combine reads only the chosen pairs.

Mode choice differs from NxD's rule where the GPU wants it (:meth:`TritonBackend.select_mode`). Supports fp32,
bf16 and fp16 on CUDA; on a CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how CI tests them. Under ``torch.compile`` every seam method that launches kernels calls one opaque custom op
instead, whose implementation is the same method run eagerly (:mod:`~nxd_moe.triton_kernels.compiled`).
"""

from __future__ import annotations

import os

import torch

from nxd_moe.experts.backends import ExpertsBackend
from nxd_moe.experts.capacity import admit
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ModePolicy
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import BlockMapping, num_blocks
from nxd_moe.graphs import in_replayed_steps
from nxd_moe.layer_parts import RouterParts, SharedParts
from nxd_moe.quantization.weight import QuantizedWeight
from nxd_moe.triton_kernels import compiled, persistent_decode, prefill_gemm
from nxd_moe.triton_kernels import router as router_kernel
from nxd_moe.triton_kernels.combine import combine_rows
from nxd_moe.triton_kernels.grouped_gemm import ACTIVATIONS, FORMAT_CODES, down_projection, gate_up_projection
from nxd_moe.triton_kernels.launch_configs import decode_config, launch_config
from nxd_moe.triton_kernels.local_routing import fused_local_routing
from nxd_moe.triton_kernels.repack import REPACKED_CODES, repacked
from nxd_moe.triton_kernels.routing import fused_routing
from nxd_moe.triton_kernels.routing_metadata import TileLayout, routing_layout
from nxd_moe.triton_kernels.w8a8 import w8a8_expert_rows, w8a8_launch_config

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Decodes of steps replayed as CUDA graphs (nxd_moe.graphs.replayed_steps) with at least this many (token, expert)
# pairs, of layers of at most this many experts, run in separate kernels (H200, replays: Qwen3-30B-A3B T=16 221 vs
# 234 us one launch, T=32 299 vs 314, T=128 331 vs 419; the application's full-size Qwen3 at batch 16 1,267 vs 1,159
# tokens/s; Mixtral T=16 (32 pairs) 641 vs 665 and T=1 stay in one launch; DeepSeek-V3 T=16 (E = 256) measured 4 %
# faster in one launch on an H100). Outside replays launches cost what they cost and one launch wins every shape.
REPLAYED_SEPARATE_PAIRS = 128
REPLAYED_SEPARATE_EXPERTS = 128


def _check_device(hidden_states: torch.Tensor) -> None:
    if hidden_states.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the triton backend runs on CUDA tensors (got a {hidden_states.device.type} tensor); "
                           "on a CPU set TRITON_INTERPRET=1 before importing nxd_moe to run its kernels in "
                           "Triton's interpreter, or use backend='torch'")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports dtypes {[str(d) for d in SUPPORTED_DTYPES]}, got "
                        f"{hidden_states.dtype} (use the torch backend for float64)")


def _static_layout(kept: torch.Tensor, rank: torch.Tensor, rows_per_expert: int, expert_index: torch.Tensor | None,
                   block_m: int) -> TileLayout:
    """Each expert owns ``rows_per_expert`` (a multiple of ``block_m``) consecutive rows; token ``t`` of
    ``kept (T, E)`` sits at rank ``rank[t, e]``. ``expert_index (T, k)`` picks the pairs the combine reads
    (None: all ``E`` of them)."""
    num_tokens, num_experts = kept.shape
    device = kept.device
    num_rows = num_experts * rows_per_expert
    row = torch.arange(num_experts, device=device) * rows_per_expert + rank
    tokens = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(row)
    scatter_at = torch.where(kept, row, torch.full_like(row, num_rows)).reshape(-1)
    row_token = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    row_token = row_token.scatter(0, scatter_at, tokens.reshape(-1))[:num_rows]
    tile_expert = torch.arange(num_experts, dtype=torch.int32, device=device).repeat_interleave(
        rows_per_expert // block_m)
    num_tiles = torch.full((1,), num_rows // block_m, dtype=torch.int32, device=device)
    if expert_index is not None:
        kept, row = kept.gather(1, expert_index), row.gather(1, expert_index)
    pair_row = torch.where(kept, row, torch.full_like(row, num_rows))
    return TileLayout(row_token, tile_expert, num_tiles, pair_row, block_m)


class TritonBackend(ExpertsBackend):
    """Fused Triton kernels on NVIDIA GPUs (see the module docstring).

    ``configs``: a launch configuration (see :mod:`~nxd_moe.triton_kernels.launch_configs`) to use for every
    shape instead of the tuned table -- what the tuner passes; None for the shipped table and default rule.
    ``repack``: decode-sized GEMMs read quantized weights (``mxfp4``, ``fp8``, ``fp8_block``; W8A16) from a copy
    rearranged into their tensor-core operand order (:mod:`~nxd_moe.triton_kernels.repack`), made on first use and
    cached; False reads the stored layout everywhere and saves that copy's memory (the stored weights' size again).
    ``one_launch``: decode sizes as one persistent launch (:mod:`~nxd_moe.triton_kernels.persistent_decode`). None
    (default): where it was measured faster, i.e. 16-bit weights; quantized weights decode through the separate
    kernels, which read the repacked copy 10-45 % faster than the persistent kernel on every measured shape (H100,
    ``benchmarks/results/gpu_quantized_decode_h100.json``: its one program per multiprocessor leaves the
    dequantization's latency exposed); and inside :func:`nxd_moe.graphs.replayed_steps` (the application's CUDA-graph
    steps), where launches cost nothing, not from :data:`REPLAYED_SEPARATE_PAIRS` pairs on in layers of at most
    :data:`REPLAYED_SEPARATE_EXPERTS` experts. True: wherever it applies; False: never.
    ``fuse_router``: a top-k router with an fp32 weight as one kernel (:meth:`fused_router`) where the layer is not
    decoded in one launch. None (default): from :data:`~nxd_moe.triton_kernels.router.MIN_TOKENS` tokens on, where
    it was measured faster than torch's router; True: wherever it applies; False: never.
    """

    name = "triton"
    fuses_addend = True
    fuses_layers = True
    # Quantized weights are read as stored and dequantized in registers inside the GEMMs' weight-tile loads.
    supported_formats = frozenset(FORMAT_CODES)
    # W8A8 (FP8 activations with fp8 / fp8_block weights): FP8 x FP8 tensor-core GEMMs, w8a8.py.
    supports_activation_quantization = True

    def __init__(self, configs: dict | None = None, decode_configs: dict | None = None, one_launch: bool | None = None,
                 persistent_prefill: bool = True, repack: bool = True,
                 fuse_router: bool | None = None):
        if not (one_launch is None or type(one_launch) is bool):
            raise TypeError(f"TritonBackend: one_launch must be None (the measured rule), True or False, got "
                            f"{one_launch!r}")
        if not (fuse_router is None or type(fuse_router) is bool):
            raise TypeError(f"TritonBackend: fuse_router must be None (the measured rule), True or False, got "
                            f"{fuse_router!r}")
        for name, value in (("persistent_prefill", persistent_prefill), ("repack", repack)):
            if type(value) is not bool:
                raise TypeError(f"TritonBackend: {name} must be True or False, got {value!r}")
        self.configs = configs
        self.decode_configs = decode_configs
        self.one_launch = one_launch
        self.persistent_prefill = persistent_prefill
        self.repack = repack
        self.fuse_router = fuse_router
        # Launch configurations by static shape: looked up once, not on every forward.
        self._configs: dict[tuple, dict] = {}
        # How the ops of a torch.compile'd graph find this backend (see compiled.py).
        self.handle = compiled.register(self)

    def __setstate__(self, state):
        """A copy (``copy.deepcopy`` of a layer, unpickling) is another backend: its own handle."""
        self.__dict__.update(state)
        self.handle = compiled.register(self)

    def _config(self, hidden_states: torch.Tensor, weights: ExpertWeights, top_k: int, decode: bool = False,
                shared_inter: int = 0) -> dict:
        """The launch configuration of this call's shapes (``shared_inter``: the width of a shared expert the decode
        launch runs beside the routed experts, 0 for none)."""
        if decode and self.decode_configs is not None:
            return self.decode_configs
        if not decode and self.configs is not None:
            return self.configs
        num_experts, hidden, _ = weights.gate_up_proj.shape
        w8a8 = weights.activation_quantization is not None
        # int(): a compiled graph with a dynamic token count specializes on it here (tiles and launch follow T).
        key = (decode, w8a8, num_experts, hidden, weights.down_proj.shape[1], top_k, int(hidden_states.shape[0]),
               hidden_states.device, hidden_states.dtype, weights.format, shared_inter)
        config = self._configs.get(key)
        if config is None:
            if decode:
                config = decode_config(*key[2:])
            else:
                config = (w8a8_launch_config if w8a8 else launch_config)(*key[2:-1])
            self._configs[key] = config
        return config

    def _decode_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """``weights`` with each quantized projection replaced by its repacked copy (decode-sized tiles: the weight is
        the MMA's register operand, see :mod:`~nxd_moe.triton_kernels.repack`) where there is one; W8A8 runs its own
        kernels on the stored K-major FP8."""
        if not self.repack or weights.activation_quantization is not None:
            return weights
        projections = []
        for w in (weights.gate_up_proj, weights.down_proj):
            if isinstance(w, QuantizedWeight) and w.format.name in REPACKED_CODES:
                w = repacked(w) or w
            projections.append(w)
        return weights._replace(gate_up_proj=projections[0], down_proj=projections[1])

    def _one_launch(self, num_tokens: int, top_k: int, weights: ExpertWeights) -> bool:
        """Whether this decode runs in one launch (see ``one_launch``; W8A8 runs its own FP8 kernels, which the
        persistent kernel does not have)."""
        if (self.one_launch is False or not persistent_decode.applies(num_tokens, top_k)
                or weights.activation_quantization is not None):
            return False
        if self.one_launch:
            return True
        if (in_replayed_steps() and num_tokens * top_k >= REPLAYED_SEPARATE_PAIRS
                and weights.num_experts <= REPLAYED_SEPARATE_EXPERTS):
            return False
        return weights.format == "bf16"

    @property
    def mode_policy(self) -> ModePolicy:
        """On a GPU the tiled kernels never compute an empty row and read each used expert's weights once per
        tile, so all-experts (every expert's weights, ``E/k`` times the FLOPs) never wins and is only run when
        forced; NxD's ``T*k >= alpha*E`` switch to it -- right for Trainium's DMA -- is not applied, nor its
        all-experts prefill below one block. Capacity factor still applies to prefill. A dropless prefill of
        decode size (``T*k`` within one launch's pairs: a short prompt at batch 1) runs as the decode of the same
        size does -- selective loading, the one-launch decode where it applies -- since it is the same computation:
        the blockwise kernels' sort and separate launches cost it more than they save (measured: a 128-token
        Qwen3-30B-A3B prefill in eager ``generate``). Larger prefills are blockwise; tiny ones selective loading,
        as in NxD. The rule reads ``T`` only, so the transformers experts seam (which cannot tell decode from
        prefill) gets the same answer."""
        return ModePolicy(all_experts=False, pairs_up_to=persistent_decode.MAX_PAIRS)

    def build_routing(self, expert_affinities, expert_index, num_experts, normalize, prescale, padding_mask=None):
        """One fused kernel instead of the torch version's chain of small ones (decode latency)."""
        if torch.compiler.is_compiling():
            return compiled.build_routing(self, expert_affinities, expert_index, num_experts, normalize, prescale,
                                          padding_mask)
        _check_device(expert_affinities)
        return fused_routing(expert_affinities, expert_index, num_experts, normalize, prescale, padding_mask)

    def build_local_routing(self, pair_expert, pair_weight, local_slot, num_local, prescale):
        """One kernel instead of the torch version's dozen (the local compute of an expert-parallel step)."""
        if torch.compiler.is_compiling():
            return compiled.build_local_routing(self, pair_expert, pair_weight, local_slot, num_local, prescale)
        _check_device(pair_weight)
        return fused_local_routing(pair_expert, pair_weight, local_slot, num_local, prescale)

    def block_mapping(self, routing: Routing, weights: ExpertWeights, block_size: int, n_blocks: int,
                      optimized: bool) -> BlockMapping:
        """NxD's mapping and the GPU tiles from the two routing-metadata kernels (``optimized`` changes how the
        torch version computes the same mapping; it has no meaning here)."""
        if torch.compiler.is_compiling():
            return compiled.block_mapping(self, routing, weights, block_size, n_blocks)
        _check_device(routing.affinities)
        config = self._config(routing.affinities, weights, routing.expert_index.shape[1])
        mapping, tiles = routing_layout(routing.expert_mask, routing.expert_index, block_size, n_blocks,
                                        config["block_m"])
        return mapping._replace(tiles=tiles)

    def _run(self, hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights, layout: TileLayout,
             config: dict, addend: torch.Tensor | None, pair_expert: torch.Tensor | None = None) -> torch.Tensor:
        """gate/up -> down -> combine (+ ``addend``) over ``layout``; ``pair_expert (T, K)``: the expert of each
        of ``layout.pair_row``'s pairs (default: the routing's top-k)."""
        x = hidden_states.contiguous()
        affinities = routing.affinities.contiguous()
        if weights.activation_quantization is not None:  # W8A8: FP8 x FP8 GEMMs (w8a8.py)
            rows = w8a8_expert_rows(x, layout, weights, affinities if routing.prescale else None, config)
        elif self.persistent_prefill and prefill_gemm.applies(x, weights, layout.block_m):
            # Prefill tiles of 16-bit weights on Hopper+: persistent TMA GEMMs (prefill_gemm.py).
            prefill = config.get("prefill") or prefill_gemm.default_prefill_config(layout.block_m,
                                                                                  weights.down_proj.shape[1])
            rows = prefill_gemm.expert_rows(x, layout, weights, affinities if routing.prescale else None, prefill,
                                            config)
        else:
            if config["block_m"] < 64:  # decode-sized tiles (prefill tiles read the stored layout)
                weights = self._decode_weights(weights)
            activated = gate_up_projection(x, layout, weights.gate_up_proj, weights.gate_up_bias, weights.activation,
                                           affinities if routing.prescale else None, config["gate_up"])
            rows = down_projection(activated, layout, weights.down_proj, weights.down_bias, config["down"])
        pair_expert = routing.expert_index if pair_expert is None else pair_expert
        return combine_rows(rows, layout.pair_row, pair_expert, affinities, routing.prescale, x.dtype, addend)

    def blockwise(self, hidden_states, routing, mapping, weights, config, addend=None):
        if torch.compiler.is_compiling():
            return compiled.experts(self, "blockwise", hidden_states, routing, weights, addend, mapping=mapping)[0]
        _check_device(hidden_states)
        launch = self._config(hidden_states, weights, routing.expert_index.shape[1])
        tiles = mapping.tiles
        if not isinstance(tiles, TileLayout) or tiles.block_m != launch["block_m"]:
            # A mapping made elsewhere (the torch implementation, another backend): tile it here.
            tiles = self.block_mapping(routing, weights, mapping.block_size, mapping.num_blocks, True).tiles
        return self._run(hidden_states, routing, weights, tiles, launch, addend)

    def selective_loading(self, hidden_states, routing, weights, addend=None):
        """Decode sizes run as one persistent launch (:mod:`~nxd_moe.triton_kernels.persistent_decode`); larger
        problems as the separate kernels with decode-sized tiles."""
        if torch.compiler.is_compiling():
            return compiled.experts(self, "selective_loading", hidden_states, routing, weights, addend)[0]
        _check_device(hidden_states)
        num_tokens, top_k = routing.expert_index.shape
        if self._one_launch(num_tokens, top_k, weights):
            return persistent_decode.selective_loading(hidden_states, routing, self._decode_weights(weights),
                                                       self._config(hidden_states, weights, top_k, decode=True),
                                                       addend)
        launch = self._config(hidden_states, weights, routing.expert_index.shape[1])
        block_m = launch["block_m"]
        num_tokens, top_k = routing.expert_index.shape
        _, tiles = routing_layout(routing.expert_mask, routing.expert_index, block_m,
                                  num_blocks(num_tokens, top_k, routing.expert_mask.shape[1], block_m), block_m)
        return self._run(hidden_states, routing, weights, tiles, launch, addend)

    def capacity_factor(self, hidden_states, routing, capacity, weights, addend=None):
        if torch.compiler.is_compiling():
            out, dropped = compiled.experts(self, "capacity_factor", hidden_states, routing, weights, addend,
                                            capacity=capacity)
            return out, dropped
        _check_device(hidden_states)
        launch = self._config(hidden_states, weights, routing.expert_index.shape[1])
        block_m = launch["block_m"]
        kept, rank, dropped = admit(routing.expert_mask, capacity)
        tiles = _static_layout(kept, rank, -(-capacity // block_m) * block_m, routing.expert_index, block_m)
        return self._run(hidden_states, routing, weights, tiles, launch, addend), dropped

    def all_experts(self, hidden_states, routing, weights, addend=None):
        if torch.compiler.is_compiling():
            return compiled.experts(self, "all_experts", hidden_states, routing, weights, addend)[0]
        _check_device(hidden_states)
        launch = self._config(hidden_states, weights, routing.expert_index.shape[1])
        block_m = launch["block_m"]
        num_tokens, num_experts = routing.expert_mask.shape
        everyone = torch.ones_like(routing.expert_mask)
        rank = torch.arange(num_tokens, device=hidden_states.device).unsqueeze(1).expand(num_tokens, num_experts)
        tiles = _static_layout(everyone, rank, -(-num_tokens // block_m) * block_m, None, block_m)
        # Only the chosen pairs are combined: unchosen rows are computed (that is the algorithm) but never read.
        pair_row = torch.where(routing.expert_mask, tiles.pair_row, torch.full_like(tiles.pair_row, tiles.num_rows))
        every_expert = torch.arange(num_experts, device=hidden_states.device).expand(num_tokens, num_experts)
        return self._run(hidden_states, routing, weights, tiles._replace(pair_row=pair_row), launch, addend,
                         every_expert)

    def fused_router(self, hidden_states, router):
        """A router with fused parts (:meth:`~nxd_moe.routing.topk.RouterTopK.fused_parts`: a top-k router with an
        fp32 weight, no training jitter) as one kernel (:mod:`~nxd_moe.triton_kernels.router`) instead of torch's
        fp32 copy, SIMT fp32 GEMM, top-k, activation and scatter, where ``fuse_router`` asks for it; else None."""
        wanted = (hidden_states.shape[0] >= router_kernel.MIN_TOKENS if self.fuse_router is None
                  else self.fuse_router)
        if not wanted or router is None or not router_kernel.applies(hidden_states, router.weight, router.top_k):
            return None
        return self.router_top_k(hidden_states, router.weight, router.bias, router.top_k, router.sigmoid,
                                 router.act_over_topk)

    def router_top_k(self, hidden_states, weight, bias, top_k: int, sigmoid: bool, act_over_topk: bool):
        """The router kernel's launch (:func:`~nxd_moe.triton_kernels.router.router_top_k`)."""
        if torch.compiler.is_compiling():
            return compiled.router_top_k(self, hidden_states, weight, bias, top_k, sigmoid, act_over_topk)
        _check_device(hidden_states)
        return router_kernel.router_top_k(hidden_states, weight, bias, top_k, sigmoid, act_over_topk)

    def fused_decode(self, hidden_states, router, weights, prescale, shared):
        """A single-device decode layer in one launch when everything in it has a fused form (the router's and
        the shared experts' parts, an activation the kernels have) and the decode runs in one launch; else
        None."""
        if router is None or not self._one_launch(hidden_states.shape[0], router.top_k, weights):
            return None
        if shared is not None and shared.hidden_act not in ACTIVATIONS:
            return None
        return self.moe_decode(hidden_states, router, weights, prescale, shared)

    def moe_decode(self, hidden_states, router: RouterParts, weights: ExpertWeights, prescale: bool,
                   shared: SharedParts | None):
        """The one-launch decode's launch (:func:`~nxd_moe.triton_kernels.persistent_decode.moe_decode`)."""
        if torch.compiler.is_compiling():
            return compiled.moe_decode(self, hidden_states, router, weights, prescale, shared)
        _check_device(hidden_states)
        return persistent_decode.moe_decode(hidden_states, router, self._decode_weights(weights),
                                            self._config(hidden_states, weights, router.top_k, decode=True,
                                                         shared_inter=0 if shared is None else shared.gate.shape[1]),
                                            prescale, shared)

    def __repr__(self) -> str:
        options = {"configs": self.configs, "decode_configs": self.decode_configs}
        shown = [f"{name}={value!r}" for name, value in options.items() if value is not None]
        shown += [] if self.one_launch is None else [f"one_launch={self.one_launch}"]
        shown += [] if self.persistent_prefill else ["persistent_prefill=False"]
        shown += [] if self.repack else ["repack=False"]
        shown += [] if self.fuse_router is None else [f"fuse_router={self.fuse_router}"]
        return f"TritonBackend({', '.join(shown)})"
