"""The MoE orchestrator: outputs, residual, rmsnorm, padding, shared experts, and every shipped config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    FP32_ATOL,
    assert_close,
    expert_count_dropped,
    make_config,
    make_experts,
    make_router,
    make_scaling_experts,
    make_shared,
    pad_experts_like,
    randn,
    randomize_,
)

from nxd_moe import ExpertsMode, ExpertsStats, MoE, RouterTopK, build_moe, builtin_config_names
from nxd_moe.reference import first_come_first_served, reference_for_experts, reference_for_moe


def small_moe(shared=True, rmsnorm=None, **kwargs):
    experts = make_experts(make_config(num_experts=6, top_k=2, capacity_factor=kwargs.pop("capacity_factor", None)),
                           block_size=4, seed=1)
    return MoE(make_router("topk_softmax", 6, 2, 16, seed=2), experts, make_shared(16) if shared else None,
               rmsnorm=rmsnorm, **kwargs).eval()


# ----------------------------------------------------------------------------------------------------------
# return structure and residual


@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("index", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("stats", [False, True])
def test_return_tuple_structure(logits, index, with_residual, stats):
    moe = small_moe(return_router_logits=logits, return_expert_index=index)
    x = randn(2, 5, 16, seed=3)
    residual = randn(2, 5, 16, seed=4) if with_residual else None
    result = moe(x, residual=residual, return_stats=stats)
    assert isinstance(result, tuple)
    assert len(result) == 1 + logits + index + with_residual + stats
    items = list(result)
    out = items.pop(0)
    assert out.shape == (2, 5, 16) and out.dtype == torch.float32
    h = x if residual is None else x + residual
    _, _, expected_index = moe.router(h.view(10, 16))
    if logits:
        router_logits = items.pop(0)
        assert router_logits.shape == (10, 6)
        assert_close(router_logits, h.view(10, 16).double() @ moe.router.linear_router.weight.double().t(), 1e-5)
    if index:
        expert_index = items.pop(0)
        assert expert_index.shape == (10, 2) and expert_index.dtype == torch.int64
        assert torch.equal(expert_index, expected_index)
    if with_residual:
        new_residual = items.pop(0)
        assert torch.equal(new_residual, x + residual)
    if stats:
        s = items.pop(0)
        assert isinstance(s, ExpertsStats) and s.mode is ExpertsMode.BLOCKWISE and s.num_tokens == 10
    assert not items


def test_residual_semantics():
    """output excludes the residual; it is the MoE of (hidden + residual); the new residual is hidden + residual."""
    moe = small_moe()
    x, residual = randn(2, 5, 16, seed=5), randn(2, 5, 16, seed=6)
    out, new_residual = moe(x, residual=residual)
    (expected,) = moe(x + residual)
    assert_close(out, expected, 0.0)
    assert_close(new_residual, x + residual, 0.0)
    assert_close(out, reference_for_moe(moe, x + residual), FP32_ATOL)
    # the residual is not inside the output
    assert (out - (expected + x + residual)).abs().max() > 0.1


def test_rmsnorm_is_applied_before_routing_and_experts():
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(16, seed=7, scale=0.3) + 1.0)
    moe = small_moe(rmsnorm=norm)
    x = randn(2, 5, 16, seed=8, scale=4.0)
    out, _ = moe(x, residual=torch.zeros_like(x))
    # explicit RMSNorm in float64
    x64 = x.double()
    normed = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    plain = small_moe()
    assert_close(out, plain(normed.float())[0], 1e-5)
    assert_close(out, reference_for_moe(moe, x), FP32_ATOL)
    assert (out - plain(x)[0]).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------------------
# padding mask


@pytest.mark.parametrize("shape", [(2, 7), (4, 1), (1, 12)], ids=lambda s: f"B{s[0]}xS{s[1]}")
def test_padded_tokens_contribute_nothing_and_output_zero(shape):
    moe = small_moe()
    x = randn(*shape, 16, seed=9)
    mask = torch.ones(shape, dtype=torch.bool)
    mask.view(-1)[1::3] = False
    out, stats = moe(x, padding_mask=mask, return_stats=True)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    assert_close(out, reference_for_moe(moe, x, padding_mask=mask), FP32_ATOL)
    # the real tokens' outputs do not depend on what the padded ones hold
    garbage = x.clone()
    garbage[~mask] = 1e4
    out2 = moe(garbage, padding_mask=mask)[0]
    assert_close(out2, out, FP32_ATOL)
    # padded tokens take no block slot
    assert int(stats.tokens_per_expert.sum()) == int(mask.sum()) * 2
    if stats.mapping is not None:
        ids = stats.mapping.token_position_to_id
        padded_ids = torch.nonzero(~mask.view(-1)).view(-1)
        assert not torch.isin(ids, padded_ids).any()


def test_padded_tokens_consume_no_capacity():
    """Tokens 0-5 are padding and route to expert 0 first; with capacity 2 they would take expert 0's places."""
    experts = make_scaling_experts(4, 8, 1, capacity_factor=1.0, dtype=torch.float32)  # C = ceil(12/4) = 3
    router = RouterTopK(4, 1, 8, bias=True)
    with torch.no_grad():
        router.linear_router.weight.zero_()
        router.linear_router.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))  # everyone -> expert 0
    moe = MoE(router, experts).eval()
    x = randn(1, 12, 8, seed=10)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, :6] = False
    out, stats = moe(x, padding_mask=mask, return_stats=True)
    assert stats.mode is ExpertsMode.CAPACITY_FACTOR and stats.capacity == 3
    # real tokens 6, 7, 8 fit; 9, 10, 11 are dropped. Had padding taken capacity, all real tokens would drop.
    weight = math.exp(5.0) / (math.exp(5.0) + 3.0)  # softmax affinity of expert 0
    expected = torch.zeros(12, 8)
    expected[6:9] = weight * x[0, 6:9]  # expert 0 is the identity
    assert_close(out[0], expected, 1e-6)
    assert int(stats.dropped_tokens) == 3 == expert_count_dropped(torch.zeros(12, 1, dtype=torch.long), 4, 3,
                                                                  mask.view(-1))
    assert_close(out, reference_for_moe(moe, x, padding_mask=mask, capacity=3), 1e-6)
    # without the mask the first three (padding) tokens would be the ones kept
    unmasked = moe(x, return_stats=True)[0]
    assert_close(unmasked[0, 6:], torch.zeros(6, 8), 0.0)


