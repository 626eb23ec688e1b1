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

import torch

from nxd_moe.parallel.collectives import all_gather, all_reduce, reduce_scatter
from nxd_moe.parallel.dispatch import DispatchInputs, DispatchResult
from nxd_moe.parallel.payload import exchange_rows
from nxd_moe.parallel.placement import assign_pairs, needs_positions, pair_positions


def all_gather_dispatch(inputs: DispatchInputs) -> DispatchResult:
    """See :mod:`nxd_moe.parallel.dispatch` for the contract."""
    hidden, layout, groups, shard, ledger = inputs.hidden, inputs.layout, inputs.groups, inputs.shard, inputs.ledger
    sp = layout.sequence_parallel
    gather_group = groups.block_group if sp else groups.token_dp_group

    def gather(field: torch.Tensor) -> torch.Tensor:
        return layout.to_token_order(all_gather(field, gather_group, ledger, "dispatch").reshape(-1, *field.shape[1:]))

    rows, experts, weights = exchange_rows([hidden, inputs.pair_expert.to(torch.int32), inputs.pair_weight], gather)
    experts = experts.long()
    position = pairs_per_expert = None
    if inputs.count_pairs or needs_positions(shard.placement, inputs.capacity):
        position, pairs_per_expert = pair_positions(experts, shard.placement.num_experts)
    owner = assign_pairs(shard.placement, experts, position, pairs_per_expert, inputs.capacity)
    mine = torch.where(owner == shard.expert_parallel_rank, experts, torch.full_like(experts, -1))
    partial = inputs.compute(rows, mine, weights)
    if sp:
        per_rank = layout.from_token_order(partial).reshape(groups.block_size, -1, partial.shape[-1])
        return DispatchResult(reduce_scatter(per_rank, groups.block_group, ledger, "combine"), pairs_per_expert)
    per_group = partial.reshape(groups.num_token_groups, -1, partial.shape[-1])
    local = reduce_scatter(per_group, groups.token_dp_group, ledger, "combine")
    return DispatchResult(all_reduce(local, groups.token_group, ledger, "tensor_parallel_reduce"), pairs_per_expert)
