"""What every ``nisa`` instruction does besides its own arithmetic, shared by the instruction families in
:mod:`nxd_moe.nki_kernels.instructions` and the tile functions (:mod:`~nxd_moe.nki_kernels.tiles`): check its
operands (``tile_operand``, ``check_same_shape``, ``scalar_operand``), read them in fp32 (``as_f32``) and round the
result into the destination (``store_result``), skip the arithmetic in a counting run (``computes``), apply an ALU op
(``alu``), run on an engine (``chosen_engine``, ``check_reaches``) and be counted there (``account``), and drive the
engines' accumulator registers (``accumulate_registers``).

It imports neither ``isa`` nor ``instructions``, so every instruction module is a leaf that imports only this and the
modules below it (the machine, tensors, dtypes, opcodes and ``isa_constants``). ``isa`` re-exports the instructions
alone, so these helpers are not in the ``nki.isa`` namespace, whose public names are NKI's.
"""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.dtypes import cast, is_integer
from nxd_moe.nki_kernels.hardware import PMAX, Buffer, HardwareLimitError
from nxd_moe.nki_kernels.isa_constants import engine, reduce_cmd
from nxd_moe.nki_kernels.machine import check_alive, current_core
from nxd_moe.nki_kernels.opcodes import ALU_OPS, INTEGER_ALU_OPS, UNARY_ALU_OPS
from nxd_moe.nki_kernels.tensor import NkiTensor

# ----------------------------------------------------------------------------------------------------------------
# operands


# The operand roles an instruction writes; every other role is read. A write settles the pending matmuls that read
# the tile's old values and is what the liveness trace starts a value's life at.
WRITTEN_ROLES = frozenset({"dst", "reduce_res", "val_dst", "idx_dst", "dst_idx"})


def tile_operand(t, role: str, op: str, buffers=(Buffer.SBUF, Buffer.PSUM), settled: bool = True) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise TypeError(f"{op}: {role} must be an on-chip tensor, got {type(t).__name__}")
    check_alive(t, write=role in WRITTEN_ROLES, settled=settled)
    if t.buffer not in buffers:
        allowed = " or ".join(b.value for b in buffers)
        raise HardwareLimitError(f"{op}: {role} {t.name!r} is in {t.buffer.value}; it must be in {allowed}")
    if t.partitions > PMAX:
        raise HardwareLimitError(f"{op}: {role} partition dimension {t.partitions} exceeds nl.tile_size.pmax = "
                                 f"{PMAX}")
    return t


def check_same_shape(op: str, a: NkiTensor, a_role: str, b: NkiTensor, b_role: str) -> None:
    """NKI's rule for elementwise operands: the same partitions and the same number of elements per partition."""
    if a.partitions != b.partitions or a.free_size != b.free_size:
        raise HardwareLimitError(f"{op}: {a_role} shape {a.shape} and {b_role} shape {b.shape} must have the same "
                                 "partitions and elements per partition")


def scalar_operand(value, data: NkiTensor, op: str, role: str):
    """A scalar operand: a Python number (broadcast everywhere) or a ``(P, 1)`` tile (one value per partition)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return value
    t = tile_operand(value, role, op)
    if t.shape != (data.partitions, 1):
        raise HardwareLimitError(f"{op}: {role} must be a number or a ({data.partitions}, 1) tile (one value per "
                                 f"partition), got shape {t.shape}")
    return t


def computes(dst: NkiTensor, *inputs) -> bool:
    """Whether to do the arithmetic: when every input holds known values (always in a numeric run). In a counting
    run a float result of data-less inputs is skipped and marked unknown; an integer one raises (it would steer
    control flow)."""
    if not dst.alloc.has_data:
        return False
    unknown = [t.name for t in inputs if isinstance(t, NkiTensor) and not t.alloc.known]
    if unknown:
        mark_unknown(dst, unknown)
        return False
    return True


def mark_unknown(dst: NkiTensor, sources) -> None:
    if is_integer(dst.dtype):
        raise RuntimeError(f"counting run: integer tensor {dst.name!r} would be computed from float tensors "
                           f"{list(sources)} that hold no data; keep index arithmetic in integer tensors")
    dst.alloc.known = False


def as_f32(value) -> np.ndarray | float:
    """An operand as fp32: a tile flattened to ``(partitions, elements per partition)``, or a number."""
    if isinstance(value, NkiTensor):
        return cast(value.data, np.float32).reshape(value.partitions, value.free_size)
    return np.float32(value)


def store_result(dst: NkiTensor, values) -> None:
    values = np.asarray(values)
    if is_integer(dst.dtype) and not is_integer(values.dtype):
        values = np.rint(values)
    elif dst.dtype == np.float16 and values.dtype != np.float16 and values.ndim:
        values = cast(values, np.float16)  # NumPy's own half-precision rounding loop is ~15x slower
    if values.size == dst.size and values.shape != dst.shape:
        values = values.reshape(dst.shape)
    np.copyto(dst.data, values, casting="unsafe")


# ----------------------------------------------------------------------------------------------------------------
# the ALU


def check_alu_op(name: str, op) -> None:
    if op not in ALU_OPS.values():
        raise ValueError(f"{name}: op must be one of {sorted('nl.' + k for k in ALU_OPS)}, got {op!r}")


def alu(op, a, b):
    """An ALU op in fp32, except integer-only (bitwise, shift) ops, which work on the integers; a unary op
    (``nl.abs``, ``nl.invert``, ``nl.bypass``, ...) acts on ``a`` alone."""
    if op.name in UNARY_ALU_OPS:
        return op(_ints(a)) if op.name in INTEGER_ALU_OPS else op(as_f32(a))
    if op.name in INTEGER_ALU_OPS:
        return op(_ints(a), _ints(b))
    return op(as_f32(a), as_f32(b))


def _ints(value):
    if isinstance(value, NkiTensor):
        return value.data.astype(np.int64).reshape(value.partitions, value.free_size)
    return np.int64(value)


# ----------------------------------------------------------------------------------------------------------------
# engines


def chosen_engine(value, default: str, allowed=("vector", "scalar", "gpsimd"), op: str = "") -> str:
    """An ``engine=`` argument (``nisa.engine`` member or its name) as the accounting's engine name."""
    if value is None or value == engine.unknown or value == "unknown":
        return default
    name = value.name if isinstance(value, engine) else value
    if name not in allowed:
        raise ValueError(f"{op}: engine must be one of {', '.join(allowed)}, got {value!r}")
    return name


