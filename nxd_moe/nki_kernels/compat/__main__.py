"""``python -m nxd_moe.nki_kernels.compat [--force] [--alias F,...] (script.py | -m module) [args...]``: run a
script or a module (like ``python -m``) with the simulator installed under NKI's module names.

The runner exists to run NKI code unmodified, so by default it aliases every family (``nki``, AWS's
``nki_cpu_simulator``, the legacy ``neuronxcc.nki``, the ``neuron_dtypes`` stand-in) before the script's first
import -- nki-library's pytest harness imports ``nki`` while loading its conftest, before its own ``--test-mode
simulation`` would alias anything::

    python -m nxd_moe.nki_kernels.compat -m pytest test/integration/nkilib/core/max --test-mode simulation

``--alias nki`` aliases fewer; a family whose real package is importable is refused unless ``--force``.
"""

from __future__ import annotations

import sys

from nxd_moe import aliasing
from nxd_moe.aliasing import UsageError
from nxd_moe.nki_kernels.compat import ALL_FAMILIES, install

__all__ = ["USAGE", "UsageError", "parse", "main"]

USAGE = ("usage: python -m nxd_moe.nki_kernels.compat [--force] [--alias F,...] (script.py | -m MODULE) [args...]\n"
         f"  --alias F,...  module families to alias (default: all of {','.join(ALL_FAMILIES)})\n"
         "  --force        install even when a real package of a family is importable\n"
         "  -m MODULE      run a library module as a script, like python -m (e.g. -m pytest)")


def parse(argv: list[str]) -> tuple[bool, tuple[str, ...], str | None, list[str]]:
    """``(force, families, module, args)``: the runner's own options come first; everything from the script (or
    ``-m MODULE``) on belongs to it, as with ``python``."""
    return aliasing.parse(argv, ALL_FAMILIES)


def main(argv: list[str] | None = None) -> int:
    return aliasing.main(argv, USAGE, ALL_FAMILIES, install)


if __name__ == "__main__":
    sys.exit(main())
