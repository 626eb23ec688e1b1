"""The real ``nki`` API on our simulator: ``install()`` makes ``import nki``, ``nki.language``, ``nki.isa``,
``nki.jit`` and ``nki.simulate(kernel[lnc])`` resolve to :mod:`nxd_moe.nki_kernels`, so a kernel written for the
Neuron compiler -- AWS's nki-library kernels included -- runs unmodified on a CPU, with the simulator's limits,
byte counts and cost model.

Three ways in:

- ``from nxd_moe.nki_kernels import compat; compat.install()`` (``compat.uninstall()`` undoes it; ``with
  compat.installed(): ...`` does both);
- ``python -m nxd_moe.nki_kernels.compat script.py [args]`` runs a script with the API installed;
- the pytest fixture ``nki_compat`` (plugin :mod:`nxd_moe.nki_kernels.compat.pytest_plugin`, registered as a pytest11
  entry point) installs it for one test and restores ``sys.modules`` afterwards.

It is the way nki-library's own harness runs kernels on a CPU -- aliasing ``sys.modules["nki"]`` and its submodules
to a simulator package (reference ``nki-kernels-and-trn2.md`` section 3.1) -- with this package as the simulator.
When a real ``nki`` (the Neuron SDK's) is importable, ``install`` refuses unless ``force=True``: silently shadowing
the real compiler would be worse than an error.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from nxd_moe.aliasing import ModuleAliases
from nxd_moe.nki_kernels.compat import frontend
from nxd_moe.nki_kernels.compat.frontend import Kernel, jit, last_run, run, simulate
from nxd_moe.nki_kernels.compat.namespaces import FAMILIES

__all__ = ["install", "uninstall", "installed", "is_installed", "installed_families", "RealNkiError", "Kernel", "jit",
           "simulate", "run", "last_run", "MODULE_NAMES", "ALL_FAMILIES", "FAMILIES"]


class RealNkiError(RuntimeError):
    """A real ``nki`` (or other aliased) package is importable; installing the simulator over it needs
    ``force=True``."""


ALL_FAMILIES = tuple(FAMILIES)
MODULE_NAMES = tuple(FAMILIES["nki"])

_ALIASES = ModuleAliases(FAMILIES, "nxd_moe.nki_kernels.compat", RealNkiError, "the CPU simulator")


def real_package(name: str = "nki") -> str | None:
    """Where a real package ``name`` (``nki``, ``nki_cpu_simulator``, ``neuronxcc``, ``neuron_dtypes``) would be
    imported from, or ``None`` (also for PyPI's ``nki`` placeholder and for namespace packages)."""
    return _ALIASES.real_package(name)


def real_nki() -> str | None:
    """Where a real ``nki`` package would be imported from, or ``None`` (also for PyPI's placeholder)."""
    return real_package("nki")


def is_installed() -> bool:
    return _ALIASES.is_installed()


def installed_families() -> tuple[str, ...]:
    """The families :func:`install` aliased (empty when not installed)."""
    return _ALIASES.installed_families()


def install(force: bool = False, families=("nki",)):
    """Make ``nki`` and its submodules this simulator; returns the ``nki`` module. Idempotent.

    ``families`` picks the names to alias (see :mod:`~nxd_moe.nki_kernels.compat.namespaces`): ``"nki"``
    (default), ``"nki_cpu_simulator"`` (AWS's simulator package, as nki-library's harness imports it),
    ``"neuronxcc"`` (the legacy ``neuronxcc.nki.*``), ``"neuron_dtypes"`` (the ``ml_dtypes`` stand-in);
    :data:`ALL_FAMILIES` is all of them. Raises :class:`RealNkiError` when a real package of one of them is
    importable, unless ``force=True``; ``ValueError`` for an unknown family or a second install with other ones.
    """
    _ALIASES.install(force, families)
    return frontend


def uninstall() -> None:
    """Undo :func:`install`: every entry of ``sys.modules`` under an aliased family is restored to what it was."""
    _ALIASES.uninstall()


@contextmanager
def installed(force: bool = False, families=("nki",)) -> Iterator:
    """``with installed() as nki: ...`` -- the API installed inside the block only (unless it already was)."""
    with _ALIASES.installed(force, families):
        yield frontend
