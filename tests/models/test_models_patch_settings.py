"""Settings of the models' front doors seen by tests: ``build_hf_config`` / ``build_hf_model`` (each family's MoE
keys, taken from configs whose values all differ from transformers' defaults), ``patch_model`` (its report, backend
choice, quantization config, state-dict hooks) and the experts interface (layouts, activations, backends).

Expected values are written by hand from the definitions (transformers' config keys, the widths divided by the
scale, the float64 sum over each token's experts), never computed the way the code computes them.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import MODELS, one_intra_op_thread, randomize_hf_  # noqa: E402,F401 (autouse fixture)

from nxd_moe.config import load_model_config  # noqa: E402
from nxd_moe.hf import from_hf_config, patch_model  # noqa: E402
from nxd_moe.models.hf_models import build_hf_config, build_hf_model  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# build_hf_config: every MoE key from the config, none from transformers' defaults


def variant(shipped: str, *, experts: dict | None = None, router: dict | None = None, transformers_keys=None,
            **fields) -> object:
    """The shipped config ``shipped`` with ``fields`` / experts / router keys replaced (values unlike the
    defaults)."""
    base = load_model_config(shipped)
    changes = dict(fields)
    if experts is not None:
        changes["experts"] = {**base.experts, **experts}
    if router is not None:
        changes["router"] = dataclasses.replace(base.router, **router)
    if transformers_keys is not None:
        changes["transformers"] = transformers_keys
    return dataclasses.replace(base, **changes)


# (config, num_layers, the transformers keys it must give): every value differs from the class default.
FAMILY_KEYS = {
    "qwen3_moe": (lambda: variant("qwen3-30b-a3b", num_experts=12, top_k=3, hidden_size=96, intermediate_size=40,
                                  experts={"hidden_act": "gelu"}),
                  3, dict(hidden_size=96, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=40,
                          norm_topk_prob=True, hidden_act="gelu", decoder_sparse_step=1, mlp_only_layers=[],
                          num_hidden_layers=3)),
    "mixtral": (lambda: variant("mixtral-8x7b", num_experts=6, top_k=3, hidden_size=64, intermediate_size=40,
                                experts={"hidden_act": "gelu"}),
                3, dict(hidden_size=64, num_local_experts=6, num_experts_per_tok=3, intermediate_size=40,
                        hidden_act="gelu", num_hidden_layers=3)),
    "gpt_oss": (lambda: variant("gpt-oss-20b", num_experts=6, top_k=3, hidden_size=64, intermediate_size=40,
                                experts={"hidden_act_scaling_factor": 1.5, "gate_clamp_upper_limit": 5.0,
                                         "up_clamp_lower_limit": -5.0, "up_clamp_upper_limit": 5.0}),
                3, dict(hidden_size=64, num_local_experts=6, num_experts_per_tok=3, intermediate_size=40,
                        swiglu_alpha=1.5, swiglu_limit=5.0, num_hidden_layers=3)),
    "deepseek_v3": (lambda: variant("deepseek-v3", num_experts=16, top_k=3, hidden_size=64, intermediate_size=40,
                                    shared_experts=None, experts={"hidden_act": "gelu"},
                                    router={"n_group": 4, "topk_group": 2, "normalize": False,
                                            "routed_scaling_factor": 1.5},
                                    transformers_keys={"first_k_dense_replace": 2}),
                    3, dict(hidden_size=64, n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=40,
                            n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                            n_shared_experts=0, hidden_act="gelu", num_hidden_layers=2 + 3)),
    "deepseek_v3_two_shared": (lambda: variant("deepseek-v3", hidden_size=64, intermediate_size=40,
                                               shared_experts={"num_shared_experts": 2}),
                               1, dict(n_shared_experts=2, num_hidden_layers=3 + 1)),
    "llama4_text": (lambda: variant("llama4-maverick", num_experts=6, top_k=2, hidden_size=64, intermediate_size=40,
                                    experts={"hidden_act": "gelu"},
                                    transformers_keys={"interleave_moe_layer_step": 3}),
                    2, dict(hidden_size=64, num_local_experts=6, num_experts_per_tok=2, intermediate_size=40,
                            hidden_act="gelu", num_hidden_layers=3 * 2)),
    "dbrx": (lambda: variant("dbrx", num_experts=6, top_k=3, hidden_size=64, intermediate_size=40,
                             experts={"hidden_act": "gelu", "normalize_top_k_affinities": False}),
             3, dict(d_model=64, n_layers=3)),
}


@pytest.mark.parametrize("family", list(FAMILY_KEYS))
def test_each_family_takes_its_moe_keys_from_the_config(family):
    make, layers, expected = FAMILY_KEYS[family]
    hf = build_hf_config(make(), num_layers=layers)
    assert {key: getattr(hf, key) for key in expected} == expected
    if family == "dbrx":
        ffn = hf.ffn_config
        assert (ffn.ffn_hidden_size, ffn.moe_num_experts, ffn.moe_top_k, ffn.moe_normalize_expert_weights,
                ffn.ffn_act_fn) == (40, 6, 3, None, {"name": "gelu"})


def test_keys_the_moe_fields_decide_are_refused_in_the_transformers_section():
    """decoder_sparse_step is the MoE layer's pattern (every layer): a section setting it is refused, not used."""
    base = load_model_config("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=r"^build_hf_model: config 'qwen3-30b-a3b': transformers key\(s\) "
                                         r"\['decoder_sparse_step'\] come from the MoE fields and the layer count, "
                                         r"not from the transformers section$"):
        build_hf_config(dataclasses.replace(base, transformers={**base.transformers, "decoder_sparse_step": 2}))
    no_shared = dataclasses.replace(from_hf_config(transformers.Qwen2MoeConfig()), shared_experts=None, name="q2")
    with pytest.raises(ValueError, match=r"^build_hf_model: qwen2_moe has a gated shared expert; config 'q2' has "
                                         r"none$"):
        build_hf_config(no_shared, num_layers=1)
    with pytest.raises(ValueError, match=r"^build_hf_model: config 'qwen3-30b-a3b': transformers key\(s\) "
                                         r"\['mlp_only_layers'\] are derived from the layer count; set the pattern "
                                         r"instead \(e\.g\. interleave_moe_layer_step\)$"):
        build_hf_config(dataclasses.replace(base, transformers={**base.transformers, "mlp_only_layers": [0]}))


