"""Expert weight formats: how a logical ``(E, K, N)`` projection (``K`` the contraction dim, ``N`` the outputs) is
stored, quantized, checked and turned back into numbers.

Every format stores expert-major tensors (dim 0 is the expert), so dequantizing a subset of experts is
``dequantize(data[idx], scale[idx])`` whatever the format -- the property that lets every algorithm pick its
experts' rows with one ``index_select`` and no per-format code.

=============== ===================================== ============================== ==========================
format          NxD vocabulary                        ``weight``                     ``scale``
=============== ===================================== ============================== ==========================
``bf16``        not quantized (the layer's dtype)     ``(E, K, N)`` layer dtype      --
``fp8``         EXPERT_WISE_PER_CHANNEL_SYMMETRIC,    ``(E, K, N)`` float8_e4m3fn    ``(E, 1, N)`` float32
                F8E4M3FN, scale F32
``fp8_block``   BLOCKWISE_SYMMETRIC 128x128,          ``(E, K, N)`` float8_e4m3fn    ``(E, K/128, N/128)``
                F8E4M3FN, scale F32 (DeepSeek-V3                                     float32
                ``weight_scale_inv``)
``mxfp4``       BLOCKWISE_SYMMETRIC (OCP MX),         ``(E, K/2, N)`` uint8: E2M1    ``(E, K/32, N)`` uint8
                F4E2M1FN, scale F8E8M0                nibbles of rows 2j (low) and   E8M0 (``2**(s-127)``)
                                                      2j+1 (high)                    per 32 rows of K
=============== ===================================== ============================== ==========================

Dequantized value: ``float32(weight) * scale`` (FP8), ``e2m1(nibble) * 2**(scale - 127)`` (MxFP4), rounded
once to the compute dtype. The FP8 range is OCP E4M3FN's +-448 (what checkpoints use; Trn2's own FP8 saturates
at +-240, reference section on FP8 weights).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # nibble codes 0..7; bit 3 is the sign
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255


class Shape(NamedTuple):
    """A projection's logical shape: experts, contraction (in) and output features."""

    experts: int
    k: int
    n: int


