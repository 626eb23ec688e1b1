"""Recurrences along the free axis on the Vector Engine (``tensor_tensor_scan``, ``tensor_scalar_cumulative``) and
reductions across partitions on GpSimd (``tensor_partition_reduce``). Each partition's free elements are taken in
row-major order; the running state is fp32, every output element is rounded to the destination."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.dtypes import int32, uint32
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import (
    REDUCE_IDENTITY,
    account,
    alu,
    as_f32,
    check_alu_op,
    check_same_shape,
    computes,
    scalar_operand,
    store_result,
    tile_operand,
)
from nxd_moe.nki_kernels.isa_constants import reduce_cmd
from nxd_moe.nki_kernels.isa_constants import reduce_cmd as ReduceCmd
from nxd_moe.nki_kernels.machine import current_core, instruction
from nxd_moe.nki_kernels.opcodes import add

# Running a scan with NumPy's accumulate where the recurrence is one (same order, same fp32 rounding).
_ACCUMULATE = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum}


def _scan(state: np.ndarray, steps: np.ndarray, op, state_first: bool) -> np.ndarray:
    """``out[:, i] = op(state_i-1, steps[:, i])`` (``state_first``) or ``op(steps[:, i], state_i-1)``, from
    ``state (P, 1)``; fp32."""
    ufunc = _ACCUMULATE.get(op.name)
    if ufunc is not None:  # commutative: one accumulate over [state, steps...]
        return ufunc.accumulate(np.concatenate([state, steps], axis=1), axis=1, dtype=np.float32)[:, 1:]
    out = np.empty_like(steps)
    for i in range(steps.shape[1]):
        state = alu(op, state, steps[:, i:i + 1]) if state_first else alu(op, steps[:, i:i + 1], state)
        out[:, i:i + 1] = state
    return out


@instruction
def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0: bool = False, reverse1: bool = False,
                       name=None) -> None:
    """Per partition, ``r_i = op1(op0(data0_i, r_i-1), data1_i)`` from ``r_-1 = initial`` (an fp32 number or a
    ``(P, 1)`` tile); ``reverse0`` makes ``data0`` the right operand of ``op0``, ``reverse1`` makes ``data1`` the left
    operand of ``op1``. ``data0`` and ``data1`` cannot both be in PSUM."""
    label = "tensor_tensor_scan"
    dst, data0, data1 = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (data0, "data0"), (data1, "data1")))
    check_same_shape(label, data0, "data0", data1, "data1")
    check_same_shape(label, dst, "dst", data0, "data0")
    if data0.buffer is Buffer.PSUM and data1.buffer is Buffer.PSUM:
        raise HardwareLimitError(f"{label}: data0 and data1 cannot both be in PSUM")
    check_alu_op(label, op0)
    check_alu_op(label, op1)
    initial = scalar_operand(initial, data0, label, "initial")
    if computes(dst, data0, data1, initial):
        a, b = as_f32(data0), as_f32(data1)
        state = np.broadcast_to(np.asarray(as_f32(initial), np.float32), (a.shape[0], 1)).astype(np.float32)
        if op0.name == "multiply" and op1.name == "add" and not reverse1 and np.all(a == 1):
            out = _scan(state, b, add, True)  # a running sum (nki-library's cumsum): one accumulate
        else:
            out = np.empty_like(a)
            for i in range(a.shape[1]):
                x, y = a[:, i:i + 1], b[:, i:i + 1]
                t = alu(op0, state, x) if reverse0 else alu(op0, x, state)
                state = np.asarray(alu(op1, y, t) if reverse1 else alu(op1, t, y), np.float32)
                out[:, i:i + 1] = state
        store_result(dst, out)
    account("vector", label, data0, data1, dst)


CUMULATIVE_OPS = ("add", "subtract", "multiply", "maximum", "minimum")


@instruction
def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=reduce_cmd.reset_reduce,
                             name=None) -> None:
    """Per partition, ``reg = op1(op0(src_i, imm0), reg)``, ``dst_i = reg``, with the Vector Engine's accumulator
    register: ``reset_reduce`` starts from op1's identity, ``load_reduce`` from ``imm1``, ``reduce`` from where the
    last accumulating instruction left it. int32/uint32 tiles are not supported (ISA limit)."""
    label = "tensor_scalar_cumulative"
    dst, src = tile_operand(dst, "dst", label), tile_operand(src, "src", label)
    check_same_shape(label, dst, "dst", src, "src")
    check_alu_op(label, op0)
    if getattr(op1, "name", None) not in CUMULATIVE_OPS:
        raise ValueError(f"{label}: op1 must be nl.add, nl.subtract, nl.multiply, nl.maximum or nl.minimum, got "
                         f"{op1!r}")
    for role, t in (("dst", dst), ("src", src)):
        if t.dtype in (int32, uint32):
            raise TypeError(f"{label}: {role} cannot be int32 or uint32 (ISA limit)")
    imm0 = scalar_operand(imm0, src, label, "imm0")
    cmd = ReduceCmd(reduce_cmd)
    if cmd == ReduceCmd.load_reduce:
        if imm1 is None:
            raise ValueError(f"{label}: reduce_cmd.load_reduce needs imm1")
        imm1 = scalar_operand(imm1, src, label, "imm1")
    registers = current_core().accumulators.setdefault("vector", {})
    p = src.partitions
    if computes(dst, src, imm0, imm1):
        if cmd == ReduceCmd.load_reduce:
            state = np.broadcast_to(np.asarray(as_f32(imm1), np.float32), (p, 1)).astype(np.float32)
        elif cmd == ReduceCmd.reduce:
            if registers.get("shape") != (p,):
                raise HardwareLimitError(f"{label}: reduce_cmd.reduce continues a reduction, but none over {p} "
                                         "partitions was started (use reduce_cmd.reset_reduce first)")
            state = registers["value"].reshape(p, 1).astype(np.float32)
        else:
            identity = REDUCE_IDENTITY.get(op1.name, 0.0)  # add and subtract start from 0
            state = np.full((p, 1), identity, np.float32)
        steps = np.asarray(alu(op0, src, imm0), np.float32).reshape(p, src.free_size)
        out = _scan(state, steps, op1, state_first=False)
        store_result(dst, out)
        registers["value"], registers["shape"] = out[:, -1].astype(np.float32).copy(), (p,)
    account("vector", label, src, dst)


PARTITION_REDUCTIONS = {"add": np.sum, "maximum": np.max, "minimum": np.min, "average": np.mean,
                        "bitwise_or": np.bitwise_or.reduce, "bitwise_and": np.bitwise_and.reduce}


@instruction
def tensor_partition_reduce(dst, op, data, name=None) -> None:
    """GpSimd: ``dst (1, ...)`` = ``data`` reduced across its partitions elementwise with ``op`` (``nl.add``,
    ``nl.maximum``, ``nl.minimum``, ``nl.average``, ``nl.bitwise_or``, ``nl.bitwise_and``; bitwise ops on the
    integers)."""
    label = "tensor_partition_reduce"
    dst, data = tile_operand(dst, "dst", label, (Buffer.SBUF,)), tile_operand(data, "data", label, (Buffer.SBUF,))
    key = {"max": "maximum", "min": "minimum"}.get(getattr(op, "name", None), getattr(op, "name", None))
    if key not in PARTITION_REDUCTIONS:
        raise ValueError(f"{label}: op must be one of {sorted('nl.' + k for k in PARTITION_REDUCTIONS)}, got {op!r}")
    if dst.partitions != 1 or dst.free_size != data.free_size:
        raise HardwareLimitError(f"{label}: dst must be one partition with data's {data.free_size} elements, got "
                                 f"{dst.shape}")
    if computes(dst, data):
        if key.startswith("bitwise"):
            values = data.data.astype(np.int64).reshape(data.partitions, data.free_size)
        else:
            values = as_f32(data)
        store_result(dst, PARTITION_REDUCTIONS[key](values, axis=0).reshape(1, -1))
    account("gpsimd", label, data, dst)
