"""``nisa``: the ``nki.isa`` instructions the kernels use, with NKI's names, arguments and limits.

Each instruction checks what the hardware requires (buffers, partition sizes <= 128, matmul free sizes, dtypes,
PSUM banks, DMA bounds) and raises :class:`~nxd_moe.nki_kernels.machine.HardwareLimitError` naming the limit;
then it computes with NumPy -- engines in fp32, the result rounded to the destination's dtype -- and records
itself in the core's :class:`~nxd_moe.nki_kernels.accounting.Accounting`. One call is one instruction, vectorised
over its whole tile.

Engines: ``nc_matmul`` / ``nc_transpose`` on the Tensor Engine; ``activation`` on the Scalar Engine;
``tensor_tensor`` / ``tensor_scalar`` / ``scalar_tensor_tensor`` / ``tensor_reduce`` / ``tensor_copy`` / ``memset``
on the Vector Engine; ``core_barrier`` on GpSimd; ``dma_copy`` / ``dma_compute`` / ``sendrecv`` on the DMA queues.
"""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.accounting import DmaTraffic
from nxd_moe.nki_kernels.machine import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    AccessPattern,
    Buffer,
    HardwareLimitError,
    NkiTensor,
    OutOfBoundsError,
    VirtualRegister,
    check_alive,
    current_core,
    is_integer,
    scalar_value,
)

MATMUL_DTYPES = (nl.bfloat16, nl.float16, nl.float8_e4m3, nl.float32)


class oob_mode:  # noqa: N801 -- NKI's name
    """What a DMA does with a dynamic address outside its tensor: raise (``error``) or drop that row (``skip``)."""

    error = "error"
    skip = "skip"


# ----------------------------------------------------------------------------------------------------------------
# operand helpers


def _tile(t, role: str, op: str, buffers=(Buffer.SBUF, Buffer.PSUM)) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise TypeError(f"{op}: {role} must be an on-chip tensor, got {type(t).__name__}")
    check_alive(t)
    if t.buffer not in buffers:
        allowed = " or ".join(b.value for b in buffers)
        raise HardwareLimitError(f"{op}: {role} {t.name!r} is in {t.buffer.value}; it must be in {allowed}")
    if t.partitions > PMAX:
        raise HardwareLimitError(f"{op}: {role} partition dimension {t.partitions} exceeds nl.tile_size.pmax = "
                                 f"{PMAX}")
    return t


def _same_shape(op: str, a: NkiTensor, a_role: str, b: NkiTensor, b_role: str) -> None:
    if a.shape != b.shape:
        raise HardwareLimitError(f"{op}: {a_role} shape {a.shape} and {b_role} shape {b.shape} must match")


