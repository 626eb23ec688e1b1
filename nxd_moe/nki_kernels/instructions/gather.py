"""``nc_n_gather``: a gather within each partition on GpSimd (SBUF to SBUF, no DMA)."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.instruction_support import _account, _computes, _store, _tile
from nxd_moe.nki_kernels.machine import Buffer, HardwareLimitError, OutOfBoundsError, instruction


@instruction
def nc_n_gather(dst, data, indices, name=None) -> None:
    """``dst[p, j] = data[p, :].flat[indices[p, j]]`` on GpSimd: all three in SBUF, ``indices`` uint32, ``dst`` of
    ``data``'s dtype with ``indices``' elements per partition; an index outside ``[0, data elements per partition)``
    raises."""
    label = "nc_n_gather"
    dst = _tile(dst, "dst", label, (Buffer.SBUF,))
    data = _tile(data, "data", label, (Buffer.SBUF,))
    indices = _tile(indices, "indices", label, (Buffer.SBUF,))
    if not dst.partitions == data.partitions == indices.partitions:
        raise HardwareLimitError(f"{label}: dst {dst.shape}, data {data.shape} and indices {indices.shape} must have "
                                 "the same partitions")
    if dst.free_size != indices.free_size:
        raise HardwareLimitError(f"{label}: dst has {dst.free_size} elements per partition, indices "
                                 f"{indices.free_size}")
    if indices.dtype != nl.uint32:
        raise TypeError(f"{label}: indices must be uint32, got {indices.dtype}")
    if dst.dtype != data.dtype:
        raise TypeError(f"{label}: dst must have data's dtype {data.dtype}, got {dst.dtype}")
    if _computes(dst, data, indices):
        idx = indices.data.astype(np.int64).reshape(indices.partitions, indices.free_size)
        bad = (idx < 0) | (idx >= data.free_size)
        if bad.any():
            p, j = map(int, np.argwhere(bad)[0])
            raise OutOfBoundsError(f"{label}: index {int(idx[p, j])} at partition {p} is outside [0, "
                                   f"{data.free_size}) (data's elements per partition)")
        values = data.data.reshape(data.partitions, data.free_size)
        _store(dst, np.take_along_axis(values, idx, axis=1))
    _account("gpsimd", label, data, dst)
