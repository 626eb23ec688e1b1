"""Every expert algorithm against the float64 dense reference, and the mode-selection rules.

Matrix: mode (blockwise, capacity_factor, selective_loading, all_experts) x router (top-k softmax/sigmoid/
act-over-top-k, group-limited, Sinkhorn) x activation (GLU SiLU, GPT-OSS SwiGLU, plain relu/gelu MLP). Then the
options one at a time: biases, hidden_act_bias without bias, normalisation, early affinity modulation, size
padding, both matmul implementations, float64 and bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    ACTIVATIONS,
    DROPLESS_MODES,
    FP32_ATOL,
    FP64_ATOL,
    MODES,
    ROUTER_KINDS,
    TORCH_ROUNDINGS,
    assert_close,
    assert_rounding_close,
    expert_count_dropped,
    make_config,
    make_experts,
    make_router,
    pad_experts_like,
    randn,
    random_routing,
    rounding_tolerance,
    router_top_k,
)

from nxd_moe import ExpertMLPsV2, ExpertsMode, MoE, RouterTopK, TorchBackend, select_mode
from nxd_moe.activations import ACT2FN
from nxd_moe.reference import first_come_first_served, reference_for_experts


def run_and_reference(experts: ExpertMLPsV2, x, affinities, expert_index, mode, padding_mask=None):
    """Output of ``mode`` and the float64 reference for the same routing (FCFS drops for capacity mode)."""
    out, stats = experts(x, affinities, expert_index, padding_mask=padding_mask, mode=mode, return_stats=True)
    real = None if padding_mask is None else padding_mask.bool()
    keep = torch.ones(expert_index.shape, dtype=torch.bool)
    if real is not None:
        keep &= real.unsqueeze(1)
    if mode == "capacity_factor":
        keep &= first_come_first_served(expert_index, experts.num_experts, stats.capacity, real)
    ref = reference_for_experts(experts, x, affinities, expert_index, keep=keep)
    return out, ref, stats


# ----------------------------------------------------------------------------------------------------------
# the full matrix: router -> experts, every mode and activation


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("router_kind", ROUTER_KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_mode_router_activation_matrix(mode, router_kind, activation):
    num_experts, hidden, num_tokens = 8, 16, 12
    top_k = router_top_k(router_kind, 2)
    normalize = router_kind == "topk_softmax"  # Mixtral/Qwen style; the others carry their final weights
    config = make_config(num_experts=num_experts, hidden_size=hidden, intermediate_size=8, top_k=top_k,
                         activation=activation, normalize_top_k_affinities=normalize, capacity_factor=1.0)
    experts = make_experts(config, block_size=4, matmul="gather", seed=1)
    router = make_router(router_kind, num_experts, top_k, hidden, seed=2)
    x = randn(num_tokens, hidden, seed=3)
    _, affinities, expert_index = router(x)
    out, ref, stats = run_and_reference(experts, x, affinities, expert_index, mode)
    assert stats.mode.value == mode
    assert_close(out, ref, FP32_ATOL, msg=f"{mode}/{router_kind}/{activation}")
    # outputs are O(0.1-1): a tolerance of 1e-5 is meaningful
    assert ref.abs().max() > 0.05
    if mode == "capacity_factor":
        expected = expert_count_dropped(expert_index, num_experts, stats.capacity)
        assert int(stats.dropped_tokens) == expected


# ----------------------------------------------------------------------------------------------------------
# matmul implementations and dtypes


@pytest.mark.parametrize("matmul", ["gather", "grouped_mm", "auto"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_matmul_impls_fp32(mode, activation, matmul):
    config = make_config(num_experts=6, hidden_size=16, intermediate_size=12, top_k=2, activation=activation,
                         capacity_factor=1.0, bias=True)
    experts = make_experts(config, block_size=4, matmul=matmul, seed=11)
    x = randn(14, 16, seed=12)
    affinities, expert_index = random_routing(14, 6, 2, seed=13)
    out, ref, _ = run_and_reference(experts, x, affinities, expert_index, mode)
    assert_close(out, ref, FP32_ATOL, msg=f"{mode}/{matmul}")


def test_matmul_impls_agree_with_each_other():
    config = make_config(num_experts=5, hidden_size=16, intermediate_size=8, top_k=2)
    x = randn(20, 16, seed=1)
    affinities, expert_index = random_routing(20, 5, 2, seed=2)
    outs = {}
    for impl in ("gather", "grouped_mm"):
        experts = make_experts(config, block_size=3, matmul=impl, seed=4)
        outs[impl] = [experts(x, affinities, expert_index, mode=m) for m in ("blockwise", "selective_loading")]
    for a, b in zip(outs["gather"], outs["grouped_mm"]):
        assert_close(a, b, 1e-6)


def test_grouped_mm_refuses_what_it_cannot_do():
    # float64 and unaligned rows (H=6 floats = 24 bytes) are outside grouped_mm's contract
    experts = make_experts(make_config(hidden_size=16), matmul="grouped_mm", dtype=torch.float64)
    affinities, expert_index = random_routing(8, 4, 2, seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match="grouped_mm"):
        experts(randn(8, 16, seed=1, dtype=torch.float64), affinities, expert_index, mode="blockwise")
    experts = make_experts(make_config(hidden_size=6), matmul="grouped_mm")
    with pytest.raises(ValueError, match="grouped_mm"):
        experts(randn(8, 6, seed=1), affinities.float(), expert_index, mode="selective_loading")
    # "auto" falls back to gather for both
    for dtype, hidden in ((torch.float64, 16), (torch.float32, 6)):
        experts = make_experts(make_config(hidden_size=hidden), matmul="auto", dtype=dtype)
        x = randn(8, hidden, seed=1, dtype=dtype)
        for mode in DROPLESS_MODES:
            out, ref, _ = run_and_reference(experts, x, affinities.to(dtype), expert_index, mode)
            assert_close(out, ref, FP32_ATOL)
    with pytest.raises(ValueError, match="matmul"):
        TorchBackend(matmul="cublas")


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_float64_gather_is_exact(mode, activation):
    config = make_config(num_experts=5, hidden_size=12, intermediate_size=7, top_k=3, activation=activation,
                         capacity_factor=1.2, bias=True, normalize_top_k_affinities=True)
    experts = make_experts(config, block_size=3, matmul="gather", dtype=torch.float64, seed=21)
    x = randn(11, 12, seed=22, dtype=torch.float64)
    affinities, expert_index = random_routing(11, 5, 3, seed=23, dtype=torch.float64)
    out, ref, _ = run_and_reference(experts, x, affinities, expert_index, mode)
    assert out.dtype == torch.float64
    assert_close(out, ref, FP64_ATOL, msg=mode)


@pytest.mark.parametrize("matmul", ["gather", "auto"])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_close_to_reference(mode, matmul):
    config = make_config(num_experts=4, hidden_size=32, intermediate_size=16, top_k=2, capacity_factor=1.0)
    experts = make_experts(config, block_size=4, matmul=matmul, dtype=torch.bfloat16, seed=31)
    x = randn(16, 32, seed=32, dtype=torch.bfloat16)
    affinities, expert_index = random_routing(16, 4, 2, seed=33, dtype=torch.bfloat16)
    out, ref, _ = run_and_reference(experts, x, affinities, expert_index, mode)
    assert out.dtype == torch.bfloat16
    # The torch backend's roundings to bf16 (conftest.rounding_tolerance), relative to the reference's scale.
    tolerance = rounding_tolerance(torch.bfloat16, 32, torch_roundings=TORCH_ROUNDINGS)
    assert_rounding_close(out, ref, tolerance, mode)
    # Negative control: the same output 4 % too large (a systematic error an absolute 6e-2 once let through), or
    # with one token's row lost, is rejected.
    with pytest.raises(AssertionError):
        assert_rounding_close(out.double() * 1.04, ref, tolerance, mode)
    with pytest.raises(AssertionError):
        assert_rounding_close(torch.cat([out[:3], torch.zeros_like(out[3:4]), out[4:]]), ref, tolerance, mode)


# ----------------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_expert_biases(mode, activation):
    config = make_config(activation=activation, bias=True, capacity_factor=1.0)
    experts = make_experts(config, seed=41)
    x = randn(10, 16, seed=42)
    affinities, expert_index = random_routing(10, 4, 2, seed=43)
    out, ref, _ = run_and_reference(experts, x, affinities, expert_index, mode)
    assert_close(out, ref, FP32_ATOL)
    # the biases matter: zeroing them changes the output
    with torch.no_grad():
        experts.mlp_op.down_proj.bias.zero_()
    assert (experts(x, affinities, expert_index, mode=mode) - out).abs().max() > 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_hidden_act_bias_without_expert_bias_is_applied(mode):
    """NxD folds hidden_act_bias into the up-projection bias, so with bias=False it is silently dropped.
    We apply it at run time: it must change the output, and match the hand-written formula."""
    kwargs = dict(activation="glu_silu", bias=False, capacity_factor=1.0, top_k=1)
    with_bias = make_experts(make_config(hidden_act_bias=1.0, **kwargs), seed=51)
    without = make_experts(make_config(hidden_act_bias=0.0, **kwargs), seed=51)
    x = randn(9, 16, seed=52)
    affinities, expert_index = random_routing(9, 4, 1, seed=53)
    out1, ref1, stats = run_and_reference(with_bias, x, affinities, expert_index, mode)
    out0 = without(x, affinities, expert_index, mode=mode)
    assert_close(out1, ref1, FP32_ATOL)
    assert (out1 - out0).abs().max() > 1e-2
    # hand formula for the tokens that were kept: w * down(silu(x Wg) * (x Wu + 1))
    gate_up = with_bias.mlp_op.gate_up_proj.weight.double()
    down = with_bias.mlp_op.down_proj.weight.double()
    keep = (first_come_first_served(expert_index, 4, stats.capacity) if mode == "capacity_factor"
            else torch.ones_like(expert_index, dtype=torch.bool))
    for t in range(9):
        e = int(expert_index[t, 0])
        h = x[t].double() @ gate_up[e]
        gate, up = h[:8], h[8:]
        expected = float(affinities[t, e]) * ((gate * torch.sigmoid(gate) * (up + 1.0)) @ down[e])
        if not keep[t, 0]:
            expected = torch.zeros_like(expected)
        assert_close(out1[t:t + 1], expected[None], FP32_ATOL)


def test_swiglu_clamps_are_applied_and_zero_limits_honoured():
    """Gate/up values far beyond +-7: the clamped output matches the reference and differs from unclamped."""
    clamped_cfg = make_config(activation="swiglu_gptoss")
    free_cfg = clamped_cfg.replace(gate_clamp_upper_limit=None, up_clamp_lower_limit=None, up_clamp_upper_limit=None)
    zero_cfg = clamped_cfg.replace(gate_clamp_upper_limit=0.0, up_clamp_lower_limit=0.0)
    x = randn(10, 16, seed=62, scale=6.0)  # pre-activations of order +-20
    affinities, expert_index = random_routing(10, 4, 2, seed=63)
    outs = {}
    for name, cfg in (("clamped", clamped_cfg), ("free", free_cfg), ("zero", zero_cfg)):
        experts = make_experts(cfg, seed=61)
        for mode in DROPLESS_MODES:
            out, ref, _ = run_and_reference(experts, x, affinities, expert_index, mode)
            assert_close(out, ref, 1e-4, rtol=1e-5, msg=f"{name}/{mode}")
        outs[name] = out
    assert (outs["clamped"] - outs["free"]).abs().max() > 1.0
    assert (outs["zero"] - outs["clamped"]).abs().max() > 1e-2  # a 0.0 limit is a limit, not "unset"


@pytest.mark.parametrize("mode", MODES)
def test_normalize_top_k_affinities(mode):
    cfg = make_config(num_experts=6, top_k=3, capacity_factor=1.0)
    x = randn(10, 16, seed=72)
    affinities, expert_index = random_routing(10, 6, 3, seed=73)
    plain = make_experts(cfg, seed=71)
    normed = make_experts(cfg.replace(normalize_top_k_affinities=True), seed=71)
    out, ref, stats = run_and_reference(normed, x, affinities, expert_index, mode)
    assert_close(out, ref, FP32_ATOL)
    # normalising the affinities by hand and not asking the module to must give the same thing
    chosen = torch.zeros_like(affinities).scatter(1, expert_index, affinities.gather(1, expert_index))
    by_hand = chosen / chosen.sum(dim=1, keepdim=True)
    assert_close(plain(x, by_hand, expert_index, mode=mode), out, FP32_ATOL)
    assert (plain(x, affinities, expert_index, mode=mode) - out).abs().max() > 1e-2


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_early_expert_affinity_modulation(mode, top_k):
    cfg = make_config(num_experts=6, top_k=top_k, capacity_factor=1.0)
    x = randn(10, 16, seed=82)
    affinities, expert_index = random_routing(10, 6, top_k, seed=83, act="sigmoid")
    pre = make_experts(cfg.replace(early_expert_affinity_modulation=True), seed=81)
    post = make_experts(cfg, seed=81)
    out, ref, stats = run_and_reference(pre, x, affinities, expert_index, mode)
    assert_close(out, ref, FP32_ATOL)
    assert (post(x, affinities, expert_index, mode=mode) - out).abs().max() > 1e-2
    # explicit formula for k=1: out[t] = expert_e(a * x[t])
    if top_k == 1:
        for t in range(10):
            e = int(expert_index[t, 0])
            one_hot = torch.zeros(1, 6)
            one_hot[0, e] = 1.0
            single = post(affinities[t, e] * x[t:t + 1], one_hot, expert_index[t:t + 1], mode="all_experts")
            kept = mode != "capacity_factor" or bool(
                first_come_first_served(expert_index, 6, stats.capacity)[t, 0])
            assert_close(out[t:t + 1], single if kept else torch.zeros_like(single), FP32_ATOL)


@pytest.mark.parametrize("activation", ["glu_silu", "swiglu_gptoss", "mlp_gelu"])
@pytest.mark.parametrize("mode", MODES)
def test_hidden_and_intermediate_padding(mode, activation):
    # GLU with sigmoid + hidden_act_bias makes padded intermediate columns non-zero unless they are masked
    overrides = dict(hidden_act="sigmoid") if activation == "glu_silu" else {}
    cfg = make_config(num_experts=4, hidden_size=12, intermediate_size=6, top_k=2, activation=activation,
                      bias=True, capacity_factor=1.0,
                      hidden_act_bias=1.0 if ACTIVATIONS[activation]["glu_mlp"] else 0.0, **overrides)
    small = make_experts(cfg, seed=91)
    big = pad_experts_like(small, hidden=16, inter=8, block_size=4)
    x = randn(10, 12, seed=92)
    affinities, expert_index = random_routing(10, 4, 2, seed=93)
    expected = small(x, affinities, expert_index, mode=mode)
    out_narrow = big(x, affinities, expert_index, mode=mode)
    assert out_narrow.shape == (10, 12)
    assert_close(out_narrow, expected, FP32_ATOL)
    wide = torch.nn.functional.pad(x, (0, 4))
    out_wide = big(wide, affinities, expert_index, mode=mode)
    assert out_wide.shape == (10, 16)
    assert_close(out_wide[:, :12], expected, FP32_ATOL)
    assert_close(out_wide[:, 12:], torch.zeros(10, 4), 0.0)
    _, ref, _ = run_and_reference(big, x, affinities, expert_index, mode)
    assert_close(out_narrow, ref, FP32_ATOL)


def test_intermediate_padding_columns_are_masked():
    """With garbage (non-zero) weights in the padded intermediate columns, *_actual still hides them."""
    cfg = make_config(hidden_act="sigmoid", hidden_act_bias=1.0)
    small = make_experts(cfg.replace(intermediate_size=6), seed=95)
    big = pad_experts_like(small, hidden=16, inter=8, block_size=4)
    with torch.no_grad():  # pollute the padding: gate/up columns 6,7 and 14,15 and down rows 6,7
        big.mlp_op.gate_up_proj.weight[:, :, 6:8] = 3.0
        big.mlp_op.gate_up_proj.weight[:, :, 14:16] = 3.0
        big.mlp_op.down_proj.weight[:, 6:8, :] = 3.0
    x = randn(10, 16, seed=96)
    affinities, expert_index = random_routing(10, 4, 2, seed=97)
    for mode in DROPLESS_MODES:
        assert_close(big(x, affinities, expert_index, mode=mode), small(x, affinities, expert_index, mode=mode),
                     FP32_ATOL)


# ----------------------------------------------------------------------------------------------------------
# capacity factor


@pytest.mark.parametrize("capacity_factor", [0.25, 0.3, 0.5, 0.7, 1.0, 1.5])  # 8*cf: 2, 2.4, 4, 5.6, 8, 12
def test_capacity_factor_drops_first_come_first_served(capacity_factor):
    num_tokens, num_experts, top_k = 24, 6, 2
    cfg = make_config(num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor)
    experts = make_experts(cfg, seed=101)
    x = randn(num_tokens, 16, seed=102)
    affinities, expert_index = random_routing(num_tokens, num_experts, top_k, seed=103, skew=0.8)
    out, stats = experts(x, affinities, expert_index, return_stats=True)
    assert stats.mode is ExpertsMode.CAPACITY_FACTOR  # prefill with a capacity factor
    capacity = min(math.ceil(num_tokens * top_k * capacity_factor / num_experts), num_tokens)
    assert stats.capacity == capacity
    dropped = expert_count_dropped(expert_index, num_experts, capacity)
    assert int(stats.dropped_tokens) == dropped
    assert stats.summary()["dropped_tokens"] == dropped
    if capacity_factor <= 0.5:
        assert dropped > 0
    keep = first_come_first_served(expert_index, num_experts, capacity)
    assert int((~keep).sum()) == dropped
    assert_close(out, reference_for_experts(experts, x, affinities, expert_index, keep=keep), FP32_ATOL)
    # and it is not the dropless result when something was dropped
    if dropped:
        dropless = reference_for_experts(experts, x, affinities, expert_index)
        assert (out.double() - dropless).abs().max() > 1e-3


def test_capacity_factor_at_or_above_num_experts_over_top_k_is_dropless():
    cfg = make_config(num_experts=4, top_k=2, capacity_factor=2.0)  # E/k = 2
    assert cfg.capacity_factor is None and cfg.dropless
    assert make_config(num_experts=4, top_k=2, capacity_factor=1.99).capacity_factor == 1.99
    experts = make_experts(cfg, block_size=4)
    affinities, expert_index = random_routing(12, 4, 2, seed=1)
    _, stats = experts(randn(12, 16, seed=2), affinities, expert_index, return_stats=True)
    assert stats.mode is ExpertsMode.BLOCKWISE and int(stats.dropped_tokens) == 0


def test_capacity_drops_by_token_order_not_by_affinity():
    """Expert 0 has capacity 2: tokens 0 and 1 keep it, tokens 2..5 lose it, whatever their affinities."""
    num_tokens = 6
    cfg = make_config(num_experts=3, top_k=1, capacity_factor=1.0)  # C = ceil(6*1*1/3) = 2
    experts = make_experts(cfg, matmul="gather", seed=7)
    x = randn(num_tokens, 16, seed=8)
    expert_index = torch.zeros(num_tokens, 1, dtype=torch.long)
    affinities = torch.zeros(num_tokens, 3)
    affinities[:, 0] = torch.linspace(0.1, 1.0, num_tokens)  # later tokens have higher affinity
    out, stats = experts(x, affinities, expert_index, return_stats=True)
    assert stats.capacity == 2 and int(stats.dropped_tokens) == 4
    full = experts(x, affinities, expert_index, mode="all_experts")
    assert_close(out[:2], full[:2], FP32_ATOL)
    assert_close(out[2:], torch.zeros(4, 16), 0.0)


# ----------------------------------------------------------------------------------------------------------
# mode selection


@pytest.mark.parametrize(
    "num_tokens, seq_len, top_k, num_experts, block_size, cf, alpha, expected",
    [
        # decode: all-experts once T*k >= alpha*E
        (1, 1, 2, 8, 512, None, 1.0, "selective_loading"),
        (3, 1, 2, 8, 512, None, 1.0, "selective_loading"),  # 6 < 8
        (4, 1, 2, 8, 512, None, 1.0, "all_experts"),  # 8 >= 8
        (64, 1, 8, 128, 512, None, 1.0, "all_experts"),
        (63, 1, 2, 128, 512, None, 1.0, "selective_loading"),
        (3, 1, 2, 8, 512, None, 0.75, "all_experts"),  # 6 >= 0.75*8
        (3, 1, 2, 8, 512, 1.0, 1.0, "selective_loading"),  # decode ignores the capacity factor
        (4, 1, 2, 8, 512, 1.0, 1.0, "all_experts"),
        # prefill: capacity factor first
        (2, 2, 1, 8, 512, 1.0, 1.0, "capacity_factor"),
        (4096, 4096, 2, 8, 512, 1.0, 1.0, "capacity_factor"),
        # then selective while T*k < alpha*E
        (3, 3, 2, 8, 512, None, 1.0, "selective_loading"),
        (4, 4, 2, 8, 512, None, 1.0, "all_experts"),
        (4, 4, 2, 8, 512, None, 1.5, "selective_loading"),  # 8 < 12
        (6, 6, 2, 8, 512, None, 1.5, "all_experts"),  # 12 >= 12
        # then all-experts while T*k < block_size
        (255, 255, 2, 8, 512, None, 1.0, "all_experts"),  # 510 < 512
        (256, 256, 2, 8, 512, None, 1.0, "blockwise"),  # 512 >= 512
        (1000, 1000, 2, 8, 256, None, 1.0, "blockwise"),
        (5, None, 1, 4, 5, None, 1.0, "blockwise"),  # seq_len None is prefill
        (5, None, 1, 4, 6, None, 1.0, "all_experts"),
    ],
)
def test_select_mode_rules(num_tokens, seq_len, top_k, num_experts, block_size, cf, alpha, expected):
    assert select_mode(num_tokens, seq_len, top_k, num_experts, block_size, cf, alpha) is ExpertsMode(expected)


@pytest.mark.parametrize(
    "num_tokens, seq_len, cf, alpha, block_size, expected",
    [
        (3, 1, None, 1.0, 8, "selective_loading"),  # 6 < 8
        (4, 1, None, 1.0, 8, "all_experts"),
        (3, 1, None, 0.5, 8, "all_experts"),  # alpha configurable
        (3, 3, None, 1.0, 8, "selective_loading"),
        (5, 5, None, 1.0, 16, "all_experts"),  # 10 < 16
        (8, 8, None, 1.0, 16, "blockwise"),
        (8, 8, 1.0, 1.0, 16, "capacity_factor"),
        (8, None, 1.0, 1.0, 16, "capacity_factor"),
    ],
)
def test_automatic_mode_in_expert_mlps_and_moe(num_tokens, seq_len, cf, alpha, block_size, expected):
    cfg = make_config(num_experts=8, top_k=2, capacity_factor=cf, selective_loading_threshold=alpha)
    experts = make_experts(cfg, block_size=block_size, seed=3)
    x = randn(num_tokens, 16, seed=4)
    affinities, expert_index = random_routing(num_tokens, 8, 2, seed=5)
    out, stats = experts(x, affinities, expert_index, seq_len=seq_len, return_stats=True)
    assert stats.mode is ExpertsMode(expected)
    keep = (first_come_first_served(expert_index, 8, stats.capacity) if expected == "capacity_factor" else None)
    assert_close(out, reference_for_experts(experts, x, affinities, expert_index, keep=keep), FP32_ATOL)
    if seq_len is not None:
        # the MoE layer sees (B, S, H): S == 1 is decode
        router = make_router("topk_softmax", 8, 2, 16, seed=6)
        moe = MoE(router, experts).eval()
        batch = num_tokens // seq_len
        *_, moe_stats = moe(x.view(batch, seq_len, 16), return_stats=True)
        assert moe_stats.mode is ExpertsMode(expected)


@pytest.mark.parametrize(
    "num_tokens, seq_len, top_k, cf, expected",
    [
        (128, 1, 8, None, "selective_loading"),  # decode: always
        (300, 1, 8, None, "selective_loading"),
        (128, 128, 8, None, "selective_loading"),  # a 128-token prompt at top-8: 1024 pairs, one launch
        (129, 129, 8, None, "blockwise"),  # 1032 pairs
        (128, None, 8, None, "selective_loading"),  # T alone (the transformers seam): the same answer
        (129, None, 8, None, "blockwise"),
        (128, 128, 8, 1.0, "capacity_factor"),  # a capacity factor still drops
        (2, 2, 2, None, "selective_loading"),  # 4 pairs, 128 experts: NxD's tiny-prefill rule
    ],
)
def test_gpu_backend_rules(num_tokens, seq_len, top_k, cf, expected):
    """The triton backend's rule (pure shapes: no GPU needed): never all-experts unforced, and a decode-sized
    prefill (T*k within one launch's 1024 pairs) runs as the decode of that size does."""
    pytest.importorskip("triton")
    from nxd_moe.triton_kernels.backend import TritonBackend

    backend = TritonBackend()
    assert backend.select_mode(num_tokens, seq_len, top_k, 128, 512, cf, 1.0) is ExpertsMode(expected)
    if seq_len is None:
        assert backend.select_mode_from_tokens(num_tokens, top_k, 128, 512, 1.0) is ExpertsMode(expected)


def test_forced_mode_validation():
    experts = make_experts(make_config())
    affinities, expert_index = random_routing(4, 4, 2, seed=0)
    x = randn(4, 16, seed=1)
    with pytest.raises(ValueError, match="capacity_factor"):
        experts(x, affinities, expert_index, mode="capacity_factor")
    with pytest.raises(ValueError, match="mode"):
        experts(x, affinities, expert_index, mode="dense")
    assert experts(x, affinities, expert_index, mode=ExpertsMode.ALL_EXPERTS).shape == (4, 16)


def test_stats_padding_overheads_match_deep_dive_best_case():
    """1000 tokens, 8 experts, top-2, block 256, perfectly balanced: 15 blocks provisioned, 8 used."""
    cfg = make_config(num_experts=8, hidden_size=4, intermediate_size=4, top_k=2)
    experts = make_experts(cfg, block_size=256, seed=0)
    t = torch.arange(1000)
    expert_index = torch.stack([t % 8, (t + 1) % 8], dim=1)  # every expert gets exactly 250
    affinities = torch.full((1000, 8), 0.5)
    _, stats = experts(randn(1000, 4, seed=1), affinities, expert_index, return_stats=True)
    summary = stats.summary()
    assert summary["mode"] == "blockwise" and summary["num_blocks"] == 15
    assert summary["active_blocks"] == 8
    assert summary["padding_overhead_provisioned"] == pytest.approx((3840 - 2048) / 2048)  # 87.5%
    assert summary["padding_overhead_algorithmic"] == pytest.approx((2048 - 2000) / 2000)  # 2.4%
    assert stats.tokens_per_expert.tolist() == [250] * 8


def test_router_top_k_to_moe_with_explicit_router():
    """The matrix above calls router and experts separately; MoE must compose them identically."""
    experts = make_experts(make_config(num_experts=8, top_k=2), block_size=4, seed=1)
    router = make_router("topk_sigmoid", 8, 2, 16, seed=2)
    moe = MoE(router, experts).eval()
    assert isinstance(moe.router, RouterTopK)
    x = randn(2, 6, 16, seed=3)
    (out,) = moe(x)
    _, affinities, expert_index = router(x.view(12, 16))
    assert_close(out.view(12, 16), experts(x.view(12, 16), affinities, expert_index), 0.0)


# ----------------------------------------------------------------------------------------------------------
# the reference itself: it is right on a hand-computed case, and it catches deliberately wrong implementations


def test_reference_hand_computed():
    """Two relu experts, H=2, I=1: every number below is worked out by hand."""
    from nxd_moe.reference import dense_moe_reference

    cfg = make_config(num_experts=2, hidden_size=2, intermediate_size=1, top_k=2, activation="mlp_relu")
    up = torch.tensor([[[1.0], [1.0]], [[0.0], [1.0]]])  # (E, H, I)
    down = torch.tensor([[[1.0, -1.0]], [[2.0, 0.0]]])  # (E, I, H)
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    index = torch.tensor([[0, 1], [1, 0]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 3.0]])
    out = dense_moe_reference(x, index, weights, cfg, up, down)
    # token 0: e0: relu(1+2)=3 -> [3,-3] * 0.5 ; e1: relu(2)=2 -> [4,0] * 0.25  => [2.5, -1.5]
    # token 1: e1: relu(0.5) -> [1,0] * 1.0 ; e0: relu(-0.5)=0 -> 0             => [1.0, 0.0]
    assert out.tolist() == [[2.5, -1.5], [1.0, 0.0]]
    keep = torch.tensor([[True, False], [True, True]])
    assert dense_moe_reference(x, index, weights, cfg, up, down, keep=keep).tolist() == [[1.5, -1.5], [1.0, 0.0]]


