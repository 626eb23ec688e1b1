"""The application's config (NxD Inference's field names) and the bad input the application names: every value
a test sets differs from its default, so a dropped or swapped field changes what is checked."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from nxd_moe.application import ApplicationConfig, CausalLMApplication, NxDIFieldWarning, SamplingConfig  # noqa: E402
from nxd_moe.application.config import IGNORED, REFUSED, SERVED, autobucket  # noqa: E402
from nxd_moe.config import BlockShardStrategy, BlockwiseMatmulConfig, RouterConfig  # noqa: E402


def test_served_fields_take_the_values_given():
    c = ApplicationConfig(batch_size=6, ctx_batch_size=3, seq_len=300, max_context_length=200, max_length=280,
                          torch_dtype="float16", enable_bucketing=True, tp_degree=8, moe_tp_degree=2,
                          moe_ep_degree=4, logical_nc_config=2, padding_side="left", skip_warmup=True,
                          on_device_sampling_config={"do_sample": True, "top_k": 7, "top_p": 0.5,
                                                     "temperature": 0.3, "dynamic": True, "global_topk": 64},
                          blockwise_matmul_config={"block_size": 128, "block_sharding_strategy": "PING_PONG"},
                          router_config={"act_fn": "sigmoid", "dtype": "bfloat16"})
    assert (c.batch_size, c.ctx_batch_size, c.seq_len, c.max_context_length, c.max_length) == (6, 3, 300, 200, 280)
    assert c.torch_dtype == torch.float16 and c.padding_side == "left" and c.skip_warmup
    assert (c.tp_degree, c.moe_tp_degree, c.moe_ep_degree, c.logical_nc_config) == (8, 2, 4, 2)
    assert c.on_device_sampling_config == SamplingConfig(True, 7, 0.5, 0.3, True, 64)
    assert c.blockwise_matmul_config.block_size == 128
    assert c.blockwise_matmul_config.block_sharding_strategy == BlockShardStrategy.PING_PONG
    assert c.router_config == RouterConfig("sigmoid", torch.bfloat16)
    # NxDI's automatic buckets: powers of two from 128, then the maximum
    assert c.context_encoding_buckets == [128, 200] and c.token_generation_buckets == [128, 256, 280]
    assert c.max_new_tokens == 100  # seq_len - max_context_length, NxDI's default


def test_to_dict_round_trips_through_the_constructor():
    c = ApplicationConfig(batch_size=2, seq_len=64, max_context_length=32, torch_dtype="bfloat16",
                          context_encoding_buckets=[16, 32], token_generation_buckets=[40, 64],
                          on_device_sampling_config=SamplingConfig(do_sample=True, top_k=3),
                          blockwise_matmul_config=BlockwiseMatmulConfig.from_kwargs(
                              block_size=64, block_sharding_strategy="PING_PONG"),
                          quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f8e4m3",
                          quantization_block_size=[128, 128])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field at its default or served: nothing to warn about
        again = ApplicationConfig(**c.to_dict())
    assert again.to_dict() == c.to_dict()
    assert again.quantization == "fp8_block" and again.on_device_sampling_config.top_k == 3
    assert again.blockwise_matmul_config.block_sharding_strategy == BlockShardStrategy.PING_PONG


@pytest.mark.parametrize("fields, expected", [
    (dict(quantized=True, quantization_type="per_channel_symmetric", quantization_dtype="f8e4m3"), "fp8"),
    (dict(quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f4e2m1fn_x4"), "mxfp4"),
    (dict(quantized=False, quantization_type="blockwise_symmetric", quantization_dtype="f4e2m1fn_x4"), None),
])
def test_quantization_fields_name_the_expert_format(fields, expected):
    assert ApplicationConfig(**fields).quantization == expected


def test_an_unknown_field_is_an_error_here_and_a_warning_at_nxdis_front_door():
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['batch_szie'\]"):
        ApplicationConfig(batch_szie=4)
    from nxd_moe.nxd_compat.inference import MoENeuronConfig

    with pytest.warns(NxDIFieldWarning, match="batch_szie"):
        MoENeuronConfig(batch_szie=4)


def test_ignored_fields_are_named_in_one_warning_only_when_not_at_their_default():
    with pytest.warns(NxDIFieldWarning) as record:
        c = ApplicationConfig(fused_qkv=True, attention_dp_degree=4, cp_degree=2, flash_decoding_enabled=False)
    assert len(record) == 1
    message = str(record[0].message)
    assert "fused_qkv=True" in message and "attention_dp_degree=4" in message and "cp_degree=2" in message
    assert "flash_decoding_enabled" not in message
    assert c.fused_qkv is True and c.attention_dp_degree == 4  # the script can read them back
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ApplicationConfig(fused_qkv=False, sequence_parallel_enabled=False)


@pytest.mark.parametrize("field, value", [("speculation_length", 4), ("lora_config", {"max_loras": 2}),
                                          ("is_block_kv_layout", True), ("kv_cache_quant", True),
                                          ("output_logits", True), ("is_prefix_caching", True)])
def test_refused_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"{field}="):
        ApplicationConfig(**{field: value})


def test_the_three_field_tables_are_disjoint_and_cover_nxdis_moe_config():
    assert not SERVED & set(IGNORED) and not SERVED & set(REFUSED)
    assert not set(IGNORED) & set(REFUSED)
    # a sample of MoENeuronConfig's own fields, each in one table
    for name in ("capacity_factor", "glu_mlp", "moe_tp_degree", "moe_ep_degree", "hybrid_sharding_config",
                 "router_config", "blockwise_matmul_config", "fused_shared_experts", "return_router_logits"):
        assert name in SERVED or name in IGNORED, name


@pytest.mark.parametrize("fields, error, match", [
    (dict(batch_size=4, tkg_batch_size=2), ValueError, "tkg_batch_size"),
    (dict(batch_size=4, ctx_batch_size=3), ValueError, "ctx_batch_size"),
    (dict(seq_len=64, max_context_length=65), ValueError, "max_context_length must be in"),
    (dict(seq_len=64, context_encoding_buckets=[16, 128]), ValueError, "context_encoding_buckets: bucket 128"),
    (dict(seq_len=64, token_generation_buckets=[]), TypeError, "token_generation_buckets must be a non-empty"),
    (dict(torch_dtype="int8"), TypeError, "torch_dtype must be a floating"),
    (dict(capacity_factor=1.25), ValueError, "capacity_factor=1.25"),
    (dict(tp_degree=4, moe_tp_degree=2, moe_ep_degree=4), ValueError, "must divide tp_degree"),
    (dict(padding_side="middle"), ValueError, "padding_side"),
    (dict(on_device_sampling_config={"do_sample": True, "top_p": 2.0}), ValueError, "top_p must be in"),
])
def test_bad_values_are_named(fields, error, match):
    with pytest.raises(error, match=match):
        ApplicationConfig(**fields)


def test_autobucket_and_bucket_choice():
    assert autobucket(128, 1000) == [128, 256, 512, 1000]
    c = ApplicationConfig(seq_len=600, max_context_length=300, enable_bucketing=True)
    assert [c.context_bucket(n) for n in (1, 128, 129, 300)] == [128, 128, 256, 300]
    assert [c.generation_bucket(n) for n in (5, 257, 600)] == [128, 512, 600]
    with pytest.raises(ValueError, match="prompt of 301 tokens is longer than the largest context-encoding bucket"):
        c.context_bucket(301)


@pytest.fixture(scope="module")
def app():
    from nxd_moe.models.hf_models import build_hf_model

    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=16, seed=2)
    return CausalLMApplication(model, ApplicationConfig(batch_size=2, seq_len=32, max_context_length=8,
                                                        torch_dtype="float32"))


@pytest.mark.parametrize("call, error, match", [
    (lambda a: a.generate(torch.ones(1, 9, dtype=torch.long)), ValueError, "longer than max_context_length"),
    (lambda a: a.generate(torch.ones(3, 4, dtype=torch.long)), ValueError, "exceeds the application's batch_size"),
    (lambda a: a.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=25), ValueError, "exceed max_length"),
    (lambda a: a.generate(torch.ones(1, 4)), TypeError, "input_ids must be an integer tensor"),
    (lambda a: a.generate(torch.ones(1, 4, dtype=torch.long), torch.tensor([[1, 0, 1, 1]])), ValueError,
     "padding between prompt tokens"),
    (lambda a: a.generate(torch.ones(1, 4, dtype=torch.long), torch.zeros(1, 4)), ValueError, "all zeros"),
    (lambda a: a.generate(torch.ones(1, 4, dtype=torch.long), eos_token_id=10**6), ValueError, "eos_token_id"),
    (lambda a: a.generate(torch.ones(1, 4, dtype=torch.long), read_every=0), ValueError, "read_every"),
])
def test_bad_input_is_named(app, call, error, match):
    with pytest.raises(error, match=match):
        call(app)


def test_a_model_without_moe_layers_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=100))
    with pytest.raises(ValueError, match="model_type 'llama' is not an MoE family nxd_moe serves"):
        CausalLMApplication(dense, ApplicationConfig())
    with pytest.raises(TypeError, match="config must be an ApplicationConfig"):
        CausalLMApplication(dense, {"batch_size": 1})


@pytest.mark.parametrize("patched_first", [False, True])
def test_a_bf16_application_keeps_float32_routers_whether_or_not_the_model_came_patched(patched_first):
    """The routers route in float32 as NxD does (and the GPU's one-launch decode takes only a float32 router): a model
    patched before the application converts it to bf16 keeps them bit for bit; an unpatched one is converted first
    (as a checkpoint in ``torch_dtype`` would be) and patched after, its routers the bf16 gates in float32."""
    from nxd_moe.hf import patch_model
    from nxd_moe.models.hf_models import build_hf_model
    from nxd_moe.moe import MoE

    model = build_hf_model("qwen3-30b-a3b", num_layers=2, scale=16, seed=4)
    gate = model.model.layers[1].mlp.gate.weight.detach().clone()
    gate += torch.linspace(0, 1e-5, gate.numel()).view_as(gate)  # bits below bf16's precision
    model.model.layers[1].mlp.gate.weight.data.copy_(gate)
    if patched_first:
        patch_model(model, backend="torch")
    app = CausalLMApplication(model, ApplicationConfig(batch_size=1, seq_len=16, max_context_length=8,
                                                       torch_dtype="bfloat16"))
    layers = [m for m in app.model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2
    for layer in layers:
        assert layer.router.linear_router.weight.dtype == torch.float32
        assert layer.expert_mlps.dtype == torch.bfloat16
    expected = gate if patched_first else gate.to(torch.bfloat16).float()
    assert not torch.equal(expected, gate.to(torch.bfloat16).float()) or not patched_first
    assert torch.equal(layers[1].router.linear_router.weight, expected)
    assert app.model.model.embed_tokens.weight.dtype == torch.bfloat16
