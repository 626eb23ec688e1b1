"""The DMA queues: ``dma_copy`` (HBM <-> SBUF, HBM -> HBM, SBUF -> SBUF, with dynamic access patterns and
``oob_mode``), ``dma_compute`` (a sum of sources inside the DMA engines) and ``dma_transpose``. Each is accounted as
traffic of the HBM tensor it reads or writes (:class:`~nxd_moe.nki_kernels.accounting.DmaTraffic`)."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.accounting import DmaTraffic
from nxd_moe.nki_kernels.dtypes import is_integer
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError, OutOfBoundsError
from nxd_moe.nki_kernels.instruction_support import as_f32, computes, mark_unknown, store_result
from nxd_moe.nki_kernels.isa_constants import dge_mode, oob_mode
from nxd_moe.nki_kernels.machine import check_alive, current_core, instruction
from nxd_moe.nki_kernels.opcodes import add
from nxd_moe.nki_kernels.tensor import AccessPattern, NkiTensor


@instruction
def dma_copy(dst, src, priority=None, oob_mode: str = oob_mode.error, dge_mode=dge_mode.unknown, engine=None,
             name=None) -> None:
    """Copy ``src`` to ``dst`` through the DMA queues (HBM <-> SBUF, HBM -> HBM, SBUF -> SBUF).

    Either side may be an :meth:`~nxd_moe.nki_kernels.tensor.NkiTensor.ap` access pattern with dynamic offsets;
    rows whose dynamic address is out of bounds raise (``oob_mode.error``) or are not transferred
    (``oob_mode.skip``: the destination rows keep their contents). The element counts must match; sides with the
    same rows and elements per row move row by row (a vector offset gathers or scatters rows), others all at once in
    row-major order (no vector offset then). Different dtypes convert through fp32 (NKI's documented DMA cast);
    bytes are counted in the HBM side's dtype.
    """
    for side, role in ((dst, "dst"), (src, "src")):
        _check_dma_side(side, role, "dma_copy")
    if oob_mode not in ("error", "skip"):
        raise ValueError(f"dma_copy: oob_mode must be oob_mode.error or oob_mode.skip, got {oob_mode!r}")
    if int(dge_mode) not in (0, 1, 2, 3):
        raise ValueError(f"dma_copy: dge_mode must be a nisa.dge_mode member, got {dge_mode!r}")
    def rows_of(t):
        return t.shape[0], int(np.prod(t.shape[1:]))
    aligned = rows_of(dst) == rows_of(src)
    if not aligned:
        vector = any(isinstance(s, AccessPattern) and s.vector_offset is not None for s in (dst, src))
        if vector or int(np.prod(dst.shape)) != int(np.prod(src.shape)):
            raise HardwareLimitError(f"dma_copy: shapes differ (dst {dst.shape}, src {src.shape}); they must hold the "
                                     "same number of elements, and a vector-offset access the same rows")
    # Aligned transfers are row by row (a vector offset gathers or scatters rows); a reshaping one is all or nothing.
    valid = np.ones(dst.shape[0] if aligned else 1, dtype=bool)
    bases = {}
    for side, role in ((dst, "dst"), (src, "src")):
        if not isinstance(side, AccessPattern):
            continue
        base, ok, index = side.rows()
        bases[role] = base
        if not aligned:
            first_bad = int(np.argmin(ok))
            ok, index = ok.all(keepdims=True), index[first_bad:first_bad + 1]
        bad = ~ok & valid
        if bad.any() and oob_mode == "error":
            first = int(np.argmax(bad))
            raise OutOfBoundsError(
                f"dma_copy: {role} {side.name!r} dynamic index {int(index[first])} is out of bounds for dim "
                f"{side.indirect_dim} of size {side.tensor.shape[side.indirect_dim]} (oob_mode=error)")
        valid &= ok
    moved = int(valid.sum())
    if moved and _has_data(dst) and not _has_data(src):
        mark_unknown(_base(dst), [src.name])
    elif moved and _has_data(dst):
        if aligned:
            values = _dma_read(src, bases.get("src"), valid)
            _dma_write(dst, bases.get("dst"), valid, _convert(values, dst.dtype))
        else:
            values = _dma_read(src, bases.get("src"), None).reshape(dst.shape)
            _dma_write(dst, bases.get("dst"), None, _convert(values, dst.dtype))
    hbm = src if not src.buffer.on_chip else dst if not dst.buffer.on_chip else src
    if aligned:
        rows, moved_rows = dst.shape[0], moved
        moved_bytes = moved * int(np.prod(dst.shape[1:])) * hbm.dtype.itemsize
    else:
        rows = next((s.shape[0] for s in (dst, src) if s.buffer.on_chip), dst.shape[0])
        moved_rows = rows * moved
        moved_bytes = moved * int(np.prod(dst.shape)) * hbm.dtype.itemsize
    current_core().accounting.record_dma(hbm.name, f"{src.buffer.kind}->{dst.buffer.kind}", DmaTraffic(
        bytes=moved_bytes, transfers=int(moved > 0), rows=moved_rows, skipped_rows=rows - moved_rows,
        skipped_transfers=int(moved == 0)))


@instruction
def dma_compute(dst, srcs, reduce_op=add, scales=None, unique_indices: bool = True, oob_mode: str = oob_mode.error,
                name=None) -> None:
    """``dst = reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...)`` elementwise inside the DMA engines, in fp32
    (sources cast to fp32, the result to dst's dtype) -- how LNC2 kernels sum the two cores' partial outputs. As NKI
    documents, only ``nl.add`` and scales of 1.0 are supported. Accounted as one read transfer per source and the
    write of ``dst``."""
    name = "dma_compute"
    _check_dma_side(dst, "dst", name)
    if not isinstance(dst, NkiTensor) or not srcs:
        raise TypeError(f"{name}: dst must be a tensor and srcs a non-empty list of tensors")
    if reduce_op is not add:
        raise ValueError(f"{name}: only reduce_op=nl.add is supported, got {reduce_op!r}")
    if scales is not None and (len(scales) != len(srcs) or any(float(v) != 1.0 for v in scales)):
        raise ValueError(f"{name}: scales must be None or one 1.0 per source ({len(srcs)}), got {scales!r}")
    for i, src in enumerate(srcs):
        _check_dma_side(src, f"srcs[{i}]", name)
        if not isinstance(src, NkiTensor) or src.shape[0] != dst.shape[0] or src.size != dst.size:
            raise HardwareLimitError(f"{name}: srcs[{i}] must be a tensor with dst's rows and elements "
                                     f"({dst.shape}), got {src!r}")
    factors = [np.float32(1.0)] * len(srcs)
    if computes(dst, *srcs):
        result = as_f32(srcs[0]) * factors[0]
        for src, factor in zip(srcs[1:], factors[1:]):
            result = reduce_op(result, as_f32(src) * factor)
        store_result(dst, result)
    accounting = current_core().accounting
    nbytes = int(np.prod(dst.shape)) * dst.dtype.itemsize
    for src in srcs:
        accounting.record_dma(src.name, f"{src.buffer.kind}->{dst.buffer.kind}",
                              DmaTraffic(bytes=nbytes, transfers=1, rows=dst.shape[0]))
    accounting.record_dma(dst.name, f"dma_compute->{dst.buffer.kind}", DmaTraffic(bytes=nbytes, rows=dst.shape[0]))


@instruction
def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode: str = oob_mode.error,
                  name=None) -> None:
    """``dst = src`` permuted by the DMA engines: ``[1, 0]`` for 2-D, ``[2, 1, 0]`` for 3-D, ``[3, 1, 2, 0]`` for
    4-D (or ``axes``). ``src`` may gather rows with a vector offset (``oob_mode.skip`` leaves skipped columns);
    with ``dge_mode.hwdge`` the documented hardware limits apply (2-byte dtype, last dim <= 128)."""
    label = "dma_transpose"
    for side, role in ((dst, "dst"), (src, "src")):
        _check_dma_side(side, role, label)
    ndim = len(src.shape)
    axes = tuple(axes) if axes is not None else {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}.get(ndim)
    if axes is None or sorted(axes) != list(range(ndim)):
        raise HardwareLimitError(f"{label}: src must be 2-D to 4-D (or give axes), got {src.shape} / axes {axes}")
    expected = tuple(src.shape[a] for a in axes)
    if int(np.prod(expected)) != int(np.prod(dst.shape)) or expected[0] != dst.shape[0]:
        raise HardwareLimitError(f"{label}: dst {dst.shape} must be src {src.shape} permuted by {axes} = {expected}")
    if src.dtype != dst.dtype:
        raise TypeError(f"{label}: src and dst dtypes differ ({src.dtype}, {dst.dtype})")
    if dge_mode == 2:  # hwdge: the documented direct-transpose limits
        lead_ok = src.shape[0] == 16 if ndim == 2 else (src.shape[0] in (1, 2, 4, 8, 16)
                                                        and src.shape[0] * src.shape[-2] % 16 == 0)
        if src.dtype.itemsize != 2 or src.shape[-1] > 128 or not lead_ok:
            raise HardwareLimitError(f"{label}: a hardware-DGE transpose needs a 2-byte dtype, src.shape[-1] <= 128 "
                                     "and "
                                     "src.shape[0] == 16 (2-D) or in {1, 2, 4, 8, 16} with shape[0] * shape[-2] a "
                                     f"multiple of 16 (3-D / 4-D); got {src.dtype} {src.shape}")
    if isinstance(src, AccessPattern) and src.vector_offset is not None and (
            src.dtype.itemsize != 2 or src.shape[-1] > 128 or dge_mode == 2):
        raise HardwareLimitError(f"{label}: a gather-transpose (software DGE) needs a 2-byte dtype and "
                                 f"src.shape[-1] <= 128; got {src.dtype} {src.shape}, dge_mode {dge_mode!r}")
    valid = None
    if isinstance(src, AccessPattern):
        base, valid, index = src.rows()
        if not valid.all() and oob_mode == "error":
            first = int(np.argmin(valid))
            raise OutOfBoundsError(f"{label}: src {src.name!r} dynamic index {int(index[first])} is out of bounds "
                                   "(oob_mode=error)")
        values = None
        if _has_data(src) and valid.any():
            values = src.tensor.alloc.data.reshape(-1)[src.addresses(base)]
    else:
        values = src.data if _has_data(src) else None
    if isinstance(dst, AccessPattern):
        raise NotImplementedError(f"{label}: a dynamic destination is not simulated")
    if values is None:
        mark_unknown(dst, [src.name])
    elif dst.alloc.has_data:
        moved = np.transpose(values, axes)
        if valid is None or valid.all():
            dst.data[...] = moved.reshape(dst.shape)
        else:
            current = np.transpose(dst.data.reshape(expected), np.argsort(axes)).copy()
            current[valid] = values[valid]
            dst.data[...] = np.transpose(current, axes).reshape(dst.shape)
    moved_rows = int(src.shape[0] if valid is None else valid.sum())
    hbm = src if not src.buffer.on_chip else dst
    nbytes = moved_rows * int(np.prod(src.shape[1:])) * hbm.dtype.itemsize
    current_core().accounting.record_dma(hbm.name, f"{src.buffer.kind}->{dst.buffer.kind}", DmaTraffic(
        bytes=nbytes, transfers=int(moved_rows > 0), rows=moved_rows, skipped_rows=int(src.shape[0]) - moved_rows,
        skipped_transfers=int(moved_rows == 0)))


def _check_dma_side(side, role: str, op: str) -> None:
    if not isinstance(side, (NkiTensor, AccessPattern)):
        raise TypeError(f"{op}: {role} must be a tensor or an access pattern, got {type(side).__name__}")
    if side.buffer is Buffer.PSUM:
        raise HardwareLimitError(f"{op}: {role} {side.name!r} is in PSUM, which DMA cannot reach; evacuate it to SBUF "
                                 "with tensor_copy first")
    if isinstance(side, AccessPattern):
        check_alive(side.tensor, write=role == "dst")
        check_alive(side.vector_offset, side.scalar_offset)
    else:
        check_alive(side, write=role == "dst")


def _convert(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if values.dtype == dtype:
        return values
    if is_integer(dtype) and not is_integer(values.dtype):
        return np.rint(values.astype(np.float32)).astype(dtype)
    return values.astype(np.float32).astype(dtype)


def _base(side) -> NkiTensor:
    return side.tensor if isinstance(side, AccessPattern) else side


def _has_data(side) -> bool:
    """Whether a DMA side holds real values (a known source, or a destination with storage)."""
    alloc = _base(side).alloc
    return alloc.has_data and alloc.known


def _dma_read(side, base, valid) -> np.ndarray:
    if isinstance(side, NkiTensor):
        return side.data if valid is None else side.data[valid]
    array, index = side.elements(base if valid is None else base[valid])
    return array[index]


def _dma_write(side, base, valid, values: np.ndarray) -> None:
    if isinstance(side, NkiTensor):
        if valid is None:
            side.data[...] = values.reshape(side.shape)
        elif valid.all():
            side.data[...] = values.reshape(side.shape)
        else:
            side.data[valid] = values.reshape((-1,) + side.shape[1:])
        return
    array, index = side.elements(base if valid is None else base[valid])
    array[index] = values.reshape((-1,) + side.shape[1:])
