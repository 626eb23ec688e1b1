"""The application's config (NxD Inference's field names) and the bad input the application names: every value
a test sets differs from its default, so a dropped or swapped field changes what is checked."""

from __future__ import annotations

import os
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


# From the mutation run of config.py: every default stated, every served field read away from its default (the
# "dict-form config" class of blind spot), every check's whole message at its boundary.
def test_the_defaults_are_nxdis():
    c = ApplicationConfig()
    assert (c.batch_size, c.ctx_batch_size, c.tkg_batch_size, c.max_batch_size, c.kv_cache_batch_size) == (1,) * 5
    assert (c.padding_side, c.seq_len, c.max_context_length, c.max_length) == ("right", 128, 128, 128)
    assert c.max_new_tokens is None and c.torch_dtype == torch.bfloat16 and c.on_device_sampling_config is None
    assert c.enable_bucketing is False and c.buckets == [128]
    assert c.context_encoding_buckets == [128] and c.token_generation_buckets == [128]
    assert (c.tp_degree, c.moe_tp_degree, c.moe_ep_degree, c.ep_degree, c.world_size) == (1,) * 5
    assert c.hybrid_sharding_config is None and c.capacity_factor is None
    assert c.blockwise_matmul_config == BlockwiseMatmulConfig() and c.router_config == RouterConfig()
    assert (c.quantized, c.quantized_checkpoints_path, c.quantization_type, c.quantization_dtype,
            c.quantization_block_size, c.quantization) == (False, None, "per_tensor_symmetric", "int8", None, None)
    assert (c.save_sharded_checkpoint, c.skip_warmup, c.logical_nc_config, c.on_cpu) == (False, False, 1, False)
    assert c.ignored_fields == {} and c.unknown_fields == {}


def test_every_other_served_field_away_from_its_default():
    from types import SimpleNamespace

    hybrid = {"moe_cte_tp_degree": 2, "moe_cte_ep_degree": 2, "moe_tkg_tp_degree": 1, "moe_tkg_ep_degree": 4}
    sampling = SimpleNamespace(do_sample=True, top_k=3, top_p=0.25, temperature=2.0, dynamic=False, global_topk=8,
                               other="ignored")  # NxDI's OnDeviceSamplingConfig object: its fields are read
    c = ApplicationConfig(batch_size=4, max_batch_size=8, seq_len=96, max_context_length=40, max_new_tokens=7,
                          ep_degree=2, tp_degree=4, moe_tp_degree=2, moe_ep_degree=2, world_size=16,
                          hybrid_sharding_config=hybrid, buckets=[48, 96], quantized_checkpoints_path="q/",
                          save_sharded_checkpoint=True, on_cpu=True, router_act_fn="sigmoid", router_dtype="bfloat16",
                          on_device_sampling_config=sampling)
    assert (c.batch_size, c.ctx_batch_size, c.max_batch_size, c.max_length, c.max_new_tokens) == (4, 4, 8, 96, 7)
    assert (c.ep_degree, c.world_size, c.hybrid_sharding_config) == (2, 16, hybrid)
    assert c.buckets == [48, 96] and c.quantized_checkpoints_path == "q/"
    assert c.save_sharded_checkpoint is True and c.on_cpu is True
    assert c.router_config == RouterConfig("sigmoid", torch.bfloat16)
    assert c.on_device_sampling_config == SamplingConfig(True, 3, 0.25, 2.0, False, 8)
    assert ApplicationConfig(tp_degree=4, ep_degree=2).world_size == 8  # tp x ep by default
    assert ApplicationConfig(router_act_fn="sigmoid").router_config == RouterConfig("sigmoid")
    assert ApplicationConfig(router_dtype="bfloat16").router_config == RouterConfig("softmax", torch.bfloat16)
    given = SamplingConfig(do_sample=True, top_k=5)
    assert ApplicationConfig(on_device_sampling_config=given).on_device_sampling_config is given
    # without bucketing: one bucket each, whatever the lengths; a generation bucket below max_length gets max_length
    c = ApplicationConfig(seq_len=512, max_context_length=300, max_length=500)
    assert c.context_encoding_buckets == [300] and c.token_generation_buckets == [500]
    assert ApplicationConfig(seq_len=64, token_generation_buckets=[16, 32]).token_generation_buckets == [16, 32, 64]
    # the smallest sizes each check admits
    c = ApplicationConfig(seq_len=2, max_context_length=1, max_length=2, max_new_tokens=1, logical_nc_config=2)
    assert (c.seq_len, c.max_context_length, c.max_length, c.max_new_tokens, c.logical_nc_config) == (2, 1, 2, 1, 2)
    assert ApplicationConfig(moe_tp_degree=2, moe_ep_degree=1, tp_degree=2).moe_tp_degree == 2


