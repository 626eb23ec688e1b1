"""CPU benchmark: our MoE layer vs HuggingFace transformers' own sparse-MoE block, same weights, same CPU.

What is compared
----------------
For each model (scaled Qwen3-30B-A3B and Mixtral-8x7B configs from ``configs/``):

- HF: the model's sparse-MoE block (``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``: router + experts)
  with each experts implementation selected through ``config._experts_implementation``:
  ``eager`` (the class's loop over hit experts), ``grouped_mm`` (sort + ``F.grouped_mm``; transformers'
  default), and, for decode only, ``batched_mm`` (gathers one weight matrix per (token, expert) pair; it
  would copy T*k expert matrices at prefill, which is pathological there, and HF itself only uses it for
  decode).
- Ours: ``nxd_moe.build_moe`` (router + ``ExpertMLPsV2``, torch backend) with the HF block's weights copied
  in. Prefill runs the dropless blockwise algorithm twice: at a CPU-tuned small block size
  (``--block-size-cpu``, the comparison that matters on CPU) and at the config's block size (512, what
  Trainium kernels use; on CPU its in-block padding is pure wasted compute, reported for honesty). Decode
  (``seq_len == 1``) picks selective loading or all-experts by itself; the mode that ran is reported.

Both sides compute the same function: the JSON reports the max abs difference of every contender's output
against HF ``eager`` on the same input.

Method
------
- ``torch.no_grad()``, fixed ``torch.set_num_threads`` (default: every core this process may use), fp32.
- Contenders are interleaved: every repetition runs each contender once, rotating the start (see
  ``_timing.py``), after warm-up. Short calls are batched so that one sample lasts >= ``--min-sample-ms``.
- Reported per contender: median, p10, p90 and min in ms per call, plus the median minor page faults and
  kernel CPU ms per call (``getrusage``). ``speedup_vs_best_hf`` = best HF median / our median within the
  same run and allocator setting (> 1 means ours is faster).
- Allocator: every phase runs twice, first with glibc malloc as the process started, then after
  ``mallopt`` keeps freed memory in the heap (``--malloc``). Why: with glibc's defaults, the multi-MiB
  temporaries of the vectorised implementations (ours, HF ``grouped_mm``) are often mmap'ed fresh and
  unmapped on free, so each forward page-faults them back in and the kernel zeroes every 4 KiB page; HF
  ``eager`` works on small per-expert tensors and does not pay this. The fault counts show which run paid.
- Noise: other processes on a shared VM can take a core for seconds, and with every core in use by our
  threads that costs far more than a core's worth (threads wait on each other). Before each phase the run
  waits (up to ``--wait-quiet`` s) for other processes to drop below 0.3 busy cores, and it measures their
  CPU use during the timing (``/proc/stat`` minus our own CPU time). ``noise_warning`` lists the phases
  where it exceeded 0.25 cores: their absolute times are inflated; ratios, interleaved, stay comparable.
- The environment (versions, threads, CPU model, load average, date, git commit) is recorded.

Output: one JSON object on stdout (``--out FILE`` writes it too); a human-readable table on stderr.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers  # noqa: E402
from _timing import OtherCpuMeter, percentile, time_interleaved, wait_for_quiet  # noqa: E402
from transformers import MixtralConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from nxd_moe import MoE, MoEModelConfig, build_moe, load_model_config  # noqa: E402

HF_PREFILL_IMPLS = ("eager", "grouped_mm")
HF_DECODE_IMPLS = ("eager", "grouped_mm", "batched_mm")
REFERENCE = "hf_eager"


# --------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """How to build the HF block that matches one of our configs."""

    hf_block: type[nn.Module]
    make_hf_config: Callable[[MoEModelConfig], Any]
    default_scale: int
    quick_scale: int


def _qwen3_config(m: MoEModelConfig) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=m.hidden_size, moe_intermediate_size=m.intermediate_size,
                          num_experts=m.num_experts, num_experts_per_tok=m.top_k, norm_topk_prob=True,
                          hidden_act=m.experts.get("hidden_act", "silu"))


def _mixtral_config(m: MoEModelConfig) -> MixtralConfig:
    # Mixtral always renormalises its top-k; jitter only applies in training but is zeroed to be explicit.
    return MixtralConfig(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_local_experts=m.num_experts, num_experts_per_tok=m.top_k, router_jitter_noise=0.0,
                         hidden_act=m.experts.get("hidden_act", "silu"))


# Default scales keep the run at a few minutes on 2 cores: Qwen3 H=512 I=192 (E=128, k=8),
# Mixtral H=512 I=1792 (E=8, k=2).
MODELS: dict[str, ModelSpec] = {
    "qwen3-30b-a3b": ModelSpec(Qwen3MoeSparseMoeBlock, _qwen3_config, default_scale=4, quick_scale=16),
    "mixtral-8x7b": ModelSpec(MixtralSparseMoeBlock, _mixtral_config, default_scale=8, quick_scale=32),
}


def check_config_matches_hf(m: MoEModelConfig) -> None:
    """The HF blocks above are softmax top-k routers with renormalised top-k and SiLU-GLU experts, no bias
    and no shared experts; refuse to compare against a config that computes something else."""
    problems = []
    if m.router.type != "topk" or m.router.act_fn != "softmax" or m.router.apply_act_fn_over_topk:
        problems.append(f"router {m.router}")
    if not m.experts.get("normalize_top_k_affinities", False):
        problems.append("normalize_top_k_affinities is not set")
    if not m.experts.get("glu_mlp", True) or m.experts.get("bias", False):
        problems.append("experts are not bias-free GLU")
    if m.shared_experts is not None:
        problems.append("config has shared experts")
    if problems:
        raise ValueError(f"{m.name}: config does not match the HF block: {'; '.join(problems)}")


def init_hf_block(block: nn.Module, seed: int) -> None:
    """Random weights with std 1/sqrt(fan_in) (activations stay O(1); router logits have std ~1, so routing
    spreads over the experts). HF's own init leaves these parameters empty or zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * param.shape[-1] ** -0.5)


