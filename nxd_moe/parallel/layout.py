"""This rank's place in a parallel MoE: the groups its tokens move through, and its share of the experts.

- :class:`MoEGroups` -- the MoE model-parallel block (``TP * EP`` ranks, one copy of every expert), the token
  group (the dense layers' TP group: ranks that share tokens) and the token-DP group (one rank of each token
  group of the block, i.e. NxD's EP group).
- :class:`ExpertShard` -- for one phase (prefill or decode): the MoE TP/EP sizes and ranks, which experts this
  rank holds (:class:`~nxd_moe.parallel.placement.ExpertPlacement`) and which slice of their intermediate
  dimension.

In an SPMD layout (:func:`~nxd_moe.parallel_state.initialize_spmd_model_parallel`) the ranks are None when built:
one program serves every rank, so :meth:`ExpertsParallelism.at` fills them in from the rank tensor
(:class:`~nxd_moe.parallel_state.SPMDRank`) as 0-d tensors, and a Python int rank never reaches the program.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from nxd_moe import parallel_state
from nxd_moe.experts.shard import WeightShard
from nxd_moe.moe_configs import ExpertParallelConfig
from nxd_moe.parallel.placement import ExpertPlacement
from nxd_moe.parallel.token_layout import TokenLayout


@dataclass(frozen=True, eq=False)
class MoEGroups:
    """Process groups (``torch.distributed`` ``ProcessGroup`` objects, or ``ReplicaGroups`` in an SPMD layout)
    with their sizes and this rank's index."""

    block_group: Any
    block_size: int
    block_rank: int | torch.Tensor | None
    token_group: Any
    token_group_size: int
    token_group_rank: int | torch.Tensor | None
    token_dp_group: Any
    num_token_groups: int
    token_group_index: int | torch.Tensor | None

    @classmethod
    def from_parallel_state(cls) -> "MoEGroups":
        spmd = parallel_state.is_spmd()
        return cls(
            block_group=parallel_state.get_moe_model_parallel_group(),
            block_size=parallel_state.get_moe_model_parallel_size(),
            block_rank=None if spmd else parallel_state.get_moe_model_parallel_rank(),
            token_group=parallel_state.get_tensor_model_parallel_group(),
            token_group_size=parallel_state.get_tensor_model_parallel_size(),
            token_group_rank=None if spmd else parallel_state.get_tensor_model_parallel_rank(),
            token_dp_group=parallel_state.get_expert_model_parallel_group(),
            num_token_groups=parallel_state.get_expert_model_parallel_size(),
            token_group_index=None if spmd else parallel_state.get_expert_model_parallel_rank(),
        )

    def at(self, rank: parallel_state.SPMDRank) -> "MoEGroups":
        """The same groups with this rank's indices computed from ``rank`` (0-d tensors; SPMD)."""
        return dataclasses.replace(self, block_rank=rank.index_in_group("moe_model_parallel_groups"),
                                   token_group_rank=rank.index_in_group("tensor_model_parallel_groups"),
                                   token_group_index=rank.index_in_group("expert_model_parallel_groups"))

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
    tensor_parallel_rank: int | torch.Tensor | None
    expert_parallel_size: int
    expert_parallel_rank: int | torch.Tensor | None
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
        spmd = parallel_state.is_spmd()
        return cls(
            tensor_parallel_size=parallel_state.get_moe_tensor_model_parallel_size(prefill),
            tensor_parallel_rank=None if spmd else parallel_state.get_moe_tensor_model_parallel_rank(prefill),
            expert_parallel_size=ep,
            expert_parallel_rank=None if spmd else parallel_state.get_moe_expert_model_parallel_rank(prefill),
            placement=ExpertPlacement(num_experts, ep, expert_distribution),
        )

    def at(self, rank: parallel_state.SPMDRank, prefill: bool) -> "ExpertShard":
        """The same shard with this rank's MoE TP / EP ranks of the phase computed from ``rank`` (SPMD)."""
        phase = "prefill" if prefill else "decode"
        return dataclasses.replace(self, tensor_parallel_rank=rank.index_in_group(f"moe_{phase}_tensor_groups"),
                                   expert_parallel_rank=rank.index_in_group(f"moe_{phase}_expert_groups"))

    def local_slot(self, device) -> torch.Tensor:
        """``(E,)`` local index of each expert on this rank, ``-1`` where it is not held (read from the placement's
        table of every EP rank at a tensor ``expert_parallel_rank``)."""
        table = self.placement.local_slot_table(device)
        return table.index_select(0, self.expert_parallel_rank.reshape(1)).squeeze(0)


@dataclass(frozen=True, eq=False)
class ExpertsParallelism:
    """What a sharded ``ExpertMLPsV2`` needs at run time: its groups and its shard in each phase."""

    groups: MoEGroups
    prefill: ExpertShard
    decode: ExpertShard

    def shard(self, decode: bool) -> ExpertShard:
        return self.decode if decode else self.prefill

    def at(self, rank: parallel_state.SPMDRank) -> "ExpertsParallelism":
        """Ranks filled in from the rank tensor (see the module docstring)."""
        return ExpertsParallelism(self.groups.at(rank), self.prefill.at(rank, True), self.decode.at(rank, False))


def held_weight_shard(prefill: bool, num_experts: int, expert_parallel_config: ExpertParallelConfig) -> WeightShard:
    """The routed experts' weights this rank holds for a phase under the current layout (in an SPMD layout, the
    rank whose shard is being built): its expert-parallel rank's experts, its MoE tensor-parallel slice. The one
    place that decides it: ``ExpertMLPsV2`` builds its weights from it, ``ExpertParallel`` checks them against it."""
    distribution = parallel_state.expert_distribution_for(expert_parallel_config, prefill)
    experts = parallel_state.get_experts_for_expert_parallel_rank(
        parallel_state.get_moe_expert_model_parallel_rank(prefill), num_experts,
        parallel_state.get_moe_expert_model_parallel_size(prefill), distribution)
    return WeightShard(experts, parallel_state.get_moe_tensor_model_parallel_size(prefill),
                       parallel_state.get_moe_tensor_model_parallel_rank(prefill))
