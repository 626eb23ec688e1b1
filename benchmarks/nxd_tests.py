"""NxD's own MoE unit tests (``test/unit_test/modules/moe``), unmodified, through nxd_moe's front doors on a CPU.

    python benchmarks/nxd_tests.py PATH [--commit REV] [--files test_x.py ...] [--timeout S] [--out FILE]
        [--docs docs/nxd.md] [pytest args...]
    python benchmarks/nxd_tests.py --from-json FILE [--docs docs/nxd.md]   # re-render a run

``PATH`` is github.com/aws-neuron/neuronx-distributed (not vendored): a checkout, or a git directory (a bare clone
too), whose ``REV`` (default ``HEAD``) is read. The benchmark

1. copies the test folder (and the two package ``__init__`` files above it) into a scratch directory, unchanged;
2. runs each test file in its own process, ``python -m nxd_moe.nxd_compat -m nxd_moe.nki_kernels.compat -m pytest
   FILE`` with ``PJRT_DEVICE=CPU`` -- the NxD front door (``neuronx_distributed``, ``torch_neuronx.testing``) and
   the NKI one (``nki``, ``neuronxcc``: NxD's tests import ``nki.language`` and neuronxcc's ``SkipMode``);
3. writes JSON (``--out``): per file and per test the outcome -- passed, *not served* (the test used a training or
   Neuron-kernel name, which raises ``NotServedError`` saying why), failed (with the error), or skipped -- and
   whether the test is an inference, training or Neuron-kernel test; and (``--docs``) replaces the table between
   ``<!-- nxd_tests:begin -->`` and ``<!-- nxd_tests:end -->``.

NxD's tests need ``torch_xla`` (they import it and create a ``torch.distributed`` group with its ``xla`` backend, on
the CPU with ``PJRT_DEVICE=CPU``), ``parameterized``, ``pytest-mock`` and ``transformers``: run it in the environment of
the ``xla`` extra (``pip install -e '.[xla,test]' parameterized pytest-mock``). Extra arguments go to pytest
(``-k 'inference'``, ``--deselect NODE_ID``, ``-x``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nki_library_tests import update_docs  # the table between a docs section's markers

REPO = Path(__file__).resolve().parents[1]
FOLDER = "test/unit_test/modules/moe"
PACKAGE_INITS = ("test/unit_test/__init__.py", "test/unit_test/modules/__init__.py")
FRONT_DOORS = ("-m", "nxd_moe.nxd_compat", "-m", "nxd_moe.nki_kernels.compat")
DEPENDENCIES = ("torch_xla", "parameterized", "pytest_mock", "transformers")

# What each file tests, where the whole file is one kind (NxD's folder; the rest are inference tests, per test).
TRAINING_FILES = {"test_moe_config_validator.py", "test_token_shuffle.py"}
KERNEL_FILES = {"test_bwmm_shard_on_block_kernel_call.py", "test_can_use_blockwise_nki.py",
                "test_can_use_index_calc_kernel.py", "test_can_use_moe_fused_tkg_nki.py", "test_moe_fused_tkg.py",
                "test_moe_fused_tkg_mx.py"}
TRAINING_TESTS = re.compile(r"test_mode='training'|^test_bwd_correctness|^test_loss_fn_correctness")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def prepare(source: Path, commit: str, scratch: Path) -> str:
    """Copy NxD's MoE unit-test folder from ``source`` into ``scratch``; returns the commit it came from."""
    if (source / FOLDER).is_dir():  # a checkout: its files as they are
        for relative in (FOLDER, *PACKAGE_INITS):
            target = scratch / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if (source / relative).is_dir():
                shutil.copytree(source / relative, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source / relative, target)
        try:
            return git("-C", str(source), "rev-parse", "--short", "HEAD")
        except (OSError, subprocess.CalledProcessError):
            return "unknown"
    try:
        resolved = git("--git-dir", str(source), "rev-parse", "--short", f"{commit}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(f"{source}: neither a neuronx-distributed checkout (no {FOLDER}) nor a git directory "
                         f"holding {commit}") from None
    archive = subprocess.run(["git", "--git-dir", str(source), "archive", resolved, FOLDER, *PACKAGE_INITS],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(scratch)], input=archive, check=True)
    return resolved


def missing_dependencies() -> list[str]:
    probe = "import importlib.util, sys; print(','.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    done = subprocess.run([sys.executable, "-c", probe, *DEPENDENCIES], capture_output=True, text=True)
    return [m for m in done.stdout.strip().split(",") if m]


def kind_of(file: str, name: str) -> str:
    if file in TRAINING_FILES or TRAINING_TESTS.search(name):
        return "training"
    return "kernel" if file in KERNEL_FILES else "inference"


def outcome_of(record: dict) -> tuple[str, str]:
    """``(outcome, reason)`` of a test the plugin reported: passed / not_served / failed / skipped."""
    if record["outcome"] == "failed":
        served = re.search(r"NotServedError: (.*? is not served [^\n]*)", record["text"])
        if served:
            return "not_served", served.group(1)
        lines = [line[1:].strip() for line in record["text"].splitlines() if line.startswith("E ")]
        message = record["message"] if not record["message"].startswith("file ") or not lines else lines[0]
        return "failed", message.splitlines()[0][:300] if message else "failed"
    return record["outcome"], record["message"]


def read_log(log: Path) -> tuple[list[str], dict[str, dict], list[dict]]:
    """The plugin's log: collected ids (of the first run), reported tests, collection errors."""
    collected, reported, errors = None, {}, []
    if log.exists():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "collected" in record:
                collected = record["collected"] if collected is None else collected
            elif "collect_error" in record:
                errors.append(record)
            elif reported.get(record["nodeid"], {}).get("outcome") != "failed":  # a failed unittest subTest
                reported[record["nodeid"]] = record  # stays: the test's own report after it says passed
    return collected or [], reported, errors


