"""``nxd-moe generate``: a whole transformers MoE model generating through nxd_moe, next to transformers' default.

The model is a shipped config's architecture with random weights (``--config``, ``--scale``, ``--layers``) or a
local checkpoint directory (``--hf-model``, safetensors only). The same prompts run through transformers' default
experts implementation and through nxd_moe (``--path patch``: every sparse-MoE block replaced by nxd_moe's ``MoE``;
``--path experts``: transformers' blocks with nxd_moe's experts backend), greedy, eagerly or with transformers'
compiled recipe (``--compile``: static cache, decode step under ``torch.compile(mode="reduce-overhead",
fullgraph=True)``). It prints prefill time, decode tokens/s of both, and whether they chose the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from nxd_moe.arguments import auto_scale, positive_int, resolve_device, resolve_dtype, scale_argument
from nxd_moe.checks import check_int
from nxd_moe.extras import require
from nxd_moe.model_config import builtin_config_names, load_model_config
from nxd_moe.models.experts_backend import register_experts_implementations

HELP = "generate with a whole transformers MoE model through nxd_moe and print tokens/s next to transformers' default"

PATHS = ("patch", "experts")
DEFAULT_LAYERS = 4
# transformers' default experts implementation (its generate swaps in batched_mm for decode steps on a GPU).
TRANSFORMERS_DEFAULT = "grouped_mm"


def load_checkpoint_model(path: str | Path, dtype: torch.dtype, device: torch.device):
    """A transformers model from a local checkpoint directory, read from safetensors files only.

    A directory holding only pickle weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) is refused by name: unpickling
    runs code from the file. So is, before any weight is read, a model type without a sparse-MoE block nxd_moe
    serves; a file transformers cannot read is one ``ValueError`` naming it.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    from nxd_moe.hf.configs import SUPPORTED_MODEL_TYPES

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--hf-model must be a local checkpoint directory, got {str(path)!r}")
    if not (path / "config.json").is_file():
        raise ValueError(f"--hf-model {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(ext))
        found = f"it holds pickle weights ({', '.join(pickles[:4])}), which are never unpickled" if pickles else \
            "it holds no weights"
        raise ValueError(f"--hf-model {str(path)!r}: only safetensors checkpoints are read, and {found}; convert it "
                         "to safetensors first")
    try:
        model_type = AutoConfig.from_pretrained(path).model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"--hf-model {str(path)!r}: model_type {model_type!r} has no sparse-MoE block nxd_moe "
                             f"serves; supported: {list(SUPPORTED_MODEL_TYPES)}")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device).eval()
    except (OSError, SafetensorError) as e:  # unreadable files: one line naming the checkpoint
        raise ValueError(f"--hf-model {str(path)!r} could not be read: {type(e).__name__}: {e}") from None


