"""Routers: which k experts each token goes to, and with what weight."""

from nxd_moe.routing.base import RouterBase
from nxd_moe.routing.group_limited import GroupLimitedRouter
from nxd_moe.routing.sinkhorn import RouterSinkhorn
from nxd_moe.routing.topk import RouterTopK

__all__ = ["RouterBase", "RouterTopK", "GroupLimitedRouter", "RouterSinkhorn"]
