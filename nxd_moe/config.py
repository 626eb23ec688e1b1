"""Configuration objects and their validation, by their public path: ``from nxd_moe.config import ...``.

Everything a user can get wrong about a configuration is rejected at construction, with an error that names the
argument and the allowed range. The forward passes then only check what depends on the inputs (shapes and dtypes).

- :class:`RoutedExpertsMLPOpsConfig` -- what the routed experts compute (NxD's class of that name).
- :class:`BlockwiseMatmulConfig` -- how the dropless blockwise prefill is laid out (NxD's 15 fields).
- :class:`RouterConfig` -- router activation and dtype (NxD's class of that name).
- :class:`MoEFusedTKGConfig` -- NxD's fused-decode kernel settings, kept so NxD code builds unchanged.
- :class:`ExpertParallelConfig` -- expert-parallel dispatch and expert placement.
- :class:`MoEModelConfig` -- one real architecture (the YAML files in ``configs/``).

This file only re-exports. The code lives in these modules, none importing one listed after it:

- :mod:`nxd_moe.checks`: the input checks (``to_torch_dtype``, ``check_int``, ``check_float``, ``check_bool``,
  ``check_limits``);
- :mod:`nxd_moe.fingerprint`: :func:`config_fingerprint`, the text form that compares configurations across
  processes;
- :mod:`nxd_moe.moe_configs`: NxD's configs (the first four classes above, ``GLUType``, ``BlockShardStrategy``,
  ``SkipMode``) and :class:`ExpertParallelConfig` with the expert placements (``normalize_distribution``,
  ``contiguous_distribution``, ``placed_distribution``);
- :mod:`nxd_moe.model_config`: :class:`MoEModelConfig` and its specs, :func:`load_model_config`,
  :func:`builtin_config_names`.

Their classes and functions keep ``nxd_moe.config`` as their ``__module__`` (their home before the split), so
pickles, reprs and :func:`config_fingerprint` read as before. Modules of the package import from the defining module.
"""

from __future__ import annotations

# Besides the names of __all__, the ``import x as x`` lines keep importable from here: the names the classes'
# annotations use (typing.get_type_hints reads them in the namespace of the classes' __module__, this one) and the
# names of other modules that this one imported before the split.
from typing import Any as Any
from typing import Mapping as Mapping

import torch as torch

from nxd_moe.activations import ACT2FN as ACT2FN
from nxd_moe.checks import check_bool, check_float, check_int, check_limits, to_torch_dtype
from nxd_moe.fingerprint import config_fingerprint
from nxd_moe.model_config import (
    CONFIG_DIR,
    ROUTER_TYPES,
    MoEModelConfig,
    RouterSpec,
    SharedExpertsSpec,
    builtin_config_names,
    load_model_config,
    scaled_width,
)
from nxd_moe.moe_configs import (
    ALL_TO_ALL_SPLITS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_PADDING_VALUE,
    DEFAULT_SELECTIVE_LOADING_THRESHOLD,
    EXPERT_PARALLEL_DISPATCHES,
    ROUTER_CONFIG_ACT_FNS,
    ROUTER_CONFIG_KEYS,
    BlockShardStrategy,
    BlockwiseMatmulConfig,
    ExpertParallelConfig,
    GLUType,
    InitMethod,
    MoEFusedTKGConfig,
    RoutedExpertsMLPOpsConfig,
    RouterConfig,
    SkipMode,
    contiguous_distribution,
    default_logical_nc_config,
    normalize_distribution,
    placed_distribution,
)
from nxd_moe.quantization.activations import ACTIVATION_QUANTIZATION_CHOICES as ACTIVATION_QUANTIZATION_CHOICES
from nxd_moe.quantization.activations import W8A8_WEIGHT_FORMATS as W8A8_WEIGHT_FORMATS
from nxd_moe.quantization.formats import get_format as get_format

__all__ = [
    "ALL_TO_ALL_SPLITS",
    "CONFIG_DIR",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_PADDING_VALUE",
    "DEFAULT_SELECTIVE_LOADING_THRESHOLD",
    "EXPERT_PARALLEL_DISPATCHES",
    "ROUTER_CONFIG_ACT_FNS",
    "ROUTER_CONFIG_KEYS",
    "ROUTER_TYPES",
    "BlockShardStrategy",
    "BlockwiseMatmulConfig",
    "ExpertParallelConfig",
    "GLUType",
    "InitMethod",
    "MoEFusedTKGConfig",
    "MoEModelConfig",
    "RoutedExpertsMLPOpsConfig",
    "RouterConfig",
    "RouterSpec",
    "SharedExpertsSpec",
    "SkipMode",
    "builtin_config_names",
    "check_bool",
    "check_float",
    "check_int",
    "check_limits",
    "config_fingerprint",
    "contiguous_distribution",
    "default_logical_nc_config",
    "load_model_config",
    "normalize_distribution",
    "placed_distribution",
    "scaled_width",
    "to_torch_dtype",
]
