"""The ALU opcodes and activation functions (``nl.add``, ``nl.exp``, ...): each an :class:`Op`, a name and its fp32
NumPy semantics, which the instructions take as arguments (``op=nl.add``) and apply to their operands.

NKI's ``nl.add(x, y)`` is the same object called on tiles: a new tile built from instructions. That lowering lives in
:mod:`~nxd_moe.nki_kernels.tiles`, above the instructions that take ops, and installs itself here as
:attr:`Op.on_tiles` when imported (importing :mod:`~nxd_moe.nki_kernels.language` always imports it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from nxd_moe.nki_kernels.tensor import NkiTensor


def _tile_functions_missing(op: "Op", args: tuple, dtype) -> NkiTensor:
    raise RuntimeError(f"nl.{op.name} on tiles is built by nxd_moe.nki_kernels.tiles, which is not imported; import "
                       "nxd_moe.nki_kernels.language (nl)")


class Op:
    """An ALU opcode or activation function: a name and its fp32 NumPy semantics."""

    # ``op(tiles..., dtype=)`` -> a new tile: tiles.elementwise, set when that module is imported.
    on_tiles: Callable[["Op", tuple, Any], NkiTensor] = _tile_functions_missing

    def __init__(self, name: str, fn: Callable[..., np.ndarray]):
        self.name = name
        self.fn = fn

    def __call__(self, *args, dtype=None):
        """On NumPy values: the fp32 semantics the instructions use. On tiles: NKI's ``nl.<op>(x[, y], dtype=None)``,
        a new tile (see :mod:`nxd_moe.nki_kernels.tiles`)."""
        if any(isinstance(a, NkiTensor) for a in args):
            return Op.on_tiles(self, args, dtype)
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


_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf by the C library, element by element (NumPy has none). Not torch's: its result for the same input varied
    with the state of torch's thread pool after LNC2 launches had called it from two threads, which made
    fp32 gelu kernels differ from run to run by ~3e-5."""
    return _ERF(np.asarray(x, dtype=np.float64)).astype(np.float32)


def _gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + _erf(np.asarray(x, dtype=np.float32) / np.float32(math.sqrt(2.0))))).astype(np.float32)


divide = Op("divide", np.divide)
power = Op("power", np.power)
less = Op("less", lambda a, b: (a < b).astype(np.float32))
less_equal = Op("less_equal", lambda a, b: (a <= b).astype(np.float32))
greater = Op("greater", lambda a, b: (a > b).astype(np.float32))
greater_equal = Op("greater_equal", lambda a, b: (a >= b).astype(np.float32))
abs_max = Op("abs_max", lambda a, b: np.maximum(np.abs(a), np.abs(b)))
abs_min = Op("abs_min", lambda a, b: np.minimum(np.abs(a), np.abs(b)))
logical_and = Op("logical_and", lambda a, b: np.logical_and(a, b).astype(np.float32))
logical_or = Op("logical_or", lambda a, b: np.logical_or(a, b).astype(np.float32))
logical_xor = Op("logical_xor", lambda a, b: np.logical_xor(a, b).astype(np.float32))
bitwise_and = Op("bitwise_and", np.bitwise_and)
bitwise_or = Op("bitwise_or", np.bitwise_or)
bitwise_xor = Op("bitwise_xor", np.bitwise_xor)
left_shift = Op("left_shift", np.left_shift)
right_shift = Op("right_shift", np.right_shift)
mod = Op("mod", np.mod)
fmod = Op("fmod", np.fmod)
average = Op("average", lambda *xs: np.mean(np.stack(xs), axis=0))  # a reduction op (tensor_partition_reduce)
invert = Op("invert", np.invert)  # bitwise not (a unary bitvec ALU op)
bypass = Op("bypass", lambda x, *unused: x)  # passes its data through: skips an instruction's op0 / op1 stage

