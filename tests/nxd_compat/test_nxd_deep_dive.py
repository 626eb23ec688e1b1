"""The MoE deep dive's Python examples (tests/nxd_compat/deep_dive_examples.py, sizes scaled) through the NxD front
door, on one process: every layer runs prefill and decode against its float64 dense reference; the examples NxD
itself rejects fail with our named error and run once corrected. The ``initialize_model_parallel`` examples run
under torchrun in test_nxd_worlds.py.

Tolerance: fp32 layers with O(0.1-1) outputs summing at most k=8 experts of H <= 56, I <= 64 products: a few
hundred ulps of 2^-24, so ``FP32_ATOL = 1e-5`` keeps a 10x margin; each test's negative control shows it rejects a
layer computing something else.
"""

from __future__ import annotations

import deep_dive_examples as dd
import pytest
import torch
from conftest import FP32_ATOL, assert_close, randn, randomize_

from nxd_moe.nxd_compat.pytest_plugin import nxd_compat  # noqa: F401 -- the fixture
from nxd_moe.reference import reference_for_moe


def _check_layer(moe, prefill_tokens: int, expected_prefill_mode: str, seed: int, scale: float = 1.0):
    """Prefill of ``prefill_tokens`` and a decode of 4, each against the float64 reference; returns the stats.
    ``scale`` > 1 makes outputs larger, and the bound grows with them: fp32 dot products of n = H + I + k ~ 120
    terms err by up to n * 2^-24 ~ 7e-6 of the sum of the terms' magnitudes, typically sqrt(n) * 2^-24 ~ 7e-7 of
    it; 4e-6 of the largest output lies between the two."""
    randomize_(moe, seed=seed).eval()
    hidden = moe.router.hidden_size
    modes = []
    for shape in ((1, prefill_tokens, hidden), (4, 1, hidden)):
        x = randn(*shape, seed=seed + 1, scale=scale)
        with torch.no_grad():
            out, stats = moe(x, return_stats=True)
        expected = reference_for_moe(moe, x, capacity=stats.capacity)
        assert expected.abs().mean() > 0.02, "reference near zero: the comparison would be vacuous"
        assert_close(out, expected, max(FP32_ATOL, 4e-6 * float(expected.abs().max())), msg=f"{shape}")
        modes.append(stats.mode.value)
    # Negative control: the same layer's output against another input's reference is far outside the bound.
    assert (out.double() - reference_for_moe(moe, x.roll(1, 0))).abs().max() > 100 * FP32_ATOL
    assert modes[0] == expected_prefill_mode, modes
    return stats


def test_line_113_moe_layer(nxd_compat):  # noqa: F811
    moe = dd.moe_layer()
    assert moe.expert_mlps.blockwise_matmul_config.logical_nc_config == 2 and moe.sequence_parallel_enabled
    # 64 tokens x top 8 = 512 assignments fill the page's 512-token blocks: the dropless blockwise prefill.
    _check_layer(moe, 64, "blockwise", seed=1)


@pytest.mark.parametrize("example", [dd.sp_router, dd.sp_router_2880])
def test_lines_182_and_445_sequence_parallel_routers(nxd_compat, example):  # noqa: F811
    router = randomize_(example(), seed=2)
    assert router.sequence_parallel_enabled and router.act_fn == "softmax"
    x = randn(10, router.hidden_size, seed=3)
    _, affinities, index = router(x)
    logits = x.double() @ router.linear_router.weight.double().t()
    assert_close(affinities, torch.softmax(logits, dim=-1), FP32_ATOL)
    assert torch.equal(index.sort(-1).values, logits.topk(8, dim=-1).indices.sort(-1).values)


def test_line_197_group_limited_router(nxd_compat):  # noqa: F811
    """DeepSeek-V3's rule, checked against a direct statement of it: each group scores the sum of its two best
    sigmoid scores; the best 2 of 8 groups are kept; the top 8 experts come from those groups only."""
    router = randomize_(dd.group_limited_router(), seed=4).eval()
    x = randn(16, router.hidden_size, seed=5)
    _, affinities, index = router(x)
    scores = torch.sigmoid(x.double() @ router.linear_router.weight.double().t())  # (T, 256), zero correction bias
    groups = scores.view(16, 8, 32)
    kept = groups.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # (T, 2)
    masked = torch.full_like(groups, -1.0)
    masked.scatter_(1, kept[:, :, None].expand(-1, -1, 32), groups.gather(1, kept[:, :, None].expand(-1, -1, 32)))
    expected = masked.view(16, 256).topk(8, dim=-1).indices
    assert torch.equal(index.sort(-1).values, expected.sort(-1).values)
    assert_close(affinities.gather(1, index), scores.gather(1, index), FP32_ATOL)


