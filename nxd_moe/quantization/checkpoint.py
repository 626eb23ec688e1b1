"""Quantized checkpoint tensors of real models <-> this package's stored layout (:mod:`.formats`).

GPT-OSS (MXFP4, ``mlp.experts.``): ``gate_up_proj_blocks (E, 2I, H/32, 16)`` uint8 -- output rows, then the 32-value
blocks along the contraction dim, two E2M1 values per byte (element ``2j`` in the low nibble) -- and
``gate_up_proj_scales (E, 2I, H/32)`` uint8 E8M0; ``down_proj_blocks (E, H, I/32, 16)``, ``down_proj_scales
(E, H, I/32)``. Gate and up are interleaved along ``2I`` (even columns gate), as in the bf16 checkpoint.

DeepSeek-V3 (FP8, Hub per-expert layout): ``experts.K.{gate,up,down}_proj.weight`` ``(out, in)`` float8_e4m3fn and
``.weight_scale_inv`` ``(out/128, in/128)`` float32, the multiplier that dequantizes each 128x128 tile.

Ours is ``(E, K, N)``-oriented (contraction dim second): the conversions are transposes and reshapes, the stored
bytes are never re-quantized. The DeepSeek tensors need only the transposes of the bf16 weights
(:mod:`nxd_moe.hf`); GPT-OSS's blocks are regrouped here.
"""

from __future__ import annotations

import torch

from nxd_moe.quantization.formats import FORMATS

MX_BLOCK = FORMATS["mxfp4"].block_k


def mxfp4_from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E, N, K/32, 16)`` blocks + ``(E, N, K/32)`` scales -> our ``weight (E, K/2, N)``, ``scale (E, K/32, N)``."""
    if blocks.dim() != 4 or blocks.shape[-1] != MX_BLOCK // 2 or blocks.shape[:3] != scales.shape:
        raise ValueError(f"{what}_blocks / {what}_scales: GPT-OSS MXFP4 stores blocks (E, N, K/32, 16) and scales "
                         f"(E, N, K/32), got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}_blocks / {what}_scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    e, n, groups, _ = blocks.shape
    return blocks.reshape(e, n, groups * MX_BLOCK // 2).transpose(1, 2), scales.transpose(1, 2)


def mxfp4_to_gpt_oss(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`mxfp4_from_gpt_oss`."""
    e, half_k, n = weight.shape
    return weight.transpose(1, 2).reshape(e, n, half_k * 2 // MX_BLOCK, MX_BLOCK // 2), scale.transpose(1, 2)
