"""Capacity-factor MoE (token dropping): each expert takes at most C tokens, first come first served."""

from __future__ import annotations

import math

import torch

from nxd_moe.checks import check_float, check_int
from nxd_moe.experts.mlp import ExpertWeights, combine, dense_expert_mlp
from nxd_moe.experts.routing_inputs import Routing


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """NxD's capacity ``C = min(ceil(T * k * capacity_factor / E), T)``."""
    check_int("num_tokens", num_tokens, minimum=1)
    check_float("capacity_factor", capacity_factor, positive=True)
    return min(math.ceil(num_tokens * top_k * capacity_factor / num_experts), num_tokens)


def admit(expert_mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First come, first served: ``expert_mask (T, E)`` -> ``(kept (T, E), rank_in_expert (T, E), dropped)``.

    A token's rank is its order among the expert's tokens; ranks ``>= capacity`` are dropped. ``dropped`` counts
    the dropped (token, expert) assignments (a 0-d int64 tensor).
    """
    rank_in_expert = torch.cumsum(expert_mask.to(torch.int64), dim=0) - 1
    kept = expert_mask & (rank_in_expert < capacity)
    return kept, rank_in_expert, (expert_mask & ~kept).sum()


def capacity_factor_forward(
    hidden_states: torch.Tensor,
    routing: Routing,
    capacity: int,
    weights: ExpertWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, H) -> ((T, H), dropped)``. Tokens are admitted in token order; an expert's (C+1)-th token
    onwards is dropped from that expert (its other experts still count). ``dropped`` is the number of
    dropped (token, expert) assignments, a 0-d int64 tensor (reading it is the caller's choice)."""
    num_tokens, hidden = hidden_states.shape
    num_experts = routing.expert_mask.shape[1]  # not the property: Dynamo 2.9 cannot multiply it by an int
    device = hidden_states.device
    kept, rank_in_expert, dropped = admit(routing.expert_mask, capacity)

    num_slots = num_experts * capacity
    experts = torch.arange(num_experts, device=device)
    slot = experts * capacity + rank_in_expert  # (T, E), meaningful where kept
    # Scratch slot num_slots absorbs every non-kept entry; empty slots point at the zero row T.
    scatter_at = torch.where(kept, slot, torch.full_like(slot, num_slots)).reshape(-1)
    token_ids = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(slot).reshape(-1)
    slot_token = torch.full((num_slots + 1,), num_tokens, dtype=torch.int64, device=device)
    slot_token = slot_token.scatter(0, scatter_at, token_ids)[:num_slots]

    padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden)])
    x = padded.index_select(0, slot_token).view(num_experts, capacity, hidden)
    if routing.prescale:
        affinities = torch.cat([routing.affinities, routing.affinities.new_zeros(1, num_experts)])
        slot_affinity = affinities[slot_token, experts.repeat_interleave(capacity)]
        x = x * slot_affinity.view(num_experts, capacity, 1).to(x.dtype)
    y = dense_expert_mlp(x, weights)

    pair_kept = kept.gather(1, routing.expert_index)
    pair_slot = torch.where(pair_kept, slot.gather(1, routing.expert_index), torch.full_like(routing.expert_index,
                                                                                              num_slots))
    return combine(y.reshape(num_slots, hidden), pair_slot, routing.pair_weights()), dropped