@pytest.mark.parametrize("mode_shape", [(1, 1), (8, 1), (2, 3), (2, 16)], ids=lambda s: f"B{s[0]}xS{s[1]}")
def test_padding_mask_every_mode(mode_shape):
    moe = small_moe()
    x = randn(*mode_shape, 16, seed=11)
    mask = torch.ones(mode_shape, dtype=torch.bool)
    mask.view(-1)[0] = False
    out, stats = moe(x, padding_mask=mask, return_stats=True)
    assert torch.equal(out.view(-1, 16)[0], torch.zeros(16))
    assert_close(out, reference_for_moe(moe, x, padding_mask=mask), FP32_ATOL)


def test_all_tokens_padded():
    moe = small_moe()
    x = randn(2, 8, 16, seed=12)
    out = moe(x, padding_mask=torch.zeros(2, 8, dtype=torch.bool))[0]
    assert torch.equal(out, torch.zeros_like(out))


# ----------------------------------------------------------------------------------------------------------
# shared experts


def shared_formula(x, shared, gate_w, up_w, down_w, gate_vec=None, act=F.silu):
    """``down(act(gate(x)) * up(x))`` with (out, in) matrices, optionally times ``sigmoid(x . g)``; float64."""
    x = x.double()
    out = (act(x @ gate_w.double().t()) * (x @ up_w.double().t())) @ down_w.double().t()
    if gate_vec is not None:
        out = torch.sigmoid(x @ gate_vec.double().t()) * out
    return out


