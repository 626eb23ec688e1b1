"""Start a gloo world of N processes on this machine, run a suite of scenarios on every rank, collect the results.

Each rank is a plain subprocess (``parallel_worker.py``) with torchrun's environment variables, so nothing is
pickled across processes and a hung world is killed after ``timeout_s``. Every rank records each scenario as
``"ok"``, ``"FAIL ..."`` (with the traceback) or ``"skipped ..."`` in a JSON file, rewritten after each scenario
so that the results of a world that had to be killed survive.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "parallel_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world_size: int, suite: str, timeout_s: float, only: list[str] | None = None) -> dict[str, list[str]]:
    """``{scenario: [status of rank 0, rank 1, ...]}``; scenarios a rank never reached read ``"missing"``.
    ``only``: run just these scenarios of the suite (in its order), e.g. those a ``pytest -k`` selected."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = []
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "PYTHONWARNINGS": "ignore"}
            if only is not None:
                env["PARALLEL_SCENARIOS"] = json.dumps(sorted(only))
            log = open(Path(out_dir) / f"log{rank}.txt", "w")
            procs.append((subprocess.Popen([sys.executable, str(WORKER), suite, out_dir], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        timed_out = False
        try:
            for proc, _ in procs:
                proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            alive = [proc for proc, _ in procs if proc.poll() is None]
            for proc in alive:  # the worker dumps every thread's stack to its log on SIGUSR1
                proc.send_signal(signal.SIGUSR1)
            if alive:
                time.sleep(2)
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        per_rank = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.json"
            per_rank.append(json.loads(path.read_text()) if path.exists() else {})
        logs = [(Path(out_dir) / f"log{rank}.txt").read_text()[-6000:] for rank in range(world_size)]
    names = {name for results in per_rank for name in results}
    out = {name: [results.get(name, "missing") for results in per_rank] for name in names}
    if timed_out:
        out["__world__"] = [f"timed out after {timeout_s} s; log tail:\n{log}" for log in logs]
    elif any(proc.returncode for proc, _ in procs):
        out["__world__"] = [f"exit code {proc.returncode}; log tail:\n{log}" for (proc, _), log in zip(procs, logs)]
    return out


def selected_scenarios(request, test_name: str) -> list[str]:
    """The ``scenario`` parameters of the tests named ``test_name`` that this pytest session runs (after ``-k``)."""
    return [item.callspec.params["scenario"] for item in request.session.items
            if getattr(item, "originalname", None) == test_name and hasattr(item, "callspec")]


def assert_scenario(results: dict[str, list[str]], name: str) -> None:
    """Every rank ran ``name`` and passed it; otherwise fail with each rank's message."""
    statuses = results.get(name)
    problems = results.get("__world__", [])
    assert statuses is not None, f"scenario {name!r} never ran\n" + "\n".join(problems)
    assert all(s == "ok" for s in statuses), f"scenario {name!r}:\n" + "\n".join(
        f"rank {r}: {s}" for r, s in enumerate(statuses)) + ("\n" + "\n".join(problems) if problems else "")
