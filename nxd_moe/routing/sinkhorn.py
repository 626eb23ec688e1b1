"""Top-1 routing balanced by Sinkhorn iterations during training (S-BASE)."""

from __future__ import annotations

import torch

from nxd_moe.checks import check_int
from nxd_moe.routing.base import RouterBase

DEFAULT_SINKHORN_ITERATIONS = 30


def sinkhorn(cost: torch.Tensor, iterations: int, eps: float = 1e-8) -> torch.Tensor:
    """Scale rows and columns of a positive ``(T, E)`` matrix towards uniform marginals.

    A fixed iteration count (rather than a tolerance loop) keeps the graph static.
    """
    num_tokens, num_experts = cost.shape
    row_scale = torch.ones(num_tokens, dtype=cost.dtype, device=cost.device)
    col_scale = torch.ones(num_experts, dtype=cost.dtype, device=cost.device)
    for _ in range(iterations):
        row_scale = (1.0 / num_tokens) / ((cost * col_scale).sum(dim=1) + eps)
        col_scale = (1.0 / num_experts) / ((cost * row_scale.unsqueeze(1)).sum(dim=0) + eps)
    return cost * row_scale.unsqueeze(1) * col_scale


class RouterSinkhorn(RouterBase):
    """Top-1 router: training picks ``argmax`` of the Sinkhorn-balanced assignment, eval picks ``argmax`` of
    the logits. Affinities are ``act(logits)`` (sigmoid by default)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        act_fn: str = "sigmoid",
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        device=None,
        sinkhorn_iterations: int | None = None,
        tensor_model_parallel_group=None,
        jitter_eps: float = 0.0,
    ):
        if top_k != 1:
            raise ValueError(f"RouterSinkhorn supports top_k=1 only, got top_k={top_k}")
        super().__init__(num_experts, top_k, hidden_size, sequence_parallel_enabled, sequence_dimension, dtype, device,
                         tensor_model_parallel_group=tensor_model_parallel_group, act_fn=act_fn, jitter_eps=jitter_eps)
        self.sinkhorn_iterations = check_int(
            "RouterSinkhorn.sinkhorn_iterations",
            DEFAULT_SINKHORN_ITERATIONS if sinkhorn_iterations is None else sinkhorn_iterations,
            minimum=1,
        )

    def forward(self, hidden_states: torch.Tensor):
        logits = self.get_router_logits(hidden_states)
        affinities = self.apply_activation_fn(logits)
        if self.training:
            with torch.no_grad():
                # exp of shifted logits: the balanced assignment is invariant to a global scale, and this
                # cannot overflow.
                balanced = sinkhorn(torch.exp(logits - logits.max()), self.sinkhorn_iterations)
            expert_index = balanced.argmax(dim=-1, keepdim=True)
        else:
            expert_index = logits.argmax(dim=-1, keepdim=True)
        return logits, affinities, expert_index.detach()
