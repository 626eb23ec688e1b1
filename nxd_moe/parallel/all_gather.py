"""Expert-parallel dispatch by all-gather + local-expert mask + reduce-scatter (NxD's inference dispatch).

Every rank gathers the block's tokens with their top-k routing (never the ``(T, E)`` affinities: the delayed
gather of NxD's sequence-parallel router), computes the pairs assigned to its local experts on its slice of the
intermediate dimension, and the partial outputs are summed back onto the ranks that own the tokens:

- sequence parallel: gather over the whole block, reduce-scatter over it;
- otherwise (token groups share their tokens): gather over the token-DP group (one rank per token group),
  reduce-scatter over it, then all-reduce over the token group. Unlike NxD, the reduction stays inside the
  MoE block instead of spanning the world group, so expert-data-parallel replicas never mix their tokens.

Shapes are static: every size is a function of the token shape and the group sizes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nxd_moe.parallel.collectives import CommLedger, all_gather, all_reduce, reduce_scatter
from nxd_moe.parallel.dispatch import Dispatched, DispatchInputs, DispatchResult
from nxd_moe.parallel.layout import MoEGroups
from nxd_moe.parallel.payload import exchange_rows
from nxd_moe.parallel.placement import assign_pairs, needs_positions, pair_positions
from nxd_moe.parallel.token_layout import TokenLayout


class _Handle(NamedTuple):
    layout: TokenLayout
    groups: MoEGroups
    ledger: CommLedger
    pairs_per_expert: torch.Tensor | None


class AllGatherDispatcher:
    """See :mod:`nxd_moe.parallel.dispatch` for the contract."""

    def dispatch(self, inputs: DispatchInputs) -> Dispatched:
        hidden, layout, groups, shard, ledger = (inputs.hidden, inputs.layout, inputs.groups, inputs.shard,
                                                 inputs.ledger)
        gather_group = groups.block_group if layout.sequence_parallel else groups.token_dp_group

        def gather(field: torch.Tensor) -> torch.Tensor:
            return layout.to_token_order(all_gather(field, gather_group, ledger, "dispatch").reshape(
                -1, *field.shape[1:]))

        pair_expert, pair_weight = inputs.pairs()
        rows, experts, weights = exchange_rows([hidden, pair_expert.to(torch.int32), pair_weight], gather)
        experts = experts.long()
        position = pairs_per_expert = None
        if inputs.count_pairs or needs_positions(shard.placement, inputs.capacity):
            position, pairs_per_expert = pair_positions(experts, shard.placement.num_experts)
        owner = assign_pairs(shard.placement, experts, position, pairs_per_expert, inputs.capacity)
        mine = torch.where(owner == shard.expert_parallel_rank, experts, torch.full_like(experts, -1))
        return Dispatched(rows, mine, weights, _Handle(layout, groups, ledger, pairs_per_expert))

    def combine(self, partial: torch.Tensor, handle: _Handle) -> DispatchResult:
        layout, groups, ledger = handle.layout, handle.groups, handle.ledger
        if layout.sequence_parallel:
            per_rank = layout.from_token_order(partial).reshape(groups.block_size, -1, partial.shape[-1])
            return DispatchResult(reduce_scatter(per_rank, groups.block_group, ledger, "combine"),
                                  handle.pairs_per_expert)
        per_group = partial.reshape(groups.num_token_groups, -1, partial.shape[-1])
        local = reduce_scatter(per_group, groups.token_dp_group, ledger, "combine")
        return DispatchResult(all_reduce(local, groups.token_group, ledger, "tensor_parallel_reduce"),
                              handle.pairs_per_expert)
