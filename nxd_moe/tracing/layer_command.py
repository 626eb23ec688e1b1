"""``nxd-moe trace`` for one MoE layer on one device: the layer a config describes built, checked with
``torch.export``, ``torch.compile(fullgraph)`` and (unless ``--skip-xla``) under XLA, its HLO written, and the
report (``trace.json``) printed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from nxd_moe.build import build_moe, scale_rounding
from nxd_moe.quantization.formats import describe_weights, reported_format
from nxd_moe.tracing.inputs import moe_inputs
from nxd_moe.tracing.options import TraceSetup, setup, tolerance
from nxd_moe.tracing.report_lines import LABEL, parameters_line, parity_with_eager, verdict
from nxd_moe.tracing.single_device import check_static, export_hlo
from nxd_moe.tracing.static_graph import compile_check, export_program
from nxd_moe.tracing.xla import import_torch_xla


def layer_report(args: argparse.Namespace, run: TraceSetup, moe: nn.Module, stats: dict,
                 experts: nn.Module | None = None) -> dict[str, Any]:
    """The report's description of the traced layer ``moe`` (``stats``: its ``ExpertsStats.summary()``);
    ``experts``: the ``ExpertMLPsV2`` whose stored weights the graph takes (default ``moe``'s)."""
    bcfg = moe.expert_mlps.blockwise_matmul_config
    experts = moe.expert_mlps if experts is None else experts
    return {
        "config": run.model.name,
        "scale": run.scale,
        "dtype": str(run.dtype).removeprefix("torch."),
        "mode": args.mode,
        "tokens": run.tokens,
        "padding": args.padding,
        "hidden_size": moe.hidden_size,
        "scale_rounding": scale_rounding(run.model, run.scale, moe.hidden_size,
                                         moe.expert_mlps.routed_experts_mlp_config.intermediate_size),
        "num_experts": run.model.num_experts,
        "top_k": run.model.top_k,
        "router": type(moe.router).__name__,
        "experts_mode": stats["mode"],
        "num_blocks": stats["num_blocks"],
        "active_blocks": stats.get("active_blocks"),
        "dynamic_while": ("intermediate" if bcfg.use_shard_on_intermediate_dynamic_while
                          else "block" if bcfg.use_shard_on_block_dynamic_while else "off"),
        "quantization": reported_format(moe.expert_mlps.routed_experts_mlp_config.quantization),
        # what the graph's weight inputs hold: the stored (8-bit / packed 4-bit) tensors, not dequantized copies
        "expert_weight_dtypes": {k: str(v.dtype).removeprefix("torch.")
                                 for k, v in experts.mlp_op.state_dict().items()},
    }


def trace_layer(args: argparse.Namespace) -> dict:
    """Build the layer a config describes and run every check; write the artifacts to ``args.out``."""
    run = setup(args)
    if not args.skip_xla:
        import_torch_xla()  # the HLO is what was asked for: without torch_xla, stop before any work
    dtype = run.dtype
    moe = build_moe(run.model, scale=run.scale, dtype=dtype, seed=args.seed, **run.overrides)
    atol = tolerance(args, dtype)
    make_inputs = moe_inputs(moe, run.tokens, args.mode, args.padding, args.seed)
    example = make_inputs(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        stats = moe(*example, return_stats=True)[-1].summary()
    report = layer_report(args, run, moe, stats)
    exported = export_program(moe, example)
    torch.export.save(exported.program, out_dir / "program.pt2")
    report["export"] = {**exported.to_dict(), "file": "program.pt2",
                        "ops": sum(exported.op_histogram.values())}
    report["compile"] = compile_check(moe, example).to_dict()
    if args.skip_xla:
        report["xla"] = {"skipped": "--skip-xla"}
    else:
        # check_static first: it then reports the one compilation (export_hlo reuses the compiled graph).
        static = check_static(moe, make_inputs, n=args.routings, atol=atol)
        hlo = export_hlo(moe, example, out_dir, atol=atol)
        report["xla"] = {"hlo": hlo, "check_static": static.to_dict()}
    report["ok"] = _all_ok(report)
    (out_dir / "trace.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _all_ok(report: dict) -> bool:
    checks = [report["export"]["static"], report["compile"]["fullgraph"]]
    if "hlo" in report["xla"]:
        hlo, static = report["xla"]["hlo"], report["xla"]["check_static"]
        checks += [hlo["static"], hlo["matches_eager"], static["ok"]]
    return all(checks)


def format_layer_report(report: dict, out_dir: str) -> str:
    """The printed report of :func:`trace_layer`."""
    blocks = ""
    if report["num_blocks"] is not None:
        blocks = f" (num_blocks {report['num_blocks']}, active {report['active_blocks']})"
    lines = [
        f"nxd-moe trace: {report['config']}  (scale 1/{report['scale']}: H={report['hidden_size']}"
        + (f" (rounded up: {report['scale_rounding']})" if report["scale_rounding"] else "")
        + f", E={report['num_experts']}, k={report['top_k']}, router={report['router']}; {report['dtype']})",
        f"{report['mode']} {report['tokens']} tokens{' with padding' if report['padding'] else ''} -> "
        f"{report['experts_mode']}{blocks}, dynamic while: {report['dynamic_while']}",
        f"expert weights {describe_weights(report['quantization'], report['dtype'])}: "
        + ", ".join(f"{k} {v}" for k, v in report["expert_weight_dtypes"].items()),
    ]
    export, compiled = report["export"], report["compile"]
    lines.append(f"{'torch.export (strict)':<{LABEL}}{verdict(export['static'])}: {export['ops']} ops, "
                 f"{len(export['data_dependent'])} data-dependent -> {out_dir}/{export['file']}")
    for problem in export["data_dependent"][:3]:
        lines.append(f"    {problem}")
    detail = (f"max |compiled - eager| {compiled['max_abs_diff']:.2e}" if compiled["fullgraph"]
              else compiled["error"])
    lines.append(f"{'torch.compile(fullgraph)':<{LABEL}}{verdict(compiled['fullgraph'])}: {detail}")
    xla = report["xla"]
    if "skipped" in xla:
        lines.append(f"{'XLA':<{LABEL}}skipped: {xla['skipped']}")
    else:
        hlo, static = xla["hlo"], xla["check_static"]
        lines.append(
            f"{'XLA HLO':<{LABEL}}{verdict(hlo['static'] and hlo['matches_eager'])}: "
            f"{hlo['compiled_graphs']} graph, {hlo['hlo_instructions']} instructions, {hlo['while_ops']} while, "
            f"CPU fallbacks {hlo['fallback_ops'] or 'none'}, host transfers during trace "
            f"{hlo['transfers_during_trace']} -> {out_dir}/{hlo['files']['hlo_proto']}")
        lines.append(parameters_line(hlo, out_dir))
        lines.append(
            f"{'XLA check_static':<{LABEL}}{verdict(static['ok'])}: {static['routings']} routings -> "
            f"{static['graphs']} graph, {static['compilations']} compilation, "
            f"{static['executions_during_trace']} mid-layer executions, "
            f"{static['transfers_during_trace']} mid-layer transfers "
            f"({static['output_fetch_transfers']} output fetches), fallbacks {static['fallback_ops'] or 'none'}, "
            f"{parity_with_eager(static)}")
        for i, step in enumerate(static["blocks"]):
            for b in step:
                lines.append(f"    routing {i}: computed {b['computed']} of {b['num_blocks']} blocks "
                             f"(active {b['active']}, static prefix {b['static_blocks']}, "
                             f"{b['blocks_per_iteration']} per iteration; skipped {b['skipped']})")
        lines.append(f"compile for Trainium2: neuronx-cc compile {out_dir}/{hlo['files']['hlo_proto']} "
                     f"--framework XLA --target trn2 --output {out_dir}/model.neff")
    if not report["ok"]:
        lines.append("SOME CHECKS FAILED")
    elif "skipped" in xla:
        lines.append("torch.export and torch.compile checks passed; XLA checks skipped, no HLO written")
    else:
        lines.append("all checks passed")
    return "\n".join(lines)
