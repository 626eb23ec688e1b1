"""``nxd-moe``: the command line.

``nxd-moe run --config configs/qwen3-30b-a3b.yaml`` builds one MoE layer of a real architecture with random
weights (H and I divided by ``--scale``), runs a prefill and a decode step, and reports which algorithm ran,
the block layout, padding overhead, dropped tokens, time per step and the error against the float64 dense
reference. ``--json`` prints the same as one JSON object.

``--device cuda`` runs the layer on the GPU (``--backend triton`` for the Triton kernels, ``torch`` or ``nki_sim``)
in bfloat16 unless ``--dtype`` says otherwise (a CPU run defaults to float32), and reports each step's time twice:
``ms`` for an eager call (what HF ``generate`` or a debugger sees: host work included) and ``graph_ms`` for a warm
call replayed from a CUDA graph (what a serving engine sees). Inputs are drawn on the CPU, so a CPU and a GPU run
see the same tokens, and the float64 reference is computed on the CPU either way.

``torchrun --nproc-per-node N -m nxd_moe.cli run --config ... --tp A --ep B`` runs the same job model-parallel
(gloo on a CPU; NCCL with ``--device cuda``, one GPU per rank, bfloat16 and graph replays as above): each token
group (TP group) feeds its own sequence and decode batch, rank 0 reports (times: the slowest rank's).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nxd_moe import parallel_state
from nxd_moe.arguments import (
    AUTO_SCALE_MAX_HIDDEN,
    MIN_AUTO_SCALE,
    auto_scale,
    positive_float,
    positive_int,
    resolve_device,
    resolve_dtype,
    scale_argument,
)
from nxd_moe.build import build_moe, scale_rounding, scaled_model
from nxd_moe.experts.backends import BACKENDS
from nxd_moe.graphs import GraphedStep, capture
from nxd_moe.model_config import MoEModelConfig, builtin_config_names, load_model_config
from nxd_moe.moe_configs import ALL_TO_ALL_SPLITS, EXPERT_PARALLEL_DISPATCHES, TRANSPORTS, ExpertParallelConfig
from nxd_moe.parallel.sharding import load_full_state_dict
from nxd_moe.quantization import QUANTIZATION_CHOICES
from nxd_moe.quantization.activations import ACTIVATION_QUANTIZATION_CHOICES, activation_quantization_spec
from nxd_moe.quantization.formats import describe_weights, reported_format
from nxd_moe.quantization.quantizer import expert_weight_bytes
from nxd_moe.reference import reference_for_moe

# Subcommands that live with the code they drive: each module has HELP, add_arguments(parser), main(args) -> int.
SUBCOMMANDS = {
    "trace": "nxd_moe.tracing.command",
    "plan": "nxd_moe.nki_kernels.plan",
    "generate": "nxd_moe.application.generate_command",
    "compile": "nxd_moe.application.command",
    "checkpoint": "nxd_moe.models.checkpoint",
}

DEFAULT_TOKENS = 512
DEFAULT_DECODE_BATCH = 8
# Timed CUDA-graph replays per step (at least): replays are cheap, so more samples than eager calls.
GRAPH_REPLAYS = 20


def _timed_ms(fn, repeats: int, device: torch.device | None = None) -> tuple[object, float]:
    """Run ``fn`` once to warm up, then ``repeats`` times; return the last result and the median in ms (on a CUDA
    ``device``, each call's kernels included: the clock stops after a synchronize)."""
    def sync():
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    result = fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def _graphed_ms(step: GraphedStep, repeats: int) -> float:
    """Median time (ms, CUDA events) of one replay of a captured step."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(max(repeats, GRAPH_REPLAYS)):
        start.record()
        step.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextmanager
def _progress(total: int, enabled: bool):
    """A progress bar on stderr that appears only if the run takes more than two seconds, and only on a
    terminal (``disable=None`` is tqdm's "not a TTY")."""
    from tqdm import tqdm

    bar = tqdm(total=total, delay=2.0, file=sys.stderr, disable=None if enabled else True, leave=False,
               unit="step")
    try:
        yield bar
    finally:
        bar.close()


def _graph_time(moe, x: torch.Tensor, repeats: int) -> dict:
    """``{"graph_ms": ...}`` for the step captured as a CUDA graph (on a GPU), ``{"graph_error": ...}`` where the
    step cannot be captured (a backend or dispatch that syncs with the host), ``{}`` on a CPU. Under a model-parallel
    world every rank captures and replays together (the graph holds the collectives)."""
    if x.device.type != "cuda":
        return {}
    try:
        return {"graph_ms": _graphed_ms(capture(moe, x), repeats)}
    except Exception as error:
        return {"graph_error": f"{type(error).__name__}: {error}"[:300]}


def _step(moe, x: torch.Tensor, repeats: int, unquantized=None) -> dict:
    """One timed step with its error against the float64 reference of the layer's own (for a quantized layer:
    dequantized) weights and, given the ``unquantized`` layer, the quantization error against its output."""
    with torch.inference_mode():
        (output, stats), ms = _timed_ms(lambda: moe(x, return_stats=True), repeats, x.device)
        graph = _graph_time(moe, x, repeats)
        reference = reference_for_moe(moe, x, capacity=stats.capacity)  # float64, on the CPU
        original = None if unquantized is None else unquantized(x)[0]
    summary = stats.summary()
    summary["ms"] = ms
    summary.update(graph)
    summary["max_abs_err"] = float((output.double().cpu() - reference).abs().max())
    summary["max_abs_ref"] = float(reference.abs().max())
    if original is not None:
        summary["max_abs_err_vs_unquantized"] = float((output.double() - original.double()).abs().max())
    return summary


def _overrides(args: argparse.Namespace) -> dict:
    overrides = {}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.capacity_factor is not None:
        overrides["capacity_factor"] = args.capacity_factor
    if getattr(args, "quantization", None) is not None:
        overrides["quantization"] = args.quantization
    if getattr(args, "activation_quantization", None) is not None:
        overrides["activation_quantization"] = args.activation_quantization
    return overrides


def _is_parallel(args: argparse.Namespace) -> bool:
    return (args.tp * args.ep > 1 or args.sp or args.decode_tp is not None or args.decode_ep is not None
            or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def _setup(args: argparse.Namespace, device: torch.device | None = None) -> tuple[MoEModelConfig, torch.dtype, int]:
    """The run's model config, dtype (``--dtype`` or ``device``'s default) and scale (``--scale auto``
    resolved); applies ``--threads``."""
    model = load_model_config(args.config)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, torch.device("cpu") if device is None else device)
    return model, dtype, auto_scale(model.hidden_size) if args.scale == "auto" else args.scale


def _report(args: argparse.Namespace, model: MoEModelConfig, scale: int, dtype: torch.dtype, moe, prefill: dict,
            decode: dict, parallel: dict | None = None) -> dict:
    """The run's report: the layer ``moe`` (the single-device one of a parallel run), its two steps and, for a
    parallel run, the layout."""
    cfg = moe.expert_mlps.routed_experts_mlp_config
    experts_activations = activation_quantization_spec(cfg)
    report = {
        "config": model.name,
        "scale": scale,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": args.backend,
        "device": str(moe.router.linear_router.weight.device),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "scale_rounding": scale_rounding(model, scale, cfg.hidden_size, cfg.intermediate_size),
        "num_experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "quantization": reported_format(cfg.quantization),
        "activation_quantization": (cfg.activation_quantization if experts_activations is None
                                    else experts_activations.describe()),
        "expert_weight_bytes": expert_weight_bytes(moe.expert_mlps),
        "shared_experts": moe.shared_experts is not None,
        "router": type(moe.router).__name__,
        "threads": torch.get_num_threads(),
    }
    if parallel is not None:
        report["parallel"] = parallel
    report.update(prefill=prefill, decode=decode, dropped_tokens=prefill["dropped_tokens"] + decode["dropped_tokens"])
    return report


def run(args: argparse.Namespace) -> dict | None:
    """The report (on rank 0 of a model-parallel run; None on the other ranks)."""
    if _is_parallel(args):
        return run_parallel(args)
    device = resolve_device(args.device, args.backend)
    model, dtype, scale = _setup(args, device)
    overrides = _overrides(args)
    with _progress(total=3, enabled=not args.no_progress) as bar:
        bar.set_description("build", refresh=False)
        moe = build_moe(model, scale=scale, dtype=dtype, seed=args.seed, backend=args.backend, device=device,
                        **overrides)
        cfg = moe.expert_mlps.routed_experts_mlp_config
        unquantized = None
        if cfg.quantization != "bf16":  # the same random weights before quantization, to report its error
            shapes = scaled_model(model, scale, cfg.quantization)
            unquantized = build_moe(shapes, dtype=dtype, seed=args.seed, device=device,
                                    **{**overrides, "quantization": "bf16", "activation_quantization": "none"})
        bar.update()
        generator = torch.Generator().manual_seed(args.seed + 1)
        bar.set_description("prefill", refresh=False)
        prefill_x = torch.randn(1, args.tokens, cfg.hidden_size, generator=generator).to(device, dtype)
        prefill = _step(moe, prefill_x, args.repeats, unquantized)
        prefill["tokens"] = args.tokens
        bar.update()
        bar.set_description("decode", refresh=False)
        decode_x = torch.randn(args.decode_batch, 1, cfg.hidden_size, generator=generator).to(device, dtype)
        decode = _step(moe, decode_x, args.repeats, unquantized)
        decode["batch"] = args.decode_batch
        bar.update()
    return _report(args, model, scale, dtype, moe, prefill, decode)


def _parallel_step(full, moe, x: torch.Tensor, batch: int, sharded: bool, repeats: int, device: torch.device,
                   unquantized=None) -> dict:
    """One step on this rank's part of the block's input ``x (D * batch, S, H)``; error against the float64
    reference of the same tokens (and, given the ``unquantized`` single-device layer, against its output: the
    quantization error), gathered over the ranks (time: the slowest rank's)."""
    d, j = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_size()

    def mine(t: torch.Tensor) -> torch.Tensor:
        t = t[d * batch:(d + 1) * batch]
        width = t.shape[1] // tp
        return t[:, j * width:(j + 1) * width] if sharded else t

    local = mine(x).to(device)
    with torch.inference_mode():
        (output, stats), ms = _timed_ms(lambda: moe(local, return_stats=True), repeats, device)
        graph = _graph_time(moe, local, repeats)
        # Capacity drops depend on every token of the block; otherwise this rank's tokens are enough.
        reference = (mine(reference_for_moe(full, x, capacity=stats.capacity)) if stats.capacity is not None
                     else reference_for_moe(full, local.cpu()))
        output = output.cpu()
        original = None if unquantized is None else mine(unquantized(x)[0])
    summary = stats.summary()
    mine_numbers = {"err": float((output.double() - reference).abs().max()), "ref": float(reference.abs().max()),
                    "ms": ms, "bytes": summary["bytes_moved"], "load": summary["rank_load"],
                    "vs_unquantized": None if original is None else float((output.double() - original.double())
                                                                          .abs().max()), **graph}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine_numbers)
    summary.update(
        ms=max(e["ms"] for e in everyone),
        max_abs_err=max(e["err"] for e in everyone),
        max_abs_ref=max(e["ref"] for e in everyone),
        bytes_moved_per_rank=[e["bytes"] for e in everyone],
        rank_load_per_rank=[e["load"] for e in everyone],
    )
    if unquantized is not None:
        summary["max_abs_err_vs_unquantized"] = max(e["vs_unquantized"] for e in everyone)
    errors = [e["graph_error"] for e in everyone if "graph_error" in e]
    if errors:
        summary["graph_error"] = errors[0]
    elif "graph_ms" in mine_numbers:  # the slowest rank's replay
        summary["graph_ms"] = max(e["graph_ms"] for e in everyone)
    for key in ("bytes_moved", "rank_load", "bytes_by_step", "local_experts"):
        summary.pop(key, None)
    return summary


def run_parallel(args: argparse.Namespace) -> dict | None:
    """The run job on every rank of a ``torchrun`` launch (gloo on CPU; NCCL with ``--device cuda``, one GPU per
    local rank); the single-device layer with the same seed is built on each rank (on the CPU) for the reference
    and sharded into the parallel one."""
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        raise ValueError(f"--tp {args.tp} --ep {args.ep} runs on {args.tp * args.ep} processes: launch with "
                         f"torchrun --nproc-per-node {args.tp * args.ep} -m nxd_moe.cli run ...")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    device = resolve_device(str(device), args.backend)
    model, dtype, scale = _setup(args, device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        parallel_state.initialize_model_parallel(args.tp, args.ep, moe_decode_tensor_model_parallel_size=args.decode_tp,
                                                 moe_decode_expert_model_parallel_size=args.decode_ep)
        if args.sp and args.tokens % args.tp:
            raise ValueError(f"--sp shards the --tokens ({args.tokens}) over --tp ({args.tp}); pick a multiple")
        common = dict(scale=scale, dtype=dtype, seed=args.seed, backend=args.backend, sequence_parallel=args.sp,
                      **_overrides(args))
        # The single-device layers are references on the CPU: the torch backend, whatever --backend the
        # parallel layer runs (a GPU backend cannot run there).
        on_cpu = {**common, "backend": "torch"}
        full = build_moe(model, model_parallel=False, **on_cpu)
        unquantized = None
        if full.expert_mlps.routed_experts_mlp_config.quantization != "bf16":  # the same weights before quantization
            shapes = scaled_model(model, scale, full.expert_mlps.routed_experts_mlp_config.quantization)
            unquantized = build_moe(shapes, model_parallel=False, **{**on_cpu, "scale": 1, "quantization": "bf16"})
        placement = ExpertParallelConfig(args.dispatch, all_to_all_splits=args.all_to_all_splits,
                                         micro_batches=args.micro_batches, transport=args.transport)
        moe = load_full_state_dict(build_moe(model, expert_parallel_config=placement, device=device, **common),
                                   full.state_dict())
        cfg = full.expert_mlps.routed_experts_mlp_config
        groups = parallel_state.get_expert_model_parallel_size()
        generator = torch.Generator().manual_seed(args.seed + 1)
        prefill_x = torch.randn(groups, args.tokens, cfg.hidden_size, generator=generator).to(dtype)
        decode_x = torch.randn(groups * args.decode_batch, 1, cfg.hidden_size, generator=generator).to(dtype)
        prefill = _parallel_step(full, moe, prefill_x, 1, args.sp, args.repeats, device, unquantized)
        decode = _parallel_step(full, moe, decode_x, args.decode_batch, False, args.repeats, device, unquantized)
        layout = parallel_state.get_parallel_layout()
        rank = dist.get_rank()
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()
    if rank:
        return None
    prefill["tokens"], decode["batch"] = args.tokens, args.decode_batch
    report = _report(args, model, scale, dtype, full, prefill, decode, parallel={
        "world_size": layout.world_size,
        "tensor_model_parallel_size": layout.tensor_model_parallel_size,
        "expert_model_parallel_size": layout.expert_model_parallel_size,
        "moe_prefill": list(layout.moe_prefill),
        "moe_decode": list(layout.moe_decode),
        "sequence_parallel": args.sp,
        "dispatch": args.dispatch,
        "all_to_all_splits": args.all_to_all_splits,
        "micro_batches": args.micro_batches,
        "transport": args.transport,
        "token_groups": groups,
    })
    report["device"] = str(device.type)  # the parallel layer's (the reference ran on the CPU)
    return report


def _kib(values: list[int]) -> str:
    return f"{max(values) / 1024:.1f} KiB max/rank"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _times(step: dict) -> str:
    """``1.23 ms/step`` on a CPU; eager and CUDA-graph times on a GPU."""
    if "graph_ms" in step:
        return f"{step['ms']:.3f} ms/step eager, {step['graph_ms']:.3f} ms/step CUDA graph"
    if "graph_error" in step:
        return f"{step['ms']:.3f} ms/step eager (no CUDA graph: {step['graph_error']})"
    return f"{step['ms']:.2f} ms/step"


def format_report(report: dict) -> str:
    p, d = report["prefill"], report["decode"]
    lines = [
        f"nxd-moe run: {report['config']}  (scale 1/{report['scale']}: H={report['hidden_size']}, "
        f"I={report['intermediate_size']}"
        + (f" (rounded up: {report['scale_rounding']})" if report["scale_rounding"] else "") + ", "
        f"E={report['num_experts']}, k={report['top_k']}, router={report['router']}, "
        f"shared experts={'yes' if report['shared_experts'] else 'no'}; {report['dtype']}, "
        f"backend {report['backend']} on {report['device']}"
        + (f", {report['threads']} threads)" if report["device"] == "cpu" else ")"),
        f"experts  weights {describe_weights(report['quantization'], report['dtype'])}: "
        f"{report['expert_weight_bytes'] / 2**20:.2f} MiB"
        + (f", activations {report['activation_quantization']}"
           if report.get("activation_quantization", "none") != "none" else ""),
        f"prefill  {p['tokens']} tokens -> {p['mode']}",
    ]
    if p["num_blocks"] is not None:
        lines.append(
            f"         block_size {p['block_size']}, num_blocks {p['num_blocks']} (active {p['active_blocks']}); "
            f"padding overhead: provisioned-for-worst-case {_pct(p['padding_overhead_provisioned'])}, "
            f"algorithmic {_pct(p['padding_overhead_algorithmic'])}"
        )
    if p["capacity"] is not None:
        lines.append(f"         capacity {p['capacity']} tokens per expert")
    lines.append(
        f"         dropped tokens {p['dropped_tokens']}, {_times(p)}, "
        f"max |err| vs float64 dense reference {p['max_abs_err']:.2e} (max |ref| {p['max_abs_ref']:.2e})"
    )
    lines.append(
        f"decode   batch {d['batch']} -> {d['mode']}: {_times(d)}, "
        f"max |err| {d['max_abs_err']:.2e} (max |ref| {d['max_abs_ref']:.2e})"
    )
    if "max_abs_err_vs_unquantized" in p:
        lines.append(f"quantization error vs the unquantized layer: prefill max |err| "
                     f"{p['max_abs_err_vs_unquantized']:.2e}, decode {d['max_abs_err_vs_unquantized']:.2e}")
    par = report.get("parallel")
    if par is not None:
        (ptp, pep), (dtp, dep) = par["moe_prefill"], par["moe_decode"]
        lines.insert(1, f"parallel world {par['world_size']}: TP {par['tensor_model_parallel_size']} x EP "
                        f"{par['expert_model_parallel_size']} (MoE prefill TP {ptp} x EP {pep}, decode TP {dtp} x EP "
                        f"{dep}), sequence parallel {'on' if par['sequence_parallel'] else 'off'}, dispatch "
                        f"{par['dispatch']}; {par['token_groups']} token group(s), each with its own sequence and "
                        "decode batch; rank 0 reports, time = slowest rank")
        lines.append(f"moved    prefill {_kib(p['bytes_moved_per_rank'])} (pairs per rank "
                     f"{p['rank_load_per_rank']}), decode {_kib(d['bytes_moved_per_rank'])}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nxd-moe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="build one MoE layer and run a prefill and a decode step")
    run_p.add_argument("--config", required=True,
                       help=f"YAML path or built-in name ({', '.join(builtin_config_names())})")
    run_p.add_argument("--scale", type=scale_argument, default="auto",
                       help="divide H and I by this (rounded up to a multiple of 8, or of the weight format's block; "
                            "the report says when); 1 = full size; 'auto' (default) picks a power of two >= "
                            f"{MIN_AUTO_SCALE} that brings H to <= {AUTO_SCALE_MAX_HIDDEN}")
    run_p.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS,
                       help=f"prefill tokens (default {DEFAULT_TOKENS})")
    run_p.add_argument("--decode-batch", type=positive_int, default=DEFAULT_DECODE_BATCH,
                       help=f"sequences in the decode step (default {DEFAULT_DECODE_BATCH})")
    run_p.add_argument("--dtype", default=None,
                       help="float32 | bfloat16 | float16 | float64 (default: bfloat16 on --device cuda, else "
                            "float32)")
    run_p.add_argument("--block-size", type=positive_int, default=None,
                       help="override the config's blockwise block_size")
    run_p.add_argument("--capacity-factor", type=positive_float, default=None,
                       help="drop tokens beyond this capacity factor (default: the config's, usually dropless)")
    run_p.add_argument("--backend", default="torch", choices=sorted(BACKENDS),
                       help="expert computation (default torch; triton needs --device cuda and Triton)")
    run_p.add_argument("--device", default="cpu",
                       help="cpu (default) or cuda / cuda:N; the float64 reference is computed on the CPU either way")
    run_p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                       help="routed experts' weight format (default: the config's, bf16): fp8 = E4M3 per expert and "
                            "channel, fp8_block = E4M3 with 128x128 block scales, mxfp4 = OCP MX FP4")
    run_p.add_argument("--activation-quantization", default=None, choices=ACTIVATION_QUANTIZATION_CHOICES,
                       help="fp8 = W8A8: the experts' activations quantized to FP8 E4M3 on the fly (per token with "
                            "fp8 weights, per token and 128 columns with fp8_block), FP8 x FP8 GEMMs; needs "
                            "--quantization fp8 or fp8_block (default: the config's, none)")
    run_p.add_argument("--repeats", type=positive_int, default=3, help="timed repetitions per step (median)")
    run_p.add_argument("--seed", type=int, default=0)
    run_p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    run_p.add_argument("--tp", type=positive_int, default=1,
                       help="tensor-parallel size (model parallel runs: launch with torchrun --nproc-per-node N)")
    run_p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size")
    run_p.add_argument("--decode-tp", type=positive_int, default=None,
                       help="MoE tensor-parallel size in decode (hybrid sharding; default --tp)")
    run_p.add_argument("--decode-ep", type=positive_int, default=None,
                       help="MoE expert-parallel size in decode (hybrid sharding; default --ep)")
    run_p.add_argument("--sp", action="store_true", help="sequence parallelism in prefill (shards --tokens over --tp)")
    run_p.add_argument("--dispatch", default="all_gather", choices=EXPERT_PARALLEL_DISPATCHES,
                       help="expert-parallel token dispatch (default all_gather, NxD's)")
    run_p.add_argument("--all-to-all-splits", default="static", choices=ALL_TO_ALL_SPLITS,
                       help="all_to_all_v buffers: static (default; no host sync, CUDA-graph capturable) or exact "
                            "(counts exchanged first: fewer bytes, one host sync per step)")
    run_p.add_argument("--micro-batches", type=positive_int, default=None,
                       help="static all_to_all_v: exchange in this many micro-batches beside the experts (default: "
                            "the rule's count from the exchange's bytes and the held weights)")
    run_p.add_argument("--transport", default="nccl", choices=TRANSPORTS,
                       help="static all_to_all_v: nccl (default) or nvlink (rows written straight into the peers' "
                            "buffers; NCCL where that cannot run)")
    run_p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    run_p.add_argument("--no-progress", action="store_true", help="never show the progress bar")

    sub.add_parser("configs", help="list the built-in model configs")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    for subparser in sub.choices.values():  # main() names an unknown flag with its subcommand's usage
        subparser.set_defaults(subcommand_parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.subcommand_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[args.command]).main(args)
    if args.command == "configs":
        for name in builtin_config_names():
            model = load_model_config(name)
            print(f"{name:18s} E={model.num_experts:<4d} k={model.top_k:<2d} H={model.hidden_size:<5d} "
                  f"I={model.intermediate_size:<6d} router={model.router.type}")
        return 0
    try:
        report = run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        parser.exit(2, f"nxd-moe: error: {e}\n")
    if report is not None:
        print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
