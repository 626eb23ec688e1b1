"""Whole transformers MoE models generating on one GPU: transformers' own experts implementations against nxd_moe.

What is compared
----------------
One model (random weights, bf16) per run, built by :func:`nxd_moe.models.hf_models.build_hf_model` from a shipped
config (``--model qwen3-30b-a3b --layers 4`` ...). Contenders, same weights, same prompts, greedy decoding:

- transformers' experts implementations, switched on the same model with ``set_experts_implementation``:
  ``grouped_mm`` (transformers' default; its ``generate`` swaps in ``batched_mm`` for the decode steps on a GPU),
  ``batched_mm``, ``eager`` (a Python loop over the hit experts) and, only where they load offline, ``sonicmoe`` /
  ``deepgemm`` (they fetch kernels from the Hub: on an offline machine the row records why they did not run);
- ``nxd_moe``: the same model through nxd_moe's experts backend (``set_experts_implementation("nxd_moe")``: the
  routed experts only; router, shared experts and the rest stay transformers');
- ``patch_model``: every sparse-MoE block replaced by nxd_moe's ``MoE`` (``nxd_moe.hf.patch_model``), run last
  because it changes the model in place.

Each contender runs eagerly (plain ``generate``: what a transformers user gets) or compiled (transformers' recipe:
a ``StaticCache`` with ``CompileConfig(fullgraph=True, mode="reduce-overhead")``: the decode step is one Inductor
graph replayed as a CUDA graph). Every contender's compiled runs share one ``StaticCache`` across ``generate`` calls,
as a server keeps its cache (``nxd_moe.models.generate.static_cache``): with ``cache_implementation="static"``
transformers makes a new cache per call and the decode graph is re-recorded whenever its addresses move (60-100 ms
per call at 48 layers, measured). Run one ``--modes`` per process: eager runs after compiled ones in the
same process were measured slower (8.1 vs 5.6 ms per step, same code), so mixing them is not a fair comparison.

Measured
--------
With ``--interleave`` the eager rows of the contenders that switch on one model are timed in turns
(:func:`interleaved_eager`): run one after another in one process, the second of two was measured 13-22% slower
than the first in either order (``benchmarks/results/hf_generate_qwen3_4l_b1_eager_{nxd,gm}_first_h200.json``).

Per batch size B (``--batches``): prefill ms (``generate`` of one new token from a ``--prompt-len`` prompt), decode
tokens/s (``B * (N - 1) / (t_N - t_1)`` with ``N = --new-tokens``), medians of ``--repeats`` runs after two warm-up
runs (the first compiles; attention libraries plan once per new cache length, which a cold first ``generate`` pays at
every step: measured 40 ms per step on an H100 for transformers' default on a 4-layer Qwen3, 5.6 warm); whether the
greedy tokens equal the reference contender's (transformers' ``eager`` where it ran, else ``grouped_mm``); GPU memory
after switching or patching, against the unpatched model's. With ``--profile``, the device time of nxd_moe's own
kernels per decode step and layer (``torch.profiler``, kernels whose names are nxd_moe's Triton kernels), beside the
same MoE layer's CUDA-graph time measured in this run (``nxd_moe.graphs.capture`` on the patched layer of layer 0,
same B tokens) -- the comparison the issue asks for.

Roofline (measured in the same run): device copy bandwidth (1 GiB copy). A decode step must read the weights it
touches once: attention, norms, LM head, the router, and for each MoE layer the experts the step's ``B * k`` choices
hit (expected ``E * (1 - (1 - k / E) ** B)`` under uniform routing, which random weights give), plus the KV cache
of every sequence. Roofline tokens/s = ``B * copy_bandwidth / bytes_per_step``. Reported per row: ratio to the best
transformers implementation in the same run and to the roofline.

Expert parallelism: under ``torchrun --nproc-per-node N`` (N > 1) each rank builds the same model, initialises
``nxd_moe.parallel_state`` with expert parallelism N, patches it (each rank keeps E / N experts, attention stays
whole: data-parallel attention) and generates its own ``B`` sequences in lockstep (``synced_gpus``); only
``patch_model`` runs, and rank 0 reports the slowest rank's times and the aggregate decode tokens/s (``N * B`` per
step). Compare with a one-process run of ``--variants patch_model`` at the same ``B`` per GPU.

Output: one JSON (``--out``) and a table on stdout. On a CPU (``--device cpu``, a small ``--scale``) it times with
this process's CPU time by default (``--clock process``), which a CPU shared with other work does not inflate, in
fp32, every contender in one run: docs/performance.md's CPU table comes from such a run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

HF_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager", "sonicmoe", "deepgemm")
OURS = ("nxd_moe", "patch_model")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a 1 GiB device copy (read + write), median of 20."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times[5:])


def decode_bytes_per_step(model, batch: int, context: int, expert_parallel: int = 1) -> float:
    """Bytes a decode step of ``batch`` sequences at ``context`` cached tokens must read at least once -- on one
    rank of ``expert_parallel`` when that is > 1: the rank's own sequences' attention, embeddings and cache, and
    its ``E / expert_parallel`` experts as hit by every rank's ``batch`` tokens."""
    from nxd_moe.hf import from_hf_config

    cfg = model.config
    moe_cfg = from_hf_config(cfg)
    expert_params = 0
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            expert_params += nbytes
            continue
        if "embed_tokens" in name:
            nbytes = batch * p.shape[-1] * p.element_size()  # only the rows of the step's tokens
        total += nbytes
    num_experts, top_k = moe_cfg.num_experts, moe_cfg.top_k
    # the expected fraction of experts that at least one of the tokens the experts see picks
    hit = 1 - (1 - top_k / num_experts) ** (batch * expert_parallel)
    total += expert_params / expert_parallel * hit
    text = getattr(cfg, "text_config", cfg)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_bytes = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 2  # K and V, bf16
    return total + batch * context * kv_bytes


