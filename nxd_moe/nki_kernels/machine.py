"""The Trn2 NeuronCore as the simulator sees it: memories with their capacities, the tensors that live in them,
and the limits every allocation and access checks.

A NeuronCore-v3 (Trn2) has 128 partitions of SBUF (224 KiB each) and of PSUM (8 banks of 2 KiB each); HBM is
shared by the two physical cores of a logical core. On-chip tensors have the partition dimension first. Fresh
memory is filled with NaN (floats) or 4 (integers), as in the NKI CPU simulator, so a read of memory nobody wrote
shows up in the result. Values are stored in their real dtype (``ml_dtypes`` bfloat16 / float8), so every store
rounds as the hardware does.

SBUF and PSUM allocations are freed when the loop iteration (or kernel) that made them ends -- see
:meth:`Core.scope` -- which is how the high-water marks and the capacity errors come about.

With ``numerics=False`` (a *counting* run) floating-point tensors hold no data: instructions check their limits and
are accounted, but no arithmetic is done. Integer tensors (token ids, expert ids, conditions, addresses) always
hold real values, because they decide which transfers are skipped and how often dynamic loops run.
"""

from __future__ import annotations

import enum
import functools
import math
import threading
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from nxd_moe.nki_kernels.accounting import Accounting

PMAX = 128  # nl.tile_size.pmax: partitions of SBUF/PSUM, and of any on-chip tile
SBUF_PARTITION_BYTES = 224 * 1024
PSUM_NUM_BANKS = 8
PSUM_BANK_BYTES = 2 * 1024
PSUM_FMAX = PSUM_BANK_BYTES // 4  # nl.tile_size.psum_fmax: fp32 elements of one bank, per partition
GEMM_STATIONARY_FMAX = 128  # nl.tile_size.gemm_stationary_fmax
GEMM_MOVING_FMAX = 512  # nl.tile_size.gemm_moving_fmax

UNINITIALISED_INT = 4  # what the NKI simulator writes into fresh integer memory


class HardwareLimitError(ValueError):
    """An allocation or instruction broke a Trn2 limit; the message names the limit."""


class OutOfBoundsError(HardwareLimitError):
    """A dynamic DMA address fell outside its tensor with ``oob_mode=error``."""


class Buffer(str, enum.Enum):
    SHARED_HBM = "shared_hbm"
    PRIVATE_HBM = "private_hbm"
    SBUF = "sbuf"
    PSUM = "psum"

    @property
    def on_chip(self) -> bool:
        return self in (Buffer.SBUF, Buffer.PSUM)

    @property
    def kind(self) -> str:
        """``hbm`` | ``sbuf`` | ``psum``: how the accounting names a transfer's direction."""
        return "hbm" if not self.on_chip else self.value


def is_integer(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer)