def hf_block_with_impl(base: nn.Module, impl: str) -> nn.Module:
    """A block of ``base``'s class using experts implementation ``impl`` and sharing ``base``'s parameter
    tensors (``assign=True``: no copy). A separate config per block, so no contender switches another's
    implementation and the timed call does nothing but the forward."""
    config = copy.deepcopy(base.experts.config)
    config._experts_implementation = impl
    block = type(base)(config)
    block.load_state_dict(base.state_dict(), assign=True)
    return block.eval()


def copy_hf_weights_into_ours(hf_block: nn.Module, ours: MoE) -> None:
    """HF Qwen3-MoE / Mixtral block weights -> our MoE, in place.

    HF: ``gate.weight (E, H)``; ``experts.gate_up_proj (E, 2I, H)`` with ``[gate; up]`` on dim 1;
    ``experts.down_proj (E, H, I)``. Ours: ``router.linear_router.weight (E, H)``;
    ``expert_mlps.mlp_op.gate_up_proj.weight (E, H, 2I)`` = ``[gate | up]`` on the last dim;
    ``expert_mlps.mlp_op.down_proj.weight (E, I, H)``. Both are plain transposes of the last two dims.
    """
    pairs = [
        (ours.router.linear_router.weight, hf_block.gate.weight),
        (ours.expert_mlps.mlp_op.gate_up_proj.weight, hf_block.experts.gate_up_proj.transpose(1, 2)),
        (ours.expert_mlps.mlp_op.down_proj.weight, hf_block.experts.down_proj.transpose(1, 2)),
    ]
    with torch.no_grad():
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"weight copy: shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
            dst.copy_(src)  # copy_ makes the destination contiguous in our layout


