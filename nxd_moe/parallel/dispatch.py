"""The contract both expert-parallel dispatch strategies implement (:mod:`~nxd_moe.parallel.dispatches` picks one
by name).

A dispatch takes this rank's tokens with their routing (a :class:`DispatchInputs`) -- ``hidden (T_r, H)``,
``pair_expert (T_r, k)`` (global expert ids, ``-1`` for pairs that do not count: padded tokens) and
``pair_weight (T_r, k)`` -- and returns the complete routed output of those tokens: every expert's contribution,
every tensor-parallel slice summed. On the way it hands the rows this rank must compute to
``compute(rows (N, H), pair_expert (N, k), pair_weight (N, k))``, where ``pair_expert`` keeps only the pairs
assigned to this rank's experts (``-1`` elsewhere); ``compute`` returns this rank's ``(N, H)`` partial output (its
experts, its slice of the intermediate dimension).

- ``all_gather`` (NxD's way): every rank gathers all tokens of the block, masks to its local experts, and the
  partial outputs are reduce-scattered back. Static shapes.
- ``all_to_all_v``: each token goes only to the ranks holding one of its experts, and the results come back;
  static per-destination buffers (no host sync, the default) or exact counts exchanged first (a host sync).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from nxd_moe.parallel.collectives import CommLedger
from nxd_moe.parallel.layout import ExpertShard, MoEGroups
from nxd_moe.parallel.token_layout import TokenLayout

Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DispatchInputs(NamedTuple):
    """What every dispatch takes: this rank's tokens and routing (see the module docstring), where they sit in the
    block (``layout``), the groups they move through, this rank's share of the experts for the phase (``shard``),
    the per-expert ``capacity`` of the block's tokens (capacity-factor mode) or None, ``compute``, the
    ``ledger`` that counts the bytes moved, how an all-to-all sizes its buffers
    (``ExpertParallelConfig.all_to_all_splits``), and whether the block's pairs per expert are wanted (statistics:
    without replicas or a capacity they cost an extra collective in an all-to-all)."""

    hidden: torch.Tensor
    pair_expert: torch.Tensor
    pair_weight: torch.Tensor
    layout: TokenLayout
    groups: MoEGroups
    shard: ExpertShard
    capacity: int | None
    compute: Compute
    ledger: CommLedger
    all_to_all_splits: str = "static"
    count_pairs: bool = True


class DispatchResult(NamedTuple):
    """``output (T_r, H)`` for this rank's tokens; ``pairs_per_expert (E,)`` valid pairs of each expert in the whole
    block (before any capacity drop; None unless ``count_pairs``, replicas or a capacity needed them)."""

    output: torch.Tensor
    pairs_per_expert: torch.Tensor | None
