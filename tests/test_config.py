"""Configuration objects: NxD defaults, derived fields, normalisation, and the shipped model configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from nxd_moe import (
    BlockShardStrategy,
    BlockwiseMatmulConfig,
    GLUType,
    MoEModelConfig,
    RoutedExpertsMLPOpsConfig,
    SkipMode,
    builtin_config_names,
    load_model_config,
)
from nxd_moe.config import CONFIG_DIR, to_torch_dtype


def test_blockwise_defaults_match_nxd(monkeypatch):
    """NxD's ``BlockwiseMatmulConfig.from_kwargs()`` defaults (api reference section 1.2.1), all 15 fields."""
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    cfg = BlockwiseMatmulConfig.from_kwargs()
    expected = dict(
        block_size=512,
        use_block_parallel=False,
        block_sharding_strategy=BlockShardStrategy.HI_LO,
        skip_dma_token=False,
        skip_dma_weight=False,
        logical_nc_config=1,
        blockwise_nki_autograd_cls=None,
        use_torch_block_wise=False,
        parallelize_token_to_block_mapping=True,
        optimized_block_to_token_mapping=True,
        always_augment_inputs_for_blockwise_matmul=False,
        use_shard_on_intermediate_dynamic_while=False,
        use_shard_on_block_dynamic_while=False,
        num_static_blocks=None,
        pad_num_blocks_to_even=False,
    )
    assert {f.name for f in dataclasses.fields(cfg)} == set(expected)
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name
    assert BlockwiseMatmulConfig.default() == cfg == BlockwiseMatmulConfig()


def test_blockwise_derived_fields_and_immutability():
    cfg = BlockwiseMatmulConfig(skip_dma_token=True, use_shard_on_block_dynamic_while=True,
                                block_sharding_strategy="ping_pong")
    assert cfg.skip_dma == SkipMode(True, False) and cfg.skip_dma.skip_token and not cfg.skip_dma.skip_weight
    assert cfg.use_dynamic_while
    assert cfg.block_sharding_strategy is BlockShardStrategy.PING_PONG
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 128
    # asking for skip_dma never mutates a shared default (NxD quirk Q7)
    default = BlockwiseMatmulConfig.default()
    _ = default.skip_dma
    assert "skip_dma" not in vars(default) and default == BlockwiseMatmulConfig()


def test_routed_experts_defaults_and_normalisation():
    cfg = RoutedExpertsMLPOpsConfig(num_experts=8, hidden_size=32, intermediate_size=16, top_k=2,
                                    hidden_act="silu", glu_mlp=True)
    assert cfg.bias is False and cfg.glu_type is GLUType.GLU
    assert cfg.hidden_act_scaling_factor == 1.0 and cfg.hidden_act_bias == 0.0
    assert cfg.capacity_factor is None and cfg.dropless
    assert cfg.selective_loading_threshold == 1.0
    assert not cfg.normalize_top_k_affinities and not cfg.early_expert_affinity_modulation
    # strings and None normalise to the enum
    assert cfg.replace(glu_type="SwiGLU").glu_type is GLUType.SWIGLU
    assert cfg.replace(glu_type=None).glu_type is GLUType.GLU
    # capacity factor: >= E/k is full capacity (dropless), below that it is kept as a float
    assert cfg.replace(capacity_factor=4).capacity_factor is None
    assert cfg.replace(capacity_factor=100.0).capacity_factor is None
    kept = cfg.replace(capacity_factor=1)
    assert kept.capacity_factor == 1.0 and isinstance(kept.capacity_factor, float) and not kept.dropless
    assert cfg.replace(hidden_act_scaling_factor=2).hidden_act_scaling_factor == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3


def test_config_objects_are_not_mutated_by_modules():
    """NxD shifts the up-clamp limits by hidden_act_bias in place (quirk Q2); we never touch the config."""
    from nxd_moe import ExpertMLPsV2

    cfg = RoutedExpertsMLPOpsConfig(num_experts=4, hidden_size=8, intermediate_size=8, top_k=2,
                                    hidden_act="sigmoid", glu_mlp=True, glu_type="swiglu", hidden_act_bias=1.0,
                                    up_clamp_lower_limit=-7.0, up_clamp_upper_limit=7.0)
    before = dataclasses.asdict(cfg)
    bcfg = BlockwiseMatmulConfig()
    ExpertMLPsV2(cfg, bcfg)
    ExpertMLPsV2(cfg, bcfg)
    assert dataclasses.asdict(cfg) == before
    assert bcfg == BlockwiseMatmulConfig()


def test_to_torch_dtype():
    assert to_torch_dtype("bf16") is torch.bfloat16
    assert to_torch_dtype("torch.float32") is torch.float32
    assert to_torch_dtype(torch.float64) is torch.float64
    with pytest.raises(TypeError, match="my_dtype"):
        to_torch_dtype("int8", "my_dtype")
    with pytest.raises(TypeError, match="floating"):
        to_torch_dtype(torch.int32)


# ----------------------------------------------------------------------------------------------------------
# model configs


