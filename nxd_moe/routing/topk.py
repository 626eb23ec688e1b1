"""Standard top-k routing (Mixtral, Qwen3-MoE, DBRX, GPT-OSS, Llama 4)."""

from __future__ import annotations

import torch

from nxd_moe.routing.base import RouterBase


class RouterTopK(RouterBase):
    """Top-k over the logits.

    - ``apply_act_fn_over_topk=False``: affinities are ``act(logits)`` over all E experts (softmax: Mixtral,
      Qwen3, DBRX; sigmoid: Llama 4); normalisation over the chosen k, if any, happens in the experts.
    - ``apply_act_fn_over_topk=True``: the activation sees only the k chosen logits (GPT-OSS: softmax over its
      top-4), and the other affinities are 0.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        device=None,
        bias: bool = False,
        tensor_model_parallel_group=None,
        act_fn: str = "softmax",
        apply_act_fn_over_topk: bool = False,
        jitter_eps: float = 0.0,
    ):
        super().__init__(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            act_fn=act_fn,
            sequence_parallel_enabled=sequence_parallel_enabled,
            sequence_dimension=sequence_dimension,
            dtype=dtype,
            device=device,
            bias=bias,
            tensor_model_parallel_group=tensor_model_parallel_group,
            jitter_eps=jitter_eps,
            apply_act_fn_over_topk=apply_act_fn_over_topk,
        )

    def forward(self, hidden_states: torch.Tensor):
        logits = self.get_router_logits(hidden_states)
        top_logits, expert_index = torch.topk(logits, self.top_k, dim=-1)
        if self.apply_act_fn_over_topk:
            affinities = torch.zeros_like(logits).scatter(1, expert_index, self.apply_activation_fn(top_logits))
        else:
            affinities = self.apply_activation_fn(logits)
        return logits, affinities.to(hidden_states.dtype), expert_index.detach()