def _wrong_mapping(kind):
    """Wrap the block mapping so one (token, expert) pair is lost or duplicated."""
    from nxd_moe.experts import backends

    real = backends.token_to_block_mapping

    def broken(*args, **kwargs):
        mapping = real(*args, **kwargs)
        slot = mapping.token_slot.clone()
        if kind == "drop":  # token 3's second pair reads a padding slot instead of its own
            slot[3, 1] = int((mapping.token_position_to_id == -1).nonzero()[0])
        else:  # "duplicate": token 3's second pair reads its first pair's row
            slot[3, 1] = slot[3, 0]
        return mapping._replace(token_slot=slot)

    return broken


@pytest.mark.parametrize("kind", ["drop", "duplicate"])
def test_reference_catches_lost_or_duplicated_pair(monkeypatch, kind):
    from nxd_moe.experts import backends

    experts = make_experts(make_config(), seed=111)
    x = randn(8, 16, seed=112)
    affinities, expert_index = random_routing(8, 4, 2, seed=113)
    ref = reference_for_experts(experts, x, affinities, expert_index)
    assert_close(experts(x, affinities, expert_index, mode="blockwise"), ref, FP32_ATOL)
    monkeypatch.setattr(backends, "token_to_block_mapping", _wrong_mapping(kind))
    out = experts(x, affinities, expert_index, mode="blockwise")
    with pytest.raises(AssertionError, match="worst row 3"):
        assert_close(out, ref, FP32_ATOL)
    others = torch.arange(8) != 3
    assert_close(out[others], ref[others], FP32_ATOL)  # only token 3 is wrong, and the check says which


