"""Batch-norm statistics on the Vector Engine: ``bn_stats`` (count, mean and variance of the even- and odd-indexed
elements of each partition) and ``bn_aggr`` (their combination into mean and variance), in fp32."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.hardware import BN_STATS_FMAX, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import account, as_f32, computes, store_result, tile_operand
from nxd_moe.nki_kernels.machine import instruction


@instruction
def bn_stats(dst, data, name=None) -> None:
    """Per partition: ``(count, mean, variance * count)`` of the even-indexed and of the odd-indexed elements of
    ``data`` (at most 512 per partition), in fp32 on the Vector Engine; dst has 6 elements per partition."""
    label = "bn_stats"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    if data.free_size > BN_STATS_FMAX:
        raise HardwareLimitError(f"{label}: data has {data.free_size} elements per partition; at most "
                                 f"nl.tile_size.bn_stats_fmax = {BN_STATS_FMAX}")
    if dst.partitions != data.partitions or dst.free_size != 6:
        raise HardwareLimitError(f"{label}: dst must be ({data.partitions}, 6), got {dst.shape}")
    if computes(dst, data):
        x = as_f32(data)
        parts = []
        for half in (x[:, 0::2], x[:, 1::2]):
            count = np.float32(half.shape[1])
            mean = half.mean(axis=1) if half.shape[1] else np.zeros(x.shape[0], np.float32)
            m2 = ((half - mean[:, None]) ** 2).sum(axis=1)
            parts += [np.full(x.shape[0], count, np.float32), mean, m2]
        store_result(dst, np.stack(parts, axis=1))
    account("vector", label, data, dst)


@instruction
def bn_aggr(dst, data, name=None) -> None:
    """Combine ``(count, mean, variance * count)`` triples (``bn_stats`` outputs) into ``(mean, variance)`` per
    partition, in fp32 on the Vector Engine."""
    label = "bn_aggr"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    if data.free_size % 3:
        raise HardwareLimitError(f"{label}: data must hold (count, mean, variance*count) triples; "
                                 f"{data.free_size} elements per partition is not a multiple of 3")
    if dst.partitions != data.partitions or dst.free_size != 2:
        raise HardwareLimitError(f"{label}: dst must be ({data.partitions}, 2), got {dst.shape}")
    if computes(dst, data):
        triples = as_f32(data).reshape(data.partitions, -1, 3)
        count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
        total = count.sum(axis=1)
        safe = np.where(total > 0, total, 1)
        grand = (count * mean).sum(axis=1) / safe
        var = (m2 + count * (mean - grand[:, None]) ** 2).sum(axis=1) / safe
        store_result(dst, np.stack([grand, var], axis=1))
    account("vector", label, data, dst)
