"""Where the host time of ONE eager expert-parallel MoE call goes, per rank (issue 29).

Run under ``torchrun`` (gloo on a CPU, NCCL on GPUs), one rank per process, EP = world size, TP = 1::

    torchrun --nproc-per-node 2 benchmarks/ep_host_time.py --config qwen3-30b-a3b --scale 16 --tokens 8
    torchrun --nproc-per-node 2 benchmarks/ep_host_time.py --device cuda --backend triton --scale 1 --tokens 8

For one decode step of ``--tokens`` tokens per rank through the layer's router, dispatch, experts and combine:

- ``wall_ms``: per-call wall time of back-to-back eager calls (``--samples`` samples of ``--calls`` calls each,
  barrier first; min and median over samples). On CUDA the calls end with a synchronize per sample, so it is the
  eager step's time; ``graph_ms`` is the same step captured in one CUDA graph and replayed (the issue's target:
  eager <= 2x graph).
- ``host_cpu_ms``: CPU time of the calling thread per call (``time.thread_time``): the host work itself, without
  the time spent waiting for the other ranks or for a CPU on a shared machine -- the robust figure there.
- ``phases``: cProfile's cumulative time per call of each phase's function (profiler overhead included, so read
  them as shares): the agreement fingerprint exchange (start and wait), router, routing, the dispatch's bookkeeping
  (owned pairs, slots, buffers), collectives, experts, combine.
- ``ops_per_call``: the aten operations one call dispatches (each a kernel launch on a GPU), by the nxd_moe file
  that issued them.

Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime as dt
import json
import os
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nxd_moe import build_moe, parallel_state  # noqa: E402
from nxd_moe.config import ExpertParallelConfig  # noqa: E402

# phase -> (file suffix, function) whose cumulative time is the phase's, or several such pairs summed.
PHASES = {
    "agreement_start": ("parallel/expert_parallel.py", "_start_agreement"),
    "agreement_wait": ("nxd_moe/parallel_state.py", "wait"),
    "router": ("nxd_moe/moe.py", "_layer"),  # minus everything below (see phases())
    "routing": ("nxd_moe/expert_mlps_v2.py", "routing"),
    "owned_pairs": ("parallel/all_to_all.py", "owned_pairs"),
    "destination_slots": ("parallel/all_to_all.py", "destination_slots"),
    "pack": ("parallel/all_to_all.py", "destination_fields"),
    "pack_kernel": ("triton_kernels/dispatch.py", "pack_for_destinations"),
    "slots_kernel": ("triton_kernels/dispatch.py", "destination_slots"),
    # the exchanges: blocking, or started and waited for (NCCL or straight over NVLink)
    "all_to_all": (("parallel/collectives.py", "all_to_all"), ("parallel/collectives.py", "start_all_to_all"),
                   ("parallel/collectives.py", "wait"), ("parallel/nvlink.py", "start_nvlink_all_to_all")),
    "all_gather": ("parallel/collectives.py", "all_gather"),
    "reduce_scatter": ("parallel/collectives.py", "reduce_scatter"),
    "experts": ("nxd_moe/expert_mlps_v2.py", "compute"),
    "combine": ("parallel/all_to_all.py", "combine_from_destinations"),
    "combine_kernel": ("triton_kernels/dispatch.py", "combine_from_destinations"),
    "expert_parallel_call": ("parallel/expert_parallel.py", "__call__"),
    "moe_forward": ("nxd_moe/moe.py", "forward"),
}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched, by the nxd_moe file that issued each."""

    def __init__(self):
        super().__init__()
        self.by_file: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f.filename for f in traceback.extract_stack() if "nxd_moe" in f.filename]
        self.by_file[frames[-1].split("nxd_moe/")[-1] if frames else "outside nxd_moe"] += 1
        return func(*args, **(kwargs or {}))


def phases(profile: cProfile.Profile, calls: int) -> dict[str, float]:
    """Cumulative ms per call of each of :data:`PHASES`; ``router`` is ``MoE._layer`` minus the expert-parallel
    call inside it."""
    stats = pstats.Stats(profile).stats
    cumulative: dict[str, float] = {}
    for (filename, _, name), (_, _, _, cum, _) in stats.items():
        for phase, where in PHASES.items():
            pairs = where if isinstance(where[0], tuple) else (where,)
            if any(name == function and filename.endswith(suffix) for suffix, function in pairs):
                cumulative[phase] = cumulative.get(phase, 0.0) + cum * 1e3 / calls
    if "router" in cumulative:
        cumulative["router"] -= cumulative.get("expert_parallel_call", 0.0)
    return {k: round(v, 4) for k, v in cumulative.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--scale", type=int, default=16, help="divide H and I (1 = full size)")
    parser.add_argument("--tokens", type=int, default=8, help="decode tokens per rank")
    parser.add_argument("--dispatch", default="all_to_all_v", choices=("all_gather", "all_to_all_v"))
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--calls", type=int, default=50, help="calls per sample")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--profile-calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", timeout=dt.timedelta(seconds=300), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=dt.timedelta(seconds=300))
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(1, world)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    moe = build_moe(args.config, scale=args.scale, seed=0, dtype=dtype, device=device, backend=args.backend,
                    model_parallel=True, expert_parallel_config=ExpertParallelConfig(args.dispatch))
    x = torch.randn(args.tokens, 1, moe.hidden_size, generator=torch.Generator().manual_seed(rank)).to(device, dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> tuple[list[float], list[float]]:
        wall, cpu = [], []
        for _ in range(args.samples):
            dist.barrier()
            sync()
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.calls):
                fn()
            sync()
            wall.append((time.perf_counter() - start) * 1e3 / args.calls)
            cpu.append((time.thread_time() - start_cpu) * 1e3 / args.calls)
        return wall, cpu

    with torch.inference_mode():
        for _ in range(10):
            moe(x)
        wall, cpu = timed(lambda: moe(x))
        counter = OpCounter()
        with counter:
            moe(x)
        profile = cProfile.Profile()
        dist.barrier()
        profile.enable()
        for _ in range(args.profile_calls):
            moe(x)
        profile.disable()
        sync()
        graph_ms = None
        if device.type == "cuda":
            from nxd_moe.graphs import capture

            step = capture(lambda inp: moe(inp)[0], x)
            graph_wall, _ = timed(lambda: step(x))
            graph_ms = statistics.median(graph_wall)
    record = {"rank": rank, "wall_ms": {"min": min(wall), "median": statistics.median(wall)},
              "host_cpu_ms": {"min": min(cpu), "median": statistics.median(cpu)}, "graph_ms": graph_ms,
              "phases_ms": phases(profile, args.profile_calls), "ops_per_call": sum(counter.by_file.values()),
              "ops_by_file": dict(counter.by_file.most_common())}
    everyone = [None] * world
    dist.all_gather_object(everyone, record)
    if rank == 0:
        print(json.dumps({"settings": vars(args), "world_size": world, "torch": torch.__version__,
                          "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)",
                          "ranks": everyone}, indent=2))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
