"""nxd_moe.hf's readers and converters, piece by piece: which format a block's tensors are stored in, the config
readers' fields, the families' key layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from nxd_moe.hf.stored_formats import hf_quantization, nxd_quantization  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# stored_formats: the format a state dict's tensors are stored in, read from the tensors


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("weight,scale,expected", [
    (meta(2, 256, 384, dtype=torch.float8_e4m3fn), meta(2, 1, 384), "fp8"),  # one scale per column of N
    (meta(2, 256, 384, dtype=torch.float8_e4m3fn), meta(2, 2, 3), "fp8_block"),  # 128 x 128 tiles
    (meta(2, 128, 384, dtype=torch.uint8), meta(2, 8, 384, dtype=torch.uint8), "mxfp4"),
    (meta(2, 256, 384), None, "bf16"),
])
def test_nxd_quantization_reads_the_format_from_the_scales_shape(weight, scale, expected):
    routed = {"expert_mlps.mlp_op.gate_up_proj.weight": weight}
    shared = {"shared_experts.down_proj.weight": weight[0]}  # (in, out), as our quantized projections store it
    if scale is not None:
        routed["expert_mlps.mlp_op.gate_up_proj.scale"] = scale
        shared["shared_experts.down_proj.scale"] = scale[0]
    assert nxd_quantization(routed) == expected
    assert nxd_quantization(shared, "shared_experts.down_proj.") == expected
    assert nxd_quantization(shared) == "bf16"  # the routed experts' keys are not there


def test_hf_quantization_reads_routed_and_shared_experts_apart():
    assert hf_quantization({"experts.gate_up_proj": 0, "shared_expert.up_proj.weight": 0}) == ("bf16", "bf16")
    assert hf_quantization({"experts.gate_up_proj_blocks": 0, "experts.gate_up_proj_scales": 0}) == ("mxfp4", "bf16")
    assert hf_quantization({"experts.3.up_proj.weight_scale_inv": 0}) == ("fp8_block", "bf16")
    assert hf_quantization({"experts.3.up_proj.weight": 0, "shared_experts.up_proj.weight_scale_inv": 0}) == (
        "bf16", "fp8_block")
    assert hf_quantization({"gate_blocks": 0}) == ("bf16", "bf16")  # _blocks counts under experts. only


# ----------------------------------------------------------------------------------------------------------
# blocks: from_hf_moe_block's defaults and messages


def fake_block(class_name: str, parts: dict) -> torch.nn.Module:
    """A module named like a transformers block whose state dict is ``parts`` (stored formats transformers builds
    only with its own quantizers)."""
    return type(class_name, (torch.nn.Module,), {"state_dict": lambda self, *args, **kwargs: dict(parts)})()


def unprefixed(sd: dict, prefix: str = "model.layers.0.mlp.") -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def qwen3_block(dtype=torch.float32):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                            head_dim=16)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    return config, block.to(dtype)


def test_from_hf_moe_block_names_what_it_refuses():
    from nxd_moe.hf import from_hf_moe_block

    config, block = qwen3_block()
    with pytest.raises(TypeError) as error:
        from_hf_moe_block(42, config)
    assert str(error.value) == "from_hf_moe_block: block must be an nn.Module, got int"
    with pytest.raises(TypeError) as error:
        from_hf_moe_block(block, config, scale=2)
    assert str(error.value) == "from_hf_moe_block: 'scale' would change the shapes the block's weights need"
    with pytest.raises(TypeError) as error:
        from_hf_moe_block(torch.nn.Linear(2, 2), config)
    assert str(error.value) == ("from_hf_moe_block: config is 'qwen3_moe', whose MoE block is Qwen3MoeSparseMoeBlock, "
                                "got Linear")
    parts = {**block.state_dict(), "experts.down_proj": torch.zeros(4, 32, 8)}
    with pytest.raises(ValueError) as error:
        from_hf_moe_block(fake_block("Qwen3MoeSparseMoeBlock", parts), config)
    assert str(error.value) == ("HF key 'Qwen3MoeSparseMoeBlock.experts.down_proj' has shape (4, 32, 8), the config "
                                "expects (4, 32, 16)")


def test_from_hf_moe_block_takes_the_experts_dtype_and_a_given_device():
    from nxd_moe.hf import from_hf_moe_block

    config, block = qwen3_block(torch.bfloat16)
    parts = {**block.state_dict(), "gate.weight": block.state_dict()["gate.weight"].float()}  # a float32 router
    moe = from_hf_moe_block(fake_block("Qwen3MoeSparseMoeBlock", parts), config, device="cpu")
    assert moe.expert_mlps.mlp_op.down_proj.weight.dtype == torch.bfloat16  # the experts' dtype, not the router's
    assert torch.equal(moe.expert_mlps.mlp_op.down_proj.weight, parts["experts.down_proj"].transpose(1, 2))


def test_from_hf_moe_block_builds_on_the_meta_device_first(monkeypatch):
    import nxd_moe.hf.blocks as blocks

    devices = []

    def build_moe(cfg, **kwargs):
        devices.append(kwargs.get("device"))
        return original(cfg, **kwargs)

    original = blocks.build_moe
    monkeypatch.setattr(blocks, "build_moe", build_moe)
    config, block = qwen3_block()
    blocks.from_hf_moe_block(block, config)
    assert devices == ["meta"]


def test_from_hf_moe_block_loads_quantized_blocks_in_their_stored_formats():
    from test_quantization import deepseek_v3_fp8_checkpoint, gpt_oss_mxfp4_checkpoint

    from nxd_moe.hf import from_hf_moe_block

    config, sd = gpt_oss_mxfp4_checkpoint()
    parts = unprefixed(sd)
    parts = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in parts.items()}
    moe = from_hf_moe_block(fake_block("GptOssMLP", parts), config)
    assert moe.expert_mlps.routed_experts_mlp_config.quantization == "mxfp4"
    assert moe.expert_mlps.mlp_op.gate_up_proj.weight.dtype == torch.uint8
    assert moe.expert_mlps.mlp_op.gate_up_proj.bias.dtype == torch.bfloat16  # the router's dtype: the model's

    config, sd, _ = deepseek_v3_fp8_checkpoint(shared="fp8_block")
    moe = from_hf_moe_block(fake_block("DeepseekV3MoE", unprefixed(sd)), config)
    assert moe.expert_mlps.routed_experts_mlp_config.quantization == "fp8_block"
    assert moe.shared_experts.down_proj.format.name == "fp8_block"
    assert moe.router.linear_router.weight.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------
# configs: every field a reader needs is named when missing, with the model type


def _dbrx_ffn(**changes):
    fields = dict(moe_num_experts=8, moe_top_k=2, ffn_hidden_size=96, moe_normalize_expert_weights=1,
                  ffn_act_fn={"name": "silu"})
    return SimpleNamespace(**{**fields, **changes})


# model type -> the fields its reader takes, all away from any default (nested DBRX ffn_config fields apart)
READ_FIELDS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=3, hidden_act="silu"),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=96,
                      decoder_sparse_step=1, num_hidden_layers=3, mlp_only_layers=None, norm_topk_prob=True,
                      hidden_act="silu"),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=96,
                      decoder_sparse_step=1, num_hidden_layers=3, mlp_only_layers=None, norm_topk_prob=True,
                      hidden_act="silu", shared_expert_intermediate_size=128),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=3),
    "deepseek_v3": dict(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                        hidden_size=64, moe_intermediate_size=96, n_group=2, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, hidden_act="silu", n_shared_experts=2),
    "llama4_text": dict(num_local_experts=8, num_experts_per_tok=1, hidden_size=64, intermediate_size=96,
                        hidden_act="silu", moe_layers=[1, 3]),
    "dbrx": dict(d_model=64, n_layers=3, ffn_config=None),
}
REQUIRED = [(t, f) for t, fields in READ_FIELDS.items() for f in fields
            if f not in ("hidden_act", "mlp_only_layers", "norm_topk_prob", "first_k_dense_replace",
                         "n_shared_experts")] + [
    ("dbrx", f) for f in ("moe_num_experts", "moe_top_k", "ffn_hidden_size")]


@pytest.fixture
def gpt_oss_experts(monkeypatch):
    """GPT-OSS's SwiGLU constants from a stand-in experts module (the reader builds one from the config)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.alpha, self.limit = 1.25, 3.5

    monkeypatch.setattr(modeling_gpt_oss, "GptOssExperts", Experts)


