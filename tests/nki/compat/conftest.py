"""The ``nki_compat`` fixture (installs ``nki`` for one test) and ``nki_style``: the kernels of
``nki_style_kernels.py``, imported with ``import nki.language as nl`` while the API is installed."""

from __future__ import annotations

import importlib
import sys

import pytest

from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture

STYLE_MODULE = "nki_style_kernels"


@pytest.fixture
def nki_style(nki_compat):  # noqa: F811 -- the fixture above
    sys.modules.pop(STYLE_MODULE, None)
    module = importlib.import_module(STYLE_MODULE)
    yield module
    sys.modules.pop(STYLE_MODULE, None)
