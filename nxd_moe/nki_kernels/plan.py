"""``nxd-moe plan``: kernel settings for one MoE layer on Trainium2, from simulated counts and the Trn2 cost model.

For the per-rank problem (``E / EP`` experts, ``I / TP`` intermediate columns, all ``T`` tokens) and a balanced
routing (every expert gets ``T * k / E`` tokens), it reports:

- prefill block size by the deep dive's arithmetic-intensity rule ``AIF = B * N / E >= target`` (the smallest
  such B of 128..1024), with each size simulated;
- the LNC2 strategies (shard-on-H, shard-on-I and shard-on-block HI_LO / PING_PONG with the dynamic loop) and one
  core, at that block size with both DMA skips on;
- the four DMA skip modes with the fastest strategy;
- decode: selective loading vs all-experts for ``--decode-batch`` sequences, and which one NxD's rule picks;
- TP vs EP: the deep dive's advice, and every ``TP x EP`` split of the same number of ranks simulated;
- external kernels (``--kernel module:function``, any ``@nki.jit`` kernel taking the blockwise-matmul arguments by
  NxD's names, e.g. nki-library's ``bwmm_shard_on_block``) on the same prefill problem, next to ours.

Every candidate runs the real kernel in a counting run at full size (float data are not materialised; blocks
with the same signature are simulated once and their counts multiplied -- exact, see ``docs/nki.md``); times
come from :mod:`nxd_moe.nki_kernels.cost_model`, a model, not a measurement. A kernel that does not fit SBUF or
PSUM at this size is reported as such.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from dataclasses import asdict, dataclass, replace

import ml_dtypes
import numpy as np
import torch

from nxd_moe.checks import check_int
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.mode import ExpertsMode, select_mode
from nxd_moe.experts.token_mapping import num_blocks, num_static_blocks, token_to_block_mapping
from nxd_moe.extras import MissingExtraError, require
from nxd_moe.model_config import MoEModelConfig, builtin_config_names, load_model_config
from nxd_moe.moe_configs import BlockwiseMatmulConfig
from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.backend import KernelCall, blockwise_call, pads_token_rows
from nxd_moe.nki_kernels.cost_model import TRN2
from nxd_moe.nki_kernels.hardware import HardwareLimitError
from nxd_moe.nki_kernels.kernels import ExpertAffinityScaleMode, moe_tkg_all_expert, moe_tkg_selective_expert
from nxd_moe.quantization.formats import QUANTIZATION_CHOICES, Shape, get_format

HELP = ("plan Trainium2 kernel settings for a model config (block size, DMA skipping, LNC2 strategy, TP vs EP, "
        "selective loading vs all-experts) from simulated counts and the Trn2 cost model")
BLOCK_SIZES = (128, 256, 512, 1024)
DEFAULT_AIF_TARGET = 400.0  # the deep dive: "For TRN2 instances, this ratio is approximately 400-500 FLOPs/byte"
DEFAULT_DECODE_BATCH = 8
ALL_SKIPS = {"skip_dma_token": True, "skip_dma_weight": True}
LNC2_STRATEGIES = {
    "shard-on-H": {},
    "shard-on-I, dynamic": {"use_shard_on_intermediate_dynamic_while": True},
    "shard-on-block PING_PONG, dynamic": {"use_shard_on_block_dynamic_while": True,
                                          "block_sharding_strategy": "PING_PONG"},
    "shard-on-block HI_LO, dynamic": {"use_shard_on_block_dynamic_while": True, "block_sharding_strategy": "HI_LO"},
}
SKIP_MODES = {"no skipping": (False, False), "token": (True, False), "weight": (False, True),
              "token+weight": (True, True)}
_FLAGS = ("skip_dma_token", "skip_dma_weight", "use_shard_on_intermediate_dynamic_while",
          "use_shard_on_block_dynamic_while", "use_block_parallel", "block_sharding_strategy", "logical_nc_config")


@dataclass(frozen=True)
class RankProblem:
    """One rank's share of an MoE layer: all ``tokens``, ``E / ep`` experts, ``I / tp`` intermediate columns."""

    model: MoEModelConfig
    tokens: int
    tp: int
    ep: int

    @property
    def experts(self) -> int:
        return self.model.num_experts // self.ep

    @property
    def intermediate(self) -> int:
        return self.model.intermediate_size // self.tp

    @property
    def hidden(self) -> int:
        return self.model.hidden_size

    @property
    def top_k(self) -> int:
        return self.model.top_k

    def experts_config(self):
        return self.model.routed_experts_config(intermediate_size=self.intermediate)

    def activation(self) -> ExpertActivation:
        return ExpertActivation.from_config(self.experts_config())


