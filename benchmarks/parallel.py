"""Expert-parallel MoE on several GPUs (NCCL) or CPU processes (gloo): all-gather vs all-to-all-v dispatch, and
EP scaling of a DeepSeek-V3-sized layer.

What is measured
----------------
One MoE layer of DeepSeek-V3 (``configs/deepseek-v3.yaml``: H=7168, I=2048, 256 routed experts, top-8,
group-limited router, one shared expert; ``--scale`` divides H and I), random weights, bf16 on GPU (fp32 on CPU),
expert parallelism over all ranks of the world (TP=1, EP=N: each rank is its own token group, as with
data-parallel attention, and feeds its own tokens).

1. **Dispatch** (worlds of 2 and more ranks): for each prefill length and decode batch *per rank*, the layer's
   latency with ``all_gather`` (NxD's: every rank gathers every token, computes its local experts, reduce-scatter)
   and with ``all_to_all_v`` (tokens go only to the ranks that hold one of their experts), interleaved
   repetition by repetition; the bytes each rank received (the layer's own count, ``ExpertsStats.communication``);
   ratios a2a / all-gather; and the largest difference between the two dispatches' outputs.
2. **EP scaling**: a fixed *global* prefill (``--scaling-prefill-tokens``) and decode batch
   (``--scaling-decode-batch``) split over 1, 2, 4 ... ranks (EP = world size; EP=1 is the single-device layer
   holding all experts): latency, tokens/s and speed-up over EP=1, for both dispatches.

Method: after warm-up, each repetition runs every contender once (rotating the start); a call is timed from a
barrier + device sync to a device sync; the reported time is the median over repetitions of the slowest rank
(a layer waits for its slowest rank), with p10/p90. Routing comes from the layer's own router on random inputs
(roughly uniform over experts; no EPLB).

Run: ``python benchmarks/parallel.py --device cuda --worlds 1,2,4 --out benchmarks/results/parallel.json``
(the script starts ``torchrun`` itself for each world size). CPU smoke test (gloo, tiny shapes, seconds):
``python benchmarks/parallel.py --quick``. Output: one JSON object on stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nxd_moe import build_moe, load_model_config, parallel_state  # noqa: E402
from nxd_moe.config import EXPERT_PARALLEL_DISPATCHES, ExpertParallelConfig  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------------------
# worker: one rank of a torchrun world


def build_layers(args, device: torch.device, dtype: torch.dtype) -> dict:
    """One layer per dispatch, sharing the same weight tensors."""
    model = load_model_config(args.config)
    common = dict(scale=args.scale, dtype=dtype, seed=0, block_size=args.block_size, backend=args.backend)
    first = build_moe(model, device=device, expert_parallel_config=ExpertParallelConfig(EXPERT_PARALLEL_DISPATCHES[0]),
                      **common)
    layers = {EXPERT_PARALLEL_DISPATCHES[0]: first}
    for dispatch in EXPERT_PARALLEL_DISPATCHES[1:]:
        other = build_moe(model, device="meta", expert_parallel_config=ExpertParallelConfig(dispatch), **common)
        other.load_state_dict(first.state_dict(), assign=True)
        layers[dispatch] = other
    return layers


def timed(contenders: dict, repeats: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Per-call seconds of each contender, interleaved with a rotating start (this rank's clock)."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            contenders[name]()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return samples


def slowest_rank(samples: list[float]) -> dict:
    """Median / p10 / p90 in ms of the per-repetition maximum over ranks."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, samples)
    per_rep = [max(rank[i] for rank in everyone) * 1e3 for i in range(len(samples))]
    return {"median_ms": statistics.median(per_rep), "p10_ms": percentile(per_rep, 10),
            "p90_ms": percentile(per_rep, 90)}


