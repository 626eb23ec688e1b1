"""``benchmarks/gpu_suite.sh`` runs every GPU test file: its shards, the computed ``other`` among them, cover
``tests/gpu`` with no file in two shards (a file it left out was never run on the GPU by the suite)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARDS = ("decode", "quantized", "backend", "other", "graphs")


def _files(shard: str, script: str) -> list[str]:
    """The files ``tests_of SHARD`` names in ``script`` (the suite's own functions, sourced; nothing runs)."""
    functions = ("source <(sed -n '/^tests_of()/,/^}/p;/^other_files()/,/^}/p' " + script + ")")
    out = subprocess.run(["bash", "-c", f"{functions} && tests_of {shard}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def _by_shard(script: str = "benchmarks/gpu_suite.sh") -> dict[str, list[str]]:
    return {shard: _files(shard, script) for shard in SHARDS}


def test_every_gpu_test_file_is_in_exactly_one_shard():
    listed = [f for files in _by_shard().values() for f in files if f.startswith("tests/gpu/")]
    expected = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert sorted(listed) == expected


def test_a_suite_without_the_computed_shard_leaves_files_out(tmp_path):
    """Negative control: the same check on a copy whose ``other`` shard names nothing fails."""
    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text().replace("    other) other_files ;;",
                                                                        "    other) ;;")
    broken = tmp_path / "gpu_suite.sh"
    broken.write_text(script)
    listed = [f for files in _by_shard(str(broken)).values() for f in files if f.startswith("tests/gpu/")]
    assert len(listed) < len(list((ROOT / "tests" / "gpu").glob("test_*.py")))
