"""The backend seam: one contract for the expert computation, implementations picked by name.

A backend receives what the front end (``ExpertMLPsV2``) prepared -- hidden states, :class:`Routing`, and for
blockwise the :class:`BlockMapping` -- plus the weights, and returns the ``(T, H)`` output with the top-k
combine done. Routing, mapping and mode selection are shared, so every backend computes the same function
and is tested against the same dense reference.

``BACKENDS`` maps a name to the ``module:Class`` that implements it, imported on first use so an optional
backend's dependencies are only needed by those who ask for it.
"""

from __future__ import annotations

import abc
import importlib

import torch

from nxd_moe.checks import check_bool
from nxd_moe.experts.blockwise import blockwise_forward
from nxd_moe.experts.capacity import capacity_factor_forward
from nxd_moe.experts.decode import all_experts_forward, selective_loading_forward
from nxd_moe.experts.dynamic_while import dynamic_while_blockwise_forward
from nxd_moe.experts.grouped_matmul import MATMUL_IMPLS, grouped_mm_applies
from nxd_moe.experts.local_routing import local_routing
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import NXD_POLICY, ExpertsMode, ModePolicy, select_mode
from nxd_moe.experts.routing_inputs import Routing, build_routing
from nxd_moe.experts.token_mapping import BlockMapping, token_to_block_mapping
from nxd_moe.layer_parts import RouterParts, SharedParts
from nxd_moe.moe_configs import BlockwiseMatmulConfig
from nxd_moe.quantization import QUANTIZATION_CHOICES


