"""The token dispatchers by name (:data:`~nxd_moe.moe_configs.EXPERT_PARALLEL_DISPATCHES`, and ``"local"`` for one
device), each implementing :mod:`~nxd_moe.parallel.dispatch`'s contract."""

from __future__ import annotations

from nxd_moe.moe_configs import EXPERT_PARALLEL_DISPATCHES
from nxd_moe.parallel.all_gather import AllGatherDispatcher
from nxd_moe.parallel.all_to_all import AllToAllDispatcher
from nxd_moe.parallel.dispatch import LOCAL, TokenDispatcher

__all__ = ["DISPATCHERS", "get_dispatcher"]

DISPATCHERS: dict[str, TokenDispatcher] = {
    "local": LOCAL,
    "all_gather": AllGatherDispatcher(),
    "all_to_all_v": AllToAllDispatcher(),
}


def get_dispatcher(name: str) -> TokenDispatcher:
    """The dispatcher called ``name``: one of :data:`~nxd_moe.moe_configs.EXPERT_PARALLEL_DISPATCHES` (across
    ranks) or ``"local"``."""
    dispatcher = DISPATCHERS.get(name)
    if dispatcher is None:
        raise ValueError(f"expert-parallel dispatch must be one of {list(EXPERT_PARALLEL_DISPATCHES)}, got {name!r}")
    return dispatcher
