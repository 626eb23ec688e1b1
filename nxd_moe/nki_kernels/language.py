"""``nl``: the ``nki.language`` namespace, with NKI's names, so ``from nxd_moe.nki_kernels import language as nl``
reads like a kernel written for the real compiler, and :mod:`nxd_moe.nki_kernels.compat` serves this module as
``nki.language`` itself.

It gathers the dtypes (:mod:`~nxd_moe.nki_kernels.dtypes`), the ALU and activation opcodes
(:mod:`~nxd_moe.nki_kernels.opcodes`) and the tile functions -- ``ndarray`` and the other constructors, loads and
stores, ``nl.sum``, ``nl.softmax``, ... (:mod:`~nxd_moe.nki_kernels.tiles`) -- and defines what is the language's
own: buffers, tile sizes, ``NKIObject``, ``ds``, program ids, loop ranges, ``device_print``.

Loops: ``affine_range`` / ``sequential_range`` / ``static_range`` are compile-time loops (Python ranges, as in NKI
now); ``dynamic_range(start, stop)`` is a hardware loop whose bounds may be registers read on the device. Every
iteration of any of them frees the on-chip tensors it allocated, so tensors that must outlive an iteration are
allocated before the loop -- NKI's rule too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from nxd_moe.nki_kernels.dtypes import (  # noqa: F401 -- re-exports: NKI's dtypes
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from nxd_moe.nki_kernels.hardware import (
    BN_STATS_FMAX,
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    PSUM_BANK_BYTES,
    PSUM_FMAX,
    PSUM_NUM_BANKS,
    SBUF_PARTITION_BYTES,
    Buffer,
)
from nxd_moe.nki_kernels.machine import check_alive, current_core
from nxd_moe.nki_kernels.opcodes import (  # noqa: F401 -- re-exports: NKI's opcodes
    ACTIVATION_FUNCTIONS,
    ALU_OPS,
    INTEGER_ALU_OPS,
    UNARY_ALU_OPS,
    Op,
    abs,
    abs_max,
    abs_min,
    add,
    arctan,
    average,
    bitwise_and,
    bitwise_or,
    bitwise_xor,
    bypass,
    ceil,
    copy,
    cos,
    divide,
    equal,
    erf,
    erf_dx,
    exp,
    floor,
    fmod,
    gelu,
    gelu_apprx_sigmoid,
    gelu_apprx_sigmoid_dx,
    gelu_apprx_tanh,
    gelu_dx,
    greater,
    greater_equal,
    invert,
    leaky_relu,
    left_shift,
    less,
    less_equal,
    log,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    maximum,
    minimum,
    mish,
    mod,
    multiply,
    negative,
    not_equal,
    power,
    prelu,
    reciprocal,
    relu,
    right_shift,
    rsqrt,
    sigmoid,
    sign,
    silu,
    silu_dx,
    sin,
    softplus,
    sqrt,
    square,
    subtract,
    tan,
    tanh,
    trunc,
)
from nxd_moe.nki_kernels.tensor import DynSlice, NkiTensor
from nxd_moe.nki_kernels.tiles import (  # noqa: F401 -- re-exports: NKI's tile functions
    all,
    broadcast_to,
    dropout,
    empty_like,
    expand_dims,
    full,
    gather_flattened,
    load,
    load_transpose2d,
    matmul,
    max,
    mean,
    min,
    ndarray,
    no_reorder,
    ones,
    par_dim,
    prod,
    rand,
    random_seed,
    rms_norm,
    shared_constant,
    shared_identity_matrix,
    softmax,
    store,
    sum,
    transpose,
    var,
    where,
    zeros,
    zeros_like,
)
from nxd_moe.nki_kernels.virtual_register import VirtualRegister

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
    bn_stats_fmax = BN_STATS_FMAX
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


def ds(start, size) -> DynSlice:
    """``size`` elements from ``start``: ``t[nl.ds(i * 128, 128)]`` is ``t[i * 128:(i + 1) * 128]``."""
    return DynSlice(start, size)


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
