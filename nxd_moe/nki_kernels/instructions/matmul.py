"""The Tensor Engine's instructions: ``nc_matmul`` (a matmul accumulating in PSUM) and ``nc_transpose`` (on the
Tensor Engine, or on the Vector Engine for small tiles)."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.allocation import PendingMatmul, fp32_matmul, settle
from nxd_moe.nki_kernels.dtypes import bfloat16, float8_e4m3, float16, float32
from nxd_moe.nki_kernels.hardware import GEMM_MOVING_FMAX, GEMM_STATIONARY_FMAX, Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import as_f32, chosen_engine, computes, store_result, tile_operand
from nxd_moe.nki_kernels.machine import check_alive, current_core, instruction
from nxd_moe.nki_kernels.tensor import NkiTensor

MATMUL_DTYPES = (bfloat16, float16, float8_e4m3, float32)


@instruction
def nc_matmul(dst, stationary, moving, is_stationary_onezero: bool = False, is_moving_onezero: bool = False,
              is_transpose: bool = False, accumulate: bool | None = None, tile_position=(), tile_size=(),
              perf_mode=None, name=None) -> None:
    """``dst (M, N) [+]= stationary (K, M).T @ moving (K, N)`` on the Tensor Engine, fp32 in PSUM.

    Limits: K (the partition / contraction size) <= 128, stationary free M <= 128, moving free N <= 512 (free dims
    beyond the first are flattened), dst a PSUM tile of M partitions and N elements per partition, float32 (or, with
    ``is_transpose``, the stationary's dtype: the bit-accurate transpose against an identity ``moving``).
    ``accumulate``: ``None`` overwrites PSUM no matmul has written yet and adds to what one has; ``True`` always adds
    (and raises on PSUM no matmul initialised: undefined on hardware); ``False`` overwrites. ``tile_position`` /
    ``tile_size`` (row, column) place a small stationary in a quarter or half of the PE array: checked, and the
    stationary must fit the tile. ``perf_mode="double_row"`` needs fp8 operands ``(K, 2, M)`` / ``(K, 2, N)``: the
    contraction runs over the partitions and that first free dim of 2 (K x 2 rows; M, N count the rest).
    """
    op = "nc_matmul"
    dst = tile_operand(dst, "dst", op, (Buffer.PSUM,), settled=False)
    stationary = tile_operand(stationary, "stationary", op, (Buffer.SBUF,))
    moving = tile_operand(moving, "moving", op, (Buffer.SBUF,))
    double_row = getattr(perf_mode, "value", perf_mode) == "double_row"
    k_rows = 2 if double_row else 1  # double_row contracts over the partitions and a first free dim of 2
    if double_row and not all(t.dtype.itemsize == 1 for t in (stationary, moving)):
        raise TypeError(f"{op}: perf_mode=double_row needs fp8 stationary and moving tiles")
    if double_row and not all(len(t.shape) >= 3 and t.shape[1] == 2 for t in (stationary, moving)):
        raise HardwareLimitError(f"{op}: perf_mode=double_row needs stationary (K, 2, M) and moving (K, 2, N) tiles, "
                                 f"got {stationary.shape} and {moving.shape}")
    k, m = stationary.partitions, stationary.free_size // k_rows
    k2, n = moving.partitions, moving.free_size // k_rows
    if k != k2:
        raise HardwareLimitError(f"{op}: stationary and moving partition (contraction) sizes differ: {k} vs {k2}")
    if m > GEMM_STATIONARY_FMAX:
        raise HardwareLimitError(f"{op}: stationary free size {m} exceeds nl.tile_size.gemm_stationary_fmax = "
                                 f"{GEMM_STATIONARY_FMAX}")
    if n > GEMM_MOVING_FMAX:
        raise HardwareLimitError(f"{op}: moving free size {n} exceeds nl.tile_size.gemm_moving_fmax = "
                                 f"{GEMM_MOVING_FMAX}")
    if (dst.partitions, dst.free_size) != (m, n):
        raise HardwareLimitError(f"{op}: dst shape {dst.shape} must be (stationary free, moving free) = {(m, n)}")
    if dst.dtype != float32 and not (is_transpose and dst.dtype == stationary.dtype):
        raise HardwareLimitError(f"{op}: dst must be float32 (PSUM accumulates in fp32 on NeuronCore-v3), got "
                                 f"{dst.dtype}")
    for t, role in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype not in MATMUL_DTYPES:
            raise TypeError(f"{op}: {role} dtype {t.dtype} is not a Tensor Engine input type "
                            f"({', '.join(str(d) for d in MATMUL_DTYPES)})")
    if (stationary.dtype == float32) != (moving.dtype == float32) and not is_transpose:
        raise TypeError(f"{op}: float32 operands must be paired (stationary {stationary.dtype}, moving "
                        f"{moving.dtype})")
    if perf_mode not in (None, "none", "double_row") \
            and getattr(perf_mode, "value", None) not in ("none", "double_row"):
        raise ValueError(f"{op}: perf_mode must be matmul_perf_mode.none or .double_row, got {perf_mode!r}")
    if bool(tile_position) != bool(tile_size):
        raise ValueError(f"{op}: tile_position and tile_size must be given together")
    if tile_size:
        rows, cols = (int(v) for v in tile_size)
        r0, c0 = (int(v) for v in tile_position)
        if rows not in (32, 64, 128) or cols not in (32, 64, 128) or r0 % rows or c0 % cols or r0 + rows > 128 \
                or c0 + cols > 128:
            raise HardwareLimitError(f"{op}: tile_size {tile_size} / tile_position {tile_position} do not tile the "
                                     "128 x 128 PE array (sizes 32, 64 or 128; positions multiples of the size)")
        if k > rows or m > cols:
            raise HardwareLimitError(f"{op}: stationary ({k}, {m}) does not fit the PE tile {tile_size}")
    core = current_core()
    adds = accumulate is not False and not is_transpose
    pending = dst.alloc.pending
    # Extending the accumulation group being built on this region: it is written, and nothing else touched it.
    continuing = adds and pending is not None and pending.key == (dst.offset, dst.shape, dst.strides)
    if accumulate is True and not continuing and not dst.written.all():
        raise HardwareLimitError(f"{op}: accumulate=True onto PSUM tile {dst.name!r} that no nc_matmul initialised "
                                 "(undefined behaviour on hardware)")
    if continuing or (adds and dst.written.any()):
        check_alive(dst, settled=False)  # it adds to what the bank holds: a read of it
    if pending is not None and not continuing:
        settle(dst.alloc)  # another region, or an overwrite: the group so far is complete
        pending = None
    if computes(dst, stationary, moving):
        if is_transpose:
            settle(dst.alloc)
            if _is_identity(moving):
                store_result(dst, stationary.data.reshape(k, m).T[:, :n])  # bit-accurate: NaN and Inf pass through
            else:
                store_result(dst, fp32_matmul(as_f32(stationary), as_f32(moving)))
        else:
            if pending is None:
                pending = dst.alloc.pending = PendingMatmul(dst, dst.written.reshape(m, n).copy() if adds else None)
            pending.add(stationary, moving, k_rows)
    if not continuing:
        dst.written[...] = True
    if is_transpose:
        core.accounting.transposes += 1
        core.accounting.record("tensor", "transpose", n, stationary.dtype == float32)
        return
    core.accounting.matmuls += 1
    core.accounting.matmul_flops += 2 * k_rows * k * m * n
    core.accounting.record("tensor", "matmul", n, stationary.dtype == float32)


def _is_identity(t: NkiTensor) -> bool:
    values = t.data.reshape(t.partitions, t.free_size)
    return values.shape[0] <= values.shape[1] and np.array_equal(values.astype(np.float32),
                                                                 np.eye(*values.shape, dtype=np.float32))


@instruction
def nc_transpose(dst, data, engine=None, name=None) -> None:
    """``dst (F, P) = data (P, F).T``: on the Tensor Engine (P, F <= 128, data in SBUF, dst in PSUM) or the Vector
    Engine (P, F <= 32, SBUF or PSUM either side).

    Without ``engine`` the compiler picks one, as NKI documents: only the Vector Engine can write SBUF or read PSUM,
    so a transpose into SBUF (or out of PSUM) runs there; otherwise the Tensor Engine does it.
    """
    op = "nc_transpose"
    vector_only = isinstance(dst, NkiTensor) and dst.buffer is Buffer.SBUF or \
        isinstance(data, NkiTensor) and data.buffer is Buffer.PSUM
    on = chosen_engine(engine, "vector" if vector_only else "tensor", ("tensor", "vector"), op)
    limit = GEMM_STATIONARY_FMAX if on == "tensor" else 32
    dst = tile_operand(dst, "dst", op, (Buffer.PSUM,) if on == "tensor" else (Buffer.SBUF, Buffer.PSUM))
    data = tile_operand(data, "data", op, (Buffer.SBUF,) if on == "tensor" else (Buffer.SBUF, Buffer.PSUM))
    p, f = data.partitions, data.free_size
    if f > limit or p > limit:
        raise HardwareLimitError(f"{op}: data ({p}, {f}) exceeds the {on} engine transpose limit {limit} x {limit}")
    if (dst.partitions, dst.free_size) != (f, p):
        raise HardwareLimitError(f"{op}: dst shape {dst.shape} must be {(f, p)}")
    if dst.dtype not in (float32, data.dtype):
        raise TypeError(f"{op}: dst dtype must be float32 or the data's dtype {data.dtype}, got {dst.dtype}")
    if computes(dst, data):
        store_result(dst, data.data.reshape(p, f).T)
    core = current_core()
    if on == "tensor":
        core.accounting.transposes += 1
        if dst.written is not None:
            dst.written[...] = True
    core.accounting.record(on, "transpose", p, data.dtype == float32)
