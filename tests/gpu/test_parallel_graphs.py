"""The parallel MoE step in one CUDA graph (NCCL).

- Two GPUs or more: a 2-rank NCCL world (``parallel_worker.py`` suite ``nccl2``) captures the whole step -- router,
  dispatch, local experts (torch and triton backends), combine, shared experts -- for EP2 and TP2, both dispatches,
  decode and prefill, and replays it with new inputs: replay == eager, eager == the single-device layer; and
  (``graph/shape_change/...``) around a captured EP2 step, rank 0 alone changes its batch: both ranks raise the
  named "inputs differ across ranks" error within seconds, the replays (which run no agreement) and eager calls
  (which run it with no device sync) still agree afterwards.
- One GPU: a 1-rank NCCL world with the experts sharded anyway (``model_parallel=True``), so that every step of
  the parallel path runs (collectives of one rank are no-ops): capture and replay with new routings equal eager,
  the eager step makes no host sync (``torch.cuda.set_sync_debug_mode``), an out-of-range expert id trips the
  device-side assert, and the exact all-to-all (host-synced by design) refuses to be captured.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))

from conftest import PARALLEL_BF16_TOLERANCE, assert_rounding_close, without_device_sync  # noqa: E402
from parallel_harness import assert_scenario, run_world, selected_scenarios  # noqa: E402
from parallel_worker import SUITES  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def nccl2(request):
    # Only the scenarios this session selected (``-k compiled`` runs the compiled ones, not the whole suite).
    return run_world(2, "nccl2", 600, only=selected_scenarios(request, "test_nccl2_graph_replay"))


@needs_two_gpus
@pytest.mark.parametrize("scenario", list(SUITES["nccl2"]))
def test_nccl2_graph_replay(nccl2, scenario):
    assert_scenario(nccl2, scenario)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_world():
    import torch.distributed as dist

    from nxd_moe import parallel_state

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _layers(dispatch: str, splits: str, backend: str, config: str = "qwen3-30b-a3b"):
    from conftest import randomize_

    from nxd_moe import build_moe
    from nxd_moe.config import ExpertParallelConfig
    from nxd_moe.parallel import load_full_state_dict

    common = dict(scale=16, dtype=torch.bfloat16, device="cuda", seed=0, backend=backend, block_size=16)
    full = randomize_(build_moe(config, model_parallel=False, **common), seed=3)
    par = build_moe(config, model_parallel=True,
                    expert_parallel_config=ExpertParallelConfig(dispatch, all_to_all_splits=splits), **common)
    return full.eval(), load_full_state_dict(par, full.state_dict()).eval()


@needs_cuda
@pytest.mark.parametrize("dispatch,splits", [("all_gather", "static"), ("all_to_all_v", "static")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("batch,seq", [(8, 1), (2, 64)])
@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "deepseek-v3"])  # DeepSeek: shared expert on a side stream
def test_one_rank_parallel_step_in_one_graph(one_rank_world, dispatch, splits, backend, batch, seq, config):
    from nxd_moe.graphs import capture

    full, par = _layers(dispatch, splits, backend, config)
    assert par.expert_parallel is not None
    xs = [torch.randn(batch, seq, full.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    step = capture(lambda x: par(x)[0], xs[0])
    for x in xs:
        with torch.no_grad():
            eager = without_device_sync(lambda x=x: par(x)[0])
            expected = full(x)[0]
        replayed = step(x).clone()
        assert torch.equal(replayed, eager), (replayed - eager).abs().max()
        assert expected.float().abs().max() > 0.01
        assert_rounding_close(eager, expected, PARALLEL_BF16_TOLERANCE, f"{config} {backend} {dispatch}")


@needs_cuda
def test_one_rank_exact_all_to_all_is_not_capturable(one_rank_world):
    from nxd_moe.graphs import capture

    _, par = _layers("all_to_all_v", "exact", "torch")
    x = torch.randn(4, 1, par.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        par(x)
    with pytest.raises(RuntimeError, match="all_to_all_splits='exact'.*cannot be captured"):
        capture(lambda x: par(x)[0], x)
    torch.randn(4, device="cuda")  # the refused capture ended cleanly: the CUDA generator still works


@needs_cuda
def test_out_of_range_expert_index_trips_the_device_assert(tmp_path):
    """A separate process: a device-side assert leaves the CUDA context unusable."""
    script = tmp_path / "bad_index.py"
    script.write_text(textwrap.dedent("""
        import torch
        from nxd_moe import ExpertMLPsV2, RoutedExpertsMLPOpsConfig
        cfg = RoutedExpertsMLPOpsConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                                        hidden_act="silu", glu_mlp=True)
        experts = ExpertMLPsV2(cfg, dtype=torch.bfloat16, device="cuda", backend="triton")
        x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
        affinities = torch.rand(4, 8, device="cuda")
        index = torch.tensor([[0, 1], [2, 3], [4, 9], [5, 6]], device="cuda")
        experts(x, affinities, index)
        torch.cuda.synchronize()
        print("NO ERROR")
    """))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert "NO ERROR" not in done.stdout
    assert "expert_index values must be in [0, 7]" in done.stderr or "device-side assert" in done.stderr, \
        done.stderr[-2000:]


@needs_two_gpus
def test_torchrun_on_two_gpus_defaults_to_bf16_and_reports_graph_replays():
    """``torchrun --nproc-per-node 2 -m nxd_moe.cli run --device cuda ...``: NCCL, one GPU per rank, bf16 by
    default like the single-GPU run, and the whole parallel step's CUDA-graph replay time next to the eager one;
    the exact all-to-all (host-synced) says why it has no graph time instead of hanging."""
    import json

    def torchrun(*args: str) -> dict:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(_free_port()), "-m", "nxd_moe.cli", "run", "--no-progress", "--repeats", "2", "--device",
                   "cuda", "--tokens", "64", "--decode-batch", "4", "--json", *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    report = torchrun("--config", "deepseek-v3", "--ep", "2", "--dispatch", "all_to_all_v", "--backend", "triton",
                      "--quantization", "fp8_block")
    assert report["dtype"] == "bfloat16" and report["device"] == "cuda"
    for step in (report["prefill"], report["decode"]):
        assert step["ms"] > 0 and step["graph_ms"] > 0 and "graph_error" not in step, step
        assert step["max_abs_err"] < 6e-2 * max(1.0, step["max_abs_ref"]), step
    exact = torchrun("--config", "qwen3-30b-a3b", "--ep", "2", "--dispatch", "all_to_all_v", "--all-to-all-splits",
                     "exact", "--dtype", "float32")
    assert exact["dtype"] == "float32"
    for step in (exact["prefill"], exact["decode"]):
        assert "graph_ms" not in step and "capture" in step["graph_error"], step
        assert step["max_abs_err"] < 1e-4 * max(1.0, step["max_abs_ref"]), step
