"""``nisa``: the ``nki.isa`` instructions the kernels use, with NKI's names, arguments and limits.

Each instruction checks what the hardware requires (buffers, partition sizes <= 128, matmul free sizes, dtypes,
PSUM banks, DMA bounds) and raises :class:`~nxd_moe.nki_kernels.machine.HardwareLimitError` naming the limit;
then it computes with NumPy -- engines in fp32, the result rounded to the destination's dtype -- and records
itself in the core's :class:`~nxd_moe.nki_kernels.accounting.Accounting`. One call is one instruction, vectorised
over its whole tile.

Engines: ``nc_matmul`` / ``nc_transpose`` on the Tensor Engine; ``activation`` / ``activation_reduce`` on the
Scalar Engine; ``tensor_tensor`` / ``tensor_scalar`` / ``scalar_tensor_tensor`` / ``tensor_reduce`` /
``tensor_scalar_reduce`` / ``tensor_copy`` / ``tensor_copy_predicated`` / ``memset`` / ``reciprocal`` /
``bn_stats`` / ``bn_aggr`` / ``nc_stream_shuffle`` on the Vector Engine (``engine=`` moves some to GpSimd or the
Scalar Engine); ``iota`` / ``local_gather`` / ``nonzero_with_count`` / ``core_barrier`` on GpSimd; ``dma_copy`` /
``dma_transpose`` / ``dma_compute`` / ``sendrecv`` on the DMA queues. Signatures, keyword names and defaults follow
the NKI API reference, so :mod:`nxd_moe.nki_kernels.compat` can serve this module as ``nki.isa``.
"""

from __future__ import annotations

import enum

import numpy as np

from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.accounting import DmaTraffic
from nxd_moe.nki_kernels.instruction_support import (  # noqa: F401 -- engine, reduce_cmd: nki.isa's names
    _REDUCTIONS,
    _accumulate,
    _account,
    _alu,
    _check_alu,
    _computes,
    _engine,
    _f32,
    _mark_unknown,
    _operand,
    _reaches,
    _reduce_op,
    _same_shape,
    _store,
    _tile,
    engine,
    reduce_cmd,
)
# The instruction families beyond the core set live in their own modules (nxd_moe.nki_kernels.instructions);
# re-exported so that this module stays the one nki.isa namespace.
from nxd_moe.nki_kernels.instructions.gather import nc_n_gather  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.prng import (  # noqa: F401 -- re-exports
    dropout,
    rand_get_state,
    rand_set_state,
    rng,
    set_rng_seed,
)
from nxd_moe.nki_kernels.instructions.scan import (  # noqa: F401 -- re-exports
    tensor_partition_reduce,
    tensor_scalar_cumulative,
    tensor_tensor_scan,
)
from nxd_moe.nki_kernels.instructions.select import (  # noqa: F401 -- re-exports
    affine_select,
    range_select,
    select_reduce,
    sequence_bounds,
)
from nxd_moe.nki_kernels.instructions.top8 import max8, nc_find_index8, nc_match_replace8, topk  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.trn3 import (  # noqa: F401 -- re-exports
    Trn3OnlyError,
    activate2,
    exponential,
    nc_matmul_mx,
    quantize_mx,
    rand2,
)
from nxd_moe.nki_kernels.machine import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    AccessPattern,
    Buffer,
    HardwareLimitError,
    NkiTensor,
    OutOfBoundsError,
    PendingMatmul,
    VirtualRegister,
    cast,
    check_alive,
    current_core,
    fp32_matmul,
    instruction,
    is_integer,
    scalar_value,
    settle,
)

MATMUL_DTYPES = (nl.bfloat16, nl.float16, nl.float8_e4m3, nl.float32)


class oob_mode:  # noqa: N801 -- NKI's name
    """What a DMA does with a dynamic address outside its tensor: raise (``error``) or drop that row (``skip``)."""

    error = "error"
    skip = "skip"


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor, engine.vector, engine.scalar, engine.gpsimd, engine.unknown)


