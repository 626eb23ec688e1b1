"""This rank's place in a parallel MoE: the groups its tokens move through, and its share of the experts.

- :class:`MoEGroups` -- the MoE model-parallel block (``TP * EP`` ranks, one copy of every expert), the token
  group (the dense layers' TP group: ranks that share tokens) and the token-DP group (one rank of each token
  group of the block, i.e. NxD's EP group).
- :class:`ExpertShard` -- for one phase (prefill or decode): the MoE TP/EP sizes and ranks, which experts this
  rank holds (:class:`~nxd_moe.parallel.placement.ExpertPlacement`) and which slice of their intermediate
  dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from nxd_moe import parallel_state
from nxd_moe.parallel.placement import ExpertPlacement
from nxd_moe.parallel.token_layout import TokenLayout


@dataclass(frozen=True, eq=False)
class MoEGroups:
    """Process groups (``torch.distributed`` ``ProcessGroup`` objects) with their sizes and this rank's index."""

    block_group: Any
    block_size: int
    block_rank: int
    token_group: Any
    token_group_size: int
    token_group_rank: int
    token_dp_group: Any
    num_token_groups: int
    token_group_index: int

    @classmethod
    def from_parallel_state(cls) -> "MoEGroups":
        return cls(
            block_group=parallel_state.get_moe_model_parallel_group(),
            block_size=parallel_state.get_moe_model_parallel_size(),
            block_rank=parallel_state.get_moe_model_parallel_rank(),
            token_group=parallel_state.get_tensor_model_parallel_group(),
            token_group_size=parallel_state.get_tensor_model_parallel_size(),
            token_group_rank=parallel_state.get_tensor_model_parallel_rank(),
            token_dp_group=parallel_state.get_expert_model_parallel_group(),
            num_token_groups=parallel_state.get_expert_model_parallel_size(),
            token_group_index=parallel_state.get_expert_model_parallel_rank(),
        )

    def token_layout(self, batch: int, local_seq_len: int, sequence_parallel: bool) -> TokenLayout:
        """The :class:`TokenLayout` of this rank's ``(batch, local_seq_len)`` tokens."""
        return TokenLayout(batch, local_seq_len, sequence_parallel, self.token_group_size, self.token_group_rank,
                           self.num_token_groups, self.token_group_index)


@dataclass(frozen=True, eq=False)
class ExpertShard:
    """One phase's split of the routed experts: MoE TP size/rank (a slice of the intermediate dimension), MoE
    EP size/rank (a subset of the experts, per ``placement``). Block rank ``p * TP + q`` is EP rank ``p``, TP
    rank ``q``."""

    tensor_parallel_size: int
    tensor_parallel_rank: int
    expert_parallel_size: int
    expert_parallel_rank: int
    placement: ExpertPlacement

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.placement.experts_of(self.expert_parallel_rank)

    def holds_same_weights_as(self, other: "ExpertShard") -> bool:
        return (self.local_experts == other.local_experts and self.tensor_parallel_size == other.tensor_parallel_size
                and self.tensor_parallel_rank == other.tensor_parallel_rank)

    @classmethod
    def from_parallel_state(cls, prefill: bool, num_experts: int,
                            expert_distribution: Sequence[Sequence[int]] | None) -> "ExpertShard":
        ep = parallel_state.get_moe_expert_model_parallel_size(prefill)
        return cls(
            tensor_parallel_size=parallel_state.get_moe_tensor_model_parallel_size(prefill),
            tensor_parallel_rank=parallel_state.get_moe_tensor_model_parallel_rank(prefill),
            expert_parallel_size=ep,
            expert_parallel_rank=parallel_state.get_moe_expert_model_parallel_rank(prefill),
            placement=ExpertPlacement(num_experts, ep, expert_distribution),
        )


@dataclass(frozen=True, eq=False)
class ExpertsParallelism:
    """What a sharded ``ExpertMLPsV2`` needs at run time: its groups and its shard in each phase."""

    groups: MoEGroups
    prefill: ExpertShard
    decode: ExpertShard

    def shard(self, decode: bool) -> ExpertShard:
        return self.decode if decode else self.prefill