def run_file(scratch: Path, file: str, pytest_args: list[str], timeout: float) -> dict:
    """Run one file; when a test kills its process (signal or timeout) it is recorded as killed and the tests
    after it run again in a fresh process."""
    log = scratch / f"{file}.jsonl"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONDONTWRITEBYTECODE": "1", "NXD_TESTS_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), str(REPO / "benchmarks"),
                                                       os.environ.get("PYTHONPATH"))))}
    targets, killed, tail = [f"{FOLDER}/{file}"], {}, ""
    start = time.monotonic()
    while True:
        command = [sys.executable, *FRONT_DOORS, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "-p",
                   "_nxd_tests_plugin", *pytest_args]
        timed_out, signal = False, None
        try:
            done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=max(timeout - (time.monotonic() - start), 1))
            signal = -done.returncode if done.returncode < 0 else None
            tail = (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            timed_out = True
        collected, reported, errors = read_log(log)
        pending = [t for t in collected if t not in reported and t not in killed]
        if not pending or not (timed_out or signal):
            break
        if timed_out:
            killed[pending[0]] = f"still running when the file's {timeout:.0f} s ran out"
            killed.update({t: "not run: the file's time ran out" for t in pending[1:]})
            break
        killed[pending[0]] = f"its process was killed by signal {signal} (out of memory?)"
        targets = pending[1:]
        if not targets:
            break
    result = {"file": file, "seconds": round(time.monotonic() - start, 1), "tests": []}
    if errors and not collected:
        result["error"] = errors[0]["message"]
    elif not collected:
        result["error"] = tail or "no test collected"
    for test in collected:
        name = test.split("::")[-1]
        if test in reported:
            outcome, reason = outcome_of(reported[test])
            seconds = reported[test]["seconds"]
        elif test in killed:
            outcome, reason, seconds = "killed", killed[test], None
        else:
            continue  # deselected (-k) or not reached
        result["tests"].append({"name": name, "kind": kind_of(file, name), "outcome": outcome, "reason": reason,
                                "seconds": seconds})
    return result


def summarise(result: dict) -> dict:
    """Counts per kind and outcome, and the distinct reasons of the tests that did not pass."""
    counts = collections.Counter((t["kind"], t["outcome"]) for t in result["tests"])
    reasons = collections.Counter((t["outcome"], t["reason"]) for t in result["tests"] if t["reason"])
    return {"counts": {f"{kind}/{outcome}": n for (kind, outcome), n in sorted(counts.items())},
            "reasons": [{"outcome": o, "reason": r, "tests": n} for (o, r), n in reasons.most_common()]}


def markdown(document: dict) -> str:
    rows = ["| File | Inference tests | Training tests | Neuron-kernel tests | Not passed: why |",
            "|---|---|---|---|---|"]
    for result in document["files"]:
        if result.get("error"):
            rows.append(f"| `{result['file']}` | not collected | | | {result['error'].splitlines()[-1][:200]} |")
            continue
        cells = []
        for kind in ("inference", "training", "kernel"):
            tests = [t for t in result["tests"] if t["kind"] == kind]
            counts = collections.Counter(t["outcome"] for t in tests)
            parts = [f"{counts[o]} {o.replace('_', ' ')}" for o in ("passed", "failed", "not_served", "killed",
                                                                    "skipped") if counts[o]]
            cells.append(f"{len(tests)}: " + ", ".join(parts) if tests else "")
        why = "; ".join(f"{r['tests']} x {r['reason'][:160]}" for r in result["summary"]["reasons"])
        rows.append(f"| `{result['file']}` | {' | '.join(cells)} | {why} |")
    return (f"NxD {document['commit']}, {document['seconds']:.0f} s on {document['cpus']} CPU(s) "
            f"(`benchmarks/nxd_tests.py`):\n\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, help="a neuronx-distributed checkout or git directory")
    parser.add_argument("--commit", default="HEAD", help="revision to read from a git directory (default HEAD)")
    parser.add_argument("--files", nargs="+", help="test files of the folder to run (default: every test_*.py)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per file (default 7200)")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    parser.add_argument("--docs", type=Path, help="replace the nxd_tests table of this markdown file")
    parser.add_argument("--from-json", type=Path, help="re-render a previous --out instead of running")
    args, pytest_args = parser.parse_known_args(argv)
    if args.from_json:
        document = json.loads(args.from_json.read_text())
    else:
        if args.path is None:
            parser.error("give PATH (or --from-json)")
        missing = missing_dependencies()
        if missing:
            raise SystemExit(f"NxD's tests need {missing}: pip install -e '.[xla,test]' parameterized pytest-mock")
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="nxd_tests_") as scratch:
            commit = prepare(args.path, args.commit, Path(scratch))
            files = args.files or sorted(p.name for p in (Path(scratch) / FOLDER).glob("test_*.py"))
            results = []
            for file in files:
                print(f"{file} ...", file=sys.stderr, flush=True)
                result = run_file(Path(scratch), file, pytest_args, args.timeout)
                result["summary"] = summarise(result)
                print(f"  {result.get('error', '').splitlines()[-1:] or result['summary']['counts']}", file=sys.stderr)
                results.append(result)
        document = {"commit": commit, "argv": sys.argv[1:], "seconds": round(time.monotonic() - start, 1),
                    "cpus": len(os.sched_getaffinity(0)), "files": results}
        text = json.dumps(document, indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        else:
            print(text)
    if args.docs:
        update_docs(args.docs, markdown(document), "nxd_tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