class dge_mode(enum.IntEnum):  # noqa: N801 -- NKI's name
    """How DMA descriptors are generated: before the run (``none``), by GpSimd (``swdge``) or by the DGE hardware
    (``hwdge``). Descriptor generation is not timed here; the mode is checked and recorded only."""

    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class nc_version(enum.IntEnum):  # noqa: N801 -- NKI's name
    gen2 = 2
    gen3 = 3
    gen4 = 4


class matmul_perf_mode(str, enum.Enum):  # noqa: N801 -- NKI's name
    none = "none"
    double_row = "double_row"


class dma_engine(enum.IntEnum):  # noqa: N801 -- NKI's name
    dma = 1
    gpsimd_dma = 2


def get_nc_version() -> nc_version:
    """The simulated NeuronCore generation: Trn2's NeuronCore-v3."""
    return nc_version.gen3


def get_nc_sub_version() -> int:
    return 0


NkiValidationError = HardwareLimitError  # NKI's name for a violated hardware constraint


class NkiInstruction:
    """NKI's handle to a traced instruction, for ``.depends_on(*producers)`` (run after them). The simulator
    executes instructions in program order, which satisfies any such dependency, so this only records them."""

    def __init__(self, handle=None):
        self.handle = handle
        self.dependencies: list = []

    def depends_on(self, *producers) -> "NkiInstruction":
        self.dependencies.extend(producers)
        return self


# ----------------------------------------------------------------------------------------------------------------
# Tensor Engine


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
    dst = _tile(dst, "dst", op, (Buffer.PSUM,), settled=False)
    stationary = _tile(stationary, "stationary", op, (Buffer.SBUF,))
    moving = _tile(moving, "moving", op, (Buffer.SBUF,))
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
    if dst.dtype != nl.float32 and not (is_transpose and dst.dtype == stationary.dtype):
        raise HardwareLimitError(f"{op}: dst must be float32 (PSUM accumulates in fp32 on NeuronCore-v3), got "
                                 f"{dst.dtype}")
    for t, role in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype not in MATMUL_DTYPES:
            raise TypeError(f"{op}: {role} dtype {t.dtype} is not a Tensor Engine input type "
                            f"({', '.join(str(d) for d in MATMUL_DTYPES)})")
    if (stationary.dtype == nl.float32) != (moving.dtype == nl.float32) and not is_transpose:
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
    if _computes(dst, stationary, moving):
        if is_transpose:
            settle(dst.alloc)
            if _is_identity(moving):
                _store(dst, stationary.data.reshape(k, m).T[:, :n])  # bit-accurate: NaN and Inf pass through
            else:
                _store(dst, fp32_matmul(_f32(stationary), _f32(moving)))
        else:
            if pending is None:
                pending = dst.alloc.pending = PendingMatmul(dst, dst.written.reshape(m, n).copy() if adds else None)
            pending.add(stationary, moving, k_rows)
    if not continuing:
        dst.written[...] = True
    if is_transpose:
        core.accounting.transposes += 1
        core.accounting.record("tensor", "transpose", n, stationary.dtype == nl.float32)
        return
    core.accounting.matmuls += 1
    core.accounting.matmul_flops += 2 * k_rows * k * m * n
    core.accounting.record("tensor", "matmul", n, stationary.dtype == nl.float32)


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
    on = _engine(engine, "vector" if vector_only else "tensor", ("tensor", "vector"), op)
    limit = GEMM_STATIONARY_FMAX if on == "tensor" else 32
    dst = _tile(dst, "dst", op, (Buffer.PSUM,) if on == "tensor" else (Buffer.SBUF, Buffer.PSUM))
    data = _tile(data, "data", op, (Buffer.SBUF,) if on == "tensor" else (Buffer.SBUF, Buffer.PSUM))
    p, f = data.partitions, data.free_size
    if f > limit or p > limit:
        raise HardwareLimitError(f"{op}: data ({p}, {f}) exceeds the {on} engine transpose limit {limit} x {limit}")
    if (dst.partitions, dst.free_size) != (f, p):
        raise HardwareLimitError(f"{op}: dst shape {dst.shape} must be {(f, p)}")
    if dst.dtype not in (nl.float32, data.dtype):
        raise TypeError(f"{op}: dst dtype must be float32 or the data's dtype {data.dtype}, got {dst.dtype}")
    if _computes(dst, data):
        _store(dst, data.data.reshape(p, f).T)
    core = current_core()
    if on == "tensor":
        core.accounting.transposes += 1
        if dst.written is not None:
            dst.written[...] = True
    core.accounting.record(on, "transpose", p, data.dtype == nl.float32)


