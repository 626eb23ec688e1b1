"""Multiply groups of rows by their expert's weight matrix: the one matmul every sparse algorithm needs.

Two implementations of one contract:

- ``gather``: ``bmm(x, weight[group_expert])``. Pure static indexing + batched matmul: what XLA traces, what
  ``torch.compile`` captures for any dtype, and the direct analogue of a kernel loading each block's weights.
  It copies one weight matrix per group, so it is memory-hungry for many groups.
- ``grouped_mm``: ``torch.nn.functional.grouped_mm`` over the expert-sorted rows. No weight copies, and groups
  past the last active one are not computed at all (the eager counterpart of the kernels' dynamic-while
  skipping). Available for fp32/bf16/fp16 on CPU and bf16 on CUDA (sm80+); inside ``torch.compile`` only for
  bf16, which is all its meta kernel accepts.

``auto`` picks ``grouped_mm`` where it applies and ``gather`` everywhere else. A quantized weight
(:class:`~nxd_moe.quantization.weight.QuantizedWeight`) is dequantized once whole when there are at least as many
groups as experts (then ``auto`` may pick ``grouped_mm``), and otherwise per group by ``gather`` -- decode's few
pairs dequantize only their experts. Both return identical results up to float rounding; tests run both.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from nxd_moe.quantization.weight import dequantized

MATMUL_IMPLS = ("auto", "gather", "grouped_mm")


def grouped_mm_applies(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
                       weight_dims: Sequence[int]) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` multiplies rows of ``dtype`` on ``device`` by weights of
    ``weight_dtype`` whose last two dims are ``weight_dims`` (each weight's, flattened) -- here, now (inside
    ``torch.compile`` fewer dtypes apply)."""
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    if device.type == "cpu":
        dtypes = (torch.bfloat16,) if torch.compiler.is_compiling() else (torch.float32, torch.bfloat16, torch.float16)
    elif device.type == "cuda":
        dtypes = (torch.bfloat16,) if torch.cuda.get_device_capability(device) >= (8, 0) else ()
    else:
        return False
    if dtype not in dtypes or weight_dtype != dtype:
        return False
    # grouped_mm needs 16-byte aligned row strides on both operands.
    return all((size * dtype.itemsize) % 16 == 0 for size in weight_dims)


def _grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return grouped_mm_applies(x.device, x.dtype, weight.dtype, (weight.shape[1], weight.shape[2]))


def resolve_matmul_impl(impl: str, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> str:
    """The implementation that will multiply ``x`` by each of ``weights`` (one choice for all of them)."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul impl must be one of {list(MATMUL_IMPLS)}, got {impl!r}")
    applies = all(_grouped_mm_applies(x, w) for w in weights)
    if impl == "auto":
        few_groups = False
        for w in weights:  # a loop, not any(): Dynamo 2.9 cannot inline a generator over NamedTuples here
            few_groups = few_groups or (not isinstance(w, torch.Tensor) and x.shape[0] < w.shape[0])
        return "grouped_mm" if applies and not few_groups else "gather"
    if impl == "grouped_mm" and not applies:
        raise ValueError(
            f"matmul impl 'grouped_mm' does not apply to dtype {x.dtype} on {x.device.type} with weight shapes "
            f"{[tuple(w.shape) for w in weights]}; use 'gather' or 'auto'"
        )
    return impl


class GroupPlan(NamedTuple):
    """How groups of rows meet their experts, computed once and shared by every projection of a forward.

    ``group_expert (G,)``: each group's expert; ``row_ends (E,)`` int32: cumulative row count per expert over
    the active groups (``grouped_mm`` only, else None).
    """

    impl: str
    group_expert: torch.Tensor
    row_ends: torch.Tensor | None


def plan_groups(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    group_expert: torch.Tensor,
    group_active: torch.Tensor | None = None,
    impl: str = "auto",
) -> GroupPlan:
    """Plan ``x (G, M, K)``'s groups against ``weights`` (each ``(E, ., .)``).

    Contract: ``group_expert (G,)`` is non-decreasing (groups sorted by expert) and the active groups
    (``group_active (G,)`` bool, all if None) form a prefix. Rows of inactive groups come out unspecified
    (``grouped_mm`` leaves them uninitialised, ``gather`` computes them from their padding input): callers
    must never read them, and the combine step only reads slots of real tokens, which are all active.
    """
    impl = resolve_matmul_impl(impl, x, weights)
    if impl == "gather":
        return GroupPlan(impl, group_expert, None)
    active = torch.ones_like(group_expert) if group_active is None else group_active.to(group_expert.dtype)
    groups_per_expert = torch.zeros(weights[0].shape[0], dtype=group_expert.dtype, device=x.device)
    groups_per_expert = groups_per_expert.index_add(0, group_expert, active)
    row_ends = (torch.cumsum(groups_per_expert, dim=0) * x.shape[1]).to(torch.int32)
    return GroupPlan(impl, group_expert, row_ends)


def grouped_matmul(x: torch.Tensor, weight, plan: GroupPlan) -> torch.Tensor:
    """``x (G, M, K) @ weight[plan.group_expert] (G, K, N) -> (G, M, N)``."""
    if plan.impl == "gather":
        if x.shape[0] >= weight.shape[0]:  # as many groups as experts: dequantize each expert once, not per group
            weight = dequantized(weight)
        return torch.bmm(x, weight.index_select(0, plan.group_expert))
    groups, rows, _ = x.shape
    out = torch.nn.functional.grouped_mm(x.reshape(groups * rows, -1), dequantized(weight), offs=plan.row_ends)
    return out.view(groups, rows, -1)
