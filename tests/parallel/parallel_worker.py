"""One rank of a test world: ``python parallel_worker.py SUITE OUT_DIR`` (started by ``parallel_harness``).

Every check compares the parallel layer on this rank's tokens with the single-device layer (same weights, loaded
through :func:`nxd_moe.parallel.sharding.load_full_state_dict`) run on the whole block's tokens. The single-device
layer is itself checked against the float64 dense reference by the core suite. Comparisons refuse near-zero
references, so they cannot pass vacuously.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import (  # noqa: E402
    FP32_ATOL,
    MODES,
    PARALLEL_BF16_TOLERANCE,
    assert_close,
    assert_rounding_close,
    make_config,
    make_router,
    no_host_sync,
    randn,
    random_routing,
    randomize_,
    without_device_sync,
)

from nxd_moe import (  # noqa: E402
    BlockwiseMatmulConfig,
    ExpertMLPsV2,
    MoE,
    RoutedExpertsMLPOpsConfig,
    SharedExperts,
    parallel_state,
)
from nxd_moe.config import ExpertParallelConfig  # noqa: E402
from nxd_moe.parallel import ExpertParallel  # noqa: E402
from nxd_moe.parallel.eplb import plan_expert_distribution, rank_loads  # noqa: E402
from nxd_moe.parallel.sharding import load_full_state_dict  # noqa: E402

DISPATCHES = ("all_gather", "all_to_all_v")
# (dispatch, all_to_all_splits): every way tokens travel.
DISPATCH_WAYS = (("all_gather", "static"), ("all_to_all_v", "static"), ("all_to_all_v", "exact"))

# Expert/router variants, so that each layout also exercises different expert features.
VARIANTS = {
    "gptoss": dict(activation="swiglu_gptoss", bias=True, intermediate_size_actual=6, router="topk_act_over_topk"),
    "qwen": dict(activation="glu_silu", normalize_top_k_affinities=True, router="topk_softmax"),
    "llama4": dict(activation="glu_silu", top_k=1, early_expert_affinity_modulation=True, router="topk_sigmoid"),
    "deepseek": dict(activation="glu_silu", num_experts=16, top_k=4, router="group_limited"),
    "mixtral": dict(activation="glu_silu", normalize_top_k_affinities=True, router="topk_softmax", num_experts=16),
}


# ----------------------------------------------------------------------------------------------------------
# building blocks


def init(tp: int, ep: int, prefill: tuple[int, int] | None = None, decode: tuple[int, int] | None = None,
         **kwargs) -> None:
    sizes = {}
    for phase, phase_sizes in (("prefill", prefill), ("decode", decode)):
        if phase_sizes:
            sizes[f"moe_{phase}_tensor_model_parallel_size"], sizes[f"moe_{phase}_expert_model_parallel_size"] = \
                phase_sizes
    parallel_state.initialize_model_parallel(tp, ep, **sizes, **kwargs)


def make_moe(model_parallel: bool | None, *, variant: str = "qwen", sp: bool = False, shared: str | None = None,
             dispatch: str = "all_gather", distribution=None, block_size: int = 4, backend: str = "torch",
             splits: str = "static", micro_batches: int | None = None, transport: str = "nccl",
             **overrides) -> MoE:
    spec = {"num_experts": 8, "top_k": 2, "hidden_size": 16, "intermediate_size": 8, **VARIANTS[variant], **overrides}
    router_kind = spec.pop("router")
    cfg = make_config(**spec)
    router = make_router(router_kind, cfg.num_experts, cfg.top_k, cfg.hidden_size, seed=2)
    experts = ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=block_size),
                           expert_parallel_config=ExpertParallelConfig(dispatch, distribution,
                                                                       all_to_all_splits=splits,
                                                                       micro_batches=micro_batches,
                                                                       transport=transport),
                           model_parallel=model_parallel, backend=backend)
    shared_experts = None if shared is None else SharedExperts(
        cfg.hidden_size, 8, 1, "silu", fused_gate_up_projection=True, sequence_parallel_enabled=shared == "sp",
        shared_expert_gate=True, model_parallel=model_parallel)
    return MoE(router, experts, shared_experts, sequence_parallel_enabled=sp).eval()


def pair(backend: str = "torch", **kwargs) -> tuple[MoE, MoE]:
    """The single-device layer (random weights, torch backend) and the parallel one holding this rank's shard of
    them, computing with ``backend``."""
    full = randomize_(make_moe(False, **kwargs), seed=1)
    return full, load_full_state_dict(make_moe(None, backend=backend, **kwargs), full.state_dict())


def full_experts(cfg: RoutedExpertsMLPOpsConfig, seed: int) -> ExpertMLPsV2:
    """The single-device ``ExpertMLPsV2`` (block size 4) with random weights."""
    return randomize_(ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=4), model_parallel=False), seed=seed)


def parallel_experts(full: ExpertMLPsV2, dispatch: str, distribution=None, splits: str = "static"
                     ) -> ExpertParallel:
    """The parallel twin of ``full`` (same configs): this rank's shard of its weights, run over the block."""
    placed = ExpertParallelConfig(dispatch, distribution, all_to_all_splits=splits)
    return ExpertParallel(load_full_state_dict(ExpertMLPsV2(full.routed_experts_mlp_config,
                                                            full.blockwise_matmul_config,
                                                            expert_parallel_config=placed), full.state_dict()))


def check_rows(par: ExpertParallel, inputs: tuple, rows: slice, expected: torch.Tensor, msg: str, **kwargs):
    """``par`` on rows ``rows`` of the block-wide ``inputs`` (hidden, affinities, expert index) gives
    ``expected``; returns its stats."""
    out, stats = par(*(t[rows] for t in inputs), return_stats=True, **kwargs)
    assert_close(out, expected, FP32_ATOL, msg=msg)
    return stats


def coordinates() -> tuple[int, int, int, int]:
    """``(token group index, number of token groups, TP rank, TP size)`` of this rank."""
    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_size(),
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_size())


def local_view(x: torch.Tensor, batch: int, sharded: bool) -> torch.Tensor:
    """This rank's part of a block-wide ``(D * B, S, ...)`` tensor."""
    d, _, j, tp = coordinates()
    x = x[d * batch:(d + 1) * batch]
    if sharded:
        width = x.shape[1] // tp
        x = x[:, j * width:(j + 1) * width]
    return x


def check_moe(full: MoE, par: MoE, batch: int, seq: int, seed: int, padding: bool = False,
              relative: float = 0.0, dtype: torch.dtype = torch.float32, atol: float = FP32_ATOL,
              return_stats: bool = True):
    """Parallel output on this rank's tokens == single-device output on the block's tokens; returns the stats
    (None without ``return_stats``: a call that asks for none, as a model's does)."""
    _, groups, _, _ = coordinates()
    x = randn(groups * batch, seq, full.hidden_size, seed=seed).to(dtype)
    mask = (randn(groups * batch, seq, seed=seed + 1) > -1.0) if padding else None
    sharded = par.sequence_parallel_enabled and seq > 1
    with torch.no_grad():
        expected = local_view(full(x, padding_mask=mask)[0], batch, sharded)
        result = par(local_view(x, batch, sharded), padding_mask=None if mask is None else
                     local_view(mask, batch, sharded), return_stats=return_stats)
        out, stats = (result[0], result[-1]) if return_stats else (result[0], None)
    assert expected.abs().mean() > 0.02, "reference output is near zero: the comparison would be vacuous"
    # ``relative``: a tolerance that scales with the largest output (large-valued layers round more in fp32).
    assert out.dtype == dtype
    assert_close(out, expected, max(atol, relative * float(expected.abs().max())), msg=f"B={batch} S={seq}")
    return stats


