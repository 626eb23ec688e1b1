"""A stand-in for the Neuron SDK's ``neuron_dtypes`` on ``ml_dtypes``: the part nki-library's tests and torch
references use (``static_cast``, ``sizeinbytes``, ``finfo``, ``is_float_type``, the dtype names, the MX ``_x4``
names). :func:`~nxd_moe.nki_kernels.compat.install` serves it as ``neuron_dtypes`` (and as the legacy
``neuronxcc.starfish.support.dtype``) when asked to.

``static_cast`` rounds to nearest-even into float types (what ``ml_dtypes`` does, and the hardware's rounding) and
truncates toward zero into integer types (C++'s ``static_cast``). The packed MX types (``float8_e4m3fn_x4``, ...)
are Trn3 (NeuronCore-v4) formats: their names exist, casting to them raises.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from nxd_moe.nki_kernels import language

bfloat16 = language.bfloat16
float16 = language.float16
float32 = language.float32
float8_e4m3 = language.float8_e4m3
float8_e4m3fn = language.float8_e4m3fn
float8_e5m2 = language.float8_e5m2
float8_e8m0fnu = language.float8_e8m0fnu
float8_e4m3fn_x4 = language.float8_e4m3fn_x4
float8_e5m2_x4 = language.float8_e5m2_x4
float4_e2m1fn_x4 = language.float4_e2m1fn_x4
_PACKED = (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)


class MxFormatError(NotImplementedError):
    """A cast to a packed MX (``_x4``) type: a Trn3 (NeuronCore-v4) format, not simulated."""


def _dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        name = dtype.rsplit(".", 1)[-1]
        found = getattr(language, name, None)
        return np.dtype(found if isinstance(found, np.dtype) else getattr(ml_dtypes, name, name))
    if hasattr(dtype, "dtype") and not isinstance(dtype, (type, np.dtype)):  # a torch dtype has none; arrays do
        return np.dtype(dtype.dtype)
    return np.dtype(dtype)


def is_float_type(dtype) -> bool:
    """Whether ``dtype`` is a floating-point type (NumPy's or ``ml_dtypes``')."""
    d = _dtype(dtype)
    return d.kind == "f" or d in (bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)


def sizeinbytes(dtype) -> int:
    """Bytes per element (a packed ``_x4`` element is the four values' storage)."""
    return _dtype(dtype).itemsize


def finfo(dtype):
    """``ml_dtypes.finfo``: NumPy's ``finfo`` extended to bfloat16 and the float8 types."""
    return ml_dtypes.finfo(_dtype(dtype))


def static_cast(array, dtype) -> np.ndarray:
    """``array`` converted to ``dtype``: round-to-nearest-even into floats (through fp32 when both are narrow),
    truncation toward zero into integers."""
    target = _dtype(dtype)
    if target in _PACKED:
        raise MxFormatError(f"static_cast to {target.names[0]}: packed MX types are Trn3 (NeuronCore-v4) formats, "
                            "which the nxd_moe simulator (Trn2) does not produce")
    a = np.asarray(array)
    if a.dtype == target:
        return a
    if target.kind in "iub" and is_float_type(a.dtype):
        return np.trunc(a.astype(np.float64)).astype(target)
    if is_float_type(target) and is_float_type(a.dtype) and a.dtype.itemsize < 4 and target.itemsize < 4:
        a = a.astype(np.float32)  # ml_dtypes converts narrow float to narrow float through fp32 as well
    return a.astype(target)
