"""The Scalar and Vector Engines' arithmetic: activation functions (``activation``, ``activation_reduce``), ALU ops
on tiles and per-partition scalars (``tensor_tensor``, ``tensor_scalar``, ``scalar_tensor_tensor``, ``reciprocal``)
and reductions along the free axes (``tensor_reduce``, ``tensor_scalar_reduce``, and the accumulator registers that
``reduce_cmd`` drives). Operands are read in fp32; results are rounded to the destination."""

from __future__ import annotations

import numpy as np

from nxd_moe.nki_kernels.dtypes import is_integer
from nxd_moe.nki_kernels.hardware import HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import (
    REDUCTIONS,
    account,
    accumulate_registers,
    alu,
    as_f32,
    check_alu_op,
    check_reaches,
    check_same_shape,
    chosen_engine,
    computes,
    reduce_op_name,
    scalar_operand,
    store_result,
    tile_operand,
)
from nxd_moe.nki_kernels.isa_constants import reduce_cmd
from nxd_moe.nki_kernels.machine import current_core, instruction
from nxd_moe.nki_kernels.opcodes import ACTIVATION_FUNCTIONS, UNARY_ALU_OPS


@instruction
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None) -> None:
    """``dst = op(data * scale + bias)`` on the Scalar Engine; ``bias``/``scale`` are numbers or ``(P, 1)`` tiles.
    With ``reduce_op`` the results are also reduced along the free dims into the accumulator / ``reduce_res``."""
    label = "activation"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    check_same_shape(label, dst, "dst", data, "data")
    if op not in ACTIVATION_FUNCTIONS.values():
        raise ValueError(f"{label}: op must be one of {sorted('nl.' + k for k in ACTIVATION_FUNCTIONS)}, got "
                         f"{op!r}")
    scale = scalar_operand(scale, data, label, "scale")
    bias = None if bias is None else scalar_operand(bias, data, label, "bias")
    if computes(dst, data, scale, bias):
        x = as_f32(data) * as_f32(scale)
        if bias is not None:
            x = x + as_f32(bias)
        y = np.asarray(op(x), dtype=np.float32)
        store_result(dst, y)
        if reduce_op is not None:
            accumulate_registers(current_core(), label, "scalar", y, reduce_op, reduce_res,
                        reduce_cmd if reduce_cmd != reduce_cmd.idle else reduce_cmd.reset_reduce)
    elif reduce_op is not None and reduce_res is not None:
        tile_operand(reduce_res, "reduce_res", label)
    account("scalar", label, data, dst)


@instruction
def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None) -> None:
    """``activation`` plus a free-dim reduction of its result into ``reduce_res`` ``(P, 1)``."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce)


@instruction
def tensor_tensor(dst, data1, data2, op, engine=None, name=None) -> None:
    """``dst = data1 <op> data2`` elementwise on the Vector Engine (or GpSimd)."""
    label = "tensor_tensor"
    on = chosen_engine(engine, "vector", ("vector", "gpsimd"), label)
    dst, data1, data2 = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (data1, "data1"), (data2, "data2")))
    check_reaches(on, label, dst, data1, data2)
    check_same_shape(label, data1, "data1", data2, "data2")
    check_same_shape(label, dst, "dst", data1, "data1")
    check_alu_op(label, op)
    if computes(dst, data1, data2):
        store_result(dst, alu(op, data1, data2))
    account(on, label, data1, data2, dst)


@instruction
def tensor_scalar(dst, data, op0, operand0, reverse0: bool = False, op1=None, operand1=None,
                  reverse1: bool = False, engine=None, name=None) -> None:
    """``dst = (data <op0> operand0) <op1> operand1`` with per-partition or constant operands (``reverse`` swaps
    an operation's sides)."""
    label = "tensor_scalar"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    check_same_shape(label, dst, "dst", data, "data")
    check_alu_op(label, op0)
    on = chosen_engine(engine, "vector", op=label)
    check_reaches(on, label, dst, data, operand0, operand1)
    operand0 = scalar_operand(operand0, data, label, "operand0")
    if op1 is not None:
        check_alu_op(label, op1)
        operand1 = scalar_operand(operand1, data, label, "operand1")
    if computes(dst, data, operand0, operand1):
        store_result(dst, _scalar_steps(data, op0, operand0, reverse0, op1, operand1, reverse1))
    account(on, label, data, dst)


def _scalar_steps(data, op0, operand0, reverse0, op1=None, operand1=None, reverse1=False):
    x = alu(op0, operand0, data) if reverse0 and op0.name not in UNARY_ALU_OPS else alu(op0, data, operand0)
    if op1 is not None:
        x = alu(op1, operand1, x) if reverse1 and op1.name not in UNARY_ALU_OPS else alu(op1, x, operand1)
    return x


@instruction
def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0: bool = False, reverse1: bool = False,
                         name=None) -> None:
    """``dst = (data <op0> operand0) <op1> operand1``: a per-partition scalar step, then an elementwise one with the
    tile ``operand1`` (``reverse`` swaps an operation's sides)."""
    label = "scalar_tensor_tensor"
    dst, data, operand1 = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (data, "data"), (operand1, "operand1")))
    check_same_shape(label, data, "data", operand1, "operand1")
    check_same_shape(label, dst, "dst", data, "data")
    check_alu_op(label, op0)
    check_alu_op(label, op1)
    operand0 = scalar_operand(operand0, data, label, "operand0")
    if computes(dst, data, operand0, operand1):
        x = alu(op0, operand0, data) if reverse0 else alu(op0, data, operand0)
        store_result(dst, op1(as_f32(operand1), x) if reverse1 else op1(x, as_f32(operand1)))
    account("vector", label, data, operand1, dst)


