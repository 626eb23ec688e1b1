"""AWS nki-library's own test suites in ``--test-mode simulation`` on the nxd_moe NKI simulator: the conformance bar.

    python benchmarks/nki_library_tests.py PATH [--suite core/max ...] [--jobs N] [--timeout S] [--mem-gb G]
        [--sample N] [--site DIR] [--out FILE] [--docs docs/nki.md [--docs-section NAME]] [pytest args...]
    python benchmarks/nki_library_tests.py --from-json FILE [--from-json FILE ...] [--out FILE]
        [--docs docs/nki.md [--docs-section NAME]]   # re-render (several runs: merged)

``PATH`` is a checkout of github.com/aws-neuron/nki-library (not vendored). The benchmark

1. makes a scratch copy of it (``--scratch``, default a temporary directory) with exactly three changes, each
   because the public snapshot cannot run otherwise: stand-ins for the two harness files the public snapshot lacks
   (``test/utils/scripts/remote_lock_scripts.py``: the lock-status enum and result record the remote-host lock
   client imports; ``test/utils/perf_analysis_private.py``: ``analyze_trace``, a no-op -- there is no device
   profile to analyse), and one line in ``Orchestrator.__init__`` (``self._compiled_kernel = None``: simulation mode
   reads the attribute, which only compilation sets);
2. runs each suite (a directory or file under ``test/integration/nkilib``; default every ``core/`` family) in its
   own process through the front door ``python -m nxd_moe.nki_kernels.compat -m pytest SUITE --test-mode
   simulation``, ``--jobs`` at a time (``--sample N``: every N-th collected test of each suite; a file that does
   not import is listed and the suite's other files still run), each test under ``--timeout`` seconds and each
   process under ``--mem-gb`` of address space (a test over it fails with ``MemoryError``; where nki-library's own
   input generator or reference is what asks for more, the test is counted *over memory*, apart from passes and
   failures), with the harness's per-test artifact dumps (every input, output and golden: GBs per suite) deleted
   after each test;
3. writes JSON (``--out``): per suite pass / fail / skip counts, per failure its cause, per test its time and memory,
   and for each kernel launch its DMA bytes, instruction counts and the Trn2 cost model's estimate; and (``--docs``)
   replaces the table between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (``--docs-section NAME``, default
   ``nki_library_tests``).

Extra arguments go to pytest (``-k 'lnc-1'``, ``-x``). nki-library's harness needs its test dependencies
(``pandas aws-embedded-metrics boto3 fabric2 filelock plotext pytest-xdist pytest-metadata pytest-html allpairspy
scipy``): install them, or ``pip install --target DIR ...`` and pass ``--site DIR``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
SUITE_ROOT = Path("test/integration/nkilib")
HARNESS_DEPENDENCIES = ("pandas", "aws_embedded_metrics", "boto3", "fabric2", "filelock", "plotext", "xdist",
                        "pytest_metadata", "pytest_html", "allpairspy", "scipy")

REMOTE_LOCK_SCRIPTS = '''"""Stand-in (nxd_moe benchmark) for nki-library's private
test/utils/scripts/remote_lock_scripts.py: the names the remote-host core-lock client imports. Simulation mode
locks no device cores, so nothing here runs."""

import dataclasses
import enum
import json


class LockStatus(enum.Enum):
    ALLOCATED = 0
    NO_CORES = 1
    DRAINING = 2
    DRAINED = 3
    UNDRAINED = 4
    RELEASED = 5
    ERROR = 6
    FLOCK_TIMEOUT = 7

    @property
    def exit_code(self):
        return self.value

    @classmethod
    def from_exit_code(cls, code):
        return next((status for status in cls if status.value == code), None)


@dataclasses.dataclass
class LockResult:
    status: LockStatus = LockStatus.ERROR
    cores: list = dataclasses.field(default_factory=list)
    max_lock_expiry: float = 0.0

    @classmethod
    def from_json(cls, text):
        data = json.loads(text)
        return cls(LockStatus[data["status"]], data.get("cores", []), data.get("max_lock_expiry", 0.0))
'''

PERF_ANALYSIS_PRIVATE = '''"""Stand-in (nxd_moe benchmark) for nki-library's private
test/utils/perf_analysis_private.py. It analyses device profiles; simulation mode has none, so this does nothing."""


def analyze_trace(*args, **kwargs):
    return None
'''

ORCHESTRATOR_ANCHOR = "        self.kernel_under_test: Optional[KernelArgs] = None\n"
ORCHESTRATOR_FIX = ("        self._compiled_kernel = None  # nxd_moe benchmark: simulation mode reads it before it is "
                    "set\n")


def commit_of(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prepare(source: Path, scratch: Path) -> Path:
    """A scratch copy of nki-library ``source`` with the two stand-ins and the one-line fix; returns it."""
    if not (source / SUITE_ROOT).is_dir() or not (source / "test/utils/test_orchestrator.py").is_file():
        raise SystemExit(f"{source}: not an nki-library checkout (no {SUITE_ROOT} / test/utils/test_orchestrator.py)")
    target = scratch / "nki-library"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git", "build", "neuron_test_output",
                                                                  "__pycache__", ".pytest_cache"))
    for relative, text in (("test/utils/scripts/remote_lock_scripts.py", REMOTE_LOCK_SCRIPTS),
                           ("test/utils/perf_analysis_private.py", PERF_ANALYSIS_PRIVATE)):
        path = target / relative
        if not path.exists():  # a later snapshot may ship them
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    orchestrator = target / "test/utils/test_orchestrator.py"
    text = orchestrator.read_text()
    if "self._compiled_kernel = None" not in text.split("def execute", 1)[0]:
        if text.count(ORCHESTRATOR_ANCHOR) != 1:
            raise SystemExit(f"{orchestrator}: cannot place the _compiled_kernel fix (anchor line not found once)")
        orchestrator.write_text(text.replace(ORCHESTRATOR_ANCHOR, ORCHESTRATOR_ANCHOR + ORCHESTRATOR_FIX))
    return target


def default_suites(checkout: Path) -> list[str]:
    core = checkout / SUITE_ROOT / "core"
    return sorted(f"core/{p.name}" for p in core.iterdir() if p.is_dir() and not p.name.startswith("__"))


def environment(checkout: Path, site: list[str], report: Path, timeout: float, outputs: Path | None = None,
                sample: int = 0) -> dict:
    env = dict(os.environ)
    paths = [str(BENCHMARKS), str(REPO), *site, str(checkout / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(NKI_LIBRARY_TESTS_REPORT=str(report), NKI_LIBRARY_TESTS_TIMEOUT=str(timeout),
               NKI_LIBRARY_TESTS_OUTPUTS=str(outputs or ""), NKI_LIBRARY_TESTS_SAMPLE=str(sample),
               NEURON_PYTHONHASHSEED=env.get("NEURON_PYTHONHASHSEED", "0"),  # the ranged sweeps' ids: reproducible
               MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def missing_dependencies(env: dict) -> list[str]:
    probe = ("import importlib.util, sys; "
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    out = subprocess.run([sys.executable, "-c", probe, *HARNESS_DEPENDENCIES], env=env, capture_output=True,
                         text=True)
    return out.stdout.split()


def _limit_memory(gb: float):
    def apply():
        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


_HARD_TIMEOUT_EXIT = 3  # the plugin's exit status for a test still running past its timeout's grace
_MAX_RESTARTS = 3  # per worker slot: a worker that died (hard timeout, killed) is replaced this many times
_DEADLINE_GRACE_S = 60.0  # after --deadline no test starts; those still running are stopped this much later
_ALLOCATION_FAILURE = re.compile(r"MemoryError|Unable to allocate|can't allocate memory")


def _worker(command: list[str], checkout: Path, env: dict, log: Path, mem_gb: float, stop_at: float | None) -> tuple:
    """One pytest process until it exits, or until ``stop_at`` (a ``time.time()``) when it and its process group
    are killed; returns (exit status, whether it was stopped)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,  # its own process group, so a stop reaches all of it
                                preexec_fn=_limit_memory(mem_gb) if mem_gb > 0 else None)
        try:
            return proc.wait(timeout=None if stop_at is None else max(0.0, stop_at - time.time())), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True


