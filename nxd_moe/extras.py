"""Optional dependencies. Each is imported where it is used; one missing then is a one-line ``MissingExtraError``
naming the extra of ``pyproject.toml`` that brings it (``pip install 'nxd-moe[hf]'``), never a bare
``No module named ...`` from deep inside a call."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require"]

# top-level module -> the extra that installs it
EXTRAS = {"transformers": "hf", "accelerate": "hf", "torch_xla": "xla", "matplotlib": "plot", "triton": "gpu"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra."""


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or a :class:`MissingExtraError` ``"<purpose> needs <package>, which is
    not installed: pip install 'nxd-moe[<extra>]'"`` when that package is missing. An ImportError raised inside an
    installed package (a broken install, a missing dependency of its own) propagates as it is."""
    package = module.partition(".")[0]
    if package not in EXTRAS:
        raise ValueError(f"require: module must belong to one of {sorted(EXTRAS)}, got {module!r}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.partition(".")[0] != package:
            raise
        raise MissingExtraError(f"{purpose} needs {package}, which is not installed: pip install "
                                f"'nxd-moe[{EXTRAS[package]}]'") from None
