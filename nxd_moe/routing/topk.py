"""Standard top-k routing (Mixtral, Qwen3-MoE, DBRX, GPT-OSS, Llama 4)."""

from __future__ import annotations

import torch

from nxd_moe.layer_parts import RouterParts
from nxd_moe.routing.base import RouterBase


class RouterTopK(RouterBase):
    """Top-k over the logits.

    - ``apply_act_fn_over_topk=False``: affinities are ``act(logits)`` over all E experts (softmax: Mixtral,
      Qwen3, DBRX; sigmoid: Llama 4); normalisation over the chosen k, if any, happens in the experts.
    - ``apply_act_fn_over_topk=True``: the activation sees only the k chosen logits (GPT-OSS: softmax over its
      top-4), and the other affinities are 0.

    The constructor is :class:`RouterBase`'s, which has NxD's ``RouterTopK`` signature.
    """

    def forward(self, hidden_states: torch.Tensor):
        logits = self.get_router_logits(hidden_states)
        top_logits, expert_index = torch.topk(logits, self.top_k, dim=-1)
        if self.apply_act_fn_over_topk:
            affinities = torch.zeros_like(logits).scatter(1, expert_index, self.apply_activation_fn(top_logits))
        else:
            affinities = self.apply_activation_fn(logits)
        return logits, affinities, expert_index.detach()

    def fused_parts(self) -> RouterParts | None:
        """``logits = x @ W.T (+ b)`` in float32, top-k, the activation: as plain parts (``normalize`` False and no
        ``padding``: the layer's, which the caller fills in), where a fused kernel computes exactly this router --
        a float32 weight, no training jitter, and this class's own computation (a subclass that changes
        ``forward``, the logits or the activation runs as it is); else None."""
        own = all(getattr(type(self), name) is getattr(RouterTopK, name)
                  for name in ("forward", "get_router_logits", "apply_activation_fn"))
        weight = self.linear_router.weight
        if not own or weight.dtype != torch.float32 or (self.training and self.jitter_eps > 0):
            return None
        return RouterParts(weight, self.linear_router.bias, self.top_k, self.act_fn == "sigmoid",
                           self.apply_act_fn_over_topk, False, None)