def namespace(model_type: str, **changes) -> SimpleNamespace:
    fields = {**READ_FIELDS[model_type], **changes}
    if model_type == "dbrx" and "ffn_config" not in changes:
        fields["ffn_config"] = _dbrx_ffn()
    return SimpleNamespace(model_type=model_type, **fields)


@pytest.mark.parametrize("model_type,field", REQUIRED)
def test_a_missing_field_is_named_with_the_model_type(model_type, field, gpt_oss_experts):
    from nxd_moe.hf import from_hf_config

    if model_type == "dbrx" and field in ("moe_num_experts", "moe_top_k", "ffn_hidden_size"):
        config = namespace("dbrx", ffn_config=_dbrx_ffn(**{field: None}))
    else:
        config = namespace(model_type, **{field: None})
    with pytest.raises(ValueError) as error:
        from_hf_config(config)
    assert str(error.value) == f"from_hf_config({model_type}): config.{field} must be set, got None"


@pytest.mark.parametrize("model_type", [t for t in READ_FIELDS if t not in ("gpt_oss", "dbrx")])
def test_an_unsupported_activation_is_named_with_the_model_type(model_type):
    from nxd_moe.hf import from_hf_config

    with pytest.raises(ValueError) as error:
        from_hf_config(namespace(model_type, hidden_act="gelu_new"))
    assert str(error.value) == (f"from_hf_config({model_type}): hidden_act='gelu_new' is not supported; the experts "
                                "support ['gelu', 'leaky_relu', 'relu', 'sigmoid', 'silu', 'tanh']")
    assert from_hf_config(namespace(model_type, hidden_act="swish")).experts["hidden_act"] == "silu"
    assert from_hf_config(namespace(model_type, hidden_act="relu")).experts["hidden_act"] == "relu"