def rank_problem(model: MoEModelConfig, tokens: int, tp: int = 1, ep: int = 1) -> RankProblem:
    check_int("tokens", tokens, minimum=1)
    check_int("tp", tp, minimum=1)
    check_int("ep", ep, minimum=1)
    if model.num_experts % ep:
        raise ValueError(f"--ep must divide the number of experts ({model.num_experts}), got {ep}")
    if model.intermediate_size % tp:
        raise ValueError(f"--tp must divide the intermediate size ({model.intermediate_size}), got {tp}")
    return RankProblem(model, tokens, tp, ep)


def _shape_only(shape: tuple[int, ...], dtype=nl.bfloat16) -> np.ndarray:
    """A float input of the right shape holding no data (a counting run never reads float values)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=dtype), shape=shape, strides=(0,) * len(shape))


# Stored quantized bytes in a counting run: a 1-byte float container, so nothing is materialised (integer inputs
# would be); the kernels only move and count these bytes. E8M0 is exactly what MX scales are.
_COUNTING_BYTES = {torch.float8_e4m3fn: nl.float8_e4m3fn, torch.uint8: np.dtype(ml_dtypes.float8_e8m0fnu),
                   torch.float32: nl.float32}


def _weights(problem: RankProblem) -> dict:
    e, h, i = problem.experts, problem.hidden, problem.intermediate
    projections = 2 if problem.model.experts.get("glu_mlp", True) else 1
    bias = problem.model.experts.get("bias", False)
    fmt = get_format(problem.experts_config().quantization)
    out = {
        "gate_and_up_proj_bias": _shape_only((e, projections, i)) if bias else None,
        "down_proj_bias": _shape_only((e, h)) if bias else None,
    }
    if not fmt.quantized:
        return {"gate_up_proj_weight": _shape_only((e, h, projections, i)),
                "down_proj_weight": _shape_only((e, i, h)), **out}
    for name, shape in (("gate_up_proj", Shape(e, h, projections * i)), ("down_proj", Shape(e, i, h))):
        out[f"{name}_weight"] = _shape_only(fmt.weight_shape(shape), _COUNTING_BYTES[fmt.weight_dtype])
        out[f"{name}_scale"] = _shape_only(fmt.scale_shape(shape), _COUNTING_BYTES[fmt.scale_dtype])
    out["weight_format"] = fmt.name
    return out


def balanced_expert_index(tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """``(T, k)``: token ``t`` goes to experts ``(t*k + j) mod E`` -- every expert gets ``T*k/E`` tokens."""
    return (torch.arange(tokens * top_k) % num_experts).view(tokens, top_k)


def local_expert_mask(problem: RankProblem) -> torch.Tensor:
    """``(T, E/EP)``: the balanced routing restricted to rank 0's experts (EP's other ranks look the same)."""
    index = balanced_expert_index(problem.tokens, problem.top_k, problem.model.num_experts)
    return (index.unsqueeze(-1) == torch.arange(problem.experts)).any(dim=1)


@dataclass
class Candidate:
    """One simulated configuration: its counts and estimated time, or why it cannot run."""

    section: str
    label: str
    kernel: str | None = None
    lnc: int | None = None
    dma_bytes: int | None = None
    matmul_flops: int | None = None
    estimated_us: float | None = None
    bound: str | None = None
    sbuf_kib: float | None = None
    error: str | None = None


def _simulate(section: str, label: str, call: KernelCall) -> Candidate:
    # Ours fail only on limits and bad sizes; an external kernel may fail any way (its asserts, its index errors).
    expected = Exception if isinstance(call.kernel, compat.Kernel) else (HardwareLimitError, ValueError)
    try:
        run = call.run(numerics=False)
    except expected as e:
        return Candidate(section, label, call.name, call.lnc,
                         error=str(e) if isinstance(e, HardwareLimitError) else f"{type(e).__name__}: {e}")
    estimate = TRN2.estimate_run(run)
    accounting = run.accounting
    return Candidate(section, label, call.name, call.lnc, accounting.dma_bytes(), accounting.matmul_flops,
                     estimate.total_ns / 1e3, estimate.bound, accounting.sbuf_high_water / 1024)


def prefill_candidate(problem: RankProblem, config: BlockwiseMatmulConfig, section: str, label: str,
                      intercept=None) -> Candidate:
    """Simulate the BWMM kernel ``config`` selects on the rank's balanced prefill (``intercept(call)``: hand the
    prepared call over instead, and return an empty candidate)."""
    mask = local_expert_mask(problem)
    blocks = num_blocks(problem.tokens, problem.top_k, problem.experts, config.block_size)
    # optimized=False scatters from the (T, E/EP) mask alone: rank 0 does not know the other ranks' experts.
    mapping = token_to_block_mapping(mask, torch.zeros(problem.tokens, 1, dtype=torch.long), config.block_size,
                                     blocks, optimized=False)
    if config.num_static_blocks is None:
        static = num_static_blocks(problem.tokens, problem.top_k, config.block_size, problem.ep)
        config = replace(config, num_static_blocks=min(static, blocks))
    rows = problem.tokens + int(pads_token_rows(config))
    arrays = {"hidden_states": _shape_only((rows, problem.hidden)),
              "expert_affinities_masked": _shape_only((rows * problem.experts, 1)), **_weights(problem)}
    try:
        call = blockwise_call(arrays, mapping.token_position_to_id.numpy(), mapping.block_to_expert.numpy(),
                              mapping.conditions.numpy(), config, tokens=problem.tokens, top_k=problem.top_k,
                              activation=problem.activation(),
                              prescale=problem.model.experts.get("early_expert_affinity_modulation", False),
                              accumulate=problem.top_k > 1 or problem.ep > 1)
    except ValueError as e:
        return Candidate(section, label, error=str(e))
    if intercept is not None:
        intercept(call)
        return Candidate(section, label)
    return _simulate(section, label, call)


# The blockwise-matmul inputs an external kernel may take, by NxD's / nki-library's argument names. Options whose
# types are the kernel's own (skip modes, scaling-mode enums, dtypes) are left at the kernel's defaults.
EXTERNAL_ARGUMENTS = ("hidden_states", "expert_affinities_masked", "gate_up_proj_weight", "down_proj_weight",
                      "token_position_to_id", "block_to_expert", "block_size", "conditions", "gate_and_up_proj_bias",
                      "down_proj_bias", "is_tensor_update_accumulating")


def external_call(kernel, lnc: int, label: str, call: KernelCall) -> KernelCall:
    """``call``'s problem handed to an external ``@nki.jit`` kernel: the arguments of :data:`EXTERNAL_ARGUMENTS`
    its signature names (``conditions`` only with a trailing 0, as NxD passes it)."""
    kernel = kernel if isinstance(kernel, compat.Kernel) else compat.Kernel(kernel)
    accepted = inspect.signature(kernel.fn).parameters
    args = {name: call.args[name] for name in EXTERNAL_ARGUMENTS if name in accepted and name in call.args
            and not (name == "conditions" and call.args[name] is None)}
    return KernelCall(kernel.fn.__name__, kernel, lnc, args)


def external_candidate(problem: RankProblem, config: BlockwiseMatmulConfig, kernel, lnc: int, section: str,
                       label: str) -> Candidate:
    """An external kernel on the rank's balanced prefill: NxD's augmented inputs (padding slots hold ``T``, a zero
    row ``T``; no DMA skipping unless the kernel's own defaults skip), an even block count, a counting run."""
    config = _variant(config, skip_dma_token=False, skip_dma_weight=False, use_block_parallel=True,
                      logical_nc_config=lnc)
    captured: list[KernelCall] = []
    ours = prefill_candidate(problem, config, section, label, captured.append)
    if not captured:
        return ours
    return _simulate(section, label, external_call(kernel, lnc, label, captured[0]))


def decode_candidate(problem: RankProblem, batch: int, mode: ExpertsMode, lnc: int, section: str) -> Candidate:
    """Simulate a decode kernel on ``batch`` tokens with a balanced routing over the rank's experts."""
    experts = problem.experts
    prescale = problem.model.experts.get("early_expert_affinity_modulation", False)
    args = {"hidden_states": _shape_only((batch, problem.hidden)),
            "expert_affinities_masked": _shape_only((batch * experts, 1)),
            "expert_mask": _shape_only((batch * experts, 1)) if prescale else None,
            "activation": problem.activation(),
            "expert_affinities_scaling_mode": (ExpertAffinityScaleMode.PRE_SCALE if prescale
                                               else ExpertAffinityScaleMode.POST_SCALE),
            **_weights(problem)}
    label = mode.value
    if mode is ExpertsMode.SELECTIVE_LOADING:
        # Under EP (where NxD raises and nxd_moe does not) a balanced routing spreads each token's k experts over
        # the EP ranks, so a rank serves about ceil(k / EP) of them per token.
        local_top_k = min(-(-problem.top_k // problem.ep), experts)
        args["expert_index"] = balanced_expert_index(batch, local_top_k, experts).to(torch.int32).numpy()
        call = KernelCall("moe_tkg_selective_expert", moe_tkg_selective_expert, lnc, args)
    else:
        call = KernelCall("moe_tkg_all_expert", moe_tkg_all_expert, lnc, args)
    return _simulate(section, label, call)


def aif_table(problem: RankProblem, target: float) -> list[dict]:
    """The deep dive's block-size rule: ``AIF = B * N / E`` FLOPs per weight byte (``N`` provisioned blocks)."""
    rows = []
    for block_size in BLOCK_SIZES:
        blocks = num_blocks(problem.tokens, problem.top_k, problem.experts, block_size)
        aif = block_size * blocks / problem.experts
        rows.append({"block_size": block_size, "num_blocks": blocks, "aif": aif, "meets_target": aif >= target})
    return rows


def choose_block_size(table: list[dict]) -> int:
    """The smallest block size whose AIF meets the target (compute-bound, least padding); else the largest."""
    return next((row["block_size"] for row in table if row["meets_target"]), table[-1]["block_size"])


def _fastest(candidates: list[Candidate]) -> Candidate | None:
    ran = [c for c in candidates if c.error is None]
    return min(ran, key=lambda c: c.estimated_us) if ran else None


def tp_ep_advice(model: MoEModelConfig, splits: list[tuple[int, int]]) -> list[str]:
    """The deep dive's "Configuring TP and EP" rules applied to this model."""
    advice = []
    if model.num_experts <= 32:
        advice.append(f"{model.num_experts} experts (<= 32): prefer TP -- good load balance without distributing "
                      "experts")
    elif model.num_experts >= 64:
        advice.append(f"{model.num_experts} experts (>= 64): prefer EP -- better expert distribution")
    else:
        advice.append(f"{model.num_experts} experts: between the deep dive's TP (<= 32) and EP (>= 64) regimes")
    for tp, _ in splits:
        if tp > 1 and model.intermediate_size // tp < 128:
            advice.append(f"TP={tp} leaves I/TP = {model.intermediate_size // tp} < 128 columns: the Tensor Engine is "
                          "under-used; prefer EP")
    advice.append("hybrid: moderate TP (2-8) with EP; with large EP the slowest rank decides and routing skew can "
                  "give one rank 3-4x the average tokens -- the estimates below assume balanced routing")
    advice.append("collective communication (all-gather, reduce-scatter) is not in the estimates")
    return advice


def plan(model: MoEModelConfig, tokens: int, tp: int = 1, ep: int = 1, decode_batch: int = DEFAULT_DECODE_BATCH,
         aif_target: float = DEFAULT_AIF_TARGET, external: dict | None = None) -> dict:
    """The whole report as plain data (what ``--json`` prints). ``external``: ``{label: (kernel, lnc)}`` of
    ``@nki.jit`` kernels to simulate on the prefill problem too (section "prefill external kernels")."""
    problem = rank_problem(model, tokens, tp, ep)
    check_int("decode_batch", decode_batch, minimum=1)
    base = model.blockwise_config(logical_nc_config=2)
    table = aif_table(problem, aif_target)
    block_size = choose_block_size(table)
    sizes = [prefill_candidate(problem, replace(base, block_size=b), "prefill block size", f"B={b}")
             for b in BLOCK_SIZES]
    fastest_size = _fastest(sizes)
    candidates = list(sizes)
    tuned = replace(base, block_size=block_size, **ALL_SKIPS)
    strategies = [prefill_candidate(problem, _variant(tuned, **flags), "prefill LNC2 strategy", label)
                  for label, flags in LNC2_STRATEGIES.items()]
    strategies.append(prefill_candidate(problem, _variant(tuned, logical_nc_config=1), "prefill LNC2 strategy",
                                        "one core (LNC1), shard-on-H"))
    candidates += strategies
    for label, (kernel, lnc) in (external or {}).items():
        candidates.append(external_candidate(problem, tuned, kernel, lnc, "prefill external kernels", label))
    best = _fastest(strategies[:-1])
    if best is not None:
        flags = LNC2_STRATEGIES[best.label]
        candidates += [prefill_candidate(problem, _variant(tuned, skip_dma_token=tok, skip_dma_weight=wt, **flags),
                                         "prefill DMA skipping", label) for label, (tok, wt) in SKIP_MODES.items()]
    chosen_decode = select_mode(decode_batch, 1, model.top_k, model.num_experts, block_size, None,
                                model.experts.get("selective_loading_threshold", 1.0))
    candidates += [decode_candidate(problem, decode_batch, mode, 2, "decode")
                   for mode in (ExpertsMode.SELECTIVE_LOADING, ExpertsMode.ALL_EXPERTS)]
    world = tp * ep
    splits = [(t, world // t) for t in range(1, world + 1)
              if world % t == 0 and model.intermediate_size % t == 0 and model.num_experts % (world // t) == 0]
    best_flags = LNC2_STRATEGIES[best.label] if best is not None else {}
    for t, e in splits:
        split_problem = rank_problem(model, tokens, t, e)
        candidates.append(prefill_candidate(split_problem, _variant(tuned, **best_flags), "TP x EP (prefill, per rank)",
                                            f"TP={t} EP={e}"))
    return {
        "config": model.name,
        "tokens": tokens,
        "tp": tp,
        "ep": ep,
        "decode_batch": decode_batch,
        "quantization": problem.experts_config().quantization,
        "per_rank": {"experts": problem.experts, "hidden_size": problem.hidden,
                     "intermediate_size": problem.intermediate, "top_k": problem.top_k},
        "aif_target": aif_target,
        "model_ridge_flops_per_byte": TRN2.ridge_flops_per_byte,
        "aif_table": table,
        "block_size": block_size,
        "fastest_block_size": None if fastest_size is None else int(fastest_size.label.removeprefix("B=")),
        "fastest_lnc2_strategy": None if best is None else best.label,
        "decode_rule": {"mode": chosen_decode.value, "assignments": decode_batch * model.top_k,
                        "alpha_times_experts": model.experts.get("selective_loading_threshold", 1.0)
                        * model.num_experts},
        "tp_ep_advice": tp_ep_advice(model, splits),
        "assumptions": TRN2.assumptions() + [
            "balanced routing: every expert gets T*k/E tokens; per rank E/EP experts and I/TP columns, all T tokens",
            "bf16 weights and activations; each candidate is the real kernel in a counting run at full size",
        ],
        "candidates": [asdict(c) for c in candidates],
    }


def _variant(config: BlockwiseMatmulConfig, **flags) -> BlockwiseMatmulConfig:
    """``config`` with the kernel-selecting flags replaced (the others reset to NxD's defaults)."""
    defaults = BlockwiseMatmulConfig(block_size=config.block_size, logical_nc_config=config.logical_nc_config,
                                     skip_dma_token=config.skip_dma_token, skip_dma_weight=config.skip_dma_weight)
    chosen = {name: getattr(defaults, name) for name in _FLAGS}
    chosen.update(flags)
    return replace(config, **chosen)


# ----------------------------------------------------------------------------------------------------------------
# output


def format_plan(report: dict) -> str:
    r = report
    per_rank = r["per_rank"]
    lines = [
        f"nxd-moe plan: {r['config']}, {r['tokens']} prefill tokens, decode batch {r['decode_batch']}, "
        f"TP={r['tp']} EP={r['ep']} -> per rank E={per_rank['experts']}, H={per_rank['hidden_size']}, "
        f"I={per_rank['intermediate_size']}, k={per_rank['top_k']}, expert weights {r['quantization']}",
        "Estimated Trn2 times come from a cost model over simulated counts -- a model, not a measurement:",
        *(f"  - {a}" for a in r["assumptions"]),
        "",
        f"Block size by arithmetic intensity, AIF = B * N / E >= {r['aif_target']:.0f} FLOPs/byte (deep dive; this "
        f"model's per-core ridge point is {r['model_ridge_flops_per_byte']:.0f}):",
    ]
    for row in r["aif_table"]:
        mark = "  <- chosen" if row["block_size"] == r["block_size"] else ""
        lines.append(f"  B={row['block_size']:<5d} N={row['num_blocks']:<6d} AIF={row['aif']:9.1f}"
                     f"{' meets' if row['meets_target'] else ' below'} target{mark}")
    sections: dict[str, list[dict]] = {}
    for c in r["candidates"]:
        sections.setdefault(c["section"], []).append(c)
    header = f"  {'candidate':36s} {'kernel':40s} {'lnc':>3s} {'DMA MB':>10s} {'GFLOP':>10s} {'est. us':>10s} " \
             f"{'bound':>7s} {'SBUF KiB':>9s}"
    for section, rows in sections.items():
        lines += ["", section + ":", header]
        fastest = min((c["estimated_us"] for c in rows if c["error"] is None), default=None)
        for c in rows:
            if c["error"] is not None:
                lines.append(f"  {c['label']:36s} does not run: {c['error']}")
                continue
            ratio = f"  x{c['estimated_us'] / fastest:.2f}" if fastest else ""
            lines.append(f"  {c['label']:36s} {c['kernel']:40s} {c['lnc']:>3d} {c['dma_bytes'] / 1e6:10.2f} "
                         f"{c['matmul_flops'] / 1e9:10.2f} {c['estimated_us']:10.1f} {c['bound']:>7s} "
                         f"{c['sbuf_kib']:9.1f}{ratio}")
        if section == "prefill block size" and r["fastest_block_size"]:
            lines.append(f"  -> the rule picks B={r['block_size']}; fastest simulated: B={r['fastest_block_size']} "
                         "(with the config's kernel settings)")
        if section == "prefill LNC2 strategy" and r["fastest_lnc2_strategy"]:
            lines.append(f"  -> fastest LNC2 strategy: {r['fastest_lnc2_strategy']}")
        if section == "decode":
            rule = r["decode_rule"]
            lines.append(f"  -> NxD's rule (T*k = {rule['assignments']} vs alpha*E = {rule['alpha_times_experts']:g}): "
                         f"{rule['mode']}")
    lines += ["", "TP vs EP (deep dive, 'Configuring TP and EP'):", *(f"  - {a}" for a in r["tp_ep_advice"])]
    return "\n".join(lines)


def _pyplot():
    """matplotlib's pyplot on the file-only backend, imported on first use (an optional dependency)."""
    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plan(report: dict, path: str) -> None:
    """A PNG: estimated time of each candidate, one panel per section."""
    plt = _pyplot()
    sections: dict[str, list[dict]] = {}
    for c in report["candidates"]:
        if c["error"] is None:
            sections.setdefault(c["section"], []).append(c)
    fig, axes = plt.subplots(len(sections), 1, figsize=(9, 2.2 + 0.45 * len(report["candidates"])), squeeze=False)
    for ax, (section, rows) in zip(axes[:, 0], sections.items()):
        ax.barh([c["label"] for c in rows], [c["estimated_us"] for c in rows], color="tab:blue")
        ax.set_title(section, fontsize=10)
        ax.set_xlabel("estimated Trn2 time (us) -- cost model, not a measurement")
        ax.invert_yaxis()
    fig.suptitle(f"{report['config']}: {report['tokens']} tokens, TP={report['tp']} EP={report['ep']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help=f"YAML path or built-in name ({', '.join(builtin_config_names())})")
    parser.add_argument("--tokens", type=int, required=True, help="prefill tokens (batch x sequence)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the experts (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")
    parser.add_argument("--decode-batch", type=int, default=DEFAULT_DECODE_BATCH,
                        help=f"sequences in a decode step (default {DEFAULT_DECODE_BATCH})")
    parser.add_argument("--aif-target", type=float, default=DEFAULT_AIF_TARGET,
                        help=f"arithmetic-intensity target of the block-size rule (default {DEFAULT_AIF_TARGET:.0f})")
    parser.add_argument("--kernel", action="append", default=[], metavar="MODULE:FUNCTION[@LNC]",
                        help="also simulate this @nki.jit kernel on the prefill problem (repeatable; LNC default 2); "
                             "its module is imported with `nki` resolving to the simulator")
    parser.add_argument("--kernel-path", action="append", default=[], metavar="DIR",
                        help="prepend DIR to sys.path for --kernel (e.g. an nki-library checkout's src/)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="routed experts' weight format (default: the config's, bf16); the kernels DMA the stored "
                             "bytes and scales and dequantize on chip")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw the estimates into this PNG file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def load_kernels(specs: list[str], paths: list[str]) -> dict:
    """``{spec: (kernel, lnc)}`` for ``module:function[@lnc]`` specs, imported with the ``nki`` API installed."""
    if not specs:
        return {}
    compat.install()
    sys.path[:0] = list(paths)
    kernels = {}
    for spec in specs:
        target, _, lnc = spec.partition("@")
        module, sep, attr = target.partition(":")
        if not sep or not attr:
            raise ValueError(f"--kernel must be MODULE:FUNCTION[@LNC], got {spec!r}")
        if lnc not in ("", "1", "2"):
            raise ValueError(f"--kernel {spec!r}: LNC must be 1 or 2")
        try:
            kernel = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--kernel {spec!r}: {e}") from None
        kernels[f"{attr}@{lnc or 2} ({module})"] = (kernel, int(lnc or 2))
    return kernels


def main(args: argparse.Namespace) -> int:
    try:
        if args.plot:
            _pyplot()  # fail before simulating, not after
        external = load_kernels(args.kernel, args.kernel_path)
        model = load_model_config(args.config)
        if args.quantization is not None:
            model = replace(model, experts={**model.experts, "quantization": args.quantization})
        report = plan(model, args.tokens, args.tp, args.ep, args.decode_batch, args.aif_target, external)
        if args.plot:
            plot_plan(report, args.plot)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, MissingExtraError) as e:
        print(f"nxd-moe plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    if args.plot:
        print(f"chart written to {args.plot}")
    return 0
