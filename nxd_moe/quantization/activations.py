"""FP8 activations (W8A8): the experts' inputs quantized on the fly, per token or per token and column group.

With ``activation_quantization="fp8"`` (:class:`~nxd_moe.config.RoutedExpertsMLPOpsConfig`) both expert GEMMs
multiply FP8 activations by the FP8 weights: the token rows entering gate/up and the activated intermediate rows
entering down are each quantized, row by row, in groups of ``group_size`` columns (``None``: the whole row)::

    amax  = max |x[g]|                        over the group's columns, in fp32
    scale = amax * (1 / 448)                  fp32 (an all-zero group gets scale 1)
    q     = float8_e4m3fn(clamp(x * (1 / scale), -448, 448))   fp32, round to nearest (ties to even)

and the GEMM computes ``sum_k (q_x[k] * scale_x[g(k)]) * (q_w[k] * scale_w[k])`` in fp32. ``group_size=None``
in the config follows the weight format: per token for ``fp8`` (per-channel) weights, per token and 128 columns
for ``fp8_block`` (DeepSeek-V3's recipe: the groups line up with the weights' 128-row blocks).

The torch backend computes the same function as quantize -> dequantize of its activations in front of each
GEMM (:meth:`ActivationQuantization.fake_quantize`); the triton backend multiplies the FP8 values on the tensor
cores and applies the scales in fp32 in the epilogue. Rows are quantized independently, so a token never
changes another token's result (a NaN token stays in its row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nxd_moe.quantization.formats import FP8_MAX

ACTIVATION_QUANTIZATION_CHOICES = ("none", "fp8")
# The weight formats whose FP8 values the tensor cores can multiply by FP8 activations.
W8A8_WEIGHT_FORMATS = ("fp8", "fp8_block")
# DeepSeek-V3's activation group, matching the 128-row K blocks of ``fp8_block`` weights.
BLOCK_GROUP = 128
INV_FP8_MAX = 1.0 / FP8_MAX


class ActivationQuantization(NamedTuple):
    """Dynamic FP8 E4M3 activations, ``group_size`` columns per scale (``None``: one scale per row)."""

    group_size: int | None

    @classmethod
    def for_weights(cls, weight_format: str, group_size: int | None) -> "ActivationQuantization":
        """The spec of ``activation_quantization="fp8"`` with ``weight_format`` weights (``group_size=None``
        follows the weights: per token for ``fp8``, 128 columns for ``fp8_block``)."""
        if group_size is None and weight_format == "fp8_block":
            group_size = BLOCK_GROUP
        return cls(group_size)

    def group(self, width: int) -> int:
        """Columns per scale in a row of ``width`` columns."""
        return width if self.group_size is None else self.group_size

    def describe(self) -> str:
        return "fp8, per token" if self.group_size is None else f"fp8, per token and {self.group_size} columns"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (..., K)`` -> ``(q (..., K) float8_e4m3fn, scale (..., K / group) float32)``."""
        width = x.shape[-1]
        group = self.group(width)
        groups = x.to(torch.float32).reshape(*x.shape[:-1], width // group, group)
        scale = groups.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (groups * torch.reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(x.shape), scale.squeeze(-1)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`quantize` in ``dtype`` (fp32 product, one rounding)."""
        width = q.shape[-1]
        group = self.group(width)
        groups = q.to(torch.float32).reshape(*q.shape[:-1], width // group, group) * scale.unsqueeze(-1)
        return groups.reshape(q.shape).to(dtype)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the FP8 GEMM sees it: quantized, then dequantized to ``x.dtype``."""
        return self.dequantize(*self.quantize(x), x.dtype)


def activation_quantization_spec(config) -> ActivationQuantization | None:
    """The spec a :class:`~nxd_moe.config.RoutedExpertsMLPOpsConfig` asks for (None: bf16 activations)."""
    if config.activation_quantization == "none":
        return None
    return ActivationQuantization.for_weights(config.quantization, config.activation_quantization_group_size)