@instruction
def reciprocal(dst, data, name=None) -> None:
    """``dst = 1 / data`` elementwise on the Vector Engine, in fp32."""
    label = "reciprocal"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    check_same_shape(label, dst, "dst", data, "data")
    if computes(dst, data):
        with np.errstate(divide="ignore"):
            store_result(dst, np.float32(1.0) / as_f32(data))
    account("vector", label, data, dst)


@instruction
def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0: bool = False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate: bool = False,
                         name=None) -> None:
    """``dst = data <op0> operand0`` (as ``tensor_scalar``) and a reduction of ``dst`` over all free dims into the
    Vector Engine's accumulator and ``reduce_res`` ``(P, 1)`` (``reduce_cmd`` as documented)."""
    label = "tensor_scalar_reduce"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    check_same_shape(label, dst, "dst", data, "data")
    check_alu_op(label, op0)
    operand0 = scalar_operand(operand0, data, label, "operand0")
    reduce_op_name(reduce_op, label)
    if reduce_init is not None and reduce_cmd != reduce_cmd.load_reduce:
        raise ValueError(f"{label}: reduce_init is only used with reduce_cmd.load_reduce")
    if computes(dst, data, operand0):
        result = np.asarray(_scalar_steps(data, op0, operand0, reverse0), dtype=np.float32)
        store_result(dst, result)
        accumulate_registers(current_core(), label, "vector", result, reduce_op, reduce_res, reduce_cmd, reduce_init,
                    reduce_res_negate)
    account("vector", label, data, dst)


@instruction
def tensor_reduce(dst, op, data, axis, negate: bool = False, keepdims: bool = False, name=None) -> None:
    """Reduce ``data`` over free axes (never the partition axis) with ``nl.add`` / ``nl.multiply`` /
    ``nl.maximum`` / ``nl.minimum``; ``negate`` negates the result."""
    label = "tensor_reduce"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(a % len(data.shape) if a < 0 else a for a in axes)
    if not axes or any(a < 1 or a >= len(data.shape) for a in axes):
        raise HardwareLimitError(f"{label}: axis {axis} must name free axes of data {data.shape} (1..."
                                 f"{len(data.shape) - 1}); the partition axis cannot be reduced here")
    key = reduce_op_name(op, label)
    kept = tuple(1 if d in axes else n for d, n in enumerate(data.shape))
    if dst.partitions != data.partitions or dst.free_size != int(np.prod(kept[1:])):
        raise HardwareLimitError(f"{label}: dst shape {dst.shape} must hold "
                                 f"{kept if keepdims else tuple(n for d, n in enumerate(data.shape) if d not in axes)}")
    if computes(dst, data):
        reducer = REDUCTIONS[key]
        source = data.data if is_integer(data.dtype) and is_integer(dst.dtype) else data.data.astype(np.float32)
        result = reducer(source, axis=axes, keepdims=True)
        store_result(dst, -result if negate else result)
    account("vector", label, data, dst)
