"""Expert-parallel MoE on several GPUs (NCCL), CUDA-graph replay, against one GPU doing all the work.

What is measured
----------------
For each model layer (``--configs``: Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 at full size by default) and
weight format
(``--formats``: bf16, fp8_block), expert parallelism over every rank of a world (TP=1, EP=N; each rank is its own
token group and feeds its own tokens, as with data-parallel attention), both dispatches (``all_gather``, NxD's;
``all_to_all_v`` with static per-destination buffers), each step captured in ONE CUDA graph and replayed:

- **steps**: decode with ``--decode`` tokens per rank and prefill with ``--prefill`` tokens per rank. Per step:
  the slowest rank's replay time; the single-GPU layer's replay time for the same TOTAL tokens (world 1, same run);
  the ratio; bytes each rank sends (the layer's own count: static buffers, padding included, so wire bytes); the
  achieved NVLink GB/s of those bytes over the step; and the floor = max(expert-weight bytes this rank reads /
  HBM bandwidth, FLOPs / bf16 matmul rate, dispatch + combine bytes / NVLink bandwidth), with HBM, matmul and
  NVLink (a large all-to-all) bandwidths measured in the same run.
- **dispatch_combine**: the DeepEP-comparable figure -- dispatch + combine alone (the experts replaced by the
  identity) of a 128-token DeepSeek-V3 decode batch (7168 hidden, top-8) per rank, graph-replayed.
- **orchestration** (world 1 only): the parallel path forced onto one GPU (``model_parallel=True``; its
  collectives are no-ops) against the single-device layer -- the cost of the dispatch/combine bookkeeping itself.
- **ep_model**: EP 8..64 predicted from the measured parts (written in the JSON with its assumptions).

Memory: before building a layer, each world estimates what one rank needs for it (its share of the weights, the
quantized formats' repacked decode copy, and for every step the static dispatch buffers and the worst-case expert
intermediates, doubled for the CUDA graph's pool; :func:`memory_need`) against the smallest GPU of the world
(``--gpu-memory-gib`` on a CPU, 78 by default: an H100). A layer or step that would not fit is not run: it is listed
in ``skipped`` with both figures, the same on every rank, so no rank is left waiting in a collective. ``--memory-plan``
prints the estimates for ``--worlds`` without running anything.

Method: after warm-up and capture, each rank replays ``--replays`` times between two CUDA events, ``--repeats``
times (barrier first); a rank's time is the median per replay; the step's time is the slowest rank's. Routing
comes from the layer's own router on random inputs (roughly uniform; no EPLB).

Run: ``python benchmarks/parallel.py --worlds 1,2 --out benchmarks/results/parallel_ep2_h200.json`` on a machine
with 2 GPUs (the script starts ``torchrun`` itself per world size). CPU smoke test (gloo, tiny shapes, eager):
``python benchmarks/parallel.py --quick``. Output: one JSON object on stdout (and ``--out``), a table on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
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
from nxd_moe.config import ExpertParallelConfig  # noqa: E402
from nxd_moe.graphs import capture  # noqa: E402
from nxd_moe.parallel import overlap  # noqa: E402
from nxd_moe.parallel.collectives import CommLedger, all_to_all  # noqa: E402
from nxd_moe.parallel.dispatch import DispatchInputs  # noqa: E402
from nxd_moe.parallel.dispatches import get_dispatcher  # noqa: E402
from nxd_moe.quantization.quantizer import expert_weight_bytes  # noqa: E402

DISPATCHES = ("all_gather", "all_to_all_v")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gathered(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def time_ms(fn, device: torch.device, repeats: int, replays: int) -> float:
    """This rank's median ms per call of ``fn`` (``replays`` back-to-back calls per sample; events on CUDA)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        sync(device)
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / replays)
        else:
            begin = time.perf_counter()
            for _ in range(replays):
                fn()
            samples.append((time.perf_counter() - begin) * 1e3 / replays)
    return statistics.median(samples)


