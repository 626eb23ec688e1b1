"""pytest plugin that ``benchmarks/nki_library_tests.py`` loads into every suite process (``-p _nki_library_plugin``).

Per test it writes JSON lines to ``$NKI_LIBRARY_TESTS_REPORT``: a ``start`` line before the test (so a process that
dies mid-test leaves its culprit named), and an ``end`` line with the outcome, the cause of a failure or skip
(the exception's last line), the wall and CPU time (in all and inside the simulator's launches), the test's own
memory high-water mark (the process's where the kernel cannot reset it) and what the simulator added to it, and one
summary per kernel launch (DMA bytes, instructions per engine, matmul FLOPs, SBUF/PSUM high-water marks, the Trn2
cost model's estimate).

After each test the folders under ``$NKI_LIBRARY_TESTS_OUTPUTS`` (the harness's ``--output-directory``) are deleted.

``$NKI_LIBRARY_TESTS_SAMPLE`` (N > 1) keeps every N-th collected test (after the harness's own skips are marked;
the others are deselected): a fixed, deterministic sample of a large suite.

``$NKI_LIBRARY_TESTS_ONLY`` (a file of node ids, one a line) keeps only those tests: the benchmark's second pass
re-runs a suite's over-memory and unstarted tests under a larger cap.

``$NKI_LIBRARY_TESTS_CLAIMS`` (a directory) lets several processes share one suite: every process collects the same
tests, and runs a test only after creating its claim file there first (``O_EXCL``), so each test runs once and a
process that finishes early takes the next unclaimed one -- a queue with no coordinator. A process claims its next
test just before starting the current one (pytest tears fixtures down by the next item it will run), so the report
gets a ``claim`` line for it: a process that dies leaves at most that one test claimed and unstarted, and the
benchmark re-runs it. ``$NKI_LIBRARY_TESTS_DEADLINE`` (a ``time.time()``) stops claiming at that time.

``$NKI_LIBRARY_TESTS_TIMEOUT`` (seconds) bounds each test: the first alarm raises :class:`TestTimeout` in the test;
a test still running a minute later is ended with the process (``os._exit``) after its ``end`` line is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import time
import traceback
from pathlib import Path

import pytest

from nxd_moe.nki_kernels.compat import frontend
from nxd_moe.nki_kernels.cost_model import TRN2
from nxd_moe.nki_kernels.machine import running_core

_REPORT = os.environ.get("NKI_LIBRARY_TESTS_REPORT")
_OUTPUTS = os.environ.get("NKI_LIBRARY_TESTS_OUTPUTS")
_TIMEOUT = float(os.environ.get("NKI_LIBRARY_TESTS_TIMEOUT", "0") or 0)
_SAMPLE = int(os.environ.get("NKI_LIBRARY_TESTS_SAMPLE", "0") or 0)
_ONLY = os.environ.get("NKI_LIBRARY_TESTS_ONLY")
_CLAIMS = os.environ.get("NKI_LIBRARY_TESTS_CLAIMS")
_DEADLINE = float(os.environ.get("NKI_LIBRARY_TESTS_DEADLINE", "0") or 0)
_HARD_GRACE_S = 60.0


class TestTimeout(Exception):
    """The test ran past the benchmark's per-test timeout."""

    __test__ = False  # not a test class


_launches: list[dict] = []
_reports: dict[str, list] = {}
_current: dict = {}


def _kernel_name(fn) -> str:
    module = getattr(fn, "__module__", "") or ""
    return f"{module.removeprefix('nkilib_src.nkilib.')}.{fn.__qualname__}"


def _nested_call(self, *args, **kwargs):
    """``Kernel.__call__``, noting the first library kernel a test's jitted wrapper calls inside a launch (the harness
    launches wrappers such as ``moe_cte_kernel_wrapper``; the table names the kernel they run)."""
    if running_core() is not None and not _nested:
        _nested.append(_kernel_name(self.fn))
    return _kernel_call(self, *args, **kwargs)


_kernel_call = frontend.Kernel.__call__
_nested: list[str] = []
_host_run = frontend._run  # simulate / cpu_simulate / run all launch through it


def _timed_run(*args, **kwargs):
    """``frontend._run`` (every host launch goes through it), timed: the simulator's share of a test's time, and the
    memory it adds on top of what the test held when the launch began."""
    _current["peak_before_mb"] = max(_current.get("peak_before_mb", 0), _max_rss_mb())
    rss0 = _status_mb("VmRSS:")
    _reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        return _host_run(*args, **kwargs)
    finally:
        _current["simulator_seconds"] += time.perf_counter() - t0
        _current["simulator_cpu_seconds"] += time.process_time() - c0
        if rss0 is not None:
            _current["simulator_extra_mb"] = max(_current["simulator_extra_mb"], (_status_mb("VmHWM:") or 0) - rss0)