EXPECTED = {
    # name: (E, k, H, I, router type, act_fn, normalize_top_k, shared)
    "mixtral-8x7b": (8, 2, 4096, 14336, "topk", "softmax", True, False),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "topk", "softmax", True, False),
    "qwen3-235b-a22b": (128, 8, 4096, 1536, "topk", "softmax", True, False),
    "dbrx": (16, 4, 6144, 10752, "topk", "softmax", True, False),
    "deepseek-v3": (256, 8, 7168, 2048, "group_limited", "sigmoid", False, True),
    "gpt-oss-20b": (32, 4, 2880, 2880, "topk", "softmax", False, False),
    "gpt-oss-120b": (128, 4, 2880, 2880, "topk", "softmax", False, False),
    "llama4-scout": (16, 1, 5120, 8192, "topk", "sigmoid", False, True),
    "llama4-maverick": (128, 1, 5120, 8192, "topk", "sigmoid", False, True),
}


def test_builtin_configs_listed():
    assert builtin_config_names() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_config_numbers(name):
    cfg = load_model_config(name)
    e, k, h, i, router, act, normalize, shared = EXPECTED[name]
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (e, k, h, i)
    assert cfg.router.type == router and cfg.router.act_fn == act
    experts = cfg.routed_experts_config()
    assert experts.normalize_top_k_affinities is normalize
    assert (cfg.shared_experts is not None) is shared
    assert isinstance(cfg.blockwise_config(), BlockwiseMatmulConfig)
    # the same config through a path and through a mapping
    assert load_model_config(CONFIG_DIR / f"{name}.yaml") == cfg
    with open(CONFIG_DIR / f"{name}.yaml") as f:
        assert load_model_config(yaml.safe_load(f)) == cfg


def test_gpt_oss_and_llama4_semantics():
    gpt = load_model_config("gpt-oss-20b").routed_experts_config()
    assert gpt.glu_type is GLUType.SWIGLU and gpt.hidden_act == "sigmoid"
    assert gpt.hidden_act_scaling_factor == 1.702 and gpt.hidden_act_bias == 1.0 and gpt.bias
    assert (gpt.gate_clamp_upper_limit, gpt.up_clamp_lower_limit, gpt.up_clamp_upper_limit) == (7.0, -7.0, 7.0)
    assert load_model_config("gpt-oss-20b").router.apply_act_fn_over_topk
    llama = load_model_config("llama4-scout").routed_experts_config()
    assert llama.early_expert_affinity_modulation and llama.top_k == 1
    ds = load_model_config("deepseek-v3").router
    assert (ds.n_group, ds.topk_group, ds.normalize, ds.routed_scaling_factor) == (8, 4, True, 2.5)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scaled_config_keeps_routing_structure(name):
    cfg = load_model_config(name)
    small = cfg.scaled(16)
    assert (small.num_experts, small.top_k, small.router) == (cfg.num_experts, cfg.top_k, cfg.router)
    assert small.hidden_size % 8 == 0 and small.intermediate_size % 8 == 0
    assert small.hidden_size == max(8, -(-cfg.hidden_size // 128) * 8)
    assert cfg.scaled(1) is cfg
    with pytest.raises(ValueError, match="scale"):
        cfg.scaled(0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_to_dict_round_trip(name):
    cfg = load_model_config(name)
    assert MoEModelConfig.from_dict(cfg.to_dict()) == cfg


def test_model_config_errors_name_the_key(tmp_path):
    base = load_model_config("mixtral-8x7b").to_dict()
    with pytest.raises(ValueError, match="bogus"):
        MoEModelConfig.from_dict({**base, "bogus": 1})
    with pytest.raises(ValueError, match="hiden_act"):
        MoEModelConfig.from_dict({**base, "experts": {**base["experts"], "hiden_act": "silu"}})
    with pytest.raises(ValueError, match="n_group"):
        MoEModelConfig.from_dict({**base, "router": {"type": "group_limited"}})
    with pytest.raises(ValueError, match="router.type"):
        MoEModelConfig.from_dict({**base, "router": {"type": "expert_choice"}})
    with pytest.raises(TypeError, match="blok_size"):
        MoEModelConfig.from_dict({**base, "blockwise": {"blok_size": 4}})
    with pytest.raises(ValueError, match="top_k"):
        MoEModelConfig.from_dict({**base, "top_k": 9})
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**base, "top_k": 0}))
    with pytest.raises(ValueError, match="bad.yaml.*top_k"):
        load_model_config(bad)
    with pytest.raises(FileNotFoundError, match="built-in"):
        load_model_config("no-such-model")


def test_nxd_moe_config_is_the_public_path_of_the_config_modules():
    """``nxd_moe.config`` re-exports checks, fingerprint, moe_configs and model_config, and their classes and functions
    keep it as their ``__module__`` (their home before the split): pickles name it, and annotations resolve there."""
    import pickle
    import types
    import typing

    import nxd_moe.config as config
    from nxd_moe import checks, fingerprint, model_config, moe_configs

    homes = (checks, fingerprint, moe_configs, model_config)
    for name in config.__all__:
        value = getattr(config, name)
        assert any(vars(m).get(name) is value for m in homes), name
        if isinstance(value, (type, types.FunctionType)) and name != "check_limits":  # check_limits: new
            assert value.__module__ == "nxd_moe.config", name
    cfg = load_model_config("qwen3-30b-a3b")
    for obj in (cfg, cfg.routed_experts_config(), cfg.blockwise_config(), GLUType.SWIGLU, SkipMode(True, False),
                config.ExpertParallelConfig(), config.RouterConfig(), config.MoEFusedTKGConfig(quantized=False)):
        data = pickle.dumps(obj)
        assert b"nxd_moe.config" in data and pickle.loads(data) == obj
        if dataclasses.is_dataclass(obj):
            assert set(typing.get_type_hints(type(obj))) == {f.name for f in dataclasses.fields(obj)}
