"""Input checks: each rejects a bad argument with an error that names it and what is allowed.

Imports nothing of nxd_moe, so that every module can check its arguments the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def to_torch_dtype(value: torch.dtype | str, name: str = "dtype") -> torch.dtype:
    """Accept a floating ``torch.dtype`` or one of its usual spellings (``"bf16"``, ``"float32"``...)."""
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise TypeError(f"{name} must be a floating-point dtype, got {value}")
        return value
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise TypeError(f"{name} must be a floating torch.dtype or one of {sorted(_DTYPES)}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# small validators: every message names the argument and what is allowed


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else minimum
        high = "inf" if maximum is None else maximum
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_float(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_limits(owner: str, lower_name: str, lower: Any, upper_name: str, upper: Any) -> None:
    for name, value in ((lower_name, lower), (upper_name, upper)):
        if value is not None:
            check_float(f"{owner}.{name}", value)
    if lower is not None and upper is not None and lower > upper:
        raise ValueError(f"{owner}.{lower_name} ({lower}) must be <= {owner}.{upper_name} ({upper})")


# nxd_moe.config, where these lived before it was split, is still their public path: pickles and reprs name it.
for _public in (to_torch_dtype, check_int, check_float, check_bool):
    _public.__module__ = "nxd_moe.config"
del _public
