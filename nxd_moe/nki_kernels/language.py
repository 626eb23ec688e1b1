"""``nl``: the ``nki.language`` subset the kernels use -- dtypes, buffers, ``ndarray``, program ids, loop ranges and
the math / activation opcodes -- with NKI's names, so ``from nxd_moe.nki_kernels import language as nl`` reads like
a kernel written for the real compiler.

Loops: ``affine_range`` / ``sequential_range`` / ``static_range`` are compile-time loops (Python ranges, as in NKI
now); ``dynamic_range(start, stop)`` is a hardware loop whose bounds may be registers read on the device. Every
iteration of any of them frees the on-chip tensors it allocated, so tensors that must outlive an iteration are
allocated before the loop -- NKI's rule too.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import ml_dtypes
import numpy as np
import torch

from nxd_moe.nki_kernels.machine import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    PSUM_FMAX,
    Buffer,
    NkiTensor,
    VirtualRegister,
    current_core,
)

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)  # OCP E4M3 (+-448): what FP8 checkpoints store
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)

sbuf = Buffer.SBUF
psum = Buffer.PSUM
shared_hbm = Buffer.SHARED_HBM
private_hbm = Buffer.PRIVATE_HBM
hbm = Buffer.SHARED_HBM


class tile_size:  # noqa: N801 -- NKI's name
    pmax = PMAX
    psum_fmax = PSUM_FMAX
    gemm_stationary_fmax = GEMM_STATIONARY_FMAX
    gemm_moving_fmax = GEMM_MOVING_FMAX


def ndarray(shape, dtype, buffer: Buffer = sbuf, name: str | None = None) -> NkiTensor:
    """A new tensor, NaN-filled (4 for integers). ``shared_hbm`` tensors are the same tensor on both cores."""
    return current_core().allocate(shape, dtype, buffer, name)


def program_id(axis: int = 0) -> int:
    _check_axis(axis)
    return current_core().program_id


def num_programs(axis: int = 0) -> int:
    _check_axis(axis)
    return current_core().num_programs


def _check_axis(axis: int) -> None:
    if axis != 0:
        raise ValueError(f"only launch axis 0 exists (the LNC cores), got axis={axis}")


def _scoped(values) -> Iterator:
    core = current_core()
    for value in values:
        with core.scope():
            yield value


def affine_range(start: int, stop: int | None = None, step: int = 1) -> Iterator[int]:
    return _scoped(range(start, stop, step) if stop is not None else range(start))


sequential_range = affine_range
static_range = affine_range


def dynamic_range(start, stop=None, step: int = 1) -> Iterator[VirtualRegister]:
    """A hardware loop: bounds are ints or registers, read once when the loop starts; ``step`` is a compile-time
    int. The induction variable is a register (usable as a ``scalar_offset``)."""
    if stop is None:
        start, stop = 0, start
    if not isinstance(step, int) or isinstance(step, bool) or step == 0:
        raise TypeError(f"dynamic_range step must be a non-zero compile-time int, got {step!r}")
    core = current_core()
    first, last = (b.value if isinstance(b, VirtualRegister) else int(b) for b in (start, stop))
    for i in range(first, last, step):
        core.accounting.dynamic_iterations += 1
        core.accounting.branches += 1
        with core.scope():
            yield VirtualRegister(core, i)
    core.accounting.branches += 1


class Op:
    """An ALU opcode or activation function: a name and its fp32 NumPy semantics."""

    def __init__(self, name: str, fn: Callable[..., np.ndarray]):
        self.name = name
        self.fn = fn

    def __call__(self, *args) -> np.ndarray:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


add = Op("add", np.add)
subtract = Op("subtract", np.subtract)
multiply = Op("multiply", np.multiply)
maximum = Op("maximum", np.maximum)
minimum = Op("minimum", np.minimum)
equal = Op("equal", lambda a, b: (a == b).astype(np.float32))
not_equal = Op("not_equal", lambda a, b: (a != b).astype(np.float32))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (0.5 * (1.0 + np.tanh(0.5 * x))).astype(np.float32)


def _gelu(x: np.ndarray) -> np.ndarray:
    erf = torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32) / math.sqrt(2.0))).numpy()
    return (0.5 * x * (1.0 + erf)).astype(np.float32)


copy = Op("copy", lambda x: x)
silu = Op("silu", lambda x: x * _sigmoid(x))
gelu = Op("gelu", _gelu)
relu = Op("relu", lambda x: np.maximum(x, np.float32(0.0)))
sigmoid = Op("sigmoid", _sigmoid)
tanh = Op("tanh", np.tanh)
leaky_relu = Op("leaky_relu", lambda x: np.where(x >= 0, x, np.float32(0.01) * x))

ACTIVATION_FUNCTIONS = {op.name: op for op in (copy, silu, gelu, relu, sigmoid, tanh, leaky_relu)}
ALU_OPS = {op.name: op for op in (add, subtract, multiply, maximum, minimum, equal, not_equal)}
