"""Where experts live under expert parallelism, and which copy of an expert serves a (token, expert) pair.

``expert_distribution[p]`` lists the experts EP rank ``p`` holds (NxD's name and meaning). Every rank holds the
same number of experts, no expert twice; every expert at least once. An expert listed on several ranks is
*replicated* (EPLB's redundant experts): its pairs are split between the copies by the pair's position among
that expert's pairs in token order -- copy ``r`` of ``R`` takes positions ``[r*n/R, (r+1)*n/R)`` of the ``n``
pairs -- so each pair is computed exactly once, the split is even, and it needs no data-dependent shapes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from nxd_moe.checks import check_int
from nxd_moe.experts.routing_inputs import expert_mask
from nxd_moe.moe_configs import placed_distribution


class ExpertPlacement:
    """The experts of each of ``expert_parallel_size`` EP ranks (contiguous unless ``expert_distribution``)."""

    def __init__(self, num_experts: int, expert_parallel_size: int,
                 expert_distribution: Sequence[Sequence[int]] | None = None):
        self.num_experts = check_int("num_experts", num_experts, minimum=1)
        self.expert_parallel_size = check_int("expert_parallel_size", expert_parallel_size, minimum=1)
        distribution = placed_distribution(num_experts, expert_parallel_size, expert_distribution)
        self.distribution = distribution
        self._device_tables: dict[tuple, Any] = {}
        self.replicas: tuple[tuple[int, ...], ...] = tuple(
            tuple(p for p, ids in enumerate(distribution) if e in ids) for e in range(num_experts))
        # Read twice per forward: a scan of E tuples each time was a measurable share of an eager decode step.
        self.has_redundancy = any(len(r) > 1 for r in self.replicas)

    @property
    def num_local_experts(self) -> int:
        return len(self.distribution[0])

    def experts_of(self, ep_rank: int) -> tuple[int, ...]:
        check_int("ep_rank", ep_rank, minimum=0, maximum=self.expert_parallel_size - 1)
        return self.distribution[ep_rank]

    def _device_table(self, key: tuple, build: Callable[[], torch.Tensor]) -> Any:
        """The table ``key``, built once by ``build()`` -- except while a graph is being compiled: a table stored
        then would be that graph's output, held across CUDA-graph replays that overwrite it; it is built in the
        graph instead (the eager prefill before compiled decode steps has already stored it)."""
        table = self._device_tables.get(key)
        if table is None:
            table = build()
            if not torch.compiler.is_compiling():
                self._device_tables[key] = table
        return table

    def local_slot(self, ep_rank: int, device=None) -> torch.Tensor:
        """``(E,)`` int64: the local index of each expert on ``ep_rank``, ``-1`` where it is not held."""
        def build():
            slot = torch.full((self.num_experts,), -1, dtype=torch.int64)
            experts = self.experts_of(ep_rank)
            slot[list(experts)] = torch.arange(len(experts))
            return slot.to(device)
        return self._device_table(("slot", ep_rank, str(torch.device(device or "cpu"))), build)

    def local_slot_table(self, device=None) -> torch.Tensor:
        """``(EP, E)`` int64: :meth:`local_slot` of every EP rank (an SPMD program reads its row at its EP rank)."""
        return self._device_table(("slots", str(torch.device(device or "cpu"))), lambda: torch.stack(
            [self.local_slot(r) for r in range(self.expert_parallel_size)]).to(device))

    def replica_table(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E, R_max)`` EP rank of each copy (``-1`` past an expert's last copy) and ``(E,)`` copies per expert
        (built once per device: every forward needs them)."""
        return self._device_table(("replicas", str(torch.device(device or "cpu"))),
                                  lambda: self._replica_table(device))

    def _owner_table(self, device) -> torch.Tensor:
        """``(E + 1,)``: ``-1``, then the EP rank of each expert's only copy (index ``expert + 1``: one lookup maps
        ``-1`` to ``-1``)."""
        return self._device_table(("owner", str(torch.device(device or "cpu"))), lambda: torch.tensor(
            [-1] + [ranks[0] for ranks in self.replicas], dtype=torch.int64).to(device))

    def _replica_table(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in self.replicas)
        table = torch.full((self.num_experts, width), -1, dtype=torch.int64)
        for e, ranks in enumerate(self.replicas):
            table[e, : len(ranks)] = torch.tensor(ranks)
        counts = torch.tensor([len(r) for r in self.replicas], dtype=torch.int64)
        return table.to(device), counts.to(device)

    def pair_ranks(self, pair_expert: torch.Tensor, position: torch.Tensor | None = None,
                   pairs_per_expert: torch.Tensor | None = None) -> torch.Tensor:
        """``(T, k)`` EP rank that computes each pair (``-1`` for ``pair_expert == -1``).

        ``position (T, k)``: the pair's index among its expert's pairs (token order); ``pairs_per_expert (E,)``:
        how many pairs each expert has in all. Copy ``floor(position * R / n)`` of the expert serves the pair.
        Without replicas every expert has one copy, and the two may be None (a table lookup).
        """
        if position is None:
            if self.has_redundancy:
                raise ValueError("pair_ranks: a placement with replicated experts needs the pairs' positions")
            return self._owner_table(pair_expert.device)[pair_expert.long() + 1]
        table, copies = self.replica_table(pair_expert.device)
        valid = pair_expert >= 0
        expert = pair_expert.clamp(min=0).long()
        n = pairs_per_expert.long()[expert].clamp(min=1)
        replica = (torch.where(valid, position.long(), 0) * copies[expert]) // n
        rank = table[expert, replica]
        return torch.where(valid, rank, torch.full_like(rank, -1))


def pair_positions(pair_expert: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, k)`` index of each valid pair among its expert's valid pairs in token order, and ``(E,)`` pairs per
    expert. ``pair_expert == -1`` marks an invalid pair (position 0, counted nowhere)."""
    mask = expert_mask(pair_expert.long(), num_experts)
    earlier = torch.cumsum(mask.to(torch.int64), dim=0) - mask.to(torch.int64)
    position = earlier.gather(1, pair_expert.clamp(min=0).long())
    return torch.where(pair_expert >= 0, position, torch.zeros_like(position)), mask.sum(dim=0)



def needs_positions(placement: ExpertPlacement, capacity: int | None) -> bool:
    """Whether :func:`assign_pairs` needs the pairs' positions (replicas split by position; capacity drops by it)."""
    return placement.has_redundancy or capacity is not None


def assign_pairs(placement: ExpertPlacement, pair_expert: torch.Tensor, position: torch.Tensor | None,
                 pairs_per_expert: torch.Tensor | None, capacity: int | None) -> torch.Tensor:
    """``(T, k)`` EP rank computing each pair, ``-1`` for invalid pairs and, with a ``capacity``, for the pairs
    beyond it (an expert keeps its first ``capacity`` pairs in token order, as on one device). ``position`` and
    ``pairs_per_expert`` may be None where :func:`needs_positions` says so."""
    if capacity is not None:
        pair_expert = torch.where(position < capacity, pair_expert, torch.full_like(pair_expert, -1))
        pairs_per_expert = pairs_per_expert.clamp(max=capacity)
    return placement.pair_ranks(pair_expert, position, pairs_per_expert)
