"""``nl``'s tile-level functions: the tensor constructors (``nl.ndarray``, ``nl.zeros``, ``nl.full``, ...), loads
and stores, and NKI's (experimental) ``nl.add(x, y)``, ``nl.exp(x)``, ``nl.sum(x, axis)``, ``nl.softmax``,
``nl.rms_norm``, ``nl.where``, ``nl.matmul``, ``nl.transpose``, ``nl.broadcast_to``, ... Each returns a new tile
(SBUF; PSUM for ``matmul`` / ``transpose``, as NKI documents) and is lowered to this package's ``nisa``
instructions, so it is counted, checked and scheduled like the instructions a compiler would emit for it.

The math functions are the same objects as the ALU / activation opcodes (``op=nl.add``): called with tiles they
build a tile (this module, which installs itself as :attr:`Op.on_tiles <nxd_moe.nki_kernels.opcodes.Op>`), called
with NumPy values they compute NumPy values (how the instructions use them).
Result dtypes: ``dtype`` if given, else the first tile argument's. Binary operands are two tiles of the same
shape, a tile and a number, or a tile and a ``(P, 1)`` tile (one value per partition), either way round.
"""

from __future__ import annotations

import builtins
import math
from contextlib import contextmanager

import numpy as np

from nxd_moe.nki_kernels import isa
from nxd_moe.nki_kernels.dtypes import float32, is_integer, uint8, uint32
from nxd_moe.nki_kernels.hardware import GEMM_MOVING_FMAX, Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import account, as_f32, computes, store_result, tile_operand
from nxd_moe.nki_kernels.machine import current_core, instruction
from nxd_moe.nki_kernels.opcodes import (
    ACTIVATION_FUNCTIONS,
    ALU_OPS,
    Op,
    add,
    exp,
    maximum,
    minimum,
    multiply,
    not_equal,
    rsqrt,
    square,
)
from nxd_moe.nki_kernels.tensor import NkiTensor

# nl math functions that are neither ALU nor activation opcodes: one Vector Engine op each here
_VECTOR_ONLY = ("tan", "ceil", "floor", "trunc", "logical_not")


def _new(shape, dtype, buffer: Buffer = Buffer.SBUF, name: str = "") -> NkiTensor:
    return ndarray(tuple(shape), dtype, buffer=buffer, name=name or None)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _per_partition(t, like: NkiTensor) -> bool:
    return isinstance(t, NkiTensor) and t.shape == (like.partitions, 1) and like.free_size != 1


def elementwise(op: Op, args: tuple, dtype=None) -> NkiTensor:
    """``op`` applied to tiles (and numbers) into a new SBUF tile -- what ``nl.<op>(x[, y], dtype=)`` does."""
    tiles = [a for a in args if isinstance(a, NkiTensor)]
    if len(args) == 1:
        (x,) = args
        out = _new(x.shape, dtype or x.dtype)
        if op.name in _VECTOR_ONLY:
            _vector_unary(out, op, x)
        elif op in ACTIVATION_FUNCTIONS.values():
            isa.activation(dst=out, op=op, data=x)
        else:  # a unary ALU op (invert, ...)
            isa.tensor_scalar(dst=out, data=x, op0=op, operand0=0)
        return out
    if len(args) != 2:
        raise TypeError(f"nl.{op.name} takes one or two operands (and dtype=), got {len(args)}")
    a, b = args
    if op not in ALU_OPS.values():
        raise ValueError(f"nl.{op.name} is not a binary ALU op")
    if not builtins.all(isinstance(v, NkiTensor) or _is_number(v) for v in args):
        raise TypeError(f"nl.{op.name}: operands must be tiles or numbers, got {[type(v).__name__ for v in args]}")
    big = builtins.max(tiles, key=lambda t: t.size)
    out = _new(big.shape, dtype or tiles[0].dtype)
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a.shape == b.shape:
        isa.tensor_tensor(dst=out, data1=a, data2=b, op=op)
    elif b is not big and (_is_number(b) or _per_partition(b, big)):
        isa.tensor_scalar(dst=out, data=a, op0=op, operand0=b)
    elif a is not big and (_is_number(a) or _per_partition(a, big)):
        isa.tensor_scalar(dst=out, data=b, op0=op, operand0=a, reverse0=True)
    else:
        raise HardwareLimitError(f"nl.{op.name}: operand shapes {getattr(a, 'shape', a)} and "
                                 f"{getattr(b, 'shape', b)} do not combine (equal shapes, a number, or a (P, 1) tile)")
    return out