def test_dbrx_activation_defaults_to_silu_and_its_errors_are_named():
    from nxd_moe.hf import from_hf_config

    for act in (None, {}, {"limit": 1}):
        assert from_hf_config(namespace("dbrx", ffn_config=_dbrx_ffn(ffn_act_fn=act))).experts["hidden_act"] == "silu"
    relu = from_hf_config(namespace("dbrx", ffn_config=_dbrx_ffn(ffn_act_fn={"name": "relu"})))
    assert relu.experts["hidden_act"] == "relu"
    with pytest.raises(ValueError) as error:
        from_hf_config(namespace("dbrx", ffn_config=_dbrx_ffn(ffn_act_fn={"name": "gelu_new"})))
    assert str(error.value) == ("from_hf_config(dbrx): ffn_config.ffn_act_fn['name']='gelu_new' is not supported; the "
                                "experts support ['gelu', 'leaky_relu', 'relu', 'sigmoid', 'silu', 'tanh']")
    with pytest.raises(ValueError) as error:
        from_hf_config(namespace("dbrx", ffn_config=_dbrx_ffn(moe_normalize_expert_weights=2)))
    assert str(error.value) == ("from_hf_config(dbrx): ffn_config.moe_normalize_expert_weights=2 is not supported; "
                                "only None (no normalisation) and 1 (L1 renormalisation of the top-k weights) map "
                                "onto normalize_top_k_affinities")