def _operand(value, data: NkiTensor, op: str, role: str):
    """A scalar operand: a Python number (broadcast everywhere) or a ``(P, 1)`` tile (one value per partition)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return value
    t = _tile(value, role, op)
    if t.shape != (data.partitions, 1):
        raise HardwareLimitError(f"{op}: {role} must be a number or a ({data.partitions}, 1) tile (one value per "
                                 f"partition), got shape {t.shape}")
    return t


def _computes(dst: NkiTensor, *inputs) -> bool:
    """Whether to do the arithmetic: always for integer results (they steer control flow), else if numerics."""
    if not dst.alloc.has_data:
        return False
    missing = [t.name for t in inputs if isinstance(t, NkiTensor) and not t.alloc.has_data]
    if missing:
        raise RuntimeError(f"counting run: integer tensor {dst.name!r} would be computed from float tensors "
                           f"{missing} that hold no data; keep index arithmetic in integer tensors")
    return True


def _f32(value) -> np.ndarray | float:
    if isinstance(value, NkiTensor):
        return value.data.astype(np.float32)
    return np.float32(value)


def _store(dst: NkiTensor, values) -> None:
    values = np.asarray(values)
    if is_integer(dst.dtype) and not is_integer(values.dtype):
        values = np.rint(values)
    dst.data[...] = np.broadcast_to(values, dst.shape).astype(dst.dtype)


def _wide(*tensors) -> bool:
    return max(t.dtype.itemsize for t in tensors if isinstance(t, NkiTensor)) >= 4


def _account(engine: str, op: str, data: NkiTensor, *inputs) -> None:
    current_core().accounting.record(engine, op, data.free_size, _wide(data, *inputs))


# ----------------------------------------------------------------------------------------------------------------
# Tensor Engine


def nc_matmul(dst, stationary, moving, accumulate: bool | None = None) -> None:
    """``dst (M, N) [+]= stationary (K, M).T @ moving (K, N)`` on the Tensor Engine, fp32 in PSUM.

    Limits: K (the partition / contraction size) <= 128, stationary free M <= 128, moving free N <= 512, dst a
    float32 PSUM tile inside one bank. ``accumulate``: ``None`` overwrites PSUM no matmul has written yet and adds
    to what one has; ``True`` always adds (and raises on PSUM no matmul initialised: undefined on hardware);
    ``False`` overwrites.
    """
    op = "nc_matmul"
    dst = _tile(dst, "dst", op, (Buffer.PSUM,))
    stationary = _tile(stationary, "stationary", op, (Buffer.SBUF,))
    moving = _tile(moving, "moving", op, (Buffer.SBUF,))
    if len(stationary.shape) != 2 or len(moving.shape) != 2 or len(dst.shape) != 2:
        raise HardwareLimitError(f"{op}: operands must be 2-D tiles, got stationary {stationary.shape}, moving "
                                 f"{moving.shape}, dst {dst.shape}")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2:
        raise HardwareLimitError(f"{op}: stationary and moving partition (contraction) sizes differ: {k} vs {k2}")
    if m > GEMM_STATIONARY_FMAX:
        raise HardwareLimitError(f"{op}: stationary free size {m} exceeds nl.tile_size.gemm_stationary_fmax = "
                                 f"{GEMM_STATIONARY_FMAX}")
    if n > GEMM_MOVING_FMAX:
        raise HardwareLimitError(f"{op}: moving free size {n} exceeds nl.tile_size.gemm_moving_fmax = "
                                 f"{GEMM_MOVING_FMAX}")
    if dst.shape != (m, n):
        raise HardwareLimitError(f"{op}: dst shape {dst.shape} must be (stationary free, moving free) = {(m, n)}")
    if dst.dtype != nl.float32:
        raise HardwareLimitError(f"{op}: dst must be float32 (PSUM accumulates in fp32 on NeuronCore-v3), got "
                                 f"{dst.dtype}")
    for t, role in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype not in MATMUL_DTYPES:
            raise TypeError(f"{op}: {role} dtype {t.dtype} is not a Tensor Engine input type "
                            f"({', '.join(str(d) for d in MATMUL_DTYPES)})")
    if (stationary.dtype == nl.float32) != (moving.dtype == nl.float32):
        raise TypeError(f"{op}: float32 operands must be paired (stationary {stationary.dtype}, moving "
                        f"{moving.dtype})")
    if accumulate is True and not dst.written.all():
        raise HardwareLimitError(f"{op}: accumulate=True onto PSUM tile {dst.name!r} that no nc_matmul initialised "
                                 "(undefined behaviour on hardware)")
    core = current_core()
    if _computes(dst, stationary, moving):
        # einsum's own loop, not BLAS: tiles are small, and BLAS threads oversubscribe the cores of an LNC2 launch.
        product = np.einsum("km,kn->mn", stationary.data.astype(np.float32), moving.data.astype(np.float32))
        if accumulate is False:
            dst.data[...] = product
        else:
            dst.data[...] = np.where(dst.written, dst.data + product, product)
    dst.written[...] = True
    core.accounting.matmuls += 1
    core.accounting.matmul_flops += 2 * k * m * n
    core.accounting.record("tensor", "matmul", n, stationary.dtype == nl.float32)


def nc_transpose(dst, data) -> None:
    """``dst (F, P) = data (P, F).T`` on the Tensor Engine (a matmul against the identity): P, F <= 128."""
    op = "nc_transpose"
    dst = _tile(dst, "dst", op, (Buffer.PSUM,))
    data = _tile(data, "data", op, (Buffer.SBUF,))
    if len(data.shape) != 2:
        raise HardwareLimitError(f"{op}: data must be a 2-D tile, got {data.shape}")
    p, f = data.shape
    if f > GEMM_STATIONARY_FMAX:
        raise HardwareLimitError(f"{op}: data free size {f} exceeds {GEMM_STATIONARY_FMAX} (it becomes the "
                                 "stationary tile of a Tensor Engine transpose)")
    if dst.shape != (f, p):
        raise HardwareLimitError(f"{op}: dst shape {dst.shape} must be {(f, p)}")
    if dst.dtype not in (nl.float32, data.dtype):
        raise TypeError(f"{op}: dst dtype must be float32 or the data's dtype {data.dtype}, got {dst.dtype}")
    if _computes(dst, data):
        _store(dst, data.data.T)
    core = current_core()
    core.accounting.transposes += 1
    core.accounting.record("tensor", "transpose", p, data.dtype == nl.float32)


# ----------------------------------------------------------------------------------------------------------------
# Scalar and Vector Engines


def activation(dst, op, data, bias=None, scale=1.0) -> None:
    """``dst = op(data * scale + bias)`` on the Scalar Engine; ``bias``/``scale`` are numbers or ``(P, 1)`` tiles."""
    name = "activation"
    dst, data = _tile(dst, "dst", name), _tile(data, "data", name)
    _same_shape(name, dst, "dst", data, "data")
    if op not in nl.ACTIVATION_FUNCTIONS.values():
        raise ValueError(f"{name}: op must be one of {sorted('nl.' + k for k in nl.ACTIVATION_FUNCTIONS)}, got {op!r}")
    scale = _operand(scale, data, name, "scale")
    bias = None if bias is None else _operand(bias, data, name, "bias")
    if _computes(dst, data, scale, bias):
        x = _f32(data) * _f32(scale)
        if bias is not None:
            x = x + _f32(bias)
        _store(dst, op(x))
    _account("scalar", name, data, dst)


def tensor_tensor(dst, data1, data2, op) -> None:
    """``dst = data1 <op> data2`` elementwise on the Vector Engine."""
    name = "tensor_tensor"
    dst, data1, data2 = (_tile(t, r, name) for t, r in ((dst, "dst"), (data1, "data1"), (data2, "data2")))
    _same_shape(name, data1, "data1", data2, "data2")
    _same_shape(name, dst, "dst", data1, "data1")
    _check_alu(name, op)
    if _computes(dst, data1, data2):
        _store(dst, op(_f32(data1), _f32(data2)))
    _account("vector", name, data1, data2, dst)


def tensor_scalar(dst, data, op0, operand0, reverse0: bool = False, op1=None, operand1=None,
                  reverse1: bool = False, engine: str = "vector") -> None:
    """``dst = (data <op0> operand0) <op1> operand1`` with per-partition or constant operands (``reverse`` swaps
    an operation's sides)."""
    name = "tensor_scalar"
    dst, data = _tile(dst, "dst", name), _tile(data, "data", name)
    _same_shape(name, dst, "dst", data, "data")
    _check_alu(name, op0)
    _check_engine(name, engine)
    operand0 = _operand(operand0, data, name, "operand0")
    if op1 is not None:
        _check_alu(name, op1)
        operand1 = _operand(operand1, data, name, "operand1")
    if _computes(dst, data, operand0, operand1):
        x = _f32(data)
        x = op0(_f32(operand0), x) if reverse0 else op0(x, _f32(operand0))
        if op1 is not None:
            x = op1(_f32(operand1), x) if reverse1 else op1(x, _f32(operand1))
        _store(dst, x)
    _account(engine, name, data, dst)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, data1) -> None:
    """``dst = (data <op0> operand0) <op1> data1``: a per-partition scalar step, then an elementwise one."""
    name = "scalar_tensor_tensor"
    dst, data, data1 = (_tile(t, r, name) for t, r in ((dst, "dst"), (data, "data"), (data1, "data1")))
    _same_shape(name, data, "data", data1, "data1")
    _same_shape(name, dst, "dst", data, "data")
    _check_alu(name, op0)
    _check_alu(name, op1)
    operand0 = _operand(operand0, data, name, "operand0")
    if _computes(dst, data, operand0, data1):
        _store(dst, op1(op0(_f32(data), _f32(operand0)), _f32(data1)))
    _account("vector", name, data, data1, dst)