def test_dbrx_heads_without_an_attention_section_and_kv_heads_that_must_shrink():
    """DBRX's kv heads live in attn_config: without one in the section, transformers' default attention config
    (kv_n_heads 1, clip_qkv None) is the one whose kv count is set. At scale 160 d_model is 6144 / 160 -> 40
    (a multiple of 8): 4 heads of 10 (the most heads dividing 48 that leave an even width), and 8 kv heads do not
    divide 4 heads: 4."""
    bare = variant("dbrx", transformers_keys={"vocab_size": 1000, "n_heads": 48})
    c = build_hf_config(bare, num_layers=1, scale=16)
    assert (c.d_model, c.n_heads, c.attn_config.kv_n_heads, c.attn_config.clip_qkv) == (384, 48, 1, None)
    shrunk = build_hf_config("dbrx", num_layers=1, scale=160)
    assert (shrunk.d_model, shrunk.n_heads, shrunk.attn_config.kv_n_heads, shrunk.attn_config.clip_qkv) == (
        40, 4, 4, 8.0)


def tiny_mixtral():
    """A mixtral layer small enough to build at scale 1: H 80, I 48, 4 experts, a 64-token vocabulary."""
    return variant("mixtral-8x7b", num_experts=4, top_k=2, hidden_size=80, intermediate_size=48,
                   transformers_keys={"vocab_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1})


def test_build_hf_model_defaults_and_arguments_reach_the_model():
    """Defaults: scale 1 (the config's widths), seed 0, CPU, float32; device, scale and quantization are passed
    on (MXFP4's 32-column blocks: H 80 / 2 = 40 rounds up to 64, I 48 / 2 = 24 to 32; unquantized 40 and 24)."""
    cfg = tiny_mixtral()
    default = build_hf_model(cfg, num_layers=1)
    assert (default.config.hidden_size, default.config.intermediate_size, default.config.vocab_size) == (80, 48, 64)
    assert {(p.device.type, p.dtype) for p in default.parameters()} == {("cpu", torch.float32)}
    seed0, seed1 = build_hf_model(cfg, num_layers=1, seed=0), build_hf_model(cfg, num_layers=1, seed=1)
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(default.state_dict()[router], seed0.state_dict()[router])
    assert not torch.equal(default.state_dict()[router], seed1.state_dict()[router])
    meta = build_hf_model(cfg, num_layers=1, scale=2, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert (meta.config.hidden_size, meta.config.intermediate_size) == (40, 24)
    mx = build_hf_model(cfg, num_layers=1, scale=2, device="meta", quantization="mxfp4")
    assert (mx.config.hidden_size, mx.config.intermediate_size) == (64, 32)
    with pytest.raises(TypeError, match=r"^dtype must be a floating torch\.dtype or one of \["):
        build_hf_model(cfg, num_layers=1, dtype="int8")
    with pytest.raises(TypeError, match=r"^seed must be an int, got float 1\.5$"):
        build_hf_model(cfg, num_layers=1, seed=1.5)


def test_a_layer_transformers_cannot_hold_is_refused_naming_every_difference():
    """Mixtral's config has no shared experts, no sigmoid router and always renormalises the top-k weights."""
    cfg = variant("mixtral-8x7b", name="m", experts={"normalize_top_k_affinities": False},
                  router={"act_fn": "sigmoid"}, shared_experts={"num_shared_experts": 1})
    with pytest.raises(ValueError, match=r"^build_hf_model: config 'm/scale64' is not a transformers mixtral model: "
                                         r"experts\.normalize_top_k_affinities, router, shared_experts differ from "
                                         r"what transformers' MixtralConfig can hold$"):
        build_hf_config(cfg, num_layers=1, scale=64)
    with pytest.raises(ValueError, match=r"^num_layers must be in \[1, inf\], got 0$"):
        build_hf_config("mixtral-8x7b", num_layers=0)


# ----------------------------------------------------------------------------------------------------------
# patch_model: outputs, repr, state-dict hooks, quantization config


def original(name: str, seed: int = 0, **sizes) -> torch.nn.Module:
    return randomize_hf_(MODELS[name].make(**sizes), seed)


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text"])
def test_tuple_outputs_are_in_the_models_dtype(name):
    """GptOssMLP's router scores and Llama 4's router logits come back in the block's dtype (bf16 here), as the
    unpatched block gives them, though the layer routes in float32."""
    model = original(name).to(torch.bfloat16)
    path = f"{MODELS[name].layers}.1.{MODELS[name].block_attr}"
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        before = model.get_submodule(path)(x)
        patch_model(model)
        after = model.get_submodule(path)(x)
    assert [t.dtype for t in before] == [t.dtype for t in after] == [torch.bfloat16, torch.bfloat16]
    assert [t.shape for t in before] == [t.shape for t in after]


def test_repr_names_the_shared_format_only_where_there_are_shared_experts():
    mixtral = patch_model(original("mixtral"))
    assert mixtral.model.layers[0].mlp.extra_repr() == (
        "in place of MixtralSparseMoeBlock, backend='torch', quantization='none'")
    qwen2 = patch_model(original("qwen2_moe", hidden=64, intermediate=64), shared_quantization="fp8")
    assert qwen2.model.layers[0].mlp.extra_repr() == (
        "in place of Qwen2MoeSparseMoeBlock, backend='torch', quantization='none', shared_quantization='fp8'")
    assert (qwen2.nxd_moe_patched.quantization, qwen2.nxd_moe_patched.shared_quantization) == ("none", "fp8")


SHARDED = ("state_dict of {} (Qwen2MoeSparseMoeBlock patched by nxd_moe): under model parallelism each rank holds "
           "only its shard of the experts; save the checkpoint from a model patched in one process")


def test_state_dict_of_a_sharded_layer_is_refused(monkeypatch):
    """A layer holding one rank's experts, or one rank's slice of the shared experts' width (set here by hand, as
    expert / tensor parallelism sets them), cannot give the block's whole tensors."""
    model = patch_model(original("qwen2_moe"))
    block = model.model.layers[0].mlp
    model.state_dict()  # whole: fine
    monkeypatch.setattr(block.moe.expert_mlps, "weight_shards", ("prefill shard", "decode shard"))
    with pytest.raises(NotImplementedError, match=f"^{re.escape(SHARDED.format(repr('the block')))}$"):
        block.state_dict()
    with pytest.raises(NotImplementedError, match=f"^{re.escape(SHARDED.format(repr('model.layers.0.mlp.')))}$"):
        model.state_dict()
    monkeypatch.undo()
    monkeypatch.setattr(block.moe.shared_experts, "intermediate_shard", (2, 1))
    with pytest.raises(NotImplementedError, match=f"^{re.escape(SHARDED.format(repr('the block')))}$"):
        block.state_dict()


def test_a_block_alone_names_itself_in_its_state_dict_errors():
    """Called on the block itself (no prefix), the errors say "the block"."""
    model = patch_model(original("qwen3_moe", hidden=128, intermediate=128), quantization="fp8")
    with pytest.raises(ValueError, match=r"^state_dict of 'the block' \(Qwen3MoeSparseMoeBlock patched by nxd_moe\): "
                                         r"routed experts stored as 'fp8' have no checkpoint format"):
        model.model.layers[1].mlp.state_dict()
    model = patch_model(original("qwen3_moe", hidden=128, intermediate=128), quantization="fp8_block")
    unquantized = original("qwen3_moe", hidden=128, intermediate=128).model.layers[1].mlp.state_dict()
    with pytest.raises(ValueError, match=r"^load_state_dict: 'the block''s routed experts are stored as 'bf16' in "
                                         r"the checkpoint, the layer's as 'fp8_block': patch the model with "
                                         r"quantization='bf16'$"):
        model.model.layers[1].mlp.load_state_dict(unquantized)


def test_a_bf16_checkpoint_assigned_to_a_meta_model_keeps_the_float32_router():
    """load_state_dict(assign=True) of a bf16 checkpoint into a bf16 model patched on the meta device: the router
    becomes float32 (the layer's own dtype, its bf16 values exactly), the experts stay bf16."""
    with torch.device("meta"):
        model = MODELS["qwen3_moe"].make().to(torch.bfloat16)
    patch_model(model)
    state = original("qwen3_moe").to(torch.bfloat16).state_dict()
    model.load_state_dict(state, assign=True, strict=False)
    moe = model.model.layers[1].mlp.moe
    router = moe.router.linear_router.weight
    assert router.dtype == torch.float32 and not router.is_meta
    assert torch.equal(router, state["model.layers.1.mlp.gate.weight"].float())
    assert moe.expert_mlps.mlp_op.gate_up_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, None])
def test_a_model_cast_after_patching_saves_every_key_in_its_new_dtype(cast):
    """model.to(dtype) after patch_model: the MoE keys come out in the new dtype, as the other keys and an unpatched
    model cast alike do -- their values the unpatched model's cast (the experts, exactly; the router through the
    layer's float32 copy, exactly). Without a cast they keep the dtypes of patching (the control: a model patched
    in bf16 gives its float32-held router back in bf16)."""
    reference = original("qwen3_moe")
    model = original("qwen3_moe")
    patch_model(model)
    if cast is not None:
        model, reference = model.to(cast), reference.to(cast)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    bf16 = original("qwen3_moe").to(torch.bfloat16)
    patch_model(bf16)
    assert bf16.model.layers[1].mlp.moe.router.linear_router.weight.dtype == torch.float32
    assert {v.dtype for v in bf16.state_dict().values()} == {torch.bfloat16}


def test_a_bf16_model_cast_to_float32_and_a_router_kept_in_float32_follow_the_cast():
    """Patched in bf16 and cast to float32: every key float32, as the unpatched model cast alike (bf16 keys follow a
    cast too). Patched in float32, cast to bf16, the routers then put back in float32 (what the application does to
    keep routing exact): the router keys still come in bf16, the model's dtype."""
    model, reference = original("qwen3_moe").to(torch.bfloat16), original("qwen3_moe").to(torch.bfloat16)
    patch_model(model)
    model, reference = model.float(), reference.float()
    ours, theirs = model.state_dict(), reference.state_dict()
    assert all(ours[k].dtype == theirs[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k]) for k in ours)
    model = original("qwen3_moe")
    patch_model(model)
    model = model.to(torch.bfloat16)
    routers = [m.moe.router for m in model.modules() if hasattr(m, "moe")]
    for router in routers:
        router.float()
    assert routers and all(r.linear_router.weight.dtype == torch.float32 for r in routers)
    state = model.state_dict()
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    expected = original("qwen3_moe").to(torch.bfloat16).state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_the_cast_is_the_dtype_most_of_the_changed_tensors_took():
    """Tensors cast to different dtypes since patching (a model cast, one part cast again by hand): the dtype most
    of them took names the cast; none changed: no cast."""
    from nxd_moe.models.patch import PatchedMoEBlock

    block = SimpleNamespace(patched_dtypes={"a": torch.float32, "b": torch.float32, "c": torch.float32,
                                            "d": torch.float8_e4m3fn})
    cast = PatchedMoEBlock._cast_dtype
    half, bf16, fp8 = torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(
        1, dtype=torch.float8_e5m2)
    assert cast(block, {"a": bf16, "b": half, "c": bf16, "d": fp8}) == torch.bfloat16  # 1-byte tensors never count
    assert cast(block, {"a": half, "b": half, "c": bf16}) == torch.float16
    assert cast(block, {"a": torch.zeros(1), "b": torch.zeros(1), "e": half}) is None  # unknown keys do not count


