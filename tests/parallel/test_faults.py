"""A rank that dies mid-run makes the others fail within the configured collective timeout -- never hang.

Two gloo processes build an expert-parallel layer; rank 1 then exits without a word, rank 0 calls the layer. The
MoE groups were made with ``collective_timeout_s=3``: rank 0 must raise (a connection error as soon as gloo sees
the peer gone, at the latest the timeout) and exit well within the test's limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from parallel_harness import free_port

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import datetime, os, sys, time
    sys.path[:0] = [{tests!r}, {root!r}]
    import torch, torch.distributed as dist
    from conftest import make_config, random_routing, randn
    from nxd_moe import ExpertMLPsV2, parallel_state
    from nxd_moe.config import ExpertParallelConfig
    from nxd_moe.parallel import ExpertParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel(1, 2, collective_timeout_s=3)
    layer = ExpertParallel(ExpertMLPsV2(make_config(num_experts=4),
                                        expert_parallel_config=ExpertParallelConfig({dispatch!r})))
    affinities, index = random_routing(4, 4, 2, seed=1)
    x = randn(4, 16, seed=2)
    layer(x, affinities, index)  # both ranks: shapes agreed on, everything warm
    if dist.get_rank() == 1:
        os._exit(0)
    time.sleep(0.5)
    start = time.perf_counter()
    try:
        layer(x, affinities, index)
    except Exception as e:
        print(f"RAISED after {{time.perf_counter() - start:.1f}} s: {{type(e).__name__}}", flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all_v"])
def test_a_dead_rank_makes_the_others_fail_within_the_timeout(tmp_path, dispatch):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT), dispatch=dispatch))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    start = time.perf_counter()
    try:
        out0, _ = procs[0].communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert "RAISED" in out0, out0[-2000:]
    assert time.perf_counter() - start < 45
