"""Routed and shared experts, rank-free: their weights, the token->block mapping, and the expert algorithms. The
modules that hold them are :class:`nxd_moe.expert_mlps_v2.ExpertMLPsV2` and
:class:`nxd_moe.shared_experts.SharedExperts`."""

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import BACKENDS, ExpertsBackend, TorchBackend, get_backend
from nxd_moe.experts.capacity import expert_capacity
from nxd_moe.experts.expert_mlps import ExpertsStats
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ExpertsMode, select_mode
from nxd_moe.experts.routing_inputs import Routing, build_routing, expert_mask
from nxd_moe.experts.token_mapping import BlockMapping, block_conditions, num_blocks, token_to_block_mapping

__all__ = [
    "BACKENDS",
    "BlockMapping",
    "ExpertActivation",
    "ExpertWeights",
    "ExpertsBackend",
    "ExpertsMode",
    "ExpertsStats",
    "Routing",
    "TorchBackend",
    "block_conditions",
    "build_routing",
    "expert_capacity",
    "expert_mask",
    "get_backend",
    "num_blocks",
    "select_mode",
    "token_to_block_mapping",
]