def gather_objects(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ----------------------------------------------------------------------------------------------------------
# layouts: every layout x sequence parallel x dispatch, prefill and both decode modes


def blockwise_seq(backend: str) -> int:
    """A prefill length (batch 2 per token group, top-2) that ``backend``'s rule runs blockwise: 8 for NxD's rule;
    the GPU backend runs up to 1024 (token, expert) pairs as the decode of that size, so 528 tokens in all
    (1056 pairs), whatever the token groups."""
    return 8 if backend == "torch" else 264 // coordinates()[1]


def layout(tp: int, ep: int, sp: bool, dispatch: str, variant: str, shared: str | None, prefill=None, decode=None,
           decode_batches: tuple[int, int] = (1, 4), backend: str = "torch", splits: str = "static",
           micro_batches: int | None = None) -> Callable[[], None]:
    def run():
        init(tp, ep, prefill, decode)
        full, par = pair(variant=variant, sp=sp, shared=shared, dispatch=dispatch, backend=backend, splits=splits,
                         micro_batches=micro_batches)
        stats = check_moe(full, par, 2, blockwise_seq(backend), seed=10, padding=True)
        assert stats.mode.value == "blockwise" and stats.dispatch == dispatch, stats.summary()
        small, large = decode_batches
        assert check_moe(full, par, small, 1, seed=11).mode.value == "selective_loading"
        # A large decode batch: NxD's rule picks all-experts; the GPU backend keeps selective loading.
        large_mode = "all_experts" if backend == "torch" else "selective_loading"
        assert check_moe(full, par, large, 1, seed=12).mode.value == large_mode
        if prefill or decode:  # hybrid sharding: the two phases hold different shards
            assert hasattr(par.expert_mlps, "mlp_op_tkg")
    return run


def forced_modes(tp: int, ep: int) -> Callable[[], None]:
    """ExpertMLPsV2 alone, every mode forced, both dispatches, with and without sequence parallelism."""
    def run():
        init(tp, ep)
        cfg = make_config(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, bias=True, capacity_factor=1.0)
        full = full_experts(cfg, seed=3)
        d, groups, j, tp_size = coordinates()
        per_group = 12
        hidden = randn(groups * per_group, 16, seed=20)
        affinities, index = random_routing(groups * per_group, 8, 2, seed=21, skew=0.3)
        real = randn(groups * per_group, seed=22) > -1.0
        for dispatch, splits in DISPATCH_WAYS:
            par = parallel_experts(full, dispatch, splits=splits)
            for mode in MODES:
                expected, ref_stats = full(hidden, affinities, index, padding_mask=real, mode=mode, return_stats=True)
                for sp in (False, True):
                    rows = slice(d * per_group, (d + 1) * per_group)
                    if sp:
                        width = per_group // tp_size
                        rows = slice(d * per_group + j * width, d * per_group + (j + 1) * width)
                    token_layout = par.groups.token_layout(1, rows.stop - rows.start, sp)
                    stats = check_rows(par, (hidden, affinities, index), rows, expected[rows],
                                       f"{dispatch}/{splits} {mode} sp={sp}", padding_mask=real[rows], mode=mode,
                                       token_layout=token_layout)
                    assert int(stats.dropped_tokens) == int(ref_stats.dropped_tokens)
                    assert torch.equal(stats.tokens_per_expert, ref_stats.tokens_per_expert)
                if mode == "capacity_factor":
                    assert int(ref_stats.dropped_tokens) > 0, "capacity case must drop something"
    return run


def capacity(tp: int, ep: int, sp: bool, dispatch: str) -> Callable[[], None]:
    """Capacity-factor drops under parallelism are exactly one device's (first come first served in token order,
    with B > 1 so that sequence shards interleave in that order)."""
    def run():
        init(tp, ep)
        full, par = pair(variant="qwen", sp=sp, dispatch=dispatch, capacity_factor=1.0)
        stats = check_moe(full, par, 2, 8, seed=30)
        assert stats.mode.value == "capacity_factor" and int(stats.dropped_tokens) > 0
    return run


def micro_batched(tp: int, ep: int, sp: bool, variant: str, count: int, backend: str = "torch",
                  **overrides) -> Callable[[], None]:
    """The static all-to-all in ``count`` micro-batches (asynchronous exchanges waited for part by part) equals the
    single-device layer: a padded blockwise prefill, a decode, and with ``capacity_factor`` each expert's first
    pairs of the whole block; each call without statistics runs the experts once per part."""
    def run():
        init(tp, ep)
        full, par = pair(variant=variant, sp=sp, shared="tp", dispatch="all_to_all_v", backend=backend,
                         micro_batches=count, **overrides)
        experts = par.expert_mlps
        runs, compute = [], experts.compute
        experts.compute = lambda *a, **k: runs.append(1) or compute(*a, **k)
        _, groups, _, tp_size = coordinates()
        for batch, seq, padding in ((2, 8, True), (3, 1, False)):
            runs.clear()
            check_moe(full, par, batch, seq, seed=60 + seq, padding=padding, return_stats=False)
            local = batch * (seq // tp_size if sp and seq > 1 else seq)
            owned = local if sp and seq > 1 else -(-local // tp_size)
            assert len(runs) == min(count, owned), (batch, seq, len(runs))
        runs.clear()
        check_moe(full, par, 2, 8, seed=62)  # statistics describe one run of the experts: one batch
        assert len(runs) == 1
    return run


# ----------------------------------------------------------------------------------------------------------
# EPLB, bytes, negative control


def zipf_routing(num_tokens: int, num_experts: int, top_k: int, seed: int, exponent: float = 1.2):
    """Top-k of noisy logits whose prior is Zipf: expert e is chosen with weight (e + 1) ** -exponent."""
    logits = randn(num_tokens, num_experts, seed=seed, dtype=torch.float64) * 0.5
    logits = logits - exponent * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64))
    return torch.softmax(logits, dim=-1).float(), logits.topk(top_k, dim=-1).indices


def eplb(dispatch: str) -> Callable[[], None]:
    def run():
        init(1, 4)
        cfg = make_config(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)
        full = full_experts(cfg, seed=4)
        d, groups, _, _ = coordinates()
        per_group = 32
        hidden = randn(groups * per_group, 16, seed=40)
        affinities, index = zipf_routing(groups * per_group, 8, 2, seed=41)
        rows = slice(d * per_group, (d + 1) * per_group)
        expected = full(hidden, affinities, index)[rows]

        def measure(distribution):
            stats = check_rows(parallel_experts(full, dispatch, distribution), (hidden, affinities, index), rows,
                               expected, f"distribution {distribution}")
            return gather_objects(stats.summary()["rank_load"]), stats.tokens_per_expert

        contiguous, counts = measure(None)
        plan = plan_expert_distribution(counts, 4, slots_per_rank=3)
        assert sum(len(experts) for experts in plan) == 12 and len({e for x in plan for e in x}) == 8
        planned, _ = measure(plan)
        total = int(counts.sum())
        assert sum(contiguous) == sum(planned) == total == groups * per_group * 2, "a pair was lost or duplicated"
        assert max(planned) < max(contiguous), (planned, contiguous)
        predicted = rank_loads(counts, plan)
        # The dispatch splits an expert's pairs between its copies to within one pair per copy.
        assert all(abs(m - p) <= len(experts) for m, p, experts in zip(planned, predicted, plan)), (planned, predicted)
    return run


def bytes_moved() -> None:
    """Every dispatch agrees with one device; the bytes each reports equal a count made from the routing alone; the
    exact all-to-all moves fewer than the all-gather (E = 16 > k = 2); the static one moves its fixed buffers."""
    init(1, 4)
    num_experts, top_k, hidden_size, per_rank = 16, 2, 64, 12
    cfg = make_config(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=8)
    full = full_experts(cfg, seed=5)
    me, ranks = dist.get_rank(), dist.get_world_size()
    hidden = randn(ranks * per_rank, hidden_size, seed=50)
    affinities, index = random_routing(ranks * per_rank, num_experts, top_k, seed=51)
    rows = slice(me * per_rank, (me + 1) * per_rank)
    expected = full(hidden, affinities, index)[rows]
    reported = {}
    for dispatch, splits in DISPATCH_WAYS:
        reported[dispatch, splits] = check_rows(parallel_experts(full, dispatch, splits=splits),
                                                (hidden, affinities, index), rows, expected, dispatch).communication
    owner = index // (num_experts // ranks)  # contiguous placement
    hits = torch.stack([(owner == r).any(dim=1) for r in range(ranks)], dim=1)  # (T, ranks)
    source = torch.arange(ranks * per_rank) // per_rank
    h_bytes, routing_bytes = hidden_size * 4, top_k * 4 + top_k * 4  # fp32 rows; int32 ids + fp32 weights
    others = ranks - 1
    gathered = reported["all_gather", "static"]
    assert gathered == {"dispatch": others * per_rank * (h_bytes + routing_bytes),
                        "combine": others * per_rank * h_bytes}, gathered
    # Static buffers: every other rank sends this rank per_rank rows, padding included.
    assert reported["all_to_all_v", "static"] == {"expert_counts": others * num_experts * 8,
                                                  "dispatch": others * per_rank * (h_bytes + routing_bytes),
                                                  "combine": others * per_rank * h_bytes}, \
        reported["all_to_all_v", "static"]
    received = int((hits[:, me] & (source != me)).sum())
    sent_away = int(hits[rows].sum()) - int(hits[rows, me].sum())
    assert reported["all_to_all_v", "exact"] == {"expert_counts": others * num_experts * 8, "send_counts": others * 8,
                                                 "dispatch": received * (h_bytes + routing_bytes + 8),
                                                 "combine": sent_away * h_bytes}, reported["all_to_all_v", "exact"]
    totals = gather_objects({k: sum(v.values()) for k, v in reported.items()})
    assert sum(t["all_to_all_v", "exact"] for t in totals) < sum(t["all_gather", "static"] for t in totals), totals


def negative_control(dispatch: str) -> Callable[[], None]:
    """Zeroing EP rank 1's experts changes exactly the tokens that route to them: every rank's experts take part,
    and a wrong placement would be caught."""
    def run():
        init(1, 4)
        full, par = pair(variant="qwen", dispatch=dispatch)
        if parallel_state.get_moe_expert_model_parallel_rank() == 1:
            with torch.no_grad():
                for p in par.expert_mlps.parameters():
                    p.zero_()
        _, groups, _, _ = coordinates()
        x = randn(groups * 3, 4, 16, seed=60)
        with torch.no_grad():
            expected = local_view(full(x)[0], 3, False).reshape(-1, 16)
            _, _, index = full.router(local_view(x, 3, False).reshape(-1, 16))
            out = par(local_view(x, 3, False))[0].reshape(-1, 16)
        touched = ((index >= 2) & (index < 4)).any(dim=1)  # experts 2, 3 live on EP rank 1
        diff = (out - expected).abs().max(dim=1).values
        assert bool((diff[~touched] <= FP32_ATOL).all()), diff[~touched]
        assert bool((diff[touched] > 1e-4).all()), diff[touched]
        assert 0 < int(touched.sum()) < touched.numel()
    return run


def idle_ranks() -> None:
    """Every token picks experts 0 and 1 (EP rank 0's): the other ranks compute nothing, receive nothing in the
    all-to-all-v, and every rank still gets its tokens' outputs."""
    init(1, 4)
    cfg = make_config(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)
    full = full_experts(cfg, seed=6)
    me, ranks, per_rank = dist.get_rank(), dist.get_world_size(), 5
    hidden = randn(ranks * per_rank, 16, seed=80)
    affinities = torch.softmax(randn(ranks * per_rank, 8, seed=81), dim=-1)
    index = torch.tensor([[0, 1], [1, 0]]).repeat(ranks * per_rank // 2 + 1, 1)[: ranks * per_rank]
    rows = slice(me * per_rank, (me + 1) * per_rank)
    expected = full(hidden, affinities, index)[rows]
    for dispatch, splits in DISPATCH_WAYS:
        stats = check_rows(parallel_experts(full, dispatch, splits=splits), (hidden, affinities, index), rows,
                           expected, f"{dispatch}/{splits}")
        assert stats.summary()["rank_load"] == (2 * ranks * per_rank if me == 0 else 0)


# ----------------------------------------------------------------------------------------------------------
# quantized experts (and shared experts) under TP / EP: the same stored bytes, sliced per rank

# (H, I) that every format's blocks divide on each rank: fp8_block 128 x 128 tiles, MxFP4 32-row blocks along K.
QUANTIZED_SIZES = {"fp8": (16, 8), "fp8_block": (128, 256), "mxfp4": (64, 64)}


def quantized_pair(fmt: str, dispatch: str, sp: bool, shared: str | None, backend: str = "torch",
                   activations: str = "none"):
    """The single-device quantized layer (random weights quantized once) and its parallel twin loaded from its state
    dict: every rank holds a slice of the same stored bytes and scales. ``activations="fp8"``: W8A8."""
    from nxd_moe.quantization.quantizer import quantize_experts

    hidden, inter = QUANTIZED_SIZES[fmt]

    def build(model_parallel, quantization):
        cfg = make_config(num_experts=8, top_k=2, hidden_size=hidden, intermediate_size=inter, bias=True,
                          normalize_top_k_affinities=True, quantization=quantization,
                          activation_quantization=activations if quantization != "bf16" else "none")
        router = make_router("topk_softmax", 8, 2, hidden, seed=2)
        experts = ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=4), model_parallel=model_parallel,
                               backend=backend, expert_parallel_config=ExpertParallelConfig(dispatch))
        shared_experts = None if shared is None else SharedExperts(
            hidden, inter, 1, "silu", fused_gate_up_projection=True, sequence_parallel_enabled=shared == "sp",
            model_parallel=model_parallel, quantization=quantization)
        return MoE(router, experts, shared_experts, sequence_parallel_enabled=sp).eval()

    full = quantize_experts(randomize_(build(False, "bf16"), seed=1), fmt, shared_experts=shared is not None,
                            activation_quantization=activations)
    return full, load_full_state_dict(build(None, fmt), full.state_dict())


