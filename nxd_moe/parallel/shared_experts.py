"""Shared experts over a tensor-parallel group: which slice each rank computes, and the reductions.

:class:`~nxd_moe.shared_experts.SharedExperts` computes on the rows it is given -- the whole shared expert where
it holds whole weights, or one slice's contribution (:meth:`~nxd_moe.shared_experts.SharedExperts.partial`). Here
the slices meet, over the TP group (whose ranks share tokens, or hold consecutive sequence shards under SP):

- replicated weights (``sequence_parallel_enabled``) and a sequence-parallel input: local, no communication;
- a shared input (decode, or no SP): each rank its slice, then an all-reduce;
- a sequence-parallel input with sliced weights: all-gather the group's tokens, each rank its slice,
  reduce-scatter back to the shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nxd_moe import parallel_state
from nxd_moe.parallel.collectives import CommLedger, all_gather, all_reduce, reduce_scatter

if TYPE_CHECKING:  # the module sits above this plumbing
    from nxd_moe.shared_experts import SharedExperts


def shared_experts_forward(shared: "SharedExperts", hidden_states: torch.Tensor, sequence_parallel: bool,
                           ledger: CommLedger | None = None) -> torch.Tensor:
    """``(B, S_r, H)`` (``sequence_parallel``: this rank's sequence shard) or ``(..., H)`` shared by the TP group
    -> the shared experts' output for the same rows."""
    if shared.intermediate_shard is None or (sequence_parallel and shared.sequence_parallel_enabled):
        return shared(hidden_states)
    group = parallel_state.get_tensor_model_parallel_group()
    ledger = CommLedger() if ledger is None else ledger
    # SPMD: the slice of replicated weights is this rank's TP index, computed from its rank tensor.
    part = None if shared.spmd_rank is None else shared.spmd_rank.index_in_group("tensor_model_parallel_groups")
    if not sequence_parallel:
        return all_reduce(shared.partial(hidden_states, part), group, ledger, "shared_reduce")
    if hidden_states.dim() != 3:
        raise ValueError(f"SharedExperts: a sequence-parallel input must be (B, S_r, H), got "
                         f"{tuple(hidden_states.shape)}")
    size = shared.intermediate_shard[0]
    gathered = all_gather(hidden_states, group, ledger, "shared_gather")  # (TP, B, S_r, H)
    x = gathered.transpose(0, 1).reshape(hidden_states.shape[0], -1, hidden_states.shape[-1])
    out = shared.partial(x, part)
    per_rank = out.reshape(out.shape[0], size, -1, out.shape[-1]).transpose(0, 1)
    return reduce_scatter(per_rank, group, ledger, "shared_reduce")