ATTENTION = [r"model.layers.\d+.self_attn." + proj for proj in ("k_proj", "o_proj", "q_proj", "v_proj")]
MLA = [r"model.layers.\d+.self_attn." + proj
       for proj in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj")]
FP8_BLOCKS = dict(activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128])
# (name, patch_model arguments, the quantization_config save_pretrained writes): modules_to_not_convert lists, one
# pattern per name across layers, every Linear / experts module holding unquantized weights -- attention, LM head,
# routers, dense MLPs (DeepSeek's layer 0), unquantized experts -- and nothing inside the quantized ones.
QUANTIZATION_CONFIGS = [
    ("mixtral", dict(quantization="fp8_block"),
     dict(quant_method="fp8", modules_to_not_convert=["lm_head", r"model.layers.\d+.mlp.gate", *ATTENTION],
          **FP8_BLOCKS)),
    ("gpt_oss", dict(quantization="mxfp4"),
     dict(quant_method="mxfp4", modules_to_not_convert=["lm_head", r"model.layers.\d+.mlp.router", *ATTENTION])),
    ("deepseek_v3", dict(shared_quantization="fp8_block"),
     dict(quant_method="fp8", modules_to_not_convert=[
         "lm_head", r"model.layers.\d+.mlp.down_proj", r"model.layers.\d+.mlp.experts", r"model.layers.\d+.mlp.gate",
         r"model.layers.\d+.mlp.gate_proj", r"model.layers.\d+.mlp.up_proj", *MLA], **FP8_BLOCKS)),
]


@pytest.mark.parametrize("name,kwargs,expected", QUANTIZATION_CONFIGS, ids=[c[0] for c in QUANTIZATION_CONFIGS])
def test_the_quantization_config_lists_exactly_the_unquantized_modules(name, kwargs, expected):
    model = patch_model(original(name, hidden=128, intermediate=128), **kwargs)
    assert model.config.quantization_config == expected
    assert getattr(patch_model(original(name)).config, "quantization_config", None) is None  # nothing quantized


