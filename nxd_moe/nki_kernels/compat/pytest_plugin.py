"""pytest plugin: the ``nki_compat`` fixture installs the ``nki`` API for one test and restores ``sys.modules``.

Registered as a ``pytest11`` entry point of nxd-moe; ``pytest_plugins = ["nxd_moe.nki_kernels.compat.pytest_plugin"]``
in a conftest works too.
"""

from __future__ import annotations

import pytest

from nxd_moe.nki_kernels import compat


@pytest.fixture
def nki_compat():
    """The ``nki`` module (our simulator), installed for this test only."""
    with compat.installed() as nki:
        yield nki