@pytest.mark.parametrize("fields, error, message", [
    (dict(batch_size=0), ValueError, "batch_size must be in [1, inf], got 0"),
    (dict(ctx_batch_size=0), ValueError, "ctx_batch_size must be in [1, inf], got 0"),
    (dict(max_batch_size=0), ValueError, "max_batch_size must be in [1, inf], got 0"),
    (dict(tkg_batch_size=2), ValueError, "tkg_batch_size (2) must equal batch_size (1): every sequence of a batch "
                                         "generates in one token-generation program"),
    (dict(seq_len=1), ValueError, "seq_len must be in [2, inf], got 1"),
    (dict(max_context_length=0), ValueError, "max_context_length must be in [1, 128], got 0"),
    (dict(max_context_length=129), ValueError, "max_context_length must be in [1, 128], got 129"),
    (dict(max_length=1), ValueError, "max_length must be in [2, 128], got 1"),
    (dict(max_length=129), ValueError, "max_length must be in [2, 128], got 129"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be in [1, inf], got 0"),
    (dict(enable_bucketing="yes"), TypeError, "enable_bucketing must be a bool"),
    (dict(context_encoding_buckets=[0, 64]), ValueError, "context_encoding_buckets[0] must be in [1, inf], got 0"),
    (dict(token_generation_buckets=[32, 64, 256]), ValueError,
     "token_generation_buckets: bucket 256 exceeds max_length (128)"),
    (dict(context_encoding_buckets=[256]), ValueError,
     "context_encoding_buckets: bucket 256 exceeds max_context_length (128)"),
    (dict(max_context_length=100, max_length=50), ValueError, "max_context_length (100) must be <= max_length (50)"),
    (dict(tp_degree=0), ValueError, "tp_degree must be in [1, inf], got 0"),
    (dict(moe_tp_degree=0), ValueError, "moe_tp_degree must be in [1, inf], got 0"),
    (dict(moe_ep_degree=0), ValueError, "moe_ep_degree must be in [1, inf], got 0"),
    (dict(ep_degree=0), ValueError, "ep_degree must be in [1, inf], got 0"),
    (dict(world_size=0), ValueError, "world_size must be in [1, inf], got 0"),
    (dict(moe_tp_degree=2, tp_degree=3), ValueError, "moe_tp_degree x moe_ep_degree (2 x 1) must divide tp_degree (3)"),
    (dict(blockwise_matmul_config=5), TypeError,
     "blockwise_matmul_config must be a BlockwiseMatmulConfig or a dict, got int"),
    (dict(router_config=5), TypeError, "router_config must be a RouterConfig or a dict, got int"),
    (dict(capacity_factor=1.0), ValueError, "capacity_factor=1.0: the application runs the experts dropless, as NxD "
                                            "Inference's MoE models do; leave it None"),
    (dict(quantized="no"), TypeError, "quantized must be a bool"),
    (dict(save_sharded_checkpoint=1), TypeError, "save_sharded_checkpoint must be a bool"),
    (dict(skip_warmup=1), TypeError, "skip_warmup must be a bool"),
    (dict(on_cpu=1), TypeError, "on_cpu must be a bool"),
    (dict(logical_nc_config=0), ValueError, "logical_nc_config must be in [1, 2], got 0"),
    (dict(logical_nc_config=3), ValueError, "logical_nc_config must be in [1, 2], got 3"),
    (dict(speculation_length=4), ValueError, "speculation_length=4: speculative decoding is not served by nxd_moe's "
                                             "application (nxd_moe serves NxD Inference's MoE generation without it)"),
    (dict(bogus_field=1), TypeError, "ApplicationConfig: unknown field(s) ['bogus_field'] (not NxD Inference "
                                     "NeuronConfig / MoENeuronConfig fields known to nxd_moe)"),
])
def test_bad_values_are_named_whole(fields, error, message):
    with pytest.raises(error) as caught:
        ApplicationConfig(**fields)
    assert str(caught.value).startswith(message), str(caught.value)


def test_warnings_name_the_fields_and_point_at_the_script():
    def front_door(**fields):  # NxDI's MoENeuronConfig: one frame between the script and ApplicationConfig
        return ApplicationConfig(strict=False, **fields)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c = front_door(fused_qkv=True, lm_head_pad=True, bogus_field=1)
    texts = [str(w.message) for w in seen]
    assert texts[0] == ("NeuronConfig: unexpected keyword arguments ['bogus_field'] are not NxD Inference fields "
                        "known to nxd_moe; ignored")
    assert texts[1] == ("NxD Inference fields that choose how a Neuron device runs the model are ignored (the "
                        "function computed is the same): fused_qkv=True, lm_head_pad=True")
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames: the stacklevel is not seen there
        assert all(w.filename == __file__ for w in seen)  # stacklevel: the script's line, not the front door's
    assert c.ignored_fields == {"fused_qkv": True, "lm_head_pad": True} and c.unknown_fields == {"bogus_field": 1}
    assert c.fused_qkv is True and c.lm_head_pad is True and c.flash_decoding_enabled is False


def test_refused_fields_at_an_unset_value_pass_and_keep_it():
    """A refused field whose default is None, given a falsy value (NxDI scripts pass 0 or {} for "off"), is not an
    error, and the attribute keeps what was given."""
    c = ApplicationConfig(spec_batch_size=0, lora_config={}, speculation_length=0)
    assert (c.spec_batch_size, c.lora_config, c.speculation_length) == (0, {}, 0)
    assert ApplicationConfig().spec_batch_size is None


def test_a_value_without_a_truth_value_is_compared_by_identity():
    bound = torch.tensor([1.0, 2.0])  # == gives a tensor, whose truth is ambiguous
    with pytest.warns(NxDIFieldWarning, match="quantize_clamp_bound"):
        c = ApplicationConfig(quantize_clamp_bound=bound)
    assert c.ignored_fields["quantize_clamp_bound"] is bound


def test_autobucket_stops_at_the_largest():
    assert autobucket(128, 256) == [128, 256] and autobucket(128, 128) == [128]
    assert autobucket(16, 100) == [16, 32, 64, 100]


def test_bucket_errors_name_the_largest_bucket():
    c = ApplicationConfig(seq_len=256, max_context_length=64, context_encoding_buckets=[16, 32, 64],
                          token_generation_buckets=[96, 160, 256])
    with pytest.raises(ValueError) as caught:
        c.context_bucket(65)
    assert str(caught.value) == ("prompt of 65 tokens is longer than the largest context-encoding bucket (64, "
                                 "max_context_length 64)")
    with pytest.raises(ValueError) as caught:
        c.generation_bucket(257)
    assert str(caught.value) == "257 positions exceed the largest token-generation bucket (256, max_length 256)"


def test_to_dict_is_json_ready():
    import json

    c = ApplicationConfig(torch_dtype="float16", on_device_sampling_config={"do_sample": True, "top_k": 4})
    out = c.to_dict()
    json.dumps(out)
    assert out["torch_dtype"] == "float16"
    assert out["on_device_sampling_config"]["top_k"] == 4 and out["on_device_sampling_config"]["do_sample"] is True
    assert out["blockwise_matmul_config"]["block_sharding_strategy"] == "HI_LO"
    assert out["router_config"] == {"act_fn": "softmax", "dtype": "float32"}
    assert not {"ignored_fields", "unknown_fields", "quantization"} & set(out)
    from types import SimpleNamespace  # an NxDI config object: its public attributes, each made JSON-ready

    hybrid = SimpleNamespace(moe_tkg_ep_degree=2, dtype=torch.bfloat16, _cache=object())
    out = ApplicationConfig(hybrid_sharding_config=hybrid).to_dict()
    assert out["hybrid_sharding_config"] == {"moe_tkg_ep_degree": 2, "dtype": "bfloat16"}
    out = ApplicationConfig(hybrid_sharding_config={"dtype": torch.float16}).to_dict()
    assert out["hybrid_sharding_config"] == {"dtype": "float16"}
    assert ApplicationConfig(hybrid_sharding_config=SimpleNamespace).to_dict()["hybrid_sharding_config"] is \
        SimpleNamespace  # a class is passed through, not taken apart
