"""Adversarial routings: every mode must account for every (token, expert) pair exactly once.

Two kinds of experts: "scaling" experts (expert e computes ``scale_e * x`` exactly, with scales that identify the
set of experts a token went through, see conftest) for per-token reconstruction, and random GLU experts
checked against the float64 reference. Routings are hand-built (driving ``ExpertMLPsV2`` directly) and produced
by routers with crafted weights (ties, biases).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DROPLESS_MODES,
    FP32_ATOL,
    MODES,
    assert_close,
    expert_count_dropped,
    expert_scales,
    make_config,
    make_experts,
    make_router,
    make_scaling_experts,
    randn,
    scaling_expected,
    zero_router,
)

from nxd_moe import GroupLimitedRouter, MoE, RouterSinkhorn, RouterTopK
from nxd_moe.experts.token_mapping import num_blocks
from nxd_moe.reference import first_come_first_served, reference_for_experts, reference_for_moe


def _rows(*rows):
    return torch.tensor(rows, dtype=torch.long)


# name -> (num_experts, top_k, block_size, expert_index (T, k))
SCENARIOS = {
    "all_to_one_expert": (4, 1, 4, torch.full((10, 1), 2)),
    "all_to_last_expert": (4, 1, 3, torch.full((10, 1), 3)),  # shares the last expert with the tail blocks
    "all_to_same_pair": (6, 2, 4, _rows(*[[1, 4]] * 9)),
    "empty_experts": (8, 2, 2, _rows(*[[0, 5], [5, 0]] * 5)),
    "single_token": (4, 2, 4, _rows([3, 1])),
    "single_token_k1_e1": (1, 1, 4, _rows([0])),
    "tokens_not_multiple_of_block": (4, 2, 4, _rows(*[[t % 4, (t + 1) % 4] for t in range(13)])),
    "k_equals_e": (4, 4, 3, _rows(*[[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1], [0, 2, 1, 3]])),
    "block_size_one": (3, 2, 1, _rows([0, 1], [1, 2], [2, 0], [0, 2], [1, 0])),
    "block_larger_than_assignments": (4, 2, 64, _rows([0, 1], [2, 3], [1, 2], [3, 0], [0, 2])),
    "worst_case_for_num_blocks": (6, 1, 4, _rows(*([[e] for e in range(5)] + [[5]] * 14))),
    "worst_case_first_expert_hot": (6, 1, 4, _rows(*([[0]] * 14 + [[e] for e in range(1, 6)]))),
    "descending_index_order": (5, 3, 2, _rows(*[[4, 2, 0], [3, 1, 0], [4, 3, 2], [2, 1, 0]] * 3)),
}


def pair_weights_for(expert_index, seed):
    """Distinct, non-trivial weight per pair: a lost pair and a duplicated one cannot cancel."""
    gen = torch.Generator().manual_seed(seed)
    return 0.25 + torch.rand(expert_index.shape, generator=gen, dtype=torch.float64)


def affinities_from(pair_weights, expert_index, num_experts, dtype):
    aff = torch.zeros(expert_index.shape[0], num_experts, dtype=torch.float64)
    return aff.scatter(1, expert_index, pair_weights).to(dtype)


# capacity mode needs k < E (with k == E every capacity factor is full capacity, i.e. dropless)
SCENARIO_MODES = [(name, mode) for name in SCENARIOS for mode in MODES
                  if mode != "capacity_factor" or SCENARIOS[name][0] > SCENARIOS[name][1]]


@pytest.mark.parametrize("dtype, matmul", [(torch.float64, "gather"), (torch.float32, "grouped_mm"),
                                           (torch.float32, "gather")])
@pytest.mark.parametrize("scenario, mode", SCENARIO_MODES)
def test_per_token_reconstruction(scenario, mode, dtype, matmul):
    num_experts, top_k, block_size, expert_index = SCENARIOS[scenario]
    num_tokens = expert_index.shape[0]
    hidden = 8
    cf = dict(capacity_factor=0.5) if mode == "capacity_factor" else {}
    experts = make_scaling_experts(num_experts, hidden, top_k, block_size=block_size, dtype=dtype, matmul=matmul,
                                   **cf)
    x = randn(num_tokens, hidden, seed=1, dtype=dtype)
    weights = pair_weights_for(expert_index, seed=2)
    affinities = affinities_from(weights, expert_index, num_experts, dtype)
    out, stats = experts(x, affinities, expert_index, mode=mode, return_stats=True)
    keep = None
    if mode == "capacity_factor":
        keep = first_come_first_served(expert_index, num_experts, stats.capacity)
        assert int(stats.dropped_tokens) == expert_count_dropped(expert_index, num_experts, stats.capacity)
    expected = scaling_expected(x, weights, expert_index, expert_scales(num_experts, top_k), keep)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    for t in range(num_tokens):  # token by token: a lost, duplicated or misrouted pair names its token
        assert_close(out[t:t + 1], expected[t:t + 1], 1e-12, rtol=rtol, msg=f"{scenario}/{mode} token {t}")
    if mode == "blockwise":
        assert stats.num_blocks == num_blocks(num_tokens, top_k, num_experts, block_size)
        assert int(stats.mapping.conditions.sum()) == sum(
            -(-int(c) // block_size) for c in torch.bincount(expert_index.reshape(-1), minlength=num_experts))


@pytest.mark.parametrize("scenario, mode", SCENARIO_MODES)
def test_adversarial_routings_random_glu_experts(scenario, mode):
    num_experts, top_k, block_size, expert_index = SCENARIOS[scenario]
    cf = 0.5 if mode == "capacity_factor" else None
    cfg = make_config(num_experts=num_experts, top_k=top_k, activation="swiglu_gptoss", bias=True,
                      capacity_factor=cf)
    experts = make_experts(cfg, block_size=block_size, seed=3)
    num_tokens = expert_index.shape[0]
    x = randn(num_tokens, 16, seed=4)
    affinities = affinities_from(pair_weights_for(expert_index, 5), expert_index, num_experts, torch.float32)
    out, stats = experts(x, affinities, expert_index, mode=mode, return_stats=True)
    keep = first_come_first_served(expert_index, num_experts, stats.capacity) if cf else None
    assert_close(out, reference_for_experts(experts, x, affinities, expert_index, keep=keep), 2 * FP32_ATOL)


@pytest.mark.parametrize("mode", DROPLESS_MODES)
def test_prescale_with_every_token_on_one_expert(mode):
    """Early affinity modulation with k > 1 and all tokens on the same experts."""
    experts = make_scaling_experts(4, 8, 2, block_size=3, early_expert_affinity_modulation=True)
    expert_index = _rows(*[[3, 0]] * 7)
    weights = pair_weights_for(expert_index, 6)
    x = randn(7, 8, seed=7, dtype=torch.float64)
    out = experts(x, affinities_from(weights, expert_index, 4, torch.float64), expert_index, mode=mode)
    # scaling experts are linear, so pre-scaling equals post-scaling
    assert_close(out, scaling_expected(x, weights, expert_index, expert_scales(4, 2)), 1e-12)


# ----------------------------------------------------------------------------------------------------------
# through routers with crafted weights


ROUTERS = {
    "topk_softmax_ties": lambda: zero_router(RouterTopK(6, 2, 8)),
    "topk_sigmoid_ties": lambda: zero_router(RouterTopK(6, 3, 8, act_fn="sigmoid")),
    "topk_act_over_topk_ties": lambda: zero_router(RouterTopK(6, 2, 8, apply_act_fn_over_topk=True, bias=True)),
    "group_limited_ties": lambda: zero_router(GroupLimitedRouter(6, 2, 8, n_group=3, topk_group=2, normalize=True)),
    "sinkhorn_ties": lambda: zero_router(RouterSinkhorn(6, 1, 8)),
    "k_equals_e_ties": lambda: zero_router(RouterTopK(6, 6, 8)),
}


def _bias_router(num_experts, top_k, favourite):
    router = zero_router(RouterTopK(num_experts, top_k, 8, bias=True))
    with torch.no_grad():
        router.linear_router.bias[favourite] = 30.0
    return router


ROUTERS["bias_all_to_last_expert"] = lambda: _bias_router(6, 1, 5)
ROUTERS["bias_all_to_first_expert_k2"] = lambda: _bias_router(6, 2, 0)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 9), (2, 13)], ids=lambda s: f"B{s[0]}xS{s[1]}")
@pytest.mark.parametrize("router_name", list(ROUTERS))
@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_crafted_routers_lose_nothing(router_name, shape, block_size):
    router = ROUTERS[router_name]().eval()
    num_experts, top_k = router.num_experts, router.top_k
    experts = make_scaling_experts(num_experts, 8, top_k, block_size=block_size, dtype=torch.float32)
    moe = MoE(router, experts).eval()
    x = randn(*shape, 8, seed=8)
    out, stats = moe(x, return_stats=True)
    flat = x.reshape(-1, 8)
    _, affinities, expert_index = router(flat)
    assert all(len(set(row)) == top_k for row in expert_index.tolist()), "top-k must return distinct experts"
    weights = affinities.gather(1, expert_index)
    expected = scaling_expected(flat, weights, expert_index, expert_scales(num_experts, top_k))
    for t in range(flat.shape[0]):
        assert_close(out.reshape(-1, 8)[t:t + 1], expected[t:t + 1], 1e-6, rtol=2e-6,
                     msg=f"{router_name} mode {stats.mode.value} token {t}")
    assert_close(out, reference_for_moe(moe, x), 1e-5, rtol=2e-6)


@pytest.mark.parametrize("router_kind", ["topk_softmax", "group_limited", "sinkhorn"])
def test_zero_router_weights_with_random_experts_all_modes(router_kind):
    router = zero_router(make_router(router_kind, 8, 2, 16))
    top_k = router.top_k
    cfg = make_config(num_experts=8, top_k=top_k, capacity_factor=1.0, bias=True)
    experts = make_experts(cfg, block_size=4, seed=9)
    x = randn(10, 16, seed=10)
    _, affinities, expert_index = router(x)
    for mode in MODES:
        out, stats = experts(x, affinities, expert_index, mode=mode, return_stats=True)
        keep = first_come_first_served(expert_index, 8, stats.capacity) if mode == "capacity_factor" else None
        assert_close(out, reference_for_experts(experts, x, affinities, expert_index, keep=keep), FP32_ATOL,
                     msg=mode)
        if mode == "capacity_factor":
            # ties send every token to the same experts: capacity C = ceil(10*k/8) each, the rest dropped
            assert int(stats.dropped_tokens) == expert_count_dropped(expert_index, 8, stats.capacity) > 0


@pytest.mark.parametrize("matmul", ["gather", "grouped_mm"])
@pytest.mark.parametrize("mode", MODES)
def test_unchosen_overflowing_expert_does_not_poison(mode, matmul):
    """Expert 3 overflows to inf on every input. Tokens that did not choose it must be finite and correct
    (all-experts runs every token through expert 3: a 0 * inf there would be NaN)."""
    cfg = make_config(num_experts=4, top_k=2, capacity_factor=1.0)
    experts = make_experts(cfg, block_size=4, matmul=matmul, seed=21)
    x = randn(10, 16, seed=22)
    expert_index = _rows(*[[0, 1], [2, 0], [1, 2]] * 3, [3, 0])  # only token 9 chooses expert 3
    affinities = affinities_from(pair_weights_for(expert_index, 23), expert_index, 4, torch.float32)
    expected = experts(x, affinities, expert_index, mode=mode)
    with torch.no_grad():
        experts.mlp_op.gate_up_proj.weight[3] *= 1e20
        experts.mlp_op.down_proj.weight[3] *= 1e20
    probe = experts(x, torch.full_like(affinities, 0.5), torch.tensor([[3, 0]] * 10), mode="all_experts")
    assert not torch.isfinite(probe).all()  # expert 3 really overflows
    out = experts(x, affinities, expert_index, mode=mode)
    assert torch.isfinite(out[:9]).all()
    assert_close(out[:9], expected[:9], FP32_ATOL)
