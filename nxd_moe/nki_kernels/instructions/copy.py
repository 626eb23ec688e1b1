"""Writing tiles on an engine without ALU arithmetic: ``tensor_copy`` (converting to the destination's dtype: how
PSUM is evacuated to SBUF), ``tensor_copy_predicated``, ``memset``, ``iota`` (GpSimd's index generator) and
``dequantize`` (a modelled instruction: a quantized weight tile converted on chip)."""

from __future__ import annotations

import numpy as np
import torch

from nxd_moe.nki_kernels.dtypes import cast, is_integer, uint8, uint16, uint32
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import (
    account,
    as_f32,
    check_reaches,
    check_same_shape,
    chosen_engine,
    computes,
    store_result,
    tile_operand,
)
from nxd_moe.nki_kernels.machine import check_alive, instruction
from nxd_moe.nki_kernels.tensor import NkiTensor


@instruction
def tensor_copy(dst, src, engine=None, name=None) -> None:
    """Copy on an engine, converting to ``dst``'s dtype (how PSUM is evacuated to SBUF); bit-exact when the dtypes
    match. GpSimd cannot reach PSUM."""
    label = "tensor_copy"
    dst, src = tile_operand(dst, "dst", label), tile_operand(src, "src", label)
    check_same_shape(label, dst, "dst", src, "src")
    on = chosen_engine(engine, "vector", op=label)
    check_reaches(on, label, dst, src)
    if computes(dst, src):
        if is_integer(src.dtype) or src.dtype == dst.dtype:
            store_result(dst, src.data)
        else:  # through fp32; an integer dst rounds to nearest (store_result)
            store_result(dst, as_f32(src) if is_integer(dst.dtype) else cast(src.data, dst.dtype))
    account(on, label, src, dst)


@instruction
def tensor_copy_predicated(dst, src, predicate, reverse_pred: bool = False, name=None) -> None:
    """``dst = where(predicate, src, dst)`` on the Vector Engine: where the (unsigned integer) predicate is non-zero
    (zero with ``reverse_pred``) copy ``src`` (a tile of dst's dtype, or a number); elsewhere ``dst`` keeps its
    values."""
    label = "tensor_copy_predicated"
    dst, predicate = tile_operand(dst, "dst", label), tile_operand(predicate, "predicate", label)
    check_alive(dst)  # where the predicate is off, dst keeps its values: a read of it
    check_same_shape(label, dst, "dst", predicate, "predicate")
    if predicate.dtype not in (uint8, uint16, uint32):
        raise TypeError(f"{label}: predicate must be uint8, uint16 or uint32, got {predicate.dtype}")
    if isinstance(src, NkiTensor):
        src = tile_operand(src, "src", label)
        check_same_shape(label, dst, "dst", src, "src")
        if src.dtype != dst.dtype:
            raise TypeError(f"{label}: src and dst must share a dtype ({src.dtype} vs {dst.dtype})")
        if src.buffer is Buffer.PSUM and predicate.buffer is Buffer.PSUM:
            raise HardwareLimitError(f"{label}: src and predicate cannot both be in PSUM")
    if computes(dst, predicate, src):
        mask = predicate.data.reshape(dst.partitions, dst.free_size) != 0
        if reverse_pred:
            mask = ~mask
        current = dst.data.reshape(dst.partitions, dst.free_size).copy()
        values = (src.data.reshape(current.shape) if isinstance(src, NkiTensor)
                  else np.asarray(src).astype(dst.dtype))
        store_result(dst, np.where(mask, values, current))
    account("vector", label, dst, predicate)


@instruction
def memset(dst, value, engine=None, name=None) -> None:
    """Fill ``dst`` with a constant on the Vector Engine (or GpSimd)."""
    label = "memset"
    dst = tile_operand(dst, "dst", label)
    on = chosen_engine(engine, "vector", ("vector", "gpsimd"), label)
    check_reaches(on, label, dst)
    if dst.alloc.has_data:
        if dst.dtype.names is not None:
            if value != 0:
                raise ValueError(f"{label}: packed x4 dtypes can only be set to 0, got {value}")
            dst.data.view(np.uint8)[...] = 0
        else:
            store_result(dst, np.float32(value) if not is_integer(dst.dtype) else value)
    account(on, label, dst)


@instruction
def iota(dst, pattern, offset: int = 0, channel_multiplier: int = 0, name=None) -> None:
    """``dst[p, w, z, y, x] = offset + p * channel_multiplier + w*step_w + z*step_z + y*step_y + x*step_x`` on
    GpSimd: ``pattern`` is up to 4 ``[step, count]`` pairs whose counts multiply to dst's elements per partition;
    computed in int32, then cast to dst's dtype. dst must be in SBUF."""
    label = "iota"
    dst = tile_operand(dst, "dst", label, (Buffer.SBUF,))
    pairs = [(int(step), int(count)) for step, count in pattern]
    if not 1 <= len(pairs) <= 4 or any(count < 1 for _, count in pairs):
        raise HardwareLimitError(f"{label}: pattern must be 1 to 4 [step, count] pairs with counts >= 1, got {pattern}")
    if int(np.prod([c for _, c in pairs])) != dst.free_size:
        raise HardwareLimitError(f"{label}: pattern {pattern} generates {int(np.prod([c for _, c in pairs]))} "
                                 f"elements per partition; dst {dst.shape} has {dst.free_size}")
    if dst.alloc.has_data:
        values = np.full((dst.partitions, 1), int(offset), np.int64) + \
            np.arange(dst.partitions, dtype=np.int64)[:, None] * int(channel_multiplier)
        grid = np.zeros([c for _, c in pairs], np.int64)
        for d, (step, count) in enumerate(pairs):
            shape = [1] * len(pairs)
            shape[d] = count
            grid = grid + (np.arange(count, dtype=np.int64) * step).reshape(shape)
        result = (values + grid.reshape(1, -1)).astype(np.int32)
        store_result(dst, result if is_integer(dst.dtype) else result.astype(np.float32))
    account("gpsimd", label, dst)


@instruction
def dequantize(dst, data, scale, weight_format) -> None:
    """``dst (P, C)`` = the weight tile stored as ``data`` with block scales ``scale`` in ``weight_format`` (a
    :class:`~nxd_moe.quantization.formats.QuantizationFormat`), converted on chip before the matmul.

    ``data`` holds the tile's ``P`` rows packed ``values_per_byte`` to a partition row (``(P / v, C)``), ``scale``
    its scale rows (``(P / block_k, C / block_n)``, or one row for per-channel scales). A modelled instruction: one
    Vector Engine pass over ``dst`` (on Trn2 an FP8 tile is a ``tensor_copy`` upcast and a scale multiply; MX
    unpacking is Trn3's ``nc_matmul_mx`` territory).
    """
    name = "dequantize"
    dst, data, scale = (tile_operand(t, r, name) for t, r in ((dst, "dst"), (data, "data"), (scale, "scale")))
    if len(dst.shape) != 2 or data.shape != (dst.shape[0] // weight_format.values_per_byte, dst.shape[1]):
        raise HardwareLimitError(f"{name}: data {data.shape} must hold dst {dst.shape}'s rows packed "
                                 f"{weight_format.values_per_byte} per byte")
    if computes(dst, data, scale):
        def as_torch(t: NkiTensor, dtype):
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8))
            return raw.view(dtype).unsqueeze(0)

        values = weight_format.dequantize(as_torch(data, weight_format.weight_dtype),
                                          as_torch(scale, weight_format.scale_dtype), torch.float32)
        store_result(dst, values[0].numpy())
    account("vector", name, dst, data)