def test_gpt_oss_swiglu_read_from_an_experts_module_without_the_attributes(monkeypatch):
    """An experts class that keeps no ``limit`` clamps nothing; one without ``alpha`` is refused by name."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from nxd_moe.hf import from_hf_config

    class NoLimit(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.alpha = 1.25

    class NoAlpha(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.limit = 3.5

    monkeypatch.setattr(modeling_gpt_oss, "GptOssExperts", NoLimit)
    rc = from_hf_config(namespace("gpt_oss")).routed_experts_config()
    assert rc.hidden_act_scaling_factor == 1.25
    assert (rc.gate_clamp_upper_limit, rc.up_clamp_lower_limit, rc.up_clamp_upper_limit) == (None, None, None)
    monkeypatch.setattr(modeling_gpt_oss, "GptOssExperts", NoAlpha)
    with pytest.raises(ValueError) as error:
        from_hf_config(namespace("gpt_oss"))
    assert str(error.value) == "from_hf_config(gpt_oss): config.swiglu_alpha must be a number, got None"


def test_config_messages_name_the_model_type_and_the_choices():
    from nxd_moe.hf import from_hf_config

    supported = ("['mixtral', 'qwen3_moe', 'qwen2_moe', 'gpt_oss', 'deepseek_v3', 'llama4_text', 'llama4', "
                 "'dbrx']")
    cases = [
        (dict(model_type="llama"), ValueError, f"model_type 'llama' is not supported by nxd_moe.hf; supported: "
                                               f"{supported}"),
        (SimpleNamespace(model_type="llama"), ValueError, f"model_type 'llama' is not supported by nxd_moe.hf; "
                                                          f"supported: {supported}"),
        (dict(model_type=3), ValueError, f"from_hf_config: a config dict needs a 'model_type' string; supported: "
                                         f"{supported}"),
        (SimpleNamespace(model_type=None), TypeError, "from_hf_config: config must be a transformers "
                                                      "PretrainedConfig or a dict, got SimpleNamespace"),
        (namespace("qwen3_moe", num_experts=0), ValueError, "from_hf_config(qwen3_moe): config.num_experts is 0, "
                                                            "the model has no MoE layer"),
        (namespace("qwen2_moe", num_experts=0), ValueError, "from_hf_config(qwen2_moe): config.num_experts is 0, "
                                                            "the model has no MoE layer"),
        (namespace("deepseek_v3", first_k_dense_replace=4), ValueError, "from_hf_config(deepseek_v3): "
         "first_k_dense_replace=4 >= num_hidden_layers=4, the model has no MoE layer"),
    ]
    for config, kind, message in cases:
        with pytest.raises(kind) as error:
            from_hf_config(config)
        assert str(error.value) == message


def test_config_readers_read_every_field(gpt_oss_experts):
    from nxd_moe.config import RouterSpec, SharedExpertsSpec
    from nxd_moe.hf import from_hf_config

    def routing(cfg):
        return cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, cfg.num_moe_layers

    qwen2 = from_hf_config(namespace("qwen2_moe", decoder_sparse_step=3, num_hidden_layers=9, mlp_only_layers=[5],
                                     norm_topk_prob=0))
    assert routing(qwen2) == (8, 2, 64, 96, 2)  # every third layer, 2 and 8 (5 is dense)
    assert qwen2.experts == dict(hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=False)
    assert qwen2.shared_experts == SharedExpertsSpec(num_shared_experts=1, intermediate_size=128, gate=True)
    assert qwen2.name == "hf:qwen2_moe" and qwen2.hf_model_type == "qwen2_moe"
    assert qwen2.source == "nxd_moe.hf.from_hf_config(SimpleNamespace)"
    assert qwen2.blockwise == {"block_size": 512}  # no shipped Qwen2-MoE config: NxD's default
    qwen3 = from_hf_config(namespace("qwen3_moe"))
    assert routing(qwen3) == (8, 2, 64, 96, 3) and qwen3.shared_experts is None
    assert qwen3.experts["normalize_top_k_affinities"] is True

    deepseek = from_hf_config(namespace("deepseek_v3"))
    assert routing(deepseek) == (8, 2, 64, 96, 3)
    assert deepseek.router == RouterSpec(type="group_limited", act_fn="sigmoid", n_group=2, topk_group=1,
                                         normalize=True, routed_scaling_factor=2.5)
    assert deepseek.shared_experts == SharedExpertsSpec(num_shared_experts=2, intermediate_size=96)
    dense_none = from_hf_config(namespace("deepseek_v3", first_k_dense_replace=None, n_shared_experts=0))
    assert dense_none.num_moe_layers == 4 and dense_none.shared_experts is None

    llama = from_hf_config(namespace("llama4_text"))
    assert routing(llama) == (8, 1, 64, 96, 2)
    assert llama.router == RouterSpec(type="topk", act_fn="sigmoid")
    assert llama.experts == dict(hidden_act="silu", glu_mlp=True, early_expert_affinity_modulation=True,
                                 normalize_top_k_affinities=False)
    assert llama.shared_experts == SharedExpertsSpec(num_shared_experts=1, intermediate_size=96)
    assert llama.blockwise == {"block_size": 256}  # every shipped Llama 4 config's

    gpt = from_hf_config(namespace("gpt_oss"))
    assert routing(gpt) == (8, 2, 64, 96, 3)
    assert gpt.experts == dict(hidden_act="sigmoid", glu_mlp=True, glu_type="swiglu", hidden_act_scaling_factor=1.25,
                               hidden_act_bias=1.0, bias=True, normalize_top_k_affinities=False,
                               gate_clamp_upper_limit=3.5, up_clamp_lower_limit=-3.5, up_clamp_upper_limit=3.5)

    dbrx = from_hf_config(namespace("dbrx"))
    assert routing(dbrx) == (8, 2, 64, 96, 3)
    assert dbrx.experts == dict(hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    mixtral = from_hf_config(namespace("mixtral"))
    assert routing(mixtral) == (8, 2, 64, 96, 3)
    assert mixtral.experts == dict(hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    override = from_hf_config(namespace("mixtral"), blockwise={"block_size": 32})
    assert override.blockwise == {"block_size": 32}


# ----------------------------------------------------------------------------------------------------------
# checkpoints: what a bad checkpoint is told


def mixtral_checkpoint(layout: str, prefix: str) -> tuple:
    """``(config, zero-valued state dict of one Mixtral block at prefix)`` with the keys and shapes of ``layout``."""
    from nxd_moe.hf import from_hf_config
    from nxd_moe.hf.checkpoints import meta_state_dict
    from nxd_moe.hf.families import family_of

    cfg = from_hf_config(namespace("mixtral"))
    hf = family_of(cfg).from_nxd(meta_state_dict(cfg), layout)
    return cfg, {prefix + k: torch.zeros(v.shape) for k, v in hf.items()}


@pytest.mark.parametrize("missing", [6, 7])
def test_missing_keys_are_listed_six_at_most(missing):
    from nxd_moe.hf import hf_to_nxd_state_dict

    where = "model.layers.0.block_sparse_moe."
    cfg, sd = mixtral_checkpoint("hub", where)
    gone = sorted(k for k in sd if ".experts." in k)[-missing:]
    for key in gone:
        del sd[key]
    listing = ", ".join(repr(k) for k in gone[:6]) + (" ... (7 in all)" if missing == 7 else "")
    with pytest.raises(ValueError) as error:
        hf_to_nxd_state_dict(sd, cfg)
    assert str(error.value) == (f"HF MoE block {where!r} is missing {listing}; merge all checkpoint shards before "
                                "converting")


def test_converting_names_the_bad_argument_and_a_block_given_twice():
    from nxd_moe.hf import hf_to_nxd_state_dict

    cfg, memory = mixtral_checkpoint("transformers", "model.layers.0.mlp.")
    with pytest.raises(TypeError) as error:
        hf_to_nxd_state_dict(list(memory.items()), cfg)
    assert str(error.value) == "state_dict must be a mapping of str to tensors, got list"
    _, hub = mixtral_checkpoint("hub", "model.layers.0.block_sparse_moe.")
    with pytest.raises(ValueError, match=r"^two source keys convert to 'model\.layers\.0\.mlp\.[a-z_.]+'; the state "
                                         r"dict holds the same block twice \(e\.g\. in both the transformers and the "
                                         r"Hub layout\)$"):
        hf_to_nxd_state_dict({**memory, **hub}, cfg)


def test_load_hf_layer_names_its_arguments_and_the_blocks_it_found():
    from nxd_moe import build_moe
    from nxd_moe.hf import load_hf_layer

    cfg, memory = mixtral_checkpoint("transformers", "model.layers.0.mlp.")
    _, hub = mixtral_checkpoint("hub", "model.layers.0.block_sparse_moe.")
    moe = build_moe(cfg, device="meta")
    for moe_arg, layer, message in ((3, 0, "load_hf_layer: moe must be an nxd_moe MoE, got int"),
                                    (moe, "0", "load_hf_layer: layer must be an int, got str"),
                                    (moe, True, "load_hf_layer: layer must be an int, got bool")):
        with pytest.raises(TypeError) as error:
            load_hf_layer(moe_arg, memory, cfg, layer)
        assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        load_hf_layer(moe, {**memory, **hub}, cfg, 0)
    assert str(error.value) == ("load_hf_layer: layer 0 has several blocks ['model.layers.0.block_sparse_moe.', "
                                "'model.layers.0.mlp.']")
    with pytest.raises(ValueError) as error:
        load_hf_layer(moe, memory, cfg, 1)
    assert str(error.value) == "load_hf_layer: layer 1 has no MoE weights (a dense layer, or out of range)"
    narrow = {**memory, "model.layers.0.mlp.experts.down_proj": torch.zeros(8, 64, 48)}
    with pytest.raises(ValueError) as error:
        load_hf_layer(moe, narrow, cfg, 0)
    assert str(error.value) == ("HF key 'model.layers.0.mlp.experts.down_proj' has shape (8, 64, 48), the config "
                                "expects (8, 64, 96)")


def test_missing_and_unexpected_keys_are_named_on_either_side():
    from nxd_moe.hf import hf_to_nxd_state_dict, nxd_to_hf_state_dict
    from nxd_moe.hf.checkpoints import meta_state_dict

    where = "model.layers.0.mlp."
    cfg, memory = mixtral_checkpoint("transformers", where)
    with pytest.raises(ValueError) as error:
        hf_to_nxd_state_dict({**memory, where + "experts.extra": torch.zeros(1)}, cfg)
    assert str(error.value) == (f"HF MoE block {where!r} has unexpected '{where}experts.extra' (unknown weights are "
                                "not converted)")
    nxd = {where + k: torch.zeros(v.shape) for k, v in meta_state_dict(cfg).items()}
    with pytest.raises(ValueError) as error:
        nxd_to_hf_state_dict({**nxd, where + "expert_mlps.extra": torch.zeros(1)}, cfg)
    assert str(error.value) == f"nxd MoE block {where!r} has unexpected '{where}expert_mlps.extra'"
    del nxd[where + "router.linear_router.weight"]
    with pytest.raises(ValueError) as error:
        nxd_to_hf_state_dict(nxd, cfg)
    assert str(error.value) == f"nxd MoE block {where!r} is missing '{where}router.linear_router.weight'"


def test_expected_keys_come_from_a_whole_layer_on_the_meta_device(monkeypatch):
    """The keys and shapes a checkpoint block must have: the whole (unsharded) layer's, without storage."""
    import nxd_moe.hf.checkpoints as checkpoints

    cfg, memory = mixtral_checkpoint("transformers", "model.layers.0.mlp.")
    assert all(v.is_meta for v in checkpoints.meta_state_dict(cfg).values())
    calls = []

    def build_moe(cfg, **kwargs):
        calls.append((kwargs.get("device"), kwargs.get("model_parallel")))
        return original(cfg, **kwargs)

    original = checkpoints.build_moe
    monkeypatch.setattr(checkpoints, "build_moe", build_moe)
    checkpoints.meta_state_dict(cfg, "fp8")
    assert calls == [("meta", False)]
    with pytest.raises(TypeError) as error:
        checkpoints.hf_to_nxd_state_dict({**memory, "model.layers.0.mlp.gate.weight": [0.0]}, cfg)
    assert str(error.value) == "HF key 'model.layers.0.mlp.gate.weight' must be a torch.Tensor, got list"


