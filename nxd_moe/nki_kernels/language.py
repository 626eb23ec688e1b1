"""``nl``: ``nki.language`` -- dtypes, buffers, ``ndarray``, ``ds`` / ``par_dim``, program ids, loop ranges, tile
sizes, ``NKIObject``, ``shared_identity_matrix`` and the ALU / activation opcodes -- with NKI's names, so ``from
nxd_moe.nki_kernels import language as nl`` reads like a kernel written for the real compiler, and
:mod:`nxd_moe.nki_kernels.compat` serves this module as ``nki.language`` itself.

Loops: ``affine_range`` / ``sequential_range`` / ``static_range`` are compile-time loops (Python ranges, as in NKI
now); ``dynamic_range(start, stop)`` is a hardware loop whose bounds may be registers read on the device. Every
iteration of any of them frees the on-chip tensors it allocated, so tensors that must outlive an iteration are
allocated before the loop -- NKI's rule too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from nxd_moe.nki_kernels.machine import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    PSUM_FMAX,
    PSUM_BANK_BYTES,
    PSUM_NUM_BANKS,
    SBUF_PARTITION_BYTES,
    Buffer,
    DynSlice,
    NkiTensor,
    VirtualRegister,
    check_alive,
    current_core,
)

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)  # OCP E4M3 (+-448): what FP8 checkpoints store
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)
tfloat32 = float32  # fp32 storage; the Tensor Engine's tf32 rounding is not modelled
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)


def _packed(name: str) -> np.dtype:
    """A Trn3 (NeuronCore-v4) MX dtype packing four values into 4 bytes: storage only (bytes), no arithmetic."""
    return np.dtype([(name, np.uint8, (4,))])


float8_e4m3fn_x4 = _packed("float8_e4m3fn_x4")
float8_e5m2_x4 = _packed("float8_e5m2_x4")
float4_e2m1fn_x4 = _packed("float4_e2m1fn_x4")
globals()["bool"] = bool_  # NKI's name (nki-library's resolve_dtype_to_nki returns nl.bool); not shadowing here

DType = np.dtype  # what the dtype names above are (NKI annotates dtype parameters with nl.DType)
MemoryRegion = Buffer  # the buffers below (NKI's enum of memory regions)
sbuf = Buffer.SBUF
psum = Buffer.PSUM
shared_hbm = Buffer.SHARED_HBM
private_hbm = Buffer.PRIVATE_HBM
hbm = Buffer.SHARED_HBM


class tile_size:  # noqa: N801 -- NKI's name
    pmax = PMAX
    psum_fmax = PSUM_FMAX
    psum_bank_fmax = PSUM_FMAX
    psum_bank_fmax_bytes = PSUM_BANK_BYTES
    psum_num_banks = PSUM_NUM_BANKS
    gemm_stationary_fmax = GEMM_STATIONARY_FMAX
    gemm_moving_fmax = GEMM_MOVING_FMAX
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 4
    sbuf_size_bytes = PMAX * SBUF_PARTITION_BYTES
    sbuf_fmax_bytes = SBUF_PARTITION_BYTES
    sbuf_fmax = SBUF_PARTITION_BYTES // 4
    total_available_sbuf_size = SBUF_PARTITION_BYTES  # deprecated NKI name: bytes per partition


class NKIObject:
    """Base class of NKI kernel dataclasses and configuration objects (plain Python objects here).

    Every subclass gets this keyword-friendly ``__init__`` (``@dataclass`` keeps an ``__init__`` the class already
    has): positional arguments fill the dataclass fields in order; keywords may name any field or any other
    attribute (the plain class attributes of an unannotated ``@dataclass``); a field given neither takes its default
    (or ``default_factory()``), else ``None``. nki-library relies on all three: ``SectionParams(section_idx=...)`` is
    a ``@dataclass`` whose attributes are unannotated, and ``MLPTKGConstantsDimensionSizes(...)`` omits
    ``remainderIFused`` -- both of which its own CPU simulator accepts. A subclass defining ``__init__`` itself keeps
    it; ``__post_init__`` runs as in a dataclass.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            cls.__init__ = NKIObject.__init__

    def __init__(self, *args, **kwargs) -> None:
        cls = type(self)
        fields = [f for f in getattr(cls, "__dataclass_fields__", {}).values()
                  if f._field_type is dataclasses._FIELD]  # not ClassVar / InitVar pseudo-fields
        if len(args) > len(fields):
            raise TypeError(f"{cls.__name__}() takes {len(fields)} positional arguments but {len(args)} were given")
        for f, value in zip(fields, args):
            if f.name in kwargs:
                raise TypeError(f"{cls.__name__}() got multiple values for argument '{f.name}'")
            kwargs[f.name] = value
        for f in fields:
            if f.name not in kwargs:
                if f.default is not dataclasses.MISSING:
                    kwargs[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    kwargs[f.name] = f.default_factory()
                else:
                    kwargs[f.name] = None
        for key, value in kwargs.items():
            object.__setattr__(self, key, value)  # frozen dataclasses too
        if hasattr(self, "__post_init__"):
            self.__post_init__()


tensor = NkiTensor


class par_dim(int):  # noqa: N801 -- NKI's name
    """Marks the partition dimension in a shape: ``(nl.par_dim(128), 512)``. Only the first dimension may be it."""


def ds(start, size) -> DynSlice:
    """``size`` elements from ``start``: ``t[nl.ds(i * 128, 128)]`` is ``t[i * 128:(i + 1) * 128]``."""
    return DynSlice(start, size)


def _plain_shape(shape) -> tuple[int, ...]:
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if any(isinstance(n, par_dim) for n in shape[1:]):
        raise NotImplementedError(f"shape {shape}: nl.par_dim after dim 0 (leading block dims) is not simulated; "
                                  "put the partition dim first")
    return tuple(int(n) for n in shape)


def ndarray(shape, dtype, buffer: Buffer = sbuf, name: str | None = None, address=None) -> NkiTensor:
    """A new tensor, NaN-filled (4 for integers). ``shared_hbm`` tensors are the same tensor on both cores.
    ``address`` (a fixed ``(partition, byte)`` placement) is accepted and ignored: every tensor gets its own
    memory, and capacity is counted."""
    return current_core().allocate(_plain_shape(shape), np.dtype(dtype), buffer, name or None)


def zeros(shape, dtype, buffer: Buffer = sbuf, name: str = "") -> NkiTensor:
    """A new tensor filled with zeros (a ``memset`` on chip)."""
    return full(shape, 0, dtype, buffer, name)


def shared_identity_matrix(n: int, dtype=uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An ``(n, n)`` identity matrix in SBUF (a constant the compiler loads once)."""
    t = ndarray((n, n), dtype, sbuf, "identity") if dst is None else dst
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
    t = ndarray(values.shape if values.ndim else (1,), values.dtype, shared_hbm, "shared_constant")
    if t.alloc.has_data:
        t.data[...] = values.reshape(t.shape)
    return t


def full(shape, fill_value, dtype, buffer: Buffer = sbuf, name: str = "") -> NkiTensor:
    """A new tensor filled with ``fill_value`` (a ``memset`` on chip)."""
    from nxd_moe.nki_kernels import isa

    t = ndarray(shape, dtype, buffer, name)
    if t.buffer.on_chip:
        isa.memset(t, fill_value)
    elif t.alloc.has_data:
        t.data[...] = fill_value
    return t


def ones(shape, dtype, buffer: Buffer = sbuf, name: str = "") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """A new SBUF tile holding ``src`` (one ``dma_copy``, converting to ``dtype`` if given)."""
    from nxd_moe.nki_kernels import isa

    t = ndarray(src.shape, src.dtype if dtype is None else dtype, sbuf)
    isa.dma_copy(t, src)
    return t


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """Write an SBUF tile to device memory (one ``dma_copy``)."""
    from nxd_moe.nki_kernels import isa

    isa.dma_copy(dst, value)


def program_id(axis: int = 0) -> int:
    _check_axis(axis)
    return current_core().program_id


def num_programs(axes: int = 0, axis: int | None = None) -> int:
    _check_axis(axes if axis is None else axis)
    return current_core().num_programs


def program_ndim() -> int:
    """Dimensions of the launch grid: 1 for ``kernel[n](...)``, 0 for a plain ``kernel(...)`` call."""
    return current_core().launch.grid_ndim


def device_print(print_prefix: str, tensor: NkiTensor) -> None:
    """Print a tensor's values from inside the kernel (simulation only, as in NKI)."""
    check_alive(tensor)  # a read: pending PSUM accumulation is stored first
    print(print_prefix, tensor.data)


def is_hbm(buffer) -> bool:
    return not Buffer(buffer).on_chip


def is_sbuf(buffer) -> bool:
    return Buffer(buffer) is Buffer.SBUF


def is_psum(buffer) -> bool:
    return Buffer(buffer) is Buffer.PSUM


def is_on_chip(buffer) -> bool:
    return Buffer(buffer).on_chip


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


def fori_loop(lower, upper, body_fun: Callable[[VirtualRegister], None], step: int = 1) -> None:
    """``body_fun(i)`` for ``i`` in ``[lower, upper)`` by ``step``: a hardware loop whose bounds may be registers
    (``dynamic_range``), ``i`` a register passed by value."""
    for i in dynamic_range(lower, upper, step):
        body_fun(i)


def while_loop(init: VirtualRegister, body_fun: Callable[[VirtualRegister], VirtualRegister]) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` -- a hardware loop on a register condition, checked before each
    iteration; the body gets the condition by value and returns the next condition register."""
    if not isinstance(init, VirtualRegister):
        raise TypeError(f"while_loop: init must be a VirtualRegister (nisa.register_alloc), got {type(init).__name__}")
    core = current_core()
    condition = init
    while True:
        core.accounting.branches += 1
        if condition.value == 0:
            return
        core.accounting.dynamic_iterations += 1
        if core.trace is not None:  # a hardware loop iteration: nothing is scheduled across its boundary
            core.trace.begin(fence=True)
        with core.scope():
            condition = body_fun(VirtualRegister(core, condition.value))
        if not isinstance(condition, VirtualRegister):
            raise TypeError(f"while_loop: body_fun must return the next condition register, got "
                            f"{type(condition).__name__}")


def dynamic_range(start, stop=None, step: int = 1) -> Iterator[VirtualRegister]:
    """A hardware loop: bounds are ints or registers, read once when the loop starts; ``step`` is a compile-time
    int. The induction variable is a register (usable as a ``scalar_offset``)."""
    if stop is None:
        start, stop = 0, start
    if type(step) is not int or step == 0:  # a plain int: this module's ``bool`` is NKI's dtype
        raise TypeError(f"dynamic_range step must be a non-zero compile-time int, got {step!r}")
    core = current_core()
    first, last = (b.value if isinstance(b, VirtualRegister) else int(b) for b in (start, stop))
    for i in range(first, last, step):
        core.accounting.dynamic_iterations += 1
        core.accounting.branches += 1
        if core.trace is not None:  # a hardware loop iteration: nothing is scheduled across its boundary
            core.trace.begin(fence=True)
        with core.scope():
            yield VirtualRegister(core, i)
    core.accounting.branches += 1


class Op:
    """An ALU opcode or activation function: a name and its fp32 NumPy semantics."""

    def __init__(self, name: str, fn: Callable[..., np.ndarray]):
        self.name = name
        self.fn = fn

    def __call__(self, *args, dtype=None):
        """On NumPy values: the fp32 semantics the instructions use. On tiles: NKI's ``nl.<op>(x[, y], dtype=None)``,
        a new tile (see :mod:`nxd_moe.nki_kernels.tiles`)."""
        if any(isinstance(a, NkiTensor) for a in args):
            from nxd_moe.nki_kernels import tiles

            return tiles.elementwise(self, args, dtype)
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

# NKI's tile-level functions (nl.sum, nl.softmax, nl.matmul, ...) are built on nisa (tiles.py), which imports this
# module: they are looked up on first use, so that importing any of language / isa / tiles first works.
TILE_FUNCTIONS = ("all", "broadcast_to", "dropout", "empty_like", "expand_dims", "gather_flattened", "load_transpose2d",
                  "matmul", "max", "mean", "min", "no_reorder", "prod", "rand", "random_seed", "rms_norm", "softmax",
                  "sum", "transpose", "var", "where", "zeros_like")


def __getattr__(name: str):  # noqa: N807 -- a module's __getattr__
    if name in TILE_FUNCTIONS:
        from nxd_moe.nki_kernels import tiles

        return getattr(tiles, name)
    raise AttributeError(f"module 'nki.language' has no attribute {name!r}")


def __dir__() -> list[str]:  # noqa: N807
    return sorted(list(globals()) + list(TILE_FUNCTIONS))
