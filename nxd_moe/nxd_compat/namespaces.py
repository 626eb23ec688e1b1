"""The module names under which NxD and NxD Inference code imports nxd_moe, grouped in the families
:func:`~nxd_moe.nxd_compat.install` aliases:

- ``neuronx_distributed``: ``modules.moe`` (its ``__init__``'s names, and ``routing``, ``model``, ``expert_mlps``,
  ``expert_mlps_v2``, ``moe_configs``, ``model_utils``, ``shared_experts``, ``moe_process_group``) and
  ``parallel_layers`` (``parallel_state``, ``mappings``, ``layers.SPMDRank``);
- ``neuronx_distributed_inference``: ``modules.moe_v2`` (``initialize_moe_module``, ``initialize_moe_process_group``);
- ``torch_neuronx``: ``testing.assert_close``.

Alias only: every name is nxd_moe's own object, or one of :mod:`~nxd_moe.nxd_compat.adapters` where NxD's
signature differs. The utility, training and kernel modules NxD MoE code imports beside the layers are
:mod:`~nxd_moe.nxd_compat.support_namespaces`' (training and kernel names there raise a ``NotServedError`` when
used). :func:`unserved` explains the NxD modules that are not here.
"""

from __future__ import annotations

import types

from nxd_moe import nxdi
from nxd_moe.activations import ACT2FN, ACTFunc, get_kernel_activation_func_id
from nxd_moe.aliasing import new_module as _module
from nxd_moe.aliasing import new_package as _package
from nxd_moe.checks import to_torch_dtype
from nxd_moe.moe_configs import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_PADDING_VALUE,
    DEFAULT_SELECTIVE_LOADING_THRESHOLD,
    BlockShardStrategy,
    GLUType,
    MoEFusedTKGConfig,
    RoutedExpertsMLPOpsConfig,
    RouterConfig,
    SkipMode,
    default_logical_nc_config,
)
from nxd_moe.nxd_compat import adapters, inference, mappings, parallel_state, support_namespaces
from nxd_moe.nxd_compat.not_served import KERNELS
from nxd_moe.parallel_state import SPMDRank
from nxd_moe.routing import GroupLimitedRouter, RouterBase


def _model_utils_getattr(name: str):  # noqa: N807 -- a module's __getattr__
    if name == "DEFAULT_LNC_SIZE":  # NxD reads the platform at import; here the environment, when asked
        return default_logical_nc_config()
    raise AttributeError(f"module 'neuronx_distributed.modules.moe.model_utils' has no attribute {name!r}")


MOE = "neuronx_distributed.modules.moe"

routing = _module(f"{MOE}.routing", "NxD's routers (nxd_moe.routing).", RouterBase=RouterBase,
                  RouterTopK=adapters.RouterTopK, RouterSinkhorn=adapters.RouterSinkhorn,
                  GroupLimitedRouter=GroupLimitedRouter)
moe_configs = _module(f"{MOE}.moe_configs", "NxD's MoE configs (nxd_moe.config).",
                      BlockwiseMatmulConfig=adapters.NxdBlockwiseMatmulConfig,
                      RoutedExpertsMLPOpsConfig=RoutedExpertsMLPOpsConfig,
                      RouterConfig=RouterConfig, MoEFusedTKGConfig=MoEFusedTKGConfig,
                      BlockShardStrategy=BlockShardStrategy, GLUType=GLUType, ACTFunc=ACTFunc,
                      to_torch_dtype=to_torch_dtype)
model_utils = _module(f"{MOE}.model_utils", "NxD's MoE constants and activation tables (nxd_moe.activations, "
                      "nxd_moe.config).", ACT2FN=ACT2FN, GLUType=GLUType, ACTFunc=ACTFunc,
                      get_kernel_activation_func_id=get_kernel_activation_func_id,
                      DEFAULT_SELECTIVE_LOADING_THRESHOLD=DEFAULT_SELECTIVE_LOADING_THRESHOLD,
                      DEFAULT_BLOCK_SIZE=DEFAULT_BLOCK_SIZE, DEFAULT_SKIP_MODE=SkipMode(False, False),
                      DEFAULT_PADDING_VALUE=DEFAULT_PADDING_VALUE, DEFAULT_HIDDEN_ACT_SCALING_FACTOR=1.702,
                      __getattr__=_model_utils_getattr)
