"""The NKI dtypes (``nl.bfloat16``, ``nl.float8_e4m3``, ...: NumPy and ``ml_dtypes`` dtypes) and how the engines
convert between them (:func:`cast`, through fp32).

Values are stored in their real dtype, so every store rounds as the hardware does.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import torch

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)  # OCP E4M3 (+-448): what FP8 checkpoints store
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)
tfloat32 = float32  # fp32 storage; the Tensor Engine's tf32 rounding is not modelled


def _packed(name: str) -> np.dtype:
    """A Trn3 (NeuronCore-v4) MX dtype packing four values into 4 bytes: storage only (bytes), no arithmetic."""
    return np.dtype([(name, np.uint8, (4,))])


float8_e4m3fn_x4 = _packed("float8_e4m3fn_x4")
float8_e5m2_x4 = _packed("float8_e5m2_x4")
float4_e2m1fn_x4 = _packed("float4_e2m1fn_x4")


def is_integer(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer)


@functools.lru_cache(maxsize=None)
def _byte_table(src: np.dtype, dst: np.dtype) -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(src).astype(np.float32).astype(dst)


def cast(values: np.ndarray, dtype) -> np.ndarray:
    """``values.astype(dtype)`` through fp32 (how engines convert). One-byte floats (fp8) go through a 256-entry table
    -- the same values, ~4x faster than ``ml_dtypes``' element loop; float16 through torch -- the same values (a NaN
    stays NaN; its payload bits may differ), ~15x faster than NumPy's unvectorised half-precision loop."""
    dtype = np.dtype(dtype)
    if values.dtype.itemsize == 1 and values.dtype.kind not in "biu" and values.dtype.names is None:
        return np.take(_byte_table(values.dtype, dtype), values.view(np.uint8))
    wide = _half_to_f32(values) if values.dtype == np.float16 else values.astype(np.float32)
    if dtype == np.float32:
        return wide
    return _f32_to_half(wide) if dtype == np.float16 else wide.astype(dtype, copy=False)


TORCH_CONVERT_MIN = 4096  # elements: below it a torch call's fixed cost exceeds NumPy's per-element loop


def _torch_view(values: np.ndarray):
    """``values`` as a torch tensor sharing memory, or None where NumPy is as fast (small) or torch cannot view it
    (negative strides, read-only)."""
    if values.size < TORCH_CONVERT_MIN or any(s < 0 for s in values.strides) or not values.flags.writeable:
        return None
    return torch.from_numpy(values)


def _half_to_f32(values: np.ndarray) -> np.ndarray:
    t = _torch_view(values)
    return values.astype(np.float32) if t is None else t.float().numpy()


def _f32_to_half(values: np.ndarray) -> np.ndarray:
    t = _torch_view(values)
    return values.astype(np.float16) if t is None else t.half().numpy()
