"""``nxd-moe trace``: the subcommand's flags (:func:`add_arguments`) and its entry point (:func:`main`), which runs
the trace they ask for -- one layer (:mod:`~nxd_moe.tracing.layer_command`), a whole decoder with
``--model-layers`` (:mod:`~nxd_moe.tracing.decoder_command`), or a parallel layout's SPMD program with
``--tp/--ep/--sp/--decode-*`` (:mod:`~nxd_moe.tracing.spmd_command`) -- and prints its report.
"""

from __future__ import annotations

import argparse
import json
import sys

from nxd_moe.arguments import MIN_AUTO_SCALE, positive_int, scale_argument
from nxd_moe.model_config import builtin_config_names
from nxd_moe.quantization import QUANTIZATION_CHOICES
from nxd_moe.tracing.decoder_command import format_model_report, trace_model
from nxd_moe.tracing.layer_command import format_layer_report, trace_layer
from nxd_moe.tracing.options import DEFAULT_CACHE_LENGTH, DEFAULT_MODEL_TOKENS, DEFAULT_TOKENS, DYNAMIC_WHILE_FLAGS
from nxd_moe.tracing.spmd_command import format_layout_report, spmd_layout_from_args, trace_layout

HELP = "trace one MoE layer: torch.export, torch.compile(fullgraph) and XLA checks; write HLO for neuronx-cc"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``nxd-moe trace``'s flags: the layer and its inputs, whole decoders, parallel layouts."""
    parser.add_argument("--config", required=True,
                        help=f"YAML path or built-in name ({', '.join(builtin_config_names())})")
    parser.add_argument("--out", required=True, help="directory for the HLO, the exported program and the reports")
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                        help="prefill: one sequence of --tokens tokens; decode: --tokens sequences of one token")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help=f"tokens per forward (default {DEFAULT_TOKENS['prefill']} prefill, "
                             f"{DEFAULT_TOKENS['decode']} decode)")
    parser.add_argument("--scale", type=scale_argument, default="auto",
                        help="divide H and I by this (rounded up to a multiple of 8, or of the weight format's "
                             f"block; the report says when); 'auto' (default) picks a power of two >= {MIN_AUTO_SCALE}")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--block-size", type=positive_int, default=None, help="override the config's block_size")
    parser.add_argument("--dynamic-while", choices=sorted(DYNAMIC_WHILE_FLAGS), default=None,
                        help="blockwise padding-block skipping: use_shard_on_intermediate_dynamic_while "
                             "('intermediate'), use_shard_on_block_dynamic_while ('block'), or 'off' "
                             "(default: the config's)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="routed experts' weight format (default: the config's, bf16)")
    parser.add_argument("--padding", action="store_true", help="mask out the last quarter of the tokens")
    parser.add_argument("--routings", type=positive_int, default=3,
                        help="routings check_static runs under XLA (>= 2; default 3, the first sends every token "
                             "to the same experts)")
    parser.add_argument("--atol", type=float, default=None,
                        help="largest |XLA - eager| accepted (default 1e-4; 6e-2 for 16-bit dtypes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-xla", action="store_true", help="only torch.export and torch.compile")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--model-layers", type=positive_int, default=None,
                        help="trace a whole transformers decoder of the config's architecture instead of one layer: "
                             "this many MoE layers (the dense layers it places around them on top), MoE blocks "
                             "patched with nxd_moe, one prefill or decode step over a static KV cache; needs "
                             f"torch_xla (default --tokens {DEFAULT_MODEL_TOKENS['prefill']} prefill, "
                             f"{DEFAULT_MODEL_TOKENS['decode']} decode)")
    parser.add_argument("--cache-length", type=positive_int, default=None,
                        help=f"with --model-layers: KV cache positions (default {DEFAULT_CACHE_LENGTH}, at most the "
                             "model's sliding window)")

    spmd = parser.add_argument_group("parallel layouts (one SPMD program for every rank; runs on --tp x --ep XLA "
                                     "CPU devices, no torchrun)")
    spmd.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    spmd.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size")
    spmd.add_argument("--sp", action="store_true", help="sequence-parallel prefill (the tokens split over --tp)")
    spmd.add_argument("--decode-tp", type=positive_int, default=None,
                      help="MoE tensor-parallel size in decode (hybrid sharding; default --tp)")
    spmd.add_argument("--decode-ep", type=positive_int, default=None,
                      help="MoE expert-parallel size in decode (hybrid sharding; default --ep)")
    spmd.add_argument("--dispatch", default="all_gather", choices=("all_gather", "all_to_all", "all_to_all_v"),
                      help="expert-parallel dispatch: all_gather (default, NxD's) or all_to_all (= all_to_all_v "
                           "with static splits, the only all-to-all a static graph has)")
    spmd.add_argument("--lnc", type=int, choices=(1, 2), default=2,
                      help="logical NeuronCore size in the printed neuronx-cc command (default 2, Trn2)")


def trace(args: argparse.Namespace) -> dict:
    """The single-device trace ``args`` ask for: a whole decoder with ``--model-layers``, else one layer."""
    return trace_model(args) if args.model_layers is not None else trace_layer(args)


def main(args: argparse.Namespace) -> int:
    """Run the trace, print its report (``--json``: as JSON); exit status 0 when every check passed, 1 when one
    failed, 2 for arguments the trace refuses."""
    try:
        layout = spmd_layout_from_args(args)
        if layout is not None and args.skip_xla:
            raise ValueError("--skip-xla: a parallel layout (--tp/--ep/--sp/--decode-*) is checked under XLA only")
        if layout is not None and args.model_layers is not None:
            raise ValueError("--model-layers traces a whole decoder on one device; it does not combine with a parallel "
                             "layout (--tp/--ep/--sp/--decode-*)")
        report = trace(args) if layout is None else trace_layout(args, layout)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"nxd-moe trace: error: {e}", file=sys.stderr)
        return 2
    if layout is not None:
        text = format_layout_report(report, args.out)
    else:
        text = (format_model_report if "model" in report else format_layer_report)(report, args.out)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0 if report["ok"] else 1
