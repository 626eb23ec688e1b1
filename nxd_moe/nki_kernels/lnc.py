"""Launching a kernel on one core or on the two cores of an LNC2 logical NeuronCore.

As in the NKI simulator, LNC2 runs the kernel on two Python threads, each with its own program id, on-chip
memories, registers and accounting; they share HBM (a ``shared_hbm`` allocation is one tensor for both: the k-th
such allocation of each core is the same tensor), meet at ``core_barrier`` and exchange tiles with ``sendrecv``.
If the cores take different paths -- one waits at a barrier the other never reaches -- the launch fails with an
error instead of hanging.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from nxd_moe.nki_kernels.accounting import Accounting
from nxd_moe.nki_kernels.machine import Allocation, Buffer, Core, HardwareLimitError, NkiTensor, hbm_tensor, whole

BARRIER_TIMEOUT_S = 600.0


class CoreDivergenceError(RuntimeError):
    """The cores of an LNC2 launch did not meet at the same barriers."""


class CoreBarrier:
    """A reusable two-party barrier that notices a peer that has finished or failed."""

    def __init__(self, parties: int, timeout_s: float):
        self.parties = parties
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0
        self.finished = [False] * parties
        self.failed = False

    def wait(self, program_id: int) -> None:
        with self.cond:
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.parties:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return
            while self.generation == generation:
                if self.failed:
                    raise CoreDivergenceError(f"core {program_id} waits at a barrier but its peer failed")
                if any(done for i, done in enumerate(self.finished) if i != program_id):
                    raise CoreDivergenceError(f"core {program_id} waits at a core barrier (or sendrecv) that its peer "
                                              "finished without reaching: the cores took different control paths")
                if not self.cond.wait(self.timeout_s):
                    raise CoreDivergenceError(f"core {program_id} waited {self.timeout_s:.0f} s at a core barrier")

    def finish(self, program_id: int, failed: bool) -> None:
        with self.cond:
            self.finished[program_id] = True
            self.failed = self.failed or failed
            self.cond.notify_all()


class Launch:
    """What the cores of one launch share: HBM allocations, the barrier and the sendrecv pipes."""

    def __init__(self, num_programs: int, numerics: bool, timeout_s: float, grid_ndim: int = 1):
        self.num_programs = num_programs
        self.grid_ndim = grid_ndim
        self.numerics = numerics
        self.barrier = CoreBarrier(num_programs, timeout_s)
        self._lock = threading.Lock()
        self._shared: list[Allocation] = []
        self._shared_count = [0] * num_programs
        self._pipes: dict[tuple[int, int, int], Any] = {}

    def shared_tensor(self, core: Core, shape: tuple[int, ...], dtype, name: str | None) -> NkiTensor:
        with self._lock:
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
        with self._lock:
            self._pipes[(pipe_id, send_to, program_id)] = payload
        self.barrier.wait(program_id)
        with self._lock:
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


def simulate(kernel: Callable, lnc: int = 1, numerics: bool = True,
             timeout_s: float = BARRIER_TIMEOUT_S, grid_ndim: int = 1,
             liveness: bool = False, alias_inputs: bool = False) -> Callable[..., KernelRun]:
    """``simulate(kernel, lnc=2)(*args)`` runs ``kernel`` on ``lnc`` cores (NKI's ``kernel[2](...)``).

    NumPy array arguments are copied into shared HBM under their parameter names (which the accounting uses);
    other arguments pass through. ``numerics=False`` makes a counting run (see :mod:`nxd_moe.nki_kernels.machine`).
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
        launch = Launch(lnc, numerics, timeout_s, grid_ndim)
        launch.liveness = liveness
        cores = [Core(pid, lnc, numerics, launch) for pid in range(lnc)]
        results: list[Any] = [None] * lnc
        errors: list[BaseException | None] = [None] * lnc

        def body(core: Core) -> None:
            failed = True
            try:
                with core.activate():
                    results[core.program_id] = kernel(*bound.args, **bound.kwargs)
                    if core.liveness:
                        core.check_liveness()
                failed = False
            except BaseException as e:  # re-raised by the launching thread
                errors[core.program_id] = e
            finally:
                core.release_all()
                launch.barrier.finish(core.program_id, failed)

        # Each core computes on its own thread; BLAS threads on top would only compete with them (a 128 x 3072 x 512
        # product runs ~3x slower with two BLAS threads than with one on a busy 2-core machine).
        blas_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if lnc == 1:
                body(cores[0])
            else:
                threads = [threading.Thread(target=body, args=(core,), name=f"nki-core{core.program_id}")
                           for core in cores]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        finally:
            torch.set_num_threads(blas_threads)
        primary = [e for e in errors if e is not None and not isinstance(e, CoreDivergenceError)]
        if primary or any(errors):
            raise (primary or [e for e in errors if e is not None])[0]
        arguments = {name: _to_numpy(value) for name, value in bound.arguments.items()
                     if isinstance(value, NkiTensor)}
        return KernelRun(_to_numpy(results[0]), [core.accounting for core in cores], lnc, arguments)

    return run


def _to_numpy(value):
    if isinstance(value, NkiTensor):  # the launch is over: nothing else holds its HBM, so no copy
        return value.data if value.alloc.has_data else None
    if isinstance(value, (tuple, list)):
        return type(value)(_to_numpy(v) for v in value)
    return value
