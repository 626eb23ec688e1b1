"""Which expert algorithm a forward uses: decided from static shapes only, never from routing values."""

from __future__ import annotations

import enum


class ExpertsMode(str, enum.Enum):
    BLOCKWISE = "blockwise"
    CAPACITY_FACTOR = "capacity_factor"
    SELECTIVE_LOADING = "selective_loading"
    ALL_EXPERTS = "all_experts"


def select_mode(
    num_tokens: int,
    seq_len: int | None,
    top_k: int,
    num_experts: int,
    block_size: int,
    capacity_factor: float | None,
    selective_loading_threshold: float = 1.0,
) -> ExpertsMode:
    """NxD's inference dispatch, with the deep dive's alpha.

    - decode (``seq_len == 1``): all-experts once ``T*k >= alpha*E`` (the batch would load most experts
      anyway, and unindexed weight reads are cheaper), else selective loading;
    - prefill with a capacity factor: capacity-factor dropping;
    - dropless prefill: selective loading while ``T*k < alpha*E`` (tiny speculation windows), all-experts while
      ``T*k < block_size`` (not even one full block of work), else blockwise.
    """
    assignments = num_tokens * top_k
    few_assignments = assignments < selective_loading_threshold * num_experts
    if seq_len == 1:
        return ExpertsMode.SELECTIVE_LOADING if few_assignments else ExpertsMode.ALL_EXPERTS
    if capacity_factor is not None:
        return ExpertsMode.CAPACITY_FACTOR
    if few_assignments:
        return ExpertsMode.SELECTIVE_LOADING
    if assignments < block_size:
        return ExpertsMode.ALL_EXPERTS
    return ExpertsMode.BLOCKWISE
