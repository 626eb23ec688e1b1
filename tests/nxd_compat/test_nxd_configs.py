"""NxD's config names and defaults in nxd_moe (``nxd_moe.config``), through the front door: the cases NxD's own
``test/unit_test/modules/moe/test_moe_configs.py`` checks (written here, since CI cannot fetch NxD), NxD's other
config fields and helpers, and the named errors kept where NxD silently misbehaves."""

from __future__ import annotations

import pytest
import torch

from nxd_moe.nxd_compat.pytest_plugin import nxd_compat  # noqa: F401 -- the fixture


@pytest.fixture
def moe_configs(nxd_compat):  # noqa: F811
    from neuronx_distributed.modules.moe import moe_configs

    return moe_configs


# ------------------------------------------------------------------------------------------------------------
# RouterConfig: NxD's twelve cases


@pytest.mark.parametrize("kwargs,act_fn,dtype", [
    ({}, "softmax", torch.float32),
    (dict(act_fn="gelu"), "gelu", torch.float32),
    (dict(dtype=torch.float16), "softmax", torch.float16),
    (dict(dtype=torch.bfloat16), "softmax", torch.bfloat16),
])
def test_router_config_constructor(moe_configs, kwargs, act_fn, dtype):
    config = moe_configs.RouterConfig(**kwargs)
    assert (config.act_fn, config.dtype) == (act_fn, dtype)


@pytest.mark.parametrize("kwargs,act_fn,dtype", [
    ({}, "softmax", torch.float32),
    (dict(router_act_fn="relu"), "relu", torch.float32),
    (dict(router_dtype=torch.float16), "softmax", torch.float16),
    (dict(router_dtype="float16"), "softmax", torch.float16),
    (dict(router_dtype="bfloat16"), "softmax", torch.bfloat16),
    (dict(router_dtype="float32"), "softmax", torch.float32),
    (dict(router_act_fn="gelu", router_dtype=torch.bfloat16), "gelu", torch.bfloat16),
    (dict(router_act_fn="relu", router_dtype=torch.float16, unrelated_param="ignored"), "relu", torch.float16),
])
def test_router_config_from_kwargs(moe_configs, kwargs, act_fn, dtype):
    config = moe_configs.RouterConfig.from_kwargs(**kwargs)
    assert (config.act_fn, config.dtype) == (act_fn, dtype)


def test_router_config_keeps_its_named_errors(moe_configs):
    with pytest.raises(ValueError, match="RouterConfig.act_fn must be one of.*got 'softmx'"):
        moe_configs.RouterConfig(act_fn="softmx")
    with pytest.raises(TypeError, match="RouterConfig.dtype must be a floating"):
        moe_configs.RouterConfig(dtype="int8")
    with pytest.raises(TypeError, match="did you mean 'router_dtype'"):
        moe_configs.RouterConfig.from_kwargs(router_dtpye="bfloat16")  # NxD would keep float32 silently
    from neuronx_distributed.modules.moe import routing

    with pytest.raises(ValueError, match="RouterTopK.act_fn must be one of \\['softmax', 'sigmoid'\\]"):
        routing.RouterTopK(num_experts=4, top_k=2, hidden_size=8, act_fn=moe_configs.RouterConfig("gelu").act_fn)


# ------------------------------------------------------------------------------------------------------------
# RoutedExpertsMLPOpsConfig, BlockwiseMatmulConfig, MoEFusedTKGConfig


