"""The ``nki`` module itself: ``nki.jit``, ``kernel[lnc]``, ``nki.simulate`` (and its accounting), over
:func:`nxd_moe.nki_kernels.lnc.simulate`.

``@nki.jit`` wraps a function in a :class:`Kernel`. Called inside a running kernel (one ``@nki.jit`` kernel calling
another, as nki-library's ``moe_cte`` does) it is a plain call; called from the host it runs on the simulator --
there is no device here, so this is NKI's ``NKI_SIMULATOR=1`` behaviour. ``kernel[2]`` launches on the two cores of
an LNC2 logical core. ``nki.simulate(kernel)(*args)`` takes NumPy arrays or torch tensors and returns the outputs the
same way; the :class:`~nxd_moe.nki_kernels.lnc.KernelRun` with the accounting is ``last_run()`` (or call
:func:`run` to get it directly, e.g. for the cost model and the planner). Array arguments a kernel writes are
written back to the caller's arrays, as the NKI simulator does.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

import ml_dtypes
import numpy as np

from nxd_moe.nki_kernels import isa, language
from nxd_moe.nki_kernels.lnc import KernelRun
from nxd_moe.nki_kernels.lnc import simulate as _launch
from nxd_moe.nki_kernels.machine import running_core

dtype = np.dtype
_LAST = threading.local()
# Called as hook(kernel, run) after every host launch (``simulate`` / ``cpu_simulate`` / ``run``): how a test harness
# collects each kernel's counts and cost estimate without holding the runs (and their arrays).
launch_hooks: list[Callable[["Kernel", KernelRun], None]] = []


class Kernel:
    """An ``@nki.jit`` kernel; ``kernel[lnc]`` fixes its launch grid (one axis of 1 or 2 cores on Trn2)."""

    def __init__(self, fn: Callable, grid: tuple[int, ...] | None = None, options: dict | None = None):
        self.fn = fn.fn if isinstance(fn, Kernel) else fn
        self.grid = grid
        self.options = dict(options or {})
        functools.update_wrapper(self, self.fn)

    def __getitem__(self, grid) -> "Kernel":
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        if len(grid) != 1 or isinstance(grid[0], bool) or int(grid[0]) not in (1, 2):
            raise ValueError(f"{self.fn.__name__}[{grid}]: the launch grid is one axis of 1 or 2 cores (the LNC of a "
                             "Trn2 logical NeuronCore)")
        return Kernel(self.fn, (int(grid[0]),), self.options)

    @property
    def lnc(self) -> int:
        return self.grid[0] if self.grid else 1

    def __call__(self, *args, **kwargs):
        if running_core() is not None:
            return self.fn(*args, **kwargs)
        return simulate(self)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"nki.jit({self.fn.__qualname__}{'' if self.grid is None else list(self.grid)})"


def jit(fn: Callable | None = None, **options):
    """``@nki.jit`` / ``@nki.jit(mode=...)``: wrap a kernel function; options (``mode``, ``platform_target``, ...)
    are kept and do not change the simulation."""
    if fn is None:
        return lambda f: Kernel(f, options=options)
    return Kernel(fn, options=options)


def to_numpy(value):
    """A torch tensor as a NumPy array (bfloat16 through ``ml_dtypes``); anything else unchanged."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return value


def _to_torch(value):
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(value.copy())
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(v) for v in value)
    return value


def run(kernel, *args, numerics: bool = True, lnc: int | None = None, **kwargs) -> KernelRun:
    """Run a kernel (``@nki.jit`` or plain function, optionally ``kernel[2]``) on the simulator and return the whole
    :class:`~nxd_moe.nki_kernels.lnc.KernelRun`: outputs, per-core accounting (for the cost model). ``numerics=False``
    makes a counting run. (A kernel with its own ``lnc`` / ``numerics`` parameter: use ``simulate``.)"""
    return _run(kernel, args, kwargs, numerics, lnc)


def _run(kernel, args: tuple, kwargs: dict, numerics: bool = True, lnc: int | None = None) -> KernelRun:
    """:func:`run` with the kernel's arguments as containers, so that a kernel parameter named ``lnc`` or
    ``numerics`` (nki-library's attention kernels take ``lnc``) reaches the kernel."""
    kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    grid_ndim = 0 if kernel.grid is None and lnc is None else 1
    cores = lnc if lnc is not None else kernel.lnc
    args = [to_numpy(a) for a in args]
    kwargs = {k: to_numpy(v) for k, v in kwargs.items()}
    result = _launch(kernel.fn, lnc=cores, numerics=numerics, grid_ndim=grid_ndim, liveness=True,
                     alias_inputs=True)(*args, **kwargs)
    _LAST.run = result
    for hook in list(launch_hooks):
        hook(kernel, result)
    return result


def simulate(kernel) -> Callable[..., Any]:
    """``nki.simulate(kernel)(*args)`` / ``nki.simulate(kernel[2])(*args)``: run on the CPU simulator; NumPy in,
    NumPy out (torch in, torch out). ``last_run()`` then holds the accounting."""
    kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)

    def call(*args, **kwargs):
        torch_in = any(type(a).__module__.startswith("torch") for a in (*args, *kwargs.values()))
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
        result = _run(kernel, args, kwargs)
        for name, value in bound.arguments.items():  # kernels may write their inputs
            written = result.arguments.get(name)
            if isinstance(value, np.ndarray) and written is not None and value.flags.writeable \
                    and not np.may_share_memory(value, written):
                value[...] = written
        return _to_torch(result.outputs) if torch_in else result.outputs

    return call


class cpu_simulate:  # noqa: N801 -- NKI's name
    """``nki.cpu_simulate(kernel)[lnc](**inputs)``, as nki-library's harness calls AWS's CPU simulator (its
    ``test/utils/simulation_setup.py``): ``[lnc]`` picks the launch grid; called without it, the kernel's own grid
    (``kernel[2]``) or one core. Same results as :func:`simulate`."""

    def __init__(self, kernel):
        self.kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)

    def __getitem__(self, lnc) -> Callable[..., Any]:
        return simulate(self.kernel[lnc])

    def __call__(self, *args, **kwargs):
        return simulate(self.kernel)(*args, **kwargs)


def simulate_kernel(kernel, *args, **kwargs):
    """The legacy ``nki.simulate_kernel(kernel, *args)``."""
    return simulate(kernel)(*args, **kwargs)


def last_run() -> KernelRun | None:
    """The :class:`~nxd_moe.nki_kernels.lnc.KernelRun` of this thread's last simulated launch."""
    return getattr(_LAST, "run", None)


def _no_device(name: str):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"nki.{name} compiles for and runs on a NeuronDevice; this is the nxd_moe CPU simulator "
                           "(use nki.simulate, or the cost model: nxd_moe.nki_kernels.cost_model)")

    unavailable.__name__ = name
    return unavailable


baremetal = _no_device("baremetal")
benchmark = _no_device("benchmark")
profile = _no_device("profile")

__all__ = ["jit", "Kernel", "simulate", "cpu_simulate", "simulate_kernel", "run", "last_run", "launch_hooks",
           "language", "isa", "dtype", "baremetal", "benchmark", "profile"]
