"""``nxd-moe``: the command line.

``nxd-moe run --config configs/qwen3-30b-a3b.yaml`` builds one MoE layer of a real architecture with random
weights (H and I divided by ``--scale``), runs a prefill and a decode step, and reports which algorithm ran,
the block layout, padding overhead, dropped tokens, time per step and the error against the float64 dense
reference. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from nxd_moe.build import build_moe
from nxd_moe.config import builtin_config_names, load_model_config, to_torch_dtype
from nxd_moe.experts.backends import BACKENDS
from nxd_moe.reference import reference_for_moe

MIN_AUTO_SCALE = 16
AUTO_SCALE_MAX_HIDDEN = 256
# Subcommands that live with the code they drive: each module has HELP, add_arguments(parser), main(args) -> int.
SUBCOMMANDS = {
    "trace": "nxd_moe.trace",
    "plan": "nxd_moe.nki_kernels.plan",
}

DEFAULT_TOKENS = 512
DEFAULT_DECODE_BATCH = 8


def auto_scale(hidden_size: int) -> int:
    """The smallest power of two >= 16 that brings H down to at most 256: with the Trainium block sizes of the
    shipped configs (every active expert owns at least one 256-512 row block) that keeps each step well under a
    second on a 2-core CPU, for 8 experts or 256."""
    scale = MIN_AUTO_SCALE
    while hidden_size / scale > AUTO_SCALE_MAX_HIDDEN:
        scale *= 2
    return scale


def _scale(text: str) -> int | str:
    return text if text == "auto" else _positive_int(text)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _timed_ms(fn, repeats: int) -> tuple[object, float]:
    """Run ``fn`` once to warm up, then ``repeats`` times; return the last result and the median in ms."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


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


def _step(moe, x: torch.Tensor, repeats: int) -> dict:
    with torch.inference_mode():
        (output, stats), ms = _timed_ms(lambda: moe(x, return_stats=True), repeats)
        reference = reference_for_moe(moe, x, capacity=stats.capacity)
    summary = stats.summary()
    summary["ms"] = ms
    summary["max_abs_err"] = float((output.double() - reference).abs().max())
    summary["max_abs_ref"] = float(reference.abs().max())
    return summary


def run(args: argparse.Namespace) -> dict:
    model = load_model_config(args.config)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.capacity_factor is not None:
        overrides["capacity_factor"] = args.capacity_factor
    dtype = to_torch_dtype(args.dtype, "--dtype")
    scale = auto_scale(model.hidden_size) if args.scale == "auto" else args.scale
    with _progress(total=3, enabled=not args.no_progress) as bar:
        bar.set_description("build", refresh=False)
        moe = build_moe(model, scale=scale, dtype=dtype, seed=args.seed, backend=args.backend, **overrides)
        bar.update()
        cfg = moe.expert_mlps.routed_experts_mlp_config
        generator = torch.Generator().manual_seed(args.seed + 1)
        bar.set_description("prefill", refresh=False)
        prefill_x = torch.randn(1, args.tokens, cfg.hidden_size, generator=generator).to(dtype)
        prefill = _step(moe, prefill_x, args.repeats)
        prefill["tokens"] = args.tokens
        bar.update()
        bar.set_description("decode", refresh=False)
        decode_x = torch.randn(args.decode_batch, 1, cfg.hidden_size, generator=generator).to(dtype)
        decode = _step(moe, decode_x, args.repeats)
        decode["batch"] = args.decode_batch
        bar.update()
    return {
        "config": model.name,
        "scale": scale,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": args.backend,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "shared_experts": moe.shared_experts is not None,
        "router": type(moe.router).__name__,
        "threads": torch.get_num_threads(),
        "prefill": prefill,
        "decode": decode,
        "dropped_tokens": prefill["dropped_tokens"] + decode["dropped_tokens"],
    }


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def format_report(report: dict) -> str:
    p, d = report["prefill"], report["decode"]
    lines = [
        f"nxd-moe run: {report['config']}  (scale 1/{report['scale']}: H={report['hidden_size']}, "
        f"I={report['intermediate_size']}, "
        f"E={report['num_experts']}, k={report['top_k']}, router={report['router']}, "
        f"shared experts={'yes' if report['shared_experts'] else 'no'}; {report['dtype']}, "
        f"backend {report['backend']}, {report['threads']} threads)",
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
        f"         dropped tokens {p['dropped_tokens']}, {p['ms']:.2f} ms/step, "
        f"max |err| vs float64 dense reference {p['max_abs_err']:.2e} (max |ref| {p['max_abs_ref']:.2e})"
    )
    lines.append(
        f"decode   batch {d['batch']} -> {d['mode']}: {d['ms']:.2f} ms/step, "
        f"max |err| {d['max_abs_err']:.2e} (max |ref| {d['max_abs_ref']:.2e})"
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nxd-moe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="build one MoE layer and run a prefill and a decode step")
    run_p.add_argument("--config", required=True,
                       help=f"YAML path or built-in name ({', '.join(builtin_config_names())})")
    run_p.add_argument("--scale", type=_scale, default="auto",
                       help="divide H and I by this; 1 = full size; 'auto' (default) picks a power of two >= "
                            f"{MIN_AUTO_SCALE} that brings H to <= {AUTO_SCALE_MAX_HIDDEN}")
    run_p.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS,
                       help=f"prefill tokens (default {DEFAULT_TOKENS})")
    run_p.add_argument("--decode-batch", type=_positive_int, default=DEFAULT_DECODE_BATCH,
                       help=f"sequences in the decode step (default {DEFAULT_DECODE_BATCH})")
    run_p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | float64")
    run_p.add_argument("--block-size", type=_positive_int, default=None,
                       help="override the config's blockwise block_size")
    run_p.add_argument("--capacity-factor", type=_positive_float, default=None,
                       help="drop tokens beyond this capacity factor (default: the config's, usually dropless)")
    run_p.add_argument("--backend", default="torch", choices=sorted(BACKENDS))
    run_p.add_argument("--repeats", type=_positive_int, default=3, help="timed repetitions per step (median)")
    run_p.add_argument("--seed", type=int, default=0)
    run_p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    run_p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    run_p.add_argument("--no-progress", action="store_true", help="never show the progress bar")

    sub.add_parser("configs", help="list the built-in model configs")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.exit(2, f"nxd-moe: error: {e}\n")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