def test_a_module_named_like_a_quantized_one_keeps_its_own_name():
    """Linears a user added to DeepSeek's dense layer 0 under the names of layer 1's quantized modules
    (``mlp.experts``, ``mlp.shared_experts``): a layer-index pattern for them would also match the quantized
    experts (or their ``shared_experts.*`` children) and keep transformers from converting those, so they are
    listed by their own names."""
    model = original("deepseek_v3", hidden=128, intermediate=128)
    model.model.layers[0].mlp.experts = torch.nn.Linear(4, 4)
    model.model.layers[0].mlp.shared_experts = torch.nn.Linear(4, 4)
    patch_model(model, quantization="fp8_block", shared_quantization="fp8_block")
    assert model.config.quantization_config == dict(quant_method="fp8", modules_to_not_convert=[
        "lm_head", "model.layers.0.mlp.experts", "model.layers.0.mlp.shared_experts", r"model.layers.\d+.mlp.down_proj",
        r"model.layers.\d+.mlp.gate", r"model.layers.\d+.mlp.gate_proj", r"model.layers.\d+.mlp.up_proj", *MLA],
        **FP8_BLOCKS)


def test_patch_model_refusals_say_all_of_what_they_say():
    """Whole messages: each names the argument or the model and what to do instead."""
    not_a_model = torch.nn.Module()
    not_a_model.config = type("Config", (), {"model_type": None})()
    for model, name in ((torch.nn.Linear(2, 2), "Linear"), (not_a_model, "Module")):
        with pytest.raises(TypeError, match=r"^patch_model: model must be a transformers model \(an nn\.Module with a "
                                            rf"config\.model_type\), got {name}$"):
            patch_model(model)
    for name in ("dtype", "device", "scale"):
        with pytest.raises(TypeError, match=rf"^patch_model: '{name}' is the model's own \(convert the model itself, "
                                            r"e\.g\. model\.to\(\), before patching\)$"):
            patch_model(original("mixtral"), **{name: None})
    with pytest.raises(ValueError, match=r"^patch_model: shared_quantization='fp8', but model_type 'mixtral' has no "
                                         r"shared experts$"):
        patch_model(original("mixtral"), shared_quantization="fp8")
    patched = patch_model(original("mixtral"))
    with pytest.raises(ValueError, match=r"^patch_model: the model is already patched \(2 MoE blocks, "
                                         r"model\.nxd_moe_patched\); patch a fresh model$"):
        patch_model(patched)


# ----------------------------------------------------------------------------------------------------------
# the experts interface: layouts, activations, refusals in whole


def experts_module(kind: str, **changes) -> torch.nn.Module:
    """A decorated experts module of test_experts_backend.py (Mixtral's, GPT-OSS's, transposed with biases,
    ungated) with attributes replaced (``None`` deletes a parameter or submodule)."""
    from test_experts_backend import make_experts

    module = make_experts(kind)
    for name, value in changes.items():
        if name in module._modules or name in module._parameters:
            delattr(module, name)
        if value is not None:
            object.__setattr__(module, name, value) if callable(value) and not isinstance(value, torch.nn.Module) \
                else setattr(module, name, value)
    return module


WEIGHT_DTYPES = "['torch.float32', 'torch.bfloat16', 'torch.float16', 'torch.float64']"
ACTIVATIONS = ("['gelu', 'leaky_relu', 'relu', 'sigmoid', 'silu', 'tanh'] (transformers' SiLU, GELU (erf), ReLU, "
               "Sigmoid, Tanh and LeakyReLU(0.01) modules, or those torch functions)")
