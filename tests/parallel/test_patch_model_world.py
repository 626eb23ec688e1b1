"""``patch_model`` under expert parallelism on a gloo world of 2 processes: data-parallel attention (each rank its
own sequences, a whole copy of attention), expert-parallel MoE (each rank half the experts), ``generate`` in
lockstep; tokens equal to one process running every rank's sequences (``parallel_worker.py``, suite ``models2``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from parallel_harness import assert_scenario, run_world  # noqa: E402
from parallel_worker import SUITES  # noqa: E402


@pytest.fixture(scope="module")
def models2():
    return run_world(2, "models2", timeout_s=300)


@pytest.mark.parametrize("scenario", list(SUITES["models2"]))
def test_models2(models2, scenario):
    assert_scenario(models2, scenario)
