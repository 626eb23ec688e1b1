"""``python -m nxd_moe.nxd_compat [--force] [--alias F,...] (script.py | -m MODULE) [args...]``: run a script or a
module (like ``python -m``) with NxD's module names installed, e.g. NxD's own unit tests::

    python -m nxd_moe.nxd_compat -m pytest test/unit_test/modules/moe/test_moe_configs.py

``--alias neuronx_distributed`` aliases one family; a family whose real package is importable is refused unless
``--force``.
"""

from __future__ import annotations

import sys

from nxd_moe import aliasing
from nxd_moe.nxd_compat import ALL_FAMILIES, install

USAGE = ("usage: python -m nxd_moe.nxd_compat [--force] [--alias F,...] (script.py | -m MODULE) [args...]\n"
         f"  --alias F,...  module families to alias (default: all of {','.join(ALL_FAMILIES)})\n"
         "  --force        install even when a real package of a family is importable\n"
         "  -m MODULE      run a library module as a script, like python -m (e.g. -m pytest)")


def main(argv: list[str] | None = None) -> int:
    return aliasing.main(argv, USAGE, ALL_FAMILIES, install)


if __name__ == "__main__":
    sys.exit(main())