expert_mlps_v2 = _module(f"{MOE}.expert_mlps_v2", "NxD's ExpertMLPsV2.", ExpertMLPsV2=adapters.ExpertMLPsV2,
                         RoutedExpertsMLPOpsConfig=RoutedExpertsMLPOpsConfig,
                         BlockwiseMatmulConfig=adapters.NxdBlockwiseMatmulConfig)
expert_mlps = _module(f"{MOE}.expert_mlps", "NxD's ExpertMLPs (flat arguments).", ExpertMLPs=adapters.ExpertMLPs,
                      ExpertMLPsV2=adapters.ExpertMLPsV2, GLUType=GLUType)
shared_experts = _module(f"{MOE}.shared_experts", "NxD's SharedExperts.", SharedExperts=adapters.SharedExperts)
model = _module(f"{MOE}.model", "NxD's MoE orchestrator.", MoE=adapters.MoE, MoEFusedTKGConfig=MoEFusedTKGConfig,
                SharedExperts=adapters.SharedExperts, routing=routing, expert_mlps=expert_mlps,
                mappings=mappings, parallel_state=parallel_state)
moe_process_group = _module(
    f"{MOE}.moe_process_group", "NxD's MoE process groups (nxd_moe.parallel_state's MoE groups).",
    init_tensor_expert_parallel_moe_process_groups=parallel_state.init_tensor_expert_parallel_moe_process_groups,
    get_moe_tp_ep_group=parallel_state.get_moe_tp_ep_group, get_moe_ep_group=parallel_state.get_moe_ep_group,
    destroy_moe_model_parallel=parallel_state.destroy_moe_model_parallel)
moe = _package(MOE, "NxD's MoE modules, served by nxd_moe.", MoE=adapters.MoE, ExpertMLPs=adapters.ExpertMLPs,
               ACT2FN=ACT2FN, RouterTopK=adapters.RouterTopK, RouterSinkhorn=adapters.RouterSinkhorn,
               routing=routing, model=model, expert_mlps=expert_mlps, expert_mlps_v2=expert_mlps_v2,
               moe_configs=moe_configs, model_utils=model_utils, shared_experts=shared_experts,
               moe_process_group=moe_process_group)
modules = _package("neuronx_distributed.modules", "NxD's modules (MoE only).", moe=moe)
# NxD's tensor-parallel layers (parallel_layers/layers.py): named when asked for, as unserved modules are.
_PARALLEL_LAYERS = ("ColumnParallelLinear", "RowParallelLinear", "BaseParallelLinear", "ParallelEmbedding",
                    "LinearWithAsyncCommunication", "OutputChannelParallelConv2d", "InputChannelParallelConv2d")


def _layers_getattr(name: str):  # noqa: N807 -- a module's __getattr__
    module = "neuronx_distributed.parallel_layers.layers"
    if name in _PARALLEL_LAYERS:  # ImportError, not AttributeError: `from ... import` passes it on as it is
        raise ImportError(f"{module}.{name} is not served by nxd_moe's NxD front door (NxD's tensor-parallel layers "
                          "for a whole model; nxd_moe's MoE shards its own router, experts and shared experts under "
                          f"nxd_moe.parallel_state, and this module serves SPMDRank only); docs/nxd.md lists what is",
                          name=module)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


layers = _module("neuronx_distributed.parallel_layers.layers", "NxD's SPMDRank (NxD's parallel linear layers are "
                 "not served).", SPMDRank=SPMDRank, __getattr__=_layers_getattr)
parallel_layers = _package("neuronx_distributed.parallel_layers", "NxD's parallel_state, mappings and SPMDRank.",
                           parallel_state=parallel_state, mappings=mappings, layers=layers)
root = _package("neuronx_distributed", "NeuronxDistributed's MoE inference names, served by nxd_moe.",
                modules=modules, parallel_layers=parallel_layers)