def slowest(ms: float) -> float:
    return max(gathered(ms))


def stepper(fn, x: torch.Tensor, graphs: bool):
    """``fn`` on ``x`` as a replayable call: a captured CUDA graph, or eager."""
    if graphs:
        graphed = capture(fn, x)
        return lambda: graphed(x)
    return lambda: fn(x)


# ------------------------------------------------------------------------------------------------------------
# rooflines measured in the run


def rooflines(device: torch.device, world: int, args) -> dict:
    if device.type != "cuda":
        return {}
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = time_ms(lambda: b.copy_(a), device, 5, 10)
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: m @ m, device, 5, 5)
    out = {"hbm_copy_GBps": 2 * a.numel() / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}
    if world > 1:
        # Per-GPU all-to-all bandwidth: bytes this rank sends to the others over the time of a large exchange.
        rows = (256 << 20) // 4096
        buf = torch.randn(world * rows, 2048, device=device, dtype=torch.bfloat16)
        group = dist.group.WORLD
        ledger = CommLedger()
        a2a_ms = slowest(time_ms(lambda: all_to_all(buf, group, ledger, "x"), device, 5, 5))
        sent = buf.numel() * buf.element_size() * (world - 1) / world
        out["nvlink_all_to_all_GBps_per_gpu"] = sent / a2a_ms / 1e6
        out["nvlink_measure"] = f"all_to_all_single of {buf.numel() * 2 >> 20} MiB per rank, bytes sent to others"
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------------------
# worker: one rank of a torchrun world


def build(args, config: str, fmt: str, device, dtype, dispatch: str | None, weights_of=None,
          micro_batches: int | None = None, transport: str = "nccl"):
    """The layer (dispatch None: the single-device one, weights from seed 0); parallel layers share the
    single-device layer's seed so that every world computes the same function. ``weights_of``: a layer whose
    tensors the new one uses as they are (no copy: one GPU holds a full DeepSeek-V3 layer once).
    ``micro_batches``: the static all-to-all's, forced (None: the rule's); ``transport``: how it moves rows."""
    common = dict(scale=args.scale, dtype=dtype, seed=0, block_size=args.block_size, backend=args.backend,
                  quantization=None if fmt == "bf16" else fmt)
    if dispatch is None:
        return build_moe(config, device=device, model_parallel=False, **common)
    placed = ExpertParallelConfig(dispatch, all_to_all_splits="static", micro_batches=micro_batches,
                                  transport=transport)
    if weights_of is None:
        return build_moe(config, device=device, model_parallel=True, expert_parallel_config=placed, **common)
    layer = build_moe(config, device="meta", model_parallel=True, expert_parallel_config=placed, **common)
    layer.load_state_dict(weights_of.state_dict(), assign=True)
    return layer


# ------------------------------------------------------------------------------------------------------------
# memory: what one rank needs, estimated before anything is allocated