def build_ours(name: str, scale: int, block_size: int, hf_block: nn.Module) -> tuple[MoE, str]:
    """Our MoE for ``name`` (its YAML config, scaled) holding ``hf_block``'s weights, and how it was made.

    The library's ``nxd_moe.hf.from_hf_moe_block`` is used when it exists and builds exactly what the
    benchmark-local copy builds (same configs, bit-identical weights); otherwise the local copy is used and
    the reason is recorded. Either way the module is checked against HF by the parity numbers.
    """
    local = build_moe(name, scale=scale, dtype=torch.float32, block_size=block_size)
    copy_hf_weights_into_ours(hf_block, local)
    local.eval()
    fallback = "copy_hf_weights_into_ours (benchmark-local)"
    try:
        from nxd_moe.hf import from_hf_moe_block

        lib = from_hf_moe_block(hf_block, hf_block.experts.config, block_size=block_size).eval()
    except Exception as exc:  # the helper is optional: any failure means "use the local copy"
        return local, f"{fallback}; nxd_moe.hf.from_hf_moe_block unusable: {type(exc).__name__}: {exc}"
    mine, theirs = local.expert_mlps, lib.expert_mlps
    local_sd, lib_sd = local.state_dict(), lib.state_dict()
    same = (type(lib.router) is type(local.router) and lib.shared_experts is None
            and theirs.routed_experts_mlp_config == mine.routed_experts_mlp_config
            and theirs.blockwise_matmul_config == mine.blockwise_matmul_config
            and lib_sd.keys() == local_sd.keys()
            and all(torch.equal(lib_sd[k], local_sd[k]) for k in local_sd))
    if not same:
        return local, f"{fallback}; nxd_moe.hf.from_hf_moe_block built a different module"
    return lib, "nxd_moe.hf.from_hf_moe_block (checked identical to the benchmark-local copy)"


# --------------------------------------------------------------------------------------------------------
# Running one phase
# --------------------------------------------------------------------------------------------------------

def first_output(result: Any) -> torch.Tensor:
    """Our MoE returns a tuple ``(output, ...)``; HF blocks return the tensor."""
    return result[0] if isinstance(result, tuple) else result


def parity(outputs: dict[str, torch.Tensor], reference: str) -> dict[str, dict[str, float]]:
    """Max abs difference of each output vs ``reference`` (also relative to the reference's max abs)."""
    ref = outputs[reference].double()
    scale = ref.abs().max().item()
    out = {}
    for name, y in outputs.items():
        diff = (y.double() - ref).abs().max().item()
        out[name] = {"max_abs_diff": diff, "max_abs_diff_rel": diff / scale if scale else diff}
    return out


def profile_interleaved(contenders: dict[str, Callable[[], Any]], rounds: int, top: int) -> dict[str, list[dict]]:
    """Top ops by self CPU time per forward call (``--profile``), robust to a noisy machine.

    Each round profiles one call of every contender (rotating the order, like the timing loop); an op's
    time is the median over rounds, so one contended round cannot reorder the breakdown.
    """
    from torch.profiler import ProfilerActivity, profile

    names = list(contenders)
    per_op: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    counts: dict[str, dict[str, int]] = {n: {} for n in names}
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                contenders[name]()
            for event in prof.key_averages():
                per_op[name].setdefault(event.key, []).append(event.self_cpu_time_total / 1e3)
                counts[name][event.key] = event.count
    out = {}
    for name in names:
        # An op missing from some rounds counts 0 there (median over all rounds).
        med = {op: percentile(v + [0.0] * (rounds - len(v)), 50) for op, v in per_op[name].items()}
        total = sum(med.values())
        ranked = sorted(med.items(), key=lambda kv: kv[1], reverse=True)[:top]
        out[name] = [{"op": op, "self_ms": ms, "self_pct": 100.0 * ms / total if total else 0.0,
                      "calls": counts[name][op]} for op, ms in ranked]
        out[name].append({"op": "(all ops, sum of medians)", "self_ms": total, "self_pct": 100.0, "calls": None})
    return out


def run_phase(contenders: dict[str, Callable[[], Any]], ours_stats: dict[str, Any], args: argparse.Namespace,
              shape: dict[str, int]) -> dict[str, Any]:
    """Parity, interleaved timing and ratios for one phase (prefill or decode) of one model."""
    outputs = {name: first_output(fn()).detach().clone() for name, fn in contenders.items()}
    par = parity(outputs, REFERENCE)
    del outputs
    noise = (wait_for_quiet(args.wait_quiet, threshold_cores=spare_cores() + 0.3) if args.wait_quiet > 0 else {})
    meter = OtherCpuMeter().start()
    timings = time_interleaved(contenders, repeats=args.repeats, warmup=args.warmup,
                               min_sample_s=args.min_sample_ms / 1e3)
    noise["other_cpu_cores_during"] = meter.stop()
    results: dict[str, Any] = {}
    for name in contenders:
        results[name] = {**timings[name], **par[name]}
        if name in ours_stats:
            results[name]["stats"] = ours_stats[name]
    if args.profile:
        for name, ops in profile_interleaved(contenders, args.profile_rounds, args.profile_top).items():
            results[name]["profile_top_ops"] = ops
    hf_names = [n for n in contenders if n.startswith("hf_")]
    best_hf = min(hf_names, key=lambda n: timings[n]["median_ms"])
    best_ms = timings[best_hf]["median_ms"]
    for name in contenders:
        if name.startswith("ours"):
            results[name]["speedup_vs_best_hf"] = best_ms / timings[name]["median_ms"]
            results[name]["speedup_vs"] = {hf: timings[hf]["median_ms"] / timings[name]["median_ms"]
                                           for hf in hf_names}
    return {
        "shape": shape,
        "contenders": results,
        "best_hf": best_hf,
        "best_hf_median_ms": best_ms,
        "parity_ok": all(r["max_abs_diff_rel"] <= args.parity_rtol for r in par.values()),
        "noise": noise,
    }