def gathered(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def measure(layers: dict, x: torch.Tensor, args, device: torch.device) -> dict:
    """Latency, bytes and output agreement of every dispatch on this rank's input ``x``."""
    with torch.inference_mode():
        outputs, stats = {}, {}
        for name, layer in layers.items():
            outputs[name], stats[name] = layer(x, return_stats=True)
        samples = timed({name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}, args.repeats,
                        args.warmup, device)
    result = {"mode": next(iter(stats.values())).mode.value}
    for name in layers:
        summary = stats[name].summary()
        per_rank = gathered(summary.get("bytes_moved", 0))
        result[name] = {**slowest_rank(samples[name]), "bytes_received_max_rank": max(per_rank),
                        "bytes_received_all_ranks": sum(per_rank),
                        "bytes_by_step_rank0": gathered(summary.get("bytes_by_step", {}))[0]}
    names = list(layers)
    if len(names) == 2:
        a, b = names
        diff = float((outputs[a][0].float() - outputs[b][0].float()).abs().max())
        scale = float(outputs[a][0].float().abs().max())
        result["max_abs_diff_between_dispatches"] = max(gathered(diff))
        result["max_abs_output"] = max(gathered(scale))
        if result[a]["bytes_received_all_ranks"]:
            result["bytes_ratio_a2a_over_all_gather"] = (result[b]["bytes_received_all_ranks"]
                                                         / result[a]["bytes_received_all_ranks"])
        result["latency_ratio_a2a_over_all_gather"] = result[b]["median_ms"] / result[a]["median_ms"]
    return result


def worker(args) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=dt.timedelta(seconds=600))
    parallel_state.initialize_model_parallel(1, world)
    layers = build_layers(args, device, dtype)
    hidden = layers[EXPERT_PARALLEL_DISPATCHES[0]].hidden_size
    gen = torch.Generator().manual_seed(100 + rank)

    def inputs(batch: int, seq: int) -> torch.Tensor:
        return torch.randn(batch, seq, hidden, generator=gen).to(device=device, dtype=dtype)

    report: dict = {"world_size": world, "dispatch": [], "ep_scaling": []}
    if world > 1:
        for tokens in args.prefill_tokens:
            report["dispatch"].append({"phase": "prefill", "tokens_per_rank": tokens,
                                       **measure(layers, inputs(1, tokens), args, device)})
        for batch in args.decode_batch:
            report["dispatch"].append({"phase": "decode", "batch_per_rank": batch,
                                       **measure(layers, inputs(batch, 1), args, device)})
    if world == 1:  # the single-device layer: every dispatch is the same code path, time one
        layers = {"single_device": layers[EXPERT_PARALLEL_DISPATCHES[0]]}
    for phase, total in (("prefill", args.scaling_prefill_tokens), ("decode", args.scaling_decode_batch)):
        if total % world:
            raise ValueError(f"the global {phase} size {total} must be divisible by the world size {world}")
        x = inputs(1, total // world) if phase == "prefill" else inputs(total // world, 1)
        report["ep_scaling"].append({"phase": phase, "ep": world, "global_tokens": total,
                                     **measure(layers, x, args, device)})
    if device.type == "cuda":
        report["peak_memory_gib_rank0"] = torch.cuda.max_memory_allocated(device) / 2**30
    parallel_state.destroy_model_parallel()
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(report))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------------
# launcher


def environment(args) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": args.device}
    if args.device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus_visible"] = torch.cuda.device_count()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    env["git_commit"] = commit if len(commit) == 40 else None  # a copy without git metadata echoes "HEAD"
    return env


