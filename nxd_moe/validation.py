"""Input checks shared by the modules.

Shape and dtype checks are free (they read metadata) and always run. Value checks (NaN/Inf, duplicate experts)
read tensor data, which is a device-to-host synchronisation, so they run only when a caller asks
(``validate_inputs=True``) -- or when weights are loaded, which is never on the hot path. The expert-index range
is the exception: a wrong id would silently drop a token's pair, so it is always checked, in a way that costs no
host sync (:func:`check_expert_index_range`).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn


def check_hidden_states(x, hidden_size: int | tuple[int, ...], what: str = "hidden_states") -> None:
    """A floating tensor of at least one dimension whose last dimension is (one of) ``hidden_size``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")
    sizes = (hidden_size,) if isinstance(hidden_size, int) else hidden_size
    if x.dim() < 1 or x.shape[-1] not in sizes:
        allowed = sizes[0] if len(sizes) == 1 else " or ".join(map(str, sizes))
        raise ValueError(f"{what} must have last dimension {allowed}, got shape {tuple(x.shape)}")


def check_mask_dtype(mask, what: str = "padding_mask") -> None:
    """A tensor of bool, integer or floating 0/1 values (a complex or non-tensor mask is a mistake)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{what} must be a bool, integer or floating 0/1 tensor, got dtype {mask.dtype}")


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise if ``x`` holds NaN or Inf (reads the data: host sync). Large tensors are checked in slices of the
    first dimension, so a full DeepSeek-V3 expert tensor never needs a temporary of its size."""
    if not x.is_floating_point():
        return
    bad = 0
    step = max(1, x.shape[0] * (1 << 26) // max(1, x.numel())) if x.dim() else 1
    for part in (x.split(step) if x.dim() else (x,)):
        part = part.to(torch.float32) if part.element_size() == 1 else part  # FP8 has no isfinite kernel
        # A sum is finite only if every term is; an overflowing sum of finite terms falls to the exact count. The
        # sum needs no temporary of the slice's size (loading a layer beside its source then holds nothing more).
        if not torch.isfinite(part.sum(dtype=torch.float32)):
            bad += int((~torch.isfinite(part)).sum())
    if bad:
        raise ValueError(f"{what} contains {bad} NaN/Inf value(s)")


def check_expert_index_range(expert_index: torch.Tensor, num_experts: int, what: str) -> None:
    """Every id of ``expert_index`` lies in ``[0, num_experts)``, checked without a device-to-host sync: an
    asynchronous assert (``torch._assert_async``) that raises ``RuntimeError`` naming ``what`` at once on a CPU
    tensor, and on a CUDA tensor stops the process with that message at the next sync (a CUDA graph captures it).
    XLA tensors are not checked -- an XLA graph cannot assert -- so there, ids in range are the caller's contract
    (an id outside it routes its pair nowhere)."""
    if expert_index.numel() == 0 or expert_index.device.type == "xla":
        return
    in_range = (expert_index >= 0) & (expert_index < num_experts)
    torch._assert_async(in_range.all(), f"{what} values must be in [0, {num_experts - 1}]")


def _own_tensors(module: nn.Module, prefix: str) -> Iterator[str]:
    """State-dict keys of ``module`` excluding those owned by nested :class:`FiniteWeightsOnLoad` modules."""
    for name in list(module._parameters) + list(module._buffers):
        yield prefix + name
    for child_name, child in module._modules.items():
        if child is not None and not isinstance(child, FiniteWeightsOnLoad):
            yield from _own_tensors(child, f"{prefix}{child_name}.")


class FiniteWeightsOnLoad:
    """Mixin for ``nn.Module``: ``load_state_dict`` raises ``ValueError`` naming any weight holding NaN/Inf."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(FiniteWeightsOnLoad._check_loaded)

    @staticmethod
    def _check_loaded(module, state_dict, prefix, *args, **kwargs):
        for key in _own_tensors(module, prefix):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                check_finite(value, f"weight {key!r} being loaded")
