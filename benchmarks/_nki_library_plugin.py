"""pytest plugin that ``benchmarks/nki_library_tests.py`` loads into every suite process (``-p _nki_library_plugin``).

Each test's dumped artifacts (``--output-directory``, the harness's ``neuron_test_output``) are deleted after it.

Per test it writes JSON lines to ``$NKI_LIBRARY_TESTS_REPORT``: a ``start`` line before the test (so a process that
dies mid-test leaves its culprit named), and an ``end`` line with the outcome, the cause of a failure or skip
(the exception's last line), the duration, the process's memory high-water mark, and one summary per kernel launch
(DMA bytes, instructions per engine, matmul FLOPs, SBUF/PSUM high-water marks, the Trn2 cost model's estimate).

``$NKI_LIBRARY_TESTS_SAMPLE`` (N > 1) keeps every N-th collected test (after the harness's own skips are marked;
the others are deselected): a fixed, deterministic sample of a large suite.

``$NKI_LIBRARY_TESTS_TIMEOUT`` (seconds) bounds each test: the first alarm raises :class:`TestTimeout` in the test;
a test still running a minute later is ended with the process (``os._exit``) after its ``end`` line is written.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import time
from pathlib import Path

import pytest

from nxd_moe.nki_kernels.compat import frontend
from nxd_moe.nki_kernels.cost_model import TRN2

_REPORT = os.environ.get("NKI_LIBRARY_TESTS_REPORT")
_TIMEOUT = float(os.environ.get("NKI_LIBRARY_TESTS_TIMEOUT", "0") or 0)
_SAMPLE = int(os.environ.get("NKI_LIBRARY_TESTS_SAMPLE", "0") or 0)
_HARD_GRACE_S = 60.0


class TestTimeout(Exception):
    """The test ran past the benchmark's per-test timeout."""

    __test__ = False  # not a test class


_launches: list[dict] = []
_reports: dict[str, list] = {}
_current: dict = {}


def _kernel_name(kernel) -> str:
    fn = kernel.fn
    module = getattr(fn, "__module__", "") or ""
    return f"{module.removeprefix('nkilib_src.nkilib.')}.{fn.__qualname__}"


def _record_launch(kernel, run) -> None:
    acc = run.accounting
    estimate = TRN2.estimate_run(run)
    by_engine = acc.instructions_by_engine()
    _launches.append({
        "kernel": _kernel_name(kernel),
        "lnc": run.lnc,
        "dma_bytes": acc.dma_bytes(),
        "dma_transfers": acc.traffic().transfers,
        "instructions": sum(by_engine.values()),
        "instructions_by_engine": by_engine,
        "matmul_flops": acc.matmul_flops,
        "sbuf_high_water_bytes_per_partition": acc.sbuf_high_water,
        "psum_high_water_banks": acc.psum_high_water_banks,
        "estimate_us": estimate.total_ns / 1e3,
        "bound": estimate.bound,
    })


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write(line: dict) -> None:
    if _REPORT:
        with open(_REPORT, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def _cause(report) -> str:
    """The failure's exception line (``Type: message``), or a skip's reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return " ".join(text.split())[:400]


def _end(nodeid: str, extra: dict | None = None) -> None:
    reports = _reports.pop(nodeid, [])
    outcome, cause = "passed", ""
    for r in reports:
        if r.failed:
            outcome = "failed" if r.when == "call" else "error"
            cause = _cause(r)
            break
        if r.skipped:
            outcome = "xfailed" if hasattr(r, "wasxfail") else "skipped"
            cause = r.wasxfail if hasattr(r, "wasxfail") else _cause(r)
            break
        if r.when == "call" and hasattr(r, "wasxfail"):
            outcome = "xpassed"
    line = {"event": "end", "nodeid": nodeid, "outcome": outcome, "cause": cause,
            "seconds": round(time.perf_counter() - _current.get("t0", time.perf_counter()), 3),
            "max_rss_mb": round(_max_rss_mb(), 1), "launches": list(_launches)}
    line.update(extra or {})
    _write(line)


def _alarm(signum, frame):
    if _current.get("alarmed"):
        _end(_current["nodeid"], {"outcome": "failed", "cause": f"TestTimeout: still running {_HARD_GRACE_S:.0f} s "
                                  f"after the {_TIMEOUT:.0f} s timeout; process ended"})
        os._exit(3)
    _current["alarmed"] = True
    signal.setitimer(signal.ITIMER_REAL, _HARD_GRACE_S)
    raise TestTimeout(f"test ran past the per-test timeout of {_TIMEOUT:.0f} s")


def pytest_configure(config) -> None:
    frontend.launch_hooks.append(_record_launch)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    if _SAMPLE > 1:
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % _SAMPLE])
        items[:] = items[::_SAMPLE]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _launches.clear()
    _current.update(nodeid=item.nodeid, t0=time.perf_counter(), alarmed=False)
    _write({"event": "start", "nodeid": item.nodeid})
    if _TIMEOUT > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, _TIMEOUT)
    try:
        yield
    finally:
        if _TIMEOUT > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
        _end(item.nodeid)
        _remove_artifacts(item.config)


def _remove_artifacts(config) -> None:
    """The harness dumps every test's inputs and outputs under ``--output-directory`` (GBs for its sweep tests);
    nothing here reads them, so each test's are deleted after it."""
    root = Path(config.getoption("--output-directory", "neuron_test_output"))  # relative to the working directory
    for path in root.glob("out-*") if root.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _reports.setdefault(item.nodeid, []).append(outcome.get_result())