def quantized(tp: int, ep: int, fmt: str, dispatch: str, sp: bool, shared: str | None, backend: str = "torch",
              activations: str = "none") -> Callable[[], None]:
    def run():
        init(tp, ep)
        full, par = quantized_pair(fmt, dispatch, sp, shared, backend, activations)
        assert par.expert_mlps.mlp_op.down_proj.format.name == fmt
        assert check_moe(full, par, 2, blockwise_seq(backend), seed=15).mode.value == "blockwise"
        assert check_moe(full, par, 4, 1, seed=16).mode.value in ("selective_loading", "all_experts")
    return run


def quantized_checkpoint(kind: str, tp: int, ep: int) -> Callable[[], None]:
    """A GPT-OSS MXFP4 or DeepSeek-V3 FP8 checkpoint loads shard by shard: each rank's stored bytes and scales are
    exactly its slice of the single-device layer's, and the parallel layer computes what that layer computes."""
    def run():
        from test_quantization import deepseek_v3_fp8_checkpoint, gpt_oss_mxfp4_checkpoint

        from nxd_moe.build import build_moe
        from nxd_moe.hf import from_hf_config, load_hf_layer
        from nxd_moe.parallel.sharding import shard_specs, shard_tensor

        init(tp, ep)
        if kind == "gpt_oss_mxfp4":
            config, sd = gpt_oss_mxfp4_checkpoint(e=4, h=64, i=64)
            build = dict(quantization="mxfp4")
        else:
            config, sd, _ = deepseek_v3_fp8_checkpoint(e=4, h=128, i=256, shared="fp8_block")
            build = dict(quantization="fp8_block", shared_quantization="fp8_block")
        model = from_hf_config(config)
        full = load_hf_layer(build_moe(model, block_size=4, seed=0, model_parallel=False, **build), sd, config, 0)
        par = load_hf_layer(build_moe(model, block_size=4, seed=0, **build), sd, config, 0)
        assert par.expert_mlps.is_sharded
        full_sd, specs = full.state_dict(), shard_specs(par)
        for key, local in par.state_dict().items():
            expected = shard_tensor(full_sd[specs[key].source], specs[key]) if key in specs else full_sd[key]
            assert local.dtype == expected.dtype and torch.equal(local.view(torch.uint8) if local.element_size() == 1
                                                                 else local, expected.view(torch.uint8)
                                                                 if expected.element_size() == 1 else expected), key
        check_moe(full, par, 2, 4, seed=17, relative=1e-6)  # random MX nibbles make outputs O(1000)
    return run


