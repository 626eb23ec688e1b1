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

import importlib.util
import sys
import types
from contextlib import contextmanager
from typing import Iterator

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

_saved: dict[str, types.ModuleType | None] | None = None
_families: tuple[str, ...] = ()


def _placeholder(origin: str | None) -> bool:
    """PyPI's ``nki`` is an empty placeholder ("WRONG PACKAGE ... install from the Neuron repository")."""
    if not origin:
        return False
    try:
        with open(origin, encoding="utf-8", errors="replace") as f:
            return "WRONG PACKAGE" in f.read(4096)
    except OSError:
        return False


def _ours(module: types.ModuleType) -> bool:
    return any(module is m for family in FAMILIES.values() for m in family.values())


def real_package(name: str = "nki") -> str | None:
    """Where a real package ``name`` (``nki``, ``nki_cpu_simulator``, ``neuronxcc``, ``neuron_dtypes``) would be
    imported from, or ``None`` (also for PyPI's ``nki`` placeholder and for namespace packages)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        if _ours(loaded) or getattr(loaded, "__file__", None) is None:  # ours, or a namespace package
            return None
        return loaded.__file__
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    # A namespace package (a directory named nki without __init__.py, e.g. a tests/nki folder on sys.path) is not it.
    if spec is None or spec.origin in (None, "namespace") or _placeholder(spec.origin):
        return None
    return spec.origin


def real_nki() -> str | None:
    """Where a real ``nki`` package would be imported from, or ``None`` (also for PyPI's placeholder)."""
    return real_package("nki")


def is_installed() -> bool:
    return _saved is not None


def installed_families() -> tuple[str, ...]:
    """The families :func:`install` aliased (empty when not installed)."""
    return _families


def _owned(name: str, families) -> bool:
    return any(name == root or name.startswith(root + ".") for root in families)


def install(force: bool = False, families=("nki",)) -> types.ModuleType:
    """Make ``nki`` and its submodules this simulator; returns the ``nki`` module. Idempotent.

    ``families`` picks the names to alias (see :mod:`~nxd_moe.nki_kernels.compat.namespaces`): ``"nki"``
    (default), ``"nki_cpu_simulator"`` (AWS's simulator package, as nki-library's harness imports it),
    ``"neuronxcc"`` (the legacy ``neuronxcc.nki.*``), ``"neuron_dtypes"`` (the ``ml_dtypes`` stand-in);
    :data:`ALL_FAMILIES` is all of them. Raises :class:`RealNkiError` when a real package of one of them is
    importable, unless ``force=True``; ``ValueError`` for an unknown family or a second install with other ones.
    """
    global _saved, _families
    families = tuple(dict.fromkeys(families))
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"install(families={families!r}): each must be one of {list(FAMILIES)}")
    if _saved is not None:
        if set(families) - set(_families):
            raise ValueError(f"compat is installed with families {list(_families)}; uninstall() before installing "
                             f"{list(families)}")
        return frontend
    found = {f: where for f in families if (where := real_package(f)) is not None}
    if found and not force:
        what = "; ".join(f"a real {f} package is importable ({where})" for f, where in found.items())
        raise RealNkiError(f"{what}; nxd_moe.nki_kernels.compat.install() would shadow "
                           "it with the CPU simulator. Use the real one, leave its family out (CLI: --alias), or pass "
                           "force=True (CLI: --force) to simulate anyway.")
    aliases = {name: module for f in families for name, module in FAMILIES[f].items()}
    _saved = {name: module for name, module in sys.modules.items() if _owned(name, families)}
    for name in list(_saved):
        del sys.modules[name]
    sys.modules.update(aliases)
    _families = families
    return frontend


def uninstall() -> None:
    """Undo :func:`install`: every entry of ``sys.modules`` under an aliased family is restored to what it was."""
    global _saved, _families
    if _saved is None:
        return
    for name in [n for n in sys.modules if _owned(n, _families)]:
        del sys.modules[name]
    sys.modules.update(_saved)
    _saved, _families = None, ()


@contextmanager
def installed(force: bool = False, families=("nki",)) -> Iterator[types.ModuleType]:
    """``with installed() as nki: ...`` -- the API installed inside the block only (unless it already was)."""
    already = is_installed()
    module = install(force, families)
    try:
        yield module
    finally:
        if not already:
            uninstall()