def run_pass(checkout: Path, suite: str, pytest_args: list[str], site: list[str], timeout: float, mem_gb: float,
             logs: Path, name: str, workers: int = 1, sample: int = 0, only: list[str] | None = None,
             deadline: float | None = None) -> dict:
    """``workers`` pytest processes sharing one suite's tests (the plugin's claims directory: each test runs once,
    in whichever process is free first), each under ``mem_gb`` of address space with its own report, log and
    artifact folder; ``only``: just these node ids. A worker that dies (the plugin's hard timeout, a kill) is
    replaced and the replacement claims what is left. Returns the records by node id (``event`` ``end``; ``start``
    made a failure or, when stopped at ``deadline``, ``unfinished``; ``claim`` for a test claimed and never
    started), the logs, the tests collected and the first process's exit status."""
    claims = logs / f"{name}.claims"
    shutil.rmtree(claims, ignore_errors=True)
    claims.mkdir(parents=True)
    extra = {"NKI_LIBRARY_TESTS_CLAIMS": str(claims)}
    if only is not None:
        only_file = logs / f"{name}.only"
        only_file.write_text("\n".join(only) + "\n")
        extra["NKI_LIBRARY_TESTS_ONLY"] = str(only_file)
    if deadline is not None:
        extra["NKI_LIBRARY_TESTS_DEADLINE"] = str(deadline)
    stop_at = None if deadline is None else deadline + _DEADLINE_GRACE_S

    def slot(k: int) -> list[tuple]:
        runs = []
        for attempt in range(_MAX_RESTARTS + 1):
            tag = f"{name}.w{k}" + (f".r{attempt}" if attempt else "")
            report, log, outputs = logs / f"{tag}.jsonl", logs / f"{tag}.log", logs / f"{tag}.outputs"
            report.unlink(missing_ok=True)
            env = environment(checkout, site, report, timeout, outputs, sample) | extra
            # each worker its own --output-directory: the plugin empties it after every test
            command = [sys.executable, "-m", "nxd_moe.nki_kernels.compat", "-m", "pytest", str(SUITE_ROOT / suite),
                       "--test-mode", "simulation", "--output-directory", str(outputs), "-p", "_nki_library_plugin",
                       "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors", "-o", "addopts=",
                       *pytest_args]
            returncode, stopped = _worker(command, checkout, env, log, mem_gb, stop_at)
            runs.append((report, log, returncode, stopped, time.time()))
            if stopped or not (returncode == _HARD_TIMEOUT_EXIT or returncode < 0):
                break
        return runs

    with ThreadPoolExecutor(max(1, workers)) as pool:
        runs = [run for slot_runs in pool.map(slot, range(max(1, workers))) for run in slot_runs]
    tests: dict[str, dict] = {}
    collected = 0
    for report, _, returncode, stopped, ended in runs:
        if not report.exists():
            continue
        for line in report.read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "collected":
                collected = max(collected, record["count"])
            elif record["event"] == "claim":
                tests.setdefault(record["nodeid"], record)
            else:
                tests[record["nodeid"]] = record
        for record in tests.values():
            if record["event"] == "start" and "process" not in record:  # this process ended inside this test
                record["process"] = (returncode, stopped, ended)
    for record in tests.values():
        if record["event"] == "start":
            returncode, stopped, ended = record.pop("process")
            record.update(event="end", launches=[], seconds=round(ended - record.pop("time"), 3), **(
                {"outcome": "unfinished", "cause": "stopped at the run's deadline"} if stopped else
                {"outcome": "failed", "cause": f"process died (exit status {returncode}) in this test"}))
    return {"tests": tests, "logs": [run[1] for run in runs], "collected": collected,
            "returncode": runs[0][2]}