def _shared_matrices(shared):
    def m(proj):
        return proj.weight.detach().t() if proj.transposed else proj.weight.detach()

    if shared.fused_gate_up_projection:
        gate_w, up_w = m(shared.gate_up_proj).chunk(2, dim=0)
    else:
        gate_w, up_w = m(shared.gate_proj), m(shared.up_proj)
    return gate_w, up_w, m(shared.down_proj)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("num_shared", [1, 3])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_formula(fused, num_shared, transpose, gate):
    shared = make_shared(16, 6, num_shared, fused_gate_up_projection=fused, transpose_weights=transpose,
                         shared_expert_gate=gate)
    assert shared.intermediate_size == 6 * num_shared
    sd = shared.state_dict()
    width = 6 * num_shared
    if fused:
        assert sd["gate_up_proj.weight"].shape == ((16, 2 * width) if transpose else (2 * width, 16))
    else:
        assert sd["gate_proj.weight"].shape == ((16, width) if transpose else (width, 16))
    assert sd["down_proj.weight"].shape == ((width, 16) if transpose else (16, width))
    if gate:
        assert sd["shared_expert_gate.weight"].shape == (1, 16)
    x = randn(2, 4, 16, seed=13)
    gate_w, up_w, down_w = _shared_matrices(shared)
    expected = shared_formula(x, shared, gate_w, up_w, down_w,
                              shared.shared_expert_gate.weight if gate else None)
    assert_close(shared(x), expected, FP32_ATOL)
    # and inside the MoE: routed + shared, in both prefill and decode
    experts = make_experts(make_config(num_experts=4, top_k=2), block_size=4, seed=14)
    moe = MoE(make_router("topk_softmax", 4, 2, 16, seed=15), experts, shared).eval()
    for shape in ((2, 4), (3, 1)):
        xx = randn(*shape, 16, seed=16)
        flat = xx.view(-1, 16)
        _, affinities, expert_index = moe.router(flat)
        routed = reference_for_experts(experts, flat, affinities, expert_index)
        gate_vec = shared.shared_expert_gate.weight if gate else None
        total = routed + shared_formula(flat, shared, gate_w, up_w, down_w, gate_vec)
        out = moe(xx)[0]
        assert_close(out.view(-1, 16), total, FP32_ATOL)
        assert_close(out, reference_for_moe(moe, xx), FP32_ATOL)


def test_multiple_shared_experts_are_a_sum():
    """num_shared_experts=2 of width I equals the sum of two single shared experts (fused along I)."""
    both = make_shared(16, 5, 2)
    parts = []
    for half in (slice(0, 5), slice(5, 10)):
        one = make_shared(16, 5, 1)
        with torch.no_grad():
            one.gate_proj.weight.copy_(both.gate_proj.weight[half])
            one.up_proj.weight.copy_(both.up_proj.weight[half])
            one.down_proj.weight.copy_(both.down_proj.weight[:, half])
        parts.append(one)
    x = randn(6, 16, seed=17)
    assert_close(both(x), parts[0](x) + parts[1](x), 1e-6)


def test_shared_experts_hidden_act():
    shared = make_shared(16, 8, 1, hidden_act="gelu")
    x = randn(5, 16, seed=18)
    gate_w, up_w, down_w = _shared_matrices(shared)
    assert_close(shared(x), shared_formula(x, shared, gate_w, up_w, down_w, act=F.gelu), FP32_ATOL)


# ----------------------------------------------------------------------------------------------------------
# every shipped config


CONFIGS = builtin_config_names()


def test_every_config_is_listed():
    assert set(CONFIGS) >= {"dbrx", "deepseek-v3", "gpt-oss-120b", "gpt-oss-20b", "llama4-maverick", "llama4-scout",
                            "mixtral-8x7b", "qwen3-235b-a22b", "qwen3-30b-a3b"}


@pytest.fixture(scope="module")
def built_moes():
    return {}


def _built(name, cache):
    if name not in cache:
        moe = build_moe(name, scale=16, seed=0, block_size=32)
        randomize_(moe, seed=1)
        cache[name] = moe
    return cache[name]


