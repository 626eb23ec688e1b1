"""Expert-parallel load balancing (EPLB): an ``expert_distribution`` planned from measured expert loads.

Under expert parallelism a layer waits for its most loaded rank. Given each expert's measured token count and
``slots_per_rank`` experts per rank (``EP * slots >= E``; the extra slots hold *redundant* copies of hot experts),
:func:`plan_expert_distribution` places the experts in two greedy steps -- the heuristic of DeepSeek-V3's
EPLB, without its node hierarchy:

1. **Replicate**: each extra slot goes to the expert whose per-copy load (``load / copies``) is currently the
   largest (never more copies than ranks: a rank holds an expert once).
2. **Pack**: copies, heaviest first (``load / copies`` each, as the dispatch splits an expert's pairs evenly
   between its copies), each onto the least loaded rank that has a free slot and does not hold that expert.

Greedy packing of this kind is within 4/3 of the optimal makespan (Graham's bound for longest-first list
scheduling, here with slot limits); it is not an exact optimiser. :func:`rank_loads` gives the load each rank
would get; run the layer with the plan's ``expert_distribution`` (see
:class:`~nxd_moe.config.ExpertParallelConfig`) -- outputs are unchanged, only where pairs are computed moves.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nxd_moe.checks import check_int
from nxd_moe.parallel.placement import ExpertPlacement


def _loads(tokens_per_expert: Sequence[float] | torch.Tensor) -> list[float]:
    values = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
    if not values:
        raise ValueError("tokens_per_expert must list at least one expert")
    loads = []
    for e, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
            raise ValueError(f"tokens_per_expert[{e}] must be a finite number >= 0, got {v!r}")
        loads.append(float(v))
    return loads


def replica_counts(tokens_per_expert: Sequence[float] | torch.Tensor, num_slots: int,
                   max_copies: int) -> list[int]:
    """Copies per expert for ``num_slots`` slots in all (step 1)."""
    loads = _loads(tokens_per_expert)
    if num_slots < len(loads):
        raise ValueError(f"{num_slots} slots cannot hold {len(loads)} experts")
    if num_slots > len(loads) * max_copies:
        raise ValueError(f"{num_slots} slots need more than {max_copies} copies of some expert; at most one copy "
                         "per rank")
    copies = [1] * len(loads)
    for _ in range(num_slots - len(loads)):
        # Largest per-copy load; ties to the lowest expert id (deterministic).
        best = max((e for e in range(len(loads)) if copies[e] < max_copies), key=lambda e: (loads[e] / copies[e], -e))
        copies[best] += 1
    return copies


def plan_expert_distribution(tokens_per_expert: Sequence[float] | torch.Tensor, expert_parallel_size: int,
                             slots_per_rank: int | None = None) -> tuple[tuple[int, ...], ...]:
    """An ``expert_distribution`` for ``expert_parallel_size`` ranks of ``slots_per_rank`` experts each (default
    ``ceil(E / EP)``: no redundancy unless E does not divide) that keeps the most loaded rank light.

    Each rank's experts are listed in ascending id order.
    """
    loads = _loads(tokens_per_expert)
    num_experts = len(loads)
    ep = check_int("expert_parallel_size", expert_parallel_size, minimum=1)
    slots = -(-num_experts // ep) if slots_per_rank is None else check_int("slots_per_rank", slots_per_rank, minimum=1)
    if slots * ep < num_experts:
        raise ValueError(f"slots_per_rank ({slots}) * expert_parallel_size ({ep}) must be >= the number of experts "
                         f"({num_experts})")
    copies = replica_counts(loads, slots * ep, ep)
    items = sorted(((loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    held: list[list[int]] = [[] for _ in range(ep)]
    rank_load = [0.0] * ep
    for load, e in items:
        open_ranks = [r for r in range(ep) if len(held[r]) < slots and e not in held[r]]
        if not open_ranks:
            # Every rank with a free slot already holds e. A rank lacking e exists (e has fewer copies placed than
            # ranks) and is full; it holds an expert the free rank lacks (else the free rank would be full too):
            # move that one to the free rank and give e the slot it leaves.
            free = next(r for r in range(ep) if len(held[r]) < slots)
            donor = next(r for r in range(ep) if e not in held[r])
            moved = next(x for x in held[donor] if x not in held[free])
            held[donor].remove(moved)
            held[free].append(moved)
            moved_load = loads[moved] / copies[moved]
            rank_load[donor] -= moved_load
            rank_load[free] += moved_load
            open_ranks = [donor]
        target = min(open_ranks, key=lambda r: (rank_load[r], r))
        held[target].append(e)
        rank_load[target] += load
    return tuple(tuple(sorted(experts)) for experts in held)


def rank_loads(tokens_per_expert: Sequence[float] | torch.Tensor,
               expert_distribution: Sequence[Sequence[int]]) -> list[float]:
    """Load of each EP rank when every expert's tokens are split evenly between its copies."""
    loads = _loads(tokens_per_expert)
    placement = ExpertPlacement(len(loads), len(expert_distribution), expert_distribution)
    return [sum(loads[e] / len(placement.replicas[e]) for e in placement.experts_of(p))
            for p in range(placement.expert_parallel_size)]