def test_absent_fields_and_wrapped_configs_are_named():
    from nxd_moe.hf import from_hf_config

    config = namespace("mixtral")
    del config.intermediate_size  # absent, not None
    with pytest.raises(ValueError) as error:
        from_hf_config(config)
    assert str(error.value) == "from_hf_config(mixtral): config.intermediate_size must be set, got None"
    with pytest.raises(ValueError) as error:
        from_hf_config(SimpleNamespace(model_type="llama4", text_config=None))
    assert str(error.value) == "from_hf_config(llama4): config.text_config must be set, got None"
    with pytest.raises(TypeError) as error:
        from_hf_config(from_hf_config(namespace("mixtral")))
    assert str(error.value) == ("from_hf_config: config is already an MoEModelConfig; pass a transformers config or "
                                "dict")


# ----------------------------------------------------------------------------------------------------------
# families: each layout as transformers defines it (the shipped families are built at import, so a fresh one is
# built here from the same description)


def _fused(*args, **kwargs):
    from nxd_moe.hf.families import _FusedFamily

    return _FusedFamily(*args, **kwargs)


def test_a_family_finds_its_blocks_by_module_path():
    mixtral = _fused(("MixtralSparseMoeBlock",), expert_names=("w1", "w3", "w2"), hub_module="block_sparse_moe")
    m = mixtral.block_re.match("language_model.model.layers.12.block_sparse_moe.experts.3.w2.weight")
    assert m.group("pre", "layer", "module", "rest") == ("language_model.model.layers.12.", "12", "block_sparse_moe",
                                                         "experts.3.w2.weight")
    assert mixtral.block_re.match("model.layers.0.mlp.gate.weight").group("module", "rest") == ("mlp", "gate.weight")
    assert mixtral.block_re.match("model.layers.0.self_attn.q_proj.weight") is None
    assert mixtral.block_re.match("model.layers.0.mlpx.gate.weight") is None
    assert (mixtral.hub_module, mixtral.block_classes, mixtral.expert_names) == (
        "block_sparse_moe", ("MixtralSparseMoeBlock",), ("w1", "w3", "w2"))
    assert mixtral.owned == ("gate.", "experts.")
    assert mixtral.owns("gate.weight") and mixtral.owns("experts.0.w1.weight") and not mixtral.owns("gate_proj.w")
    assert mixtral.is_hub({"gate.weight": 0, "experts.7.w1.weight": 0})
    assert not mixtral.is_hub({"gate.weight": 0, "experts.gate_up_proj": 0})
    from nxd_moe.hf.families import _FAMILIES

    assert not _FAMILIES["gpt_oss"].is_hub({"experts.0.gate_up_proj": 0})  # one layout: never the per-expert one


