"""The MoE layer: route -> experts -> shared experts -> combine."""

from __future__ import annotations

import torch
import torch.nn as nn

from nxd_moe.checks import check_bool
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts.expert_mlps import check_expert_index
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.layer_parts import RouterParts, SharedParts
from nxd_moe.parallel.expert_parallel import ExpertParallel
from nxd_moe.parallel.shared_experts import shared_experts_forward
from nxd_moe.routing.base import RouterBase
from nxd_moe.shared_experts import SharedExperts
from nxd_moe.validation import FiniteWeightsOnLoad, check_finite, check_hidden_states, check_mask_dtype


class MoE(FiniteWeightsOnLoad, nn.Module):
    """NxD's ``MoE`` orchestrator.

    ``forward(hidden_states (B, S, H), padding_mask=None (B, S), is_speculative_decoding=False, residual=None)``
    returns a tuple ``(output (B, S, H)[, router_logits (T, E)][, expert_index (T, k)][, residual][, stats])``:

    - ``residual``: added to the input first (``h = hidden_states + residual``); ``h`` is returned as the new
      residual and ``output`` excludes it, so the caller adds it once, as in NxD.
    - ``rmsnorm``: applied to ``h`` before routing and experts.
    - ``padding_mask``: tokens with 0 take no block slot and no expert capacity, contribute nothing to other
      tokens, and get an all-zero output.
    - ``S == 1`` is decode (selective loading or all-experts); longer sequences, including multi-token
      speculation windows, follow the prefill rules. ``is_speculative_decoding`` (NxD's argument, in NxD's
      position) changes nothing: NxD uses it to send a speculation window to its fused decode kernel, which
      computes the same function as its unfused path.
    - ``return_stats=True`` appends an :class:`~nxd_moe.experts.ExpertsStats`.

    ``validate_inputs=True`` adds NaN/Inf checks on the input and the routing (host syncs); without them a
    NaN token still cannot corrupt other tokens' outputs.

    Under model parallelism (experts or shared experts built while :mod:`nxd_moe.parallel_state` is
    initialised) each rank passes its own tokens and gets their output: without ``sequence_parallel_enabled``
    the ranks of a tensor-parallel group pass the same ``(B, S, H)``; with it, each passes its ``(B, S/TP, H)``
    shard of the sequence (dimension 1) -- except in decode (``S == 1``), which is never sharded. The router
    runs on the rank's own tokens and only their top-k weights and indices travel (NxD's delayed gather);
    ``router_logits`` and ``expert_index`` are returned for the rank's own tokens. The dispatch and combine are
    :class:`~nxd_moe.parallel.ExpertParallel`'s; the whole step has static shapes and no host sync, so one CUDA
    graph captures it (:func:`nxd_moe.graphs.capture`).
    """

    def __init__(
        self,
        router: RouterBase,
        expert_mlps: ExpertMLPsV2,
        shared_experts: SharedExperts | None = None,
        rmsnorm: nn.Module | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        return_router_logits: bool = False,
        return_expert_index: bool = False,
        validate_inputs: bool = False,
    ):
        super().__init__()
        if not isinstance(router, RouterBase):
            raise TypeError(f"MoE: router must be a RouterBase, got {type(router).__name__}")
        if not isinstance(expert_mlps, ExpertMLPsV2):
            raise TypeError(f"MoE: expert_mlps must be an ExpertMLPsV2, got {type(expert_mlps).__name__}")
        if shared_experts is not None and not isinstance(shared_experts, SharedExperts):
            raise TypeError(f"MoE: shared_experts must be a SharedExperts or None, got {type(shared_experts).__name__}")
        cfg = expert_mlps.routed_experts_mlp_config
        for attr in ("num_experts", "top_k"):
            if getattr(router, attr) != getattr(cfg, attr):
                raise ValueError(f"MoE: inconsistent {attr}: router has {getattr(router, attr)}, "
                                 f"expert_mlps has {getattr(cfg, attr)}")
        widths = {cfg.hidden_size, cfg.hidden_size_actual or cfg.hidden_size}
        if router.hidden_size not in widths:
            raise ValueError(f"MoE: inconsistent hidden_size: router has {router.hidden_size}, "
                             f"expert_mlps accepts {sorted(widths)}")
        if shared_experts is not None and shared_experts.hidden_size != router.hidden_size:
            raise ValueError(f"MoE: inconsistent hidden_size: shared_experts has {shared_experts.hidden_size}, "
                             f"router has {router.hidden_size}")
        sequence_parallel_enabled = check_bool("MoE.sequence_parallel_enabled", sequence_parallel_enabled)
        if router.sequence_parallel_enabled and not sequence_parallel_enabled:
            raise ValueError("MoE: a sequence-parallel router needs MoE(sequence_parallel_enabled=True)")
        self.router = router
        self.expert_mlps = expert_mlps
        self.shared_experts = shared_experts
        self.rmsnorm = rmsnorm
        self.sequence_parallel_enabled = sequence_parallel_enabled
        # The sequence dimension of the (B, S, H) input (NxD's default 0 belongs to its (S, B, H) training layout).
        self.sequence_dimension = 1 if sequence_dimension is None and sequence_parallel_enabled else sequence_dimension
        if self._distributed and sequence_parallel_enabled and self.sequence_dimension != 1:
            raise ValueError(f"MoE: sequence parallelism shards dimension 1 (S) of the (B, S, H) input; "
                             f"sequence_dimension must be 1 or None, got {sequence_dimension}")
        self.return_router_logits = check_bool("MoE.return_router_logits", return_router_logits)
        self.return_expert_index = check_bool("MoE.return_expert_index", return_expert_index)
        self.validate_inputs = check_bool("MoE.validate_inputs", validate_inputs)
        self.expert_parallel = ExpertParallel(expert_mlps) if expert_mlps.is_sharded else None
        self._side_streams: dict = {}

    @property
    def hidden_size(self) -> int:
        return self.router.hidden_size

    @property
    def _distributed(self) -> bool:
        return self.expert_mlps.is_sharded or (
            self.shared_experts is not None and self.shared_experts.intermediate_shard is not None)

    def _on_side_stream(self, compute):
        """``compute()`` on a side stream of the current CUDA device (forked from the current stream, so a CUDA
        graph captures it); returns its result and the stream to join before using it."""
        main = torch.cuda.current_stream()
        side = self._side_streams.get(main.device)
        if side is None:
            side = self._side_streams[main.device] = torch.cuda.Stream(main.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = compute()
        out.record_stream(main)  # allocated on the side stream, read on the main one
        return out, side

    def forward(
        self,
        hidden_states: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        is_speculative_decoding: bool = False,
        residual: torch.Tensor | None = None,
        *,
        return_stats: bool = False,
    ) -> tuple:
        check_bool("MoE.forward is_speculative_decoding", is_speculative_decoding)
        check_hidden_states(hidden_states, self.hidden_size, "MoE: hidden_states")
        if hidden_states.dim() != 3:
            raise ValueError(f"MoE: hidden_states must be (B, S, H), got shape {tuple(hidden_states.shape)}")
        batch, seq_len, hidden = hidden_states.shape
        if batch * seq_len == 0:
            raise ValueError(f"MoE: hidden_states must hold at least one token, got shape {tuple(hidden_states.shape)}")
        if padding_mask is not None:
            check_mask_dtype(padding_mask, "MoE: padding_mask")
            if tuple(padding_mask.shape) != (batch, seq_len):
                raise ValueError(f"MoE: padding_mask must be (B, S) = ({batch}, {seq_len}), "
                                 f"got {tuple(padding_mask.shape)}")
        if residual is not None:
            if not isinstance(residual, torch.Tensor) or residual.shape != hidden_states.shape:
                raise ValueError(f"MoE: residual must have the shape of hidden_states {tuple(hidden_states.shape)}, "
                                 f"got {tuple(getattr(residual, 'shape', ())) or residual!r}")
            if residual.dtype != hidden_states.dtype:
                raise TypeError(f"MoE: residual dtype {residual.dtype} must match hidden_states dtype "
                                f"{hidden_states.dtype}")
            hidden_states = hidden_states + residual
            residual = hidden_states
        if self.validate_inputs:
            check_finite(hidden_states, "MoE: hidden_states")

        x = hidden_states if self.rmsnorm is None else self.rmsnorm(hidden_states)
        flat = x.reshape(batch * seq_len, hidden)
        token_is_real = None if padding_mask is None else padding_mask.reshape(-1).bool()
        fused = None
        if seq_len == 1 and self.expert_mlps.backend.fuses_layers and not (
                return_stats or self.validate_inputs or self._distributed):
            # The backend's one-launch decode of the whole layer, where it has one.
            fused = self.expert_mlps.backend.fused_decode(flat, *self._decode_parts(flat, token_is_real))
        if fused is not None:
            out, router_logits, expert_index = fused
            stats = None
        else:
            out, router_logits, expert_index, stats = self._layer(x, flat, token_is_real, seq_len, batch,
                                                                  return_stats)
        if token_is_real is not None:
            out = torch.where(token_is_real.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        result = [out.view(batch, seq_len, hidden)]
        if self.return_router_logits:
            result.append(router_logits)
        if self.return_expert_index:
            result.append(expert_index)
        if residual is not None:
            result.append(residual)
        if return_stats:
            result.append(stats)
        return tuple(result)

    def _decode_parts(self, flat: torch.Tensor, token_is_real: torch.Tensor | None
                      ) -> tuple[RouterParts | None, ExpertWeights | None, bool, SharedParts | None]:
        """The layer as the plain parts of a backend's fused decode (``ExpertsBackend.fused_decode``): router parts
        with the experts' normalisation and the padding, the routed experts' weights, whether the affinity scales
        the expert input, the shared experts' parts (None: none). Where the router, the shared experts or the shapes
        have no fused form, the router parts are None and nothing else is gathered (a decode step's host time)."""
        experts = self.expert_mlps
        cfg = experts.routed_experts_mlp_config
        prescale = cfg.early_expert_affinity_modulation
        router = self.router.fused_parts()
        if (router is None or router.top_k != cfg.top_k or cfg.hidden_size_actual is not None
                or flat.dtype != experts.dtype or flat.shape[1] != cfg.hidden_size):
            return None, None, prescale, None
        shared = None if self.shared_experts is None else self.shared_experts.fused_parts(flat.dtype)
        if self.shared_experts is not None and shared is None:
            return None, None, prescale, None
        router = router._replace(normalize=cfg.normalize_top_k_affinities, padding=token_is_real)
        return router, experts.expert_weights(), prescale, shared

    def _layer(self, x: torch.Tensor, flat: torch.Tensor, token_is_real: torch.Tensor | None, seq_len: int,
               batch: int, return_stats: bool):
        """Router, routed experts and shared experts as separate modules: ``(out (T, H), router_logits,
        expert_index, stats or None)``."""
        backend = self.expert_mlps.backend
        fused = backend.fused_router(flat, self.router.fused_parts()) if backend.fuses_layers else None
        router_logits, expert_affinities, expert_index = self.router(flat) if fused is None else fused
        if self.validate_inputs:
            check_finite(expert_affinities, "MoE: router expert_affinities")
            check_expert_index(expert_index, self.router.num_experts, "MoE: router expert_index")
        sharded_input = self._distributed and self.sequence_parallel_enabled and seq_len != 1
        # A whole shared expert's output goes into the routed experts' combine (one pass fewer where the backend
        # fuses it); a tensor-parallel one is added after. With an input of the wrong dtype it is not run first,
        # so that the experts' check reports it clearly.
        shared = side = None
        if self.shared_experts is not None and self.shared_experts.intermediate_shard is None \
                and flat.dtype == self.expert_mlps.dtype:
            if self.expert_parallel is not None and flat.is_cuda and not torch.compiler.is_compiling():
                # Across GPUs the shared expert runs on a side stream, beside the dispatch and the remote experts
                # (eager and nxd_moe.graphs.capture; under torch.compile, Inductor orders the graph's work itself).
                shared, side = self._on_side_stream(lambda: self.shared_experts(flat, seq_len))
            else:
                shared = self.shared_experts(flat, seq_len)
        routed_args = (flat, expert_affinities, expert_index)
        # The router's top-k ids are in [0, E) by construction: no range check on the hot path.
        routed_kwargs = dict(seq_len=seq_len, padding_mask=token_is_real, return_stats=return_stats,
                             check_index=False)
        if self.expert_parallel is None:
            routed = self.expert_mlps(*routed_args, addend=shared, **routed_kwargs)
        else:
            layout = self.expert_parallel.token_layout(batch, seq_len, sharded_input)
            routed = self.expert_parallel(*routed_args, token_layout=layout, addend=None if side else shared,
                                          **routed_kwargs)
        out, stats = routed if return_stats else (routed, None)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
            out = out + shared
        if self.shared_experts is not None and self.shared_experts.intermediate_shard is not None:
            out = out + shared_experts_forward(self.shared_experts, x, sharded_input).reshape(flat.shape)
        return out, router_logits, expert_index, stats
