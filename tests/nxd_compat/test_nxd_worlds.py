"""NxD-style code on gloo worlds started by torchrun through the front door (``torchrun ... -m nxd_moe.nxd_compat
tests/nxd_compat/nxd_world.py``): the deep dive's ``initialize_model_parallel`` calls with its MoE layer, NxDI's
MoE-only and hybrid sharding, NxD's parallel_state and mappings. World 2 runs by default; world 4 (the deep dive's
TP x EP layouts) is marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_harness import assert_scenario, free_port  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "nxd_world.py"
SUITE_NAMES = {
    "nxd_world2": ["deep_dive/tp2", "deep_dive/ep2", "deep_dive/tp8_in_a_world_of_2", "nxd/parallel_state",
                   "nxd/moe_process_group", "nxd/mappings", "nxdi/moe_ep2", "nxdi/hybrid"],
    "nxd_world4": ["deep_dive/tp4", "deep_dive/ep4", "deep_dive/tp2ep2"],
}


def torchrun_world(nproc: int, suite: str, timeout_s: float = 300) -> dict[str, list[str]]:
    """``{scenario: [status of rank 0, ...]}`` from the ranks' result files (tests/parallel's format)."""
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   str(free_port()), "-m", "nxd_moe.nxd_compat", str(SCRIPT), suite, out_dir]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        per_rank = [json.loads(p.read_text()) if (p := Path(out_dir) / f"rank{r}.json").exists() else {}
                    for r in range(nproc)]
    out = {name: [results.get(name, "missing") for results in per_rank] for name in SUITE_NAMES[suite]}
    if done.returncode:
        out["__world__"] = [f"torchrun exit code {done.returncode}; stderr tail:\n{done.stderr[-3000:]}"]
    return out


@pytest.fixture(scope="module")
def world2():
    return torchrun_world(2, "nxd_world2")


@pytest.fixture(scope="module")
def world4():
    return torchrun_world(4, "nxd_world4")


@pytest.mark.parametrize("scenario", SUITE_NAMES["nxd_world2"])
def test_world2(world2, scenario):
    assert_scenario(world2, scenario)


@pytest.mark.parametrize("scenario", SUITE_NAMES["nxd_world4"])  # ~16 s: CI runs the TP x EP world of 4
def test_world4(world4, scenario):
    assert_scenario(world4, scenario)
