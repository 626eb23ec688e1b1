"""Quantized expert weights: FP8 E4M3 per channel / 128x128 block scales and OCP MxFP4.

- :mod:`~nxd_moe.quantization.formats`: each format's storage, quantize, dequantize and checks;
- :mod:`~nxd_moe.quantization.weight`: :class:`QuantizedWeight`, the object the expert algorithms receive;
- :mod:`~nxd_moe.quantization.quantizer`: turn a bf16 layer into a quantized one;
- :mod:`~nxd_moe.quantization.checkpoint`: GPT-OSS MXFP4 and DeepSeek-V3 FP8 checkpoint tensors.
"""

from nxd_moe.quantization.formats import (
    FORMATS,
    QUANTIZATION_CHOICES,
    QuantizationFormat,
    Shape,
    get_format,
)
from nxd_moe.quantization.weight import QuantizedWeight, Weight, dequantized, format_name

__all__ = [
    "FORMATS",
    "QUANTIZATION_CHOICES",
    "QuantizationFormat",
    "QuantizedWeight",
    "Shape",
    "Weight",
    "dequantized",
    "format_name",
    "get_format",
]