REFUSED = {
    "int8_down": (lambda: experts_module("mixtral", down_proj=torch.nn.Parameter(
        torch.zeros(8, 32, 24, dtype=torch.int8), requires_grad=False)),
        f"MixtralExperts: down_proj must be a 3-D tensor of {WEIGHT_DTYPES}, got (8, 32, 24) torch.int8 (quantized "
        "experts are not served)"),
    "no_gate_up": (lambda: experts_module("mixtral", gate_up_proj=None),
                   f"MixtralExperts: gate_up_proj must be a 3-D tensor of {WEIGHT_DTYPES}, got NoneType (quantized "
                   "experts are not served)"),
    "bias_shape": (lambda: experts_module("transposed_bias", down_proj_bias=torch.nn.Parameter(torch.zeros(8, 31))),
                   "TransposedBiasExperts: has_bias=True needs down_proj_bias of shape (8, 32), got (8, 31)"),
    "no_bias": (lambda: experts_module("transposed_bias", down_proj_bias=None),
                "TransposedBiasExperts: has_bias=True needs down_proj_bias of shape (8, 32), got None"),
    "alpha": (lambda: experts_module("gpt_oss", alpha="x"),
              "GptOssExperts: GPT-OSS's gate needs a number alpha and a number (or None) limit, got alpha='x', "
              "limit=1.0"),
    "limit": (lambda: experts_module("gpt_oss", limit="1"),
              "GptOssExperts: GPT-OSS's gate needs a number alpha and a number (or None) limit, got alpha=1.702, "
              "limit='1'"),
    "concatenated_gpt_oss": (lambda: experts_module("gpt_oss", is_concatenated=True),
                             "GptOssExperts: GPT-OSS's _apply_gate reads interleaved gate/up columns but "
                             "is_concatenated=True"),
    "instance_gate": (lambda: experts_module("mixtral", _apply_gate=lambda gate_up: gate_up),
                      "MixtralExperts: _apply_gate is overridden on the instance; only the class's default gate or "
                      "GPT-OSS's is known"),
    "post_norm": (lambda: experts_module("mixtral", has_post_expert_norm=True),
                  "MixtralExperts: has_post_expert_norm=True (a norm after each expert) is not supported; use "
                  "experts_implementation='eager' or 'grouped_mm'"),
    "tanh_gelu": (lambda: experts_module("mixtral", act_fn=torch.nn.GELU(approximate="tanh")),
                  f"MixtralExperts: act_fn GELU(approximate='tanh') is not supported; supported: {ACTIVATIONS}"),
    "leaky_0.2": (lambda: experts_module("mixtral", act_fn=torch.nn.LeakyReLU(0.2)),
                  f"MixtralExperts: act_fn LeakyReLU(negative_slope=0.2) is not supported; supported: {ACTIVATIONS}"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refusal_says_all_of_what_it_says(case):
    from nxd_moe.models.experts_backend import UnsupportedExpertsError, experts_layout

    make, message = REFUSED[case]
    with pytest.raises(UnsupportedExpertsError, match=f"^{re.escape('nxd_moe experts implementation: ' + message)}$"):
        experts_layout(make())


def test_modules_and_models_outside_the_interface_are_named():
    from nxd_moe.models.experts_backend import UnsupportedExpertsError, check_experts_support, experts_layout

    with pytest.raises(UnsupportedExpertsError, match=r"^nxd_moe experts implementation: lin \(Linear\): not an "
                                                      r"experts module of transformers' experts interface \(a class "
                                                      r"decorated with use_experts_implementation\)$"):
        experts_layout(torch.nn.Linear(2, 2), "lin")
    with pytest.raises(UnsupportedExpertsError, match=r"^nxd_moe experts implementation: Sequential: it has no "
                                                      r"experts module decorated with transformers' "
                                                      r"use_experts_implementation; swap its MoE blocks for nxd_moe "
                                                      r"layers instead \(nxd_moe\.hf\.patch_model\)$"):
        check_experts_support(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    dbrx = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dbrx.config = transformers.DbrxConfig()
    with pytest.raises(UnsupportedExpertsError, match=r"^nxd_moe experts implementation: Sequential: DBRX's experts "
                                                      r"are not decorated with use_experts_implementation in "
                                                      r"transformers 5, so experts_implementation does not reach "
                                                      r"them; swap its MoE blocks for nxd_moe layers instead "
                                                      r"\(nxd_moe\.hf\.patch_model\)$"):
        check_experts_support(dbrx)


@pytest.mark.parametrize("act_fn,name", [
    (torch.nn.GELU(), "gelu"), (torch.nn.LeakyReLU(0.01), "leaky_relu"), (torch.nn.Tanh(), "tanh"),
    (torch.nn.Sigmoid(), "sigmoid"), (torch.nn.ReLU(), "relu"), (torch.tanh, "tanh"),
    (torch.nn.functional.silu, "silu")], ids=["GELU", "LeakyReLU", "Tanh", "Sigmoid", "ReLU", "torch.tanh", "F.silu"])
def test_activations_by_module_class_or_function(act_fn, name):
    from nxd_moe.models.experts_backend import experts_layout

    activation = experts_layout(experts_module("mixtral", act_fn=act_fn)).activation
    assert (activation.hidden_act, activation.glu_mlp, activation.gate_up_interleaved) == (name, True, False)


def test_gpt_oss_gate_clamps_only_with_a_limit():
    """GPT-OSS's gate: sigmoid(alpha * g) * g * (u + 1) on interleaved columns; a limit L clamps g from above and u
    on both sides, limit None clamps nothing."""
    from nxd_moe.experts.activation import ExpertActivation
    from nxd_moe.models.experts_backend import experts_layout
    from nxd_moe.moe_configs import GLUType

    common = dict(hidden_act="sigmoid", glu_mlp=True, glu_type=GLUType.SWIGLU, scaling_factor=1.25, act_bias=1.0,
                  intermediate_size=24, gate_up_interleaved=True)
    clamped = experts_layout(experts_module("gpt_oss", alpha=1.25, limit=3)).activation
    assert clamped == ExpertActivation(**common, gate_upper=3.0, up_lower=-3.0, up_upper=3.0)
    assert clamped.gate_lower is None
    unclamped = experts_module("gpt_oss", alpha=1.25)
    unclamped.limit = None
    assert experts_layout(unclamped).activation == ExpertActivation(**common)


def test_the_automatic_backend_by_device_type_and_dtype(monkeypatch):
    """``"nxd_moe"``'s choice, from an empty cache: torch for CPU tensors; for CUDA ones (a stand-in with a CUDA
    device: only its device type and dtype are read) triton where it computes the dtype, else torch. Each choice
    is kept per (device type, dtype)."""
    import types

    import nxd_moe.models.experts_backend as eb
    from nxd_moe.experts import TorchBackend

    pytest.importorskip("triton")
    from nxd_moe.triton_kernels.backend import TritonBackend

    monkeypatch.setattr(eb, "_AUTOMATIC", {})
    cpu = eb._automatic_backend(torch.zeros(1, dtype=torch.bfloat16))
    cuda = {dtype: eb._automatic_backend(types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype))
            for dtype in (torch.bfloat16, torch.float64)}
    assert type(cpu) is TorchBackend and type(cuda[torch.float64]) is TorchBackend
    assert type(cuda[torch.bfloat16]) is TritonBackend
    assert eb._AUTOMATIC == {("cpu", torch.bfloat16): cpu, ("cuda", torch.bfloat16): cuda[torch.bfloat16],
                             ("cuda", torch.float64): cuda[torch.float64]}
    # and from an empty cache the experts function itself runs on the chosen backend
    monkeypatch.setattr(eb, "_AUTOMATIC", {})
    module = experts_module("mixtral")
    index = torch.tensor([[0, 3], [5, 0]])
    out = eb.experts_forward(module, torch.randn(2, 32), index, torch.full((2, 2), 0.5))
    assert out.shape == (2, 32) and list(eb._AUTOMATIC) == [("cpu", torch.float32)]


def test_the_triton_implementation_takes_the_triton_backend(monkeypatch):
    """``experts_implementation="nxd_moe_triton"`` always runs the triton backend: CPU tensors are refused by it
    (not computed on another backend)."""
    from nxd_moe.models.experts_backend import nxd_moe_triton_experts_forward

    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU tensors only where there is no CUDA device")
    from nxd_moe.triton_kernels.backend import TritonBackend  # noqa: F401 (kernels defined under the interpreter)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module = experts_module("mixtral")
    with pytest.raises(RuntimeError, match="the triton backend runs on CUDA tensors"):
        nxd_moe_triton_experts_forward(module, torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [4, 5]]),
                                       torch.full((3, 2), 0.5))


