"""The tensors inside a forward's arguments and outputs (any pytree of them): listed, described for a report, and
compared with another forward's."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_leaves

# A forward's positional arguments.
Inputs = Sequence[Any]


def leaf_tensors(value) -> list[torch.Tensor]:
    """The tensors among the leaves of ``value``, in pytree order."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def describe_tensors(value) -> list[dict]:
    """``[{"shape", "dtype"}]`` of :func:`leaf_tensors`, dtypes in torch's names (``float32``)."""
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in leaf_tensors(value)]


def max_abs_diff(actual, expected) -> float:
    """Largest ``|actual - expected|`` over the tensors of two pytrees of the same structure (in float64, on the
    CPU; 0.0 for empty tensors)."""
    pairs = list(zip(leaf_tensors(actual), leaf_tensors(expected), strict=True))
    diffs = [float((a.detach().cpu().double() - e.detach().cpu().double()).abs().max()) if a.numel() else 0.0
             for a, e in pairs]
    return max(diffs, default=0.0)
