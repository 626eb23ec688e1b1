"""The modules NxD MoE code -- NxD's own MoE unit tests among it -- imports beside the MoE layers, as the front door
serves them (:mod:`~nxd_moe.nxd_compat.namespaces` registers them):

- served for real: ``utils.model_utils`` (``LogicalNCConfig``, ``get_platform_lnc``, ``move_model_to_device``),
  ``utils.logger`` (``get_logger``), ``parallel_layers.random`` (``model_parallel_xla_manual_seed``), and, in the
  family ``torch_neuronx`` (the Neuron SDK's PyTorch plugin), ``torch_neuronx.testing.assert_close``;
- importable, each use a :class:`~nxd_moe.nxd_compat.not_served.NotServedError` saying why: NxD's training tools
  (``optimizer``, ``trainer.optimizer``, ``modules.moe.token_shuffling``, ``moe_config_validator``, the
  load-balancing loss), its module-swapping ``quantization``, and its Neuron kernel plumbing
  (``modules.moe.blockwise`` -- whose ``BlockShardStrategy``, ``SkipMode`` and ``LogicalNCConfig`` are served --,
  ``moe_fused_tkg``, ``moe_fused_tkg_mx``, ``expert_mlps_v2.can_use_find_index_kernel``).
"""

from __future__ import annotations

import types

from nxd_moe.aliasing import new_module as _module
from nxd_moe.aliasing import new_package as _package
from nxd_moe.moe_configs import BlockShardStrategy, SkipMode
from nxd_moe.nxd_compat import testing, utils
from nxd_moe.nxd_compat.not_served import KERNELS, QUANTIZATION, TRAINING, not_served

MOE = "neuronx_distributed.modules.moe"

# Names set on modules namespaces.py builds: the MoE package, its expert_mlps_v2, parallel_layers, the root.
loss_function = _module(f"{MOE}.loss_function", "NxD's load-balancing loss (training).",
                        **not_served(f"{MOE}.loss_function", TRAINING, "load_balancing_loss_func"))
MOE_NAMES = {
    "load_balancing_loss_func": loss_function.load_balancing_loss_func,
    "loss_function": loss_function,
    "token_shuffling": _module(f"{MOE}.token_shuffling", "NxD's token shuffling (training).",
                               **not_served(f"{MOE}.token_shuffling", TRAINING, "token_shuffle", "token_unshuffle")),
    "moe_config_validator": _module(
        f"{MOE}.moe_config_validator", "NxD's training-YAML validation.",
        **not_served(f"{MOE}.moe_config_validator", TRAINING + "; nxd_moe validates every config on construction",
                     "MoeConfigValidator")),
    "blockwise": _module(
        f"{MOE}.blockwise", "NxD's blockwise-matmul kernel wrappers: the configuration enums are served, the "
        "kernel plumbing is not.", BlockShardStrategy=BlockShardStrategy, SkipMode=SkipMode,
        LogicalNCConfig=utils.LogicalNCConfig,
        **not_served(f"{MOE}.blockwise", KERNELS, "can_use_blockwise_matmul_nki", "BlockwiseMatmulNKIFunc",
                     "BlockwiseMatmulArgs", "ExpertAffinityScaleMode", "ActivationFunction",
                     "augment_inputs_for_padded_blockwise_matmul", "_call_bwmm_shard_on_block_kernel",
                     "_bwmm_shard_on_block_nki_call", "torch_to_nki_dtype", "VNC")),
    "moe_fused_tkg": _module(
        f"{MOE}.moe_fused_tkg", "NxD's fused decode kernel module.",
        **not_served(f"{MOE}.moe_fused_tkg", KERNELS + "; MoE(init_tkg_module=True, tkg_config=...) is accepted",
                     "MoEFusedTKG", "_convert_torch_dtype_to_nki_dtype")),
    "moe_fused_tkg_mx": _module(f"{MOE}.moe_fused_tkg_mx", "NxD's fused MXFP4 decode kernel module.",
                                **not_served(f"{MOE}.moe_fused_tkg_mx", KERNELS, "MoEFusedTKGMX")),
}
EXPERT_MLPS_V2_NAMES = not_served(f"{MOE}.expert_mlps_v2", KERNELS, "can_use_find_index_kernel")

