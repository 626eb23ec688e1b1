"""Each module name the NxD front door maps, against nxd_moe: aliased names are nxd_moe's own objects; adapters take
NxD's arguments in NxD's order, build the nxd_moe module those arguments describe (checked field by field), compute
what the float64 reference of that module computes, and refuse by name what nxd_moe does not do.

Tolerances: fp32 layers whose outputs are O(0.1-1), sums over H <= 32 and I <= 24 products: a few hundred ulps of
2^-24 at most, so ``FP32_ATOL = 1e-5`` (tests/conftest.py) has a 10x margin. Each comparison has a negative control
showing the bound rejects a layer that computes something else.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_ATOL, assert_close, randn, randomize_

import nxd_moe
from nxd_moe.nxd_compat.pytest_plugin import nxd_compat  # noqa: F401 -- the fixture
from nxd_moe.reference import reference_for_experts, reference_for_moe

H, INTER, E, K = 16, 12, 4, 2


@pytest.fixture
def moe_pkg(nxd_compat):  # noqa: F811
    import neuronx_distributed.modules.moe as moe_pkg

    return moe_pkg


def test_aliased_names_are_nxd_moes_own(moe_pkg):
    from neuronx_distributed.modules.moe import model, moe_configs, routing, shared_experts
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    assert routing.GroupLimitedRouter is nxd_moe.GroupLimitedRouter and routing.RouterBase is nxd_moe.RouterBase
    assert moe_configs.RoutedExpertsMLPOpsConfig is nxd_moe.RoutedExpertsMLPOpsConfig
    assert moe_configs.MoEFusedTKGConfig is model.MoEFusedTKGConfig is nxd_moe.config.MoEFusedTKGConfig
    # Adapters are the nxd_moe classes (subclasses): MoE, ExpertParallel, ... accept them.
    for adapter, ours in ((routing.RouterTopK, nxd_moe.RouterTopK), (routing.RouterSinkhorn, nxd_moe.RouterSinkhorn),
                          (ExpertMLPsV2, nxd_moe.ExpertMLPsV2), (ExpertMLPs, nxd_moe.ExpertMLPsV2),
                          (shared_experts.SharedExperts, nxd_moe.SharedExperts), (model.MoE, nxd_moe.MoE)):
        assert issubclass(adapter, ours)
    assert moe_pkg.MoE is model.MoE and moe_pkg.RouterTopK is routing.RouterTopK and moe_pkg.ExpertMLPs is ExpertMLPs


def _topk_softmax_reference(x: torch.Tensor, weight: torch.Tensor, k: int):
    logits = x.double() @ weight.double().t()
    return torch.softmax(logits, dim=-1), logits.topk(k, dim=-1).indices


def test_router_top_k_in_nxds_positional_order(moe_pkg):
    # NxD: (E, k, H, sequence_parallel_enabled, sequence_dimension, dtype, device, bias, group, act_fn,
    #       apply_act_fn_over_topk, jitter_eps, store_transposed_weights). Two routers whose flags differ from
    # each other in every position, so a swap or a drop inside the adapter shows in one of them.
    router = moe_pkg.routing.RouterTopK(E, K, H, True, 1, torch.float64, torch.device("cpu"), True, None, "sigmoid",
                                        False, 0.0, False)
    assert (router.sequence_parallel_enabled, router.sequence_dimension, router.dtype, router.act_fn,
            router.apply_act_fn_over_topk, router.store_transposed_weights) == (
        True, 1, torch.float64, "sigmoid", False, False)
    assert router.linear_router.bias is not None and router.linear_router.weight.dtype == torch.float64
    randomize_(router, seed=1)
    x = randn(10, H, seed=2).double()
    _, affinities, index = router(x)
    logits = x @ router.linear_router.weight.t() + router.linear_router.bias
    assert_close(affinities, torch.sigmoid(logits), FP32_ATOL)  # over all E, with the bias
    assert torch.equal(index.sort(dim=-1).values, logits.topk(K, dim=-1).indices.sort(dim=-1).values)
    assert (affinities - torch.sigmoid(logits - router.linear_router.bias)).abs().max() > 100 * FP32_ATOL

    other = moe_pkg.routing.RouterTopK(E, K, H, False, None, torch.float32, torch.device("cpu"), False, None,
                                       "softmax", True, 0.0, True)
    assert (other.sequence_parallel_enabled, other.dtype, other.act_fn, other.apply_act_fn_over_topk,
            other.store_transposed_weights, other.linear_router.bias) == (
        False, torch.float32, "softmax", True, True, None)
    assert "weight_T" not in dict(other.named_parameters())  # our kernels read linear_router.weight itself
    randomize_(other, seed=3)
    x = randn(10, H, seed=4)
    _, affinities, index = other(x)
    logits = x.double() @ other.linear_router.weight.double().t()
    top, expected_index = logits.topk(K, dim=-1)
    expected = torch.zeros_like(logits).scatter(1, expected_index, torch.softmax(top, dim=-1))  # over the k only
    assert_close(affinities, expected, FP32_ATOL)
    with pytest.raises(TypeError, match="RouterTopK.store_transposed_weights must be a bool"):
        moe_pkg.routing.RouterTopK(E, K, H, store_transposed_weights="yes")


def test_router_sinkhorn_in_nxds_positional_order(moe_pkg):
    # NxD: (E, k, H, act_fn, sequence_parallel_enabled, sequence_dimension, dtype, device, iterations, tol)
    router = moe_pkg.routing.RouterSinkhorn(E, 1, H, "softmax", False, None, torch.float32, torch.device("cpu"), 5)
    assert (router.act_fn, router.sinkhorn_iterations) == ("softmax", 5)
    randomize_(router, seed=3).eval()
    x = randn(6, H, seed=4)
    _, affinities, index = router(x)
    expected_affinities, expected_index = _topk_softmax_reference(x, router.linear_router.weight, 1)
    assert_close(affinities, expected_affinities, FP32_ATOL)
    assert torch.equal(index, expected_index)  # eval: argmax of the logits
    with pytest.raises(ValueError, match="RouterSinkhorn.sinkhorn_tol must be None"):
        moe_pkg.routing.RouterSinkhorn(E, 1, H, sinkhorn_tol=1e-3)


def test_group_limited_router_with_nxds_attached_correction_bias(moe_pkg):
    """NxD's GroupLimitedRouter registers no correction bias; its users attach an ``nn.Parameter`` (NxD's unit
    test, NxDI's DeepSeek-V3). Ours registers a buffer; attaching a Parameter the NxD way replaces it and steers the
    choice (an expert with a large bias is always picked)."""
    router = moe_pkg.routing.GroupLimitedRouter(num_experts=8, top_k=2, hidden_size=H, n_group=4, topk_group=2,
                                                dtype=torch.float32)
    randomize_(router, seed=5).eval()
    bias = torch.zeros(8)
    bias[5] = 10.0
    router.e_score_correction_bias = torch.nn.Parameter(bias, requires_grad=False)
    assert "e_score_correction_bias" in router.state_dict()
    _, scores, index = router(randn(12, H, seed=6))
    assert bool((index == 5).any(dim=-1).all())
    # The chosen experts' scores are the un-biased sigmoid of the logits, as in NxD (the bias only ranks); ours
    # are zero elsewhere (NxD returns all E, which its experts then mask to the chosen ones: the same result).
    x = randn(12, H, seed=6)
    expected = torch.sigmoid(x.double() @ router.linear_router.weight.double().t())
    assert_close(scores.gather(1, index), expected.gather(1, index), FP32_ATOL)
    assert float(scores.detach().sum()) == pytest.approx(float(scores.detach().gather(1, index).sum()))


def _experts_config(**overrides):
    base = dict(num_experts=E, hidden_size=H, intermediate_size=INTER, top_k=K, hidden_act="silu", glu_mlp=True,
                normalize_top_k_affinities=True)
    return nxd_moe.RoutedExpertsMLPOpsConfig(**{**base, **overrides})


def _routing(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    affinities = torch.softmax(torch.randn(tokens, E, generator=gen), dim=-1)
    return affinities, affinities.topk(K, dim=-1).indices


def test_expert_mlps_v2_in_nxds_positional_order(moe_pkg):
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    blockwise = nxd_moe.BlockwiseMatmulConfig.from_kwargs(block_size=4)
    # NxD: (config, blockwise, return_bias, dtype, sequence_parallel_enabled, device, groups..., is_prefill, hybrid)
    experts = ExpertMLPsV2(_experts_config(), blockwise, False, torch.float32, False, torch.device("cpu"),
                           None, None, None, None, None, None, False, False)
    assert experts.blockwise_matmul_config is blockwise and experts.is_prefill is False
    # is_prefill=True beside enabled_hybrid_sharding=False: a swap of the two positions shows (both False above)
    assert ExpertMLPsV2(_experts_config(), blockwise, False, torch.float64, False, torch.device("cpu"), None, None,
                        None, None, None, None, True, False).is_prefill is True
    randomize_(experts, seed=7)
    x = randn(20, H, seed=8)
    affinities, index = _routing(20, seed=9)
    for seq_len in (20, 1):  # prefill (blockwise) and decode
        out = experts(x, affinities, index, seq_len)
        expected = reference_for_experts(experts, x, affinities, index)
        assert_close(out, expected, FP32_ATOL)
    assert (out.double() - reference_for_experts(experts, x, affinities, index.roll(1, 0))).abs().max() > 100 * (
        FP32_ATOL)  # negative control: another routing is far outside the bound
    with pytest.raises(ValueError, match="expert_affinities_masked_full must be None"):
        experts(x, affinities, index, 20, None, affinities)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(return_bias=True), ValueError, "return_bias must be False"),
    (dict(is_prefill=None), TypeError, "is_prefill must be a bool"),
    (dict(enabled_hybrid_sharding=True), ValueError, "enabled_hybrid_sharding=True needs \\['cte_tensor"),
    (dict(tensor_model_parallel_group=object()), RuntimeError, "tensor_model_parallel_group was given, but "
                                                                "nxd_moe.parallel_state is not initialized"),
])
def test_expert_mlps_v2_refusals(moe_pkg, kwargs, error, match):
    with pytest.raises(error, match=match):
        moe_pkg.expert_mlps_v2.ExpertMLPsV2(_experts_config(), **kwargs)


def test_expert_mlps_flat_arguments(moe_pkg):
    experts = moe_pkg.ExpertMLPs(E, K, H, INTER, "sigmoid", True, None, block_size=None,
                                 normalize_top_k_affinities=True, bias=True, glu_type="swiglu",
                                 hidden_act_scaling_factor=1.702, hidden_act_bias=1.0,
                                 gate_clamp_upper_limit=7.0, up_clamp_lower_limit=-7.0, up_clamp_upper_limit=7.0,
                                 skip_dma_token=True, use_shard_on_block_dynamic_while=True)
    cfg, blockwise = experts.routed_experts_mlp_config, experts.blockwise_matmul_config
    assert cfg.glu_type is nxd_moe.GLUType.SWIGLU and (cfg.hidden_act_bias, cfg.up_clamp_lower_limit) == (1.0, -7.0)
    assert cfg.use_index_calc_kernel is False  # ExpertMLPs' default, unlike the config's
    assert blockwise.block_size == 512 and blockwise.skip_dma_token and blockwise.use_shard_on_block_dynamic_while
    assert cfg.input_layer_init_method is torch.nn.init.kaiming_uniform_
    randomize_(experts, seed=10)
    x = randn(9, H, seed=11, scale=3.0)  # large enough that the +-7 clamps act
    affinities, index = _routing(9, seed=12)
    out = experts(x, affinities, index, 9)
    assert_close(out, reference_for_experts(experts, x, affinities, index), FP32_ATOL)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        moe_pkg.ExpertMLPs(E, K, H, INTER, "silu", True, 0.0)


def test_shared_experts_in_nxds_positional_order(moe_pkg):
    from neuronx_distributed.modules.moe.shared_experts import SharedExperts

    # NxD: (H, I, n, act, dtype, group, reduce_dtype, fused_gate_up_projection, sequence_parallel, transpose)
    shared = SharedExperts(H, 6, 2, "silu", torch.float32, None, torch.float32, True, False, True)
    assert (shared.fused_gate_up_projection, shared.transpose_weights, shared.reduce_dtype) == (
        True, True, torch.float32)
    randomize_(shared, seed=13)
    x = randn(5, H, seed=14)
    w_gate_up, w_down = shared.gate_up_proj.weight.double(), shared.down_proj.weight.double()  # transposed: (in, out)
    gate, up = (x.double() @ w_gate_up).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ w_down
    assert_close(shared(x, 5), expected, FP32_ATOL)
    assert (shared(x, 5).double() - (torch.sigmoid(gate) * up) @ w_down).abs().max() > 100 * FP32_ATOL


def _nxd_moe(moe_pkg, **kwargs):
    router = moe_pkg.routing.RouterTopK(num_experts=E, top_k=K, hidden_size=H)
    experts = moe_pkg.expert_mlps_v2.ExpertMLPsV2(_experts_config(), nxd_moe.BlockwiseMatmulConfig(block_size=4))
    return moe_pkg.MoE(router, experts, **kwargs)


def test_moe_with_nxds_arguments(moe_pkg):
    tkg = nxd_moe.config.MoEFusedTKGConfig(quantized=False, norm_topk_prob=True)
    moe = randomize_(_nxd_moe(moe_pkg, return_router_logits=True, token_shuffle_group_size=1, token_shuffle_seed=3,
                              init_tkg_module=True, tkg_config=tkg), seed=15).eval()
    assert moe.init_tkg_module and moe.tkg_config is tkg
    for shape in ((2, 6, H), (3, 1, H)):  # prefill, decode
        x = randn(*shape, seed=16)
        out, logits = moe(x)
        assert_close(out, reference_for_moe(moe, x), FP32_ATOL)
        # NxD's is_speculative_decoding (its fused-decode switch) changes nothing: the same function.
        assert torch.equal(moe(x, None, True)[0], out) and logits.shape == (shape[0] * shape[1], E)
    with pytest.raises(TypeError, match="is_speculative_decoding must be a bool"):
        moe(x, is_speculative_decoding=1)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(token_shuffle_group_size=2), ValueError, "token_shuffle_group_size must be 1"),
    (dict(init_tkg_module=True), TypeError, "init_tkg_module=True needs tkg_config"),
    (dict(init_tkg_module=True, tkg_config=nxd_moe.config.MoEFusedTKGConfig(quantized=False)), ValueError,
     "tkg_config.norm_topk_prob=False but the experts' normalize_top_k_affinities=True"),
    (dict(tensor_model_parallel_group=object()), RuntimeError, "MoE: tensor_model_parallel_group was given"),
])
def test_moe_refusals(moe_pkg, kwargs, error, match):
    with pytest.raises(error, match=match):
        _nxd_moe(moe_pkg, **kwargs)


def test_parallel_state_without_a_world(nxd_compat):  # noqa: F811
    from neuronx_distributed.parallel_layers import layers, mappings, parallel_state

    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(ValueError, match="pipeline_model_parallel_size must be 1, got 2 \\(nxd_moe has no pipeline"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size must be 1"):
        parallel_state.initialize_model_parallel(context_parallel_size=2)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        parallel_state.initialize_model_parallel(mesh_only=True)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    assert parallel_state.get_experts_for_expert_parallel_rank(1, 8, 4) == [2, 3]
    assert parallel_state.get_experts_for_expert_parallel_rank(
        expert_parallel_rank=0, total_number_of_experts=4, expert_model_parallel_size=2,
        expert_distribution=[[3, 0], [1, 2]]) == [3, 0]
    rank = layers.SPMDRank(world_size=1)
    assert rank.get_rank().tolist() == [0] and rank.rank.dtype == torch.int32 and not rank.rank.requires_grad
    with pytest.raises(RuntimeError, match="run the forward collective only"):
        mappings.reduce_from_tensor_model_parallel_region(torch.ones(2, requires_grad=True))
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        mappings.reduce_from_tensor_model_parallel_region(torch.ones(2))
