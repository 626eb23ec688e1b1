"""pytest plugin: the ``nxd_compat`` fixture installs NxD's module names for one test and restores ``sys.modules``.

Registered as a ``pytest11`` entry point of nxd-moe; ``pytest_plugins = ["nxd_moe.nxd_compat.pytest_plugin"]`` in a
conftest works too.
"""

from __future__ import annotations

import pytest

from nxd_moe import nxd_compat as _compat


@pytest.fixture
def nxd_compat():
    """The :mod:`nxd_moe.nxd_compat` module, with both families installed for this test only."""
    with _compat.installed():
        yield _compat