nxd_random = _module("neuronx_distributed.parallel_layers.random", "NxD's seeding (nxd_moe.nxd_compat.utils).",
                 model_parallel_xla_manual_seed=utils.model_parallel_xla_manual_seed)
PARALLEL_LAYERS_NAMES = {"random": nxd_random}

model_utils = _module("neuronx_distributed.utils.model_utils", "NxD's model utilities (nxd_moe.nxd_compat.utils).",
                      LogicalNCConfig=utils.LogicalNCConfig, get_platform_lnc=utils.get_platform_lnc,
                      move_model_to_device=utils.move_model_to_device)
logger = _module("neuronx_distributed.utils.logger", "NxD's logger (nxd_moe.nxd_compat.utils).",
                 get_logger=utils.get_logger)
utils_package = _package("neuronx_distributed.utils", "NxD's utilities (model_utils, logger).",
                         model_utils=model_utils, logger=logger)
optimizer = _module("neuronx_distributed.optimizer", "NxD's ZeRO-1 optimizers (training).",
                    **not_served("neuronx_distributed.optimizer", TRAINING, "NeuronZero1Optimizer",
                                 "NeuronEPZero1Optimizer"))
trainer_optimizer = _module("neuronx_distributed.trainer.optimizer", "NxD's trainer optimizer (training).",
                            **not_served("neuronx_distributed.trainer.optimizer", TRAINING, "NxDOptimizer"))
trainer = _package("neuronx_distributed.trainer", "NxD's trainer (training).", optimizer=trainer_optimizer)
quantize = _module("neuronx_distributed.quantization.quantize", "NxD's module-swapping quantization.",
                   **not_served("neuronx_distributed.quantization.quantize", QUANTIZATION, "convert"))
quantization_config = _module(
    "neuronx_distributed.quantization.quantization_config", "NxD's quantization configs.",
    **not_served("neuronx_distributed.quantization.quantization_config", QUANTIZATION,
                 "get_default_expert_wise_per_channel_custom_qconfig_dict"))
quantization = _package("neuronx_distributed.quantization", "NxD's quantization (not served).", quantize=quantize,
                        quantization_config=quantization_config)
ROOT_NAMES = {"utils": utils_package, "optimizer": optimizer, "trainer": trainer, "quantization": quantization}

NXD: dict[str, types.ModuleType] = {
    **{f"{MOE}.{name}": module for name, module in MOE_NAMES.items() if isinstance(module, types.ModuleType)},
    "neuronx_distributed.parallel_layers.random": nxd_random,
    "neuronx_distributed.utils": utils_package,
    "neuronx_distributed.utils.model_utils": model_utils,
    "neuronx_distributed.utils.logger": logger,
    "neuronx_distributed.optimizer": optimizer,
    "neuronx_distributed.trainer": trainer,
    "neuronx_distributed.trainer.optimizer": trainer_optimizer,
    "neuronx_distributed.quantization": quantization,
    "neuronx_distributed.quantization.quantize": quantize,
    "neuronx_distributed.quantization.quantization_config": quantization_config,
}

torch_neuronx_testing = _module("torch_neuronx.testing", "torch-neuronx's testing (nxd_moe.nxd_compat.testing).",
                                assert_close=testing.assert_close)
TORCH_NEURONX: dict[str, types.ModuleType] = {
    "torch_neuronx": _package("torch_neuronx", "The Neuron SDK's PyTorch plugin: testing.assert_close only, served "
                              "by nxd_moe.", testing=torch_neuronx_testing),
    "torch_neuronx.testing": torch_neuronx_testing,
}