def quantized_split_refused() -> None:
    """A TP size whose slices would cut a scale block fails on every rank, naming the sizes; so do W8A8 activation
    groups of the intermediate that a slice would cut (per token: the whole row)."""
    init(dist.get_world_size(), 1)
    expect_error(ValueError, "format 'fp8_block' cannot split its out (N) dimension of 256",
                 call=lambda: ExpertMLPsV2(make_config(num_experts=4, hidden_size=128, intermediate_size=128,
                                                       quantization="fp8_block")))
    expect_error(ValueError, "activation_quantization='fp8' under tensor parallelism", "fp8, per token",
                 call=lambda: ExpertMLPsV2(make_config(num_experts=4, hidden_size=16, intermediate_size=8,
                                                       quantization="fp8", activation_quantization="fp8")))


# ----------------------------------------------------------------------------------------------------------
# no host sync, CUDA graphs


def no_sync(tp: int, ep: int, sp: bool) -> Callable[[], None]:
    """After a first call (kernel set-up, the ranks' agreement on the input shapes), a parallel forward reads no
    tensor value on the host, for every dispatch way but the exact all-to-all, in prefill and decode."""
    def run():
        init(tp, ep)
        for dispatch, splits in DISPATCH_WAYS[:2]:
            full, par = pair(variant="qwen", sp=sp, shared="sp", dispatch=dispatch, splits=splits)
            for batch, seq in ((2, 8), (4, 1)):
                check_moe(full, par, batch, seq, seed=13)
                _, groups, _, _ = coordinates()
                x = local_view(randn(groups * batch, seq, full.hidden_size, seed=14), batch, sp and seq > 1)
                with torch.no_grad():
                    par(x)  # without statistics: another set of collectives, agreed on once
                    with no_host_sync():
                        par(x)
    return run


def cuda_graph_replay(tp: int, ep: int, dispatch: str, backend: str, micro_batches: int | None = None,
                      transport: str = "nccl") -> Callable[[], None]:
    """NCCL: the whole parallel step (router, dispatch, experts, combine, shared experts) captured in one CUDA graph
    and replayed with new inputs (new routings) equals eager, and eager equals the single-device layer (with
    ``micro_batches``: exchanges on NCCL's stream beside the experts, inside the graph; ``transport="nvlink"``:
    rows written straight into the peers' buffers, and eager equal to NCCL's exchange bit for bit)."""
    def run():
        from nxd_moe.graphs import capture

        init(tp, ep)
        device = torch.device("cuda", torch.cuda.current_device())
        full, par = pair(variant="qwen", sp=False, shared="tp", dispatch=dispatch, backend=backend,
                         micro_batches=micro_batches, transport=transport)
        if transport != "nccl":  # the same layer over NCCL: the same bytes arrive, so the same output
            _, over_nccl = pair(variant="qwen", sp=False, shared="tp", dispatch=dispatch, backend=backend)
            over_nccl = over_nccl.to(device, torch.bfloat16)
        full, par = full.to(device, torch.bfloat16), par.to(device, torch.bfloat16)
        _, groups, _, _ = coordinates()
        for batch, seq in ((4, 1), (2, 16)):
            xs = [randn(groups * batch, seq, full.hidden_size, seed=100 + i).to(device, torch.bfloat16)
                  for i in range(3)]
            step = capture(lambda x: par(x)[0], local_view(xs[0], batch, False))
            for x in xs:
                with torch.no_grad():
                    expected = local_view(full(x)[0], batch, False)
                    eager = par(local_view(x, batch, False))[0]
                replayed = step(local_view(x, batch, False)).clone()
                assert torch.equal(replayed, eager), (replayed - eager).abs().max()
                if transport != "nccl":
                    with torch.no_grad():
                        nccl = over_nccl(local_view(x, batch, False))[0]
                    assert torch.equal(eager, nccl), (eager - nccl).abs().max()
                assert_rounding_close(eager, expected, PARALLEL_BF16_TOLERANCE, f"{dispatch} B={batch} S={seq}")
    return run


def graph_and_one_rank_changing_shape(dispatch: str, backend: str) -> Callable[[], None]:
    """NCCL: the per-call agreement on input shapes is host work only. A captured step replays without it (no
    exchange during replays) and equals eager; an eager step, exchange included, makes no device sync; then rank 0
    alone passes another batch: every rank raises the named error within seconds (no NCCL collective was entered
    with mismatched buffers, so no communicator is aborted), and the graph and eager calls still work after it."""
    def run():
        from nxd_moe.graphs import capture

        init(1, 2, timeout_s=AGREEMENT_TIMEOUT_S, collective_timeout_s=AGREEMENT_TIMEOUT_S)
        device = torch.device("cuda", torch.cuda.current_device())
        full, par = pair(variant="qwen", sp=False, shared="tp", dispatch=dispatch, backend=backend)
        par = par.to(device, torch.bfloat16)
        exchanges = []
        original = parallel_state.start_agreement
        parallel_state.start_agreement = lambda *a: exchanges.append(1) or original(*a)
        try:
            batch, seq = 4, 1
            xs = [randn(batch, seq, full.hidden_size, seed=140 + i).to(device, torch.bfloat16) for i in range(4)]
            step = capture(lambda x: par(x)[0], xs[0])

            def replays_equal_eager(x):
                before = len(exchanges)
                replayed = step(x).clone()
                assert len(exchanges) == before, "a replay ran the agreement"
                with torch.no_grad():
                    eager = without_device_sync(lambda: par(x)[0])
                assert len(exchanges) == before + 1, "an eager call skipped the agreement"
                assert torch.equal(replayed, eager), (replayed - eager).abs().max()

            replays_equal_eager(xs[1])
            changed = randn(3 if dist.get_rank() == 0 else batch, seq, full.hidden_size, seed=150).to(
                device, torch.bfloat16)
            with torch.no_grad():
                expect_disagreement(lambda: par(changed), 0, 3 * seq, batch * seq)
            replays_equal_eager(xs[2])
            replays_equal_eager(xs[3])
        finally:
            parallel_state.start_agreement = original
    return run


# ----------------------------------------------------------------------------------------------------------
# bad configurations: every rank fails, with the same clear message


def expect_error(kind: type, *fragments: str, call: Callable[[], object]) -> None:
    try:
        call()
    except kind as e:
        text = str(e)
        missing = [f for f in fragments if f not in text]
        assert not missing, f"message lacks {missing}: {text}"
        return
    raise AssertionError(f"expected {kind.__name__}")