def test_routed_experts_config_takes_nxds_positional_order(moe_configs):
    """NxD's 27 parameters in NxD's order, positionally (its ``__init__`` signature)."""
    init = lambda w: None  # noqa: E731
    config = moe_configs.RoutedExpertsMLPOpsConfig(
        8, 16, 12, 2, "sigmoid", True, True, "swiglu", 1.702, 1.0, 14, 10, None, False, False,
        7.0, None, 7.0, -7.0, True, False, init, init, 2.0, True, False, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert (config.num_experts, config.hidden_size, config.intermediate_size, config.top_k) == (8, 16, 12, 2)
    assert config.glu_type.value == "swiglu" and config.bias and config.hidden_act_bias == 1.0
    assert (config.hidden_size_actual, config.intermediate_size_actual) == (14, 10)
    assert config.use_index_calc_kernel is False and config.up_clamp_lower_limit == -7.0
    assert config.normalize_top_k_affinities and config.capacity_factor == 2.0 and config.enable_spmd_rank
    assert config.is_prefill is False and config.expert_distribution == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_routed_experts_config_defaults_are_nxds(moe_configs):
    config = moe_configs.RoutedExpertsMLPOpsConfig(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2,
                                                   hidden_act="silu", glu_mlp=True)
    assert config.use_index_calc_kernel is True and config.enable_spmd_rank is False
    assert config.is_prefill is None and config.expert_distribution is None
    assert config.is_hidden_dim_shuffled is None and config.is_intermediate_dim_shuffled is None
    assert config.glu_type is moe_configs.GLUType.GLU and config.capacity_factor is None


@pytest.mark.parametrize("kwargs,error,match", [
    # The deep dive's hidden_act="swiglu" (NxD rejects it too): the error says what to write.
    (dict(hidden_act="swiglu"), ValueError,
     "hidden_act='silu' with glu_mlp=True.*glu_type='swiglu', hidden_act='sigmoid', hidden_act_scaling_factor=1.702"),
    (dict(is_hidden_dim_shuffled=True), ValueError, "is_hidden_dim_shuffled must be None or False.*unshuffled"),
    (dict(is_intermediate_dim_shuffled=True), ValueError, "is_intermediate_dim_shuffled"),
    (dict(use_index_calc_kernel=1), TypeError, "use_index_calc_kernel must be a bool"),
    (dict(enable_spmd_rank="yes"), TypeError, "enable_spmd_rank must be a bool"),
    (dict(is_prefill=0), TypeError, "is_prefill must be a bool"),
    (dict(expert_distribution=[[0, 1], [2, 4]]), ValueError, "expert_distribution names experts \\[4\\]"),
    (dict(expert_distribution=[[0, 1], [2]]), ValueError, "same number of experts"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be > 0"),  # NxD: capacity 0, every token dropped
    (dict(glu_type="geglu"), ValueError, "glu_type must be 'glu' or 'swiglu'"),
])
def test_routed_experts_config_named_errors(moe_configs, kwargs, error, match):
    base = dict(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2, hidden_act="silu", glu_mlp=True)
    with pytest.raises(error, match=match):
        moe_configs.RoutedExpertsMLPOpsConfig(**{**base, **kwargs})


def test_blockwise_config_from_kwargs_and_its_strictness(moe_configs):
    config = moe_configs.BlockwiseMatmulConfig.from_kwargs(block_size=256, block_sharding_strategy="PING_PONG",
                                                           skip_dma_token=True)
    assert config.block_sharding_strategy is moe_configs.BlockShardStrategy.PING_PONG
    assert config.skip_dma == (True, False) and moe_configs.BlockwiseMatmulConfig.default().block_size == 512
    # NxD drops unknown keys silently (a typo keeps the default); here it is named.
    with pytest.raises(TypeError, match="unknown key\\(s\\) \\['skip_dma_tokens'\\]"):
        moe_configs.BlockwiseMatmulConfig.from_kwargs(skip_dma_tokens=True)


def test_fused_tkg_config(moe_configs):
    config = moe_configs.MoEFusedTKGConfig(quantized=False, moe_fused_kernel_enabled=True, norm_topk_prob=True,
                                           router_mm_dtype="bfloat16")
    assert config.router_mm_dtype == torch.bfloat16 and config.is_mxfp4_compute is None
    with pytest.raises(TypeError, match="MoEFusedTKGConfig.quantized must be a bool"):
        moe_configs.MoEFusedTKGConfig(quantized=None)
    with pytest.raises(TypeError, match="MoEFusedTKGConfig.router_topk_kernel_enabled"):
        moe_configs.MoEFusedTKGConfig(quantized=False, router_topk_kernel_enabled="on")


def test_to_torch_dtype(moe_configs):
    assert moe_configs.to_torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(TypeError, match="dtype must be a floating"):
        moe_configs.to_torch_dtype("int8")


# ------------------------------------------------------------------------------------------------------------
# model_utils


def test_model_utils_tables(nxd_compat, monkeypatch):  # noqa: F811
    from neuronx_distributed.modules.moe import model_utils

    assert sorted(model_utils.ACT2FN) == ["gelu", "leaky_relu", "relu", "sigmoid", "silu", "tanh"]
    x = torch.linspace(-3, 3, 7)
    # fused silu vs two fp32 ops: a couple of ulps (2^-23) of |x| <= 3.
    torch.testing.assert_close(model_utils.ACT2FN["silu"](x), x * torch.sigmoid(x), atol=1e-6, rtol=0)
    assert model_utils.GLUType.validate(None) is model_utils.GLUType.GLU
    assert model_utils.GLUType.validate("SWIGLU") is model_utils.GLUType.SWIGLU
    with pytest.raises(ValueError, match="glu_type must be one of \\['glu', 'swiglu'\\]"):
        model_utils.GLUType.validate("geglu")
    # NxD's kernel activation ids (they index the kernels' enum: SILU 0 ... LEAKY_RELU 6).
    assert [(m.name_str, m.id) for m in model_utils.ACTFunc] == [
        ("silu", 0), ("gelu", 1), ("gelu_tanh_approx", 2), ("sigmoid", 3), ("relu", 4), ("tanh", 5),
        ("leaky_relu", 6)]
    assert model_utils.ACTFunc.validate("relu") is model_utils.ACTFunc.RELU
    assert model_utils.ACTFunc.validate(None) is model_utils.ACTFunc.SIGMOID
    with pytest.raises(ValueError, match="act_func must be"):
        model_utils.ACTFunc.validate("swish")
    get_id = model_utils.get_kernel_activation_func_id
    assert get_id(model_utils.ACTFunc.SILU, model_utils.GLUType.GLU) == 0
    assert get_id(model_utils.ACTFunc.SIGMOID, "swiglu") == 3
    with pytest.raises(ValueError, match="no MoE kernel computes glu_type='glu' with ACTFunc.GELU"):
        get_id(model_utils.ACTFunc.GELU, model_utils.GLUType.GLU)
    assert (model_utils.DEFAULT_BLOCK_SIZE, model_utils.DEFAULT_PADDING_VALUE) == (512, -1)
    assert model_utils.DEFAULT_SKIP_MODE == (False, False) and model_utils.DEFAULT_SELECTIVE_LOADING_THRESHOLD == 1.0
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert model_utils.DEFAULT_LNC_SIZE == 2
    with pytest.raises(AttributeError, match="has no attribute 'DEFAULT_LNC'"):
        model_utils.DEFAULT_LNC  # noqa: B018
