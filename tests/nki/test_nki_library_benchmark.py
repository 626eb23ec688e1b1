"""``benchmarks/nki_library_tests.py`` on a stand-in suite laid out like nki-library's (no nki-library needed): several
worker processes share a suite's tests, each test runs once, a dead worker is replaced, out-of-memory tests get a
second pass under a larger cap, the harness's allocations (our ``neuron_dtypes`` stand-in included) count as over
memory while the simulator's are failures, and a deadline leaves the rest unfinished."""

from __future__ import annotations

import collections
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import nki_library_tests as bench  # noqa: E402

SUITE = "core/fake/test_fake.py"
PASSING = 6

CONFTEST = """
def pytest_addoption(parser):  # the options the benchmark passes nki-library's harness
    parser.addoption("--test-mode")
    parser.addoption("--output-directory")
"""

TESTS = f"""
import os
import signal
import time

import numpy as np
import pytest

GIB = 2**30


def test_worker_dies():  # first: its process has claimed the next test already, and never starts it
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("i", range({PASSING}))
def test_passes(i):
    time.sleep(1.5)  # long enough that a replaced worker, starting seconds later on a busy host, gets some


def test_fails():
    assert False, "a plain failure"


def test_harness_memory():  # the harness's own input: 2 GiB, over a 2 GiB cap, within 4
    np.empty(2 * GIB, np.uint8)


def test_static_cast_memory():  # the harness converting its input through our neuron_dtypes stand-in
    from nxd_moe.nki_kernels.compat import neuron_dtypes
    neuron_dtypes.static_cast(np.broadcast_to(np.float64(1), (GIB // 2,)), np.float32)


def test_simulator_memory():  # inside a launch: the simulator's allocation, a failure under any cap here
    import nki

    def kernel(a):
        np.empty(64 * GIB, np.uint8)
        return a

    nki.simulate(kernel)(np.zeros((128, 1), np.float32))

"""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nki-library")
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(CONFTEST)
    suite = root / bench.SUITE_ROOT / SUITE
    suite.parent.mkdir(parents=True)
    suite.write_text(textwrap.dedent(TESTS))
    return root


def _run(checkout: Path, logs: Path, pytest_args: tuple = (), **kwargs) -> dict:
    logs.mkdir()
    result = bench.run_suite(checkout, SUITE, list(pytest_args), [], timeout=60, logs=logs, **kwargs)
    result["summary"] = bench.summarise(result)
    return result


@pytest.fixture(scope="module")
def shared(checkout, tmp_path_factory) -> dict:
    return _run(checkout, tmp_path_factory.mktemp("shared") / "logs", mem_gb=2, workers=2, big_mem_gb=4,
                big_workers=1)


def _by_test(result: dict) -> dict:
    return {t["nodeid"].split("::")[-1]: t for t in result["tests"]}


def test_two_workers_run_every_test_once_and_both_take_some(shared):
    tests = _by_test(shared)
    assert shared["collected"] == PASSING + 5 and len(shared["tests"]) == len(tests) == PASSING + 5
    assert all(tests[f"test_passes[{i}]"]["outcome"] == "passed" for i in range(PASSING))
    assert tests["test_fails"]["outcome"] == "failed" and "a plain failure" in tests["test_fails"]["cause"]
    logs = Path(shared["log"]).parent
    ended = [sum('"event": "end"' in line for report in logs.glob(f"core_fake_test_fake.w{slot}*.jsonl")
                 for line in report.open()) for slot in (0, 1)]
    assert all(ended), ended  # both first-pass worker slots (a replaced worker's successor included) ran tests
    ends = collections.Counter(json.loads(line)["nodeid"].split("::")[-1] for report in logs.glob("*.jsonl")
                               for line in report.open() if '"event": "end"' in line)
    for name, record in tests.items():  # each test ran in one process; a retried one once more
        expected = 0 if name == "test_worker_dies" else 1 + (record.get("first_pass", "unstarted") != "unstarted")
        assert ends[name] == expected, (name, ends[name], record)


