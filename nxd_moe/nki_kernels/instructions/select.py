"""Masks and selections: ``affine_select`` (GpSimd: a predicate from an affine expression of the element's
position, e.g. a causal mask), ``range_select`` and ``select_reduce`` (Vector Engine: select, then a running max
in the accumulator registers), ``sequence_bounds`` (GpSimd: the bounds of each element's run of segment ids)."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.dtypes import float32, int32, is_integer, uint32
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import (
    account,
    accumulate_registers,
    as_f32,
    check_same_shape,
    computes,
    scalar_operand,
    store_result,
    tile_operand,
)
from nxd_moe.nki_kernels.isa_constants import reduce_cmd
from nxd_moe.nki_kernels.isa_constants import reduce_cmd as ReduceCmd
from nxd_moe.nki_kernels.machine import current_core, instruction
from nxd_moe.nki_kernels.opcodes import equal, greater, greater_equal, less, less_equal, maximum

FP32_MIN = float(np.finfo(np.float32).min)
COMPARISONS = (equal, less, less_equal, greater, greater_equal)


def affine_values(partitions: int, pattern, offset: int, channel_multiplier: int, free_size: int,
                  label: str) -> np.ndarray:
    """``(partitions, free_size)`` int64: ``offset + p * channel_multiplier + sum(index_d * step_d)`` over up to 4
    ``[step, count]`` pairs (outermost first), as ``iota`` and ``affine_select`` generate it."""
    pairs = [(int(step), int(count)) for step, count in pattern]
    if not 1 <= len(pairs) <= 4 or any(count < 1 for _, count in pairs):
        raise HardwareLimitError(f"{label}: pattern must be 1 to 4 [step, count] pairs with counts >= 1, got {pattern}")
    counts = [c for _, c in pairs]
    if int(np.prod(counts)) != free_size:
        raise HardwareLimitError(f"{label}: pattern {pattern} generates {int(np.prod(counts))} elements per partition; "
                                 f"the tile has {free_size}")
    grid = np.zeros(counts, np.int64)
    for d, (step, count) in enumerate(pairs):
        shape = [1] * len(pairs)
        shape[d] = count
        grid = grid + (np.arange(count, dtype=np.int64) * step).reshape(shape)
    base = int(offset) + np.arange(partitions, dtype=np.int64)[:, None] * int(channel_multiplier)
    return base + grid.reshape(1, -1)


def _comparison(op, label: str, role: str):
    if op not in COMPARISONS:
        raise ValueError(f"{label}: {role} must be nl.equal, nl.less, nl.less_equal, nl.greater or nl.greater_equal, "
                         f"got {op!r}")
    return op


@instruction
def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=equal, offset=0,
                  name=None) -> None:
    """``dst = where(cmp_op(affine, 0), on_true_tile, on_false_value)`` on GpSimd, ``affine`` as in ``iota``
    (``offset + partition * channel_multiplier + pattern``); both tiles in SBUF; ``on_false_value`` an fp32
    number."""
    label = "affine_select"
    dst = tile_operand(dst, "dst", label, (Buffer.SBUF,))
    on_true_tile = tile_operand(on_true_tile, "on_true_tile", label, (Buffer.SBUF,))
    check_same_shape(label, dst, "dst", on_true_tile, "on_true_tile")
    _comparison(cmp_op, label, "cmp_op")
    affine = affine_values(dst.partitions, pattern, offset, channel_multiplier, dst.free_size, label)
    if computes(dst, on_true_tile):
        keep = np.asarray(cmp_op(affine, 0), bool)
        store_result(dst, np.where(keep, as_f32(on_true_tile), np.float32(on_false_value)))
    account("gpsimd", label, on_true_tile, dst)


@instruction
def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=maximum, range_start=0, on_false_value=FP32_MIN, name=None) -> None:
    """Vector Engine: with ``i = range_start + free index``, ``dst = where(comp_op0(i, bound0) & comp_op1(i, bound1),
    on_true_tile, on_false_value)`` (``bound0``/``bound1`` ``(P, 1)`` fp32, compared in fp32), and a running max of
    ``dst`` in the accumulator registers (``reduce_cmd``), written to ``reduce_res`` when given."""
    label = "range_select"
    dst, on_true_tile = tile_operand(dst, "dst", label), tile_operand(on_true_tile, "on_true_tile", label)
    check_same_shape(label, dst, "dst", on_true_tile, "on_true_tile")
    _comparison(comp_op0, label, "comp_op0")
    _comparison(comp_op1, label, "comp_op1")
    if getattr(reduce_op, "name", None) != "maximum":
        raise ValueError(f"{label}: reduce_op must be nl.maximum, got {reduce_op!r}")
    bounds = []
    for role, bound in (("bound0", bound0), ("bound1", bound1)):
        bound = tile_operand(bound, role, label)
        if bound.shape[0] != dst.partitions or bound.free_size != 1:
            raise HardwareLimitError(f"{label}: {role} must be ({dst.partitions}, 1), got {bound.shape}")
        bounds.append(bound)
    if is_integer(on_true_tile.dtype):
        raise TypeError(f"{label}: on_true_tile must be a float type, got {on_true_tile.dtype}")
    if computes(dst, on_true_tile, *bounds):
        index = (np.float32(range_start) + np.arange(dst.free_size, dtype=np.float32))[None, :]
        keep = (np.asarray(comp_op0(index, as_f32(bounds[0])), bool)
                & np.asarray(comp_op1(index, as_f32(bounds[1])), bool))
        result = np.where(keep, as_f32(on_true_tile), np.float32(on_false_value)).astype(np.float32)
        store_result(dst, result)
        if reduce_cmd != ReduceCmd.idle:
            accumulate_registers(current_core(), label, "vector", result, maximum, reduce_res, reduce_cmd)
    account("vector", label, on_true_tile, dst)


@instruction
def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=maximum, reverse_pred: bool = False, name=None) -> None:
    """Vector Engine: ``dst = where(predicate != 0, on_true, on_false)`` (``reverse_pred`` flips the predicate;
    ``on_false`` an fp32 number or a ``(P, 1)`` tile); ``reduce_cmd`` runs the max accumulator over the result, and
    ``reduce_res`` ``(P, 1)`` receives it (with ``reduce_cmd.idle`` and a ``reduce_res``, the max of this result)."""
    label = "select_reduce"
    dst, predicate, on_true = (tile_operand(dst, "dst", label), tile_operand(predicate, "predicate", label),
                               tile_operand(on_true, "on_true", label))
    check_same_shape(label, dst, "dst", on_true, "on_true")
    check_same_shape(label, predicate, "predicate", on_true, "on_true")
    if predicate.dtype.kind not in "iu" or predicate.dtype.itemsize > 2:
        raise TypeError(f"{label}: predicate must be int8, uint8, int16 or uint16, got {predicate.dtype}")
    if on_true.buffer is Buffer.PSUM and predicate.buffer is Buffer.PSUM:
        raise HardwareLimitError(f"{label}: on_true and predicate cannot both be in PSUM")
    if on_true.dtype in (int32, uint32):
        raise TypeError(f"{label}: on_true cannot be int32 or uint32")
    if getattr(reduce_op, "name", None) != "maximum":
        raise ValueError(f"{label}: reduce_op must be nl.maximum, got {reduce_op!r}")
    on_false = scalar_operand(on_false, on_true, label, "on_false")
    if computes(dst, predicate, on_true, on_false):
        keep = predicate.data.reshape(dst.partitions, dst.free_size) != 0
        if reverse_pred:
            keep = ~keep
        result = np.where(keep, as_f32(on_true), as_f32(on_false)).astype(np.float32)
        store_result(dst, result)
        cmd = reduce_cmd
        if cmd == ReduceCmd.idle and reduce_res is not None:
            cmd = ReduceCmd.reset_reduce
        if cmd != ReduceCmd.idle:
            accumulate_registers(current_core(), label, "vector", result, maximum, reduce_res, cmd)
    account("vector", label, on_true, dst)


@instruction
def sequence_bounds(dst, segment_ids, name=None) -> None:
    """GpSimd, one partition: for ``segment_ids (1, n)`` (0 = padding), ``dst (1, 2, n)`` holds each element's run
    ``[start, end)`` of equal consecutive ids; padding gets ``[n, -1]``. fp32 or int32 in and out."""
    label = "sequence_bounds"
    dst, segment_ids = tile_operand(dst, "dst", label), tile_operand(segment_ids, "segment_ids", label)
    n = segment_ids.free_size
    if segment_ids.partitions != 1 or dst.partitions != 1 or dst.free_size != 2 * n:
        raise HardwareLimitError(f"{label}: segment_ids must be (1, n) and dst (1, 2, n); got {segment_ids.shape} and "
                                 f"{dst.shape}")
    for role, t in (("dst", dst), ("segment_ids", segment_ids)):
        if t.dtype not in (float32, int32):
            raise TypeError(f"{label}: {role} must be float32 or int32, got {t.dtype}")
    if computes(dst, segment_ids):
        ids = as_f32(segment_ids).reshape(n)
        new_run = np.r_[True, ids[1:] != ids[:-1]]
        run = np.cumsum(new_run) - 1
        starts = np.flatnonzero(new_run)
        ends = np.r_[starts[1:], n]
        padding = ids == 0
        start = np.where(padding, n, starts[run])
        end = np.where(padding, -1, ends[run])
        store_result(dst, np.stack([start, end]).reshape(1, 2 * n).astype(np.float32))
    account("gpsimd", label, segment_ids, dst)
