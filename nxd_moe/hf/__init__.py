"""Hugging Face ``transformers`` interoperability: configs, MoE blocks and whole checkpoints.

Supported model types: ``mixtral``, ``qwen3_moe``, ``qwen2_moe``, ``gpt_oss``, ``deepseek_v3``, ``llama4_text``
(and ``llama4`` through its ``text_config``) and ``dbrx``.

- :func:`from_hf_config` maps a transformers config (object or ``config.json`` dict) onto a
  :class:`~nxd_moe.config.MoEModelConfig` whose routing and activation knobs reproduce the model's MoE layer
  (section 6.2 of the NxD reference).
- :func:`from_hf_moe_block` builds an :class:`~nxd_moe.moe.MoE` holding the weights of one transformers
  sparse-MoE block, so that ``moe(x)[0]`` equals the block's output.
- :func:`hf_to_nxd_state_dict` / :func:`nxd_to_hf_state_dict` convert whole checkpoints; :func:`load_hf_layer`
  loads one layer of a transformers checkpoint into an ``MoE``.
- ``patch_model`` (:mod:`nxd_moe.models.patch`) replaces every MoE block of a whole transformers model.
- transformers' experts interface (:mod:`nxd_moe.models.experts_backend`): importing this package registers
  ``experts_implementation="nxd_moe"`` / ``"nxd_moe_torch"`` / ``"nxd_moe_triton"``.

This file only re-exports. The modules, each importing only those listed before it and none of
:mod:`nxd_moe.models` (which builds on them and imports them directly):

- :mod:`~nxd_moe.hf.configs`: transformers configs read as :class:`~nxd_moe.config.MoEModelConfig`;
- :mod:`~nxd_moe.hf.stored_formats`: the weight formats (bf16, FP8, MXFP4) a block's tensors are stored in;
- :mod:`~nxd_moe.hf.families`: each model family's block classes, key layouts and checkpoint formats;
- :mod:`~nxd_moe.hf.checkpoints`: one block's or a whole checkpoint's tensors converted both ways;
- :mod:`~nxd_moe.hf.blocks`: a live transformers block as an ``MoE``.

``patch_model`` and the experts interface live in :mod:`nxd_moe.models`, above those modules: this file is the one
place that reaches up to them.
"""

from nxd_moe.extras import require
from nxd_moe.hf.blocks import from_hf_moe_block
from nxd_moe.hf.checkpoints import hf_to_nxd_state_dict, load_hf_layer, nxd_to_hf_state_dict
from nxd_moe.hf.configs import SUPPORTED_MODEL_TYPES, from_hf_config
from nxd_moe.hf.configs import gpt_oss_swiglu as gpt_oss_swiglu  # documented, outside __all__ as before
from nxd_moe.hf.families import HF_QUANT_METHODS, LAYOUTS, unsaved_formats
from nxd_moe.models.experts_backend import (
    check_experts_support,
    register_experts_implementations,
    set_experts_implementation,
)

# The transformers interop: without transformers, importing it is the error (naming the extra), not a later call.
# Python runs this file before any module of the package, so that covers ``import nxd_moe.hf.configs`` too.
require("transformers", "nxd_moe.hf")

__all__ = [
    "HF_QUANT_METHODS",
    "LAYOUTS",
    "SUPPORTED_MODEL_TYPES",
    "check_experts_support",
    "from_hf_config",
    "from_hf_moe_block",
    "hf_to_nxd_state_dict",
    "load_hf_layer",
    "nxd_to_hf_state_dict",
    "patch_model",  # noqa: F822 (loaded by the module __getattr__ below)
    "register_experts_implementations",
    "set_experts_implementation",
    "unsaved_formats",
]

# After any import of this package or of one of its modules (nxd_moe.models.patch and hf_models import them),
# transformers' experts_implementation="nxd_moe" works.
register_experts_implementations()


def __getattr__(name: str):
    # nxd_moe.models.patch imports this package's modules, and Python runs this file before any of them: importing
    # patch_model here at the top would find nxd_moe.models.patch half-run whenever it is imported first. So it is
    # looked up on first use.
    if name == "patch_model":
        from nxd_moe.models.patch import patch_model

        return patch_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
