"""The one-launch decode (``triton_kernels/persistent_decode.py``) against the float64 reference, the torch backend
and the multi-kernel triton path.

Two entry points: the backend seam's selective loading (routing given) and ``TritonBackend.fused_decode``, which
``MoE`` calls for decode with the router and shared experts fused in. Under Triton's interpreter (CI) one program
takes every work item in order; on a GPU the same tests run the real concurrent schedule, plus CUDA-graph replays.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TF32X3_ROUNDINGS,
    TORCH_ROUNDINGS,
    TRITON_ROUNDINGS,
    assert_nan_stays_in_its_row,
    assert_rounding_close,
    capture_cuda_graph,
    make_config,
    randn,
    random_routing,
    randomize_,
    rounding_tolerance,
)

from nxd_moe import ExpertMLPsV2, GroupLimitedRouter, MoE, RouterTopK, SharedExperts
from nxd_moe.reference import reference_for_experts, reference_for_moe

triton = pytest.importorskip("triton")
from nxd_moe.triton_kernels import persistent_decode  # noqa: E402
from nxd_moe.triton_kernels.backend import TritonBackend  # noqa: E402
from nxd_moe.triton_kernels.launch_configs import decode_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The longest sum here: H <= 1024 terms. Tolerances: conftest.rounding_tolerance.
DEPTH = 1024


def _tolerance(dtype, triton_roundings=TRITON_ROUNDINGS, torch_roundings=0):
    return rounding_tolerance(dtype, DEPTH, triton_roundings=triton_roundings, torch_roundings=torch_roundings)


def _check(out, ref64, dtype, what=""):
    assert out.dtype == dtype, what
    assert_rounding_close(out, ref64, _tolerance(dtype), what)
    assert not persistent_decode.timed_out(out.device), what


def _check_logits(logits, theirs, hidden):
    """The fused router's fp32 logits (tf32x3 on a GPU) against the torch router's (fp32, H-term sums)."""
    tolerance = rounding_tolerance(torch.float32, hidden, triton_roundings=2 + TF32X3_ROUNDINGS)
    assert_rounding_close(logits, theirs, tolerance, "logits")


def _experts(config, one_launch=True, dtype=torch.float32, seed=0):
    return randomize_(ExpertMLPsV2(config, backend=TritonBackend(one_launch=one_launch), dtype=dtype,
                                   device=DEVICE), seed=seed)


@pytest.mark.parametrize("shape", [(1, 8, 2, 40, 24), (7, 16, 4, 24, 40), (33, 8, 2, 40, 24)])
@pytest.mark.parametrize("activation", ["swiglu_gptoss", "mlp_relu"])
def test_seam_matches_reference_and_multi_kernel_path(shape, activation):
    """Odd sizes, biases, GPT-OSS's clamped SwiGLU and a non-GLU MLP; the one-launch result equals the float64
    reference and (to rounding) the separate kernels'."""
    num_tokens, num_experts, top_k, hidden, inter = shape
    config = make_config(num_experts, hidden, inter, top_k, activation, bias=True, normalize_top_k_affinities=True)
    tested = _experts(config)
    separate = _experts(config, one_launch=False)
    x = randn(num_tokens, hidden, seed=1).to(DEVICE)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=2))
    with torch.no_grad():
        out = tested(x, affinities, index, seq_len=1)
        _check(out, reference_for_experts(tested, x, affinities, index), torch.float32, str(shape))
        assert_rounding_close(out, separate(x, affinities, index, seq_len=1), _tolerance(torch.float32,
                                                                                        2 * TRITON_ROUNDINGS))


def test_seam_slice_with_gate_up_bias_and_no_down_bias():
    """A tensor-parallel rank's slice of the intermediate dimension other than the first: gate/up biases, no down
    bias (added once, on the first slice), padded columns -- the one-launch path against the torch backend."""
    import dataclasses

    from nxd_moe.experts.backends import TorchBackend
    from nxd_moe.experts.mlp import ExpertWeights

    config = make_config(8, 16, 4, 2, "swiglu_gptoss", bias=True)
    weights = _experts(config).expert_weights()
    x = randn(3, 16, seed=4).to(DEVICE)
    affinities, index = (t.to(DEVICE) for t in random_routing(3, 8, 2, seed=5))
    routing = TritonBackend().build_routing(affinities, index, 8, False, False)
    for actual in (None, 2):
        activation = dataclasses.replace(weights.activation, intermediate_size_actual=actual)
        sliced = ExpertWeights(weights.gate_up_proj, weights.down_proj, weights.gate_up_bias, None, activation)
        with torch.no_grad():
            expected = TorchBackend().selective_loading(x, routing, sliced)
            assert_rounding_close(TritonBackend().selective_loading(x, routing, sliced), expected,
                                  _tolerance(torch.float32, torch_roundings=TORCH_ROUNDINGS), f"actual={actual}")


@pytest.mark.parametrize("case", ["all_to_one", "empty_experts", "padding_rows", "prescale"])
def test_seam_adversarial_routings(case):
    """All tokens on one expert (several tiles of it), most experts empty, an expert-parallel rank's mostly padding
    rows (no tiles for them, exact zeros out, the addend kept), Llama 4's pre-scaled inputs."""
    num_tokens, num_experts, top_k, hidden, inter = 40, 8, 2, 24, 16
    config = make_config(num_experts, hidden, inter, top_k, "glu_silu", bias=True,
                         early_expert_affinity_modulation=case == "prescale")
    tested = _experts(config)
    x = randn(num_tokens, hidden, seed=3).to(DEVICE)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=4))
    padding = None
    if case == "all_to_one":
        index = torch.stack([torch.full((num_tokens,), 5), torch.full((num_tokens,), 2)], 1).to(DEVICE)
    elif case == "empty_experts":
        index = index % 3
        index[:, 1] = torch.where(index[:, 0] == index[:, 1], (index[:, 1] + 1) % 3, index[:, 1])
    elif case == "padding_rows":
        padding = torch.zeros(num_tokens, dtype=torch.bool, device=DEVICE)
        padding[[3, 17, 30]] = True
    addend = randn(num_tokens, hidden, seed=5).to(DEVICE)
    with torch.no_grad():
        out = tested(x, affinities, index, seq_len=1, padding_mask=padding, addend=addend)
    keep = None if padding is None else padding.cpu().unsqueeze(1).expand(-1, top_k)
    ref = reference_for_experts(tested, x, affinities, index, keep=keep) + addend.double().cpu()
    _check(out, ref, torch.float32, case)
    if padding is not None:
        assert torch.equal(out[~padding], addend[~padding])


