"""``nxd-moe compile`` and ``nxd-moe generate --app``: the application from the command line.

``nxd-moe compile (--config NAME | --hf-model DIR) --out DIR [sizes, buckets, sampling]`` builds the application of a
shipped architecture (random weights, ``--layers`` / ``--scale``) or a local checkpoint and writes its compiled
directory (:meth:`~nxd_moe.application.CausalLMApplication.compile`); ``--neuron-config FILE`` takes NxD Inference's
fields from a JSON file instead of the flags. ``nxd-moe generate --app DIR`` loads such a directory and generates
from ``--prompt-ids`` (or random prompts), printing the tokens, time to first token and decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from nxd_moe.application.application import CausalLMApplication
from nxd_moe.application.config import ApplicationConfig
from nxd_moe.arguments import positive_int, resolve_device, resolve_dtype, scale_argument

HELP = "write the compiled directory of an MoE model's application (NxD Inference's compile)"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a shipped architecture (name or YAML), random weights")
    source.add_argument("--hf-model", help="a local transformers checkpoint directory (safetensors)")
    parser.add_argument("--out", required=True, help="the compiled directory to write")
    parser.add_argument("--layers", type=int, default=2, help="with --config: MoE layers (0: full depth; default 2)")
    parser.add_argument("--scale", type=scale_argument, default="auto",
                        help="with --config: divide the widths by this (1 = full size; auto: 1 on a GPU, else 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default: HLO for neuronx-cc when torch_xla is "
                                                        "installed) or cuda (CUDA graphs per bucket)")
    parser.add_argument("--neuron-config", help="a JSON file of NxD Inference (MoE)NeuronConfig fields; replaces "
                                                "the size, bucket and sampling flags")
    parser.add_argument("--dtype", default=None, help="torch_dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--ctx-batch-size", type=positive_int, default=None)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--max-context-length", type=positive_int, default=None)
    parser.add_argument("--bucketing", action="store_true", help="NxDI's automatic buckets (powers of two from 128)")
    parser.add_argument("--context-buckets", type=_ints, default=None, help="e.g. 64,128")
    parser.add_argument("--token-buckets", type=_ints, default=None, help="e.g. 128,256")
    parser.add_argument("--sample", action="store_true", help="on-device top-k / top-p / temperature sampling")
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--quantization", choices=("fp8", "fp8_block", "mxfp4"), default=None,
                        help="routed experts' weight format")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")


_QUANTIZATION_FIELDS = {
    "fp8": dict(quantized=True, quantization_type="per_channel_symmetric", quantization_dtype="f8e4m3"),
    "fp8_block": dict(quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f8e4m3",
                      quantization_block_size=[128, 128]),
    "mxfp4": dict(quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f4e2m1fn_x4"),
}


def application_config(args: argparse.Namespace, dtype: torch.dtype):
    if args.neuron_config:
        fields = json.loads(Path(args.neuron_config).read_text())
        if not isinstance(fields, dict):
            raise ValueError(f"--neuron-config {args.neuron_config}: expected a JSON object of NeuronConfig fields")
        fields.setdefault("torch_dtype", dtype)
        return ApplicationConfig(**fields)
    fields = dict(batch_size=args.batch_size, seq_len=args.seq_len, torch_dtype=dtype,
                  enable_bucketing=args.bucketing or bool(args.context_buckets or args.token_buckets))
    for name, value in (("ctx_batch_size", args.ctx_batch_size), ("max_context_length", args.max_context_length),
                        ("context_encoding_buckets", args.context_buckets),
                        ("token_generation_buckets", args.token_buckets)):
        if value is not None:
            fields[name] = value
    if args.sample:
        fields["on_device_sampling_config"] = dict(do_sample=True, top_k=args.top_k, top_p=args.top_p,
                                                   temperature=args.temperature)
    fields.update(_QUANTIZATION_FIELDS.get(args.quantization, {}))
    return ApplicationConfig(**fields)


def run(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device, "torch")
    dtype = resolve_dtype(args.dtype, device)
    config = application_config(args, dtype)
    if args.hf_model:
        app = CausalLMApplication.from_pretrained(args.hf_model, config, device=device)
    else:
        if args.layers < 0:
            raise ValueError(f"--layers must be >= 0 (0 = full depth), got {args.layers}")
        scale = args.scale if args.scale != "auto" else (1 if device.type == "cuda" else 16)
        app = CausalLMApplication.from_model_config(args.config, config, num_layers=args.layers or None,
                                                    scale=scale, seed=args.seed, device=device)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = app.compile(args.out)
    manifest["compile_s"] = round(time.perf_counter() - start, 2)
    manifest["warnings"] = [str(w.message) for w in caught]
    return manifest


def format_report(manifest: dict, out: str) -> str:
    lines = [f"nxd-moe compile: {manifest['model']['model_type']} ({manifest['model']['num_hidden_layers']} layers, "
             f"{manifest['model']['parameters'] / 1e6:.1f}M parameters) -> {out} in {manifest['compile_s']} s"]
    for name, program in manifest["programs"].items():
        hlo = f"HLO {program['hlo']['proto']} ({program['hlo_instructions']} instructions, static: " \
              f"{program['static']}, matches eager: {program['matches_eager']})" if "hlo" in program else ""
        lines.append(f"  {name:24s} {hlo}")
    if "hlo" in manifest:
        lines.append(f"  {manifest['hlo']}")
    lines += [f"  warning: {w}" for w in manifest["warnings"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        manifest = run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError, RuntimeError) as e:
        raise SystemExit(f"nxd-moe compile: error: {e}") from None
    print(json.dumps(manifest, indent=2) if args.json else format_report(manifest, args.out))
    return 0


# ------------------------------------------------------------------------------------------------------------
# nxd-moe generate --app DIR

def generate_from_app(args: argparse.Namespace) -> dict:
    """``nxd-moe generate --app DIR``: the compiled application's generation of ``--prompt-ids`` (one prompt,
    comma-separated ids) or ``--batch`` random prompts of ``--prompt-len`` tokens."""
    device = torch.device(args.device)
    app = CausalLMApplication.from_compiled(args.app, device=device)
    vocab = app.programs.text_config.vocab_size
    if getattr(args, "prompt_ids", None):
        ids = torch.tensor([_ints(args.prompt_ids)])
    else:
        ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    app.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=[])  # warm-up
    out = app.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=[])
    t = out.timings
    return {"app": str(args.app), "device": str(device), "batch": ids.shape[0], "prompt_len": ids.shape[1],
            "new_tokens": out.tokens.shape[1], "ttft_ms": round(t["context_encoding_s"] * 1e3, 2),
            "decode_tokens_per_s": round(ids.shape[0] * max(t["steps"] - 1, 1) / max(t["token_generation_s"], 1e-9),
                                         1),
            "tokens": out.tokens.tolist()}