def test_models_patch_model_cannot_take_are_refused_in_whole(monkeypatch):
    """Checked before anything changes: a model type without a converted block, router logits transformers would
    record (on the config, or on a multimodal config's text_config), quantization of experts split across ranks
    (set here by hand: what tensor parallelism gives)."""
    import types

    import nxd_moe.models.patch as patch_module
    from nxd_moe.hf import SUPPORTED_MODEL_TYPES

    def bare(**config) -> torch.nn.Module:
        model = torch.nn.Module()
        model.config = types.SimpleNamespace(**config)
        return model

    unsupported = ("patch_model: Module (model_type 'llama') has no sparse-MoE block nxd_moe converts; supported "
                   f"model types: {list(SUPPORTED_MODEL_TYPES)}")
    with pytest.raises(ValueError, match=f"^{re.escape(unsupported)}$"):
        patch_model(bare(model_type="llama"))
    logits = (r"^patch_model: config\.output_router_logits is True, but patched blocks do not record router logits "
              r"\(transformers' auxiliary training loss\); set it to False$")
    with pytest.raises(ValueError, match=logits):
        patch_model(bare(model_type="mixtral", output_router_logits=True))
    with pytest.raises(ValueError, match=logits):
        patch_model(bare(model_type="llama4", text_config=types.SimpleNamespace(output_router_logits=True)))
    config = MODELS["qwen3_moe"].config(32, 24)
    config.mlp_only_layers = [0, 1]
    with pytest.raises(ValueError, match=r"^patch_model: Qwen3MoeForCausalLM \(model_type 'qwen3_moe'\) has no "
                                         r"Qwen3MoeSparseMoeBlock to replace; every layer is dense$"):
        patch_model(transformers.Qwen3MoeForCausalLM(config))
    monkeypatch.setattr(patch_module, "holds_whole_experts", lambda expert_mlps: False)
    model = original("mixtral", hidden=64, intermediate=64)
    with pytest.raises(NotImplementedError, match=r"^patch_model: quantizing on patch under tensor parallelism or "
                                                  r"hybrid sharding is not supported yet \(expert parallelism alone "
                                                  r"is\); patch in one process$"):
        patch_model(model, quantization="fp8")
    assert not hasattr(model, "nxd_moe_patched")