def _out_of_memory(record: dict) -> bool:
    """A test that ended in an allocation failure: over the cap in the harness, or in the simulator."""
    return record["outcome"] == "memory" or (record["outcome"] in ("failed", "error")
                                             and bool(_ALLOCATION_FAILURE.search(record.get("cause", ""))))


def run_suite(checkout: Path, suite: str, pytest_args: list[str], site: list[str], timeout: float, mem_gb: float,
              logs: Path, sample: int = 0, workers: int = 1, big_mem_gb: float = 0.0, big_workers: int = 1,
              deadline: float | None = None) -> dict:
    """One suite in ``workers`` processes (:func:`run_pass`); then a second pass, ``big_workers`` processes under
    ``big_mem_gb``, over the tests that ran out of memory under ``mem_gb`` (only when ``big_mem_gb`` is larger)
    and those a dead worker claimed and never started. Returns the suite's per-test records."""
    name = suite.replace("/", "_").removesuffix(".py")
    t0 = time.perf_counter()
    first = run_pass(checkout, suite, pytest_args, site, timeout, mem_gb, logs, name, workers, sample,
                     deadline=deadline)
    tests = first["tests"]
    again = [nodeid for nodeid, record in tests.items()
             if record["event"] == "claim" or (big_mem_gb > mem_gb and _out_of_memory(record))]
    if again and (deadline is None or time.time() < deadline):
        cap = max(mem_gb, big_mem_gb)
        second = run_pass(checkout, suite, pytest_args, site, timeout, cap, logs, f"{name}.again", big_workers,
                          sample, only=again, deadline=deadline)
        for nodeid, record in second["tests"].items():
            if record["event"] == "end":
                tests[nodeid] = record | {"mem_gb": cap, "first_pass": tests[nodeid].get("outcome", "unstarted")}
    for record in tests.values():
        if record["event"] == "claim":
            record.update(outcome="unfinished", cause="claimed, never started: its process ended", launches=[])
    seconds = time.perf_counter() - t0
    text = first["logs"][0].read_text(errors="replace")
    tail = text.splitlines()[-5:]
    # files that do not import (the suite's other files still run: --continue-on-collection-errors)
    not_importing = sorted(set(re.findall(r"^ERROR (\S+\.py)(?: - .*)?$", text, re.M)))
    collection_error = first["returncode"] not in (0, 1, 5) and not tests
    return {"suite": suite, "seconds": round(seconds, 1), "returncode": first["returncode"],
            "log": str(first["logs"][0]), "collected": first["collected"],
            "collection_error": " | ".join(tail) if collection_error else "",
            "files_not_importing": not_importing,
            "tests": [{k: v for k, v in r.items() if k != "event"} for r in tests.values()]}