class ExpertsBackend(abc.ABC):
    """One implementation of the four expert algorithms.

    ``fuses_layers``: the backend has fused forms of more than the experts (:meth:`fused_decode`,
    :meth:`fused_router`), which ``MoE`` then offers the layer's parts to.
    ``fuses_addend``: the four methods also take ``addend=`` -- a ``(T, H)`` tensor (the shared experts'
    output) to add inside the backend's last pass; otherwise the front end adds it to the result.
    ``supported_formats``: the weight formats (:data:`nxd_moe.quantization.QUANTIZATION_CHOICES`) whose
    :class:`ExpertWeights` the backend computes with; ``ExpertMLPsV2`` refuses any other at construction.
    ``supports_activation_quantization``: the backend computes W8A8 (``ExpertWeights.activation_quantization``,
    FP8 activations); ``ExpertMLPsV2`` refuses a layer that asks for it otherwise.
    """

    name: str
    fuses_addend: bool = False
    fuses_layers: bool = False
    supported_formats: frozenset[str] = frozenset({"bf16"})
    supports_activation_quantization: bool = False

    @property
    def mode_policy(self) -> ModePolicy:
        """What this backend changes in the one mode rule (:class:`~nxd_moe.experts.mode.ModePolicy`): nothing by
        default."""
        return NXD_POLICY

    def select_mode(self, num_tokens: int, seq_len: int | None, top_k: int, num_experts: int, block_size: int,
                    capacity_factor: float | None, selective_loading_threshold: float) -> ExpertsMode:
        """The algorithm for a forward of these static shapes: the one rule
        (:func:`~nxd_moe.experts.mode.select_mode`) under this backend's :attr:`mode_policy`."""
        return select_mode(num_tokens, seq_len, top_k, num_experts, block_size, capacity_factor,
                           selective_loading_threshold, self.mode_policy)

    def select_mode_from_tokens(self, num_tokens: int, top_k: int, num_experts: int, block_size: int,
                                selective_loading_threshold: float) -> ExpertsMode:
        """The algorithm for ``num_tokens`` tokens when the caller cannot tell decode from prefill (transformers'
        experts seam sees ``T`` alone: a decode step of ``B`` sequences is ``T = B``): NxD's dropless prefill rule,
        which depends on ``T`` only; a backend may prefer its decode form where ``T`` is decode-sized."""
        return self.select_mode(num_tokens, None, top_k, num_experts, block_size, None, selective_loading_threshold)

    def build_routing(self, expert_affinities: torch.Tensor, expert_index: torch.Tensor, num_experts: int,
                      normalize: bool, prescale: bool, padding_mask: torch.Tensor | None = None) -> Routing:
        """The router's output in the algorithms' form (:func:`~nxd_moe.experts.routing_inputs.build_routing`;
        a backend may compute the same tensors its own way)."""
        return build_routing(expert_affinities, expert_index, num_experts, normalize, prescale, padding_mask)

    def build_local_routing(self, pair_expert: torch.Tensor, pair_weight: torch.Tensor, local_slot: torch.Tensor,
                            num_local: int, prescale: bool) -> Routing:
        """Pairs handed to a module holding ``num_local`` of the experts, as a routing over those
        (:func:`~nxd_moe.experts.local_routing.local_routing`; a backend may compute the same tensors its own
        way)."""
        return local_routing(pair_expert, pair_weight, local_slot, num_local, prescale)

    def block_mapping(self, routing: Routing, weights: ExpertWeights, block_size: int, num_blocks: int,
                      optimized: bool) -> BlockMapping:
        """The token->block mapping of a blockwise forward (a backend may compute it its own way, and attach
        its own tiling as ``BlockMapping.tiles``; the mapping itself must be the shared one)."""
        return token_to_block_mapping(routing.expert_mask, routing.expert_index, block_size, num_blocks, optimized)

    def fused_decode(self, hidden_states: torch.Tensor, router: RouterParts | None,
                     weights: ExpertWeights | None, prescale: bool, shared: SharedParts | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Optional (backends with ``fuses_layers``): a whole single-device decode layer -- router, routing, routed
        experts, shared experts and combine -- in the backend's own fused form, from plain parts
        (:mod:`nxd_moe.layer_parts`): ``router`` (the layer's normalisation and ``padding (T,)``, True = real
        token, filled in; None where the layer's router, shared experts or shapes have no fused form, and then
        the other parts are None too), the routed experts' ``weights``, ``prescale`` (the affinity scales the
        expert input) and ``shared`` (None: no shared
        experts), on ``hidden_states (T, H)`` (after any norm; padded tokens' rows are zeroed by the caller).
        Returns ``(output (T, H), router_logits (T, E), expert_index (T, k))`` -- the same function as the unfused
        layer -- or None (the caller then runs the modules as usual). ``MoE`` calls it for decode (``S == 1``) on
        one device, without stats or input validation."""
        return None

    def fused_router(self, hidden_states: torch.Tensor, router: RouterParts | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Optional (backends with ``fuses_layers``): the router given as plain parts (None: it has none) on
        ``hidden_states (T, H)`` in the backend's own fused form, returning what the router module returns --
        ``(router_logits (T, E), expert_affinities (T, E), expert_index (T, k))`` -- or None (the caller runs the
        router)."""
        return None

    @abc.abstractmethod
    def blockwise(self, hidden_states: torch.Tensor, routing: Routing, mapping: BlockMapping,
                  weights: ExpertWeights, config: BlockwiseMatmulConfig) -> torch.Tensor:
        """Dropless prefill over the given block mapping."""

    @abc.abstractmethod
    def capacity_factor(self, hidden_states: torch.Tensor, routing: Routing, capacity: int,
                        weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(output, dropped assignments as a 0-d tensor)``."""

    @abc.abstractmethod
    def selective_loading(self, hidden_states: torch.Tensor, routing: Routing,
                          weights: ExpertWeights) -> torch.Tensor:
        """Decode reading only the chosen experts."""

    @abc.abstractmethod
    def all_experts(self, hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        """Every token through every expert, unchosen outputs masked out."""


class TorchBackend(ExpertsBackend):
    """Plain PyTorch on any device: the reference backend, and the one XLA traces.

    ``matmul``: ``"auto"`` | ``"gather"`` | ``"grouped_mm"`` (see :mod:`nxd_moe.experts.grouped_matmul`).
    ``pairs=True``: every dropless forward runs the ``T*k`` pairs sorted by expert (selective loading) instead of
    NxD's Trainium rules -- the cheapest on a CPU or GPU where ``grouped_mm`` applies (:meth:`pairs_cheapest`);
    ``patch_model`` picks it there. The same function either way (dropless): only the algorithm differs.
    """

    name = "torch"
    supported_formats = frozenset(QUANTIZATION_CHOICES)
    # W8A8 as the reference: the activations are quantized and dequantized in front of each GEMM, same math.
    supports_activation_quantization = True

    def __init__(self, matmul: str = "auto", pairs: bool = False):
        if matmul not in MATMUL_IMPLS:
            raise ValueError(f"TorchBackend matmul must be one of {list(MATMUL_IMPLS)}, got {matmul!r}")
        self.matmul = matmul
        self.pairs = check_bool("TorchBackend pairs", pairs)

    def blockwise(self, hidden_states, routing, mapping, weights, config):
        if config.use_dynamic_while:
            return dynamic_while_blockwise_forward(hidden_states, routing, mapping, weights, config,
                                                   self.matmul).output
        return blockwise_forward(hidden_states, routing, mapping, weights, self.matmul)

    def capacity_factor(self, hidden_states, routing, capacity, weights):
        return capacity_factor_forward(hidden_states, routing, capacity, weights)

    def selective_loading(self, hidden_states, routing, weights):
        return selective_loading_forward(hidden_states, routing, weights, self.matmul)

    def all_experts(self, hidden_states, routing, weights):
        return all_experts_forward(hidden_states, routing, weights)

    @property
    def mode_policy(self) -> ModePolicy:
        """NxD's rule; with ``pairs``, selective loading for every dropless forward."""
        return ModePolicy(pairs_always=True) if self.pairs else NXD_POLICY

    def pairs_cheapest(self, device: torch.device, dtype: torch.dtype, weight_dims: tuple[int, ...]) -> bool:
        """Whether the ``T*k`` (token, expert) pairs sorted by expert (selective loading) are this backend's
        cheapest algorithm at every ``T`` for rows and weights of ``dtype`` on ``device`` (``weight_dims``: the
        projections' last two dims, ``(H, 2I, I, H)``): off XLA wherever ``grouped_mm`` multiplies them, with no
        weight copies and no padding -- what transformers' own default does. NxD's rules are Trainium's: blockwise
        pads every expert to ``block_size`` rows (512 by default), and all-experts from ``T*k >= alpha*E``
        computes ``E/k`` times the pairs; eager matmuls pay both in full."""
        return (device.type != "xla" and self.matmul != "gather"
                and grouped_mm_applies(device, dtype, dtype, weight_dims))

    def __repr__(self) -> str:
        return f"TorchBackend(matmul={self.matmul!r}{', pairs=True' if self.pairs else ''})"


BACKENDS: dict[str, str] = {
    "torch": "nxd_moe.experts.backends:TorchBackend",
    "nki_sim": "nxd_moe.nki_kernels.backend:NkiSimBackend",
    "triton": "nxd_moe.triton_kernels.backend:TritonBackend",
}


def get_backend(backend: str | ExpertsBackend) -> ExpertsBackend:
    """A backend instance from its name (or the instance itself)."""
    if isinstance(backend, ExpertsBackend):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or an ExpertsBackend, got {backend!r}")
    module_name, class_name = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


def check_backend_supports(backend: ExpertsBackend, quantization: str, activation_quantization: str = "none") -> None:
    """Raise unless ``backend`` computes with expert weights stored as ``quantization`` and activations as
    ``activation_quantization``."""
    if quantization not in backend.supported_formats:
        raise ValueError(f"backend {backend.name!r} does not support quantization={quantization!r}; it supports "
                         f"{sorted(backend.supported_formats)} (the 'torch' backend supports "
                         f"{list(QUANTIZATION_CHOICES)})")
    if activation_quantization != "none" and not backend.supports_activation_quantization:
        raise ValueError(f"backend {backend.name!r} does not support activation_quantization="
                         f"{activation_quantization!r} (FP8 activations, W8A8); the 'torch' and 'triton' backends do")