def test_the_default_backend_by_device(monkeypatch):
    """triton for a block on a CUDA device where the Triton kernels import, else torch (a CPU; no Triton)."""
    import nxd_moe.models.patch as patch_module

    assert patch_module._default_backend(torch.device("cpu")) == "torch"
    assert patch_module._default_backend(torch.device("meta")) == "torch"
    pytest.importorskip("triton")
    assert patch_module._default_backend(torch.device("cuda")) == "triton"

    def no_triton(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(patch_module.importlib, "import_module", no_triton)
    assert patch_module._default_backend(torch.device("cuda")) == "torch"


# ----------------------------------------------------------------------------------------------------------
# patch_model: checks and decisions seen from outside (mutation survivors of nxd_moe/models/patch.py)


def test_a_config_without_output_router_logits_is_accepted():
    """transformers configs without ``output_router_logits`` (on the config or its text_config) are taken: the
    attribute counts as False when absent."""
    import types

    import nxd_moe.models.patch as patch_module

    def bare(**config) -> torch.nn.Module:
        model = torch.nn.Module()
        model.config = types.SimpleNamespace(**config)
        return model

    assert patch_module._check_model(bare(model_type="mixtral")) == "mixtral"
    assert patch_module._check_model(bare(model_type="llama4", text_config=types.SimpleNamespace())) == "llama4"
    assert patch_module._check_model(bare(model_type="mixtral", output_router_logits=False)) == "mixtral"


def test_a_bad_shared_format_is_named_as_patch_models_shared_quantization():
    message = ("patch_model: shared_quantization must be one of ['bf16', 'fp8', 'fp8_block', 'mxfp4'] (or an NxD "
               "alias ['blockwise_symmetric', 'expert_wise_per_channel_symmetric', 'f4e2m1fn_x4', 'f8e4m3', "
               "'fp8_per_channel', 'none']), got 'int3'")
    model = original("qwen2_moe")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        patch_model(model, shared_quantization="int3")
    assert not hasattr(model, "nxd_moe_patched")


def test_a_dense_model_names_every_block_class_it_looked_for(monkeypatch):
    from nxd_moe.hf import families

    monkeypatch.setattr(families._FAMILIES["qwen3_moe"], "block_classes",
                        ("Qwen3MoeSparseMoeBlock", "Qwen3MoeOtherBlock"))
    config = MODELS["qwen3_moe"].config(32, 24)
    config.mlp_only_layers = [0, 1]
    with pytest.raises(ValueError, match=r"^patch_model: Qwen3MoeForCausalLM \(model_type 'qwen3_moe'\) has no "
                                         r"Qwen3MoeSparseMoeBlock or Qwen3MoeOtherBlock to replace; every layer is "
                                         r"dense$"):
        patch_model(transformers.Qwen3MoeForCausalLM(config))


def test_on_a_cpu_pairs_only_where_grouped_mm_multiplies_the_dtype():
    """The default backend on a CPU: ``TorchBackend(pairs=True)`` for float32 (grouped_mm takes it; H 32, I 24
    give 16-byte aligned rows), NxD's rules (no pairs) for float64, which grouped_mm does not take."""
    f32 = patch_model(original("mixtral"))
    f64 = patch_model(original("mixtral").to(torch.float64))
    assert f32.model.layers[0].mlp.moe.expert_mlps.backend.pairs is True
    assert f64.model.layers[0].mlp.moe.expert_mlps.backend.pairs is False
    assert f64.nxd_moe_patched.backend == "torch"


def test_the_probe_layer_is_built_on_meta_with_the_given_arguments(monkeypatch):
    """The layer checked before anything changes: on the meta device, with the backend, formats and build
    arguments given; shared_quantization only for a model with shared experts."""
    import nxd_moe.models.patch as patch_module

    calls = []
    real = patch_module.build_moe

    def spy(cfg, **kwargs):
        calls.append(kwargs)
        return real(cfg, **kwargs)

    monkeypatch.setattr(patch_module, "build_moe", spy)
    patch_model(original("qwen2_moe", hidden=64, intermediate=64), backend="torch", quantization="fp8",
                shared_quantization="fp8", block_size=64)
    assert calls[0] == {"device": "meta", "backend": "torch", "quantization": "fp8", "shared_quantization": "fp8",
                        "block_size": 64}
    calls.clear()
    patch_model(original("mixtral"), backend="torch", block_size=32)
    assert calls[0] == {"device": "meta", "backend": "torch", "quantization": None, "block_size": 32}


def test_experts_already_in_the_asked_format_are_not_requantized(monkeypatch):
    """quantize_experts / quantize_shared_experts run once per block only where a format is asked for and differs
    from the layer's (bf16 here): not without arguments, not for quantization='bf16'."""
    import nxd_moe.models.patch as patch_module

    calls = []

    def spying(name, real):
        def spy(moe, fmt):
            calls.append((name, fmt))
            return real(moe, fmt)
        return spy

    for name in ("quantize_experts", "quantize_shared_experts"):
        monkeypatch.setattr(patch_module, name, spying(name, getattr(patch_module, name)))
    patch_model(original("mixtral"))
    patch_model(original("mixtral"), quantization="bf16")
    patch_model(original("qwen2_moe"))
    patch_model(original("qwen2_moe"), quantization="bf16", shared_quantization="bf16")
    assert calls == []
    patch_model(original("mixtral", hidden=64, intermediate=64), quantization="fp8")
    assert calls == [("quantize_experts", "fp8")] * 2
    calls.clear()
    patch_model(original("qwen2_moe", hidden=64, intermediate=64), shared_quantization="fp8")
    assert calls == [("quantize_shared_experts", "fp8")] * 2


# ----------------------------------------------------------------------------------------------------------
# experts_backend: refusals word for word, flag defaults, caches, dtypes and token counts


def _eb_module(*, gated=True, transposed=False, e=4, h=8, i=4, flags=True, gate=True, **attrs):
    """A bare experts module: ``_apply_gate`` on the class (transformers' default unless ``gate`` is something
    else), ``is_transposed`` on the instance and, when ``flags``, the decorator's other flags at their defaults."""
    from transformers.integrations.moe import _default_apply_gate

    cls_attrs = {} if gate is None else {"_apply_gate": _default_apply_gate if gate is True else gate}
    module = type("BareExperts", (torch.nn.Module,), cls_attrs)()
    module.is_transposed = transposed
    if flags:
        module.has_gate, module.has_bias, module.has_post_expert_norm = gated, False, False
        module.is_concatenated, module._is_expert_parallel = True, False
    gen = torch.Generator().manual_seed(7)
    first = (e, h, 2 * i if gated else i) if transposed else (e, 2 * i if gated else i, h)
    setattr(module, "gate_up_proj" if gated else "up_proj", torch.nn.Parameter(torch.randn(*first, generator=gen)))
    module.down_proj = torch.nn.Parameter(torch.randn(*((e, i, h) if transposed else (e, h, i)), generator=gen))
    module.num_experts = e
    module.act_fn = torch.nn.SiLU() if gated else torch.nn.ReLU()
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def _eb_refusal(module) -> str:
    from nxd_moe.models.experts_backend import UnsupportedExpertsError, experts_layout

    with pytest.raises(UnsupportedExpertsError) as info:
        experts_layout(module)
    return str(info.value)


_EB_DTYPES = "['torch.float32', 'torch.bfloat16', 'torch.float16', 'torch.float64']"


def test_eb_layout_defaults_without_the_decorator_flags():
    """Only ``is_transposed`` set: has_gate True, has_bias False, no post norm, the default gate's [gate | up]
    halves, and ids >= E sentinels always (no ``_is_expert_parallel``); with that flag, not always."""
    from nxd_moe.experts.activation import ExpertActivation
    from nxd_moe.models.experts_backend import ExpertsLayout, experts_layout
    from nxd_moe.moe_configs import GLUType

    module = _eb_module(flags=False)
    silu = ExpertActivation("silu", True, GLUType.GLU, intermediate_size=4)
    assert experts_layout(module) == ExpertsLayout("gate_up_proj", False, False, 4, silu, sentinels_always=True)
    module._is_expert_parallel = False
    assert experts_layout(module) == ExpertsLayout("gate_up_proj", False, False, 4, silu, sentinels_always=False)
    assert experts_layout(module).sentinels_always is False


def test_eb_ungated_layout_and_refusal():
    from nxd_moe.experts.activation import ExpertActivation
    from nxd_moe.models.experts_backend import ExpertsLayout, experts_layout
    from nxd_moe.moe_configs import GLUType

    module = _eb_module(gated=False, i=5)
    layout = experts_layout(module)
    assert layout == ExpertsLayout("up_proj", False, False, 4,
                                   ExpertActivation("relu", False, GLUType.GLU, intermediate_size=5))
    assert layout.activation.glu_mlp is False and layout.activation.intermediate_size == 5
    module.act_fn = torch.nn.Softplus()
    from nxd_moe.activations import ACT2FN

    assert _eb_refusal(module) == (
        f"nxd_moe experts implementation: BareExperts: act_fn Softplus(beta=1.0, threshold=20.0) is not supported; "
        f"supported: {sorted(ACT2FN)} (transformers' SiLU, GELU (erf), ReLU, Sigmoid, Tanh and LeakyReLU(0.01) "
        "modules, or those torch functions)")
    del module.act_fn
    assert _eb_refusal(module).startswith("nxd_moe experts implementation: BareExperts: act_fn None is not supported")


def test_eb_gated_activation_fields():
    from nxd_moe.models.experts_backend import experts_layout
    from nxd_moe.moe_configs import GLUType

    activation = experts_layout(_eb_module(i=3, h=6)).activation
    assert (activation.hidden_act, activation.glu_mlp, activation.glu_type, activation.intermediate_size) == (
        "silu", True, GLUType.GLU, 3)


def test_eb_gate_refusals_word_for_word():
    assert _eb_refusal(_eb_module(is_concatenated=False)) == (
        "nxd_moe experts implementation: BareExperts: is_concatenated=False (interleaved gate/up) but the default "
        "_apply_gate splits [gate | up] halves: which layout the weights hold is ambiguous")

    def my_gate(self, gate_up):
        return gate_up

    assert _eb_refusal(_eb_module(gate=my_gate)) == (
        f"nxd_moe experts implementation: BareExperts: its _apply_gate (from {__name__}) is not one nxd_moe computes: "
        "supported are transformers' default (act_fn(gate) * up) and GPT-OSS's clamped SwiGLU")


def test_eb_gpt_oss_alpha_and_limit_may_be_missing():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from nxd_moe.experts.activation import ExpertActivation
    from nxd_moe.models.experts_backend import experts_layout
    from nxd_moe.moe_configs import GLUType

    config = GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=4, num_experts_per_tok=2)
    module = GptOssExperts(config)
    module.alpha = 1.5
    del module.limit
    assert experts_layout(module).activation == ExpertActivation(
        "sigmoid", True, GLUType.SWIGLU, scaling_factor=1.5, act_bias=1.0, intermediate_size=4,
        gate_up_interleaved=True)
    del module.alpha
    assert _eb_refusal(module) == (
        "nxd_moe experts implementation: GptOssExperts: GPT-OSS's gate needs a number alpha and a number (or None) "
        "limit, got alpha=None, limit=None")


def test_eb_loaded_of_a_missing_module_is_none():
    from nxd_moe.models.experts_backend import _loaded

    assert _loaded("nxd_moe_no_such_module", "a", "b") is None
    assert _loaded("torch", "no_such_attribute", "b") is None


