"""The expert-parallel dispatch strategies by name (:data:`~nxd_moe.config.EXPERT_PARALLEL_DISPATCHES`), each
implementing :mod:`~nxd_moe.parallel.dispatch`'s contract."""

from __future__ import annotations

from typing import Callable

from nxd_moe.moe_configs import EXPERT_PARALLEL_DISPATCHES
from nxd_moe.parallel.all_gather import all_gather_dispatch
from nxd_moe.parallel.all_to_all import all_to_all_dispatch
from nxd_moe.parallel.dispatch import DispatchInputs, DispatchResult

__all__ = ["DISPATCHES", "get_dispatch"]

DISPATCHES: dict[str, Callable[[DispatchInputs], DispatchResult]] = {
    "all_gather": all_gather_dispatch,
    "all_to_all_v": all_to_all_dispatch,
}


def get_dispatch(name: str) -> Callable[[DispatchInputs], DispatchResult]:
    """The dispatch function called ``name`` (one of :data:`~nxd_moe.config.EXPERT_PARALLEL_DISPATCHES`)."""
    dispatch = DISPATCHES.get(name)
    if dispatch is None:
        raise ValueError(f"expert-parallel dispatch must be one of {list(EXPERT_PARALLEL_DISPATCHES)}, got {name!r}")
    return dispatch
