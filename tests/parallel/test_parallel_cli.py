"""``torchrun --nproc-per-node N -m nxd_moe.cli run --config ... --tp A --ep B``: the README's command works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from parallel_harness import free_port

from nxd_moe.cli import main


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "-m", "nxd_moe.cli", "run", "--no-progress", "--repeats", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})


def test_torchrun_tp_ep_sp_all_to_all_v():
    done = torchrun(2, "--config", "deepseek-v3", "--scale", "64", "--tokens", "32", "--decode-batch", "2",
                    "--tp", "1", "--ep", "2", "--sp", "--dispatch", "all_to_all_v", "--micro-batches", "3",
                    "--transport", "nccl", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # rank 0 alone prints
    assert report["parallel"] == {"world_size": 2, "tensor_model_parallel_size": 1, "expert_model_parallel_size": 2,
                                  "moe_prefill": [1, 2], "moe_decode": [1, 2], "sequence_parallel": True,
                                  "dispatch": "all_to_all_v", "all_to_all_splits": "static", "micro_batches": 3,
                                  "transport": "nccl", "token_groups": 2}
    assert report["shared_experts"] and report["router"] == "GroupLimitedRouter"
    for step in (report["prefill"], report["decode"]):
        assert step["max_abs_err"] < 1e-5 * max(1.0, step["max_abs_ref"])
        assert len(step["bytes_moved_per_rank"]) == 2 and min(step["bytes_moved_per_rank"]) > 0
    assert sum(report["prefill"]["rank_load_per_rank"]) == report["prefill"]["assignments"] == 2 * 32 * 8


@pytest.mark.parametrize("config,layout,fmt", [
    ("deepseek-v3", ("--ep", "2", "--dispatch", "all_to_all_v"), "fp8_block"),
    ("gpt-oss-20b", ("--tp", "2"), "mxfp4"),
])
def test_torchrun_quantized_layer_matches_the_single_device_quantized_run(config, layout, fmt):
    """The issue's two commands: the sharded quantized layer is as close to its float64 reference as one device
    is, and its quantization error (against the same weights unquantized) is the single-device run's."""
    common = ("--config", config, "--quantization", fmt, "--tokens", "32", "--decode-batch", "2", "--json")
    done = torchrun(2, *common, *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    single = subprocess.run([sys.executable, "-m", "nxd_moe.cli", "run", "--no-progress", "--repeats", "1", *common],
                            capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stderr[-3000:]
    alone = json.loads(single.stdout)
    assert report["quantization"] == alone["quantization"] == fmt
    for step in ("prefill", "decode"):
        assert report[step]["max_abs_err"] < 1e-5 * max(1.0, report[step]["max_abs_ref"])
        ratio = report[step]["max_abs_err_vs_unquantized"] / alone[step]["max_abs_err_vs_unquantized"]
        assert 0.5 < ratio < 2.0, (step, report[step], alone[step])  # different tokens per rank under EP
        if "--tp" in layout:  # TP: the same tokens as one device, so the same quantization error
            assert abs(ratio - 1) < 1e-3


def test_model_parallel_without_torchrun_says_how_to_launch(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--config", "mixtral-8x7b", "--tp", "2", "--no-progress"])
    assert exit_info.value.code == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def _benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "parallel_benchmark", Path(__file__).resolve().parents[2] / "benchmarks" / "parallel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_benchmark_smoke_on_cpu(tmp_path):
    """``benchmarks/parallel.py --quick`` stays runnable (gloo, worlds 1 and 2, tiny shapes, eager)."""
    out = tmp_path / "parallel.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "parallel.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--worlds", "1,2", "--configs",
                           "qwen3-30b-a3b,qwen3-235b-a22b",
                           "--formats", "bf16", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["comparison"]
    assert {(r["world_size"], r["layer"], r["phase"]) for r in rows} >= {
        (2, d, p) for d in ("all_gather", "all_to_all_v") for p in ("decode", "prefill")}
    for row in rows:
        if row["world_size"] == 2:
            assert row["bytes_sent_per_rank"] > 0 and row["single_gpu_same_total_ms"] > 0


def test_ep_model_takes_the_assumed_latency_where_no_dispatch_combine_was_measured():
    """A 2-GPU run of a config other than ``--dispatch-config`` times no dispatch+combine: the EP model then uses
    the measured NVLink bandwidth with the assumed latency (it used to fail on an empty list after the run)."""
    import argparse
    import copy

    bench = _benchmark()
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    report = json.loads((results / "parallel_ep2_qwen3_h100x2.json").read_text())
    report["runs"] = {int(w): run for w, run in report["runs"].items()}
    args = argparse.Namespace(scale=1, assumed_latency_us=20.0, assumed_nvlink_GBps=350.0, internode_GBps=50.0)
    assert not report["runs"][2]["dispatch_combine"]
    model = bench.ep_model(copy.deepcopy(report), args)
    assert model["communication"] == "measured" and model["latency"] == "assumed"
    assert model["all_to_all_latency_ms"] == 0.02
    assert model["nvlink_all_to_all_GBps_per_gpu"] == report["runs"][2]["rooflines"]["nvlink_all_to_all_GBps_per_gpu"]
    ep2 = [r for r in model["rows"] if r["ep"] == 2]
    assert ep2 and all(r["predicted_ms"] > r["compute_ms"] > 0 for r in ep2)
    with_latency = copy.deepcopy(report)
    with_latency["runs"][2]["dispatch_combine"] = [{"dispatch": "all_to_all_v", "ms": 0.1}]
    with_latency["runs"][1]["dispatch_combine"] = [{"dispatch": "all_to_all_v", "ms": 0.04}]
    measured = bench.ep_model(with_latency, args)
    assert measured["latency"] == "measured" and abs(measured["all_to_all_latency_ms"] - 0.03) < 1e-12


def test_qwen3_235b_fits_an_h100_per_rank_at_ep2_ep4_ep8():
    """Issue 29: Qwen3-235B-A22B at full size, bf16 and fp8_block, decode 1/8/64 and prefill 2048/8192 tokens per
    rank, fits a 78 GiB H100 per rank at EP2, EP4 and EP8; its weight share is counted from the config's numbers
    (128 experts x 3 x 4096 x 1536, bf16), not from the benchmark's own count. A budget below a step's need skips
    that step (the negative control)."""
    import argparse

    bench = _benchmark()
    args = argparse.Namespace(scale=1, gpu_memory_gib=78.0, worlds=[2, 4, 8], configs=["qwen3-235b-a22b"],
                              formats=["bf16", "fp8_block"], decode=[1, 8, 64], prefill=[2048, 8192])
    plans = bench.memory_plan(args)
    assert {(p["world_size"], p["format"]) for p in plans} == {(w, f) for w in (2, 4, 8) for f in args.formats}
    experts_bytes = 128 * 3 * 4096 * 1536 * 2
    for plan in plans:
        assert plan["fits"], plan
        share = experts_bytes / plan["world_size"] / 2**30  # fp8_block: half the bytes, twice for the repacked copy
        assert share < plan["weights_gib"] < share * 1.01, plan
    ep8 = next(p for p in plans if p["world_size"] == 8 and p["format"] == "bf16")
    tight = argparse.Namespace(**{**vars(args), "gpu_memory_gib": ep8["need_gib"] * 0.9})
    assert not bench.memory_need(tight, "qwen3-235b-a22b", "bf16", 8, [("prefill", 8192)])["fits"]
    assert bench.memory_need(tight, "qwen3-235b-a22b", "bf16", 8, [("decode", 64)])["fits"]


@pytest.mark.slow
def test_benchmark_says_what_does_not_fit_instead_of_crashing(tmp_path):
    """A per-GPU budget between the decode and the prefill step's need (Qwen3-235B-A22B at laptop scale, gloo,
    EP2): the decode steps run, the prefill steps are listed as skipped with both figures, and the run succeeds."""
    import argparse

    import torch

    bench = _benchmark()
    args = argparse.Namespace(scale=64, gpu_memory_gib=1.0)
    weights = bench.layer_bytes(args, "qwen3-235b-a22b", "bf16", torch.float32)
    need = {phase: bench.memory_need(args, "qwen3-235b-a22b", "bf16", 2, [(phase, n)], act_bytes=4,
                                     weights=weights)["need_gib"] for phase, n in (("decode", 2), ("prefill", 32))}
    assert need["decode"] < need["prefill"]
    budget = (need["decode"] + need["prefill"]) / 2
    out = tmp_path / "parallel.json"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parallel.py"),
                           "--quick", "--worlds", "2", "--configs", "qwen3-235b-a22b", "--formats", "bf16",
                           "--gpu-memory-gib", repr(budget), "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(out.read_text())["runs"]["2"]
    assert {s["phase"] for s in run["steps"]} == {"decode"}
    skipped = [s for s in run["skipped"] if s.get("phase") == "prefill"]
    assert len(skipped) == 1 and "does not fit" in skipped[0]["why"] and skipped[0]["tokens_per_rank"] == 32
    assert "skipped: does not fit" in done.stderr


@pytest.mark.slow
def test_ep_host_time_on_gloo():
    """``benchmarks/ep_host_time.py`` runs on a gloo world of 2 and reports every rank's times, the phases it
    profiled and the tensor operations of one call (the static all-to-all's bookkeeping among them)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ep_host_time.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(script), "--scale", "64", "--calls", "5", "--samples", "2", "--profile-calls", "5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert 0 < rank["host_cpu_ms"]["min"] and 0 < rank["wall_ms"]["min"] and rank["graph_ms"] is None
        assert {"agreement_start", "agreement_wait", "all_to_all", "experts", "combine"} <= set(rank["phases_ms"])
        assert rank["ops_per_call"] == sum(rank["ops_by_file"].values())
        assert rank["ops_by_file"]["parallel/all_to_all.py"] > 0
