"""Dropless blockwise matmul (prefill): tokens gathered into fixed-size single-expert blocks."""

from __future__ import annotations

import torch

from nxd_moe.experts.mlp import ExpertWeights, combine, grouped_expert_mlp
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import BlockMapping


def gather_block_inputs(hidden_states: torch.Tensor, routing: Routing, mapping: BlockMapping) -> torch.Tensor:
    """``(T, H) -> (N, B, H)``: each block's token rows, zeros in padding slots (pre-scaled if asked)."""
    num_tokens, hidden = hidden_states.shape
    padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden)])
    # Padding slots (-1) read the appended zero row T, as the non-skipping kernels do.
    rows = torch.where(mapping.token_position_to_id >= 0, mapping.token_position_to_id,
                       torch.full_like(mapping.token_position_to_id, num_tokens))
    x = padded.index_select(0, rows)
    if routing.prescale:
        slot_expert = mapping.block_to_expert.repeat_interleave(mapping.block_size)
        affinities = torch.cat([routing.affinities, routing.affinities.new_zeros(1, routing.expert_mask.shape[1])])
        x = x * affinities[rows, slot_expert].unsqueeze(1).to(x.dtype)
    return x.view(mapping.num_blocks, mapping.block_size, hidden)


def blockwise_forward(
    hidden_states: torch.Tensor,
    routing: Routing,
    mapping: BlockMapping,
    weights: ExpertWeights,
    matmul_impl: str = "auto",
) -> torch.Tensor:
    """``(T, H) -> (T, H)``: every block through its expert, then each token sums its k slots.

    Vectorised over blocks: one grouped matmul per projection, no Python loop over blocks or tokens.
    """
    x = gather_block_inputs(hidden_states, routing, mapping)
    y = grouped_expert_mlp(x, weights, mapping.block_to_expert, mapping.conditions.bool(), matmul_impl)
    return combine(y.reshape(-1, y.shape[-1]), mapping.token_slot, routing.pair_weights(), routing.has_padding)