@dataclass
class PreparedModel:
    """One model's contenders, built once and timed under each allocator setting."""

    name: str
    info: dict[str, Any]
    prefill: dict[str, Callable[[], Any]]
    decode: dict[str, Callable[[], Any]]
    prefill_stats: dict[str, Any]
    decode_stats: dict[str, Any]
    prefill_shape: dict[str, int]
    decode_shape: dict[str, int]


def prepare_model(name: str, scale: int, args: argparse.Namespace) -> PreparedModel:
    """Build the HF block (random weights), its per-implementation twins, and ours (weights copied)."""
    spec = MODELS[name]
    base_cfg = load_model_config(name)
    check_config_matches_hf(base_cfg)
    cfg = base_cfg.scaled(scale)
    config_block = int(base_cfg.blockwise.get("block_size", 512))

    hf_config = spec.make_hf_config(cfg)
    hf_config._experts_implementation = "eager"
    hf_base = spec.hf_block(hf_config).eval()
    init_hf_block(hf_base, args.seed)
    hf = {impl: hf_block_with_impl(hf_base, impl) for impl in HF_DECODE_IMPLS}
    # Ours at each CPU-tuned block size, then at the config's; the first CPU one also serves decode.
    ours: dict[str, MoE] = {}
    weights_by = ""
    for block in args.block_size_cpu:
        ours[f"ours_cpu_block{block}"], weights_by = build_ours(name, scale, block, hf_base)
    label_cfg = f"ours_config_block{config_block}"
    ours[label_cfg], _ = build_ours(name, scale, config_block, hf_base)
    ours_decode = next(iter(ours.values()))

    gen = torch.Generator().manual_seed(args.seed + 1)
    x_prefill = torch.randn(1, args.prefill_tokens, cfg.hidden_size, generator=gen)
    x_decode = torch.randn(args.decode_batch, 1, cfg.hidden_size, generator=gen)

    info = {
        "config": {
            "name": cfg.name, "scale": scale, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
            "dtype": "float32", "block_size_config": config_block, "block_size_cpu": args.block_size_cpu,
            "hf_block": spec.hf_block.__name__,
            "weights": "HF block, random normal std 1/sqrt(fan_in)",
            "weights_copied_by": weights_by,
        },
        "labels": {
            **{f"ours_cpu_block{b}": f"ours at the CPU-tuned block size {b} (--block-size-cpu): the prefill "
                                     "comparison to read" for b in args.block_size_cpu},
            label_cfg: f"ours at the config block size {config_block} (what Trainium uses; on CPU the in-block "
                       "padding is wasted compute)",
            "ours": "ours in decode (the block size plays no part: selective loading or all-experts, see stats)",
            **{f"hf_{impl}": f"transformers {spec.hf_block.__name__}, experts implementation '{impl}'"
               for impl in HF_DECODE_IMPLS},
        },
    }

    with torch.no_grad():
        # Stats come from a separate call: timed calls run without return_stats, as production would.
        prefill_stats = {label: m(x_prefill, return_stats=True)[-1].summary() for label, m in ours.items()}
        decode_stats = {"ours": ours_decode(x_decode, return_stats=True)[-1].summary()}
    prefill = {f"hf_{impl}": (lambda b=hf[impl]: b(x_prefill)) for impl in HF_PREFILL_IMPLS}
    for label, m in ours.items():
        if label != label_cfg or not args.skip_config_block:
            prefill[label] = lambda m=m: m(x_prefill)
    decode = {f"hf_{impl}": (lambda b=hf[impl]: b(x_decode)) for impl in HF_DECODE_IMPLS}
    decode["ours"] = lambda: ours_decode(x_decode)
    return PreparedModel(name, info, prefill, decode, prefill_stats, decode_stats,
                         {"batch": 1, "seq": args.prefill_tokens}, {"batch": args.decode_batch, "seq": 1})