def launch(args) -> dict:
    runs = {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "world.json"
            env = dict(os.environ)
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                       "--master-port", str(29500 + world), str(Path(__file__).resolve()), "--worker",
                       "--worker-out", str(out), *sys.argv[1:]]
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.world_timeout)
            if done.returncode:
                raise RuntimeError(f"world {world} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
            runs[world] = json.loads(out.read_text())
            print(f"world {world}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    scaling = [entry for run in runs.values() for entry in run["ep_scaling"]]
    for entry in scaling:
        base = next((e for e in scaling if e["phase"] == entry["phase"] and e["ep"] == 1), None)
        for name in (*EXPERT_PARALLEL_DISPATCHES, "single_device"):
            if name in entry:
                ms = entry[name]["median_ms"]
                entry[name]["tokens_per_s"] = entry["global_tokens"] / ms * 1e3
                if base is not None:
                    entry[name]["speedup_vs_ep1"] = base["single_device"]["median_ms"] / ms
    model = load_model_config(args.config).scaled(args.scale)
    return {
        "benchmark": "parallel",
        "environment": environment(args),
        "layer": {"config": model.name, "hidden_size": model.hidden_size, "intermediate_size": model.intermediate_size,
                  "num_experts": model.num_experts, "top_k": model.top_k, "block_size": args.block_size,
                  "backend": args.backend,
                  "dtype": "bfloat16" if args.device == "cuda" else "float32", "tensor_parallel": 1,
                  "expert_parallel": "world size"},
        "method": {"repeats": args.repeats, "warmup": args.warmup,
                   "time": "median over repetitions of the slowest rank's barrier-to-sync wall time"},
        "dispatch": [dict(entry, world_size=w) for w, run in runs.items() for entry in run["dispatch"]],
        "ep_scaling": scaling,
        "peak_memory_gib_rank0": {w: run.get("peak_memory_gib_rank0") for w, run in runs.items()},
    }


def summary_table(report: dict) -> str:
    """The ratios at a glance (stderr)."""
    lines = ["dispatch: per-rank size, mode, median ms and max MiB received per rank; a2a/all-gather ratios"]
    for e in report["dispatch"]:
        ag, a2a = e["all_gather"], e["all_to_all_v"]
        size = e.get("tokens_per_rank", e.get("batch_per_rank"))
        lines.append(f"  EP{e['world_size']} {e['phase']:7s} {size:6d} {e['mode']:17s} "
                     f"all_gather {ag['median_ms']:8.2f} ms {ag['bytes_received_max_rank'] / 2**20:8.2f} MiB | "
                     f"all_to_all_v {a2a['median_ms']:8.2f} ms {a2a['bytes_received_max_rank'] / 2**20:8.2f} MiB | "
                     f"latency x{e['latency_ratio_a2a_over_all_gather']:.2f} "
                     f"bytes x{e.get('bytes_ratio_a2a_over_all_gather', float('nan')):.2f}")
    lines.append("EP scaling: global size, median ms, speed-up over EP=1")
    for e in report["ep_scaling"]:
        for name in ("single_device", *EXPERT_PARALLEL_DISPATCHES):
            if name in e:
                x = e[name]
                lines.append(f"  EP{e['ep']} {e['phase']:7s} {e['global_tokens']:6d} {name:13s} "
                             f"{x['median_ms']:8.2f} ms  x{x.get('speedup_vs_ep1', float('nan')):.2f}")
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--worlds", type=_sizes, default=[1, 2, 4], help="world sizes to run (EP = world size)")
    parser.add_argument("--config", default="deepseek-v3")
    parser.add_argument("--scale", type=int, default=1, help="divide H and I (1 = full DeepSeek-V3 size)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--backend", default="torch", help="the experts' backend on every rank (torch, triton, ...)")
    parser.add_argument("--prefill-tokens", type=_sizes, default=[2048, 8192], help="per rank, dispatch comparison")
    parser.add_argument("--decode-batch", type=_sizes, default=[4, 64], help="per rank, dispatch comparison")
    parser.add_argument("--scaling-prefill-tokens", type=int, default=8192, help="global, EP scaling")
    parser.add_argument("--scaling-decode-batch", type=int, default=256, help="global, EP scaling")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: scale 64, tiny token counts")
    parser.add_argument("--world-timeout", type=float, default=900)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.scale, args.prefill_tokens, args.decode_batch = 64, [64], [4]
        args.scaling_prefill_tokens, args.scaling_decode_batch, args.repeats, args.warmup = 64, 8, 3, 1
        if args.worlds == [1, 2, 4]:
            args.worlds = [1, 2]
    if args.worker:
        worker(args)
        return
    report = launch(args)
    print(summary_table(report), file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
