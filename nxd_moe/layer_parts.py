"""The plain parts a backend's fused forms of a whole MoE layer take (the one-launch decode, the fused router):
tensors and flags, not modules, so no backend reads a module's internals or imports the routers. The modules give
their own (:meth:`~nxd_moe.routing.topk.RouterTopK.fused_parts`, :meth:`~nxd_moe.shared_experts.SharedExperts.
fused_parts`) or None where they have no such form."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RouterParts", "SharedParts"]


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
    with ``gate``, ``up (H, I_s)`` (same strides) and ``down (I_s, H)`` as ``(K, N)`` views of the stored weights
    and ``hidden_act`` the activation's name (a backend fuses the ones it has)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    hidden_act: str
