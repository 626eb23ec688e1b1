"""``patch_model`` under expert parallelism on a gloo world of 2 processes: data-parallel attention (each rank its
own sequences, a whole copy of attention), expert-parallel MoE (each rank half the experts), ``generate`` in
lockstep; tokens equal to one process running every rank's sequences (``parallel_worker.py``, suite ``models2``); the
same under transformers' compiled recipe (suites ``compiled2`` and, slow, ``compiled2_slow``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from parallel_harness import assert_scenario, run_world, selected_scenarios  # noqa: E402
from parallel_worker import SUITES  # noqa: E402


@pytest.fixture(scope="module")
def models2(request):
    return run_world(2, "models2", timeout_s=300, only=selected_scenarios(request, "test_models2"))


@pytest.mark.parametrize("scenario", list(SUITES["models2"]))
def test_models2(models2, scenario):
    assert_scenario(models2, scenario)


@pytest.fixture(scope="module")
def compiled2():
    return run_world(2, "compiled2", timeout_s=300)


@pytest.mark.slow  # 26 s on the shared 2-core box (Dynamo traces the decode step on both ranks)
@pytest.mark.parametrize("scenario", list(SUITES["compiled2"]))
def test_compiled2(compiled2, scenario):
    """transformers' compiled recipe (static cache, ``torch.compile(fullgraph=True)``) on the expert-parallel model:
    one decode graph holding the dispatch's functional collectives, tokens equal to eager and to one process."""
    assert_scenario(compiled2, scenario)


@pytest.fixture(scope="module")
def compiled2_slow():
    return run_world(2, "compiled2_slow", timeout_s=600)


@pytest.mark.slow  # ~90 s: Inductor compiles C++ for each model on a 2-core CPU
@pytest.mark.parametrize("scenario", list(SUITES["compiled2_slow"]))
def test_compiled2_slow(compiled2_slow, scenario):
    assert_scenario(compiled2_slow, scenario)