# ----------------------------------------------------------------------------------------------------------------
# Scalar and Vector Engines


@instruction
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None) -> None:
    """``dst = op(data * scale + bias)`` on the Scalar Engine; ``bias``/``scale`` are numbers or ``(P, 1)`` tiles.
    With ``reduce_op`` the results are also reduced along the free dims into the accumulator / ``reduce_res``."""
    label = "activation"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    _same_shape(label, dst, "dst", data, "data")
    if op not in nl.ACTIVATION_FUNCTIONS.values():
        raise ValueError(f"{label}: op must be one of {sorted('nl.' + k for k in nl.ACTIVATION_FUNCTIONS)}, got "
                         f"{op!r}")
    scale = _operand(scale, data, label, "scale")
    bias = None if bias is None else _operand(bias, data, label, "bias")
    if _computes(dst, data, scale, bias):
        x = _f32(data) * _f32(scale)
        if bias is not None:
            x = x + _f32(bias)
        y = np.asarray(op(x), dtype=np.float32)
        _store(dst, y)
        if reduce_op is not None:
            _accumulate(current_core(), label, "scalar", y, reduce_op, reduce_res,
                        reduce_cmd if reduce_cmd != reduce_cmd.idle else reduce_cmd.reset_reduce)
    elif reduce_op is not None and reduce_res is not None:
        _tile(reduce_res, "reduce_res", label)
    _account("scalar", label, data, dst)


@instruction
def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None) -> None:
    """``activation`` plus a free-dim reduction of its result into ``reduce_res`` ``(P, 1)``."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce)


@instruction
def tensor_tensor(dst, data1, data2, op, engine=None, name=None) -> None:
    """``dst = data1 <op> data2`` elementwise on the Vector Engine (or GpSimd)."""
    label = "tensor_tensor"
    on = _engine(engine, "vector", ("vector", "gpsimd"), label)
    dst, data1, data2 = (_tile(t, r, label) for t, r in ((dst, "dst"), (data1, "data1"), (data2, "data2")))
    _reaches(on, label, dst, data1, data2)
    _same_shape(label, data1, "data1", data2, "data2")
    _same_shape(label, dst, "dst", data1, "data1")
    _check_alu(label, op)
    if _computes(dst, data1, data2):
        _store(dst, _alu(op, data1, data2))
    _account(on, label, data1, data2, dst)


@instruction
def tensor_scalar(dst, data, op0, operand0, reverse0: bool = False, op1=None, operand1=None,
                  reverse1: bool = False, engine=None, name=None) -> None:
    """``dst = (data <op0> operand0) <op1> operand1`` with per-partition or constant operands (``reverse`` swaps
    an operation's sides)."""
    label = "tensor_scalar"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    _same_shape(label, dst, "dst", data, "data")
    _check_alu(label, op0)
    on = _engine(engine, "vector", op=label)
    _reaches(on, label, dst, data, operand0, operand1)
    operand0 = _operand(operand0, data, label, "operand0")
    if op1 is not None:
        _check_alu(label, op1)
        operand1 = _operand(operand1, data, label, "operand1")
    if _computes(dst, data, operand0, operand1):
        _store(dst, _scalar_steps(data, op0, operand0, reverse0, op1, operand1, reverse1))
    _account(on, label, data, dst)


def _scalar_steps(data, op0, operand0, reverse0, op1=None, operand1=None, reverse1=False):
    x = _alu(op0, operand0, data) if reverse0 and op0.name not in nl.UNARY_ALU_OPS else _alu(op0, data, operand0)
    if op1 is not None:
        x = _alu(op1, operand1, x) if reverse1 and op1.name not in nl.UNARY_ALU_OPS else _alu(op1, x, operand1)
    return x


@instruction
def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0: bool = False, reverse1: bool = False,
                         name=None) -> None:
    """``dst = (data <op0> operand0) <op1> operand1``: a per-partition scalar step, then an elementwise one with the
    tile ``operand1`` (``reverse`` swaps an operation's sides)."""
    label = "scalar_tensor_tensor"
    dst, data, operand1 = (_tile(t, r, label) for t, r in ((dst, "dst"), (data, "data"), (operand1, "operand1")))
    _same_shape(label, data, "data", operand1, "operand1")
    _same_shape(label, dst, "dst", data, "data")
    _check_alu(label, op0)
    _check_alu(label, op1)
    operand0 = _operand(operand0, data, label, "operand0")
    if _computes(dst, data, operand0, operand1):
        x = _alu(op0, operand0, data) if reverse0 else _alu(op0, data, operand0)
        _store(dst, op1(_f32(operand1), x) if reverse1 else op1(x, _f32(operand1)))
    _account("vector", label, data, operand1, dst)


