"""A text form of configurations that is equal across processes for equal settings."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch


# Comparing configurations across processes (nxd_moe.parallel_state.check_configuration) needs a text form of them.
def _describe_setting(value: Any) -> str:
    """A text form that is equal across processes for equal settings (no object addresses)."""
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe_setting(v) for v in value) + ")"
    return repr(value)


def config_fingerprint(**parts: Any) -> dict[str, str]:
    """``{name: text}`` of each part; dataclass parts are expanded field by field (``part.field``)."""
    out: dict[str, str] = {}
    for name, value in parts.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                out[f"{name}.{f.name}"] = _describe_setting(getattr(value, f.name))
        else:
            out[name] = _describe_setting(value)
    return out


# nxd_moe.config, where it lived before it was split, is still its public path: pickles and reprs name it.
config_fingerprint.__module__ = "nxd_moe.config"