copy = Op("copy", lambda x: x)
silu = Op("silu", lambda x: x * _sigmoid(x))
gelu = Op("gelu", _gelu)
relu = Op("relu", lambda x: np.maximum(x, np.float32(0.0)))
sigmoid = Op("sigmoid", _sigmoid)
tanh = Op("tanh", np.tanh)
leaky_relu = Op("leaky_relu", lambda x: np.where(x >= 0, x, np.float32(0.01) * x))
# gelu approximations as documented: x * sigmoid(1.702 x), and the tanh form
gelu_apprx_sigmoid = Op("gelu_apprx_sigmoid", lambda x: x * _sigmoid(np.float32(1.702) * x))
gelu_apprx_tanh = Op("gelu_apprx_tanh", lambda x: (0.5 * x * (1.0 + np.tanh(
    np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)))).astype(np.float32))
exp = Op("exp", np.exp)
log = Op("log", np.log)
sqrt = Op("sqrt", np.sqrt)
rsqrt = Op("rsqrt", lambda x: (1.0 / np.sqrt(x)).astype(np.float32))
reciprocal = Op("reciprocal", lambda x: (1.0 / x).astype(np.float32))
square = Op("square", np.square)
abs = Op("abs", np.abs)  # noqa: A001 -- NKI's name
negative = Op("negative", np.negative)
sign = Op("sign", np.sign)
softplus = Op("softplus", lambda x: np.logaddexp(np.float32(0.0), x).astype(np.float32))
mish = Op("mish", lambda x: (x * np.tanh(np.logaddexp(np.float32(0.0), x))).astype(np.float32))
sin = Op("sin", np.sin)
cos = Op("cos", np.cos)
erf = Op("erf", _erf)
arctan = Op("arctan", np.arctan)
tan = Op("tan", np.tan)
ceil = Op("ceil", np.ceil)
floor = Op("floor", np.floor)
trunc = Op("trunc", np.trunc)
logical_not = Op("logical_not", lambda x: np.logical_not(x).astype(np.float32))
# PReLU's negative slope is the instruction's relu_param (NeuronCore-v4's activate2); nisa.activation has none,
# so there its slope is 0.
prelu = Op("prelu", lambda x, alpha=0.0: np.where(x >= 0, x, np.float32(alpha) * x).astype(np.float32))


def _phi(x):
    return (np.exp(-0.5 * x * x) / np.float32(math.sqrt(2.0 * math.pi))).astype(np.float32)


# Derivatives (the backward passes' activation functions)
gelu_dx = Op("gelu_dx", lambda x: (0.5 * (1.0 + _erf(x / np.float32(math.sqrt(2.0)))) + x * _phi(x)).astype(
    np.float32))
silu_dx = Op("silu_dx", lambda x: (_sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x)))).astype(np.float32))
gelu_apprx_sigmoid_dx = Op("gelu_apprx_sigmoid_dx", lambda x: (
    _sigmoid(np.float32(1.702) * x) * (1.0 + np.float32(1.702) * x * (1.0 - _sigmoid(np.float32(1.702) * x)))
).astype(np.float32))
erf_dx = Op("erf_dx", lambda x: (np.float32(2.0 / math.sqrt(math.pi)) * np.exp(-x * x)).astype(np.float32))

ACTIVATION_FUNCTIONS = {op.name: op for op in (
    copy, silu, gelu, relu, sigmoid, tanh, leaky_relu, gelu_apprx_sigmoid, gelu_apprx_tanh, exp, log, sqrt, rsqrt,
    reciprocal, square, abs, negative, sign, softplus, mish, sin, cos, erf, arctan, prelu, gelu_dx, silu_dx,
    gelu_apprx_sigmoid_dx, erf_dx)}
ALU_OPS = {op.name: op for op in (
    add, subtract, multiply, maximum, minimum, equal, not_equal, divide, power, less, less_equal, greater,
    greater_equal, abs_max, abs_min, logical_and, logical_or, logical_xor, bitwise_and, bitwise_or, bitwise_xor,
    left_shift, right_shift, mod, fmod, abs, square, relu, rsqrt, reciprocal, invert, bypass)}
INTEGER_ALU_OPS = ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "invert")
# Unary ALU ops (NKI's "Arithmetic Unary" and bitwise not, and bypass) act on the data alone: an instruction's
# scalar operand is ignored.
UNARY_ALU_OPS = ("abs", "square", "relu", "rsqrt", "reciprocal", "invert", "bypass")