@instruction
def tensor_reduce(dst, op, data, axis, negate: bool = False, keepdims: bool = False, name=None) -> None:
    """Reduce ``data`` over free axes (never the partition axis) with ``nl.add`` / ``nl.multiply`` /
    ``nl.maximum`` / ``nl.minimum``; ``negate`` negates the result."""
    label = "tensor_reduce"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(a % len(data.shape) if a < 0 else a for a in axes)
    if not axes or any(a < 1 or a >= len(data.shape) for a in axes):
        raise HardwareLimitError(f"{label}: axis {axis} must name free axes of data {data.shape} (1..."
                                 f"{len(data.shape) - 1}); the partition axis cannot be reduced here")
    key = _reduce_op(op, label)
    kept = tuple(1 if d in axes else n for d, n in enumerate(data.shape))
    if dst.partitions != data.partitions or dst.free_size != int(np.prod(kept[1:])):
        raise HardwareLimitError(f"{label}: dst shape {dst.shape} must hold "
                                 f"{kept if keepdims else tuple(n for d, n in enumerate(data.shape) if d not in axes)}")
    if _computes(dst, data):
        reducer = _REDUCTIONS[key]
        source = data.data if is_integer(data.dtype) and is_integer(dst.dtype) else data.data.astype(np.float32)
        result = reducer(source, axis=axes, keepdims=True)
        _store(dst, -result if negate else result)
    _account("vector", label, data, dst)


@instruction
def tensor_copy(dst, src, engine=None, name=None) -> None:
    """Copy on an engine, converting to ``dst``'s dtype (how PSUM is evacuated to SBUF); bit-exact when the dtypes
    match. GpSimd cannot reach PSUM."""
    label = "tensor_copy"
    dst, src = _tile(dst, "dst", label), _tile(src, "src", label)
    _same_shape(label, dst, "dst", src, "src")
    on = _engine(engine, "vector", op=label)
    _reaches(on, label, dst, src)
    if _computes(dst, src):
        if is_integer(src.dtype) or src.dtype == dst.dtype:
            _store(dst, src.data)
        else:  # through fp32; an integer dst rounds to nearest (_store)
            _store(dst, _f32(src) if is_integer(dst.dtype) else cast(src.data, dst.dtype))
    _account(on, label, src, dst)


@instruction
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


@instruction
def memset(dst, value, engine=None, name=None) -> None:
    """Fill ``dst`` with a constant on the Vector Engine (or GpSimd)."""
    label = "memset"
    dst = _tile(dst, "dst", label)
    on = _engine(engine, "vector", ("vector", "gpsimd"), label)
    _reaches(on, label, dst)
    if dst.alloc.has_data:
        if dst.dtype.names is not None:
            if value != 0:
                raise ValueError(f"{label}: packed x4 dtypes can only be set to 0, got {value}")
            dst.data.view(np.uint8)[...] = 0
        else:
            _store(dst, np.float32(value) if not is_integer(dst.dtype) else value)
    _account(on, label, dst)