def _dummy(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-stride stand-in of ``shape``: slicing it gives the right shapes, and it costs one element."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=dtype), shape=shape, strides=(0,) * len(shape))


class Allocation:
    """One ``nl.ndarray``: its memory, where it lives and whether it is still alive."""

    def __init__(self, name: str, buffer: Buffer, dtype: np.dtype, shape: tuple[int, ...], numerics: bool,
                 owner: int | None):
        self.name = name
        self.buffer = buffer
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self.owner = owner
        self.alive = True
        self.has_data = numerics or is_integer(self.dtype)
        if self.has_data:
            fill = UNINITIALISED_INT if is_integer(self.dtype) else np.nan
            self.data = np.full(shape, fill, dtype=self.dtype)
        else:
            self.data = _dummy(shape, self.dtype)
        # PSUM remembers what nc_matmul wrote, for its accumulate rules.
        self.matmul_written = np.zeros(shape, dtype=bool) if buffer is Buffer.PSUM else None
        free = math.prod(shape[1:]) if len(shape) > 1 else 1
        self.bytes_per_partition = free * self.dtype.itemsize

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class NkiTensor:
    """A tensor or a rectangular view of one (NumPy basic indexing: ints and slices).

    On-chip tensors keep the partition dimension first, so it may only be sliced, never indexed away.
    """

    __slots__ = ("alloc", "data", "written")

    def __init__(self, alloc: Allocation, data: np.ndarray, written: np.ndarray | None):
        self.alloc = alloc
        self.data = data
        self.written = written

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.alloc.dtype

    @property
    def buffer(self) -> Buffer:
        return self.alloc.buffer

    @property
    def name(self) -> str:
        return self.alloc.name

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    def __getitem__(self, key) -> "NkiTensor":
        key = key if isinstance(key, tuple) else (key,)
        for k in key:
            if not isinstance(k, (int, np.integer, slice)) or isinstance(k, bool):
                raise TypeError(f"tensor {self.name!r}: index with ints and slices only (got {type(k).__name__}); "
                                "dynamic addressing goes through .ap(scalar_offset=..., vector_offset=...)")
        if self.buffer.on_chip and key and not isinstance(key[0], slice):
            raise TypeError(f"tensor {self.name!r} lives in {self.buffer.value}: slice its partition dimension "
                            "(dim 0), do not index it away")
        data = self.data[key]
        if any(n == 0 for n in data.shape):
            raise HardwareLimitError(f"tensor {self.name!r}: index {key} selects an empty region of shape "
                                     f"{self.shape}")
        written = None if self.written is None else self.written[key]
        return NkiTensor(self.alloc, data, written)

    def ap(self, pattern: Sequence[Sequence[int]], offset: int = 0, scalar_offset=None, vector_offset=None,
           indirect_dim: int = 0) -> "AccessPattern":
        """A DMA access pattern over this HBM tensor's elements in row-major order (NKI's ``.ap``).

        ``pattern`` lists ``[stride, count]`` pairs (outermost first) and gives the accessed shape; ``offset`` is
        in elements. ``scalar_offset`` (an int32 ``(1, 1)`` tensor or a register) adds ``value *
        prod(shape[indirect_dim+1:])``. ``vector_offset`` (an int32 ``(P, 1)`` SBUF tensor, ``P`` the first count)
        replaces the first dimension's index by a row of ``indirect_dim=0`` -- a gather/scatter of rows.
        """
        return AccessPattern(self, pattern, offset, scalar_offset, vector_offset, indirect_dim)

    def __repr__(self) -> str:
        return f"NkiTensor({self.name!r}, {self.buffer.value}, {self.dtype}, {self.shape})"


class AccessPattern:
    """An HBM access described by strides, resolved (and bounds-checked) when a DMA runs."""

    def __init__(self, tensor: NkiTensor, pattern, offset: int, scalar_offset, vector_offset, indirect_dim: int):
        if tensor.buffer.on_chip:
            raise TypeError(f".ap() describes an HBM access; tensor {tensor.name!r} is in {tensor.buffer.value}")
        if tensor.shape != tensor.alloc.shape:
            raise TypeError(f".ap() addresses the whole tensor {tensor.name!r}: call it on the tensor, not a view "
                            "(put the view's start into offset)")
        pattern = [(int(stride), int(count)) for stride, count in pattern]
        if not pattern or any(count < 1 for _, count in pattern):
            raise HardwareLimitError(f"access pattern {pattern} on {tensor.name!r}: every count must be >= 1")
        if not 0 <= indirect_dim < len(tensor.shape):
            raise ValueError(f"indirect_dim must be in [0, {len(tensor.shape) - 1}], got {indirect_dim}")
        if vector_offset is not None:
            if scalar_offset is not None:
                raise TypeError("an access pattern takes scalar_offset or vector_offset, not both")
            if indirect_dim != 0:
                raise HardwareLimitError("vector_offset indirection is only supported on indirect_dim=0")
            if (not isinstance(vector_offset, NkiTensor) or vector_offset.buffer is not Buffer.SBUF
                    or not is_integer(vector_offset.dtype) or vector_offset.shape != (pattern[0][1], 1)):
                raise TypeError(f"vector_offset must be an integer SBUF tensor of shape ({pattern[0][1]}, 1), got "
                                f"{vector_offset!r}")
        self.tensor = tensor
        self.pattern = pattern
        self.offset = int(offset)
        self.scalar_offset = scalar_offset
        self.vector_offset = vector_offset
        self.indirect_dim = indirect_dim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(count for _, count in self.pattern)

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def buffer(self) -> Buffer:
        return self.tensor.buffer

    @property
    def dtype(self) -> np.dtype:
        return self.tensor.dtype

    @property
    def dynamic(self) -> bool:
        return self.scalar_offset is not None or self.vector_offset is not None

    def row_stride(self) -> int:
        return math.prod(self.tensor.shape[self.indirect_dim + 1:])

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row_base (P,), row_valid (P,), dynamic_index (P,))``: the element address each first-dimension index
        starts at, whether all of that row's addresses (and its dynamic index) are in bounds, and the index."""
        size = self.tensor.alloc.size
        bound = self.tensor.shape[self.indirect_dim]
        inner_lo = sum(min(0, s * (c - 1)) for s, c in self.pattern[1:])
        inner_hi = sum(max(0, s * (c - 1)) for s, c in self.pattern[1:])
        stride0, count0 = self.pattern[0]
        if self.vector_offset is not None:
            index = self.vector_offset.data.reshape(-1).astype(np.int64)
            base = self.offset + index * self.row_stride()
            index_ok = (index >= 0) & (index < bound)
        else:
            base = self.offset + np.arange(count0, dtype=np.int64) * stride0
            index = np.zeros(count0, dtype=np.int64)
            index_ok = np.ones(count0, dtype=bool)
            if self.scalar_offset is not None:
                value = scalar_value(self.scalar_offset)
                base = base + value * self.row_stride()
                index[:] = value
                index_ok[:] = 0 <= value < bound
        in_range = (base + inner_lo >= 0) & (base + inner_hi < size)
        if not self.dynamic and not in_range.all():
            raise HardwareLimitError(f"access pattern {self.pattern} + offset {self.offset} reaches outside tensor "
                                     f"{self.name!r} ({size} elements, shape {self.tensor.shape})")
        return base, index_ok & in_range, index

    def addresses(self, row_base: np.ndarray) -> np.ndarray:
        """Element addresses ``(rows, *shape[1:])`` for the given row starts."""
        addr = row_base.reshape((-1,) + (1,) * (len(self.pattern) - 1))
        for d, (stride, count) in enumerate(self.pattern[1:], start=1):
            shape = [1] * len(self.pattern)
            shape[d] = count
            addr = addr + (np.arange(count, dtype=np.int64) * stride).reshape(shape)
        return np.broadcast_to(addr, (len(row_base),) + self.shape[1:])


