"""Which expert algorithm a forward uses: decided from static shapes only, never from routing values."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nxd_moe.checks import check_bool, check_int


class ExpertsMode(str, enum.Enum):
    BLOCKWISE = "blockwise"
    CAPACITY_FACTOR = "capacity_factor"
    SELECTIVE_LOADING = "selective_loading"
    ALL_EXPERTS = "all_experts"


@dataclass(frozen=True)
class ModePolicy:
    """What a backend changes in the one mode rule (:func:`select_mode`), the rest being NxD's.

    - ``all_experts``: NxD's two all-experts cases -- a decode of ``T*k >= alpha*E`` pairs and a dropless prefill of
      fewer than ``block_size`` pairs; right for Trainium's DMA, never a win for kernels that skip empty rows;
    - ``pairs_up_to``: a dropless prefill of at most this many pairs runs selective loading (the decode of the
      same size, where it is the same computation and one launch);
    - ``pairs_always``: selective loading for every dropless forward (a backend whose sorted pairs are its
      cheapest algorithm at every size)."""

    all_experts: bool = True
    pairs_up_to: int = 0
    pairs_always: bool = False

    def __post_init__(self):
        for name in ("all_experts", "pairs_always"):
            check_bool(f"ModePolicy.{name}", getattr(self, name))
        check_int("ModePolicy.pairs_up_to", self.pairs_up_to, minimum=0)


NXD_POLICY = ModePolicy()


def select_mode(
    num_tokens: int,
    seq_len: int | None,
    top_k: int,
    num_experts: int,
    block_size: int,
    capacity_factor: float | None,
    selective_loading_threshold: float = 1.0,
    policy: ModePolicy = NXD_POLICY,
) -> ExpertsMode:
    """NxD's inference dispatch, with the deep dive's alpha, under a backend's ``policy`` (:class:`ModePolicy`;
    NxD's by default):

    - decode (``seq_len == 1``): all-experts once ``T*k >= alpha*E`` (the batch would load most experts
      anyway, and unindexed weight reads are cheaper), else selective loading;
    - prefill with a capacity factor: capacity-factor dropping;
    - dropless prefill: selective loading while ``T*k < alpha*E`` (tiny speculation windows), all-experts while
      ``T*k < block_size`` (not even one full block of work), else blockwise.
    """
    assignments = num_tokens * top_k
    if policy.pairs_always and capacity_factor is None:
        return ExpertsMode.SELECTIVE_LOADING
    few_assignments = assignments < selective_loading_threshold * num_experts
    if seq_len == 1:
        return ExpertsMode.ALL_EXPERTS if policy.all_experts and not few_assignments else \
            ExpertsMode.SELECTIVE_LOADING
    if capacity_factor is not None:
        return ExpertsMode.CAPACITY_FACTOR
    if few_assignments or assignments <= policy.pairs_up_to:
        return ExpertsMode.SELECTIVE_LOADING
    if policy.all_experts and assignments < block_size:
        return ExpertsMode.ALL_EXPERTS
    return ExpertsMode.BLOCKWISE
