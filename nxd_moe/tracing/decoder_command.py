"""``nxd-moe trace --model-layers``: a whole transformers decoder of a config's architecture, its MoE blocks
patched with nxd_moe's ``MoE`` (torch backend), checked for one decode or prefill step over a static KV cache under
XLA, its HLO written and the report printed.

The one tracing module above the model layer: it imports :mod:`nxd_moe.models`, and transformers through it when a
trace runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nxd_moe.build import scaled_model
from nxd_moe.extras import require
from nxd_moe.models.decoder_step import StaticCacheStep, check_cache_length, replace_polar_rotary_embeddings
from nxd_moe.quantization.formats import describe_weights
from nxd_moe.tracing.inputs import model_inputs, routing_summary
from nxd_moe.tracing.options import DEFAULT_CACHE_LENGTH, DEFAULT_MODEL_TOKENS, LAYER_ONLY_FLAGS, setup, tolerance
from nxd_moe.tracing.report_lines import LABEL, parameters_line, parity_with_eager, verdict
from nxd_moe.tracing.single_device import check_static, export_hlo
from nxd_moe.tracing.xla import import_torch_xla


def trace_model(args: argparse.Namespace) -> dict:
    """Build the transformers decoder of the config's architecture, patch its MoE blocks with nxd_moe's ``MoE``
    (torch backend), and check one ``args.mode`` step over a static KV cache under XLA; write the HLO and reports
    to ``args.out``."""
    require("transformers", "--model-layers")
    # Imported once transformers is known to be there: both import it (through nxd_moe.hf).
    from nxd_moe.models.hf_models import build_hf_config, build_hf_model
    from nxd_moe.models.patch import patch_model

    given = [flag for name, flag in LAYER_ONLY_FLAGS.items() if getattr(args, name) not in (None, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: one-layer trace options, not taken with --model-layers")
    run = setup(args)
    config, dtype, scale = run.model, run.dtype, run.scale
    tokens = args.tokens or DEFAULT_MODEL_TOKENS[args.mode]
    cache_length = args.cache_length or DEFAULT_CACHE_LENGTH
    hf_config = build_hf_config(config, num_layers=args.model_layers, scale=scale, quantization=args.quantization)
    check_cache_length(hf_config, cache_length, "--cache-length")
    if args.mode == "prefill" and tokens > cache_length:
        raise ValueError(f"--tokens ({tokens}) must be <= --cache-length ({cache_length}) for a prefill")
    import_torch_xla()
    # eager attention: plain matmuls and a softmax, which every family has (GPT-OSS's attention sinks exist only
    # there); sdpa decomposes into the same ops under torch_xla
    model = build_hf_model(config, num_layers=args.model_layers, scale=scale, dtype=dtype, seed=args.seed,
                           attn_implementation="eager", quantization=args.quantization)
    build_kwargs = {} if args.block_size is None else {"block_size": args.block_size}
    patch_model(model, backend="torch", quantization=args.quantization, **build_kwargs)
    patched = model.nxd_moe_patched
    rewritten = replace_polar_rotary_embeddings(model)
    step = StaticCacheStep(model, cache_length).eval()
    make_inputs = model_inputs(step, tokens, args.mode, args.seed)
    atol = tolerance(args, dtype)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    routings = [routing_summary(step, make_inputs(i)) for i in range(args.routings)]
    # check_static first: it then reports the one compilation (export_hlo reuses the compiled graph).
    static = check_static(step, make_inputs, n=args.routings, atol=atol)
    hlo = export_hlo(step, make_inputs(1), out_dir, atol=atol)
    moe = scaled_model(config, scale, args.quantization)
    report: dict[str, Any] = {
        "config": config.name,
        "scale": scale,
        "dtype": str(dtype).removeprefix("torch."),
        "mode": args.mode,
        "tokens": tokens,
        "cache_length": cache_length,
        "hidden_size": moe.hidden_size,
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "model": {
            "class": type(model).__name__,
            "model_type": hf_config.model_type,
            "decoder_layers": hf_config.num_hidden_layers,
            "moe_layers": args.model_layers,
            "vocab_size": model.get_input_embeddings().weight.shape[0],
            "attn_implementation": "eager",
            "patched": list(patched.patched),
            "kept": [path for path, _ in patched.kept],
            "backend": patched.backend,
            "quantization": patched.quantization,
            "rewritten": {path: "PolarFreeRotaryEmbedding" for path in rewritten},
        },
        "routings": routings,
        "xla": {"hlo": hlo, "check_static": static.to_dict()},
        "neuronx_cc": (f"neuronx-cc compile {out_dir}/{hlo['files']['hlo_proto']} --framework XLA --target trn2 "
                       f"--output {out_dir}/model.neff"),
    }
    # every MoE layer ran nxd_moe's MoE in every input (none left to transformers' block)
    report["model"]["moe_layers_traced"] = all(len(r) == args.model_layers for r in routings)
    report["ok"] = (report["model"]["moe_layers_traced"] and hlo["static"] and hlo["matches_eager"]
                    and static.ok)
    (out_dir / "trace.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _routing_line(i: int, layers: list[dict]) -> str:
    modes = sorted({layer["experts_mode"] for layer in layers})
    used = "/".join(str(layer["experts_used"]) for layer in layers)
    busiest = "/".join(f"{layer['max_expert_tokens']}" for layer in layers)
    return (f"    input {i}: {', '.join(modes)}; experts used per MoE layer {used}, busiest expert's tokens {busiest} "
            f"of {layers[0]['tokens'] if layers else 0}")


def format_model_report(report: dict, out_dir: str) -> str:
    """The printed report of :func:`trace_model`."""
    model, hlo, static = report["model"], report["xla"]["hlo"], report["xla"]["check_static"]
    shape = (f"{report['tokens']} sequences x 1 new token" if report["mode"] == "decode"
             else f"1 sequence of {report['tokens']} tokens")
    rewritten = f"; rewritten for XLA: {', '.join(model['rewritten'])}" if model["rewritten"] else ""
    experts = describe_weights(model["quantization"], report["dtype"])
    lines = [
        f"nxd-moe trace: {report['config']} whole decoder  ({model['class']}: {model['decoder_layers']} layers, "
        f"{model['moe_layers']} MoE; scale 1/{report['scale']}: H={report['hidden_size']}, E={report['num_experts']}, "
        f"k={report['top_k']}, vocab {model['vocab_size']}; {report['dtype']}; {model['attn_implementation']} "
        "attention)",
        f"{report['mode']} {shape}, static KV cache of {report['cache_length']} positions; MoE blocks patched "
        f"{len(model['patched'])} ({model['backend']} backend, experts {experts}){rewritten}",
        *(_routing_line(i, layers) for i, layers in enumerate(report["routings"])),
        f"{'XLA HLO':<{LABEL}}{verdict(hlo['static'] and hlo['matches_eager'])}: "
        f"{hlo['compiled_graphs']} graph, {hlo['hlo_instructions']} instructions, CPU fallbacks "
        f"{hlo['fallback_ops'] or 'none'}, host transfers during trace {hlo['transfers_during_trace']} -> "
        f"{out_dir}/{hlo['files']['hlo_proto']}",
        parameters_line(hlo, out_dir),
        f"{'XLA check_static':<{LABEL}}{verdict(static['ok'])}: {static['routings']} inputs -> {static['graphs']} "
        f"graph, {static['compilations']} compilation, {static['executions_during_trace']} mid-step executions, "
        f"{static['transfers_during_trace']} mid-step transfers ({static['output_fetch_transfers']} output "
        f"fetches), fallbacks {static['fallback_ops'] or 'none'}, {parity_with_eager(static)}",
        f"compile for Trainium2: {report['neuronx_cc']}",
    ]
    if not model["moe_layers_traced"]:
        lines.append(f"not every MoE layer ran nxd_moe's MoE (expected {model['moe_layers']} per input)")
    lines.append("all checks passed" if report["ok"] else "SOME CHECKS FAILED")
    return "\n".join(lines)