def layer_bytes(args, config: str, fmt: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Stored bytes of the single-device layer (built on the meta device: nothing allocated): ``experts`` (the
    routed experts' projections and scales), ``rest`` (router, shared experts, biases)."""
    layer = build_moe(config, device="meta", model_parallel=False, scale=args.scale, dtype=dtype, seed=0,
                      backend="torch", quantization=None if fmt == "bf16" else fmt)
    total = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    experts = expert_weight_bytes(layer.expert_mlps)
    return {"experts": experts, "rest": total - experts}


def memory_need(args, config: str, fmt: str, world: int, steps: list[tuple[str, int]], act_bytes: int = 2,
                weights: dict | None = None) -> dict:
    """Estimated peak bytes one rank of a ``world``-rank EP world needs for ``config`` in format ``fmt`` and the
    largest of ``steps`` (``(phase, tokens per rank)``); world 1 also holds the single-device layer, whose steps
    are given as totals. Deliberately high: every pair of the block may land on this rank's experts.

    - weights: ``experts / world + rest`` (the parallel layers share one copy, the single-device layer's in world
      1), the experts' share twice for a quantized format (the triton backend's repacked decode copy);
    - a step of ``n`` tokens per rank, ``N = n * world`` in the block, ``k`` experts each, hidden ``H``,
      intermediate ``I``: the router's ``(n, E)`` fp32 logits, affinities and mask; the static all-to-all's four
      ``(world * n, row)`` buffers (dispatch out and in, partial outputs out and in); up to ``N * k`` pairs'
      ``2I`` gate/up, ``I`` activation and ``H`` down rows; the ``(n, H)`` fp32 combine -- all doubled for the
      CUDA graph's private pool beside the eager warm-up's allocations."""
    cfg = load_model_config(config).scaled(args.scale)
    hidden, inter, experts, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k
    weights = weights or layer_bytes(args, config, fmt)
    held = weights["experts"] * (2 if fmt != "bf16" else 1) / world + weights["rest"]
    step = 0.0
    for _, n in steps:
        block = n * world
        router = 3 * n * experts * 4
        buffers = 4 * block * (hidden * act_bytes + 8 * k)
        pairs = block * k * (3 * inter + hidden) * act_bytes
        step = max(step, 2 * (router + buffers + pairs + n * hidden * 4))
    need = held + step
    budget = args.gpu_memory_gib * 2**30
    return {"config": config, "format": fmt, "world_size": world, "weights_gib": held / 2**30,
            "largest_step_gib": step / 2**30, "need_gib": need / 2**30, "budget_gib": args.gpu_memory_gib,
            "fits": need <= budget}


def step_record(moe, x: torch.Tensor, device, args, rates: dict) -> dict:
    """Time one layer on this rank's ``x``; bytes, touched weights and the floor."""
    with torch.inference_mode():
        result = moe(x, return_stats=True)
        out, stats = result[0], result[-1]
        summary = stats.summary()
        step = stepper(lambda inp: moe(inp)[0], x, args.graphs)
        ms = slowest(time_ms(step, device, args.repeats, args.replays))
        eager_ms = slowest(time_ms(lambda: moe(x)[0], device, max(2, args.repeats // 2), 1)) if args.eager else None
    experts = moe.expert_mlps
    per_expert = expert_weight_bytes(experts) / experts.mlp_op.down_proj.shape[0]
    local = stats.local_tokens_per_expert if stats.local_tokens_per_expert is not None else stats.tokens_per_expert
    touched = float((local > 0).sum()) * per_expert
    cfg = experts.routed_experts_mlp_config
    pairs = float(local.sum())
    flops = 2 * pairs * 3 * cfg.hidden_size * cfg.intermediate_size / max(1, experts.weight_shard(False)
                                                                            .intermediate_parts)
    # The statistics call also all-gathers the per-expert counts; the timed step (no statistics) does not.
    sent = sum(v for k, v in summary.get("bytes_by_step", {}).items() if k != "expert_counts")
    par = getattr(moe, "expert_parallel", None)
    record = {"micro_batches": None if par is None else par.micro_batch_count(
        x.reshape(-1, x.shape[-1]), moe.router.top_k, par.token_layout(x.shape[0], x.shape[1], False))}
    record |= {"ms": ms, "eager_ms": eager_ms, "mode": summary["mode"], "bytes_sent_per_rank": max(gathered(sent)),
              "bytes_by_step": summary.get("bytes_by_step", {}),
              "expert_bytes_read_max_rank": max(gathered(touched)), "flops_max_rank": max(gathered(flops)),
              "output_abs_max": float(out.float().abs().max())}
    if rates:
        parts = {"hbm_ms": record["expert_bytes_read_max_rank"] / rates["hbm_copy_GBps"] / 1e6,
                 "matmul_ms": record["flops_max_rank"] / rates["bf16_matmul_TFLOPs"] / 1e9}
        if "nvlink_all_to_all_GBps_per_gpu" in rates:
            parts["nvlink_ms"] = record["bytes_sent_per_rank"] / rates["nvlink_all_to_all_GBps_per_gpu"] / 1e6
            record["achieved_nvlink_GBps"] = record["bytes_sent_per_rank"] / ms / 1e6
        record["floor_ms"] = max(parts.values())
        record["floor_parts_ms"] = parts
        record["vs_floor"] = ms / record["floor_ms"]
    return record


def dispatch_combine(moe, x: torch.Tensor, device, args) -> dict:
    """Dispatch + combine alone (experts replaced by the identity), graph-replayed: the DeepEP-comparable time."""
    par = moe.expert_parallel
    experts = par.experts
    tokens = x.reshape(-1, x.shape[-1])
    with torch.inference_mode():
        _, affinities, index = moe.router(tokens)
        routing = experts.routing(affinities, index)
        layout = par.groups.token_layout(x.shape[0], x.shape[1], False)
        shard = par.parallelism.shard(decode=True)
        epc = experts.expert_parallel_config
        dispatcher = get_dispatcher(epc.dispatch)
        ledger = CommLedger()

        def run(rows):
            ledger.steps.clear()
            dispatched = dispatcher.dispatch(DispatchInputs(rows, routing, layout, par.groups, shard, None, ledger,
                                                            epc.all_to_all_splits, count_pairs=False,
                                                            transport=epc.transport))
            return dispatcher.combine(dispatched.rows, dispatched.handle).output

        run(tokens)
        step = stepper(run, tokens, args.graphs)
        ms = slowest(time_ms(step, device, args.repeats, args.replays))
    return {"ms": ms, "us": ms * 1e3, "bytes_sent_per_rank": max(gathered(sum(ledger.steps.values()))),
            "tokens_per_rank": tokens.shape[0], "hidden_size": tokens.shape[1], "top_k": index.shape[1]}


def worker(args) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=dt.timedelta(seconds=900), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=dt.timedelta(seconds=900))
    parallel_state.initialize_model_parallel(1, world)
    if device.type == "cuda":  # the smallest GPU of the world decides, so that every rank skips the same steps
        args.gpu_memory_gib = min(gathered(torch.cuda.get_device_properties(device).total_memory / 2**30))
    rates = rooflines(device, world, args)
    gen = torch.Generator().manual_seed(100 + rank)
    report: dict = {"world_size": world, "rooflines": rates, "steps": [], "dispatch_combine": [], "skipped": [],
                    "memory": []}
    worlds = args.all_worlds
    for config in args.configs:
        for fmt in args.formats:
            # World 1 measures every total size the larger worlds need for their baseline.
            sizes = {phase: sorted({n * w for n in per_rank for w in worlds}) if world == 1 else per_rank
                     for phase, per_rank in (("decode", args.decode), ("prefill", args.prefill))}
            try:
                weights = layer_bytes(args, config, fmt, dtype)
            except (NotImplementedError, ValueError) as e:
                report["skipped"].append({"config": config, "format": fmt, "why": f"{type(e).__name__}: {e}"})
                continue
            need = functools.partial(memory_need, args, config, fmt, world, act_bytes=dtype.itemsize, weights=weights)
            fitting = {phase: [n for n in ns if need([(phase, n)])["fits"]] for phase, ns in sizes.items()}
            for phase, ns in sizes.items():
                for n in ns:
                    if n not in fitting[phase]:
                        plan = need([(phase, n)])
                        report["skipped"].append({"config": config, "format": fmt, "phase": phase,
                                                  "tokens_per_rank": n, "why": (
                                                      f"does not fit: needs about {plan['need_gib']:.1f} GiB per "
                                                      f"rank, {plan['budget_gib']:.1f} GiB per GPU"),
                                                  "memory": plan})
            plan = need([(phase, n) for phase, ns in fitting.items() for n in ns])  # the weights alone if none fits
            report["memory"].append(plan)
            if not plan["fits"]:
                report["skipped"].append({"config": config, "format": fmt, "why": (
                    f"does not fit: its weights need about {plan['need_gib']:.1f} GiB per rank, "
                    f"{plan['budget_gib']:.1f} GiB per GPU"), "memory": plan})
                continue
            try:
                single = build(args, config, fmt, device, dtype, None) if world == 1 else None
                layers = {None: single}
                for dispatch in DISPATCHES:
                    # One GPU: the forced-parallel layers compute the single device's function on its tensors;
                    # several: the all-to-all layer shares the all-gather layer's shard.
                    layers[dispatch] = build(args, config, fmt, device, dtype, dispatch,
                                             single if single is not None else layers.get(DISPATCHES[0]))
                for count in args.micro_batches:  # the all-to-all with its micro-batches forced
                    layers[f"all_to_all_v/micro{count}"] = build(args, config, fmt, device, dtype, "all_to_all_v",
                                                                 layers[DISPATCHES[0]], micro_batches=count)
                for transport in args.transports:  # the all-to-all over another transport
                    layers[f"all_to_all_v/{transport}"] = build(args, config, fmt, device, dtype, "all_to_all_v",
                                                                layers[DISPATCHES[0]], transport=transport)
            except (NotImplementedError, ValueError) as e:
                report["skipped"].append({"config": config, "format": fmt, "why": f"{type(e).__name__}: {e}"})
                continue
            hidden = next(v for v in layers.values() if v is not None).hidden_size
            for phase, fitting_sizes in fitting.items():
                for n in fitting_sizes:
                    shape = (n, 1) if phase == "decode" else (1, n)
                    x = torch.randn(*shape, hidden, generator=gen).to(device, dtype)
                    for name, moe in layers.items():
                        if moe is None:
                            continue
                        record = step_record(moe, x, device, args, rates)
                        report["steps"].append({"config": config, "format": fmt, "phase": phase,
                                                "tokens_per_rank": n, "world_size": world,
                                                "layer": name or "single_device", **record})
            if config == args.dispatch_config and fmt == "bf16":
                for dispatch in [*DISPATCHES, *(f"all_to_all_v/{t}" for t in args.transports)]:
                    x = torch.randn(args.dispatch_tokens, 1, hidden, generator=gen).to(device, dtype)
                    report["dispatch_combine"].append({"config": config, "dispatch": dispatch, "world_size": world,
                                                       **dispatch_combine(layers[dispatch], x, device, args)})
            del layers, single
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:  # what was measured survives a later failure
                Path(args.worker_out).write_text(json.dumps(report))
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
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    env["git_commit"] = commit if len(commit) == 40 else None  # a copy without git metadata echoes "HEAD"
    return env


def compare(steps: list[dict]) -> list[dict]:
    """Each parallel step next to the single GPU doing the same total tokens (same config, format, phase)."""
    single = {(s["config"], s["format"], s["phase"], s["tokens_per_rank"]): s for s in steps
              if s["layer"] == "single_device"}
    out = []
    for s in steps:
        if s["layer"] == "single_device":
            continue
        base = single.get((s["config"], s["format"], s["phase"], s["tokens_per_rank"] * s["world_size"]))
        row = dict(s)
        if base is not None:  # the same total tokens: the throughput ratio is the inverse of the time ratio
            row["single_gpu_same_total_ms"] = base["ms"]
            row["time_vs_single_gpu"] = s["ms"] / base["ms"]
            row["throughput_vs_single_gpu"] = base["ms"] / s["ms"]
        out.append(row)
    return out


def ep_model(report: dict, args) -> dict:
    """EP 2..64 predicted from measured parts, per layer, format, phase, tokens per rank and dispatch:

    t(p) = orchestration + compute + dispatch/combine, where
    - orchestration: the parallel path's own cost at that token count, measured on one GPU (the forced-parallel
      layer minus the single-device layer, world 1);
    - compute: one rank's floor -- the weights of the experts its pairs touch over HBM (uniform routing: each of
      its E/p experts is touched with probability 1 - (1 - 1/E)^(p*n*k)) or its n*k pairs' FLOPs over the matmul
      rate, whichever is larger -- times the single GPU's measured time/floor at the same tokens per GPU (its
      efficiency);
    - dispatch/combine: the static buffers, (p-1)*n rows each way, over the per-GPU all-to-all bandwidth, plus two
      all-to-all latencies. Measured in the run when it had several GPUs (NVLink bandwidth; the dispatch+combine
      time minus its world-1 part as the latency); otherwise ``--assumed-nvlink-GBps`` and ``--assumed-latency-us``
      (written in the output). Beyond 8 GPUs a fraction (p-8)/p of each rank's traffic crosses nodes at
      ``--internode-GBps`` per GPU.
    Assumptions: uniform routing, no EPLB, compute efficiency independent of p at equal tokens per GPU, and
    orchestration independent of p (its kernels are sized by the tokens per rank, times p for the buffers)."""
    single_runs = report["runs"].get(1)
    if not single_runs or not single_runs.get("rooflines"):
        return {"skipped": "needs the world-1 (one GPU) run on CUDA"}
    rates = dict(single_runs["rooflines"])
    multi = [w for w in report["runs"] if w > 1 and report["runs"][w].get("rooflines")]
    measured = bool(multi)
    if measured:
        rates["nvlink_all_to_all_GBps_per_gpu"] = report["runs"][max(multi)]["rooflines"][
            "nvlink_all_to_all_GBps_per_gpu"]
    else:
        rates["nvlink_all_to_all_GBps_per_gpu"] = args.assumed_nvlink_GBps
    steps = single_runs["steps"]
    by_key = {(x["config"], x["format"], x["phase"], x["tokens_per_rank"], x["layer"]): x for x in steps}
    latency_ms = args.assumed_latency_us / 1e3
    top_dispatch = report["runs"][max(multi)]["dispatch_combine"] if measured else []
    if top_dispatch:
        one = {d["dispatch"]: d["ms"] for d in single_runs["dispatch_combine"]}
        latency_ms = max(0.0, min(d["ms"] - one.get(d["dispatch"], 0.0) for d in top_dispatch) / 2)
    out = {"assumptions": ep_model.__doc__, "communication": "measured" if measured else "assumed",
           "latency": "measured" if top_dispatch else "assumed",
           "nvlink_all_to_all_GBps_per_gpu": rates["nvlink_all_to_all_GBps_per_gpu"],
           "all_to_all_latency_ms": latency_ms, "internode_GBps_per_gpu": args.internode_GBps, "rows": []}
    for (config, fmt, phase, n, layer), x in by_key.items():
        base = by_key.get((config, fmt, phase, n, "single_device"))
        if layer == "single_device" or base is None or "floor_ms" not in base:
            continue
        cfg = load_model_config(config).scaled(args.scale)
        hidden, inter, experts, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k
        per_expert = base["expert_bytes_read_max_rank"] / max(1.0, base["expert_bytes_read_max_rank"] /
                                                              (3 * hidden * inter * (1 if "fp8" in fmt else 2)))
        efficiency = base["ms"] / base["floor_ms"]
        for p in (2, 4, 8, 16, 32, 64):
            if experts % p:
                continue
            touched = experts / p * (1 - (1 - 1 / experts) ** (p * n * k))
            floor = max(touched * per_expert / rates["hbm_copy_GBps"] / 1e6,
                        2 * n * k * 3 * hidden * inter / rates["bf16_matmul_TFLOPs"] / 1e9)
            compute_ms = floor * efficiency
            row_bytes = hidden * 2 + k * 8
            wire = (p - 1) * n * (row_bytes + hidden * 2)  # dispatch rows out, partial outputs back
            remote = max(0, p - 8) / p
            comm_ms = (wire * (1 - remote) / rates["nvlink_all_to_all_GBps_per_gpu"] / 1e6
                       + wire * remote / args.internode_GBps / 1e6 + 2 * latency_ms)
            orchestration_ms = max(0.0, x["ms"] - base["ms"])
            out["rows"].append({"config": config, "format": fmt, "phase": phase, "dispatch": layer,
                                "tokens_per_rank": n, "ep": p, "predicted_ms": compute_ms + comm_ms + orchestration_ms,
                                "compute_ms": compute_ms, "comm_ms": comm_ms, "orchestration_ms": orchestration_ms,
                                "single_gpu_same_tokens_per_gpu_ms": base["ms"]})
    return out


def launch(args) -> dict:
    runs, not_run = {}, {}
    for world in args.worlds:
        if args.device == "cuda" and world > torch.cuda.device_count():
            not_run[world] = f"needs {world} GPUs, {torch.cuda.device_count()} visible"
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "world.json"
            env = dict(os.environ)
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                       "--master-port", str(29500 + world), str(Path(__file__).resolve()), "--worker",
                       "--worker-out", str(out), "--all-worlds", ",".join(map(str, args.worlds)), *sys.argv[1:]]
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.world_timeout)
            if done.returncode and not out.exists():
                raise RuntimeError(f"world {world} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
            runs[world] = json.loads(out.read_text())
            if done.returncode:
                runs[world]["failed"] = done.stderr[-4000:]
                print(f"world {world} failed:\n{done.stderr[-4000:]}", file=sys.stderr)
            print(f"world {world}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    steps = [s for run in runs.values() for s in run["steps"]]
    report = {
        "benchmark": "parallel",
        "environment": environment(args),
        "settings": {"configs": args.configs, "formats": args.formats, "scale": args.scale,
                     "block_size": args.block_size, "backend": args.backend, "graphs": args.graphs,
                     "dtype": "bfloat16" if args.device == "cuda" else "float32", "tensor_parallel": 1,
                     "expert_parallel": "world size", "all_to_all_splits": "static",
                     "micro_batches_forced": args.micro_batches, "transports": args.transports,
                     "micro_batch_rule": {"link_GBps": overlap.LINK_GBPS, "cost_us": overlap.MICRO_BATCH_COST_US}},
        "method": {"repeats": args.repeats, "replays": args.replays,
                   "time": "slowest rank's median per call over repetitions of back-to-back replays (CUDA events)"},
        "runs": runs,
        "worlds_not_run": not_run,
        "comparison": compare(steps),
        "dispatch_combine": [d for run in runs.values() for d in run["dispatch_combine"]],
    }
    report["ep_model"] = ep_model(report, args)
    return report


def summary_table(report: dict) -> str:
    lines = ["step: config format phase tokens/rank layer | ms | single GPU same total ms | ratio | MiB sent/rank | "
             "x floor"]
    for s in report["comparison"]:
        lines.append(f"  EP{s['world_size']} {s['config']:14s} {s['format']:9s} {s['phase']:7s} "
                     f"{s['tokens_per_rank']:6d} {s['layer']:12s} | {s['ms']:8.3f} | "
                     f"{s.get('single_gpu_same_total_ms', float('nan')):8.3f} | "
                     f"{s.get('time_vs_single_gpu', float('nan')):5.2f} | {s['bytes_sent_per_rank'] / 2**20:8.2f} | "
                     f"{s.get('vs_floor', float('nan')):5.2f}")
    for world, run in report["runs"].items():
        for skip in run.get("skipped", []):
            step = f" {skip['phase']} {skip['tokens_per_rank']}/rank" if "phase" in skip else ""
            lines.append(f"  EP{world} {skip['config']} {skip['format']}{step} skipped: {skip['why']}")
    for d in report["dispatch_combine"]:
        lines.append(f"dispatch+combine EP{d['world_size']} {d['dispatch']:12s} {d['tokens_per_rank']} tokens x "
                     f"{d['hidden_size']}: {d['us']:.1f} us")
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def memory_plan(args) -> list[dict]:
    """:func:`memory_need` of every ``--worlds`` x ``--configs`` x ``--formats`` for the ``--decode`` and ``--prefill``
    sizes (world 1: the totals of every world), nothing run."""
    out = []
    for config in args.configs:
        for fmt in args.formats:
            weights = layer_bytes(args, config, fmt)
            for world in args.worlds:
                mult = sorted(set(args.worlds)) if world == 1 else [1]
                steps = [(phase, n * m) for phase, ns in (("decode", args.decode), ("prefill", args.prefill))
                         for n in ns for m in mult]
                out.append(memory_need(args, config, fmt, world, steps, weights=weights))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--worlds", type=_sizes, default=[1, 2], help="world sizes to run (EP = world size)")
    parser.add_argument("--configs", type=_names, default=["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"])
    parser.add_argument("--formats", type=_names, default=["bf16", "fp8_block"])
    parser.add_argument("--scale", type=int, default=1, help="divide H and I (1 = full size)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--backend", default="triton", help="the experts' backend on every rank")
    parser.add_argument("--decode", type=_sizes, default=[1, 8, 64], help="decode tokens per rank")
    parser.add_argument("--prefill", type=_sizes, default=[2048, 8192], help="prefill tokens per rank")
    parser.add_argument("--micro-batches", type=_sizes, default=[],
                        help="also time the static all-to-all with these micro-batch counts forced (the "
                             "all_to_all_v rows take the rule's count)")
    parser.add_argument("--transports", type=_names, default=[],
                        help="also time the static all-to-all over these transports (nvlink)")
    parser.add_argument("--dispatch-config", default="deepseek-v3", help="layer of the dispatch+combine figure")
    parser.add_argument("--dispatch-tokens", type=int, default=128, help="decode tokens per rank, dispatch+combine")
    parser.add_argument("--internode-GBps", type=float, default=50.0, help="EP model: per-GPU bandwidth off-node")
    parser.add_argument("--assumed-nvlink-GBps", type=float, default=350.0,
                        help="EP model without a multi-GPU run: per-GPU all-to-all bandwidth (H200 NVLink 4)")
    parser.add_argument("--assumed-latency-us", type=float, default=20.0,
                        help="EP model without a multi-GPU run: one all-to-all's fixed latency")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--no-graphs", dest="graphs", action="store_false", help="time eager calls instead")
    parser.add_argument("--eager", action="store_true", help="also time eager calls")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: gloo, scale 64, tiny sizes, eager")
    parser.add_argument("--world-timeout", type=float, default=1800)
    parser.add_argument("--gpu-memory-gib", type=float, default=78.0,
                        help="memory per GPU the estimates are checked against where no GPU is visible (CUDA: the "
                             "smallest GPU of the world)")
    parser.add_argument("--memory-plan", action="store_true",
                        help="print what one rank needs per world, config and format against --gpu-memory-gib; run "
                             "nothing")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--all-worlds", type=_sizes, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.device, args.scale, args.decode, args.prefill, args.graphs = "cpu", 64, [2], [32], False
        args.backend, args.repeats, args.replays, args.dispatch_tokens = "torch", 2, 1, 4
    if args.worker:
        worker(args)
        return
    if args.memory_plan:
        plans = memory_plan(args)
        for plan in plans:
            print(f"EP{plan['world_size']} {plan['config']:16s} {plan['format']:9s} weights {plan['weights_gib']:6.1f} "
                  f"GiB + largest step {plan['largest_step_gib']:6.1f} GiB = {plan['need_gib']:6.1f} of "
                  f"{plan['budget_gib']:.0f} GiB: {'fits' if plan['fits'] else 'DOES NOT FIT'}", file=sys.stderr)
        print(json.dumps(plans, indent=2))
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