# ----------------------------------------------------------------------------------------------------------------
# registers


@instruction(fence=True)
def register_alloc(x: int | None = None) -> VirtualRegister:
    return VirtualRegister(current_core(), 0 if x is None else int(x))


@instruction(fence=True)
def register_move(dst: VirtualRegister, src) -> None:
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)


@instruction(fence=True)
def register_load(dst: VirtualRegister, src) -> None:
    """Load a one-element integer tensor (SBUF or HBM) into a register: how device values steer loops."""
    if not isinstance(dst, VirtualRegister):
        raise TypeError(f"register_load: dst must be a VirtualRegister, got {type(dst).__name__}")
    check_alive(src)
    dst.value = scalar_value(src)


@instruction(fence=True)
def register_store(dst, src) -> None:
    """Write a register's value into a one-element integer tensor."""
    if not isinstance(src, VirtualRegister):
        raise TypeError(f"register_store: src must be a VirtualRegister, got {type(src).__name__}")
    if not isinstance(dst, NkiTensor) or not is_integer(dst.dtype) or dst.size != 1:
        raise TypeError(f"register_store: dst must be a one-element integer tensor, got {dst!r}")
    check_alive(dst, write=True)
    dst.data[...] = src.value


# ----------------------------------------------------------------------------------------------------------------
# DMA