def disagreeing_sizes() -> None:
    rank = dist.get_rank()
    expect_error(ValueError, "tensor_model_parallel_size", "rank 0=1", "rank 1=2",
                 call=lambda: init(1 + (rank == 1), 1))
    assert not parallel_state.model_parallel_is_initialized()


def not_dividing_world() -> None:
    expect_error(ValueError, "tensor_model_parallel_size (3) must divide the world size", call=lambda: init(3, 1))


def experts_not_dividing() -> None:
    init(1, dist.get_world_size())
    expect_error(ValueError, "must divide num_experts (3)",
                 call=lambda: ExpertMLPsV2(make_config(num_experts=3, top_k=1)))


def modules_disagree() -> None:
    init(1, dist.get_world_size())
    expect_error(ValueError, "ExpertMLPsV2 arguments differ", "top_k",
                 call=lambda: ExpertMLPsV2(make_config(num_experts=4, top_k=1 + (dist.get_rank() == 0))))


def intermediate_not_dividing() -> None:
    init(dist.get_world_size(), 1)
    expect_error(ValueError, "intermediate_size (7) must be divisible",
                 call=lambda: ExpertMLPsV2(make_config(num_experts=4, intermediate_size=7)))


def distribution_missing_expert() -> None:
    init(1, 2)
    expect_error(ValueError, "must place every expert", "missing [3]",
                 call=lambda: ExpertMLPsV2(make_config(num_experts=4),
                                           expert_parallel_config=ExpertParallelConfig(
                                               expert_distribution=((0, 1), (1, 2)))))


def shapes_disagree() -> None:
    """Ranks that pass different token counts, or different dtypes, fail together (a named error on every rank,
    within seconds) instead of exchanging mismatched buffers."""
    init(1, dist.get_world_size())
    full = full_experts(make_config(num_experts=4), seed=9)
    experts = parallel_experts(full, "all_to_all_v")
    tokens = 4 + 2 * dist.get_rank()
    affinities, index = random_routing(tokens, 4, 2, seed=90)
    expect_error(ValueError, "MoE inputs differ across ranks", "hidden_states", "rank 1='((6, 16)",
                 call=lambda: experts(randn(tokens, 16, seed=91), affinities, index))
    affinities, index = random_routing(4, 4, 2, seed=92)
    x = randn(4, 16, seed=93)
    if dist.get_rank() == 1:  # a rank whose layer and inputs were cast after construction
        experts.experts.double()
        x, affinities = x.double(), affinities.double()
    expect_error(ValueError, "MoE inputs differ across ranks", "torch.float64",
                 call=lambda: experts(x, affinities, index))


# A rank's inputs disagree with the others' after they had agreed: the check must name it on every rank well
# within this (the check group's and the MoE groups' timeout), not only on the rank whose shape is new to it.
AGREEMENT_TIMEOUT_S = 20.0
PROMPT_S = AGREEMENT_TIMEOUT_S / 4


def expect_disagreement(call: Callable[[], object], changer: int, tokens: int, usual_tokens: int) -> None:
    """``call()`` raises the named error on this rank, naming both ranks' token counts, within ``PROMPT_S``."""
    others = [r for r in range(dist.get_world_size()) if r != changer]
    start = time.perf_counter()
    expect_error(ValueError, "MoE inputs differ across ranks", f"rank {changer}='(({tokens}, ",
                 f"rank {others[0]}='(({usual_tokens}, ", call=call)
    elapsed = time.perf_counter() - start
    assert elapsed < PROMPT_S, f"the named error took {elapsed:.1f} s (timeouts {AGREEMENT_TIMEOUT_S:g} s)"


def one_rank_changes_shape(changer: int | None, dispatch: str) -> Callable[[], None]:
    """EP over the world, the ranks having agreed on two batch sizes; then rank ``changer`` alone passes another
    one -- first a size the ranks agreed on before, then one no rank has seen -- while the others keep theirs: every
    rank raises the named error within seconds, whichever rank changed (the unchanged ranks too, which used to skip
    the check and die in a mismatched collective), and the layer still computes the single-device result after it
    (no collective ran with mismatched buffers). ``changer=None``: every rank changes to the new size together,
    which just works."""
    def run():
        init(1, dist.get_world_size(), timeout_s=AGREEMENT_TIMEOUT_S, collective_timeout_s=AGREEMENT_TIMEOUT_S)
        full, par = pair(variant="qwen", dispatch=dispatch)
        seq = 4
        check_moe(full, par, 2, seq, seed=120)
        check_moe(full, par, 3, seq, seed=121)
        if changer is None:
            check_moe(full, par, 5, seq, seed=122)
            return
        me = dist.get_rank()
        for batch in (3, 5):
            x = randn(batch if me == changer else 2, seq, full.hidden_size, seed=123)
            with torch.no_grad():  # called as check_moe calls it: only the shape differs from agreed calls
                expect_disagreement(lambda x=x: par(x, return_stats=True), changer, batch * seq, 2 * seq)
        check_moe(full, par, 2, seq, seed=124)
    return run


def caches_follow_shape_and_dtype(dispatch: str) -> Callable[[], None]:
    """What an eager step keeps between calls (the agreement's digest, token layouts, the exchange's index tables,
    the shard's activation) is keyed by everything it depends on: decode batches, a prefill and back, then the same
    shapes in float64 (checked to float64's rounding: a float32 table or accumulator anywhere would miss it by
    orders of magnitude), each against the single-device layer; then rank 1 alone returns to a batch every cache
    holds, and every rank still raises the named error, and the layer still computes after it."""
    def run():
        init(1, dist.get_world_size(), timeout_s=AGREEMENT_TIMEOUT_S, collective_timeout_s=AGREEMENT_TIMEOUT_S)
        full, par = pair(variant="qwen", dispatch=dispatch)
        for batch, seq in ((2, 1), (3, 1), (2, 4), (2, 1), (3, 1)):
            check_moe(full, par, batch, seq, seed=160 + 10 * batch + seq)
        full.double()
        par.double()
        for batch, seq in ((2, 1), (3, 1), (2, 4)):
            # float64 rounding of sums of ~H * k terms of size ~1: 1e-12 leaves four orders of magnitude to spare,
            # float32's 1e-7 would fail it.
            check_moe(full, par, batch, seq, seed=180 + 10 * batch + seq, dtype=torch.float64, atol=1e-12)
        with torch.no_grad():  # the negative control of that bound: inputs rounded to float32 exceed it
            x = randn(4, 1, full.hidden_size, seed=189, dtype=torch.float64)
            assert (full(x)[0] - full(x.float().double())[0]).abs().max() > 1e-9
        x = randn(3 if dist.get_rank() == 1 else 2, 1, full.hidden_size, seed=190).double()
        with torch.no_grad():
            expect_disagreement(lambda: par(x, return_stats=True), 1, 3, 2)
        check_moe(full, par, 2, 1, seed=191, dtype=torch.float64, atol=1e-12)
    return run


def rank_never_arrives() -> None:
    """The last scenario of a suite: rank 1 skips initialisation; the others must fail within the timeout."""
    if dist.get_rank() == 1:
        return
    expect_error(RuntimeError, "not every rank arrived within 3 s", call=lambda: init(1, 1, timeout_s=3))


