"""Which ranks form which groups: NxD's layout of a world into tensor-, expert- and data-parallel groups and the MoE's
per-phase groups, as pure rank lists (no ``torch.distributed``). :mod:`nxd_moe.parallel_state` makes process groups
(or an SPMD program's replica groups) of them; see its docstring for the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from nxd_moe.checks import check_int

__all__ = ["ParallelLayout", "RankGroups", "model_parallel_layout"]

RankGroups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ParallelLayout:
    """The rank lists of every group kind (pure data: computed without ``torch.distributed``).

    ``moe_prefill`` / ``moe_decode`` are ``(tensor_parallel_size, expert_parallel_size)`` of the MoE in each
    phase; their groups live inside the MoE model-parallel blocks.
    """

    world_size: int
    tensor_model_parallel_size: int
    expert_model_parallel_size: int
    moe_prefill: tuple[int, int]
    moe_decode: tuple[int, int]
    tensor_model_parallel_groups: RankGroups
    data_parallel_groups: RankGroups
    expert_model_parallel_groups: RankGroups
    expert_data_parallel_groups: RankGroups
    moe_model_parallel_groups: RankGroups
    moe_prefill_tensor_groups: RankGroups
    moe_prefill_expert_groups: RankGroups
    moe_decode_tensor_groups: RankGroups
    moe_decode_expert_groups: RankGroups

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.expert_model_parallel_size)

    @property
    def moe_model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.expert_model_parallel_size

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of kind ``kind`` (a field name ending in ``_groups``) that holds ``rank``."""
        for group in getattr(self, kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in no {kind} group (world size {self.world_size})")

    def index_in_groups(self, kind: str) -> tuple[int, ...]:
        """``(world_size,)``: each rank's index in its group of kind ``kind`` (the table an SPMD program reads its
        group ranks from, with its global rank as the index)."""
        return tuple(self.group_of(kind, rank).index(rank) for rank in range(self.world_size))


def _phase_sizes(name: str, tp: int | None, ep: int | None, block: int) -> tuple[int, int]:
    """``(tp, ep)`` of one MoE phase with ``tp * ep == block``; a missing size is derived from the other."""
    if tp is not None:
        check_int(f"moe_{name}_tensor_model_parallel_size", tp, minimum=1)
    if ep is not None:
        check_int(f"moe_{name}_expert_model_parallel_size", ep, minimum=1)
    if tp is None:
        if block % ep:
            raise ValueError(f"moe_{name}_expert_model_parallel_size ({ep}) must divide "
                             f"tensor_model_parallel_size * expert_model_parallel_size ({block})")
        tp = block // ep
    if ep is None:
        if block % tp:
            raise ValueError(f"moe_{name}_tensor_model_parallel_size ({tp}) must divide "
                             f"tensor_model_parallel_size * expert_model_parallel_size ({block})")
        ep = block // tp
    if tp * ep != block:
        raise ValueError(f"moe_{name}_tensor_model_parallel_size * moe_{name}_expert_model_parallel_size "
                         f"({tp} * {ep} = {tp * ep}) must equal tensor_model_parallel_size * "
                         f"expert_model_parallel_size ({block}): the MoE re-splits the same ranks")
    return tp, ep


def _blocks(ranks: Sequence[int], tp: int) -> list[tuple[int, ...]]:
    """Consecutive blocks of ``tp`` ranks (TP groups)."""
    return [tuple(ranks[i:i + tp]) for i in range(0, len(ranks), tp)]


def _strided(ranks: Sequence[int], tp: int) -> list[tuple[int, ...]]:
    """Groups of ranks ``tp`` apart (EP groups: one rank per TP group)."""
    return [tuple(ranks[i::tp]) for i in range(tp)]


def model_parallel_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    *,
    moe_prefill_tensor_model_parallel_size: int | None = None,
    moe_prefill_expert_model_parallel_size: int | None = None,
    moe_decode_tensor_model_parallel_size: int | None = None,
    moe_decode_expert_model_parallel_size: int | None = None,
    num_experts: int | None = None,
) -> ParallelLayout:
    """NxD's group layout for ``world_size`` ranks; raises ``ValueError`` when the sizes do not divide.

    ``num_experts``, if given, must be divisible by every expert-parallel size (the contiguous placement);
    leave it out when experts are placed with an ``expert_distribution``.
    """
    check_int("world_size", world_size, minimum=1)
    tp = check_int("tensor_model_parallel_size", tensor_model_parallel_size, minimum=1)
    ep = check_int("expert_model_parallel_size", expert_model_parallel_size, minimum=1)
    if world_size % tp:
        raise ValueError(f"tensor_model_parallel_size ({tp}) must divide the world size ({world_size})")
    if world_size % (tp * ep):
        raise ValueError(f"tensor_model_parallel_size * expert_model_parallel_size ({tp} * {ep} = {tp * ep}) "
                         f"must divide the world size ({world_size})")
    block = tp * ep
    phases = {}
    for name, ptp, pep in (("prefill", moe_prefill_tensor_model_parallel_size, moe_prefill_expert_model_parallel_size),
                           ("decode", moe_decode_tensor_model_parallel_size, moe_decode_expert_model_parallel_size)):
        phases[name] = (tp, ep) if ptp is None and pep is None else _phase_sizes(name, ptp, pep, block)
    if num_experts is not None:
        check_int("num_experts", num_experts, minimum=1)
        for what, size in (("expert_model_parallel_size", ep),
                           ("moe_prefill_expert_model_parallel_size", phases["prefill"][1]),
                           ("moe_decode_expert_model_parallel_size", phases["decode"][1])):
            if num_experts % size:
                raise ValueError(f"{what} ({size}) must divide num_experts ({num_experts}) for the contiguous "
                                 "expert placement; use an expert_distribution to place experts unevenly")
    ranks = list(range(world_size))
    replicas = _blocks(ranks, block)
    tp_groups = _blocks(ranks, tp)
    ep_groups = [g for replica in replicas for g in _strided(replica, tp)]
    expert_dp = [tuple(ranks[i::block]) for i in range(block)]
    dp_groups = _strided(ranks, tp)

    def phase_groups(name: str) -> tuple[RankGroups, RankGroups]:
        ptp, _ = phases[name]
        return (tuple(g for replica in replicas for g in _blocks(replica, ptp)),
                tuple(g for replica in replicas for g in _strided(replica, ptp)))

    prefill_tp, prefill_ep = phase_groups("prefill")
    decode_tp, decode_ep = phase_groups("decode")
    return ParallelLayout(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        moe_prefill=phases["prefill"],
        moe_decode=phases["decode"],
        tensor_model_parallel_groups=tuple(tp_groups),
        data_parallel_groups=tuple(dp_groups),
        expert_model_parallel_groups=tuple(ep_groups),
        expert_data_parallel_groups=tuple(expert_dp),
        moe_model_parallel_groups=tuple(replicas),
        moe_prefill_tensor_groups=prefill_tp,
        moe_prefill_expert_groups=prefill_ep,
        moe_decode_tensor_groups=decode_tp,
        moe_decode_expert_groups=decode_ep,
    )