_REDUCTIONS = {"add": np.sum, "maximum": np.max, "minimum": np.min}


def tensor_reduce(dst, op, data, axis, keepdims: bool = False) -> None:
    """Reduce ``data`` over free axes (never the partition axis) with ``nl.add`` / ``nl.maximum`` / ``nl.minimum``."""
    name = "tensor_reduce"
    dst, data = _tile(dst, "dst", name), _tile(data, "data", name)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if not axes or any(a < 1 or a >= len(data.shape) for a in axes):
        raise HardwareLimitError(f"{name}: axis {axis} must name free axes of data {data.shape} (1..."
                                 f"{len(data.shape) - 1}); the partition axis cannot be reduced here")
    if getattr(op, "name", None) not in _REDUCTIONS:
        raise ValueError(f"{name}: op must be nl.add, nl.maximum or nl.minimum, got {op!r}")
    expected = tuple(1 if d in axes else n for d, n in enumerate(data.shape)) if keepdims else tuple(
        n for d, n in enumerate(data.shape) if d not in axes)
    if dst.shape != expected:
        raise HardwareLimitError(f"{name}: dst shape {dst.shape} must be {expected}")
    if _computes(dst, data):
        reducer = _REDUCTIONS[op.name]
        source = data.data if is_integer(data.dtype) and is_integer(dst.dtype) else _f32(data)
        _store(dst, reducer(source, axis=axes, keepdims=keepdims))
    _account("vector", name, data, dst)