def test_eb_shape_refusals_word_for_word():
    prefix = "nxd_moe experts implementation: BareExperts: "
    module = _eb_module()
    del module.num_experts
    assert _eb_refusal(module) == prefix + (
        "with is_transposed=False, gate_up_proj (4, 8, 8) and down_proj (4, 8, 4) must be (E, W, H) / (E, H, I) "
        "with E = num_experts (None) and W = 2I")
    module = _eb_module(transposed=True, e=3, h=8, i=2)
    module.down_proj = torch.nn.Parameter(torch.zeros(5, 2, 8))  # only the down projection's E differs
    assert _eb_refusal(module) == prefix + (
        "with is_transposed=True, gate_up_proj (3, 8, 4) and down_proj (5, 2, 8) must be (E, H, W) / (E, I, H) "
        "with E = num_experts (3) and W = 2I")
    module = _eb_module(gated=False, e=4, h=8, i=4, num_experts=6)  # only num_experts differs
    assert _eb_refusal(module) == prefix + (
        "with is_transposed=False, up_proj (4, 4, 8) and down_proj (4, 8, 4) must be (E, W, H) / (E, H, I) "
        "with E = num_experts (6) and W = I")
    module = _eb_module()
    module.down_proj = torch.nn.Parameter(torch.zeros(4, 6, 4))  # only H differs
    assert _eb_refusal(module).startswith(prefix + "with is_transposed=False, gate_up_proj (4, 8, 8) and down_proj "
                                          "(4, 6, 4) must be")


def test_eb_weight_type_refusals_word_for_word():
    prefix = "nxd_moe experts implementation: BareExperts: "
    module = _eb_module()
    del module.down_proj
    assert _eb_refusal(module) == prefix + (
        f"down_proj must be a 3-D tensor of {_EB_DTYPES}, got NoneType (quantized experts are not served)")
    module = _eb_module()
    del module.gate_up_proj
    module.gate_up_proj = [1.0]
    assert _eb_refusal(module) == prefix + (
        f"gate_up_proj must be a 3-D tensor of {_EB_DTYPES}, got list (quantized experts are not served)")


def test_eb_is_experts_module_needs_both_conditions():
    from nxd_moe.models.experts_backend import is_experts_module

    assert is_experts_module(_eb_module())
    assert not is_experts_module(_eb_module(gate=None))  # is_transposed alone
    module = _eb_module()
    del module.is_transposed
    assert not is_experts_module(module)  # _apply_gate alone


def test_eb_backends_are_cached_per_name_and_key(monkeypatch):
    import nxd_moe.models.experts_backend as eb
    from nxd_moe.experts import TorchBackend

    mine, auto = TorchBackend(), TorchBackend()
    monkeypatch.setattr(eb, "_BACKENDS", {"mine": mine})
    assert eb._backend("mine") is mine and eb._backend("mine") is mine
    torch_backend = eb._backend("torch")
    assert type(torch_backend) is TorchBackend and eb._BACKENDS["torch"] is torch_backend
    assert eb._backend("torch") is torch_backend
    monkeypatch.setattr(eb, "_AUTOMATIC", {("cpu", torch.float64): auto})
    assert eb._automatic_backend(torch.zeros(1, dtype=torch.float64)) is auto
    assert eb._automatic_backend(torch.zeros(1, dtype=torch.float32)) is torch_backend


def test_eb_local_slot_is_cached_per_device():
    from nxd_moe.models.experts_backend import experts_layout

    layout = experts_layout(_eb_module(e=5))
    slot = layout.local_slot(torch.device("cpu"))
    assert slot.tolist() == [0, 1, 2, 3, 4]
    assert layout.local_slot(torch.device("cpu")) is slot


def _eb_reference(module, x, index, weight):
    """float64: sum over each token's experts (ids >= E contribute nothing) of w * down(silu(gate) * up)."""
    gate_up, down = module.gate_up_proj.detach().double(), module.down_proj.detach().double()
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if e >= gate_up.shape[0]:
                continue
            proj = gate_up[e] @ x[t].double()
            hidden = torch.nn.functional.silu(proj[:inter]) * proj[inter:]
            out[t] += float(weight[t, j]) * (down[e] @ hidden)
    return out


@pytest.mark.parametrize("num_tokens", [0, 1, 3])
def test_eb_forward_token_counts_and_dtype(num_tokens):
    """fp32 weights, float64 rows: the output is float64 and matches the float64 sum; T == 0 gives zeros; ids >= E
    are sentinels on a module without ``_is_expert_parallel``."""
    from nxd_moe.models.experts_backend import experts_forward

    module = _eb_module(flags=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, 8, generator=gen, dtype=torch.float64)
    index = torch.tensor([[0, 2], [3, 4], [1, 7]][:num_tokens], dtype=torch.long).reshape(num_tokens, 2)
    weight = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]][:num_tokens], dtype=torch.float64).reshape(
        num_tokens, 2)
    for backend in (None, "torch"):
        out = experts_forward(module, x, index, weight, backend)
        assert out.dtype == torch.float64 and out.shape == (num_tokens, 8)
        torch.testing.assert_close(out, _eb_reference(module, x, index, weight), rtol=1e-4, atol=1e-4)
        if num_tokens == 0:
            assert out.numel() == 0


def test_eb_forward_shape_refusal_word_for_word():
    from nxd_moe.models.experts_backend import experts_forward

    module = _eb_module()
    index, weight = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    with pytest.raises(ValueError) as info:
        experts_forward(module, torch.zeros(4, 8), index, weight)
    assert str(info.value) == ("nxd_moe experts implementation: hidden_states must be (T, H) with H = 8 and "
                               "top_k_index, top_k_weights (T, k); got (4, 8), (3, 2), (3, 2)")


def test_eb_automatic_mode_needs_every_weight_dim_aligned(monkeypatch):
    """On a CPU in fp32 the pairs are sorted by expert at every T only where grouped_mm takes all four weight
    dims (16-byte rows): I = 2 (8 bytes) is not, so T*k >= E follows NxD's rules, not selective loading."""
    import nxd_moe.models.experts_backend as eb
    from nxd_moe.experts import ExpertsMode

    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("no grouped_mm")
    modes = []
    real = eb.experts_forward_pairs

    def spy(backend, x, pair_expert, weights_, w, slot, mode, config):
        modes.append(mode)
        return real(backend, x, pair_expert, weights_, w, slot, mode, config)

    monkeypatch.setattr(eb, "experts_forward_pairs", spy)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    weight = torch.full((8, 2), 0.5)
    for inter in (4, 2):
        module = _eb_module(e=4, h=8, i=inter)
        eb.experts_forward(module, torch.randn(8, 8), index, weight)
    assert modes[0] == ExpertsMode.SELECTIVE_LOADING and modes[1] != ExpertsMode.SELECTIVE_LOADING
