"""NxD's import names on nxd_moe: ``install()`` makes ``from neuronx_distributed.modules.moe import MoE, routing``,
``neuronx_distributed.parallel_layers.parallel_state`` and NxD Inference's ``initialize_moe_module`` resolve to
nxd_moe, so NxD MoE inference code runs unchanged on a CPU or GPU (the real Neuron SDK installs only on AWS's own
images; PyPI's ``neuronx-distributed`` is an empty placeholder).

Three ways in, as for the NKI front door (:mod:`nxd_moe.nki_kernels.compat`):

- ``from nxd_moe import nxd_compat; nxd_compat.install()`` (``nxd_compat.uninstall()`` undoes it; ``with
  nxd_compat.installed(): ...`` does both);
- ``python -m nxd_moe.nxd_compat script.py [args]`` or ``python -m nxd_moe.nxd_compat -m pytest ...`` runs a
  script or module with the names installed (under ``torchrun`` too: ``torchrun ... -m nxd_moe.nxd_compat s.py``);
- the pytest fixture ``nxd_compat`` (:mod:`nxd_moe.nxd_compat.pytest_plugin`, a ``pytest11`` entry point).

Nothing is aliased until asked. Families (:mod:`~nxd_moe.nxd_compat.namespaces`): ``neuronx_distributed``,
``neuronx_distributed_inference`` and ``torch_neuronx`` (its ``testing.assert_close``). When a real package of a
family is importable, ``install`` refuses with :class:`RealNxdError` unless ``force=True``. Importing an NxD module
that is not served raises ``ImportError`` saying why; training and Neuron-kernel names that NxD code imports beside
the layers import, and raise :class:`~nxd_moe.nxd_compat.not_served.NotServedError` saying why when used. What
differs from NxD and why: docs/nxd.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from nxd_moe.aliasing import ModuleAliases
from nxd_moe.nxd_compat.namespaces import FAMILIES, unserved
from nxd_moe.nxd_compat.utils import serve_xla_backend

__all__ = ["install", "uninstall", "installed", "is_installed", "installed_families", "real_package", "RealNxdError",
           "ALL_FAMILIES", "FAMILIES"]


class RealNxdError(RuntimeError):
    """A real ``neuronx_distributed`` (or ``neuronx_distributed_inference``) is importable; installing nxd_moe's
    names over it needs ``force=True``."""


ALL_FAMILIES = tuple(FAMILIES)

_ALIASES = ModuleAliases(FAMILIES, "nxd_moe.nxd_compat", RealNxdError, "nxd_moe's layers", unserved)


def real_package(name: str = "neuronx_distributed") -> str | None:
    """Where a real package ``name`` would be imported from, or ``None`` (also for PyPI's placeholder)."""
    return _ALIASES.real_package(name)


def is_installed() -> bool:
    return _ALIASES.is_installed()


def installed_families() -> tuple[str, ...]:
    """The families :func:`install` aliased (empty when not installed)."""
    return _ALIASES.installed_families()


def install(force: bool = False, families=ALL_FAMILIES) -> None:
    """Make NxD's (and NxD Inference's) MoE module names resolve to nxd_moe. Idempotent.

    ``families``: which of :data:`ALL_FAMILIES` (default: all). Raises :class:`RealNxdError` when a real package
    of one of them is importable, unless ``force=True``; ``ValueError`` for an unknown family or a second install
    with other ones. Also makes the ``xla`` process-group backend available, as importing NxD does: torch_xla's
    where it is installed, else gloo under that name (:func:`~nxd_moe.nxd_compat.utils.serve_xla_backend`)."""
    _ALIASES.install(force, families)
    serve_xla_backend()


def uninstall() -> None:
    """Undo :func:`install`: every ``sys.modules`` entry under an aliased family is restored to what it was."""
    _ALIASES.uninstall()


@contextmanager
def installed(force: bool = False, families=ALL_FAMILIES) -> Iterator[None]:
    """``with installed(): ...`` -- the names installed inside the block only (unless they already were)."""
    with _ALIASES.installed(force, families):
        yield