def tensor_copy(dst, src, engine: str = "vector") -> None:
    """Copy on an engine, converting to ``dst``'s dtype (how PSUM is evacuated to SBUF)."""
    name = "tensor_copy"
    dst, src = _tile(dst, "dst", name), _tile(src, "src", name)
    _same_shape(name, dst, "dst", src, "src")
    _check_engine(name, engine)
    if _computes(dst, src):
        _store(dst, src.data if is_integer(src.dtype) else _f32(src))
    _account(engine, name, src, dst)


def dequantize(dst, data, scale, weight_format) -> None:
    """``dst (P, C)`` = the weight tile stored as ``data`` with block scales ``scale`` in ``weight_format`` (a
    :class:`~nxd_moe.quantization.formats.QuantizationFormat`), converted on chip before the matmul.

    ``data`` holds the tile's ``P`` rows packed ``values_per_byte`` to a partition row (``(P / v, C)``), ``scale``
    its scale rows (``(P / block_k, C / block_n)``, or one row for per-channel scales). A modelled instruction: one
    Vector Engine pass over ``dst`` (on Trn2 an FP8 tile is a ``tensor_copy`` upcast and a scale multiply; MX
    unpacking is Trn3's ``nc_matmul_mx`` territory).
    """
    name = "dequantize"
    dst, data, scale = (_tile(t, r, name) for t, r in ((dst, "dst"), (data, "data"), (scale, "scale")))
    if len(dst.shape) != 2 or data.shape != (dst.shape[0] // weight_format.values_per_byte, dst.shape[1]):
        raise HardwareLimitError(f"{name}: data {data.shape} must hold dst {dst.shape}'s rows packed "
                                 f"{weight_format.values_per_byte} per byte")
    if _computes(dst, data, scale):
        import torch

        def as_torch(t: NkiTensor, dtype):
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8))
            return raw.view(dtype).unsqueeze(0)

        values = weight_format.dequantize(as_torch(data, weight_format.weight_dtype),
                                          as_torch(scale, weight_format.scale_dtype), torch.float32)
        _store(dst, values[0].numpy())
    _account("vector", name, dst, data)


def memset(dst, value) -> None:
    name = "memset"
    dst = _tile(dst, "dst", name)
    if dst.alloc.has_data:
        _store(dst, np.float32(value) if not is_integer(dst.dtype) else value)
    _account("vector", name, dst)


def _check_alu(name: str, op) -> None:
    if op not in nl.ALU_OPS.values():
        raise ValueError(f"{name}: op must be one of {sorted('nl.' + k for k in nl.ALU_OPS)}, got {op!r}")


def _check_engine(name: str, engine: str) -> None:
    if engine not in ("vector", "scalar", "gpsimd"):
        raise ValueError(f"{name}: engine must be 'vector', 'scalar' or 'gpsimd', got {engine!r}")


# ----------------------------------------------------------------------------------------------------------------
# registers


def register_alloc(x: int | None = None) -> VirtualRegister:
    return VirtualRegister(current_core(), 0 if x is None else int(x))


def register_move(dst: VirtualRegister, src) -> None:
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)