def generate_tokens(model, ids: torch.Tensor, new_tokens: int, compiled: bool, cache=None) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens (eager, or transformers' compiled recipe). Under expert
    parallelism (a sharded patched model) every rank steps together (``synced_gpus``); compiled, each rank's decode
    step is one graph with the expert-parallel collectives in it. Off CUDA the compiled recipe runs without CUDA
    graphs (Inductor's default mode), which transformers leaves to the caller to ask for.

    ``cache``: compiled only, a transformers ``StaticCache`` of at least ``ids.shape[1] + new_tokens`` positions,
    reset and reused (see :func:`static_cache`); default: a new one per call, transformers' default."""
    import torch.distributed as dist
    from transformers import CompileConfig

    if cache is not None and not compiled:
        raise ValueError("cache: a shared StaticCache is for compiled=True only (eager generate makes its own)")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  synced_gpus=dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    if compiled:
        cuda = ids.device.type == "cuda"
        config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
        if not cuda:
            config._compile_all_devices = True  # transformers compiles on its own only on accelerators
        kwargs.update(compile_config=config)
        if cache is None:
            kwargs.update(cache_implementation="static")
        else:
            kwargs.update(past_key_values=cache)
    else:
        kwargs.update(disable_compile=True)
    with torch.inference_mode():
        if cache is not None:
            cache.reset()  # in place (its tensors were made under inference mode): they keep their addresses
        return model.generate(ids, **kwargs)


def _synchronize(ids: torch.Tensor) -> None:
    import torch.distributed as dist

    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def static_cache(model, max_cache_len: int):
    """One transformers ``StaticCache`` for ``model`` that compiled ``generate`` calls share, as a server keeps its
    cache. ``generate(cache_implementation="static")`` makes a new cache per call; its tensors are static inputs
    of the compiled decode step, so whenever the new ones land at other addresses Inductor's CUDA-graph trees
    re-record the step ("static input data pointer changed") -- measured on an H100 at 60-100 ms per re-record of a
    48-layer Qwen3-30B-A3B step, paid by each ``generate`` call -- and after 128 re-records they stop replaying
    graphs. A shared cache keeps its addresses, so the decode step is recorded once."""
    from transformers import StaticCache

    check_int("max_cache_len", max_cache_len, minimum=1)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def timed_generate(model, ids: torch.Tensor, new_tokens: int, compiled: bool, repeats: int,
                   clock: str = "wall") -> dict:
    """Prefill ms (a one-token generate) and decode tokens/s (the rest of an ``new_tokens`` generate), medians of
    ``repeats`` runs after a warm-up run (which also compiles), and the generated tokens. Compiled runs share one
    :func:`static_cache`. ``clock``: ``"wall"`` (default), or ``"process"`` -- this process's CPU time, which other
    processes on a shared CPU do not inflate (a CPU run's comparison; with several threads it counts each)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {list(CLOCKS)}, got {clock!r}")
    now = CLOCKS[clock]
    cache = static_cache(model, ids.shape[1] + new_tokens) if compiled else None

    def timed(n: int) -> tuple[float, torch.Tensor]:
        _synchronize(ids)
        start = now()
        out = generate_tokens(model, ids, n, compiled, cache)
        _synchronize(ids)
        return now() - start, out

    # Two warm-up runs: the first compiles (Triton kernels; Inductor under --compile), and attention libraries plan
    # once per new cache length, so the timed runs see only lengths already seen.
    timed(new_tokens)
    timed(new_tokens)
    timed(1)
    prefill, whole, out = [], [], None
    for _ in range(repeats):
        prefill.append(timed(1)[0])
        t, out = timed(new_tokens)
        whole.append(t)
    return generate_timing(prefill, whole, ids, new_tokens, out)


def generate_timing(prefill: list[float], whole: list[float], ids: torch.Tensor, new_tokens: int,
                    out: torch.Tensor) -> dict:
    """:func:`timed_generate`'s result from the seconds of one-token (``prefill``) and ``new_tokens`` generates
    (``whole``) of the prompts ``ids`` and the last output ``out``: medians, and the decode step as their
    difference over ``new_tokens - 1`` steps."""
    t1, tn = statistics.median(prefill), statistics.median(whole)
    step = max(tn - t1, 1e-9) / (new_tokens - 1)
    return {"prefill_ms": round(t1 * 1e3, 2), "decode_ms_per_step": round(step * 1e3, 3),
            "decode_tokens_per_s": round(ids.shape[0] / step, 1), "tokens": out[:, ids.shape[1]:]}


def add_arguments(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """The flags of ``nxd-moe generate``; returns the group of model sources (``--config``, ``--hf-model``), which
    :mod:`nxd_moe.application.generate_command` extends with ``--app``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help=f"YAML path or built-in name ({', '.join(builtin_config_names())}): the "
                                         "architecture, with random weights")
    source.add_argument("--hf-model", help="a local transformers checkpoint directory (safetensors only)")
    parser.add_argument("--scale", type=scale_argument, default=None,
                        help="with --config: divide the widths by this (rounded up to a multiple of 8); 1 = full "
                             "size; 'auto' (default): 1 on a GPU, else the layer scale `nxd-moe run` picks")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"with --config: decoder layers (default {DEFAULT_LAYERS}; 0 = the architecture's full "
                             "depth)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    parser.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new-tokens", type=positive_int, default=16, help="generated tokens (default 16, >= 2)")
    parser.add_argument("--compile", action="store_true",
                        help="transformers' compiled recipe: static cache, decode step under torch.compile("
                             "mode='reduce-overhead', fullgraph=True) (on a CPU: mode='default')")
    parser.add_argument("--path", default="patch", choices=PATHS,
                        help="patch (default): nxd_moe.hf.patch_model replaces each sparse-MoE block; experts: "
                             "transformers' blocks with experts_implementation='nxd_moe'")
    parser.add_argument("--backend", default=None,
                        help="nxd_moe backend (default: triton on CUDA where it imports, else torch)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return source


def run(args: argparse.Namespace) -> dict:
    require("transformers", "nxd-moe generate")
    # the hf extra (transformers), required above: this module imports without it
    from nxd_moe.models.hf_models import build_hf_model
    from nxd_moe.models.patch import patch_model

    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (one prefill token and at least one decode step), got "
                         f"{args.new_tokens}")
    if args.hf_model is not None:
        given = [flag for flag, value in (("--layers", args.layers), ("--scale", args.scale)) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)}: {'they shape' if len(given) > 1 else 'it shapes'} a --config "
                             "model; a --hf-model checkpoint is generated as it is")
    layers = DEFAULT_LAYERS if args.layers is None else args.layers
    if layers < 0:
        raise ValueError(f"--layers must be >= 0 (0 = full depth), got {layers}")
    device = resolve_device(args.device, args.backend or "torch")
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    if args.hf_model is not None:
        model = load_checkpoint_model(args.hf_model, dtype, device)
        source = {"hf_model": str(args.hf_model)}
    else:
        config = load_model_config(args.config)
        scale = "auto" if args.scale is None else args.scale
        if scale == "auto":
            scale = 1 if device.type == "cuda" else auto_scale(config.hidden_size)
        model = build_hf_model(config, num_layers=layers or None, scale=scale, dtype=dtype, device=device,
                               seed=args.seed)
        source = {"config": config.name, "scale": scale}
    text_config = model.config.get_text_config()
    positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(positions, int) and args.prompt_len + args.new_tokens > positions:
        raise ValueError(f"--prompt-len + --new-tokens ({args.prompt_len + args.new_tokens}) must be <= the model's "
                         f"max_position_embeddings ({positions})")
    dispatched = model._can_set_experts_implementation()
    if args.path == "experts" and not dispatched:
        raise ValueError(f"--path experts: transformers does not dispatch {type(model).__name__}'s experts by name "
                         "(experts_implementation); use --path patch")
    vocab = text_config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), device=device,
                        generator=torch.Generator(device).manual_seed(args.seed))
    compiled = bool(args.compile)
    # transformers' default: grouped_mm where it dispatches the experts by name, else the model's own experts module
    default = TRANSFORMERS_DEFAULT if dispatched else f"{type(model).__name__}'s own experts"
    if dispatched:
        model.set_experts_implementation(TRANSFORMERS_DEFAULT)
    baseline = timed_generate(model, ids, args.new_tokens, compiled, args.repeats)
    if args.path == "patch":
        patch_model(model, backend=args.backend)
        ours_name = "patch_model"
    else:
        ours_name = "nxd_moe" if args.backend is None else f"nxd_moe_{args.backend}"
        register_experts_implementations()  # the names transformers looks up (idempotent)
        model.set_experts_implementation(ours_name)
    ours = timed_generate(model, ids, args.new_tokens, compiled, args.repeats)
    same = (ours.pop("tokens") == baseline.pop("tokens")).float().mean().item()
    return {
        **source, "model_type": model.config.model_type, "layers": text_config.num_hidden_layers,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "compiled": compiled,
        "transformers": {"experts_implementation": default, **baseline},
        "nxd_moe": {"path": ours_name, **ours},
        "speedup_decode": round(ours["decode_tokens_per_s"] / baseline["decode_tokens_per_s"], 2),
        "speedup_prefill": round(baseline["prefill_ms"] / ours["prefill_ms"], 2),
        "same_tokens": round(same, 3),
    }


def format_report(report: dict) -> str:
    what = report.get("config") or report.get("hf_model")
    lines = [f"nxd-moe generate: {what} ({report['model_type']}, {report['layers']} layers, {report['dtype']} on "
             f"{report['device']}{', compiled' if report['compiled'] else ''}), batch {report['batch']}, prompt "
             f"{report['prompt_len']}, {report['new_tokens']} new tokens"]
    for name in ("transformers", "nxd_moe"):
        row = report[name]
        label = f"{name} ({row.get('experts_implementation') or row.get('path')})"
        lines.append(f"{label:34s} prefill {row['prefill_ms']:9.2f} ms   decode {row['decode_tokens_per_s']:9.1f} "
                     f"tokens/s")
    lines.append(f"nxd_moe vs transformers: decode x{report['speedup_decode']}, prefill x{report['speedup_prefill']}; "
                 f"same greedy tokens: {report['same_tokens']:.0%}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        report = run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"nxd-moe generate: error: {e}") from None
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