def hf_checkpoint() -> None:
    """A transformers DeepSeek-V3 checkpoint loads into the parallel layer (each rank its shard) and the layer
    computes what the transformers block computes."""
    from hf_helpers import LAYERS, randomize_hf_
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from nxd_moe.build import build_moe
    from nxd_moe.hf import from_hf_config, load_hf_layer

    init(dist.get_world_size(), 1)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, intermediate_size=48, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **LAYERS))
    randomize_hf_(model, seed=7)
    config = model.config
    block = model.model.layers[1].mlp.eval()
    moe = load_hf_layer(build_moe(from_hf_config(config), block_size=4), model.state_dict(), config, 1)
    assert moe.expert_mlps.is_sharded and moe.shared_experts.intermediate_shard is not None
    x = randn(1, 6, 32, seed=70)
    with torch.no_grad():
        expected = block(x)
        out = moe(x)[0]
    assert expected.abs().mean() > 0.02
    assert_close(out, expected, FP32_ATOL)


# ----------------------------------------------------------------------------------------------------------
# whole transformers models: data-parallel attention, expert-parallel MoE (nxd_moe.hf.patch_model)


def _tiny_model(name: str, seed: int = 0, **sizes):
    from hf_helpers import MODELS, randomize_hf_

    return randomize_hf_(MODELS[name].make(**sizes), seed=seed)


def _prompts(world: int) -> torch.Tensor:
    """Every rank's prompts, two each: the same on every rank, each rank takes its rows."""
    return torch.randint(0, 64, (2 * world, 7), generator=torch.Generator().manual_seed(11))


def _greedy(model, prompts: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def patched_generate(name: str, quantization: str | None = None, device: str = "cpu", **sizes) -> Callable[[], None]:
    """Each rank generates its own two sequences with its half of the experts; rank 0 asks for fewer tokens, so it
    finishes first and keeps stepping (``synced_gpus=True``) while rank 1 finishes. The tokens equal one process
    running every rank's sequences: the unpatched transformers model, or (quantized) the model patched whole.
    ``device="cuda"`` (an NCCL world): fp32 on this rank's GPU, the patched layers on the triton backend."""
    def run():
        import copy

        from nxd_moe.hf import patch_model

        init(1, dist.get_world_size())
        rank, world = dist.get_rank(), dist.get_world_size()
        target = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        model = _tiny_model(name, **sizes).to(target)
        prompts, mine = _prompts(world).to(target), slice(2 * rank, 2 * rank + 2)
        single = model if quantization is None else patch_model(copy.deepcopy(model), quantization=quantization,
                                                                model_parallel=False)
        expected = _greedy(single, prompts, 12)
        parallel = patch_model(copy.deepcopy(model), quantization=quantization)
        moe = parallel.get_submodule(parallel.nxd_moe_patched.patched[0]).moe
        assert moe.expert_mlps.is_sharded and moe.expert_parallel is not None
        num_experts = moe.router.num_experts
        assert len(moe.expert_mlps.weight_shard(False).experts) == num_experts // world
        new_tokens = 5 if rank == 0 else 12
        out = _greedy(parallel, prompts[mine], new_tokens, synced_gpus=True)
        assert torch.equal(out, expected[mine, :7 + new_tokens]), (out, expected[mine])
        assert expected[mine, 7:].unique().numel() > 1  # a varied continuation
    return run


def application_generate(name: str) -> Callable[[], None]:
    """nxd_moe's application under expert parallelism (``moe_ep_degree`` = the world): each rank generates its own
    sequences -- rank 0 two prompts of 4 and 9 tokens ending at an EOS early, rank 1 one prompt of 7 tokens (so the
    ranks' longest prompts, batches and finishing steps differ) -- with its half of the experts, in lockstep (the
    ranks agree on the context bucket and on when every sequence is done). Tokens equal transformers' greedy
    ``generate`` of the unpatched model on the same prompts in one process."""
    def run():
        import copy

        from nxd_moe.application import ApplicationConfig, CausalLMApplication

        rank, world = dist.get_rank(), dist.get_world_size()
        model = _tiny_model(name)
        lengths = [4, 9] if rank == 0 else [7]
        width = max(lengths)
        ids = torch.zeros(len(lengths), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, n in enumerate(lengths):
            ids[b, width - n:] = torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(31 + 3 * rank + b))
            mask[b, width - n:] = 1
        free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        eos = [int(free[0, width + 2])] if rank == 0 else []  # rank 0's first sequence ends at its third token
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  eos_token_id=eos or None)
        config = ApplicationConfig(batch_size=2, seq_len=32, max_context_length=16, torch_dtype="float32",
                                   context_encoding_buckets=[8, 16], token_generation_buckets=[16, 32],
                                   tp_degree=world, moe_ep_degree=world)
        app = CausalLMApplication(copy.deepcopy(model), config)
        moe = app.model.get_submodule(app.model.nxd_moe_patched.patched[0]).moe
        assert moe.expert_mlps.is_sharded and app.group is not None
        out = app.generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, read_every=3)
        assert out.sequences.shape[0] == len(lengths)
        n = out.sequences.shape[1]
        assert torch.equal(out.sequences, expected[:, :n]), (out.sequences, expected)
        assert expected[:, n:].eq(0).all()  # transformers ran on only as long as some sequence was generating
    return run


class _GraphRecorder:
    """A Dynamo backend that keeps the functional collectives of every graph it is given and runs the graph through
    :func:`~nxd_moe.trace.static_backend` (which refuses host-sync ops and data-dependent sizes) with ``inner``."""

    def __init__(self, inner: str):
        from nxd_moe.trace import static_backend

        self.backend = static_backend(inner)
        self.collectives: list[list[str]] = []

    def __call__(self, gm, example_inputs, **mode):
        self.collectives.append([str(node.target).split(".")[1] for node in gm.graph.nodes
                                 if node.op == "call_function" and str(node.target).startswith("_c10d_functional.")
                                 and "wait" not in str(node.target)])
        return self.backend(gm, example_inputs, **mode)

    def __deepcopy__(self, memo):  # transformers' CompileConfig copies its backend; the records must stay here
        return self


def patched_generate_compiled(name: str, dispatch: str, inner: str = "aot_eager", device: str = "cpu",
                              mode: str | None = None) -> Callable[[], None]:
    """transformers' compiled recipe on an expert-parallel patched model: static cache, every decode step through
    ``torch.compile(fullgraph=True)`` (Dynamo, then ``inner``), rank 0 asking for fewer tokens and stepping on in
    lockstep. The decode step is one graph with the dispatch's collectives in it as functional collectives, no host
    sync in it, compiled once; its tokens equal eager EP's and one process running every rank's sequences. Negative
    control: rank 1's experts scaled by -10 in place (the same compiled graph runs) change rank 0's tokens -- so the
    graph does exchange the ranks' partial outputs, and the comparison can fail. ``device="cuda"``: an NCCL world, fp32,
    triton backend, ``mode`` (``"reduce-overhead"``: Inductor's CUDA graphs)."""
    def run():
        import copy

        from hf_helpers import generate_tokens
        from transformers import StaticCache

        from nxd_moe.hf import patch_model

        torch._dynamo.reset()
        init(1, dist.get_world_size())
        rank, world = dist.get_rank(), dist.get_world_size()
        target = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        model = _tiny_model(name).to(target)
        prompts, mine = _prompts(world).to(target), slice(2 * rank, 2 * rank + 2)
        longest = 12
        expected = _greedy(model, prompts, longest)[:, prompts.shape[1]:]
        parallel = patch_model(copy.deepcopy(model), expert_parallel_config=ExpertParallelConfig(dispatch=dispatch))
        new_tokens = 5 if rank == 0 else longest
        # Every rank steps until the longest generate ends (synced_gpus), so every static cache must hold that many
        # steps: generate sizes its own for this rank's tokens only.
        options = dict(synced_gpus=True, min_new_tokens=new_tokens, pad_token_id=0,
                       attention_mask=torch.ones_like(prompts[mine]))

        def generate(compiled: bool, **kwargs) -> torch.Tensor:
            cache = StaticCache(config=parallel.config, max_cache_len=prompts.shape[1] + longest)
            return generate_tokens(parallel, prompts[mine], compiled=compiled, new_tokens=new_tokens,
                                   past_key_values=cache, **options, **kwargs)

        assert torch.equal(generate(False), expected[mine, :new_tokens])
        recorder = _GraphRecorder(inner)
        tokens = generate(True, backend=recorder, mode=mode)
        assert torch.equal(tokens, expected[mine, :new_tokens]), (tokens, expected[mine])
        assert expected[mine].unique().numel() > 1  # a varied continuation
        layers = len(parallel.nxd_moe_patched.patched)
        per_layer = {"all_gather": ["all_gather_into_tensor", "reduce_scatter_tensor"],
                     "all_to_all_v": ["all_to_all_single", "all_to_all_single"]}[dispatch]
        assert len(recorder.collectives) == 1, recorder.collectives  # one decode graph, never recompiled
        assert sorted(recorder.collectives[0]) == sorted(per_layer * layers), recorder.collectives
        with torch.no_grad():
            for path in parallel.nxd_moe_patched.patched if rank == 1 else ():
                for weight in parallel.get_submodule(path).moe.expert_mlps.parameters():
                    weight.mul_(-10)
        broken = generate(True, backend=recorder, mode=mode)
        assert len(recorder.collectives) == 1, recorder.collectives
        if rank == 0:
            assert not torch.equal(broken, expected[mine, :new_tokens]), broken
    return run