def _cause_class(cause: str) -> str:
    """A failure cause with its numbers blurred, so one defect groups into one line."""
    cause = re.sub(r"^(?:[\w.]+\.)?(?:InferenceException|ValidationException): ", "", cause)
    return re.sub(r"\d+", "N", cause)[:200]


def summarise(result: dict) -> dict:
    counts = collections.Counter(t["outcome"] for t in result["tests"])
    causes = collections.Counter(_cause_class(t["cause"]) for t in result["tests"] if t["outcome"] in ("failed",
                                                                                                       "error"))
    memory = collections.Counter(_cause_class(t["cause"]) for t in result["tests"] if t["outcome"] == "memory")
    ran = counts["passed"] + counts["failed"] + counts["error"] + counts["xpassed"]
    kernels: dict[str, dict] = {}
    for test in result["tests"]:
        for launch in test.get("launches", []):
            k = kernels.setdefault(launch["kernel"], {"launches": 0, "dma_bytes": [], "instructions": [],
                                                      "estimate_us": []})
            k["launches"] += 1
            for key in ("dma_bytes", "instructions", "estimate_us"):
                k[key].append(launch[key])
    for k in kernels.values():
        for key in ("dma_bytes", "instructions", "estimate_us"):
            values = k[key]
            k[key] = {"min": min(values), "median": sorted(values)[len(values) // 2], "max": max(values)}
    timed = [t for t in result["tests"] if t["outcome"] in ("passed", "failed", "error", "xfailed", "xpassed")]
    return {
        "passed": counts["passed"], "failed": counts["failed"] + counts["error"], "skipped": counts["skipped"],
        "xfailed": counts["xfailed"], "xpassed": counts["xpassed"], "memory": counts["memory"],
        # stopped at the deadline, claimed by a process that died, or never reached (collected, no record)
        "unfinished": counts["unfinished"] + max(0, result.get("collected", 0) - len(result["tests"])),
        "pass_rate_of_run": round(counts["passed"] / ran, 4) if ran else None,
        "max_test_seconds": max((t["seconds"] for t in timed), default=0),
        "max_test_cpu_seconds": max((t.get("cpu_seconds", 0) for t in timed), default=0),
        "test_cpu_seconds": round(sum(t.get("cpu_seconds", 0) for t in result["tests"]), 1),
        "simulator_cpu_seconds": round(sum(t.get("simulator_cpu_seconds", 0) for t in result["tests"]), 1),
        "max_test_simulator_cpu_seconds": max((t.get("simulator_cpu_seconds", 0) for t in timed), default=0),
        "max_rss_mb": max((t["max_rss_mb"] for t in timed if "max_rss_mb" in t), default=0),
        "max_simulator_extra_mb": max((t.get("simulator_extra_mb", 0) for t in timed), default=0),
        "failure_causes": dict(causes.most_common()),
        "memory_causes": dict(memory.most_common()),
        "kernels": kernels,
    }


def markdown(results: list[dict], commit: str, argv: list[str], seconds: float, jobs: int, workers: int = 1) -> str:
    at_once = (f"{jobs} suite process(es) at once" if workers == 1
               else f"{jobs} suite(s) at once, {workers} processes each")
    lines = [f"nki-library `{commit}`, `python benchmarks/nki_library_tests.py {' '.join(argv)}`: {seconds:.0f} s "
             f"wall with {at_once}. Pass rate = passed / tests that ran; *skipped* are the "
             "harness's own (large shapes in simulation, Trn3-only); *over memory* are tests whose nki-library input "
             "generator or reference asks for more than the per-process cap (`--mem-gb`), counted apart and not as "
             "passes. Per test: CPU seconds of all threads (*sim*: inside the simulator's launches) and peak resident "
             "memory (*sim +MB*: what the simulator added to what the test held when the launch began).", "",
             "| suite | passed | failed | skipped | over memory | xfail | pass rate | wall s | CPU s, all tests "
             "(sim) | max test CPU s (sim) | max test MB (sim +MB) | failure causes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        rate = "--" if s["pass_rate_of_run"] is None else f"{100 * s['pass_rate_of_run']:.0f}%"
        causes = "; ".join(f"{n}x `{c}`" for c, n in list(s["failure_causes"].items())[:3]) or r["collection_error"]
        if r.get("files_not_importing"):
            causes += f"{'; ' if causes else ''}does not import: {', '.join(r['files_not_importing'])}"
        lines.append(f"| `{r['suite']}` | {s['passed']} | {s['failed']} | {s['skipped']} | {s['memory']} | "
                     f"{s['xfailed']} | {rate} | {r['seconds']:.0f} | {s['test_cpu_seconds']:.0f} "
                     f"({s['simulator_cpu_seconds']:.0f}) | {s['max_test_cpu_seconds']:.1f} "
                     f"({s['max_test_simulator_cpu_seconds']:.1f}) | {s['max_rss_mb']:.0f} "
                     f"(+{s['max_simulator_extra_mb']:.0f}) | {causes.replace('|', '/') or '--'} |")
    unfinished = {r["suite"]: r["summary"].get("unfinished", 0) for r in results if r["summary"].get("unfinished")}
    if unfinished:
        lines += ["", "Unfinished (the run's `--deadline`, or a worker that died): " + ", ".join(
            f"`{suite}` {n}" for suite, n in unfinished.items()) + " tests, counted in no column above."]
    memory = [(c, n) for r in results for c, n in r["summary"]["memory_causes"].items()]
    if memory:
        lines += ["", "Over memory: " + "; ".join(f"{n}x {c}" for c, n in memory)]
    slowest = sorted((t for r in results for t in r["tests"] if "cpu_seconds" in t and t["outcome"] != "memory"),
                     key=lambda t: -t["cpu_seconds"])[:8]
    if slowest:
        lines += ["", "| slowest tests | outcome | wall s | CPU s | sim CPU s | MB | sim +MB |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| `{t['nodeid'].split('::')[-1]}` | {t['outcome']} | {t['seconds']:.1f} | {t['cpu_seconds']:.1f} | "
                  f"{t.get('simulator_cpu_seconds', 0):.1f} | {t['max_rss_mb']:.0f} | "
                  f"{t.get('simulator_extra_mb', 0):.0f} |" for t in slowest]
    lines += ["", "| kernel (launches) | DMA bytes (median) | instructions (median) | est. us, Trn2 cost model "
              "(min / median / max) |", "|---|---|---|---|"]
    for r in results:
        for name, k in sorted(r["summary"]["kernels"].items()):
            e = k["estimate_us"]
            lines.append(f"| `{name}` ({k['launches']}) | {k['dma_bytes']['median']:,} | "
                         f"{k['instructions']['median']:,} | {e['min']:.1f} / {e['median']:.1f} / {e['max']:.1f} |")
    return "\n".join(lines)


def update_docs(path: Path, table: str, section: str = "nki_library_tests") -> None:
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} section to replace")
    head, rest = text.split(begin, 1)
    path.write_text(f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}")


def merge(documents: list[dict]) -> dict:
    """Several runs' JSON as one (runs that split the suites between calls, e.g. moe_cte's E=64 cases apart): a
    suite that appears in several has their tests (a later run's record of a test wins), their collected counts (a
    test in both once) and wall seconds added; the commands are listed one after another."""
    first = documents[0]
    if any(d["nki_library_commit"] != first["nki_library_commit"] for d in documents):
        raise SystemExit("the runs are of different nki-library commits: "
                         + ", ".join(d["nki_library_commit"] for d in documents))
    suites: dict[str, dict] = {}
    for document in documents:
        for result in document["suites"]:
            merged = suites.setdefault(result["suite"], result | {"tests": [], "seconds": 0.0, "collected": 0})
            before = {t["nodeid"]: t for t in merged["tests"]}
            again = {t["nodeid"]: t for t in result["tests"]}
            merged.update(tests=list((before | again).values()),
                          seconds=round(merged["seconds"] + result["seconds"], 1),
                          # a test both runs recorded was collected by both
                          collected=merged["collected"] + result.get("collected", 0) - len(before.keys() & again))
    shown: list[str] = []
    for document in documents:
        shown += ([";", "python", "benchmarks/nki_library_tests.py"] if shown else []) + _shown(document)
    return first | {"argv": shown, "shown_argv": shown, "seconds": round(sum(d["seconds"] for d in documents), 1),
                    "merged_from": len(documents), "suites": list(suites.values())}


def _shown(document: dict) -> list[str]:
    return document.get("shown_argv") or ["NKI_LIBRARY" if (Path(a) / SUITE_ROOT).is_dir() else a
                                          for a in document["argv"]]


def rerender(paths: list[Path], docs: Path | None, section: str = "nki_library_tests", out: Path | None = None) -> int:
    """The table of earlier runs' JSON (several: :func:`merge`), with the summaries recomputed from the per-test
    records; ``out``: also write the (merged) JSON there."""
    document = merge([json.loads(path.read_text()) for path in paths])
    for result in document["suites"]:
        result["summary"] = summarise(result)
    document["totals"] = {key: sum(r["summary"][key] for r in document["suites"])
                          for key in ("passed", "failed", "skipped", "xfailed", "memory", "unfinished",
                                      "test_cpu_seconds")}
    table = markdown(document["suites"], document["nki_library_commit"], _shown(document), document["seconds"],
                     document["jobs"], document.get("workers", 1))
    print(table)
    if out:
        out.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {out}")
    if docs:
        update_docs(docs, table, section)
        print(f"updated {docs}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, nargs="?", help="an nki-library checkout")
    parser.add_argument("--suite", action="append", default=[],
                        help="a directory or file under test/integration/nkilib (repeatable; default every core/ "
                             "family)")
    parser.add_argument("--jobs", type=int, default=1, help="suites run at once (default 1)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes per suite, sharing its tests (default 1); each under --mem-gb")
    parser.add_argument("--big-mem-gb", type=float, default=0.0,
                        help="re-run the tests that ran out of memory under --mem-gb with this cap (default: no "
                             "second pass for memory)")
    parser.add_argument("--big-workers", type=int, default=0,
                        help="processes for that second pass (default: as many as keep workers x mem-gb, at least 1)")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help=f"seconds for the whole run: no test starts after it, running ones are stopped "
                             f"{_DEADLINE_GRACE_S:.0f} s later and counted unfinished (default: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test (default 300)")
    parser.add_argument("--mem-gb", type=float, default=8.0, help="address space per process in GiB (default 8)")
    parser.add_argument("--sample", type=int, default=0, help="run every N-th collected test of each suite")
    parser.add_argument("--site", action="append", default=[], help="a directory with the harness's dependencies")
    parser.add_argument("--scratch", type=Path, help="where to make the scratch copy (default: a temporary directory)")
    parser.add_argument("--commit", help="the checkout's commit, where PATH is a copy without .git")
    parser.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/nki_library_tests_<commit>"
                                                 ".json)")
    parser.add_argument("--docs", type=Path, help="also write the table into this markdown file's marked section")
    parser.add_argument("--docs-section", default="nki_library_tests",
                        help="the section's marker name: <!-- NAME:begin --> ... <!-- NAME:end -->")
    parser.add_argument("--from-json", type=Path, action="append", default=[],
                        help="run nothing: re-summarise this results file (its tests) and write its table (to --docs); "
                             "repeated: the runs merged (a suite split between runs is one suite), to --out too")
    ns, pytest_args = parser.parse_known_args(argv)
    if ns.from_json:
        return rerender(ns.from_json, ns.docs, ns.docs_section, ns.out)
    if ns.path is None:
        parser.error("the nki-library checkout PATH is required")
    if ns.workers < 1 or ns.jobs < 1:
        parser.error("--workers and --jobs must be at least 1")
    commit = ns.commit or commit_of(ns.path)
    deadline = time.time() + ns.deadline if ns.deadline > 0 else None
    big_workers = ns.big_workers or max(1, int(ns.workers * ns.mem_gb // max(ns.big_mem_gb, ns.mem_gb)))
    scratch = ns.scratch or Path(tempfile.mkdtemp(prefix="nki_library_tests_"))
    checkout = prepare(ns.path.resolve(), scratch.resolve())
    site = [str(Path(s).resolve()) for s in ns.site]
    missing = missing_dependencies(environment(checkout, site, scratch / "probe", 0))
    if missing:
        raise SystemExit(f"nki-library's harness needs {' '.join(missing)} (import names); pip install them, or "
                         "pip install --target DIR ... and pass --site DIR")
    suites = ns.suite or default_suites(checkout)
    logs = scratch / "logs"
    logs.mkdir(exist_ok=True)
    print(f"nki-library {commit}: {len(suites)} suites, {ns.jobs} at a time, {ns.workers} process(es) each; scratch "
          f"copy {checkout}", flush=True)
    t0 = time.perf_counter()
    out = ns.out or BENCHMARKS / "results" / f"nki_library_tests_{commit}.json"
    shown = ["NKI_LIBRARY" if a == str(ns.path) else a for a in map(str, argv)]  # the command, without local paths
    finished: list[dict] = []
    lock = threading.Lock()

    def document() -> dict:
        results = sorted(finished, key=lambda r: suites.index(r["suite"]))
        return {"nki_library_commit": commit, "argv": argv, "shown_argv": shown, "pytest_args": pytest_args,
                "per_test_timeout_s": ns.timeout, "mem_gb": ns.mem_gb, "big_mem_gb": ns.big_mem_gb,
                "jobs": ns.jobs, "workers": ns.workers, "big_workers": big_workers, "deadline_s": ns.deadline,
                "sample": ns.sample, "cpus": os.cpu_count(), "seconds": round(time.perf_counter() - t0, 1),
                "suites_unfinished": [suite for suite in suites if suite not in {r["suite"] for r in results}],
                "totals": {key: sum(r["summary"][key] for r in results)
                           for key in ("passed", "failed", "skipped", "xfailed", "memory", "unfinished",
                                       "test_cpu_seconds")},
                "suites": results}

    def one(suite: str) -> dict:
        if deadline is not None and time.time() >= deadline:
            return {}
        result = run_suite(checkout, suite, pytest_args, site, ns.timeout, ns.mem_gb, logs, ns.sample, ns.workers,
                           ns.big_mem_gb, big_workers, deadline)
        result["summary"] = summarise(result)
        s = result["summary"]
        print(f"  {suite:40s} {s['passed']:4d} passed {s['failed']:4d} failed {s['skipped']:4d} skipped "
              f"{s['memory']:4d} over memory {s['unfinished']:4d} unfinished {result['seconds']:7.1f} s", flush=True)
        with lock:  # written after every suite, so a run cut short still leaves the suites it finished
            finished.append(result)
            out.write_text(json.dumps(document(), indent=1) + "\n")
        return result

    with ThreadPoolExecutor(ns.jobs) as pool:
        list(pool.map(one, suites))
    final = document()
    out.write_text(json.dumps(final, indent=1) + "\n")
    table = markdown(final["suites"], commit, shown, final["seconds"], ns.jobs, ns.workers)
    print(table)
    print(f"wrote {out}")
    if ns.docs:
        update_docs(ns.docs, table, ns.docs_section)
        print(f"updated {ns.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