def check_reaches(on: str, label: str, *tiles) -> None:
    """The ISA's memory rule for the engines: GpSimd cannot access PSUM (Vector and Scalar read and write both)."""
    if on == "gpsimd" and any(isinstance(t, NkiTensor) and t.buffer is Buffer.PSUM for t in tiles):
        raise HardwareLimitError(f"{label}: the GpSimd Engine cannot access PSUM; use the vector or scalar engine")


def _wide(*tensors) -> bool:
    return max(t.dtype.itemsize for t in tensors if isinstance(t, NkiTensor)) >= 4


def account(engine: str, op: str, data: NkiTensor, *inputs) -> None:
    current_core().accounting.record(engine, op, data.free_size, _wide(data, *inputs))


# ----------------------------------------------------------------------------------------------------------------
# the accumulator registers


REDUCTIONS = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}
REDUCE_IDENTITY = {"add": 0.0, "maximum": -np.inf, "minimum": np.inf, "multiply": 1.0}


def reduce_op_name(op, name: str) -> str:
    key = getattr(op, "name", None)
    key = {"max": "maximum", "min": "minimum", "sum": "add"}.get(key, key)
    if key not in REDUCTIONS:
        raise ValueError(f"{name}: reduce op must be nl.add, nl.multiply, nl.maximum or nl.minimum, got {op!r}")
    return key


def accumulate_registers(core, name: str, engine_name: str, partials: np.ndarray, reduce_op, reduce_res, cmd,
                init=None, negate: bool = False) -> None:
    """The engine's per-partition accumulator registers (``reduce_cmd``), written to ``reduce_res`` when given."""
    key = reduce_op_name(reduce_op, name)
    registers = core.accumulators.setdefault(engine_name, {})
    cmd = reduce_cmd(cmd)
    p = partials.shape[0]
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce) or p not in registers.get("shape", ()):
        if cmd == reduce_cmd.reduce and registers.get("shape") != (p,):
            raise HardwareLimitError(f"{name}: reduce_cmd.reduce continues a reduction, but none over {p} partitions "
                                     "was started (use reduce_cmd.reset_reduce first)")
        registers["value"] = np.full(p, REDUCE_IDENTITY[key], np.float32)
        registers["shape"] = (p,)
    if cmd == reduce_cmd.load_reduce:
        if init is None:
            raise ValueError(f"{name}: reduce_cmd.load_reduce needs reduce_init")
        registers["value"] = np.broadcast_to(as_f32(init), (p, 1)).reshape(p).astype(np.float32).copy()
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce, reduce_cmd.load_reduce):
        reducer = REDUCTIONS[key]
        step = reducer(partials, axis=1).astype(np.float32)
        registers["value"] = reducer(np.stack([registers["value"], step]), axis=0).astype(np.float32)
    if reduce_res is not None:
        res = tile_operand(reduce_res, "reduce_res", name)
        if res.partitions != p or res.free_size != 1:
            raise HardwareLimitError(f"{name}: reduce_res must be ({p}, 1), got {res.shape}")
        value = -registers["value"] if negate else registers["value"]
        if res.alloc.has_data:
            store_result(res, value.reshape(p, 1))
