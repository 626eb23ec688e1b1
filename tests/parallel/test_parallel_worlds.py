"""The parallel MoE on gloo worlds of 2 and 4 processes: every layout (TP, EP, TP+EP, hybrid prefill/decode
sharding), sequence parallelism on and off, both dispatches, every expert mode, shared experts, capacity drops,
EPLB, bytes moved, a negative control, checkpoint loading, and bad configurations failing on every rank.

Each world is one set of processes running all its scenarios (``parallel_worker.py``); a scenario that fails
on any rank stops the world, and the scenarios after it report as skipped.
"""

from __future__ import annotations

import pytest
from parallel_harness import assert_scenario, run_world
from parallel_worker import SUITES

WORLD_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def world2():
    return run_world(2, "world2", WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4():
    return run_world(4, "world4", WORLD_TIMEOUT_S)


@pytest.mark.parametrize("scenario", list(SUITES["world2"]))
def test_world2(world2, scenario):
    assert_scenario(world2, scenario)


@pytest.mark.parametrize("scenario", list(SUITES["world4"]))
def test_world4(world4, scenario):
    assert_scenario(world4, scenario)