def register_load(dst: VirtualRegister, src) -> None:
    """Load a one-element integer tensor (SBUF or HBM) into a register: how device values steer loops."""
    if not isinstance(dst, VirtualRegister):
        raise TypeError(f"register_load: dst must be a VirtualRegister, got {type(dst).__name__}")
    check_alive(src)
    dst.value = scalar_value(src)


# ----------------------------------------------------------------------------------------------------------------
# DMA


def dma_copy(dst, src, oob_mode: str = oob_mode.error) -> None:
    """Copy ``src`` to ``dst`` through the DMA queues (HBM <-> SBUF, HBM -> HBM, SBUF -> SBUF).

    Either side may be an :meth:`~nxd_moe.nki_kernels.machine.NkiTensor.ap` access pattern with dynamic offsets;
    rows whose dynamic address is out of bounds raise (``oob_mode.error``) or are not transferred
    (``oob_mode.skip``: the destination rows keep their contents). Shapes must match, except that a transfer
    without a vector offset may reshape its HBM side (read or written in row-major order). DMA copies bytes:
    dtypes must match.
    """
    for side, role in ((dst, "dst"), (src, "src")):
        _check_dma_side(side, role, "dma_copy")
    if dst.dtype != src.dtype:
        raise TypeError(f"dma_copy: dtypes differ (dst {dst.dtype}, src {src.dtype}); DMA copies bytes, convert with "
                        "tensor_copy")
    if oob_mode not in ("error", "skip"):
        raise ValueError(f"dma_copy: oob_mode must be oob_mode.error or oob_mode.skip, got {oob_mode!r}")
    aligned = dst.shape == src.shape
    if not aligned:
        vector = any(isinstance(s, AccessPattern) and s.vector_offset is not None for s in (dst, src))
        hbm_side = any(not s.buffer.on_chip for s in (dst, src))
        if vector or not hbm_side or int(np.prod(dst.shape)) != int(np.prod(src.shape)):
            raise HardwareLimitError(f"dma_copy: shapes differ (dst {dst.shape}, src {src.shape}); only an HBM side "
                                     "without a vector offset may be reshaped, to the same number of elements")
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
    if moved and _has_data(dst) and _has_data(src):
        if aligned:
            _dma_write(dst, bases.get("dst"), valid, _dma_read(src, bases.get("src"), valid))
        else:
            values = _dma_read(src, bases.get("src"), None).reshape(dst.shape)
            _dma_write(dst, bases.get("dst"), None, values)
    if aligned:
        rows, moved_rows = dst.shape[0], moved
        moved_bytes = moved * int(np.prod(dst.shape[1:])) * dst.dtype.itemsize
    else:
        rows = next((s.shape[0] for s in (dst, src) if s.buffer.on_chip), dst.shape[0])
        moved_rows = rows * moved
        moved_bytes = moved * int(np.prod(dst.shape)) * dst.dtype.itemsize
    hbm = src if not src.buffer.on_chip else dst if not dst.buffer.on_chip else src
    current_core().accounting.record_dma(hbm.name, f"{src.buffer.kind}->{dst.buffer.kind}", DmaTraffic(
        bytes=moved_bytes, transfers=int(moved > 0), rows=moved_rows, skipped_rows=rows - moved_rows,
        skipped_transfers=int(moved == 0)))


