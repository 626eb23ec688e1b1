"""pytest plugin of ``benchmarks/nxd_tests.py``: appends the collected test ids, then each test's outcome as it
finishes, to the JSON-lines file ``$NXD_TESTS_LOG``, so a test that kills its process (out of memory) loses only
itself; the benchmark runs the tests after it again."""

from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    with open(os.environ["NXD_TESTS_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"collect_error": report.nodeid, "message": _message(report), "text": str(report.longrepr)[-3000:]})


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _write({"nodeid": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2),
                "message": "" if report.passed else _message(report),
                "text": str(report.longrepr)[-3000:] if report.failed else ""})