@instruction
def _vector_unary(dst, op, data) -> None:
    """A Vector Engine elementwise op that is neither an ALU nor an activation opcode (``tan``, ``ceil``,
    ``floor``, ``trunc``, ``logical_not``): fp32 NumPy semantics, counted as one Vector Engine instruction."""
    label = f"nl.{op.name}"
    dst, data = tile_operand(dst, "dst", label), tile_operand(data, "data", label)
    if computes(dst, data):
        store_result(dst, op(as_f32(data)).reshape(dst.shape))
    account("vector", label, data, dst)


Op.on_tiles = elementwise  # nl.<op>(tile, ...): see opcodes.Op


# ------------------------------------------------------------------------------------------------ creation


class par_dim(int):  # noqa: N801 -- NKI's name
    """Marks the partition dimension in a shape: ``(nl.par_dim(128), 512)``. Only the first dimension may be it."""


def _plain_shape(shape) -> tuple[int, ...]:
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if any(isinstance(n, par_dim) for n in shape[1:]):
        raise NotImplementedError(f"shape {shape}: nl.par_dim after dim 0 (leading block dims) is not simulated; "
                                  "put the partition dim first")
    return tuple(int(n) for n in shape)


def ndarray(shape, dtype, buffer: Buffer = Buffer.SBUF, name: str | None = None, address=None) -> NkiTensor:
    """A new tensor, NaN-filled (4 for integers). ``shared_hbm`` tensors are the same tensor on both cores.
    ``address`` (a fixed ``(partition, byte)`` placement) is accepted and ignored: every tensor gets its own
    memory, and capacity is counted."""
    return current_core().allocate(_plain_shape(shape), np.dtype(dtype), buffer, name or None)


def zeros(shape, dtype, buffer: Buffer = Buffer.SBUF, name: str = "") -> NkiTensor:
    """A new tensor filled with zeros (a ``memset`` on chip)."""
    return full(shape, 0, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer: Buffer = Buffer.SBUF, name: str = "") -> NkiTensor:
    """A new tensor filled with ``fill_value`` (a ``memset`` on chip)."""
    t = ndarray(shape, dtype, buffer, name)
    if t.buffer.on_chip:
        isa.memset(t, fill_value)
    elif t.alloc.has_data:
        t.data[...] = fill_value
    return t