def patched_checkpoint() -> None:
    """An expert-parallel patched model loads a transformers checkpoint (each rank its experts) and computes what
    the unpatched model computes on its rows; its state dict, a shard, is refused by name."""
    import copy

    from nxd_moe.hf import patch_model

    init(1, dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _tiny_model("mixtral")
    prompts, mine = _prompts(world), slice(2 * rank, 2 * rank + 2)
    parallel = patch_model(_tiny_model("mixtral", seed=5))
    with torch.no_grad():
        expected, other = model(prompts).logits[mine], parallel(prompts[mine]).logits
    assert (other - expected).abs().max() > 0.1 * float(expected.abs().max())  # other weights before loading
    parallel.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        out = parallel(prompts[mine]).logits
    assert expected.abs().mean() > 0.02
    assert_close(out, expected, 1e-4 * float(expected.abs().max()))
    expect_error(NotImplementedError, "each rank holds only its shard", call=parallel.state_dict)
    expect_error(NotImplementedError, "under tensor parallelism or hybrid sharding",
                 call=lambda: (parallel_state.destroy_model_parallel(), init(world, 1),
                               patch_model(copy.deepcopy(model), quantization="fp8")))


# ----------------------------------------------------------------------------------------------------------
# suites


def _layouts(entries) -> dict[str, Callable[[], None]]:
    out = {}
    for name, tp, ep, variant, shared, extra in entries:
        for sp in (True, False):
            for dispatch, splits in DISPATCH_WAYS:
                out[f"{name}/{'sp' if sp else 'nosp'}/{dispatch}/{splits}"] = layout(
                    tp, ep, sp, dispatch, variant, shared(sp), splits=splits, **extra)
    return out


SUITES: dict[str, dict[str, Callable[[], None]]] = {
    "world2": {
        **_layouts([
            ("tp2", 2, 1, "gptoss", lambda sp: "sp" if sp else "tp", {}),
            ("ep2", 1, 2, "qwen", lambda sp: "tp" if sp else "sp", {}),
        ]),
        "llama4/tp2/nosp/all_to_all_v": layout(2, 1, False, "all_to_all_v", "llama4", "sp", decode_batches=(1, 8)),
        "deepseek/ep2/sp/all_gather": layout(1, 2, True, "all_gather", "deepseek", "sp", decode_batches=(1, 2)),
        # The triton backend as the local expert compute (its kernels in Triton's interpreter without a GPU).
        **({"triton/ep2/nosp/all_to_all_v": layout(1, 2, False, "all_to_all_v", "qwen", "sp", backend="triton"),
            "triton/tp2/sp/all_gather": layout(2, 1, True, "all_gather", "gptoss", "tp", backend="triton")}
           if importlib.util.find_spec("triton") else {}),
        "micro_batches/ep2/nosp/qwen": micro_batched(1, 2, False, "qwen", 2),
        "micro_batches/ep2/sp/deepseek/capacity": micro_batched(1, 2, True, "deepseek", 3, capacity_factor=1.0),
        "modes/tp2": forced_modes(2, 1),
        "capacity/tp2/sp/all_gather": capacity(2, 1, True, "all_gather"),
        "modes/ep2": forced_modes(1, 2),
        "hf_checkpoint/tp2": hf_checkpoint,
        "no_sync/ep2/nosp": no_sync(1, 2, False),
        "no_sync/tp2/sp": no_sync(2, 1, True),
        **{f"quantized/{fmt}/{name}/{dispatch}": quantized(tp, ep, fmt, dispatch, sp, shared)
           for fmt, name, tp, ep, dispatch, sp, shared in (
               ("fp8_block", "ep2_sp", 1, 2, "all_to_all_v", True, "sp"),
               ("fp8_block", "tp2_nosp", 2, 1, "all_gather", False, "tp"),
               ("mxfp4", "tp2_sp", 2, 1, "all_to_all_v", True, "tp"),
               ("mxfp4", "ep2_nosp", 1, 2, "all_gather", False, "sp"),
               ("fp8", "tp2_nosp", 2, 1, "all_to_all_v", False, "sp"))},
        # The other backends compute the local shard's stored bytes too (the triton kernels in the interpreter).
        "quantized/fp8/ep2/nki_sim": quantized(1, 2, "fp8", "all_to_all_v", False, None, "nki_sim"),
        # W8A8: FP8 activations too (the torch backend as everywhere's reference).
        "quantized/w8a8_fp8_block/tp2/all_gather": quantized(2, 1, "fp8_block", "all_gather", False, None,
                                                             activations="fp8"),
        "quantized/w8a8_fp8/ep2/all_to_all_v": quantized(1, 2, "fp8", "all_to_all_v", True, None, activations="fp8"),
        **({"quantized/mxfp4/tp2/triton": quantized(2, 1, "mxfp4", "all_gather", False, "tp", "triton")}
           if importlib.util.find_spec("triton") else {}),
        "quantized/hf/gpt_oss_mxfp4/tp2": quantized_checkpoint("gpt_oss_mxfp4", 2, 1),
        "quantized/hf/deepseek_fp8/tp2": quantized_checkpoint("deepseek_fp8", 2, 1),
        "quantized/hf/deepseek_fp8/ep2": quantized_checkpoint("deepseek_fp8", 1, 2),
        "errors/quantized_split": quantized_split_refused,
        "errors/disagreeing_sizes": disagreeing_sizes,
        "errors/not_dividing_world": not_dividing_world,
        "errors/experts_not_dividing": experts_not_dividing,
        "errors/modules_disagree": modules_disagree,
        "errors/intermediate_not_dividing": intermediate_not_dividing,
        "errors/distribution_missing_expert": distribution_missing_expert,
        "errors/shapes_disagree": shapes_disagree,
        **{f"errors/shape_change/{who}/{dispatch}": one_rank_changes_shape(changer, dispatch)
           for who, changer in (("rank0", 0), ("rank1", 1), ("both", None)) for dispatch in DISPATCHES},
        **{f"caches/shape_and_dtype/{dispatch}": caches_follow_shape_and_dtype(dispatch) for dispatch in DISPATCHES},
        "errors/rank_never_arrives": rank_never_arrives,
    },
    "world4": {
        **_layouts([
            ("tp2ep2", 2, 2, "gptoss", lambda sp: "tp" if sp else "sp", {}),
            ("hybrid_prefill_ep4_decode_tp4", 2, 2, "qwen", lambda sp: "sp",
             dict(prefill=(1, 4), decode=(4, 1))),
        ]),
        "tp4/sp/all_to_all_v": layout(4, 1, True, "all_to_all_v", "gptoss", "tp"),
        "tp4/nosp/all_gather": layout(4, 1, False, "all_gather", "qwen", "sp"),
        "ep4/sp/all_gather": layout(1, 4, True, "all_gather", "mixtral", None),
        "ep4/nosp/all_to_all_v": layout(1, 4, False, "all_to_all_v", "mixtral", "tp"),
        "micro_batches/tp2ep2/sp/gptoss": micro_batched(2, 2, True, "gptoss", 3),
        "micro_batches/tp2ep2/nosp/mixtral/capacity": micro_batched(2, 2, False, "mixtral", 2, capacity_factor=1.0),
        "modes/tp2ep2": forced_modes(2, 2),
        "capacity/ep4/sp/all_gather": capacity(1, 4, True, "all_gather"),
        "capacity/tp2ep2/sp/all_to_all_v": capacity(2, 2, True, "all_to_all_v"),
        "capacity/tp2ep2/sp/all_gather": capacity(2, 2, True, "all_gather"),
        **{f"quantized/{fmt}/tp2ep2/{dispatch}": quantized(2, 2, fmt, dispatch, False, "tp")
           for fmt, dispatch in (("fp8", "all_gather"), ("mxfp4", "all_to_all_v"), ("fp8_block", "all_gather"))},
        "eplb/all_gather": eplb("all_gather"),
        "eplb/all_to_all_v": eplb("all_to_all_v"),
        "bytes_moved": bytes_moved,
        "idle_ranks": idle_ranks,
        "negative_control/all_gather": negative_control("all_gather"),
        "negative_control/all_to_all_v": negative_control("all_to_all_v"),
        "errors/disagreeing_sizes4": lambda: expect_error(ValueError, "expert_model_parallel_size", "rank 3=1",
                                                          call=lambda: init(1, 1 if dist.get_rank() == 3 else 4)),
    },
}


# patch_model's whole models (tests/models/test_patch_model_parallel.py).
SUITES["models2"] = {
    "patch_model/ep2/qwen3_moe": patched_generate("qwen3_moe"),
    "patch_model/ep2/deepseek_v3": patched_generate("deepseek_v3"),
    "patch_model/ep2/gpt_oss": patched_generate("gpt_oss"),
    "patch_model/ep2/mixtral_fp8": patched_generate("mixtral", "fp8", hidden=64, intermediate=64),
    "patch_model/ep2/checkpoint": patched_checkpoint,
    "application/ep2/qwen3_moe": application_generate("qwen3_moe"),
    "application/ep2/deepseek_v3": application_generate("deepseek_v3"),
}


# patch_model's whole models under transformers' compiled recipe (torch.compile(fullgraph=True), Dynamo's functional
# collectives): aot_eager runs the traced graph (~15 s a world), Inductor compiles it (C++ on a CPU: slow tests).
SUITES["compiled2"] = {
    "patch_model/ep2/qwen3_moe/all_gather/compiled": patched_generate_compiled("qwen3_moe", "all_gather"),
}
SUITES["compiled2_slow"] = {
    "patch_model/ep2/deepseek_v3/all_to_all_v/compiled": patched_generate_compiled("deepseek_v3", "all_to_all_v"),
    "patch_model/ep2/qwen3_moe/all_gather/inductor": patched_generate_compiled("qwen3_moe", "all_gather", "inductor"),
    # Not GPT-OSS: transformers' sliding-window static cache hands the decode graph a symbolic Python int
    # (cumulative_length_int), which static_backend refuses as a data-dependent size in the unpatched model too.
    "patch_model/ep2/mixtral/all_to_all_v/inductor": patched_generate_compiled("mixtral", "all_to_all_v", "inductor"),
}


# NCCL worlds (one GPU per rank; skipped without them): CUDA-graph capture of the parallel step.
SUITES["nccl2"] = {
    f"graph/{name}/{dispatch}/{backend}": cuda_graph_replay(tp, ep, dispatch, backend)
    for name, tp, ep in (("ep2", 1, 2), ("tp2", 2, 1))
    for dispatch in DISPATCHES
    for backend in ("torch", "triton")
}
# Whole models over NCCL: data-parallel attention, expert-parallel MoE on the triton backend, lockstep generate.
SUITES["nccl2"].update({f"patch_model/ep2/{name}": patched_generate(name, device="cuda")
                        for name in ("qwen3_moe", "gpt_oss", "deepseek_v3")})
# transformers' compiled recipe as benchmarks/hf_generate.py --modes compiled runs it: Inductor with CUDA graphs.
SUITES["nccl2"].update({f"patch_model/ep2/{name}/{dispatch}/compiled": patched_generate_compiled(
    name, dispatch, "inductor", device="cuda", mode="reduce-overhead")
    for name, dispatch in (("qwen3_moe", "all_gather"), ("qwen3_moe", "all_to_all_v"), ("deepseek_v3", "all_gather"))})
# The static all-to-all in micro-batches: NCCL exchanges on the communicator's stream beside the experts' kernels.
SUITES["nccl2"].update({f"graph/ep2/all_to_all_v/micro2/{backend}": cuda_graph_replay(1, 2, "all_to_all_v", backend, 2)
                        for backend in ("torch", "triton")})
# The static all-to-all straight over NVLink (symmetric memory), TP 2 (shared tokens) and EP 2.
SUITES["nccl2"].update({f"graph/{name}/all_to_all_v/nvlink/{backend}": cuda_graph_replay(
    tp, ep, "all_to_all_v", backend, transport="nvlink")
    for name, tp, ep in (("ep2", 1, 2), ("tp2", 2, 1)) for backend in ("torch", "triton")})
SUITES["nccl2"].update({f"graph/shape_change/ep2/{dispatch}/{backend}": graph_and_one_rank_changing_shape(
    dispatch, backend) for dispatch in DISPATCHES for backend in ("torch", "triton")})


def release_compiled_graphs() -> None:
    """Free what a compiled scenario leaves behind before its groups are destroyed: Inductor's CUDA-graph trees are
    global and keep the captured graphs -- with the NCCL kernels of the groups in them -- alive, and destroying a
    NCCL group whose kernels a live graph holds hung on two H100s (rank 0 in ``destroy_process_group``)."""
    torch._dynamo.reset()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
        gc.collect()
        torch.cuda.synchronize()


def main() -> None:
    suite, out_dir = sys.argv[1], Path(sys.argv[2])
    # The harness sends SIGUSR1 before killing a world that ran past its time: every rank's stacks reach its log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    if suite.startswith("nccl"):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results: dict[str, str] = {}
    path = out_dir / f"rank{rank}.json"
    stopped = None
    only = json.loads(os.environ["PARALLEL_SCENARIOS"]) if "PARALLEL_SCENARIOS" in os.environ else None
    for name, scenario in SUITES[suite].items():
        if only is not None and name not in only:
            continue
        if stopped:
            results[name] = f"skipped: {stopped} failed earlier"
            continue
        try:
            scenario()
            results[name] = "ok"
        except Exception:
            results[name] = "FAIL " + traceback.format_exc()
        finally:
            release_compiled_graphs()
            parallel_state.destroy_model_parallel()
        path.write_text(json.dumps(results))
        # Stop at the first failure on any rank: the ranks may no longer be in step.
        if not all(s == "ok" for s in gather_objects(results[name])):
            stopped = name
    path.write_text(json.dumps(results))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