def test_fused_family_defaults_and_options():
    from nxd_moe.hf.families import GATE_UP_W, ROUTER_W, SCORE_BIAS, SHARED_GATE

    qwen3 = _fused(("Qwen3MoeSparseMoeBlock",))  # defaults: module "mlp", gate/up/down_proj, nothing shared
    assert (qwen3.hub_module, qwen3.expert_names, qwen3.shared, qwen3.shared_gate, qwen3.score_bias) == (
        "mlp", ("gate_proj", "up_proj", "down_proj"), None, False, False)
    assert qwen3.owned == ("gate.", "experts.")
    gate, up, down = torch.ones(2, 3, 4), 2 * torch.ones(2, 3, 4), 3 * torch.ones(2, 4, 3)
    hub = {"gate.weight": torch.zeros(2, 4)}
    for e in range(2):
        hub.update({f"experts.{e}.gate_proj.weight": gate[e], f"experts.{e}.up_proj.weight": up[e],
                    f"experts.{e}.down_proj.weight": down[e]})
    out = qwen3.to_nxd(hub, 2)
    assert sorted(out) == sorted([ROUTER_W, GATE_UP_W, "expert_mlps.mlp_op.down_proj.weight"])
    assert torch.equal(out[GATE_UP_W], torch.cat([gate, up], dim=1).transpose(1, 2))  # columns [gate | up]

    qwen2 = _fused(("Qwen2MoeSparseMoeBlock",), shared="shared_expert", shared_gate=True)
    assert qwen2.owned == ("gate.", "experts.", "shared_expert.", "shared_expert_gate.")
    shared = {f"shared_expert.{p}.weight": torch.full((3, 3), float(i)) for i, p in
              enumerate(("gate_proj", "up_proj", "down_proj"))}
    out = qwen2.to_nxd({**hub, **shared, "shared_expert_gate.weight": torch.ones(1, 4)}, 2)
    assert torch.equal(out[SHARED_GATE], torch.ones(1, 4))
    assert torch.equal(out["shared_experts.up_proj.weight"], shared["shared_expert.up_proj.weight"])

    deepseek = _fused(("DeepseekV3MoE",), shared="shared_experts", score_bias=True)
    assert deepseek.owned == ("gate.", "experts.", "shared_experts.")
    bias = torch.arange(2.0)
    out = deepseek.to_nxd({**hub, "gate.e_score_correction_bias": bias,
                           **{k.replace("shared_expert.", "shared_experts."): v for k, v in shared.items()}}, 2)
    assert torch.equal(out[SCORE_BIAS], bias)
    assert deepseek.from_nxd(out, "transformers")["gate.e_score_correction_bias"] is bias