def nxd_moe_kernel_names() -> set[str]:
    """Names of nxd_moe's Triton kernels (what the profiler calls their launches)."""
    import importlib
    import pkgutil

    import triton

    import nxd_moe.triton_kernels as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            while not isinstance(value, triton.runtime.jit.JITFunction) and hasattr(value, "fn"):
                value = value.fn  # autotune / heuristics wrappers hold the JITFunction
            if isinstance(value, triton.runtime.jit.JITFunction):
                names.add(value.__name__)
    return names


def moe_kernel_time_per_step(model, ids, new_tokens: int, compiled: bool, moe_layers: int) -> float | None:
    """Device microseconds of nxd_moe's Triton kernels per decode step and MoE layer (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from nxd_moe.models.generate import generate_tokens, static_cache

    if ids.device.type != "cuda":
        return None
    cache = static_cache(model, ids.shape[1] + new_tokens) if compiled else None
    generate_tokens(model, ids, new_tokens, compiled, cache)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate_tokens(model, ids, new_tokens, compiled, cache)
        _sync(ids.device)
    names = nxd_moe_kernel_names()
    ours = sum(event.device_time_total for event in prof.key_averages() if event.key in names)
    if ours == 0.0:
        return None
    steps = new_tokens  # the prefill's kernels are included; with a long decode they are a small share
    return ours / steps / moe_layers


def layer_graph_us(model, batch: int, device: torch.device) -> float | None:
    """CUDA-graph replay time of layer 0's patched MoE on ``batch`` decode tokens (what gpu_layer.py reports)."""
    from nxd_moe.graphs import capture
    from nxd_moe.moe import MoE

    if device.type != "cuda":
        return None
    moe = next((m for m in model.modules() if isinstance(m, MoE)), None)
    if moe is None:
        return None
    x = torch.randn(batch, 1, moe.hidden_size, device=device, dtype=torch.bfloat16)
    step = capture(lambda h: moe(h)[0], x)
    for _ in range(10):
        step(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        step(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 100


def distributed_setup(device: torch.device) -> tuple[int, int, torch.device]:
    """Under torchrun: the process group (NCCL on GPUs, gloo on CPUs) and expert parallelism over every rank;
    ``(rank, world size, this rank's device)``. A single process: ``(0, 1, device)``."""
    import os

    import torch.distributed as dist

    from nxd_moe import parallel_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    return dist.get_rank(), world, device


def slowest(value: float) -> float:
    """The largest of every rank's ``value`` (the rank everyone waits for); the value itself on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, value)
    return max(box)


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from nxd_moe.hf import from_hf_config, patch_model
    from nxd_moe.models.generate import timed_generate
    from nxd_moe.models.hf_models import build_hf_config

    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rank, world, device = distributed_setup(device)
    if world > 1:
        args.variants = ["patch_model"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "clock": args.clock, "threads": torch.get_num_threads()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    bandwidth = copy_bandwidth(device)
    hf_config = build_hf_config(args.model, num_layers=args.layers, scale=args.scale)
    if args.vocab is not None:
        hf_config.vocab_size = args.vocab
    torch.manual_seed(0)
    with torch.device(device):  # random weights drawn on the GPU: a 30B model is built in seconds
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    moe_cfg = from_hf_config(model.config)
    moe_layers = moe_cfg.num_moe_layers
    params = sum(p.numel() for p in model.parameters())
    result = {"benchmark": "hf_generate", "model": args.model, "layers": model.config.num_hidden_layers,
              "moe_layers": moe_layers, "scale": args.scale, "parameters": params,
              "vocab_size": model.config.vocab_size, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "expert_parallel": world,
              "environment": env, "roofline": {"copy_TBps": None if bandwidth is None else bandwidth / 1e12},
              "rows": []}

    def save():
        if args.out and rank == 0:
            Path(args.out).write_text(json.dumps(result, indent=1))

    prompts = {b: torch.randint(0, model.config.vocab_size, (b, args.prompt_len), device=device,
                                generator=torch.Generator(device).manual_seed(b + 1000 * rank)) for b in args.batches}
    for b in args.batches:
        # per rank under expert parallelism; every rank reads its bytes at the same time
        bytes_step = decode_bytes_per_step(model, b, args.prompt_len + args.new_tokens // 2, world)
        result["roofline"][f"B{b}"] = {"bytes_per_step": bytes_step, "decode_tokens_per_s":
                                       None if bandwidth is None else world * b * bandwidth / bytes_step}
    variants = [v for v in args.variants if v in HF_IMPLEMENTATIONS + OURS and v != "patch_model"]
    if "patch_model" in args.variants:
        variants.append("patch_model")
    base_memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    interleaved = [v for v in variants if v != "patch_model"] if args.interleave and "eager" in args.modes else []
    if interleaved:
        result["rows"] += interleaved_eager(model, prompts, interleaved, args)
        save()
    for variant in variants:
        for mode in args.modes:
            if mode == "eager" and variant in interleaved:
                continue
            compiled = mode == "compiled"
            row = {"variant": variant, "mode": mode}
            result["rows"].append(row)
            started = time.perf_counter()
            try:
                if variant == "patch_model":
                    if not getattr(model, "_bench_patched", False):
                        patch_model(model)
                        model._bench_patched = True
                else:
                    model.set_experts_implementation(variant)
                if device.type == "cuda":
                    row["memory_vs_unpatched"] = round(torch.cuda.memory_allocated(device) / base_memory, 4)
                torch._dynamo.reset()
                for b in args.batches:
                    if variant == "eager" and b > args.eager_max_batch:
                        row[f"B{b}"] = {"skipped": f"eager loop over experts above batch {args.eager_max_batch}"}
                        continue
                    timing = timed_generate(model, prompts[b], args.new_tokens, compiled, args.repeats, args.clock)
                    timing["tokens"] = timing["tokens"].tolist()
                    if world > 1:  # the slowest rank's times; every rank's sequences count
                        timing["prefill_ms"] = slowest(timing["prefill_ms"])
                        timing["decode_ms_per_step"] = slowest(timing["decode_ms_per_step"])
                        timing["decode_tokens_per_s"] = round(world * b / timing["decode_ms_per_step"] * 1e3, 1)
                    if args.profile and variant in OURS:
                        timing["moe_kernels_us_per_layer_step"] = moe_kernel_time_per_step(
                            model, prompts[b], args.new_tokens, compiled, moe_layers)
                        if variant == "patch_model":
                            timing["layer_graph_us"] = layer_graph_us(model, b, device)
                    row[f"B{b}"] = timing
                    print(f"{variant:12s} {mode:8s} B={b:3d} {timing['prefill_ms']:9.2f} ms prefill "
                          f"{timing['decode_tokens_per_s']:9.1f} tok/s", flush=True)
            except Exception as exc:  # a contender that cannot run is a row saying why, not a failed benchmark
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                print(f"{variant:12s} {mode:8s} error: {row['error']}", flush=True)
            row["wall_s"] = round(time.perf_counter() - started, 1)
            gc.collect()
            save()
    derive(result, args.batches)
    save()
    return result


def interleaved_eager(model, prompts: dict, variants: list[str], args) -> list[dict]:
    """Eager rows of the contenders that switch on one model (not ``patch_model``), timed in turns: every repeat
    times each contender once (one-token and ``--new-tokens`` generates), the order rotating from repeat to repeat,
    after each contender's warm-up. Measured on an H200 (Qwen3-30B-A3B, 4 layers, B=1): run one after the other in
    one process, whichever of two contenders ran second was 13-22% slower in either order, so only turns compare
    them."""
    from nxd_moe.models.generate import generate_timing, generate_tokens

    device = next(model.parameters()).device
    rows = {v: {"variant": v, "mode": "eager", "interleaved": True} for v in variants}

    def timed(ids, n):
        _sync(device)
        start = time.perf_counter()
        out = generate_tokens(model, ids, n, False)
        _sync(device)
        return time.perf_counter() - start, out

    for b in args.batches:
        ids = prompts[b]
        running = [v for v in variants if not (v == "eager" and b > args.eager_max_batch)]
        for v in variants:
            if v not in running:
                rows[v][f"B{b}"] = {"skipped": f"eager loop over experts above batch {args.eager_max_batch}"}
        for v in list(running):
            try:
                model.set_experts_implementation(v)
                for n in (args.new_tokens, args.new_tokens, 1):
                    timed(ids, n)
            except Exception as exc:  # a contender that cannot run is a row saying why
                rows[v]["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                running.remove(v)
        times = {v: ([], [], None) for v in running}
        for r in range(args.repeats):
            for v in running[r % len(running):] + running[:r % len(running)] if running else []:
                model.set_experts_implementation(v)
                times[v][0].append(timed(ids, 1)[0])
                t, out = timed(ids, args.new_tokens)
                times[v][1].append(t)
                times[v] = (*times[v][:2], out)
        for v in running:
            timing = generate_timing(times[v][0], times[v][1], ids, args.new_tokens, times[v][2])
            timing["tokens"] = timing["tokens"].tolist()
            rows[v][f"B{b}"] = timing
            print(f"{v:12s} eager    B={b:3d} {timing['prefill_ms']:9.2f} ms prefill "
                  f"{timing['decode_tokens_per_s']:9.1f} tok/s (interleaved)", flush=True)
    return list(rows.values())


def derive(result: dict, batches) -> None:
    """Token agreement with the reference contender; ratios to the best transformers row and to the roofline."""
    rows = result["rows"]

    def ok(row, b):
        return isinstance(row.get(f"B{b}"), dict) and "decode_tokens_per_s" in row[f"B{b}"]

    for b in batches:
        key = f"B{b}"
        ref = next((r for r in rows if r["variant"] == "eager" and r["mode"] == "eager" and ok(r, b)), None) or \
            next((r for r in rows if r["variant"] == "grouped_mm" and ok(r, b)), None)
        peers = [r for r in rows if r["variant"] in HF_IMPLEMENTATIONS and ok(r, b)]
        best_decode = max((r[key]["decode_tokens_per_s"] for r in peers), default=None)
        best_prefill = min((r[key]["prefill_ms"] for r in peers), default=None)
        roof = result["roofline"].get(key, {}).get("decode_tokens_per_s")
        for r in rows:
            if not ok(r, b):
                continue
            cell = r[key]
            if ref is not None:
                a, t = cell["tokens"], ref[key]["tokens"]
                same = sum(x == y for ra, rb in zip(a, t) for x, y in zip(ra, rb))
                cell["same_tokens_as_" + ref["variant"]] = round(same / max(1, sum(len(ra) for ra in a)), 3)
            if best_decode:
                cell["decode_vs_best_transformers"] = round(cell["decode_tokens_per_s"] / best_decode, 3)
                cell["prefill_vs_best_transformers"] = round(best_prefill / cell["prefill_ms"], 3)
            if roof:
                cell["decode_vs_roofline"] = round(cell["decode_tokens_per_s"] / roof, 3)
    for r in rows:
        for b in batches:
            if ok(r, b):
                r[f"B{b}"].pop("tokens")


def table(result: dict, batches) -> str:
    lines = [f"{result['model']} ({result['layers']} layers), {result['environment'].get('gpu', 'cpu')}: "
             "decode tokens/s (x best transformers, x roofline) | prefill ms"]
    for r in result["rows"]:
        cells = []
        for b in batches:
            c = r.get(f"B{b}")
            if not isinstance(c, dict) or "decode_tokens_per_s" not in c:
                cells.append(f"B{b}: -")
                continue
            cells.append(f"B{b}: {c['decode_tokens_per_s']:.1f} (x{c.get('decode_vs_best_transformers', math.nan):.2f},"
                         f" x{c.get('decode_vs_roofline', math.nan):.2f}) | {c['prefill_ms']:.1f}")
        lines.append(f"{r['variant']:12s} {r['mode']:8s} " + "   ".join(cells) + (f"  {r['error']}" if "error" in r
                                                                                 else ""))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a shipped config name (nxd-moe configs)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (0: the config's full depth)")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size override (default: the model's)")
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    p.add_argument("--variants", type=lambda s: s.split(","),
                   default=["grouped_mm", "batched_mm", "eager", "sonicmoe", "deepgemm", "nxd_moe", "patch_model"])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["eager", "compiled"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager-max-batch", type=int, default=16)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--interleave", action="store_true",
                   help="time the eager rows of the switchable contenders in turns (see interleaved_eager)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clock", choices=("wall", "process"), default=None,
                   help="wall time (default on a GPU) or this process's CPU time (default on a CPU: a shared CPU's "
                        "other processes do not inflate it)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (a CPU run; default torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.clock is None:
        args.clock = "wall" if args.device.startswith("cuda") else "process"
    if args.layers == 0:
        args.layers = None
    for m in args.modes:
        if m not in ("eager", "compiled"):
            p.error(f"--modes: {m!r} is not one of eager, compiled")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if result["expert_parallel"] == 1 or torch.distributed.get_rank() == 0:
        print(table(result, args.batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
