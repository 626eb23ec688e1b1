"""NxD's quantization fields (``quantized``, ``quantization_type``, ``quantization_dtype``,
``quantization_block_size``) read as one of nxd_moe's routed-expert weight formats."""

from __future__ import annotations

from typing import Any

__all__ = ["format_of_nxd_fields"]

_FP8 = ("f8e4m3", "f8e4m3fn", "float8_e4m3fn")
_PER_CHANNEL = ("per_channel_symmetric", "expert_wise_per_channel_symmetric")


def format_of_nxd_fields(quantized: bool, quantization_type: Any, quantization_dtype: Any,
                         quantization_block_size: Any) -> str:
    """``quantized=False`` -> ``"bf16"`` (the layer's dtype); FP8 E4M3 per channel (``per_channel_symmetric`` /
    ``expert_wise_per_channel_symmetric``) -> ``"fp8"``; FP8 E4M3 ``blockwise_symmetric`` in 128x128 blocks ->
    ``"fp8_block"``; ``f4e2m1fn_x4`` ``blockwise_symmetric`` -> ``"mxfp4"``. Anything else is a named error."""
    if not quantized:
        return "bf16"
    kind = str(getattr(quantization_type, "value", quantization_type)).lower()
    dtype = str(getattr(quantization_dtype, "name", quantization_dtype)).lower().removeprefix("torch.")
    block = quantization_block_size
    if dtype in _FP8 and kind in _PER_CHANNEL:
        return "fp8"
    if dtype in _FP8 and kind == "blockwise_symmetric" and block is not None and list(block) == [128, 128]:
        return "fp8_block"
    if dtype == "f4e2m1fn_x4" and kind == "blockwise_symmetric":
        return "mxfp4"
    raise ValueError(f"neuron_config quantization_type={kind!r}, quantization_dtype={dtype!r}, "
                     f"quantization_block_size={block!r}: nxd_moe stores routed experts as FP8 E4M3 per channel "
                     "(per_channel_symmetric / expert_wise_per_channel_symmetric with f8e4m3), FP8 E4M3 in 128x128 "
                     "blocks (blockwise_symmetric, block size [128, 128]) or MXFP4 (blockwise_symmetric with "
                     "f4e2m1fn_x4); set quantized=False for bf16 experts")
