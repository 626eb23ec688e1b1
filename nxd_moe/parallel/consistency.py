"""Fail on every rank, with one clear message, when ranks disagree on a configuration.

Ranks built with different settings do not fail where the difference is: they exchange tensors of different
shapes, or wait in collectives the others never enter. Comparing a fingerprint of the configuration once, at
construction, turns that into a ``ValueError`` on every rank naming the field and each rank's value.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

import torch
import torch.distributed as dist


def _describe(value: Any) -> str:
    """A text form that is equal across processes for equal settings (no object addresses)."""
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return repr(value)


def config_fingerprint(**parts: Any) -> dict[str, str]:
    """``{name: text}`` of each part; dataclass parts are expanded field by field (``part.field``)."""
    out: dict[str, str] = {}
    for name, value in parts.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                out[f"{name}.{f.name}"] = _describe(getattr(value, f.name))
        else:
            out[name] = _describe(value)
    return out


def check_same_on_all_ranks(values: Mapping[str, Any], what: str, group, timeout_s: float) -> None:
    """All-gather ``values`` over ``group`` (a gloo group whose timeout is ``timeout_s``) and raise on every rank
    if any key differs: ``ValueError`` listing the differing keys with each rank's value. A rank that does not
    arrive in time makes the others raise ``RuntimeError``."""
    size = dist.get_world_size(group)
    gathered: list[Any] = [None] * size
    try:
        dist.all_gather_object(gathered, dict(values), group=group)
    except RuntimeError as e:
        raise not_every_rank_arrived(what, timeout_s, e) from e
    keys = sorted({k for g in gathered for k in g})
    differing = [k for k in keys if len({repr(g.get(k)) for g in gathered}) > 1]
    if differing:
        lines = [f"{k}: " + ", ".join(f"rank {r}={g.get(k)!r}" for r, g in enumerate(gathered)) for k in differing]
        raise ValueError(f"{what} differ across ranks; every rank must use the same values:\n  " + "\n  ".join(lines))


def not_every_rank_arrived(what: str, timeout_s: float, error: Exception) -> RuntimeError:
    """The error for a collective that timed out because some rank never joined it."""
    return RuntimeError(f"{what}: not every rank arrived within {timeout_s:g} s (a rank failed before this point, "
                        f"was started with another world size, or runs different code); original error: {error}")