def scalar_value(source) -> int:
    """The value of a ``scalar_offset``: a register or a one-element integer tensor (read by the DMA engine)."""
    if isinstance(source, VirtualRegister):
        return source.value
    if isinstance(source, NkiTensor) and is_integer(source.dtype) and source.data.size == 1:
        return int(source.data.reshape(-1)[0])
    raise TypeError(f"scalar_offset must be a VirtualRegister or a one-element integer tensor, got {source!r}")


class VirtualRegister:
    """An engine-sequencer register (``nisa.register_alloc``): a dynamic loop bound or ``while`` condition.

    ``while reg:`` reads it on the device; each read is counted as a branch.
    """

    def __init__(self, core: "Core", value: int = 0):
        self.core = core
        self.value = int(value)

    def __bool__(self) -> bool:
        self.core.accounting.branches += 1
        return self.value != 0

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


class Memory:
    """Capacity bookkeeping of one on-chip memory of one core (bytes per partition, or PSUM banks)."""

    def __init__(self, name: str, capacity: int, unit: str):
        self.name = name
        self.capacity = capacity
        self.unit = unit
        self.used = 0
        self.high_water = 0

    def reserve(self, amount: int, what: str) -> None:
        if self.used + amount > self.capacity:
            raise HardwareLimitError(f"{self.name} over capacity: {what} needs {amount} {self.unit} with "
                                     f"{self.used} of {self.capacity} {self.unit} in use")
        self.used += amount
        self.high_water = max(self.high_water, self.used)

    def release(self, amount: int) -> None:
        self.used -= amount


_CURRENT = threading.local()


def current_core() -> "Core":
    core = getattr(_CURRENT, "core", None)
    if core is None:
        raise RuntimeError("NKI operations run inside a kernel launched with nxd_moe.nki_kernels.simulate(kernel)")
    return core