def _record_launch(kernel, run) -> None:
    acc = run.accounting
    estimate = TRN2.estimate_run(run)
    by_engine = acc.instructions_by_engine()
    launched = _kernel_name(kernel.fn)
    inner = _nested[0] if _nested and launched.startswith("test.") else None
    _nested.clear()
    _launches.append({
        "kernel": inner or launched,
        "launched": launched,
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


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (Linux >= 4.0), so each test reports its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _max_rss_mb() -> float:
    """This test's peak resident memory (``VmHWM`` since the per-test reset), else the process's."""
    if _current.get("peak_reset"):
        return max(_current.get("peak_before_mb", 0), _status_mb("VmHWM:") or 0)
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
            if getattr(r, "harness_memory", ""):  # not the simulator's: the harness needs more than the process may
                outcome = "memory"
                cause = f"nki-library's {r.harness_memory} needs more memory than the cap: {cause}"
            break
        if r.skipped:
            outcome = "xfailed" if hasattr(r, "wasxfail") else "skipped"
            cause = r.wasxfail if hasattr(r, "wasxfail") else _cause(r)
            break
        if r.when == "call" and hasattr(r, "wasxfail"):
            outcome = "xpassed"
    line = {"event": "end", "nodeid": nodeid, "outcome": outcome, "cause": cause,
            "seconds": round(time.perf_counter() - _current.get("t0", time.perf_counter()), 3),
            "cpu_seconds": round(time.process_time() - _current.get("cpu0", time.process_time()), 3),
            "simulator_seconds": round(_current.get("simulator_seconds", 0), 3),
            "simulator_cpu_seconds": round(_current.get("simulator_cpu_seconds", 0), 3),
            "simulator_extra_mb": round(_current.get("simulator_extra_mb", 0), 1),
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
    frontend.Kernel.__call__ = _nested_call
    frontend._run = _timed_run


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    if _SAMPLE > 1:
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % _SAMPLE])
        items[:] = items[::_SAMPLE]
    if _ONLY:
        wanted = set(Path(_ONLY).read_text().splitlines())
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
        items[:] = [item for item in items if item.nodeid in wanted]
    _write({"event": "collected", "count": len(items)})


def _claim(nodeid: str) -> bool:
    """Whether this process may run ``nodeid``: it created the test's claim file (no other process had)."""
    name = hashlib.sha1(nodeid.encode()).hexdigest()  # node ids hold "/", "[", spaces
    try:
        os.close(os.open(os.path.join(_CLAIMS, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    _write({"event": "claim", "nodeid": nodeid})
    return True


def _claimed(items):
    """The items this process claims, each claimed only when the loop asks for it (so a process that runs slow
    tests claims fewer); none once the deadline has passed."""
    for item in items:
        if _DEADLINE and time.time() >= _DEADLINE:
            return
        if _claim(item.nodeid):
            yield item


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """pytest's own loop over the tests this process claims (``$NKI_LIBRARY_TESTS_CLAIMS``), with each item's
    ``nextitem`` the next one it will run, as the fixture teardown needs; pytest's loop when not sharing."""
    if not _CLAIMS:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    if session.config.option.collectonly:
        return True
    claimed = _claimed(session.items)
    item = next(claimed, None)
    while item is not None:
        nextitem = next(claimed, None)
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        item = nextitem
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _launches.clear()
    _nested.clear()
    _current.update(nodeid=item.nodeid, t0=time.perf_counter(), cpu0=time.process_time(), alarmed=False,
                    peak_reset=_reset_peak_rss(), simulator_seconds=0.0, simulator_cpu_seconds=0.0,
                    simulator_extra_mb=0.0, peak_before_mb=0.0)
    _write({"event": "start", "nodeid": item.nodeid, "time": time.time()})
    if _TIMEOUT > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, _TIMEOUT)
    try:
        yield
    finally:
        if _TIMEOUT > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
        _end(item.nodeid)
        _remove_artifacts()


def _remove_artifacts() -> None:
    """Delete the test's artifact folders under the harness's ``--output-directory``: in simulation mode it dumps
    every input, output and golden there (up to 1.7 GB per moe_tkg test; the suite would fill a disk), and nothing
    here reads them."""
    if not _OUTPUTS or not os.path.isdir(_OUTPUTS):
        return
    for entry in os.scandir(_OUTPUTS):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        report.harness_memory = _harness_allocation(call.excinfo)
    _reports.setdefault(item.nodeid, []).append(report)


def _harness_allocation(excinfo) -> str:
    """For an allocation failure raised outside the simulator's launches (nki-library's own input generator or
    torch reference, under the benchmark's address-space cap) -- a ``MemoryError`` or torch's "can't allocate
    memory", possibly wrapped by the harness (``ValidationException`` from it, or a negative test's
    ``AssertionError`` that the kernel's validation message is missing) -- where, as ``file:line`` (the innermost
    frame of nki-library's code); else ``""``. The front door's stand-ins that the harness calls outside a launch
    (``neuron_dtypes.static_cast`` on its inputs) are the harness's allocations; one raised inside a launch (an
    ``_timed_run`` frame on its traceback) is the simulator's, a failure."""
    error = excinfo.value
    while error is not None and not _allocation_failure(error):
        error = error.__cause__ or error.__context__
    if error is None:
        return ""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    if any(frame.f_code is _timed_run.__code__ for frame in frames):
        return ""
    theirs = [frame for frame in frames if frame.f_code.co_filename.endswith(".py")
              and not any(part in frame.f_code.co_filename for part in ("numpy", "/torch/", "/nxd_moe/"))]
    if not theirs:
        return ""
    innermost = theirs[-1]
    return f"{Path(innermost.f_code.co_filename).name}:{innermost.f_lineno}"


def _allocation_failure(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError)
                                              and "can't allocate memory" in str(error))