@pytest.mark.parametrize("name", CONFIGS)
def test_build_moe_prefill_and_decode_match_reference(name, built_moes):
    moe = _built(name, built_moes)
    hidden = moe.hidden_size
    modes = set()
    # prefill: 2 x 24 tokens, blockwise (or selective for top-1 over many experts); decode: a batch of 4
    for shape, seed in (((2, 24), 20), ((4, 1), 21)):
        x = randn(*shape, hidden, seed=seed)
        mask = torch.ones(shape, dtype=torch.bool)
        mask[-1, -1] = False
        out, stats = moe(x, padding_mask=mask, return_stats=True)
        modes.add(stats.mode)
        ref = reference_for_moe(moe, x, padding_mask=mask)
        scale = max(1.0, ref.abs().max().item())
        assert_close(out, ref, 3 * FP32_ATOL * scale, msg=f"{name} {stats.mode.value}")
        assert ref.abs().max() > 0.05
    assert any(m in (ExpertsMode.SELECTIVE_LOADING, ExpertsMode.ALL_EXPERTS) for m in modes)


def test_build_moe_prefill_hits_blockwise_for_most_configs(built_moes):
    blockwise = []
    for name in CONFIGS:
        moe = _built(name, built_moes)
        *_, stats = moe(randn(2, 24, moe.hidden_size, seed=22), return_stats=True)
        if stats.mode is ExpertsMode.BLOCKWISE:
            blockwise.append(name)
    assert len(blockwise) >= len(CONFIGS) - 2, blockwise  # llama4-maverick (top-1 of 128) routes selectively


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_build_moe_capacity_factor_override(name):
    moe = build_moe(name, scale=16, seed=0, capacity_factor=0.5)
    randomize_(moe, seed=2)
    x = randn(2, 16, moe.hidden_size, seed=23)
    out, stats = moe(x, return_stats=True)
    assert stats.mode is ExpertsMode.CAPACITY_FACTOR
    e, k = moe.router.num_experts, moe.router.top_k
    assert stats.capacity == min(math.ceil(32 * k * 0.5 / e), 32)
    _, _, expert_index = moe.router(x.view(32, -1))
    assert int(stats.dropped_tokens) == expert_count_dropped(expert_index, e, stats.capacity)
    assert_close(out, reference_for_moe(moe, x, capacity=stats.capacity), 3 * FP32_ATOL)
    keep = first_come_first_served(expert_index, e, stats.capacity)
    assert int((~keep).sum()) == int(stats.dropped_tokens)


def test_moe_with_padded_experts_equals_unpadded():
    """Router and shared experts at the true width H=12; routed experts stored at H=16, I=8 (zero-padded)."""
    small = make_experts(make_config(num_experts=4, top_k=2, hidden_size=12, intermediate_size=6, bias=True),
                         block_size=4, seed=31)
    big = pad_experts_like(small, hidden=16, inter=8, block_size=4)
    router = make_router("topk_softmax", 4, 2, 12, seed=32)
    shared = make_shared(12, 4, seed=33)
    moe_small = MoE(router, small, shared).eval()
    moe_big = MoE(router, big, shared).eval()
    for shape in ((2, 6), (3, 1)):
        x = randn(*shape, 12, seed=34)
        out = moe_big(x)[0]
        assert out.shape == x.shape
        assert_close(out, moe_small(x)[0], FP32_ATOL)
        assert_close(out, reference_for_moe(moe_big, x), FP32_ATOL)


def test_stats_summary_with_every_token_padded():
    moe = small_moe()
    *_, stats = moe(randn(2, 8, 16, seed=35), padding_mask=torch.zeros(2, 8), return_stats=True)
    summary = stats.summary()
    assert summary["assignments"] == 0 and summary["active_blocks"] == 0 and summary["dropped_tokens"] == 0
    assert summary["padding_overhead_algorithmic"] is None and summary["padding_overhead_provisioned"] is None