@pytest.mark.parametrize("mode", MODES)
def test_reference_catches_swapped_experts(mode):
    experts = make_experts(make_config(capacity_factor=1.0), seed=121)
    x = randn(8, 16, seed=122)
    affinities, expert_index = random_routing(8, 4, 2, seed=123)
    _, ref, _ = run_and_reference(experts, x, affinities, expert_index, mode)
    with torch.no_grad():
        for p in (experts.mlp_op.gate_up_proj.weight, experts.mlp_op.down_proj.weight):
            p[[0, 1]] = p[[1, 0]]
    with pytest.raises(AssertionError):
        assert_close(experts(x, affinities, expert_index, mode=mode), ref, FP32_ATOL)


def test_reference_catches_dropped_hidden_act_bias(monkeypatch):
    """NxD's behaviour with bias=False (hidden_act_bias silently dropped) is detected as wrong."""
    import dataclasses

    experts = make_experts(make_config(hidden_act_bias=1.0), seed=131)
    x = randn(8, 16, seed=132)
    affinities, expert_index = random_routing(8, 4, 2, seed=133)
    ref = reference_for_experts(experts, x, affinities, expert_index)
    experts.activation = dataclasses.replace(experts.activation, act_bias=0.0)
    with pytest.raises(AssertionError):
        assert_close(experts(x, affinities, expert_index, mode="selective_loading"), ref, FP32_ATOL)