class QuantizationFormat:
    """One stored format (see the module docstring). Subclasses set the class attributes and the four methods."""

    name: str = ""
    quantized: bool = True
    nxd_quantization_type: str | None = None
    nxd_quantized_dtype: str | None = None
    nxd_scale_dtype: str | None = None
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    scale_dtype: torch.dtype = torch.float32
    # Rows of K sharing one scale (None: all of K) and columns of N sharing one (1: per channel).
    block_k: int | None = None
    block_n: int = 1
    values_per_byte: int = 1

    def check_shape(self, shape: Shape, what: str) -> None:
        """Raise unless the format's blocks divide ``shape``."""
        for dim, size, block in (("in (K)", shape.k, self.block_k), ("out (N)", shape.n, self.block_n)):
            if block is not None and size % block:
                raise ValueError(f"{what}: format {self.name!r} needs the {dim} dimension divisible by its block "
                                 f"size {block}, got {size} (shape (E, K, N) = {tuple(shape)})")

    def scale_split_dim(self, dim: int) -> int | None:
        """The dim of the stored scale to cut where the ``(E, K, N)`` weight is cut along ``dim`` (1: K, 2: N), or
        None where the scale is shared by every slice (a per-channel scale spans all of K)."""
        if dim == 2:
            return 2
        return 1 if self.block_k is not None else None

    def check_split(self, shape: Shape, dim: int, parts: int, stride: int, what: str) -> None:
        """Raise unless cutting ``dim`` (1: K, 2: N) of ``shape`` into ``stride`` groups of ``parts`` slices keeps
        every scale block (and packed byte) whole, naming the sizes that work."""
        size = shape.k if dim == 1 else shape.n
        # K: the scale blocks (MxFP4's packed pairs lie inside them); N: the scale's columns.
        block = (self.block_k or self.values_per_byte) if dim == 1 else self.block_n
        piece = size // (stride * parts)
        if size % (stride * parts) or piece % block:
            axis = "in (K)" if dim == 1 else "out (N)"
            raise ValueError(f"{what}: format {self.name!r} cannot split its {axis} dimension of {size} into "
                             f"{stride * parts} slices of whole {block}-wide blocks (a slice would be "
                             f"{size / (stride * parts):g}); pick a tensor-parallel size that makes each slice a "
                             f"multiple of {block}")

    def weight_shape(self, shape: Shape) -> tuple[int, int, int]:
        return shape.experts, shape.k // self.values_per_byte, shape.n

    def scale_shape(self, shape: Shape) -> tuple[int, int, int]:
        return shape.experts, 1 if self.block_k is None else shape.k // self.block_k, shape.n // self.block_n

    def stored_bytes(self, shape: Shape) -> int:
        """Bytes of the stored weight and scale tensors."""
        itemsize = torch.empty((), dtype=self.scale_dtype).element_size()
        return math.prod(self.weight_shape(shape)) + math.prod(self.scale_shape(shape)) * itemsize

    def empty(self, shape: Shape, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised storage (``meta`` device included); scales are set to a valid value."""
        weight = torch.zeros(self.weight_shape(shape), dtype=torch.uint8, device=device).view(self.weight_dtype)
        return weight, torch.ones(self.scale_shape(shape), dtype=torch.float32, device=device).to(self.scale_dtype)

    def check(self, weight: torch.Tensor, scale: torch.Tensor, shape: Shape, what: str,
              values: bool = True) -> None:
        """Raise naming ``what.weight`` / ``what.scale`` unless both tensors are this format's storage of
        ``shape``; ``values`` also reads the scales (NaN/Inf/non-positive; host sync)."""
        self.check_shape(shape, what)
        for name, tensor, dtype, expected in (("weight", weight, self.weight_dtype, self.weight_shape(shape)),
                                              ("scale", scale, self.scale_dtype, self.scale_shape(shape))):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{what}.{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(expected):
                raise ValueError(f"{what}.{name}: format {self.name!r} stores {name} as {dtype} of shape "
                                 f"{tuple(expected)}, got {tensor.dtype} of shape {tuple(tensor.shape)}")
        if values and not scale.is_meta:
            self.check_scale_values(scale, f"{what}.scale")

    def check_scale_values(self, scale: torch.Tensor, what: str) -> None:
        bad = ~torch.isfinite(scale) | (scale <= 0)
        if bool(bad.any()):
            raise ValueError(f"{what}: {int(bad.sum())} scale(s) are NaN, Inf, zero or negative; format "
                             f"{self.name!r} needs finite positive float32 scales")

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E, K, N)`` float -> ``(weight, scale)`` storage."""
        raise NotImplementedError

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Storage of any number of experts -> ``(E', K, N)`` in ``dtype``."""
        raise NotImplementedError

    def quantize_by_expert(self, weight: torch.Tensor, k_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`quantize` one expert at a time: the float32 working copies stay one expert's size, so a layer
        that fills most of an accelerator's memory (DeepSeek-V3's on one GPU) is quantized where it is.
        ``k_major``: the weight stored contraction-dim fastest (see :func:`k_fastest`)."""
        stored, scale = self.empty(Shape(*weight.shape), weight.device)
        if k_major:
            stored = k_fastest(stored)
        for expert in range(weight.shape[0]):
            stored[expert:expert + 1], scale[expert:expert + 1] = self.quantize(weight[expert:expert + 1])
        return stored, scale

    def __repr__(self) -> str:
        return f"QuantizationFormat({self.name!r})"


class Unquantized(QuantizationFormat):
    name = "bf16"
    quantized = False


def _fp8_from_float32(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


class Fp8PerChannel(QuantizationFormat):
    """Per expert, per output channel: one scale for each column of each expert's ``(K, N)`` matrix."""

    name = "fp8"
    nxd_quantization_type = "EXPERT_WISE_PER_CHANNEL_SYMMETRIC"
    nxd_quantized_dtype = "F8E4M3FN"
    nxd_scale_dtype = "F32"

    def quantize(self, weight):
        w = weight.detach().to(torch.float32)
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return _fp8_from_float32(w / scale), scale

    def dequantize(self, weight, scale, dtype):
        return (weight.to(torch.float32) * scale).to(dtype)


class Fp8Block(QuantizationFormat):
    """One scale per ``128 x 128`` tile of each expert's ``(K, N)`` matrix (DeepSeek-V3 / Qwen3 FP8 checkpoints)."""

    name = "fp8_block"
    nxd_quantization_type = "BLOCKWISE_SYMMETRIC"
    nxd_quantized_dtype = "F8E4M3FN"
    nxd_scale_dtype = "F32"
    block_k = 128
    block_n = 128

    def _tiles(self, t: torch.Tensor) -> torch.Tensor:
        e, k, n = t.shape
        return t.reshape(e, k // self.block_k, self.block_k, n // self.block_n, self.block_n)

    def quantize(self, weight):
        w = self._tiles(weight.detach().to(torch.float32))
        amax = w.abs().amax(dim=(2, 4), keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return _fp8_from_float32(w / scale).flatten(3).flatten(1, 2), scale[:, :, 0, :, 0]

    def dequantize(self, weight, scale, dtype):
        w = self._tiles(weight.to(torch.float32)) * scale[:, :, None, :, None]
        return w.flatten(3).flatten(1, 2).to(dtype)


class MxFp4(QuantizationFormat):
    """OCP MX FP4: E2M1 values in blocks of 32 along K, each block with a power-of-two E8M0 scale.

    The scale is the smallest power of two that fits the block's largest magnitude in E2M1's range (``<= 6``),
    so nothing saturates; values round to nearest, ties to even.

    The packed weight keeps its logical ``(E, K/2, N)`` shape but is stored K-fastest (strides
    ``(N*K/2, 1, K/2)``): GPT-OSS's own byte order, so its checkpoints load without a transpose, and the one a
    GPU kernel needs to load whole k-pairs per thread (``docs/gpu.md``). Any strides compute the same values.
    """

    name = "mxfp4"
    nxd_quantization_type = "BLOCKWISE_SYMMETRIC (OCP MX)"
    nxd_quantized_dtype = "F4E2M1FN_X4"
    nxd_scale_dtype = "F8E8M0"
    weight_dtype = torch.uint8
    scale_dtype = torch.uint8
    block_k = 32
    values_per_byte = 2

    def empty(self, shape, device=None):
        e, half_k, n = self.weight_shape(shape)
        return (torch.zeros(e, n, half_k, dtype=torch.uint8, device=device).transpose(1, 2),
                torch.full(self.scale_shape(shape), E8M0_BIAS, dtype=torch.uint8, device=device))

    def check_scale_values(self, scale, what):
        bad = scale == E8M0_NAN
        if bool(bad.any()):
            raise ValueError(f"{what}: {int(bad.sum())} E8M0 scale(s) are 0xFF (NaN); format 'mxfp4' scales are "
                             "biased exponents 0..254")

    def quantize(self, weight):
        e, k, n = weight.shape
        w = weight.detach().to(torch.float32).reshape(e, k // self.block_k, self.block_k, n)
        amax = w.abs().amax(dim=2, keepdim=True)
        exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
        exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
        magnitude = (w.abs() / torch.exp2(exponent)).clamp(max=E2M1_MAX)
        grid = torch.tensor(E2M1_GRID, device=w.device)
        midpoints = (grid[1:] + grid[:-1]) / 2
        code = torch.bucketize(magnitude, midpoints)  # ties go to the lower code ...
        odd_tie = (code % 2 == 1) & (magnitude == midpoints[code.clamp(max=len(midpoints) - 1)])
        code = code + odd_tie.long()  # ... unless that code is odd: round half to even
        code = code + 8 * ((w < 0) & (code > 0)).long()
        codes = code.reshape(e, k // 2, 2, n).to(torch.uint8)
        packed = codes[:, :, 0] | (codes[:, :, 1] << 4)
        return k_fastest(packed), (exponent[:, :, 0] + E8M0_BIAS).to(torch.uint8)

    def dequantize(self, weight, scale, dtype):
        e, half_k, n = weight.shape
        # Code -> value by a 16-entry table (bit 3 the sign), cheaper than decoding every element's bits. The table is
        # computed, not a constant tensor: exported while-loop bodies (torch 2.9) cannot hold tensor constants.
        table = _e2m1_table(weight.device)
        codes = torch.stack([weight & 0x0F, weight >> 4], dim=2).reshape(e, 2 * half_k, n)
        values = table[codes.long()].reshape(e, -1, self.block_k, n)
        block_scale = torch.pow(2.0, scale.to(torch.float32) - E8M0_BIAS)  # pow, not exp2: XLA 2.9 lowers only pow
        return (values * block_scale.unsqueeze(2)).reshape(e, 2 * half_k, n).to(dtype)


def k_fastest(packed: torch.Tensor) -> torch.Tensor:
    """``packed (E, K/2, N)`` with the same values, stored K-fastest (each output column's bytes contiguous)."""
    if packed.dim() != 3:
        raise ValueError(f"k_fastest: packed must be (E, K/2, N), got shape {tuple(packed.shape)}")
    return packed.transpose(1, 2).contiguous().transpose(1, 2)


def _e2m1_table(device) -> torch.Tensor:
    """``(16,)`` float32: the E2M1 value of each 4-bit code (exponent field 0: subnormal ``0.5 * m``; else
    ``2**(e-1) * (1 + m/2)``; bit 3 negates)."""
    code = torch.arange(16, device=device)
    exponent, mantissa = ((code >> 1) & 0x3).to(torch.float32), (code & 0x1).to(torch.float32)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.pow(2.0, exponent - 1) * (1.0 + 0.5 * mantissa))
    return torch.where(code >= 8, -magnitude, magnitude)


FORMATS: dict[str, QuantizationFormat] = {f.name: f for f in (Unquantized(), Fp8PerChannel(), Fp8Block(), MxFp4())}
# NxD / NxDI spellings of the same formats.
ALIASES = {
    None: "bf16",
    "none": "bf16",
    "fp8_per_channel": "fp8",
    "expert_wise_per_channel_symmetric": "fp8",
    "f8e4m3": "fp8",
    "blockwise_symmetric": "fp8_block",
    "f4e2m1fn_x4": "mxfp4",
}
QUANTIZATION_CHOICES = tuple(FORMATS)


def reported_format(quantization: str | QuantizationFormat | None) -> str:
    """A weight format as reports name it: ``"none"`` for weights that are not quantized (they are in the layer's
    dtype, whatever it is, which the internal name ``"bf16"`` does not say), else the format's name."""
    name = get_format(quantization).name
    return "none" if name == "bf16" else name


def describe_weights(quantization: str | QuantizationFormat | None, dtype: torch.dtype | str) -> str:
    """``"fp8"``, ``"mxfp4"``...; unquantized weights by their dtype: ``"float32 (unquantized)"``."""
    name = reported_format(quantization)
    return name if name != "none" else f"{str(dtype).removeprefix('torch.')} (unquantized)"


def get_format(quantization: str | QuantizationFormat | None, what: str = "quantization") -> QuantizationFormat:
    """A format from its name (or NxD alias, case-insensitive), or the format itself."""
    if isinstance(quantization, QuantizationFormat):
        return quantization
    key = quantization.lower() if isinstance(quantization, str) else quantization
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"{what} must be one of {list(FORMATS)} (or an NxD alias {sorted(a for a in ALIASES if a)}), "
                         f"got {quantization!r}")
    return FORMATS[key]
