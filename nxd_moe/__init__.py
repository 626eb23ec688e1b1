"""nxd_moe: NxD-style Mixture-of-Experts inference layers in plain PyTorch.

The public API mirrors NeuronxDistributed's ``modules.moe``: routers, ``ExpertMLPsV2`` configured by
``RoutedExpertsMLPOpsConfig`` and ``BlockwiseMatmulConfig``, ``SharedExperts`` and the ``MoE`` orchestrator.
"""

from nxd_moe.build import build_moe, build_router
from nxd_moe.config import (
    BlockShardStrategy,
    BlockwiseMatmulConfig,
    ExpertParallelConfig,
    GLUType,
    MoEFusedTKGConfig,
    MoEModelConfig,
    RoutedExpertsMLPOpsConfig,
    RouterConfig,
    SkipMode,
    builtin_config_names,
    load_model_config,
)
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts import (
    BACKENDS,
    BlockMapping,
    ExpertsBackend,
    ExpertsMode,
    ExpertsStats,
    TorchBackend,
    expert_capacity,
    num_blocks,
    select_mode,
    token_to_block_mapping,
)
from nxd_moe.moe import MoE
from nxd_moe.routing import GroupLimitedRouter, RouterBase, RouterSinkhorn, RouterTopK
from nxd_moe.shared_experts import SharedExperts

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BlockMapping",
    "BlockShardStrategy",
    "BlockwiseMatmulConfig",
    "ExpertMLPsV2",
    "ExpertParallelConfig",
    "ExpertsBackend",
    "ExpertsMode",
    "ExpertsStats",
    "GLUType",
    "GroupLimitedRouter",
    "MoE",
    "MoEFusedTKGConfig",
    "MoEModelConfig",
    "RoutedExpertsMLPOpsConfig",
    "RouterBase",
    "RouterConfig",
    "RouterSinkhorn",
    "RouterTopK",
    "SharedExperts",
    "SkipMode",
    "TorchBackend",
    "build_moe",
    "build_router",
    "builtin_config_names",
    "expert_capacity",
    "load_model_config",
    "num_blocks",
    "select_mode",
    "token_to_block_mapping",
]