def ones(shape, dtype, buffer: Buffer = Buffer.SBUF, name: str = "") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def shared_identity_matrix(n: int, dtype=uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An ``(n, n)`` identity matrix in SBUF (a constant the compiler loads once)."""
    t = ndarray((n, n), dtype, Buffer.SBUF, "identity") if dst is None else dst
    if t.shape != (n, n):
        raise ValueError(f"shared_identity_matrix: dst must be ({n}, {n}), got {t.shape}")
    if t.alloc.has_data:
        t.data[...] = np.eye(n, dtype=np.float32).astype(t.dtype)
    return t


def shared_constant(constant) -> NkiTensor:
    """A shared-HBM tensor holding ``constant`` (a NumPy array, or the path of a ``.npy`` file): data the compiler
    embeds and loads at model load time, so no DMA is counted; both cores of an LNC2 launch share it."""
    values = np.load(constant) if isinstance(constant, (str, bytes)) or hasattr(constant, "__fspath__") \
        else np.asarray(constant)
    if values.dtype == np.float64:
        raise TypeError("shared_constant: float64 is not an NKI dtype; convert the constant (e.g. to float32) first")
    t = ndarray(values.shape if values.ndim else (1,), values.dtype, Buffer.SHARED_HBM, "shared_constant")
    if t.alloc.has_data:
        t.data[...] = values.reshape(t.shape)
    return t


def zeros_like(x: NkiTensor, dtype=None, buffer=None, name: str = "") -> NkiTensor:
    """A new tensor of zeros with ``x``'s shape (``dtype`` / ``buffer`` default to ``x``'s and SBUF)."""
    return zeros(x.shape, dtype or x.dtype, buffer=buffer or Buffer.SBUF, name=name)


def empty_like(x: NkiTensor, dtype=None, buffer=None, name: str = "") -> NkiTensor:
    """A new (uninitialised: NaN-filled) tensor with ``x``'s shape, dtype and buffer unless given."""
    return ndarray(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def rand(shape, dtype, buffer=Buffer.SBUF, name: str = "") -> NkiTensor:
    """A new tile of uniform values in ``[0, 1)`` from the Vector Engine's generator (``random_seed`` seeds it)."""
    bits = _new(shape, uint32, Buffer.SBUF)
    isa.rng(dst=bits)
    out = ndarray(shape, dtype, buffer=buffer, name=name)
    on_chip = out if out.buffer.on_chip else _new(shape, dtype)
    isa.tensor_scalar(dst=on_chip, data=bits, op0=multiply, operand0=2.0 ** -32)
    if on_chip is not out:
        isa.dma_copy(dst=out, src=on_chip)
    return out


def random_seed(seed: NkiTensor) -> None:
    """Seed ``rand`` / ``dropout``: a ``(1, 1)`` 32-bit tile in SBUF or PSUM."""
    isa.set_rng_seed(seed)


def dropout(x: NkiTensor, rate, dtype=None) -> NkiTensor:
    """``x`` with each element zeroed with probability ``rate`` (a number or a ``(P, 1)`` tile)."""
    out = _new(x.shape, x.dtype)
    isa.dropout(dst=out, data=x, prob=rate)
    return out if dtype is None or np.dtype(dtype) == x.dtype else _converted(out, dtype)


def _converted(x: NkiTensor, dtype) -> NkiTensor:
    out = _new(x.shape, dtype)
    isa.tensor_copy(dst=out, src=x)
    return out


# ------------------------------------------------------------------------------------------------ loads and stores


def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """A new SBUF tile holding ``src`` (one ``dma_copy``, converting to ``dtype`` if given)."""
    t = ndarray(src.shape, src.dtype if dtype is None else dtype, Buffer.SBUF)
    isa.dma_copy(t, src)
    return t


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """Write an SBUF tile to device memory (one ``dma_copy``)."""
    isa.dma_copy(dst, value)


def load_transpose2d(src: NkiTensor, dtype=None) -> NkiTensor:
    """A 2-D HBM tensor loaded into a new SBUF tile transposed (``dma_transpose``)."""
    if src.ndim != 2:
        raise HardwareLimitError(f"nl.load_transpose2d: src must be 2-D, got {src.shape}")
    out = _new((src.shape[1], src.shape[0]), src.dtype)
    isa.dma_transpose(dst=out, src=src)
    return out if dtype is None or np.dtype(dtype) == src.dtype else _converted(out, dtype)


# ------------------------------------------------------------------------------------------------ reductions


def _axes(x: NkiTensor, axis, label: str) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(a % x.ndim for a in axes))
    if not axes or axes != tuple(range(axes[0], x.ndim)) or axes[0] < 1:
        raise HardwareLimitError(f"nl.{label}: axis {axis} must be the last free dims of the tile {x.shape} "
                                 "([1], [1, 2], ...); the partition dim (0) cannot be reduced here")
    return axes


def _reduce(x: NkiTensor, axis, op, dtype, keepdims: bool, label: str) -> NkiTensor:
    axes = _axes(x, axis, label)
    kept = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    out = _new(kept if keepdims else tuple(n for d, n in enumerate(x.shape) if d not in axes) or (x.partitions,),
               dtype or x.dtype)
    isa.tensor_reduce(dst=out, op=op, data=x, axis=axes, keepdims=keepdims)
    return out