def test_seam_nan_token_stays_isolated():
    config = make_config(8, 32, 16, 2, "glu_silu")
    tested = _experts(config)
    x = randn(12, 32, seed=6).to(DEVICE)
    affinities, index = (t.to(DEVICE) for t in random_routing(12, 8, 2, seed=7))
    assert_nan_stays_in_its_row(lambda tokens: tested(tokens, affinities, index, seq_len=1), x, 4)


def _moe(router, shared=None, *, num_experts=8, top_k=2, hidden=32, inter=24, dtype=torch.float32, seed=11,
         **config):
    cfg = make_config(num_experts, hidden, inter, top_k, "glu_silu", **config)
    experts = ExpertMLPsV2(cfg, backend="triton", dtype=dtype, device=DEVICE)
    moe = MoE(router, experts, shared, return_router_logits=True, return_expert_index=True)
    return randomize_(moe.to(DEVICE), seed=seed).eval()


ROUTERS = {
    "softmax": dict(act_fn="softmax", normalize_top_k_affinities=True),
    "sigmoid_prescale": dict(act_fn="sigmoid", early_expert_affinity_modulation=True),
    "softmax_over_topk": dict(act_fn="softmax", apply_act_fn_over_topk=True),
    "biased": dict(act_fn="softmax", bias=True),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("shared", [None, "separate", "fused_transposed"])
def test_moe_decode_in_one_launch(router, shared):
    """Router, routing, experts, shared expert and combine fused: the layer's output against the float64
    reference, its router logits and expert choice against the router module's own."""
    options = dict(ROUTERS[router])
    router_keys = {k: options.pop(k) for k in ("act_fn", "apply_act_fn_over_topk", "bias") if k in options}
    num_experts, top_k, hidden = 8, 2, 32
    shared_experts = None if shared is None else SharedExperts(
        hidden, 20, 1, "silu", fused_gate_up_projection=shared == "fused_transposed",
        transpose_weights=shared == "fused_transposed")
    moe = _moe(RouterTopK(num_experts, top_k, hidden, **router_keys), shared_experts, **options)
    calls = []
    original = moe.expert_mlps.backend.fused_decode
    moe.expert_mlps.backend.fused_decode = lambda *a: calls.append(original(*a)) or calls[-1]
    x = randn(9, 1, hidden, seed=12).to(DEVICE)
    padding = torch.ones(9, 1, dtype=torch.bool, device=DEVICE)
    padding[[2, 8]] = False
    with torch.no_grad():
        out, logits, index = moe(x, padding)
        theirs_logits, _, theirs_index = moe.router(x.reshape(-1, hidden))
    assert calls and calls[0] is not None  # the one-launch form ran
    _check_logits(logits, theirs_logits, hidden)
    assert torch.equal(index, theirs_index)
    _check(out, reference_for_moe(moe, x, padding), torch.float32, f"{router} {shared}")
    assert (out[~padding] == 0).all()


def test_moe_decode_routes_in_several_items():
    """More tokens than one routing item takes (1024 / E of them): every chunk's routing, logits and output are
    the router module's and the reference's."""
    num_experts, top_k, hidden = 64, 4, 48
    moe = _moe(RouterTopK(num_experts, top_k, hidden), SharedExperts(hidden, 16, 1, "silu"), num_experts=num_experts,
               top_k=top_k, hidden=hidden, inter=16, normalize_top_k_affinities=True)
    x = randn(40, 1, hidden, seed=15).to(DEVICE)  # 40 tokens, 16 per routing item
    with torch.no_grad():
        out, logits, index = moe(x)
        theirs_logits, _, theirs_index = moe.router(x.reshape(-1, hidden))
    _check_logits(logits, theirs_logits, hidden)
    assert torch.equal(index, theirs_index)
    _check(out, reference_for_moe(moe, x), torch.float32, "40 tokens")


def test_moe_decode_falls_back_where_it_has_no_fused_form():
    """A group-limited router (DeepSeek-V3), prefill, stats: the layer runs its modules as before."""
    moe = _moe(GroupLimitedRouter(8, 2, 32, n_group=4, topk_group=2), normalize_top_k_affinities=True)
    backend = moe.expert_mlps.backend
    x = randn(5, 1, 32, seed=13).to(DEVICE)
    assert backend.fused_decode(x.reshape(5, 32), *moe._decode_parts(x.reshape(5, 32), None)) is None
    with torch.no_grad():
        _check(moe(x)[0], reference_for_moe(moe, x), torch.float32, "group-limited")
        stats = moe(x, return_stats=True)[-1]
    assert stats.mode.value == "selective_loading"


def test_counters_are_left_at_zero():
    """Every launch resets its counters, so the next launch (or graph replay) starts clean."""
    moe = _moe(RouterTopK(8, 2, 32), SharedExperts(32, 16, 1, "silu"))
    with torch.no_grad():
        moe(randn(3, 1, 32, seed=14).to(DEVICE))
    assert int(persistent_decode.counters(torch.device(DEVICE)).abs().sum()) == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_launches_on_two_streams_may_overlap():
    """Two streams decode the same shape at once -- e.g. a CUDA-graph warm-up on a side stream while the default
    stream's eager call is still queued behind other work: each stream has its own counters and scratch, so both
    results are exact (one shared set lets one launch reset or overwrite the other's tiles mid-flight)."""
    config = make_config(64, 1024, 512, 8, "glu_silu", normalize_top_k_affinities=True)
    experts = _experts(config, dtype=torch.bfloat16)
    xs = [randn(16, 1024, seed=20 + i).to(DEVICE, torch.bfloat16) for i in range(2)]
    routings = [tuple(t.to(DEVICE) for t in random_routing(16, 64, 8, seed=30 + i)) for i in range(2)]
    side = torch.cuda.Stream()
    with torch.no_grad():
        experts(xs[0], *routings[0], seq_len=1)  # compiled and planned on the default stream
        with torch.cuda.stream(side):
            experts(xs[1], *routings[1], seq_len=1)
        torch.cuda.synchronize()
        default_counters = persistent_decode.counters(torch.device(DEVICE))
        with torch.cuda.stream(side):
            assert persistent_decode.counters(torch.device(DEVICE)) is not default_counters
        outs = [None, None]
        for _ in range(20):
            # Both launches wait for one event behind a sleep, so they become ready together and overlap.
            torch.cuda._sleep(200_000)
            ready = torch.cuda.Event()
            ready.record()
            side.wait_event(ready)
            outs[0] = experts(xs[0], *routings[0], seq_len=1)
            with torch.cuda.stream(side):
                outs[1] = experts(xs[1], *routings[1], seq_len=1)
            torch.cuda.synchronize()
            for i in range(2):
                _check(outs[i], reference_for_experts(experts, xs[i], *routings[i]), torch.bfloat16, f"stream {i}")


def test_layers_with_equal_launch_configs_share_one_plan():
    """A plan is found by what its launch configuration says, not by which dict says it: every layer (every
    application) builds its own config dicts, and keyed by identity each new layer made new plans and kept their
    scratch for ever. A second layer of the same shape adds no plan; one with another config does."""
    x = randn(3, 1, 32, seed=15).to(DEVICE)
    with torch.no_grad():
        _moe(RouterTopK(8, 2, 32), seed=1)(x)
        plans = len(persistent_decode._PLANS)
        for seed in (2, 3):
            _moe(RouterTopK(8, 2, 32), seed=seed)(x)
        assert len(persistent_decode._PLANS) == plans
        other = _moe(RouterTopK(8, 2, 32), seed=4)
        config = decode_config(8, 32, 24, 2, 3, torch.device(DEVICE), torch.float32)
        other.expert_mlps.backend.decode_configs = dict(config, num_stages=config["num_stages"] + 1)
        other(x)
    assert len(persistent_decode._PLANS) == plans + 1


def test_only_decode_sized_plans_keep_their_scratch(monkeypatch):
    """A decode loop relaunches a few small shapes, whose plans keep their scratch between launches; a prefill-sized
    launch (prompt lengths vary, each length its own plan) takes its scratch from the allocator for that call alone
    -- kept, every prompt length seen held its own (20 MiB at 256 tokens of a small model) for ever. The large
    launch's output is the small launches' algorithm all the same (float64 reference)."""
    monkeypatch.setattr(persistent_decode, "_PLANS", {})
    moe = _moe(RouterTopK(8, 2, 32), seed=5)
    small = randn(2, 1, 32, seed=16).to(DEVICE)
    large = randn(persistent_decode.KEPT_SCRATCH_TOKENS + 8, 1, 32, seed=17).to(DEVICE)
    with torch.no_grad():
        moe(small)
        out = moe(large)[0]
    plans = {plan.sizes[0]: plan for plan in persistent_decode._PLANS.values()}
    assert sorted(plans) == [2, large.shape[0]]
    assert plans[2].scratch is not None and plans[large.shape[0]].scratch is None
    _check(out, reference_for_moe(moe, large), torch.float32, "prefill-sized")
    with torch.no_grad():
        assert torch.equal(moe(large)[0], out)  # per-call scratch: the same result launch after launch


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_decode_first_launched_inside_a_capture_keeps_nothing_from_it():
    """A decode whose first launch on a stream is inside a CUDA-graph capture (its warm-up ran on another stream)
    makes its counters and scratch inside the graph, at every replay. Kept instead, they would live in the graph's
    pool -- memory that holds whatever it last held (here: -1 bytes, written and freed before the captures) -- and
    be zeroed only when the graph that first made them replays. Two graphs of one shape captured one after the
    other on the same stream, the second replayed first: both give the eager results."""
    moe = _moe(RouterTopK(64, 8, 256), num_experts=64, top_k=8, hidden=256, inter=192, dtype=torch.bfloat16)
    xs = [randn(5, 1, 256, seed=40 + i).to("cuda", torch.bfloat16) for i in range(2)]
    dirty = torch.full((1 << 28,), -1, dtype=torch.int8, device="cuda")
    del dirty
    with torch.no_grad():
        captured = [capture_cuda_graph(lambda x=x: moe(x)[0]) for x in xs]
        for (graph, out), x in reversed(list(zip(captured, xs))):
            graph.replay()
            torch.cuda.synchronize()
            assert not persistent_decode.timed_out(out.device)
            assert torch.equal(out, moe(x)[0])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("shared", [False, True])
def test_cuda_graph_replays_new_routings(shared):
    """One captured one-launch decode serves every routing, all tokens on one expert included; eager and replayed
    results agree bitwise (fixed summation order)."""
    num_experts, top_k, hidden, inter = 64, 8, 256, 192
    moe = _moe(RouterTopK(num_experts, top_k, hidden),
               SharedExperts(hidden, inter, 1, "silu", dtype=torch.bfloat16) if shared else None,
               num_experts=num_experts, top_k=top_k, hidden=hidden, inter=inter, dtype=torch.bfloat16,
               normalize_top_k_affinities=True)
    for tokens in (1, 16, 64):
        static_x = torch.randn(tokens, 1, hidden, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            graph, static_out = capture_cuda_graph(lambda x=static_x: moe(x)[0])
            weight = moe.router.linear_router.weight.data.clone()
            for seed in range(3):
                static_x.copy_(randn(tokens, 1, hidden, seed=100 + seed).to("cuda", torch.bfloat16))
                if seed == 2:  # every token to experts 5..5+k: feature 0 dominates every logit
                    static_x[..., 0] = 4.0
                    moe.router.linear_router.weight.data[:, 0] = -1.0
                    moe.router.linear_router.weight.data[5:5 + top_k, 0] = torch.arange(10.0, 10.0 + top_k)
                graph.replay()
                _check(static_out, reference_for_moe(moe, static_x), torch.bfloat16, f"T={tokens} replay {seed}")
                assert torch.equal(static_out, moe(static_x)[0])
            moe.router.linear_router.weight.data.copy_(weight)


@pytest.mark.parametrize("bias", [False, True])
def test_self_routed_items_break_ties_as_the_routing_does(bias, monkeypatch):
    """Fused items of pair tiles find their expert from the router items' logits themselves, without waiting for the
    routing item. Two experts tied exactly across the k-th place (integer-valued inputs and router weights: every
    sum is exact, whatever its order) must go to the lower expert, as the routing item's top-k (which the layer
    returns) has it: the output against the float64 reference of the returned routing. A router bias breaks no tie
    here but must be in the sums (it reorders the experts)."""
    moe = _small_moe(1, torch.float32, fused_mlp=True)
    generator = torch.Generator().manual_seed(91)
    x = torch.randint(-3, 4, (1, 1, SMALL_H), generator=generator).float()
    x[0, 0, 0] += 1 - x.sum()  # sum(x) = 1: logit e = c[e] (+ b[e]), multiples of 1/8 near each other
    c = (torch.randperm(SMALL_E, generator=generator) - SMALL_E // 2).float() / 8
    # a bias in 64ths below 1/8: every c + b stays distinct (and exact)
    b = (torch.randperm(SMALL_E, generator=generator) % 8).float() / 64 if bias else torch.zeros(SMALL_E)
    with torch.no_grad():
        if bias:
            moe.router.linear_router = torch.nn.Linear(SMALL_H, SMALL_E, bias=True).to(DEVICE)
            moe.router.linear_router.bias.copy_(b)
    order = torch.argsort(c + b, descending=True)
    kth, next_one = order[SMALL_K - 1], order[SMALL_K]
    low, high = min(kth, next_one), max(kth, next_one)
    c[high] = c[low] + b[low] - b[high]  # logits of `low` and `high` equal, still k-th and (k+1)-th
    with torch.no_grad():
        moe.router.linear_router.weight.copy_((c[:, None] * torch.ones(SMALL_E, SMALL_H)).to(DEVICE))
    x = x.to(DEVICE)
    logits = (c + b).tolist()
    assert sorted(logits, reverse=True)[SMALL_K - 2:SMALL_K + 2].count(logits[low]) == 2 == logits.count(logits[high])
    out, kinds = _fused_decode(moe, x, monkeypatch)
    index = _small_decode(moe, x)[2].view(-1).cpu()
    assert int(low) in index.tolist() and int(high) not in index.tolist()
    assert int((kinds == persistent_decode.FUSED_MLP_ITEM).sum()) == SMALL_K * 2
    _check(out, reference_for_moe(moe, x), torch.float32, "ties")


@pytest.mark.parametrize("broken", ["affinities_4_percent", "dropped_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_rejects_a_broken_one_launch_decode(broken, dtype, monkeypatch):
    """Negative control: the one-launch kernel given affinities 4 % too large (the whole output 4 % off) or one
    token's row zeroed must fail _check."""
    config = make_config(8, 32, 16, 2, "glu_silu", normalize_top_k_affinities=True)
    tested = _experts(config, dtype=dtype)
    x = randn(7, 32, seed=50).to(DEVICE, dtype)
    affinities, index = (t.to(DEVICE) for t in random_routing(7, 8, 2, seed=51))
    reference = reference_for_experts(tested, x, affinities, index)
    original = persistent_decode.selective_loading

    def broken_launch(hidden_states, routing, *args):
        if broken == "affinities_4_percent":
            routing = routing._replace(affinities=routing.affinities * 1.04)
        else:
            hidden_states = hidden_states.clone()
            hidden_states[3] = 0
        return original(hidden_states, routing, *args)
    with torch.no_grad():
        _check(tested(x, affinities, index, seq_len=1), reference, dtype, "unbroken")
        monkeypatch.setattr(persistent_decode, "selective_loading", broken_launch)
        out = tested(x, affinities, index, seq_len=1)
    with pytest.raises(AssertionError):
        _check(out, reference, dtype, broken)


# Small-T dataflow (T*k <= launch_configs.SMALL_DECODE_PAIRS): pair tiles -- tile p is pair p, so gate/up items wait
# only for the routing, never for a sort -- and a fused router split finely over H. Qwen3-30B-A3B's E=128, k=8 at
# laptop widths; the settings are forced (the rule turns pair tiles on at T=1 only).
SMALL_E, SMALL_K, SMALL_H, SMALL_I = 128, 8, 64, 32


def _small_settings(num_tokens, **overrides):
    from nxd_moe.triton_kernels.launch_configs import default_decode_config
    config = default_decode_config(SMALL_E, SMALL_H, SMALL_I, SMALL_K, num_tokens)
    # router_chunk 16: 4 partial sums per expert block (32 router items), summed by the routing items in order; 2
    # gate/up column slices, the down projection in 2 K splits of 16 -- in separate items unless a test fuses them
    return {**config, "pair_tiles": True, "router_chunk": 16, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32},
            "down": {"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2}, "fused_mlp": False, **overrides}


def _small_moe(num_tokens, dtype, **overrides):
    moe = _moe(RouterTopK(SMALL_E, SMALL_K, SMALL_H), num_experts=SMALL_E, top_k=SMALL_K, hidden=SMALL_H,
               inter=SMALL_I, dtype=dtype, normalize_top_k_affinities=True)
    moe.expert_mlps.backend = TritonBackend(decode_configs=_small_settings(num_tokens, **overrides))
    return moe


def _small_decode(moe, x):
    """The layer's fused one-launch decode (asserted to have run) -> (out, logits, index)."""
    calls = []
    original = moe.expert_mlps.backend.fused_decode
    moe.expert_mlps.backend.fused_decode = lambda *a: calls.append(original(*a)) or calls[-1]
    with torch.no_grad():
        out = moe(x)
    assert calls and calls[0] is not None
    return out


def test_small_decode_rule():
    """The rule: pair tiles at T=1 only (at T>1 two tokens on one expert would each read it); the router split
    while that reaches half the multiprocessors, else 256 columns; no down prefetch (measured slower); larger
    decodes keep the sorted tiles and today's router split."""
    from nxd_moe.triton_kernels.launch_configs import default_decode_config
    qwen3 = default_decode_config(128, 2048, 768, 8, 1, 132)
    assert qwen3["pair_tiles"] and qwen3["router_chunk"] == 128  # 8 expert blocks x 16 H chunks = 128 items
    assert "pair_tiles" not in default_decode_config(128, 2048, 768, 8, 4, 132)
    mixtral = default_decode_config(8, 4096, 14336, 2, 1, 132)
    assert mixtral["router_chunk"] == 256  # a 128 KB router: no chunk reaches 66 items
    assert not any("down_prefetch" in default_decode_config(*shape, 132)
                   for shape in ((128, 2048, 768, 8, 1), (8, 4096, 14336, 2, 1)))
    for large in ((128, 2048, 768, 8, 32), (16, 5120, 1024, 1, 64), (256, 7168, 2048, 8, 16)):
        assert not {"pair_tiles", "router_chunk", "down_prefetch", "fused_mlp"} & set(
            default_decode_config(*large, 132)), large


def test_fused_mlp_rule():
    """Fused items where they are one wave of unquantized pair tiles: Qwen3-30B-A3B T=1 (8 x 12 = 96 items); not
    Mixtral T=1 (2 x 112), not Qwen3 at T=2 (no pair tiles), not quantized, not where the GPU is smaller."""
    from nxd_moe.triton_kernels.launch_configs import default_decode_config
    qwen3 = default_decode_config(128, 2048, 768, 8, 1, 132)
    assert qwen3["fused_mlp"] and qwen3["gate_up"]["BLOCK_N"] == 64
    assert "fused_mlp" in default_decode_config(128, 2048, 768, 8, 1, 96)  # exactly one wave
    assert "fused_mlp" not in default_decode_config(128, 2048, 768, 8, 1, 95)
    assert "fused_mlp" not in default_decode_config(8, 4096, 14336, 2, 1, 132)
    assert "fused_mlp" not in default_decode_config(128, 2048, 768, 8, 2, 132)
    for quantization in ("fp8", "fp8_block", "mxfp4"):
        assert "fused_mlp" not in default_decode_config(128, 2048, 768, 8, 1, 132, quantization)
    # Llama 4 Scout T=1: 128 fused items fit, but not beside its shared expert's 128 gate/up items
    assert "fused_mlp" in default_decode_config(16, 5120, 8192, 1, 1, 132)
    assert "fused_mlp" not in default_decode_config(16, 5120, 8192, 1, 1, 132, shared_inter=8192)
    assert "fused_mlp" not in default_decode_config(128, 2048, 768, 8, 1, 132, shared_inter=4096)  # 96 + 64 > 132
    assert "fused_mlp" in default_decode_config(128, 2048, 768, 8, 1, 132, shared_inter=2048)  # 96 + 32


def test_the_backend_asks_the_rule_with_the_shared_experts_width():
    """The fused layer's launch config is looked up with its shared expert's width (a layer without one, 0)."""
    seen = []

    class Recording(TritonBackend):
        def _config(self, *args, **kwargs):
            seen.append(kwargs.get("shared_inter"))
            return super()._config(*args, **kwargs)

    for width in (None, 16):
        moe = _small_moe(1, torch.float32)
        if width:
            shared = randomize_(SharedExperts(SMALL_H, width, 1, "silu"), seed=88).to(DEVICE)
            moe = MoE(moe.router, moe.expert_mlps, shared, return_router_logits=True, return_expert_index=True).eval()
        moe.expert_mlps.backend = Recording()
        with torch.no_grad():
            moe(randn(1, 1, SMALL_H, seed=89).to(DEVICE))
    assert seen == [0, 16]


@pytest.mark.parametrize("num_tokens", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_decode_pair_tiles(num_tokens, dtype):
    """Router, routing, pair tiles and combine in one launch against the float64 reference and the torch backend
    (each with its own roundings: conftest.assert_backends_close), logits and expert choice against the router's."""
    from conftest import assert_backends_close

    from nxd_moe.experts.backends import TorchBackend

    moe = _small_moe(num_tokens, dtype)
    x = randn(num_tokens, 1, SMALL_H, seed=60 + num_tokens).to(DEVICE, dtype)
    out, logits, index = _small_decode(moe, x)
    with torch.no_grad():
        theirs_logits, _, theirs_index = moe.router(x.reshape(-1, SMALL_H))
        moe.expert_mlps.backend = TorchBackend()
        torch_out = moe(x)[0]
    _check_logits(logits, theirs_logits, SMALL_H)
    assert torch.equal(index, theirs_index)
    assert_backends_close(out, torch_out, reference_for_moe(moe, x), dtype, DEPTH, f"T={num_tokens}")
    assert not persistent_decode.timed_out(out.device)
    assert int(persistent_decode.counters(out.device).abs().sum()) == 0  # reset for the next launch / replay


def test_small_decode_ties_go_to_the_lower_expert():
    """A zero router: every logit ties, so each token takes experts 0..k-1 (the kernel's rule), each weighing 1/k."""
    moe = _small_moe(4, torch.float32)
    moe.router.linear_router.weight.data.zero_()
    x = randn(4, 1, SMALL_H, seed=70).to(DEVICE)
    out, _, index = _small_decode(moe, x)
    assert torch.equal(index.cpu(), torch.arange(SMALL_K).expand(4, -1))
    affinities = torch.zeros(4, SMALL_E, dtype=torch.float64)
    affinities[:, :SMALL_K] = 1.0 / SMALL_K
    _check(out.reshape(4, SMALL_H), reference_for_experts(moe.expert_mlps, x.reshape(4, SMALL_H), affinities,
                                                          index.cpu()),
           torch.float32, "ties")


def test_small_decode_all_tokens_on_the_same_experts_and_a_nan_token():
    """Pair tiles through the backend seam: all four tokens on the same 8 experts (each expert in four tiles), with a
    padding token; then one NaN token leaves every other token's output bitwise unchanged."""
    config = make_config(SMALL_E, SMALL_H, SMALL_I, SMALL_K, "glu_silu", normalize_top_k_affinities=True)
    experts = randomize_(ExpertMLPsV2(config, backend=TritonBackend(decode_configs=_small_settings(4)),
                                      device=DEVICE), seed=71)
    x = randn(4, SMALL_H, seed=72).to(DEVICE)
    affinities, _ = random_routing(4, SMALL_E, SMALL_K, seed=73)
    index = torch.tensor([5, 9, 17, 33, 64, 100, 120, 127]).expand(4, -1).contiguous()
    affinities, index = affinities.to(DEVICE), index.to(DEVICE)
    padding = torch.tensor([True, True, False, True], device=DEVICE)
    with torch.no_grad():
        clean = experts(x, affinities, index, seq_len=1, padding_mask=padding)
        poisoned = x.clone()
        poisoned[1] = float("nan")
        bad = experts(poisoned, affinities, index, seq_len=1, padding_mask=padding)
    keep = padding.cpu().unsqueeze(1).expand(-1, SMALL_K)
    _check(clean, reference_for_experts(experts, x, affinities, index, keep=keep), torch.float32, "same experts")
    assert (clean[2] == 0).all()
    assert torch.isnan(bad[1]).any()
    others = torch.tensor([True, False, True, True], device=DEVICE)
    assert torch.equal(bad[others], clean[others])


@pytest.mark.parametrize("broken", ["wrong_token_rows", "half_of_each_k_split"])
def test_bound_rejects_broken_pair_tiles(broken, monkeypatch):
    """Negative control: pair tiles whose rows name the next pair's token, or down items that read only the first
    half of their K split, must fail the bound the unbroken launch meets."""
    moe = _small_moe(4, torch.bfloat16)
    x = randn(4, 1, SMALL_H, seed=74).to(DEVICE, torch.bfloat16)
    reference = reference_for_moe(moe, x)
    _check(_small_decode(moe, x)[0], reference, torch.bfloat16, "unbroken")
    if broken == "wrong_token_rows":
        rows = persistent_decode.pair_row_tokens
        monkeypatch.setattr(persistent_decode, "pair_row_tokens",
                            lambda *a: torch.where((r := rows(*a)) >= 0, (r + 1) % 4, r))
    else:
        init = persistent_decode._Plan.__init__

        def halved(self, *args):
            init(self, *args)
            self.constexprs["k_per_split"] //= 2  # 8 of each split's 16
        monkeypatch.setattr(persistent_decode._Plan, "__init__", halved)
    monkeypatch.setattr(persistent_decode, "_PLANS", {})  # plans are found by config: make a new one
    moe = _small_moe(4, torch.bfloat16)  # the same weights (seeded)
    out = _small_decode(moe, x)[0]
    with pytest.raises(AssertionError):
        _check(out, reference, torch.bfloat16, broken)


# Down prefetch: items between the gate/up and the down items that ask L2 for the chosen experts' down weights (on
# a GPU; under the interpreter they read the lines' first elements). 24 of them here (40 programs, 16 gate/up items
# at T=1), each a slice of the 8 experts' 32 lines (4 KB each) -- or of the first lines up to the cap.
PREFETCH_PROGRAMS = 40


def _prefetch_decode(moe, x, monkeypatch, down_prefetch, l2=None):
    """The layer's fused decode with the down prefetch on or off -> (out, the item kinds in order of the trace)."""
    monkeypatch.setattr(persistent_decode, "launch_multiprocessors", lambda device: PREFETCH_PROGRAMS)
    monkeypatch.setattr(persistent_decode, "TRACE_PLANS", True)
    monkeypatch.setattr(persistent_decode, "_PLANS", {})  # new plans, made under the patches
    if l2 is not None:
        monkeypatch.setattr(persistent_decode, "l2_bytes", lambda device: l2)
    moe.expert_mlps.backend = TritonBackend(decode_configs={**moe.expert_mlps.backend.decode_configs,
                                                            "down_prefetch": down_prefetch})
    out = _small_decode(moe, x)[0]
    assert not persistent_decode.timed_out(out.device)
    assert int(persistent_decode.counters(out.device).abs().sum()) == 0
    kinds = persistent_decode.last_trace()[:, 3].cpu() % 16
    return out, kinds


# Prefetch items: the 40 programs less the gate/up items -- pair tiles at T=1: 8 tiles x 2 column slices; sorted
# tiles at T=2: a bound of 17 tiles x 2, and the shared expert's one.
PREFETCH_ITEMS = {"pairs_T1": 40 - 16, "pairs_T1_cap": 40 - 16, "sorted_T2_shared": 40 - 34 - 1}


@pytest.mark.parametrize("case", sorted(PREFETCH_ITEMS))
def test_down_prefetch_leaves_results_bitwise_unchanged(case, monkeypatch):
    """The prefetch only reads: with it on, the output is bitwise the output with it off, and its items run between
    the gate/up and the down items (pair tiles; a cap of 40 lines, so that most items have nothing to do; sorted
    tiles with a shared expert)."""
    num_tokens = int(case.split("_T")[1][0])
    moe = _small_moe(num_tokens, torch.bfloat16, pair_tiles=case.startswith("pairs"))
    if case.endswith("shared"):
        shared = randomize_(SharedExperts(SMALL_H, 16, 1, "silu", dtype=torch.bfloat16), seed=75).to(DEVICE)
        moe = MoE(moe.router, moe.expert_mlps, shared, return_router_logits=True, return_expert_index=True).eval()
    x = randn(num_tokens, 1, SMALL_H, seed=76).to(DEVICE, torch.bfloat16)
    off, off_kinds = _prefetch_decode(moe, x, monkeypatch, False)
    on, on_kinds = _prefetch_decode(moe, x, monkeypatch, True, l2=2 * 40 * 128 if case.endswith("cap") else None)
    _check(off, reference_for_moe(moe, x), torch.bfloat16, case)
    assert torch.equal(on, off)
    assert (off_kinds != persistent_decode.DOWN_PREFETCH).all()
    # Trace rows in item order; router items' rows and those of items not run are 0 (kind 0) and are skipped here.
    prefetch = (on_kinds == persistent_decode.DOWN_PREFETCH).nonzero().flatten()
    assert len(prefetch) == PREFETCH_ITEMS[case]
    gate_up = (on_kinds == persistent_decode.GATE_UP).nonzero().flatten()
    down = ((on_kinds == persistent_decode.DOWN) | (on_kinds == persistent_decode.SHARED_DOWN)).nonzero().flatten()
    assert gate_up.max() < prefetch.min() and prefetch.max() < down.min()


def test_down_prefetch_config_is_checked():
    moe = _small_moe(1, torch.float32, down_prefetch="yes")
    with pytest.raises(ValueError, match="down_prefetch must be a bool"):
        _small_decode(moe, randn(1, 1, SMALL_H, seed=77).to(DEVICE))


def test_down_prefetch_check_rejects_items_that_displace_down_items(monkeypatch):
    """Negative control: prefetch items not counted in the launch's item total push the last items (combine)
    out of the launch -- the bitwise comparison with the prefetch off must catch it."""
    moe = _small_moe(1, torch.bfloat16)
    x = randn(1, 1, SMALL_H, seed=78).to(DEVICE, torch.bfloat16)
    off, _ = _prefetch_decode(moe, x, monkeypatch, False)
    init = persistent_decode._Plan.__init__

    def uncounted(self, *args):
        init(self, *args)
        num_tokens, num_rows, max_items, *rest = self.sizes
        self.sizes = (num_tokens, num_rows, max_items - self.constexprs["PREFETCH_ITEMS"], *rest)
    monkeypatch.setattr(persistent_decode._Plan, "__init__", uncounted)
    on, _ = _prefetch_decode(moe, x, monkeypatch, True)
    assert not torch.equal(on, off)


# Fused items (``fused_mlp``): each routed item runs its gate/up column slice and at once that slice's share of the
# down projection over the whole of H (an fp32 partial sum per slice, summed by the combine in order) -- no down
# items, nothing between gate/up and down to wait for. Here 2 slices of 16 per tile (SMALL_I = 32).
def _fused_decode(moe, x, monkeypatch):
    """The layer's fused decode, traced -> (out, the item kinds in trace order)."""
    monkeypatch.setattr(persistent_decode, "TRACE_PLANS", True)
    monkeypatch.setattr(persistent_decode, "_PLANS", {})
    out = _small_decode(moe, x)[0]
    assert not persistent_decode.timed_out(out.device)
    assert int(persistent_decode.counters(out.device).abs().sum()) == 0
    return out, persistent_decode.last_trace()[:, 3].cpu() % 16


@pytest.mark.parametrize("case", ["pairs_T1_fp32", "pairs_T1_bf16", "pairs_T2_bf16", "sorted_T4_fp32",
                                  "sorted_T3_shared_bf16"])
def test_fused_mlp_items(case, monkeypatch):
    """Pair tiles and sorted tiles, a shared expert beside them: against the float64 reference and the torch
    backend (each with its own roundings), the expert choice against the router's; one fused item per (tile,
    column slice) and no separate gate/up or down items."""
    from conftest import assert_backends_close

    from nxd_moe.experts.backends import TorchBackend

    num_tokens = int(case.split("_T")[1][0])
    dtype = torch.float32 if case.endswith("fp32") else torch.bfloat16
    moe = _small_moe(num_tokens, dtype, pair_tiles=case.startswith("pairs"), fused_mlp=True)
    if "shared" in case:
        shared = randomize_(SharedExperts(SMALL_H, 16, 1, "silu", dtype=dtype), seed=79).to(DEVICE)
        moe = MoE(moe.router, moe.expert_mlps, shared, return_router_logits=True, return_expert_index=True).eval()
    x = randn(num_tokens, 1, SMALL_H, seed=80 + num_tokens).to(DEVICE, dtype)
    out, kinds = _fused_decode(moe, x, monkeypatch)
    with torch.no_grad():
        _, _, theirs_index = moe.router(x.reshape(-1, SMALL_H))
        index = moe(x)[2]
        moe.expert_mlps.backend = TorchBackend()
        torch_out = moe(x)[0]
    assert torch.equal(index, theirs_index)
    assert_backends_close(out, torch_out, reference_for_moe(moe, x), dtype, DEPTH, case)
    if case.startswith("pairs"):
        tiles = num_tokens * SMALL_K
    else:  # the sorted layout's tiles: one per used expert (at most 16 rows each here)
        tiles = int(torch.unique(index).numel())
    assert int((kinds == persistent_decode.FUSED_MLP_ITEM).sum()) == tiles * 2
    assert not ((kinds == persistent_decode.GATE_UP) | (kinds == persistent_decode.DOWN)).any()


@pytest.mark.parametrize("inter, block_n", [(24, 16), (72, 32)])
def test_fused_mlp_items_with_biases_through_the_seam(inter, block_n):
    """GPT-OSS's clamped SwiGLU with gate/up and down biases (the down bias once, in slice 0's partial sums), odd
    sizes (a last slice of 8 of 16 columns; H not a multiple of the down tile), through the backend seam: against
    the float64 reference and the two-phase items."""
    config = make_config(8, 40, inter, 2, "swiglu_gptoss", bias=True, normalize_top_k_affinities=True)
    settings = {"block_m": 16, "gate_up": {"BLOCK_N": block_n, "BLOCK_K": 32}, "down": {"BLOCK_N": 32,
                "BLOCK_K": 16, "SPLIT_K": 2}, "num_warps": 4, "num_stages": 2, "programs_per_sm": 1}
    fused_settings = {**settings, "fused_mlp": True}
    fused = randomize_(ExpertMLPsV2(config, backend=TritonBackend(decode_configs=fused_settings), device=DEVICE),
                       seed=81)
    two_phase = randomize_(ExpertMLPsV2(config, backend=TritonBackend(decode_configs=settings), device=DEVICE),
                           seed=81)
    x = randn(5, 40, seed=82).to(DEVICE)
    affinities, index = (t.to(DEVICE) for t in random_routing(5, 8, 2, seed=83))
    with torch.no_grad():
        out = fused(x, affinities, index, seq_len=1)
        _check(out, reference_for_experts(fused, x, affinities, index), torch.float32, "biases")
        assert_rounding_close(out, two_phase(x, affinities, index, seq_len=1),
                              _tolerance(torch.float32, 2 * TRITON_ROUNDINGS))


def test_fused_mlp_nan_token_stays_isolated():
    moe = _small_moe(4, torch.float32, fused_mlp=True)
    x = randn(4, 1, SMALL_H, seed=84).to(DEVICE)
    assert_nan_stays_in_its_row(lambda tokens: _small_decode(moe, tokens)[0], x, 2)


@pytest.mark.parametrize("broken", ["dropped_slice", "slices_of_the_next_tile"])
def test_bound_rejects_broken_fused_items(broken, monkeypatch):
    """Negative controls: a combine that sums one slice's partial sums fewer, or fused items whose tile rows name
    the next pair's token, must fail the bound the unbroken launch meets."""
    moe = _small_moe(2, torch.bfloat16, fused_mlp=True)
    x = randn(2, 1, SMALL_H, seed=85).to(DEVICE, torch.bfloat16)
    reference = reference_for_moe(moe, x)
    _check(_fused_decode(moe, x, monkeypatch)[0], reference, torch.bfloat16, "unbroken")
    if broken == "dropped_slice":
        init = persistent_decode._Plan.__init__

        def dropped(self, *args):
            init(self, *args)
            self.constexprs["split"] -= 1
        monkeypatch.setattr(persistent_decode._Plan, "__init__", dropped)
    else:
        rows = persistent_decode.pair_row_tokens
        monkeypatch.setattr(persistent_decode, "pair_row_tokens",
                            lambda *a: torch.where((r := rows(*a)) >= 0, (r + 1) % 2, r))
    out = _fused_decode(_small_moe(2, torch.bfloat16, fused_mlp=True), x, monkeypatch)[0]
    with pytest.raises(AssertionError):
        _check(out, reference, torch.bfloat16, broken)


@pytest.mark.parametrize("overrides, match", [
    (dict(fused_mlp=1), "fused_mlp must be a bool, got 1"),
    (dict(fused_mlp=True, down_prefetch=True), "down_prefetch and fused_mlp exclude each other"),
])
def test_fused_mlp_config_is_checked(overrides, match):
    moe = _small_moe(1, torch.float32, **overrides)
    with pytest.raises(ValueError, match=match):
        _small_decode(moe, randn(1, 1, SMALL_H, seed=86).to(DEVICE))


def test_fused_mlp_refuses_quantized_weights():
    from nxd_moe.quantization.quantizer import quantize_experts

    moe = _small_moe(1, torch.bfloat16, fused_mlp=True)
    quantize_experts(moe, "fp8")
    moe.expert_mlps.backend.one_launch = True  # the rule runs quantized decodes in separate kernels
    with pytest.raises(ValueError, match="fused_mlp runs unquantized weights only, got fp8"):
        _small_decode(moe, randn(1, 1, SMALL_H, seed=87).to(DEVICE, torch.bfloat16))


def test_combine_items_load_at_most_their_share_of_partial_sums(monkeypatch):
    """The combine's columns narrow as K splits grow (its partial sums are loaded at once): Qwen3-30B-A3B's T=1 with
    12 fused slices sums 128 columns per item (8 pairs x 12 x 128 = 12288 <= 16384 loads), with 24 slices 64, the
    two-phase split of 2 keeps 256."""
    from nxd_moe.experts.activation import ExpertActivation
    from nxd_moe.experts.mlp import ExpertWeights
    from nxd_moe.moe_configs import GLUType

    def combine_h(config):  # a plan's sizes follow from shapes alone: weights on the meta device
        meta = dict(device="meta", dtype=torch.bfloat16)
        weights = ExpertWeights(torch.empty(128, 2048, 1536, **meta), torch.empty(128, 768, 2048, **meta), None,
                                None, ExpertActivation("silu", True, GLUType.GLU, intermediate_size=768))
        plan = persistent_decode._Plan(torch.empty(1, 2048, **meta), weights, config, 128, 8, False, None, None,
                                       False, False)
        return plan.constexprs["COMBINE_H"], plan.constexprs["split"]

    rule = decode_config(128, 2048, 768, 8, 1, torch.device("cpu"))
    assert combine_h(rule) == (128, 12)  # fused items of 64 columns
    assert combine_h({**rule, "fused_mlp": False}) == (256, 2)
    assert combine_h({**rule, "gate_up": {"BLOCK_N": 32, "BLOCK_K": 256}}) == (64, 24)
