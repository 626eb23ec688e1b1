"""Gathers on chip (SBUF to SBUF, no DMA): within each partition on GpSimd (``nc_n_gather``, ``local_gather``, and
``nonzero_with_count``, which gathers the indices of non-zero elements) and across the partitions of each quadrant
on the Vector Engine (``nc_stream_shuffle``)."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.dtypes import is_integer, uint16, uint32
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError, OutOfBoundsError
from nxd_moe.nki_kernels.instruction_support import account, check_reaches, computes, store_result, tile_operand
from nxd_moe.nki_kernels.machine import instruction
from nxd_moe.nki_kernels.tensor import NkiTensor


@instruction
def nc_n_gather(dst, data, indices, name=None) -> None:
    """``dst[p, j] = data[p, :].flat[indices[p, j]]`` on GpSimd: all three in SBUF, ``indices`` uint32, ``dst`` of
    ``data``'s dtype with ``indices``' elements per partition; an index outside ``[0, data elements per partition)``
    raises."""
    label = "nc_n_gather"
    dst = tile_operand(dst, "dst", label, (Buffer.SBUF,))
    data = tile_operand(data, "data", label, (Buffer.SBUF,))
    indices = tile_operand(indices, "indices", label, (Buffer.SBUF,))
    if not dst.partitions == data.partitions == indices.partitions:
        raise HardwareLimitError(f"{label}: dst {dst.shape}, data {data.shape} and indices {indices.shape} must have "
                                 "the same partitions")
    if dst.free_size != indices.free_size:
        raise HardwareLimitError(f"{label}: dst has {dst.free_size} elements per partition, indices "
                                 f"{indices.free_size}")
    if indices.dtype != uint32:
        raise TypeError(f"{label}: indices must be uint32, got {indices.dtype}")
    if dst.dtype != data.dtype:
        raise TypeError(f"{label}: dst must have data's dtype {data.dtype}, got {dst.dtype}")
    if computes(dst, data, indices):
        idx = indices.data.astype(np.int64).reshape(indices.partitions, indices.free_size)
        bad = (idx < 0) | (idx >= data.free_size)
        if bad.any():
            p, j = map(int, np.argwhere(bad)[0])
            raise OutOfBoundsError(f"{label}: index {int(idx[p, j])} at partition {p} is outside [0, "
                                   f"{data.free_size}) (data's elements per partition)")
        values = data.data.reshape(data.partitions, data.free_size)
        store_result(dst, np.take_along_axis(values, idx, axis=1))
    account("gpsimd", label, data, dst)


@instruction
def nc_stream_shuffle(dst, src, shuffle_mask, name=None) -> None:
    """Cross-partition moves inside each quadrant of 32 partitions on the Vector Engine: output partition ``i`` of a
    quadrant takes input partition ``shuffle_mask[i]`` of the same quadrant; 255 leaves it unmodified. The
    quadrants' start partitions follow the documented rules (0 for 96/128 active partitions, 0/64 for 64,
    0/32/64/96 for 32)."""
    label = "nc_stream_shuffle"
    dst, src = tile_operand(dst, "dst", label), tile_operand(src, "src", label)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise HardwareLimitError(f"{label}: shuffle_mask must list 32 source partitions (0..31, or 255 to keep), "
                                 f"got {shuffle_mask}")
    if dst.dtype != src.dtype:
        raise TypeError(f"{label}: dst and src dtypes differ ({dst.dtype}, {src.dtype})")
    if dst.free_size != src.free_size:
        raise HardwareLimitError(f"{label}: dst and src must have the same elements per partition "
                                 f"({dst.free_size} vs {src.free_size})")
    active = -(-max(dst.partitions, src.partitions) // 32) * 32
    allowed = {32: (0, 32, 64, 96), 64: (0, 64)}.get(active, (0,))
    starts = {}
    for t, role in ((src, "src"), (dst, "dst")):
        start = _start_partition(t)
        if start not in allowed:
            raise HardwareLimitError(f"{label}: {role} starts at partition {start}; with {active} active partitions "
                                     f"it must start at one of {allowed}")
        starts[role] = start
    if dst.partitions > 32 and dst.partitions != src.partitions:
        raise HardwareLimitError(f"{label}: across quadrants src and dst must span the same partitions")
    if computes(dst, src):
        values = src.data.reshape(src.partitions, src.free_size)
        out = dst.data.reshape(dst.partitions, dst.free_size).copy()
        for q0 in range(0, dst.partitions, 32):
            for i in range(min(32, dst.partitions - q0)):
                j = mask[i]
                if j != 255:
                    if q0 + j >= src.partitions:
                        raise HardwareLimitError(f"{label}: shuffle_mask[{i}] = {j} reads past src's "
                                                 f"{src.partitions} partitions")
                    out[q0 + i] = values[q0 + j]
        dst.data[...] = out.reshape(dst.shape)
    account("vector", label, src, dst)


def _start_partition(t: NkiTensor) -> int:
    """The first partition a view of an on-chip tensor reads or writes."""
    row = t.alloc.bytes_per_partition // t.dtype.itemsize
    return (t.offset // row) if row else 0


@instruction
def local_gather(dst, src_buffer, index, num_elem_per_idx: int = 1, num_valid_indices=None, name=None) -> None:
    """Gather within each partition on GpSimd, per core of 16 partitions (NKI's NumPy semantics): the core flattens
    its 16-partition slice of ``index`` (uint16) partition-first and keeps the first ``num_valid_indices``; every
    partition ``p`` of the core then reads, for each index ``i``, the ``num_elem_per_idx`` contiguous elements of
    ``src_buffer[p]`` starting at element ``i`` into ``dst[p]`` in order. An index past the partition raises
    (undefined on hardware)."""
    label = "local_gather"
    dst, src_buffer, index = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (src_buffer, "src_buffer"),
                                                                (index, "index")))
    check_reaches("gpsimd", label, dst, src_buffer, index)
    if index.dtype != uint16:
        raise TypeError(f"{label}: index must be uint16, got {index.dtype}")
    if src_buffer.partitions != index.partitions or src_buffer.partitions % 16:
        raise HardwareLimitError(f"{label}: src_buffer and index must have the same partitions, a multiple of 16 "
                                 f"({src_buffer.partitions}, {index.partitions})")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        raise HardwareLimitError(f"{label}: num_elem_per_idx must be 1, 2, 4, 8, 16 or 32, got {num_elem_per_idx}")
    if dst.dtype != src_buffer.dtype:
        raise TypeError(f"{label}: dst keeps src_buffer's dtype ({src_buffer.dtype}), got {dst.dtype}")
    per_core = 16 * index.free_size if num_valid_indices is None else int(num_valid_indices)
    if per_core > 16 * index.free_size or per_core > 4096:
        raise HardwareLimitError(f"{label}: {per_core} indices per core exceeds the index slice "
                                 f"({16 * index.free_size}) or 4096")
    if dst.partitions != src_buffer.partitions or dst.free_size < per_core * num_elem_per_idx:
        raise HardwareLimitError(f"{label}: dst {dst.shape} cannot hold {per_core} x {num_elem_per_idx} gathered "
                                 "elements per partition")
    if computes(dst, src_buffer, index):
        src = src_buffer.data.reshape(src_buffer.partitions, -1)
        out = dst.data.reshape(dst.partitions, -1).copy()
        idx = index.data.reshape(index.partitions, -1)
        span = np.arange(num_elem_per_idx)
        for c in range(0, src.shape[0], 16):
            flat = idx[c:c + 16].reshape(16, -1).flatten(order="F")[:per_core].astype(np.int64)
            columns = (flat[:, None] + span[None, :]).reshape(-1)
            if columns.size and columns.max() >= src.shape[1]:
                raise HardwareLimitError(f"{label}: index {int(flat.max())} reads past the {src.shape[1]} elements "
                                         "of a partition (undefined on hardware)")
            out[c:c + 16, :columns.size] = src[c:c + 16][:, columns]
        dst.data[...] = out.reshape(dst.shape)
    account("gpsimd", label, dst)


@instruction
def nonzero_with_count(dst, src, index_offset: int = 0, padding_val: int = -1, name=None) -> None:
    """On GpSimd, for partitions 0, 16, ..., 112 only: the indices (+ ``index_offset``) of ``src``'s non-zero
    elements, then ``padding_val`` up to ``src``'s length, then the count; dst has one more element per partition
    than src; other partitions are not modified."""
    label = "nonzero_with_count"
    dst, src = tile_operand(dst, "dst", label), tile_operand(src, "src", label)
    check_reaches("gpsimd", label, dst, src)
    if dst.partitions != src.partitions or dst.free_size != src.free_size + 1:
        raise HardwareLimitError(f"{label}: dst must be ({src.partitions}, {src.free_size + 1}), got {dst.shape}")
    if computes(dst, src):
        values = src.data.reshape(src.partitions, -1)
        out = dst.data.reshape(dst.partitions, -1).copy()
        for p in range(0, src.partitions, 16):
            nz = np.flatnonzero(values[p].astype(np.float32) != 0)
            row = np.full(src.free_size + 1, padding_val, np.int64)
            row[:nz.size] = nz + int(index_offset)
            row[-1] = nz.size
            out[p] = row.astype(dst.dtype) if is_integer(dst.dtype) else row.astype(np.float32)
        dst.data[...] = out.reshape(dst.shape)
    account("gpsimd", label, src, dst)
