"""``nxd-moe trace --tp --ep`` (and ``--sp``, ``--decode-tp``, ``--decode-ep``): the layer a config describes as
one SPMD program for every rank of a parallel layout, checked on ``world_size`` XLA CPU devices against the
single-device layer, exported, and the report printed. No torchrun: every rank runs in this process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn

from nxd_moe.build import build_moe
from nxd_moe.moe_configs import ExpertParallelConfig
from nxd_moe.quantization.formats import describe_weights
from nxd_moe.tracing.inputs import block_inputs
from nxd_moe.tracing.layer_command import layer_report
from nxd_moe.tracing.options import setup, tolerance
from nxd_moe.tracing.report_lines import LABEL, verdict
from nxd_moe.tracing.spmd import check_spmd, export_spmd
from nxd_moe.tracing.spmd_layout import SPMDLayout, build_rank_layers
from nxd_moe.tracing.spmd_program import to_devices
from nxd_moe.tracing.xla import xla_devices


def spmd_layout_from_args(args: argparse.Namespace) -> SPMDLayout | None:
    """The layout ``nxd-moe trace``'s parallel flags ask for, or None for a single-device trace."""
    layout = SPMDLayout(args.tp, args.ep, args.sp, args.decode_tp, args.decode_ep)
    if layout.world_size == 1 and not args.sp and args.decode_tp is None and args.decode_ep is None:
        return None
    return layout


def neuronx_cc_command(out_dir: str, layout: SPMDLayout, lnc: int) -> dict:
    """The compile command for the exported program, and the cores it runs on."""
    return {
        "command": f"neuronx-cc compile {out_dir}/model.hlo_module.pb --framework XLA --target trn2 --lnc {lnc} "
                   f"--model-type transformer --auto-cast none --output {out_dir}/model.neff",
        "lnc": lnc,
        "world_size": layout.world_size,
        "physical_neuron_cores": layout.world_size * lnc,
    }


def trace_layout(args: argparse.Namespace, layout: SPMDLayout) -> dict:
    """``nxd-moe trace`` for a parallel layout: build every rank's layer, check the SPMD program over
    ``args.routings`` routings on ``world_size`` XLA CPU devices, export it; the report extends the single-device
    one (``parallel``, ``collectives``, ``shards``, ``neuronx_cc``)."""
    run = setup(args)
    layout.check(run.model.num_experts, run.tokens, args.mode)  # bad layouts fail here, before anything is built
    dispatch = "all_to_all_v" if args.dispatch == "all_to_all" else args.dispatch

    def build(**kwargs) -> nn.Module:
        return build_moe(run.model, scale=run.scale, dtype=run.dtype, seed=args.seed,
                         sequence_parallel=layout.sequence_parallel,
                         expert_parallel_config=ExpertParallelConfig(dispatch), **run.overrides, **kwargs)

    devices = xla_devices(layout.world_size)
    full, ranks = build_rank_layers(build, layout)
    atol = tolerance(args, run.dtype, full_precision=1e-5)
    make_inputs = block_inputs(full, layout, run.tokens, args.mode, args.padding, args.seed)
    with torch.no_grad():
        stats = full(*make_inputs(1), return_stats=True)[-1].summary()
    to_devices(ranks, devices)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    static = check_spmd(full, ranks, layout, make_inputs, args.mode, n=args.routings, atol=atol)
    whole = {k: v.shape for k, v in full.state_dict().items()}
    exported = export_spmd(ranks, layout, make_inputs(1), args.mode, out_dir, whole) if static.host_sync is None else {}
    report = layer_report(args, run, full, stats, experts=ranks[0].expert_mlps)
    report.update({
        "parallel": {**layout.to_dict(), "dispatch": dispatch, "token_groups": layout.expert_model_parallel_size},
        "export": {"skipped": "SPMD program: torch.export and torch.compile have no XLA collectives; the XLA "
                              "checks below are the proof"},
        "compile": {"skipped": "SPMD program (see export)"},
        "xla": {"hlo": exported, "check_static": static.to_dict()},
        "collectives": static.collectives,
        "neuronx_cc": neuronx_cc_command(str(out_dir), layout, args.lnc),
    })
    report["ok"] = static.ok
    (out_dir / "trace.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_layout_report(report: dict, out_dir: str) -> str:
    """The printed report of :func:`trace_layout`."""
    par, static = report["parallel"], report["xla"]["check_static"]
    hlo = report["xla"]["hlo"]
    decode = ""
    if par["moe_decode_tensor_model_parallel_size"] or par["moe_decode_expert_model_parallel_size"]:
        decode = (f", decode TP {par['moe_decode_tensor_model_parallel_size']} EP "
                  f"{par['moe_decode_expert_model_parallel_size']}")
    lines = [
        f"nxd-moe trace: {report['config']}  (scale 1/{report['scale']}: H={report['hidden_size']}, "
        f"E={report['num_experts']}, k={report['top_k']}, router={report['router']}; {report['dtype']})",
        f"SPMD program for {par['world_size']} ranks: TP {par['tensor_model_parallel_size']} x EP "
        f"{par['expert_model_parallel_size']}{decode}, sequence parallel {'on' if par['sequence_parallel'] else 'off'}"
        f", dispatch {par['dispatch']}; rank = an s32[1] input (SPMDRank)",
        f"{report['mode']} {report['tokens']} tokens per token group ({par['token_groups']} groups)"
        f"{' with padding' if report['padding'] else ''} -> {report['experts_mode']}, expert weights "
        f"{describe_weights(report['quantization'], report['dtype'])}",
    ]
    lines.append(f"{'one program':<{LABEL}}{verdict(static['static'])}: {static['routings']} routings x "
                 f"{static['world_size']} ranks -> {static['graphs']} graph, identical on every rank "
                 f"{static['identical_across_ranks']}, {static['compilations']} compilation, "
                 f"{static['transfers_during_trace']} host transfers, fallbacks {static['fallback_ops'] or 'none'}"
                 + (f"; {static['host_sync']}" if static["host_sync"] else ""))
    lines.append(f"{'routings':<{LABEL}}EP ranks receiving pairs: {static['routing_ranks']}")
    lines.append(f"{'run on ' + str(static['world_size']) + ' XLA devices':<{LABEL}}"
                 f"{verdict(static['matches_single_device'])}: max |rank output - "
                 f"single-device layer| {static['max_abs_diff']:.2e} (max |output| {static['max_abs_ref']:.2e}, "
                 f"atol {static['atol']:g} relative above 1)")
    for op, c in report["collectives"].items():
        lines.append(f"    {op:<15} x{c['count']:<3} replica_groups {c['replica_groups']}, "
                     f"{c['bytes_per_rank'] / 1024:.1f} KiB received per rank")
    if hlo:
        lines.append(f"{'files':<{LABEL}}{out_dir}/{hlo['files']['hlo_proto']} ({hlo['hlo_instructions']} "
                     f"instructions), {out_dir}/{hlo['files']['parameters']}, {out_dir}/shards/rank*.pt")
        cc = report["neuronx_cc"]
        lines.append(f"compile for Trainium2 ({cc['world_size']} ranks, {cc['physical_neuron_cores']} NeuronCores at "
                     f"LNC {cc['lnc']}): {cc['command']}")
    lines.append("all checks passed" if report["ok"] else "SOME CHECKS FAILED")
    return "\n".join(lines)