def test_reference_catches_wrong_capacity_order():
    """Dropping the *last* C tokens instead of keeping the first C is caught by the FCFS reference."""
    experts = make_experts(make_config(num_experts=2, top_k=1, capacity_factor=1.0), seed=141)
    x = randn(8, 16, seed=142)
    expert_index = torch.zeros(8, 1, dtype=torch.long)
    affinities = torch.tensor([[1.0, 0.0]] * 8)
    out, stats = experts(x, affinities, expert_index, return_stats=True)  # C = 4
    fcfs = first_come_first_served(expert_index, 2, stats.capacity)
    assert_close(out, reference_for_experts(experts, x, affinities, expert_index, keep=fcfs), FP32_ATOL)
    with pytest.raises(AssertionError):
        assert_close(out, reference_for_experts(experts, x, affinities, expert_index, keep=fcfs.flip(0)), FP32_ATOL)


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("hidden_act", sorted(ACT2FN))
def test_every_activation_function(hidden_act, glu):
    cfg = make_config(hidden_act=hidden_act, glu_mlp=glu, hidden_act_scaling_factor=1.5 if glu else 1.0)
    experts = make_experts(cfg, seed=151)
    x = randn(9, 16, seed=152)
    affinities, expert_index = random_routing(9, 4, 2, seed=153)
    ref = reference_for_experts(experts, x, affinities, expert_index)
    for mode in DROPLESS_MODES:
        assert_close(experts(x, affinities, expert_index, mode=mode), ref, FP32_ATOL, msg=f"{hidden_act}/{mode}")