def dma_compute(dst, srcs, reduce_op=nl.add) -> None:
    """``dst = reduce_op(srcs...)`` elementwise, computed inside the DMA engines (how LNC2 kernels sum the two
    cores' partial outputs in HBM). Accounted as one read transfer per source and the write of ``dst``."""
    name = "dma_compute"
    _check_dma_side(dst, "dst", name)
    if not isinstance(dst, NkiTensor) or not srcs:
        raise TypeError(f"{name}: dst must be a tensor and srcs a non-empty list of tensors")
    if reduce_op not in (nl.add, nl.maximum, nl.minimum):
        raise ValueError(f"{name}: reduce_op must be nl.add, nl.maximum or nl.minimum, got {reduce_op!r}")
    for i, src in enumerate(srcs):
        _check_dma_side(src, f"srcs[{i}]", name)
        if not isinstance(src, NkiTensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            raise HardwareLimitError(f"{name}: srcs[{i}] must be a tensor of dst's shape {dst.shape} and dtype "
                                     f"{dst.dtype}, got {src!r}")
    if all(t.alloc.has_data for t in (dst, *srcs)):
        result = _f32(srcs[0])
        for src in srcs[1:]:
            result = reduce_op(result, _f32(src))
        _store(dst, result)
    accounting = current_core().accounting
    nbytes = int(np.prod(dst.shape)) * dst.dtype.itemsize
    for src in srcs:
        accounting.record_dma(src.name, f"{src.buffer.kind}->{dst.buffer.kind}",
                              DmaTraffic(bytes=nbytes, transfers=1, rows=dst.shape[0]))
    accounting.record_dma(dst.name, f"dma_compute->{dst.buffer.kind}", DmaTraffic(bytes=nbytes, rows=dst.shape[0]))


def _check_dma_side(side, role: str, op: str) -> None:
    if not isinstance(side, (NkiTensor, AccessPattern)):
        raise TypeError(f"{op}: {role} must be a tensor or an access pattern, got {type(side).__name__}")
    if side.buffer is Buffer.PSUM:
        raise HardwareLimitError(f"{op}: {role} {side.name!r} is in PSUM, which DMA cannot reach; evacuate it to SBUF "
                                 "with tensor_copy first")
    if isinstance(side, AccessPattern):
        check_alive(side.tensor, side.vector_offset, side.scalar_offset)
    else:
        check_alive(side)


def _has_data(side) -> bool:
    return (side.tensor if isinstance(side, AccessPattern) else side).alloc.has_data


def _dma_read(side, base, valid) -> np.ndarray:
    if isinstance(side, NkiTensor):
        return side.data if valid is None else side.data[valid]
    flat = side.tensor.alloc.data.reshape(-1)
    return flat[side.addresses(base if valid is None else base[valid])]


def _dma_write(side, base, valid, values: np.ndarray) -> None:
    if isinstance(side, NkiTensor):
        if valid is None:
            side.data[...] = values
        else:
            side.data[valid] = values
        return
    flat = side.tensor.alloc.data.reshape(-1)
    flat[side.addresses(base if valid is None else base[valid])] = values


# ----------------------------------------------------------------------------------------------------------------
# LNC2: the two cores of a logical NeuronCore


def core_barrier(data, cores=(0, 1)) -> None:
    """Wait until both cores of the logical core reach this point (both must have finished writing ``data``, a
    shared HBM tensor). A no-op when the kernel runs on one core."""
    if tuple(cores) != (0, 1):
        raise HardwareLimitError(f"core_barrier: only cores=(0, 1) is supported, got {cores}")
    if not isinstance(data, NkiTensor) or data.buffer is not Buffer.SHARED_HBM:
        raise TypeError(f"core_barrier: data must be a shared HBM tensor, got {data!r}")
    core = current_core()
    if core.num_programs == 1:
        return
    core.accounting.barriers += 1
    core.accounting.record("gpsimd", "core_barrier", 0, False)
    core.launch.barrier.wait(core.program_id)


def sendrecv(src, dst, send_to_rank: int, recv_from_rank: int, pipe_id: int) -> None:
    """Send ``src`` (SBUF) to the peer core's ``dst`` while receiving the peer's ``src`` into this core's ``dst``."""
    name = "sendrecv"
    src, dst = _tile(src, "src", name, (Buffer.SBUF,)), _tile(dst, "dst", name, (Buffer.SBUF,))
    _same_shape(name, src, "src", dst, "dst")
    if src.dtype != dst.dtype:
        raise TypeError(f"{name}: src and dst dtypes differ ({src.dtype}, {dst.dtype})")
    core = current_core()
    if core.num_programs != 2:
        raise HardwareLimitError(f"{name} exchanges tiles between the two cores of an LNC2 launch; this launch has "
                                 f"{core.num_programs} core")
    for rank, role in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        if rank not in (0, 1) or rank == core.program_id:
            raise HardwareLimitError(f"{name}: {role} must be the peer core ({1 - core.program_id}), got {rank}")
    payload = src.data.copy() if src.alloc.has_data else None
    received = core.launch.exchange(core.program_id, payload, pipe_id, send_to_rank, recv_from_rank)
    if dst.alloc.has_data:
        dst.data[...] = received
    core.accounting.record_dma(src.name, "sbuf->sbuf", DmaTraffic(
        bytes=src.data.size * src.dtype.itemsize, transfers=1, rows=src.partitions))