def sum(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:  # noqa: A001 -- NKI's name
    return _reduce(x, axis, add, dtype, keepdims, "sum")


def max(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:  # noqa: A001 -- NKI's name
    return _reduce(x, axis, maximum, dtype, keepdims, "max")


def min(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:  # noqa: A001 -- NKI's name
    return _reduce(x, axis, minimum, dtype, keepdims, "min")


def prod(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:
    return _reduce(x, axis, multiply, dtype, keepdims, "prod")


def _count(x: NkiTensor, axis, label: str) -> int:
    return math.prod(x.shape[a] for a in _axes(x, axis, label))


def mean(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:
    """The sum in fp32, times ``1 / n``."""
    total = _reduce(x, axis, add, float32, keepdims, "mean")
    out = _new(total.shape, dtype or x.dtype)
    isa.tensor_scalar(dst=out, data=total, op0=multiply, operand0=1.0 / _count(x, axis, "mean"))
    return out


def var(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:
    """``mean(x**2) - mean(x)**2`` in fp32; the result keeps the reduced dims (``keepdims`` is ignored, as NKI
    documents)."""
    n = _count(x, axis, "var")
    squares = _new(x.shape, float32)
    isa.activation(dst=squares, op=square, data=x)
    sum_sq = _reduce(squares, axis, add, float32, True, "var")
    total = _reduce(x, axis, add, float32, True, "var")
    mean_sq = _new(total.shape, float32)
    isa.tensor_tensor(dst=mean_sq, data1=total, data2=total, op=multiply)  # sum(x)**2
    out = _new(total.shape, dtype or x.dtype)
    # (sum(x**2) - sum(x)**2 / n) / n
    isa.scalar_tensor_tensor(dst=mean_sq, data=mean_sq, op0=multiply, operand0=-1.0 / n, op1=add,
                             operand1=sum_sq)
    isa.tensor_scalar(dst=out, data=mean_sq, op0=multiply, operand0=1.0 / n)
    return out


def all(x: NkiTensor, axis, dtype=None) -> NkiTensor:  # noqa: A001 -- NKI's name
    """1 where every element along ``axis`` is nonzero, else 0 (keeps the reduced dims)."""
    nonzero = _new(x.shape, float32)
    isa.tensor_scalar(dst=nonzero, data=x, op0=not_equal, operand0=0.0)
    return _reduce(nonzero, axis, minimum, dtype or x.dtype, True, "all")


def softmax(x: NkiTensor, axis=-1, dtype=None) -> NkiTensor:
    """``exp(x - max) / sum(exp(x - max))`` along the free ``axis`` (all free dims here: a ``(P, 1)`` statistic)."""
    axes = _axes(x, axis, "softmax")
    if axes != tuple(range(1, x.ndim)):
        raise HardwareLimitError(f"nl.softmax: axis {axis} must cover every free dim of {x.shape} here")
    peak = _reduce(x, axes, maximum, float32, True, "softmax").reshape((x.partitions, 1))
    neg_peak = _new((x.partitions, 1), float32)
    isa.tensor_scalar(dst=neg_peak, data=peak, op0=multiply, operand0=-1.0)
    e = _new(x.shape, float32)
    total = _new((x.partitions, 1), float32)
    isa.activation(dst=e, op=exp, data=x, bias=neg_peak, reduce_op=add, reduce_res=total)
    inv = _new((x.partitions, 1), float32)
    isa.reciprocal(dst=inv, data=total)
    out = _new(x.shape, dtype or x.dtype)
    isa.tensor_scalar(dst=out, data=e, op0=multiply, operand0=inv)
    return out


def rms_norm(x: NkiTensor, w: NkiTensor, axis, n: int, epsilon: float = 1e-6, dtype=None,
             compute_dtype=None) -> NkiTensor:
    """``x / sqrt(sum(x**2) / n + epsilon) * w`` along the free ``axis`` (all free dims here)."""
    axes = _axes(x, axis, "rms_norm")
    if axes != tuple(range(1, x.ndim)):
        raise HardwareLimitError(f"nl.rms_norm: axis {axis} must cover every free dim of {x.shape} here")
    squares = _new(x.shape, compute_dtype or float32)
    sum_sq = _new((x.partitions, 1), float32)
    isa.activation(dst=squares, op=square, data=x, reduce_op=add, reduce_res=sum_sq)
    inv_rms = _new((x.partitions, 1), float32)
    isa.tensor_scalar(dst=inv_rms, data=sum_sq, op0=multiply, operand0=1.0 / n, op1=add, operand1=epsilon)
    isa.activation(dst=inv_rms, op=rsqrt, data=inv_rms)
    out = _new(x.shape, dtype or x.dtype)
    isa.scalar_tensor_tensor(dst=out, data=x, op0=multiply, operand0=inv_rms, op1=multiply, operand1=w)
    return out


# ------------------------------------------------------------------------------------------------ selection, layout


def where(condition: NkiTensor, x, y, dtype=None) -> NkiTensor:
    """``x`` where ``condition`` is nonzero, else ``y`` (tiles of one shape, or numbers)."""
    shape_of = next(t for t in (condition, x, y) if isinstance(t, NkiTensor))
    out = _new(shape_of.shape, dtype or next((t.dtype for t in (x, y) if isinstance(t, NkiTensor)), shape_of.dtype))
    _select(out, condition, x, y)
    return out


@instruction
def _select(dst, condition, x, y) -> None:
    label = "nl.where"
    dst, condition = tile_operand(dst, "dst", label), tile_operand(condition, "condition", label)
    operands = [tile_operand(v, role, label) if isinstance(v, NkiTensor) else v for v, role in ((x, "x"), (y, "y"))]
    for v, role in zip(operands, ("x", "y")):
        if isinstance(v, NkiTensor) and (v.partitions, v.free_size) != (condition.partitions, condition.free_size):
            raise HardwareLimitError(f"{label}: {role} shape {v.shape} must match condition {condition.shape}")
    if computes(dst, condition, *operands):
        store_result(dst, np.where(as_f32(condition) != 0, as_f32(operands[0]), as_f32(operands[1])))
    account("vector", label, condition, dst)


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    """A view of ``x`` with a new size-1 axis at ``axis`` (a free position)."""
    return x.expand_dim(axis % (x.ndim + 1))


def broadcast_to(x: NkiTensor, shape, dtype=None) -> NkiTensor:
    """``x`` broadcast to ``shape`` (same rank; each dim equal or from 1) in a new tile: free dims by a stride-0
    copy on the Vector Engine, the partition dim (1 -> P) by a Tensor Engine matmul with a row of ones."""
    shape = tuple(int(n) for n in shape)
    if len(shape) != x.ndim or any(n != m and m != 1 for n, m in zip(shape, x.shape)):
        raise ValueError(f"nl.broadcast_to: cannot broadcast {x.shape} to {shape} (same rank; dims equal or 1)")
    if shape == x.shape:
        return x if dtype is None or np.dtype(dtype) == x.dtype else _converted(x, dtype)
    view = x
    for d in range(1, x.ndim):
        if x.shape[d] != shape[d]:
            view = view.broadcast(d, shape[d])
    out = _new(shape, dtype or x.dtype)
    if x.shape[0] == shape[0]:
        isa.tensor_copy(dst=out, src=view)
        return out
    row = _new((1,) + shape[1:], x.dtype if x.dtype != float32 else float32)
    isa.tensor_copy(dst=row, src=view)
    ones_row = ones((1, shape[0]), row.dtype)
    free = math.prod(shape[1:])
    flat_row, flat_out = row.reshape((1, free)), out.reshape((shape[0], free))
    for start in range(0, free, GEMM_MOVING_FMAX):
        size = builtins.min(GEMM_MOVING_FMAX, free - start)
        ps = _new((shape[0], size), float32, Buffer.PSUM)
        isa.nc_matmul(dst=ps, stationary=ones_row, moving=flat_row[:, start:start + size])
        isa.tensor_copy(dst=flat_out[:, start:start + size], src=ps)
    return out


def transpose(x: NkiTensor, dtype=None) -> NkiTensor:
    """A 2-D tile with its partition and free dims swapped, in PSUM (the Tensor Engine's transpose)."""
    if x.ndim != 2:
        raise HardwareLimitError(f"nl.transpose: x must be 2-D, got {x.shape}")
    out = _new((x.shape[1], x.shape[0]), dtype or x.dtype, Buffer.PSUM)
    isa.nc_transpose(dst=out, data=x, engine=isa.engine.tensor)
    return out


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False) -> NkiTensor:
    """``x @ y`` (``x.T @ y`` with ``transpose_x``) into a new fp32 PSUM tile; without ``transpose_x`` the
    transpose of ``x`` is inserted (the Tensor Engine contracts over partitions)."""
    stationary = x
    if not transpose_x:
        xt = transpose(x, float32 if x.dtype == float32 else x.dtype)
        stationary = _new(xt.shape, x.dtype)
        isa.tensor_copy(dst=stationary, src=xt)
    out = _new((stationary.free_size, y.free_size), float32, Buffer.PSUM)
    isa.nc_matmul(dst=out, stationary=stationary, moving=y)
    return out


def gather_flattened(data: NkiTensor, indices: NkiTensor, axis: int = 0, dtype=None) -> NkiTensor:
    """Per partition, ``out[p, i] = data[p].flat[indices[p, i]]`` (GpSimd)."""
    out = _new(indices.shape, dtype or data.dtype)
    _gather(out, data, indices)
    return out


@instruction
def _gather(dst, data, indices) -> None:
    label = "nl.gather_flattened"
    dst, data, indices = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (data, "data"), (indices, "indices")))
    if not is_integer(indices.dtype):
        raise TypeError(f"{label}: indices must be an integer tile, got {indices.dtype}")
    if indices.partitions != data.partitions:
        raise HardwareLimitError(f"{label}: indices {indices.shape} and data {data.shape} need the same partitions")
    if computes(dst, data, indices):
        idx = indices.data.reshape(indices.partitions, -1).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= data.free_size):
            raise IndexError(f"{label}: an index is outside [0, {data.free_size}) elements per partition")
        values = data.data.reshape(data.partitions, data.free_size)
        store_result(dst, np.take_along_axis(values, idx, axis=1).reshape(dst.shape))
    account("gpsimd", label, indices, dst)


@contextmanager
def no_reorder():
    """``with nl.no_reorder():`` keeps program order. The simulator executes in program order anyway; its memory
    model (``liveness``) may still consider other schedules when checking capacity."""
    yield