NXD: dict[str, types.ModuleType] = {
    "neuronx_distributed": root,
    "neuronx_distributed.modules": modules,
    MOE: moe,
    f"{MOE}.routing": routing,
    f"{MOE}.model": model,
    f"{MOE}.expert_mlps": expert_mlps,
    f"{MOE}.expert_mlps_v2": expert_mlps_v2,
    f"{MOE}.moe_configs": moe_configs,
    f"{MOE}.model_utils": model_utils,
    f"{MOE}.shared_experts": shared_experts,
    f"{MOE}.moe_process_group": moe_process_group,
    "neuronx_distributed.parallel_layers": parallel_layers,
    "neuronx_distributed.parallel_layers.parallel_state": parallel_state,
    "neuronx_distributed.parallel_layers.mappings": mappings,
    "neuronx_distributed.parallel_layers.layers": layers,
}
# The utility, training and kernel modules NxD MoE code imports beside the layers (support_namespaces).
for _parent, _names in ((moe, support_namespaces.MOE_NAMES), (expert_mlps_v2, support_namespaces.EXPERT_MLPS_V2_NAMES),
                        (parallel_layers, support_namespaces.PARALLEL_LAYERS_NAMES),
                        (root, support_namespaces.ROOT_NAMES)):
    _parent.__dict__.update(_names)
NXD.update(support_namespaces.NXD)

moe_v2 = _module("neuronx_distributed_inference.modules.moe_v2", "NxD Inference's MoE entry point (nxd_moe.nxdi).",
                 initialize_moe_module=nxdi.initialize_moe_module,
                 initialize_moe_process_group=nxdi.initialize_moe_process_group)
nxdi_modules = _package("neuronx_distributed_inference.modules", "NxD Inference's modules (moe_v2 only).",
                        moe_v2=moe_v2)
nxdi_root = _package("neuronx_distributed_inference", "NxD Inference's MoE entry point and application, served by "
                     "nxd_moe.", modules=nxdi_modules)
NXDI: dict[str, types.ModuleType] = {
    "neuronx_distributed_inference": nxdi_root,
    "neuronx_distributed_inference.modules": nxdi_modules,
    "neuronx_distributed_inference.modules.moe_v2": moe_v2,
}
# NxDI's application (config, model classes, adapter, benchmark; nxd_moe.nxd_compat.inference), each module an
# attribute of its package
for _path, _names in inference.FAMILIES.items():
    NXDI[_path] = _module(_path, f"NxD Inference's {_path.rsplit('.', 1)[-1]}, served by nxd_moe.application.",
                          **_names)
    _package_path = _path.rpartition(".")[0]
    while _package_path not in NXDI:
        NXDI[_package_path] = _package(_package_path, "NxD Inference's package (its served modules only).")
        _package_path = _package_path.rpartition(".")[0]
for _path, _module_object in NXDI.items():
    _head, _, _name = _path.rpartition(".")
    if _head in NXDI:
        setattr(NXDI[_head], _name, _module_object)

FAMILIES: dict[str, dict[str, types.ModuleType]] = {"neuronx_distributed": NXD, "neuronx_distributed_inference": NXDI}
FAMILIES["torch_neuronx"] = support_namespaces.TORCH_NEURONX

# Why the NxD / NxDI modules MoE code may reach for are not served (docs/nxd.md has the full list).
UNSERVED: dict[str, str] = {
    f"{MOE}.experts": "NxD's per-expert MLP op; nxd_moe's experts are ExpertMLPsV2's backends",
    f"{MOE}.moe_parallel_layers": "NxD's expert-fused parallel linear layers; ExpertMLPsV2 shards itself under "
                                  "nxd_moe.parallel_state",
    f"{MOE}.nki_import": KERNELS,
    "neuronx_distributed_inference.modules.moe": "NxD Inference's legacy (Mixtral/DBRX) entry point; use "
                                                 "modules.moe_v2.initialize_moe_module, or nxd_moe.hf",
}


def unserved(name: str) -> str:
    """Why ``name`` (a module under one of :data:`FAMILIES`' roots) is not served."""
    why = UNSERVED.get(name, "not an MoE inference module")
    return (f"{name} is not served by nxd_moe's NxD front door ({why}); docs/nxd.md lists what is, "
            "from nxd_moe.nxd_compat.namespaces.NXD and NXDI")
