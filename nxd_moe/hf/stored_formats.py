"""The weight formats a block's tensors are stored in, read from the tensors themselves.

Quantized checkpoints load as stored, never requantized: GPT-OSS's MXFP4 ``*_blocks``/``*_scales``, DeepSeek-style
FP8 ``weight_scale_inv`` (128x128 block scales), else the checkpoint's float dtype (``"bf16"``). This module reads
which of them a transformers block's tensors (:func:`hf_quantization`), one of our ``MoE`` state dicts
(:func:`nxd_quantization`) and a built layer (:func:`layer_formats`) hold, and :func:`check_stored_formats` refuses a
checkpoint whose formats are not the layer's. The family converters and every loader share it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from nxd_moe.moe import MoE

# One block's tensors (or a whole checkpoint's) by key, as every converter of nxd_moe.hf reads them.
StateDict = Mapping[str, Any]


def hf_quantization(parts: StateDict) -> tuple[str, str]:
    """The formats of one HF block's routed and shared experts: GPT-OSS MXFP4 ``*_blocks``/``*_scales``,
    DeepSeek-style FP8 ``weight_scale_inv``, else bf16 (the checkpoint's float dtype)."""
    routed, shared = "bf16", "bf16"
    for key in parts:
        if key.startswith("experts."):
            if key.endswith("_blocks"):
                routed = "mxfp4"
            elif key.endswith(".weight_scale_inv"):
                routed = "fp8_block"
        elif key.endswith(".weight_scale_inv"):
            shared = "fp8_block"
    return routed, shared


def nxd_quantization(parts: StateDict, prefix: str = "expert_mlps.mlp_op.gate_up_proj.") -> str:
    """The format of the projection at ``prefix`` (default: the routed experts') in one of our MoE state dicts,
    read from its stored tensors."""
    scale = parts.get(prefix + "scale")
    if scale is None:
        return "bf16"
    weight = parts[prefix + "weight"]
    if weight.dtype == torch.uint8:
        return "mxfp4"
    return "fp8" if scale.shape[-1] == weight.shape[-1] else "fp8_block"


def layer_formats(moe: MoE) -> tuple[str, str | None]:
    """The weight formats of ``moe``'s routed and shared experts (None: no shared experts)."""
    shared = None if moe.shared_experts is None else moe.shared_experts.down_proj.format.name
    return moe.expert_mlps.routed_experts_mlp_config.quantization, shared


def check_stored_formats(moe: MoE, parts: StateDict, subject: str, remedy: str) -> None:
    """Raise unless one HF block's tensors ``parts`` are stored in ``moe``'s formats (checkpoint tensors load as
    stored, never requantized): ``"<subject> routed experts are stored as 'mxfp4' in the checkpoint, the layer's as
    'bf16': <remedy> quantization='mxfp4'"``."""
    for what, stored, argument, layer_format in zip(("routed", "shared"), hf_quantization(parts),
                                                    ("quantization", "shared_quantization"), layer_formats(moe)):
        if layer_format is not None and stored != layer_format:
            raise ValueError(f"{subject} {what} experts are stored as {stored!r} in the checkpoint, the layer's as "
                             f"{layer_format!r}: {remedy} {argument}={stored!r}")

