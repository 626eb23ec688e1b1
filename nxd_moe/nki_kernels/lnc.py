"""Launching a kernel on one core or on the two cores of an LNC2 logical NeuronCore.

LNC2 runs the kernel once per core, each with its own program id, on-chip memories, registers and accounting; the
cores share HBM (a ``shared_hbm`` allocation is one tensor for both: the k-th such allocation of each core is the same
tensor), meet at ``core_barrier`` and exchange tiles with ``sendrecv``.

**The cores run in lockstep, one interleaving, always the same.** On hardware the two cores of a logical core start
together and issue their instruction streams at the same pace, so kernels rely on it without a barrier: nki-library's
``core/max`` tests have both cores zero a shared output and then each write its half -- the zeroing is done by both
before either writes, because both progress together. Free-running threads break that (a core may zero after its peer
wrote: a wrong result in a few percent of runs) and make any LNC2 result depend on the OS scheduler. So each core runs
on its own Python thread (the kernel is ordinary Python with its own stack) but only one thread runs at a time: the
cores take turns at instruction boundaries, round-robin (:class:`Lockstep`). Each outermost ``@instruction`` -- every
``nisa`` operation, DMA, barrier and exchange -- is one step, so whenever neither core is blocked every core's k-th
instruction runs before any core's (k+1)-th, core 0's first: the rule "the cores progress together" made exact and
deterministic. (A stricter rule -- time from the cost model -- would need a timing model of every engine that we do
not have; a looser one is the race itself.) Python between two instructions (address arithmetic, loop control)
belongs to the step that follows it; it touches nothing the peer can see. A core blocked at a barrier (or a
``sendrecv``, which meets at one) gives up its turns until its peer arrives; the cores leave the barrier together, as
on hardware, and the round-robin starts again from core 0. A core that waits for something that can never come -- its
peer finished, or every core is blocked -- fails at once with :class:`CoreDivergenceError` naming what it waits for,
never by a timeout; a core whose peer raised stops at its next instruction, and the launch raises the peer's error.
One core (``lnc=1``) runs on the calling thread with no scheduler at all.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from nxd_moe.nki_kernels.accounting import Accounting
from nxd_moe.nki_kernels.allocation import Allocation
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.machine import Core
from nxd_moe.nki_kernels.tensor import NkiTensor, whole


class CoreDivergenceError(RuntimeError):
    """The cores of an LNC2 launch did not meet: a core waits for something (a barrier, a ``sendrecv``) its peer never
    reaches, or its peer failed."""


@dataclass
class _Wait:
    """What a blocked core waits for: ``ready()`` says whether it may go on; ``what`` names it in errors."""

    ready: Callable[[], bool]
    what: str


class Lockstep:
    """Runs the cores of one launch one at a time, switching at instruction boundaries.

    Every core thread calls :meth:`begin` first, :meth:`step` before each instruction, :meth:`block` to wait for its
    peers and :meth:`finish` last. The turn goes to the core that can run and has begun the fewest instructions, the
    lowest program id on a tie: with no core blocked that is round-robin, core 0's k-th instruction, core 1's k-th,
    core 0's (k+1)-th, ... A barrier levels the counts (:meth:`level`: its cores leave it together, as on hardware),
    so after it the round-robin starts again from core 0. Only the core holding the turn runs, so the state the cores
    share (shared HBM, the barrier, the sendrecv pipes) needs no lock of its own.
    """

    def __init__(self, cores: int):
        self._cond = threading.Condition()
        self._turn = 0  # core 0 issues the launch's first instruction
        self._done = [False] * cores
        self._waits: list[_Wait | None] = [None] * cores
        # Raised in a core when it next gets the turn: its peer failed, or it waits for something that cannot come.
        self._errors: list[CoreDivergenceError | None] = [None] * cores
        self._steps = [0] * cores  # instructions begun per core, levelled at barriers: who goes next
        self._issued = [0] * cores  # instructions begun per core, for the errors

    def begin(self, program_id: int) -> None:
        with self._cond:
            self._await(program_id)

    def step(self, program_id: int) -> None:
        """An instruction boundary: let the next core that can run take its turn, and wait for ours."""
        with self._cond:
            self._steps[program_id] += 1
            self._issued[program_id] += 1
            self._pass()
            self._await(program_id)

    def block(self, program_id: int, ready: Callable[[], bool], what: str) -> None:
        """Give up turns until ``ready()`` (made true by a peer's instruction); ``what`` names the wait in errors."""
        with self._cond:
            self._waits[program_id] = _Wait(ready, what)
            try:
                self._pass()
                self._await(program_id)
            finally:
                self._waits[program_id] = None

    def level(self) -> None:
        """The cores leave a barrier together: from here on they count as having begun the same instructions."""
        top = max(self._steps)
        self._steps = [top] * len(self._steps)

    def finish(self, program_id: int, failed: bool) -> None:
        with self._cond:
            self._done[program_id] = True
            if failed:  # the launch fails anyway: stop the peers at their next instruction
                for other, done in enumerate(self._done):
                    if not done and self._errors[other] is None:
                        self._errors[other] = CoreDivergenceError(f"core {other} stopped: core {program_id} failed")
                        self._waits[other] = None
            self._pass()

    def _runnable(self, core: int) -> bool:
        wait = self._waits[core]
        return not self._done[core] and (wait is None or wait.ready())

    def _pass(self) -> None:
        """Give the turn to the core that can run and has begun the fewest instructions (the lowest id on a tie);
        if none can run but some wait, those waits can never end: fail each waiting core with the reason."""
        cores = range(len(self._done))
        if not any(self._runnable(core) for core in cores):
            waiting = [core for core in cores if not self._done[core]]
            for core in waiting:
                self._errors[core] = CoreDivergenceError(self._deadlock(core))
            for core in waiting:
                self._waits[core] = None
        runnable = [core for core in cores if self._runnable(core)]
        if runnable:
            self._turn = min(runnable, key=lambda core: (self._steps[core], core))
            self._cond.notify_all()

    def _deadlock(self, core: int) -> str:
        others = [other for other in range(len(self._done)) if other != core]
        peers = "; ".join(f"core {other} finished" if self._done[other] else
                          f"core {other}, at its instruction {self._issued[other]}, waits at {self._waits[other].what}"
                          for other in others)
        reason = ("the cores took different control paths" if all(self._done[o] for o in others)
                  else "every core is blocked (deadlock)")
        return (f"core {core}, at its instruction {self._issued[core]}, waits at {self._waits[core].what}, which no "
                f"other core can reach: {peers}; {reason}")

    def _await(self, program_id: int) -> None:
        while self._turn != program_id:
            self._cond.wait()
        error = self._errors[program_id]
        if error is not None:
            self._errors[program_id] = None
            raise error


class CoreBarrier:
    """A reusable barrier of all the cores of a launch, waited at through the :class:`Lockstep` scheduler."""

    def __init__(self, lockstep: Lockstep, parties: int):
        self.lockstep = lockstep
        self.parties = parties
        self.arrived = 0
        self.generation = 0

    def wait(self, program_id: int) -> None:
        generation = self.generation
        self.arrived += 1
        if self.arrived == self.parties:
            self.arrived = 0
            self.generation += 1
            self.lockstep.level()
            return
        self.lockstep.block(program_id, lambda: self.generation != generation,
                            f"core barrier #{generation + 1} (core_barrier or sendrecv)")


class Launch:
    """What the cores of one launch share: HBM allocations, the scheduler, the barrier and the sendrecv pipes. (No
    lock: the lockstep scheduler runs one core at a time.)"""

    def __init__(self, num_programs: int, numerics: bool, grid_ndim: int = 1):
        self.num_programs = num_programs
        self.grid_ndim = grid_ndim
        self.numerics = numerics
        self.lockstep = Lockstep(num_programs) if num_programs > 1 else None
        self.barrier = CoreBarrier(self.lockstep, num_programs) if self.lockstep is not None else None
        self._shared: list[Allocation] = []
        self._shared_count = [0] * num_programs
        self._pipes: dict[tuple[int, int, int], Any] = {}

    def shared_tensor(self, core: Core, shape: tuple[int, ...], dtype, name: str | None) -> NkiTensor:
        k = self._shared_count[core.program_id]
        self._shared_count[core.program_id] += 1
        if k == len(self._shared):
            self._shared.append(Allocation(name or f"shared_hbm{k}", Buffer.SHARED_HBM, dtype, shape,
                                           self.numerics, None))
        alloc = self._shared[k]
        if alloc.shape != shape or alloc.dtype != np.dtype(dtype):
            raise HardwareLimitError(f"shared_hbm allocation #{k}: core {core.program_id} asks for {shape} "
                                     f"{np.dtype(dtype)}, the peer for {alloc.shape} {alloc.dtype}")
        return whole(alloc)

    def exchange(self, program_id: int, payload, pipe_id: int, send_to: int, recv_from: int):
        self._pipes[(pipe_id, send_to, program_id)] = payload
        self.barrier.wait(program_id)
        key = (pipe_id, program_id, recv_from)
        if key not in self._pipes:
            raise HardwareLimitError(f"sendrecv: core {program_id} expects a tile from core {recv_from} on pipe "
                                     f"{pipe_id}, which that core did not send")
        received = self._pipes.pop(key)
        # Both cores must have taken their tile before either may send again on this pipe.
        self.barrier.wait(program_id)
        return received


@dataclass
class KernelRun:
    """A finished launch: the kernel's outputs as NumPy arrays (``None`` for float outputs of a counting run) and
    what each core did."""

    outputs: Any
    cores: list[Accounting]
    lnc: int
    # The HBM copies of array arguments, as the kernel left them.
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def accounting(self) -> Accounting:
        return Accounting.merged(self.cores)


def simulate(kernel: Callable, lnc: int = 1, numerics: bool = True, grid_ndim: int = 1,
             liveness: bool = False, alias_inputs: bool = False) -> Callable[..., KernelRun]:
    """``simulate(kernel, lnc=2)(*args)`` runs ``kernel`` on ``lnc`` cores (NKI's ``kernel[2](...)``).

    NumPy array arguments are copied into shared HBM under their parameter names (which the accounting uses);
    other arguments pass through. ``numerics=False`` makes a counting run (see :mod:`nxd_moe.nki_kernels.allocation`).
    ``grid_ndim`` is what ``nl.program_ndim()`` reports (0 for NKI's plain ``kernel(...)`` call);
    ``liveness`` counts on-chip memory over the tensors' lifetimes (allocation to last use), as the NKI compiler
    allocates it, instead of by loop scopes (see ``Core``) -- for kernels written for the real compiler.
    ``alias_inputs`` lets writeable C-contiguous array arguments be the HBM tensors themselves (the kernel's writes
    land in them; no copy), as the NKI simulator writes inputs back; an array overlapping an earlier one is copied.
    """
    if lnc not in (1, 2):
        raise ValueError(f"lnc must be 1 or 2 (cores of a Trn2 logical NeuronCore), got {lnc!r}")

    def run(*args, **kwargs) -> KernelRun:
        bound = inspect.signature(kernel).bind(*args, **kwargs)
        aliased: list[np.ndarray] = []
        for name, value in bound.arguments.items():
            if isinstance(value, np.ndarray):
                shared = alias_inputs and not any(np.may_share_memory(value, other) for other in aliased)
                bound.arguments[name] = hbm_tensor(value, name, numerics, alias=shared)
                if shared:
                    aliased.append(value)
        launch = Launch(lnc, numerics, grid_ndim)
        launch.liveness = liveness
        cores = [Core(pid, lnc, numerics, launch) for pid in range(lnc)]
        results: list[Any] = [None] * lnc
        errors: list[BaseException | None] = [None] * lnc

        def body(core: Core) -> None:
            failed = True
            try:
                if launch.lockstep is not None:
                    launch.lockstep.begin(core.program_id)
                with core.activate():
                    results[core.program_id] = kernel(*bound.args, **bound.kwargs)
                    if core.liveness:
                        core.check_liveness()
                failed = False
            except BaseException as e:  # re-raised by the launching thread
                errors[core.program_id] = e
            finally:
                core.release_all()
                if launch.lockstep is not None:
                    launch.lockstep.finish(core.program_id, failed)

        if lnc == 1:
            # One core keeps the single BLAS thread it has always run with (its speed is unchanged).
            blas_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                body(cores[0])
            finally:
                torch.set_num_threads(blas_threads)
        else:
            # The threads only hold each core's Python stack and run one at a time (Lockstep), so the running core
            # may use torch's BLAS threads: the two cores no longer compute at once (a 3072 x 128 x 512 product takes
            # 2.3 ms on two BLAS threads, 4.1 ms on one, here).
            threads = [threading.Thread(target=body, args=(core,), name=f"nki-core{core.program_id}")
                       for core in cores]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        primary = [e for e in errors if e is not None and not isinstance(e, CoreDivergenceError)]
        if primary or any(errors):
            raise (primary or [e for e in errors if e is not None])[0]
        arguments = {name: _to_numpy(value) for name, value in bound.arguments.items()
                     if isinstance(value, NkiTensor)}
        return KernelRun(_to_numpy(results[0]), [core.accounting for core in cores], lnc, arguments)

    return run


def hbm_tensor(array: np.ndarray, name: str, numerics: bool, alias: bool = False) -> NkiTensor:
    """A kernel argument in shared HBM: a copy of ``array``, or with ``alias`` (a writeable C-contiguous array) the
    array itself -- what the kernel writes lands in it, and a large weight costs no second copy."""
    own = alias and array.flags.c_contiguous and array.flags.writeable
    data = array if own else np.array(array, order="C")
    return whole(Allocation(name, Buffer.SHARED_HBM, array.dtype, tuple(array.shape), numerics, None, data))


def _to_numpy(value):
    if isinstance(value, NkiTensor):  # the launch is over: nothing else holds its HBM, so no copy
        return value.data if value.alloc.has_data else None
    if isinstance(value, (tuple, list)):
        return type(value)(_to_numpy(v) for v in value)
    return value
