"""A NeuronCore running a kernel (:class:`Core`): its on-chip memories with their capacities, its registers and
accounting, and what every instruction does on it -- check that the tensors it touches are alive (:func:`check_alive`)
and be one step of the launch (:func:`instruction`).

SBUF and PSUM allocations are freed when the loop iteration (or kernel) that made them ends -- see
:meth:`Core.scope` -- which is how the high-water marks and the capacity errors come about.

With ``numerics=False`` (a *counting* run) floating-point tensors hold no data: instructions check their limits and
are accounted, but no arithmetic is done (see :mod:`~nxd_moe.nki_kernels.allocation`).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Hashable

from nxd_moe.nki_kernels.accounting import Accounting
from nxd_moe.nki_kernels.allocation import Allocation, settle
from nxd_moe.nki_kernels.dtypes import cast  # noqa: F401 -- importable from here, as before the split
from nxd_moe.nki_kernels.hardware import (  # noqa: F401 -- OutOfBoundsError: importable from here, as before
    PMAX,
    PSUM_BANK_BYTES,
    PSUM_NUM_BANKS,
    SBUF_PARTITION_BYTES,
    Buffer,
    HardwareLimitError,
    OutOfBoundsError,
)
from nxd_moe.nki_kernels.liveness import Trace, psum_banks
from nxd_moe.nki_kernels.tensor import NkiTensor, whole


class _Release:
    """Gives an on-chip allocation's space back once (at the end of its scope, or when it is garbage)."""

    def __init__(self, memory: "Memory", amount: int):
        self.memory = memory
        self.amount = amount
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.memory.release(self.amount)


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


def running_core() -> "Core | None":
    """The core running a kernel on this thread, or None (host code: outside any kernel)."""
    return getattr(_CURRENT, "core", None)


def current_core() -> "Core":
    core = running_core()
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
        # Real NKI loops are plain Python ranges and the compiler allocates on-chip memory over the instructions'
        # dependencies. With liveness (the compat front door) the instruction stream is traced and capacity is
        # checked when the kernel ends (check_liveness; see nxd_moe.nki_kernels.liveness).
        self.liveness = bool(getattr(launch, "liveness", False))
        self.trace = Trace() if self.liveness else None
        self.replays: dict[Hashable, Accounting] = {}
        self.accumulators: dict[str, dict] = {}  # the engines' reduce registers (nisa reduce_cmd)
        # LNC2: the scheduler that runs the cores in lockstep, one instruction each in turn (None on one core);
        # in_instruction marks an instruction running, so that instructions built from others are one step.
        self.lockstep = launch.lockstep
        self.in_instruction = False

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
            memory, amount = self.sbuf, alloc.bytes_per_partition
        else:
            memory, amount = self.psum, -(-alloc.bytes_per_partition // PSUM_BANK_BYTES)
        if self.liveness:
            return whole(alloc)
        memory.reserve(amount, f"tensor {label!r} {shape} {alloc.dtype}")
        alloc.release = _Release(memory, amount)
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

    @staticmethod
    def _free(alloc: Allocation) -> None:
        alloc.alive = False
        alloc.release()

    def check_liveness(self) -> None:
        """With liveness: the SBUF / PSUM high-water marks of the traced kernel, raising :class:`HardwareLimitError`
        when what must be live at once under any schedule exceeds a capacity."""
        for memory, buffer, size in ((self.sbuf, Buffer.SBUF, lambda a: a.bytes_per_partition),
                                     (self.psum, Buffer.PSUM, lambda a: psum_banks(a, PSUM_BANK_BYTES))):
            footprint = self.trace.footprint(buffer, size, memory.capacity)
            memory.high_water = footprint.peak
            if footprint.peak > memory.capacity:
                names = footprint.tensors
                raise HardwareLimitError(f"{memory.name} over capacity: {footprint.peak} {memory.unit} live at once "
                                         f"under any instruction schedule (tensors {', '.join(names[:8])}"
                                         f"{', ...' if len(names) > 8 else ''}) exceeds {memory.capacity}")
        self.accounting.sbuf_high_water = self.sbuf.high_water
        self.accounting.psum_high_water_banks = self.psum.high_water

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



def check_alive(*tensors, write: bool = False, settled: bool = True) -> None:
    """Every instruction passes the tensors it reads (or, ``write=True``, writes) here: a freed tensor, or a view
    reaching outside its tensor, raises; with liveness, the access is traced; a pending matmul accumulation is
    stored first (unless ``settled=False``: ``nc_matmul`` extending it)."""
    for t in tensors:
        if not isinstance(t, NkiTensor):
            continue
        if settled and t.alloc.pending is not None:
            settle(t.alloc)
        if write and t.alloc.read_by_pending:  # a pending product reads the old values: compute it first
            for psum in list(t.alloc.read_by_pending):
                settle(psum)
            t.alloc.read_by_pending.clear()
        if t.outside is not None:
            raise HardwareLimitError(t.outside)
        trace = current_core().trace
        if trace is not None:
            trace.access(t.alloc, write, write and t.size * t.dtype.itemsize >= t.alloc.size * t.alloc.dtype.itemsize)
        if not t.alloc.alive:
            raise RuntimeError(f"tensor {t.name!r} is used after the loop iteration that allocated it ended; "
                               "allocate tensors that outlive an iteration before the loop")


def instruction(fn: Callable | None = None, *, fence: bool = False):
    """Mark an ``nisa`` function as one instruction: one entry of the liveness trace (``fence``: nothing is reordered
    across it -- barriers, cross-core exchanges, registers) and, on LNC2, one lockstep step (the cores take turns
    before each outermost instruction; see :mod:`nxd_moe.nki_kernels.lnc`)."""

    def decorate(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            core = running_core()
            if core is None:
                return f(*args, **kwargs)
            if core.lockstep is not None and not core.in_instruction:
                return stepped(core, args, kwargs)
            if core.trace is None:
                return f(*args, **kwargs)
            with core.trace.instruction(fence):
                return f(*args, **kwargs)

        def stepped(core, args, kwargs):
            core.lockstep.step(core.program_id)  # wait for this core's turn
            core.in_instruction = True
            try:
                return run(*args, **kwargs)
            finally:
                core.in_instruction = False

        return run

    return decorate if fn is None else decorate(fn)