def run_model(model: PreparedModel, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    with torch.no_grad():
        log(f"[{tag}] {model.name} prefill {model.prefill_shape}")
        prefill = run_phase(model.prefill, model.prefill_stats, args, model.prefill_shape)
        log(f"[{tag}] {model.name} decode {model.decode_shape}")
        decode = run_phase(model.decode, model.decode_stats, args, model.decode_shape)
    return {"prefill": prefill, "decode": decode}


# --------------------------------------------------------------------------------------------------------
# Allocator
# --------------------------------------------------------------------------------------------------------

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# 32 MiB is the largest mmap threshold glibc accepts on 64-bit; blocks above it are always mmap'ed.
TUNED_MMAP_THRESHOLD = 32 << 20
TUNED_TRIM_THRESHOLD = 1 << 30
ALLOCATORS = {
    "glibc_default": "glibc malloc as the process starts (what `pip install torch` users get on Linux)",
    "glibc_tuned": f"mallopt(M_MMAP_THRESHOLD={TUNED_MMAP_THRESHOLD}, M_TRIM_THRESHOLD={TUNED_TRIM_THRESHOLD}): "
                   "freed temporaries stay in the heap, so forwards stop page-faulting them in",
}


def tune_glibc_malloc() -> dict[str, Any]:
    """Keep freed memory in the process instead of returning it to the kernel after every forward.

    With glibc's defaults, large temporaries (above a dynamic threshold, up to 32 MiB) are mmap'ed fresh and
    unmapped on free, so every forward page-faults its temporaries in again (the kernel zeroes each 4 KiB
    page). A fixed 32 MiB mmap threshold plus a high trim threshold makes those temporaries reuse heap
    memory -- the effect jemalloc/tcmalloc, which PyTorch's CPU tuning guides recommend, have as well.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, TUNED_MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TUNED_TRIM_THRESHOLD))
    except (OSError, AttributeError) as exc:
        return {"applied": False, "why": f"mallopt unavailable: {exc}"}
    return {"applied": ok, "mallopt": {"M_MMAP_THRESHOLD": TUNED_MMAP_THRESHOLD,
                                       "M_TRIM_THRESHOLD": TUNED_TRIM_THRESHOLD}}


# --------------------------------------------------------------------------------------------------------
# Environment, reporting, CLI
# --------------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _git(*cmd: str) -> str | None:
    try:
        return subprocess.run(["git", *cmd], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def git_state() -> dict[str, Any]:
    """The commit, and the library files that differ from it (the code timed is the working tree)."""
    commit = _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--", "nxd_moe") or ""
    return {"git_commit": commit.strip() if commit else None,
            "nxd_moe_uncommitted": [line.split(maxsplit=1)[1] for line in changed.splitlines() if line.strip()]}


def environment(threads: int) -> dict[str, Any]:
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "usable_cpus": usable_cpus(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        **git_state(),
        "load_average_start": load_average(),
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def phases(report: dict[str, Any]):
    """``(model, allocator, phase, result)`` for every phase that ran, in report order."""
    for model, res in report["models"].items():
        for alloc in ALLOCATORS:
            for phase in ("prefill", "decode"):
                ph = res.get(alloc, {}).get(phase)
                if ph is not None:
                    yield model, alloc, phase, ph


def print_table(report: dict[str, Any]) -> None:
    """Human-readable summary on stderr (stdout is reserved for the JSON)."""
    for model, alloc, phase, ph in phases(report):
        other = ph["noise"].get("other_cpu_cores_during")
        log(f"\n{model} {phase} {ph['shape']} [{alloc}]  best HF: {ph['best_hf']}, "
            f"parity_ok={ph['parity_ok']}, other processes' CPU during timing: "
            f"{'n/a' if other is None else f'{other:.2f} cores'}")
        log(f"  {'contender':24s} {'median':>9s} {'p10':>9s} {'p90':>9s} {'vs best HF':>10s} "
            f"{'max|diff|':>9s} {'faults':>7s} {'sys ms':>7s}")
        for name, r in ph["contenders"].items():
            ratio = f"{r['speedup_vs_best_hf']:.2f}x" if "speedup_vs_best_hf" in r else ""
            log(f"  {name:24s} {r['median_ms']:7.2f}ms {r['p10_ms']:7.2f}ms {r['p90_ms']:7.2f}ms "
                f"{ratio:>10s} {r['max_abs_diff']:9.2e} {r['minor_page_faults_per_call']:7.0f} "
                f"{r['kernel_cpu_ms_per_call']:7.2f}")
        for name, r in ph["contenders"].items():
            if "stats" in r:
                log(f"  {name}: {describe_stats(r['stats'])}")
        for name, r in ph["contenders"].items():
            if "profile_top_ops" in r:
                ops = ", ".join(f"{o['op'].removeprefix('aten::')} {o['self_ms']:.2f}"
                                for o in r["profile_top_ops"][:8])
                log(f"  profile {name} (self ms/call): {ops}")
    env = report["environment"]
    log(f"\nthreads {env['torch_threads']}, load average start {env['load_average_start']} "
        f"end {env['load_average_end']}, wall {env['wall_s']} s" +
        (f"\nWARNING: {env['noise_warning']}" if "noise_warning" in env else ""))


def describe_stats(s: dict[str, Any]) -> str:
    text = f"mode {s['mode']}"
    if s.get("padding_overhead_algorithmic") is not None:
        text += (f", blocks {s['active_blocks']}/{s['num_blocks']} active, padding overhead algorithmic "
                 f"{s['padding_overhead_algorithmic']:.3f}, provisioned {s['padding_overhead_provisioned']:.3f}")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {sorted(MODELS)} (default: all)")
    p.add_argument("--scale", default=None,
                   help="H and I divisor: one int for every model, or name=int pairs "
                        "(default: qwen3-30b-a3b=4, mixtral-8x7b=8; --quick: 16 and 32)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prefill sequence length, batch 1 (default 1024)")
    p.add_argument("--decode-batch", type=int, default=None, help="decode batch size, seq 1 (default 8)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per contender (default 40)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per contender first (default 3)")
    p.add_argument("--min-sample-ms", type=float, default=20.0,
                   help="short calls are batched so one sample lasts at least this long (default 20)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all usable CPUs)")
    p.add_argument("--block-size-cpu", default="4",
                   help="our CPU-tuned blockwise block size(s), comma-separated, each timed as its own contender "
                        "(default 4); the config's 512 is always reported too")
    p.add_argument("--skip-config-block", action="store_true",
                   help="do not time ours at the config block size (it is ~(1+padding)x the work on CPU)")
    p.add_argument("--malloc", choices=("default", "tuned", "both"), default=None,
                   help="glibc allocator settings to run under: as started, tuned (see tune_glibc_malloc), or "
                        "both, default first (default: both; --quick: default)")
    p.add_argument("--wait-quiet", type=float, default=None,
                   help="before each phase, wait up to this many seconds until other processes use less than "
                        "0.3 cores beyond those our threads leave idle (0: never wait; default 60, --quick 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parity-rtol", type=float, default=1e-4,
                   help="max |diff| / max |ref| accepted as the same function (fp32; default 1e-4)")
    p.add_argument("--profile", action="store_true",
                   help="also run torch.profiler on each contender and add its top ops to the JSON")
    p.add_argument("--profile-rounds", type=int, default=7,
                   help="--profile: interleaved profiled calls per contender; ops report the median (default 7)")
    p.add_argument("--profile-top", type=int, default=12)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (smoke test, < 30 s)")
    args = p.parse_args(argv)

    quick = args.quick
    defaults = {"prefill_tokens": 128 if quick else 1024, "decode_batch": 4 if quick else 8,
                "repeats": 3 if quick else 40, "warmup": 1 if quick else 3, "malloc": "default" if quick else "both",
                "wait_quiet": 0.0 if quick else 60.0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.min_sample_ms = min(args.min_sample_ms, 5.0)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    args.scales = parse_scales(args.scale, args.models, quick, p)
    try:
        args.block_size_cpu = [int(b) for b in str(args.block_size_cpu).split(",") if b.strip()]
    except ValueError:
        p.error(f"--block-size-cpu must be comma-separated ints, got {args.block_size_cpu!r}")
    if not args.block_size_cpu or min(args.block_size_cpu) < 1:
        p.error("--block-size-cpu needs at least one block size, all >= 1")
    for key in ("prefill_tokens", "decode_batch", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def parse_scales(value: str | None, models: list[str], quick: bool, p: argparse.ArgumentParser) -> dict[str, int]:
    scales = {m: (MODELS[m].quick_scale if quick else MODELS[m].default_scale) for m in models}
    if value is None:
        return scales
    try:
        if "=" not in value:
            return {m: int(value) for m in models}
        for pair in value.split(","):
            key, num = pair.split("=")
            if key.strip() in scales:
                scales[key.strip()] = int(num)
    except ValueError:
        p.error(f"--scale must be an int or name=int pairs, got {value!r}")
    return scales


def headline(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per (model, allocator, phase, contender): the numbers to quote."""
    rows = []
    for model, alloc, phase, ph in phases(report):
        for name, r in ph["contenders"].items():
            rows.append({"model": model, "allocator": alloc, "phase": phase, "contender": name,
                         "median_ms": round(r["median_ms"], 3), "p10_ms": round(r["p10_ms"], 3),
                         "p90_ms": round(r["p90_ms"], 3),
                         "speedup_vs_best_hf": (round(r["speedup_vs_best_hf"], 3)
                                                if "speedup_vs_best_hf" in r else None),
                         "best_hf": ph["best_hf"]})
    return rows


NOISY_OTHER_CORES = 0.25


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def spare_cores() -> int:
    """Cores our torch threads leave idle: other processes may use those without slowing us down."""
    return max(0, usable_cpus() - torch.get_num_threads())


def phase_noise(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"model": model, "allocator": alloc, "phase": phase,
             "other_cpu_cores": res[alloc][phase]["noise"].get("other_cpu_cores_during")}
            for model, res in report["models"].items() for alloc in ALLOCATORS if alloc in res
            for phase in ("prefill", "decode")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = args.threads or usable_cpus()
    torch.set_num_threads(threads)
    started = time.perf_counter()
    allocators = list(ALLOCATORS) if args.malloc == "both" else [f"glibc_{args.malloc}"]
    report: dict[str, Any] = {
        "benchmark": "cpu_layer",
        "environment": environment(torch.get_num_threads()),
        "method": {
            "timing": "interleaved: each repetition runs every contender once, rotating the start; "
                      "medians/p10/p90 of per-call ms; short calls batched to >= min_sample_ms per sample",
            "repeats": args.repeats, "warmup": args.warmup, "min_sample_ms": args.min_sample_ms,
            "no_grad": True, "dtype": "float32", "parity_reference": REFERENCE, "parity_rtol": args.parity_rtol,
            "speedup_vs_best_hf": "best HF median / ours median, same run and allocator (> 1: ours faster)",
            "allocators": {a: ALLOCATORS[a] for a in allocators},
        },
        "args": {"models": args.models, "scales": args.scales, "prefill_tokens": args.prefill_tokens,
                 "decode_batch": args.decode_batch, "block_size_cpu": args.block_size_cpu, "seed": args.seed,
                 "threads": threads, "malloc": args.malloc, "wait_quiet": args.wait_quiet, "quick": args.quick,
                 "profile": args.profile},
        "models": {},
    }
    prepared = [prepare_model(name, args.scales[name], args) for name in args.models]
    for model in prepared:
        report["models"][model.name] = dict(model.info)
    # The tuned allocator cannot be undone in-process, so every model runs under the default one first.
    for alloc in allocators:
        if alloc == "glibc_tuned":
            report["environment"]["malloc_tuning"] = tune_glibc_malloc()
        for model in prepared:
            report["models"][model.name][alloc] = run_model(model, args, alloc)
    report["headline"] = headline(report)
    report["environment"]["load_average_end"] = load_average()
    report["environment"]["wall_s"] = round(time.perf_counter() - started, 1)
    noisy = [f"{row['model']}/{row['allocator']}/{row['phase']} ({row['other_cpu_cores']:.2f} cores)"
             for row in phase_noise(report) if (row["other_cpu_cores"] or 0.0) > spare_cores() + NOISY_OTHER_CORES]
    if noisy:
        report["environment"]["noise_warning"] = ("other processes used the CPU while these phases were timed: "
                                                  + ", ".join(noisy) + "; their absolute times are inflated, "
                                                  "ratios within a phase remain comparable (interleaved)")
    print_table(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
