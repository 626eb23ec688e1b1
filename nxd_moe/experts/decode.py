"""Decode-time algorithms: selective loading (only the chosen experts) and all-experts."""

from __future__ import annotations

import torch

from nxd_moe.experts.mlp import ExpertWeights, combine, dense_expert_mlp, grouped_expert_mlp
from nxd_moe.experts.routing_inputs import Routing


def selective_loading_forward(
    hidden_states: torch.Tensor,
    routing: Routing,
    weights: ExpertWeights,
    matmul_impl: str = "auto",
) -> torch.Tensor:
    """``(T, H) -> (T, H)``: each of the ``T*k`` (token, expert) pairs through its expert; only experts that
    some pair chose are touched. Pairs are sorted by expert so each expert's weights are read once."""
    num_tokens, hidden = hidden_states.shape
    top_k = routing.expert_index.shape[1]
    num_pairs = num_tokens * top_k
    pair_expert = routing.expert_index.reshape(-1)
    order = torch.argsort(pair_expert, stable=True)
    x = hidden_states.index_select(0, order // top_k)
    if routing.prescale:
        x = x * routing.affinities.gather(1, routing.expert_index).reshape(-1)[order].unsqueeze(1).to(x.dtype)
    y = grouped_expert_mlp(x.view(num_pairs, 1, hidden), weights, pair_expert[order], None, matmul_impl)
    row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(num_pairs, device=order.device))
    token_slot = torch.where(routing.pair_valid(), row_of_pair.view(num_tokens, top_k),
                             torch.full_like(routing.expert_index, num_pairs))
    return combine(y.view(num_pairs, hidden), token_slot, routing.pair_weights(), routing.has_padding)


def all_experts_forward(hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
    """``(T, H) -> (T, H)``: every token through every expert (all weights read once, no indirection), then
    the unchosen outputs are masked out of the sum."""
    if routing.prescale:
        x = hidden_states.unsqueeze(0) * routing.affinities.t().unsqueeze(-1).to(hidden_states.dtype)
        combine_weights = routing.expert_mask.t()
    else:
        x = hidden_states.unsqueeze(0)
        combine_weights = routing.affinities.t()
    y = dense_expert_mlp(x, weights)  # (E, T, H)
    acc_dtype = torch.promote_types(y.dtype, torch.float32)
    # where, not multiply: an unchosen expert's output must not leak NaN/Inf through a zero weight.
    weighted = torch.where(routing.expert_mask.t().unsqueeze(-1),
                           y.to(acc_dtype) * combine_weights.unsqueeze(-1).to(acc_dtype),
                           torch.zeros((), dtype=acc_dtype, device=y.device))
    return weighted.sum(dim=0).to(y.dtype)