def _deepseek_cfg():
    from nxd_moe.hf import from_hf_config

    return from_hf_config(namespace("deepseek_v3", hidden_size=128, moe_intermediate_size=128))


def _llama4_cfg():
    from nxd_moe.hf import from_hf_config

    return from_hf_config(namespace("llama4_text", hidden_size=128, intermediate_size=128))


def test_formats_without_a_checkpoint_form_are_refused_on_export_by_name():
    from nxd_moe.hf import from_hf_config
    from nxd_moe.hf.checkpoints import meta_state_dict
    from nxd_moe.hf.families import family_of

    cases = [
        (_deepseek_cfg(), ("bf16", "fp8"), "hub", "DeepseekV3MoE: quantized shared experts ('fp8') export as FP8 "
         "128x128 block-scaled tensors only (DeepSeek-V3's weight_scale_inv): use shared quantization 'fp8_block'"),
        (_llama4_cfg(), ("bf16", "mxfp4"), "hub", "Llama4TextMoe: quantized shared experts ('mxfp4') export as FP8 "
         "128x128 block-scaled tensors only (DeepSeek-V3's weight_scale_inv): use shared quantization 'fp8_block'"),
        (_llama4_cfg(), ("fp8", "bf16"), "hub", "Llama4TextMoe: quantized experts ('fp8') have no checkpoint form "
         "in this model's layout; only unquantized experts export"),
        (from_hf_config(namespace("dbrx")), ("fp8", None), "hub", "DbrxFFN: quantized experts ('fp8') have no "
         "checkpoint form in this model's layout; only unquantized experts export"),
    ]
    qwen3 = from_hf_config(namespace("qwen3_moe", hidden_size=128, moe_intermediate_size=128))
    for routed, layout in (("fp8", "hub"), ("fp8_block", "transformers")):
        cases.append((qwen3, (routed, None), layout, f"Qwen3MoeSparseMoeBlock: quantized experts ({routed!r}) export "
                      "as the Hub's FP8 128x128 block-scaled per-expert tensors only: use quantization 'fp8_block' "
                      "and layout='hub'"))
    for cfg, (routed, shared), layout, message in cases:
        nxd = meta_state_dict(cfg, routed, *(() if shared is None else (shared,)))
        with pytest.raises(ValueError) as error:
            family_of(cfg).from_nxd(nxd, layout)
        assert str(error.value) == message


