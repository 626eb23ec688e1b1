"""DeepSeek-V3's group-limited, auxiliary-loss-free routing ("noaux_tc")."""

from __future__ import annotations

import torch

from nxd_moe.checks import check_bool, check_float, check_int
from nxd_moe.routing.base import RouterBase


class GroupLimitedRouter(RouterBase):
    """Sigmoid scores; experts are chosen only from the ``topk_group`` best of ``n_group`` groups.

    ``choice = sigmoid(logits) + e_score_correction_bias`` ranks experts (the bias steers load balance and
    never enters the weights); a group scores the sum of its best two choices; the top-k experts of the
    kept groups are selected, and their weights are the un-biased sigmoid scores, optionally L1-normalised
    (``normalize``) and multiplied by ``routed_scaling_factor``.

    Fixes relative to NxD: ``e_score_correction_bias`` is a registered buffer (so checkpoints load it),
    normalisation and scaling happen here, and discarded groups are masked with ``-inf`` rather than 0 so a
    negative correction bias can never let a discarded expert win. The returned affinities hold the final
    weights at the chosen experts and 0 elsewhere; pair this router with ``normalize_top_k_affinities=False``.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        n_group: int,
        topk_group: int,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        device=None,
        tensor_model_parallel_group=None,
        jitter_eps: float = 0.0,
        normalize: bool = False,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__(num_experts, top_k, hidden_size, sequence_parallel_enabled, sequence_dimension, dtype, device,
                         tensor_model_parallel_group=tensor_model_parallel_group, act_fn="sigmoid",
                         jitter_eps=jitter_eps)
        self.n_group = check_int("GroupLimitedRouter.n_group", n_group, minimum=1, maximum=num_experts)
        if num_experts % n_group:
            raise ValueError(f"GroupLimitedRouter.n_group ({n_group}) must divide num_experts ({num_experts})")
        self.topk_group = check_int("GroupLimitedRouter.topk_group", topk_group, minimum=1, maximum=n_group)
        experts_per_group = num_experts // n_group
        if top_k > topk_group * experts_per_group:
            raise ValueError(
                f"GroupLimitedRouter.top_k ({top_k}) must be <= topk_group * num_experts / n_group "
                f"({topk_group} * {experts_per_group}), the number of experts in the kept groups"
            )
        self.normalize = check_bool("GroupLimitedRouter.normalize", normalize)
        self.routed_scaling_factor = check_float("GroupLimitedRouter.routed_scaling_factor", routed_scaling_factor,
                                                 positive=True)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))

    def forward(self, hidden_states: torch.Tensor):
        logits = self.get_router_logits(hidden_states)
        num_tokens = logits.shape[0]
        per_group = self.num_experts // self.n_group
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.to(scores.dtype)
        group_scores = choice.view(num_tokens, self.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
        kept_groups = torch.topk(group_scores, self.topk_group, dim=-1).indices
        group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept_groups, True)
        expert_kept = group_kept.unsqueeze(-1).expand(num_tokens, self.n_group, per_group).reshape(num_tokens, -1)
        expert_index = torch.topk(choice.masked_fill(~expert_kept, float("-inf")), self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_index)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        affinities = torch.zeros_like(scores).scatter(1, expert_index, weights)
        return logits, affinities, expert_index.detach()