@instruction
def dma_copy(dst, src, priority=None, oob_mode: str = oob_mode.error, dge_mode=dge_mode.unknown, engine=None,
             name=None) -> None:
    """Copy ``src`` to ``dst`` through the DMA queues (HBM <-> SBUF, HBM -> HBM, SBUF -> SBUF).

    Either side may be an :meth:`~nxd_moe.nki_kernels.machine.NkiTensor.ap` access pattern with dynamic offsets;
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
        _mark_unknown(_base(dst), [src.name])
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
def dma_compute(dst, srcs, reduce_op=nl.add, scales=None, unique_indices: bool = True, oob_mode: str = oob_mode.error,
                name=None) -> None:
    """``dst = reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...)`` elementwise inside the DMA engines, in fp32
    (sources cast to fp32, the result to dst's dtype) -- how LNC2 kernels sum the two cores' partial outputs. As NKI
    documents, only ``nl.add`` and scales of 1.0 are supported. Accounted as one read transfer per source and the
    write of ``dst``."""
    name = "dma_compute"
    _check_dma_side(dst, "dst", name)
    if not isinstance(dst, NkiTensor) or not srcs:
        raise TypeError(f"{name}: dst must be a tensor and srcs a non-empty list of tensors")
    if reduce_op is not nl.add:
        raise ValueError(f"{name}: only reduce_op=nl.add is supported, got {reduce_op!r}")
    if scales is not None and (len(scales) != len(srcs) or any(float(v) != 1.0 for v in scales)):
        raise ValueError(f"{name}: scales must be None or one 1.0 per source ({len(srcs)}), got {scales!r}")
    for i, src in enumerate(srcs):
        _check_dma_side(src, f"srcs[{i}]", name)
        if not isinstance(src, NkiTensor) or src.shape[0] != dst.shape[0] or src.size != dst.size:
            raise HardwareLimitError(f"{name}: srcs[{i}] must be a tensor with dst's rows and elements "
                                     f"({dst.shape}), got {src!r}")
    factors = [np.float32(1.0)] * len(srcs)
    if _computes(dst, *srcs):
        result = _f32(srcs[0]) * factors[0]
        for src, factor in zip(srcs[1:], factors[1:]):
            result = reduce_op(result, _f32(src) * factor)
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


# ----------------------------------------------------------------------------------------------------------------
# LNC2: the two cores of a logical NeuronCore


@instruction(fence=True)
def core_barrier(data, cores=(0, 1), engine=None, name=None) -> None:
    """Wait until both cores of the logical core reach this point (both must have finished writing ``data``, a
    shared HBM tensor). A no-op when the kernel runs on one core."""
    if tuple(cores) != (0, 1):
        raise HardwareLimitError(f"core_barrier: only cores=(0, 1) is supported, got {cores}")
    # NKI documents data as "shared HBM"; nki-library also passes SBUF tiles (its hybrid kernel's block counter),
    # which the compiler accepts: the barrier orders the cores whatever the tensor.
    if not isinstance(data, NkiTensor):
        raise TypeError(f"core_barrier: data must be a tensor, got {data!r}")
    core = current_core()
    if core.num_programs == 1:
        return
    core.accounting.barriers += 1
    core.accounting.record("gpsimd", "core_barrier", 0, False)
    core.launch.barrier.wait(core.program_id)


@instruction(fence=True)
def sendrecv(src, dst, send_to_rank: int, recv_from_rank: int, pipe_id: int, dma_engine=None, name=None) -> None:
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
    if dma_engine == 2 and src.free_size * src.dtype.itemsize > 1024 // (4 // min(4, src.dtype.itemsize)):
        raise HardwareLimitError(f"{name}: dma_engine.gpsimd_dma moves at most 1024 / 512 / 256 bytes per partition "
                                 f"for 4- / 2- / 1-byte types, got {src.free_size} x {src.dtype}")
    payload = src.data.copy() if src.alloc.has_data and src.alloc.known else None
    received = core.launch.exchange(core.program_id, payload, pipe_id, send_to_rank, recv_from_rank)
    if received is None:
        _mark_unknown(dst, [f"{src.name} (peer)"])
    elif dst.alloc.has_data:
        dst.data[...] = received
    core.accounting.record_dma(src.name, "sbuf->sbuf", DmaTraffic(
        bytes=src.data.size * src.dtype.itemsize, transfers=1, rows=src.partitions))


# ----------------------------------------------------------------------------------------------------------------
# more Vector / GpSimd instructions


@instruction
def tensor_copy_predicated(dst, src, predicate, reverse_pred: bool = False, name=None) -> None:
    """``dst = where(predicate, src, dst)`` on the Vector Engine: where the (unsigned integer) predicate is non-zero
    (zero with ``reverse_pred``) copy ``src`` (a tile of dst's dtype, or a number); elsewhere ``dst`` keeps its
    values."""
    label = "tensor_copy_predicated"
    dst, predicate = _tile(dst, "dst", label), _tile(predicate, "predicate", label)
    check_alive(dst)  # where the predicate is off, dst keeps its values: a read of it
    _same_shape(label, dst, "dst", predicate, "predicate")
    if predicate.dtype not in (nl.uint8, nl.uint16, nl.uint32):
        raise TypeError(f"{label}: predicate must be uint8, uint16 or uint32, got {predicate.dtype}")
    if isinstance(src, NkiTensor):
        src = _tile(src, "src", label)
        _same_shape(label, dst, "dst", src, "src")
        if src.dtype != dst.dtype:
            raise TypeError(f"{label}: src and dst must share a dtype ({src.dtype} vs {dst.dtype})")
        if src.buffer is Buffer.PSUM and predicate.buffer is Buffer.PSUM:
            raise HardwareLimitError(f"{label}: src and predicate cannot both be in PSUM")
    if _computes(dst, predicate, src):
        mask = predicate.data.reshape(dst.partitions, dst.free_size) != 0
        if reverse_pred:
            mask = ~mask
        current = dst.data.reshape(dst.partitions, dst.free_size).copy()
        values = (src.data.reshape(current.shape) if isinstance(src, NkiTensor)
                  else np.asarray(src).astype(dst.dtype))
        _store(dst, np.where(mask, values, current))
    _account("vector", label, dst, predicate)


@instruction
def iota(dst, pattern, offset: int = 0, channel_multiplier: int = 0, name=None) -> None:
    """``dst[p, w, z, y, x] = offset + p * channel_multiplier + w*step_w + z*step_z + y*step_y + x*step_x`` on
    GpSimd: ``pattern`` is up to 4 ``[step, count]`` pairs whose counts multiply to dst's elements per partition;
    computed in int32, then cast to dst's dtype. dst must be in SBUF."""
    label = "iota"
    dst = _tile(dst, "dst", label, (Buffer.SBUF,))
    pairs = [(int(step), int(count)) for step, count in pattern]
    if not 1 <= len(pairs) <= 4 or any(count < 1 for _, count in pairs):
        raise HardwareLimitError(f"{label}: pattern must be 1 to 4 [step, count] pairs with counts >= 1, got {pattern}")
    if int(np.prod([c for _, c in pairs])) != dst.free_size:
        raise HardwareLimitError(f"{label}: pattern {pattern} generates {int(np.prod([c for _, c in pairs]))} "
                                 f"elements per partition; dst {dst.shape} has {dst.free_size}")
    if dst.alloc.has_data:
        values = np.full((dst.partitions, 1), int(offset), np.int64) + \
            np.arange(dst.partitions, dtype=np.int64)[:, None] * int(channel_multiplier)
        grid = np.zeros([c for _, c in pairs], np.int64)
        for d, (step, count) in enumerate(pairs):
            shape = [1] * len(pairs)
            shape[d] = count
            grid = grid + (np.arange(count, dtype=np.int64) * step).reshape(shape)
        result = (values + grid.reshape(1, -1)).astype(np.int32)
        _store(dst, result if is_integer(dst.dtype) else result.astype(np.float32))
    _account("gpsimd", label, dst)


@instruction
def reciprocal(dst, data, name=None) -> None:
    """``dst = 1 / data`` elementwise on the Vector Engine, in fp32."""
    label = "reciprocal"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    _same_shape(label, dst, "dst", data, "data")
    if _computes(dst, data):
        with np.errstate(divide="ignore"):
            _store(dst, np.float32(1.0) / _f32(data))
    _account("vector", label, data, dst)


@instruction
def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0: bool = False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate: bool = False,
                         name=None) -> None:
    """``dst = data <op0> operand0`` (as ``tensor_scalar``) and a reduction of ``dst`` over all free dims into the
    Vector Engine's accumulator and ``reduce_res`` ``(P, 1)`` (``reduce_cmd`` as documented)."""
    label = "tensor_scalar_reduce"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    _same_shape(label, dst, "dst", data, "data")
    _check_alu(label, op0)
    operand0 = _operand(operand0, data, label, "operand0")
    _reduce_op(reduce_op, label)
    if reduce_init is not None and reduce_cmd != reduce_cmd.load_reduce:
        raise ValueError(f"{label}: reduce_init is only used with reduce_cmd.load_reduce")
    if _computes(dst, data, operand0):
        result = np.asarray(_scalar_steps(data, op0, operand0, reverse0), dtype=np.float32)
        _store(dst, result)
        _accumulate(current_core(), label, "vector", result, reduce_op, reduce_res, reduce_cmd, reduce_init,
                    reduce_res_negate)
    _account("vector", label, data, dst)


BN_STATS_FMAX = 512


@instruction
def bn_stats(dst, data, name=None) -> None:
    """Per partition: ``(count, mean, variance * count)`` of the even-indexed and of the odd-indexed elements of
    ``data`` (at most 512 per partition), in fp32 on the Vector Engine; dst has 6 elements per partition."""
    label = "bn_stats"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    if data.free_size > BN_STATS_FMAX:
        raise HardwareLimitError(f"{label}: data has {data.free_size} elements per partition; at most "
                                 f"nl.tile_size.bn_stats_fmax = {BN_STATS_FMAX}")
    if dst.partitions != data.partitions or dst.free_size != 6:
        raise HardwareLimitError(f"{label}: dst must be ({data.partitions}, 6), got {dst.shape}")
    if _computes(dst, data):
        x = _f32(data)
        parts = []
        for half in (x[:, 0::2], x[:, 1::2]):
            count = np.float32(half.shape[1])
            mean = half.mean(axis=1) if half.shape[1] else np.zeros(x.shape[0], np.float32)
            m2 = ((half - mean[:, None]) ** 2).sum(axis=1)
            parts += [np.full(x.shape[0], count, np.float32), mean, m2]
        _store(dst, np.stack(parts, axis=1))
    _account("vector", label, data, dst)


@instruction
def bn_aggr(dst, data, name=None) -> None:
    """Combine ``(count, mean, variance * count)`` triples (``bn_stats`` outputs) into ``(mean, variance)`` per
    partition, in fp32 on the Vector Engine."""
    label = "bn_aggr"
    dst, data = _tile(dst, "dst", label), _tile(data, "data", label)
    if data.free_size % 3:
        raise HardwareLimitError(f"{label}: data must hold (count, mean, variance*count) triples; "
                                 f"{data.free_size} elements per partition is not a multiple of 3")
    if dst.partitions != data.partitions or dst.free_size != 2:
        raise HardwareLimitError(f"{label}: dst must be ({data.partitions}, 2), got {dst.shape}")
    if _computes(dst, data):
        triples = _f32(data).reshape(data.partitions, -1, 3)
        count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
        total = count.sum(axis=1)
        safe = np.where(total > 0, total, 1)
        grand = (count * mean).sum(axis=1) / safe
        var = (m2 + count * (mean - grand[:, None]) ** 2).sum(axis=1) / safe
        _store(dst, np.stack([grand, var], axis=1))
    _account("vector", label, data, dst)


@instruction
def nc_stream_shuffle(dst, src, shuffle_mask, name=None) -> None:
    """Cross-partition moves inside each quadrant of 32 partitions on the Vector Engine: output partition ``i`` of a
    quadrant takes input partition ``shuffle_mask[i]`` of the same quadrant; 255 leaves it unmodified. The
    quadrants' start partitions follow the documented rules (0 for 96/128 active partitions, 0/64 for 64,
    0/32/64/96 for 32)."""
    label = "nc_stream_shuffle"
    dst, src = _tile(dst, "dst", label), _tile(src, "src", label)
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
    if _computes(dst, src):
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
    _account("vector", label, src, dst)


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
    dst, src_buffer, index = (_tile(t, r, label) for t, r in ((dst, "dst"), (src_buffer, "src_buffer"),
                                                                (index, "index")))
    _reaches("gpsimd", label, dst, src_buffer, index)
    if index.dtype != nl.uint16:
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
    if _computes(dst, src_buffer, index):
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
    _account("gpsimd", label, dst)


@instruction
def nonzero_with_count(dst, src, index_offset: int = 0, padding_val: int = -1, name=None) -> None:
    """On GpSimd, for partitions 0, 16, ..., 112 only: the indices (+ ``index_offset``) of ``src``'s non-zero
    elements, then ``padding_val`` up to ``src``'s length, then the count; dst has one more element per partition
    than src; other partitions are not modified."""
    label = "nonzero_with_count"
    dst, src = _tile(dst, "dst", label), _tile(src, "src", label)
    _reaches("gpsimd", label, dst, src)
    if dst.partitions != src.partitions or dst.free_size != src.free_size + 1:
        raise HardwareLimitError(f"{label}: dst must be ({src.partitions}, {src.free_size + 1}), got {dst.shape}")
    if _computes(dst, src):
        values = src.data.reshape(src.partitions, -1)
        out = dst.data.reshape(dst.partitions, -1).copy()
        for p in range(0, src.partitions, 16):
            nz = np.flatnonzero(values[p].astype(np.float32) != 0)
            row = np.full(src.free_size + 1, padding_val, np.int64)
            row[:nz.size] = nz + int(index_offset)
            row[-1] = nz.size
            out[p] = row.astype(dst.dtype) if is_integer(dst.dtype) else row.astype(np.float32)
        dst.data[...] = out.reshape(dst.shape)
    _account("gpsimd", label, src, dst)


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
        _mark_unknown(dst, [src.name])
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

