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

from nxd_moe.nki_kernels import isa, language
from nxd_moe.nki_kernels.compat import frontend
from nxd_moe.nki_kernels.compat.frontend import Kernel, jit, last_run, run, simulate

__all__ = ["install", "uninstall", "installed", "is_installed", "RealNkiError", "Kernel", "jit", "simulate", "run",
           "last_run", "MODULE_NAMES"]


class RealNkiError(RuntimeError):
    """A real ``nki`` package is importable; installing the simulator over it needs ``force=True``."""


def _module(name: str, doc: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attributes)
    return module


_constants = _module("nki.isa.constants", "NKI's instruction constants (nki.isa.constants).",
                     oob_mode=isa.oob_mode, dge_mode=isa.dge_mode, engine=isa.engine, nc_version=isa.nc_version,
                     reduce_cmd=isa.reduce_cmd, matmul_perf_mode=isa.matmul_perf_mode, dma_engine=isa.dma_engine)
isa.constants = _constants  # `from nki.isa import constants` as well as `import nki.isa.constants`
_typing = _module("nki.typing", "NKI's type names (nki.typing).", tensor=language.NkiTensor,
                  NkiTensor=language.NkiTensor)

_ALIASES: dict[str, types.ModuleType] = {
    "nki": frontend,
    "nki.language": language,
    "nki.isa": isa,
    "nki.isa.constants": _constants,
    "nki.typing": _typing,
}
MODULE_NAMES = tuple(_ALIASES)

_saved: dict[str, types.ModuleType | None] | None = None


def _placeholder(origin: str | None) -> bool:
    """PyPI's ``nki`` is an empty placeholder ("WRONG PACKAGE ... install from the Neuron repository")."""
    if not origin:
        return False
    try:
        with open(origin, encoding="utf-8", errors="replace") as f:
            return "WRONG PACKAGE" in f.read(4096)
    except OSError:
        return False


def real_nki() -> str | None:
    """Where a real ``nki`` package would be imported from, or ``None`` (also for PyPI's placeholder)."""
    loaded = sys.modules.get("nki")
    if loaded is not None:
        if loaded is frontend or getattr(loaded, "__file__", None) is None:  # ours, or a namespace package
            return None
        return loaded.__file__
    try:
        spec = importlib.util.find_spec("nki")
    except (ImportError, ValueError):
        return None
    # A namespace package (a directory named nki without __init__.py, e.g. a tests/nki folder on sys.path) is not it.
    if spec is None or spec.origin in (None, "namespace") or _placeholder(spec.origin):
        return None
    return spec.origin


def is_installed() -> bool:
    return _saved is not None


def install(force: bool = False) -> types.ModuleType:
    """Make ``nki`` and its submodules this simulator; returns the ``nki`` module. Idempotent.

    Raises :class:`RealNkiError` when a real ``nki`` is importable, unless ``force=True``.
    """
    global _saved
    if _saved is not None:
        return frontend
    found = real_nki()
    if found is not None and not force:
        raise RealNkiError(f"a real nki package is importable ({found}); nxd_moe.nki_kernels.compat.install() would "
                           "shadow it with the CPU simulator. Use the real one, or pass force=True (CLI: --force) to "
                           "simulate anyway.")
    _saved = {name: sys.modules.get(name) for name in _ALIASES}
    _saved.update({name: module for name, module in sys.modules.items()
                   if (name == "nki" or name.startswith("nki.")) and name not in _saved})
    for name in [n for n in sys.modules if n.startswith("nki.") and n not in _ALIASES]:
        del sys.modules[name]
    sys.modules.update(_ALIASES)
    return frontend


def uninstall() -> None:
    """Undo :func:`install`: every ``nki*`` entry of ``sys.modules`` is restored to what it was."""
    global _saved
    if _saved is None:
        return
    for name in [n for n in sys.modules if n == "nki" or n.startswith("nki.")]:
        del sys.modules[name]
    sys.modules.update({name: module for name, module in _saved.items() if module is not None})
    _saved = None


@contextmanager
def installed(force: bool = False) -> Iterator[types.ModuleType]:
    """``with installed() as nki: ...`` -- the API installed inside the block only (unless it already was)."""
    already = is_installed()
    module = install(force)
    try:
        yield module
    finally:
        if not already:
            uninstall()