class Core:
    """One physical NeuronCore running a kernel: program id, on-chip memories, registers and accounting.

    ``launch`` is the state the cores of one launch share (shared HBM, barrier, sendrecv pipes; see
    :mod:`nxd_moe.nki_kernels.lnc`).
    """

    def __init__(self, program_id: int, num_programs: int, numerics: bool, launch: Any):
        self.program_id = program_id
        self.num_programs = num_programs
        self.numerics = numerics
        self.launch = launch
        self.sbuf = Memory("SBUF", SBUF_PARTITION_BYTES, "bytes per partition")
        self.psum = Memory("PSUM", PSUM_NUM_BANKS, f"banks of {PSUM_BANK_BYTES} bytes per partition")
        self.accounting = Accounting()
        self._scopes: list[list[Allocation]] = [[]]
        self._private_count = 0
        self.replays: dict[Hashable, Accounting] = {}

    @contextmanager
    def activate(self):
        _CURRENT.core = self
        try:
            yield self
        finally:
            _CURRENT.core = None

    def allocate(self, shape, dtype, buffer: Buffer, name: str | None) -> NkiTensor:
        shape = tuple(int(n) for n in shape)
        if not shape or any(n < 1 for n in shape):
            raise HardwareLimitError(f"nl.ndarray shape must be non-empty with positive sizes, got {shape}")
        buffer = Buffer(buffer)
        if buffer is Buffer.SHARED_HBM:
            return self.launch.shared_tensor(self, shape, dtype, name)
        if buffer is Buffer.PRIVATE_HBM:
            self._private_count += 1
            alloc = Allocation(name or f"private_hbm{self._private_count}", buffer, dtype, shape, self.numerics,
                               self.program_id)
            return whole(alloc)
        label = name or f"{buffer.value}_tensor"
        if shape[0] > PMAX:
            raise HardwareLimitError(f"{buffer.value} tensor {label!r} of shape {shape}: partition dimension "
                                     f"{shape[0]} exceeds nl.tile_size.pmax = {PMAX}")
        alloc = Allocation(label, buffer, dtype, shape, self.numerics, self.program_id)
        if buffer is Buffer.SBUF:
            self.sbuf.reserve(alloc.bytes_per_partition, f"tensor {label!r} {shape} {alloc.dtype}")
        else:
            banks = -(-alloc.bytes_per_partition // PSUM_BANK_BYTES)
            self.psum.reserve(banks, f"tensor {label!r} {shape} {alloc.dtype}")
        self._scopes[-1].append(alloc)
        self.accounting.sbuf_high_water = self.sbuf.high_water
        self.accounting.psum_high_water_banks = self.psum.high_water
        return whole(alloc)

    @contextmanager
    def scope(self):
        """On-chip tensors allocated inside are freed (and unusable) when it closes: one loop iteration."""
        self._scopes.append([])
        try:
            yield
        finally:
            for alloc in self._scopes.pop():
                self._free(alloc)

    def _free(self, alloc: Allocation) -> None:
        alloc.alive = False
        if alloc.buffer is Buffer.SBUF:
            self.sbuf.release(alloc.bytes_per_partition)
        else:
            self.psum.release(-(-alloc.bytes_per_partition // PSUM_BANK_BYTES))

    def release_all(self) -> None:
        while self._scopes:
            for alloc in self._scopes.pop():
                self._free(alloc)


def counted_once_per_signature(signature: Callable[..., Hashable]):
    """Decorate a kernel routine (returning nothing) whose accounting depends only on ``signature(*args)``.

    In a counting run the routine executes the first time a signature occurs and later calls add the counts that
    execution recorded -- "simulate one block and multiply", exact because the counts cannot differ. With
    numerics it always executes. ``signature`` may read integer tensors (token ids, expert ids): they hold real
    values in every run.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def routine(*args, **kwargs) -> None:
            core = current_core()
            if core.numerics:
                fn(*args, **kwargs)
                return
            key = (fn.__qualname__, signature(*args, **kwargs))
            if key in core.replays:
                core.accounting.add(core.replays[key])
                return
            before = core.accounting.copy()
            fn(*args, **kwargs)
            core.replays[key] = core.accounting.since(before)

        return routine

    return decorate


def whole(alloc: Allocation) -> NkiTensor:
    return NkiTensor(alloc, alloc.data, alloc.matmul_written)


def hbm_tensor(array: np.ndarray, name: str, numerics: bool) -> NkiTensor:
    """A kernel argument: ``array`` copied into shared HBM."""
    alloc = Allocation(name, Buffer.SHARED_HBM, array.dtype, tuple(array.shape), numerics, None)
    if alloc.has_data:
        alloc.data[...] = array
    return whole(alloc)


def check_alive(*tensors) -> None:
    for t in tensors:
        if isinstance(t, NkiTensor) and not t.alloc.alive:
            raise RuntimeError(f"tensor {t.name!r} is used after the loop iteration that allocated it ended; "
                               "allocate tensors that outlive an iteration before the loop")