def test_a_dead_worker_is_replaced_and_its_test_is_a_failure(shared):
    tests = _by_test(shared)
    assert tests["test_worker_dies"]["outcome"] == "failed"
    assert tests["test_worker_dies"]["cause"] == "process died (exit status -9) in this test"
    assert shared["summary"]["unfinished"] == 0  # the test it had claimed next ran, in a later process
    assert [t["first_pass"] for t in tests.values() if t.get("first_pass") == "unstarted"] == ["unstarted"]


def test_harness_allocations_are_over_memory_and_pass_under_the_larger_cap(shared):
    tests = _by_test(shared)
    for name in ("test_harness_memory", "test_static_cast_memory"):
        assert tests[name]["first_pass"] == "memory", tests[name]
        assert tests[name]["outcome"] == "passed" and tests[name]["mem_gb"] == 4


def test_an_allocation_inside_a_launch_is_the_simulators_failure(shared):
    record = _by_test(shared)["test_simulator_memory"]
    assert record["first_pass"] == "failed" and record["outcome"] == "failed", record
    assert "Unable to allocate" in record["cause"]


def test_without_a_larger_cap_over_memory_stays_over_memory(checkout, tmp_path):
    result = _run(checkout, tmp_path / "logs", mem_gb=2, workers=1, pytest_args=("-k", "not worker_dies"))
    tests = _by_test(result)
    assert tests["test_harness_memory"]["outcome"] == "memory" and "mem_gb" not in tests["test_harness_memory"]
    assert "test_fake.py:" in tests["test_harness_memory"]["cause"]  # where in their code, as file:line
    assert result["summary"]["passed"] == PASSING and result["summary"]["memory"] == 2


def test_a_deadline_leaves_the_rest_unfinished(checkout, tmp_path):
    result = _run(checkout, tmp_path / "logs", mem_gb=2, workers=1, deadline=time.time())
    assert result["collected"] == PASSING + 5 and result["tests"] == []
    assert result["summary"]["unfinished"] == PASSING + 5 and result["summary"]["passed"] == 0


def test_runs_that_split_a_suite_merge_into_one():
    def run(suite, tests, collected, seconds, argv):
        return {"nki_library_commit": "abc", "argv": argv, "shown_argv": argv, "jobs": 1, "seconds": seconds,
                "suites": [{"suite": suite, "seconds": seconds, "collected": collected, "tests": tests}]}

    def test(nodeid, outcome):
        return {"nodeid": nodeid, "outcome": outcome, "cause": "", "seconds": 1.0}

    cte = run("core/moe/moe_cte", [test("a", "passed"), test("big", "memory")], 2, 10.0, ["-k", "not 64"])
    cte64 = run("core/moe/moe_cte", [test("big", "passed"), test("c", "passed")], 2, 30.0, ["-k", "64"])
    tkg = run("core/moe/moe_tkg", [test("t", "failed")], 1, 5.0, ["--suite", "tkg"])
    merged = bench.merge([cte, cte64, tkg])
    assert [r["suite"] for r in merged["suites"]] == ["core/moe/moe_cte", "core/moe/moe_tkg"]
    suite = merged["suites"][0]
    assert {t["nodeid"]: t["outcome"] for t in suite["tests"]} == {"a": "passed", "big": "passed", "c": "passed"}
    assert suite["collected"] == 3 and suite["seconds"] == 40.0 and merged["seconds"] == 45.0  # "big": once
    assert bench.summarise(suite)["passed"] == 3 and bench.summarise(suite)["unfinished"] == 0
    assert merged["shown_argv"].count(";") == 2
    with pytest.raises(SystemExit, match="different nki-library commits"):
        bench.merge([cte, tkg | {"nki_library_commit": "def"}])