@pytest.mark.parametrize("line", [222, 262, 281])
def test_swiglu_examples_get_an_error_that_says_what_to_write(nxd_compat, line):  # noqa: F811
    with pytest.raises(ValueError, match="hidden_act must be one of .*got 'swiglu'.*hidden_act='silu' with "
                                         "glu_mlp=True.*glu_type='swiglu', hidden_act='sigmoid', "
                                         "hidden_act_scaling_factor=1.702, hidden_act_bias=1.0"):
        dd.swiglu_config(line, corrected=False)


@pytest.mark.parametrize("line,tokens,mode", [(222, 64, "blockwise"), (281, 64, "capacity_factor")])
def test_swiglu_examples_corrected(nxd_compat, line, tokens, mode):  # noqa: F811
    """Line 222's layer (262 is its config without the blockwise part) and line 281's dropping one (capacity factor
    1.25), with GPT-OSS's SwiGLU in place of ``hidden_act="swiglu"``; inputs large enough that the +-7 clamps act."""
    from neuronx_distributed.modules.moe import MoE, routing

    config = dd.swiglu_config(line, corrected=True)
    assert config.capacity_factor == (1.25 if line == 281 else None)
    experts = dd.swiglu_expert_mlps(config)
    assert experts.blockwise_matmul_config.skip_dma == (True, True)
    router = routing.RouterTopK(num_experts=128, top_k=8, hidden_size=config.hidden_size)
    moe = MoE(router=router, expert_mlps=experts, sequence_parallel_enabled=True)
    stats = _check_layer(moe, tokens, mode, seed=6, scale=4.0)
    if line == 222:  # the clamps act: the same weights without them compute something else
        unclamped = config.replace(gate_clamp_upper_limit=None, up_clamp_lower_limit=None, up_clamp_upper_limit=None)
        free = MoE(router, dd.swiglu_expert_mlps(unclamped), sequence_parallel_enabled=True)
        free.load_state_dict(moe.state_dict())
        x = randn(1, tokens, config.hidden_size, seed=7, scale=4.0)
        assert (reference_for_moe(free, x) - reference_for_moe(moe, x)).abs().max() > 1.0
    if line == 281:  # capacity min(ceil(T * k * 1.25 / E), T) = ceil(64 * 8 * 1.25 / 128) = 5 per expert
        x = randn(1, tokens, config.hidden_size, seed=7)
        _, prefill = moe(x, return_stats=True)
        assert prefill.capacity == 5
        assert 0 < int(prefill.dropped_tokens) < tokens * 8  # some dropped, as the page's "dropping" says
    assert stats.mode.value in ("selective_loading", "all_experts")


def test_lines_364_and_801_llama4_shared_experts(nxd_compat):  # noqa: F811
    moe = dd.llama4_shared_experts_layer()
    shared = moe.shared_experts
    assert shared.fused_gate_up_projection and shared.sequence_parallel_enabled and shared.intermediate_size == 64
    _check_layer(moe, 64, "blockwise", seed=8)


def test_line_673_skip_dma(nxd_compat):  # noqa: F811
    config = dd.skip_dma_blockwise_config()
    assert config.skip_dma == (True, True) and config.block_size == 512 and config.logical_nc_config == 2


def test_line_711_dynamic_while(nxd_compat):  # noqa: F811
    """As written both flags are on: refused by name (NxD's kernel asserts at the first forward). Each alternative
    runs the dynamic-while blockwise schedule (a static prefix of blocks, then a device-side loop)."""
    with pytest.raises(ValueError, match="use_shard_on_intermediate_dynamic_while and use_shard_on_block_dynamic_while "
                                         "are mutually exclusive"):
        dd.dynamic_while_blockwise_config()
    from neuronx_distributed.modules.moe import MoE
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    for which in ("block", "intermediate"):
        config = dd.dynamic_while_blockwise_config(which)
        assert config.use_dynamic_while
        base = dd.moe_layer()
        experts = ExpertMLPsV2(base.expert_mlps.routed_experts_mlp_config, config, sequence_parallel_enabled=True)
        _check_layer(MoE(base.router, experts, sequence_parallel_enabled=True), 64, "blockwise", seed=9)