def test_gpt_oss_exports_only_mxfp4_and_names_bad_stored_tensors(gpt_oss_experts):
    from nxd_moe.hf import from_hf_config, hf_to_nxd_state_dict
    from nxd_moe.hf.checkpoints import meta_state_dict
    from nxd_moe.hf.families import family_of

    cfg = from_hf_config(namespace("gpt_oss", hidden_size=64, intermediate_size=64))
    with pytest.raises(ValueError) as error:
        family_of(cfg).from_nxd(meta_state_dict(cfg, "fp8"), "transformers")
    assert str(error.value) == ("GptOssMLP: quantized experts ('fp8') export as GPT-OSS's MXFP4 tensors only: use "
                                "quantization 'mxfp4'")
    hf = family_of(cfg).from_nxd(meta_state_dict(cfg, "mxfp4"), "transformers")
    sd = {"model.layers.0.mlp." + k: torch.zeros(v.shape, dtype=v.dtype) for k, v in hf.items()}
    sd["model.layers.0.mlp.experts.down_proj_blocks"] = sd["model.layers.0.mlp.experts.down_proj_blocks"].to(
        torch.int8)
    with pytest.raises(ValueError) as error:
        hf_to_nxd_state_dict(sd, cfg)
    assert str(error.value) == ("experts.down_proj_blocks / experts.down_proj_scales must be uint8, got torch.int8 "
                                "and torch.uint8")


def test_unsaved_formats_say_what_transformers_loads_for_the_family():
    from nxd_moe.hf import from_hf_config, unsaved_formats

    qwen3, llama4 = from_hf_config(namespace("qwen3_moe")), _llama4_cfg()
    assert unsaved_formats(qwen3, "bf16", None) == "" and unsaved_formats(llama4, "bf16", "bf16") == ""
    assert unsaved_formats(qwen3, "fp8_block", None) == ""
    assert unsaved_formats(llama4, "fp8", "bf16") == (
        "routed experts stored as 'fp8' have no checkpoint format that transformers loads for model_type "
        "'llama4_text' (it loads them unquantized only); save the model before patching it with quantization='fp8'")
    assert unsaved_formats(qwen3, "mxfp4", None) == (
        "routed experts stored as 'mxfp4' have no checkpoint format that transformers loads for model_type "
        "'qwen3_moe' (it loads 'fp8_block'); patch with quantization='fp8_block' to save them quantized, or save the "
        "model before patching it with quantization='mxfp4'")
    assert unsaved_formats(llama4, "bf16", "mxfp4") == (
        "shared experts stored as 'mxfp4' have no checkpoint format that transformers loads for model_type "
        "'llama4_text' (it loads 'fp8_block'); patch with shared_quantization='fp8_block' to save them quantized, "
        "or save the model before patching it with shared_quantization='mxfp4'")
