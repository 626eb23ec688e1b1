"""``build_hf_model``: every shipped config becomes the transformers model of its architecture, whose MoE blocks
compute the config's (scaled) MoE layer, with the dense layers where the architecture has them; named errors."""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_helpers import hf_output, one_intra_op_thread  # noqa: E402, F401

from nxd_moe.config import builtin_config_names, load_model_config  # noqa: E402
from nxd_moe.hf import from_hf_config, from_hf_moe_block  # noqa: E402
from nxd_moe.models.hf_models import build_hf_config, build_hf_model  # noqa: E402
from nxd_moe.reference import reference_for_moe  # noqa: E402

SCALE = 64
# The sparse-MoE block class of each family (what patch_model swaps).
MOE_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
              "mixtral": "MixtralSparseMoeBlock", "gpt_oss": "GptOssMLP", "deepseek_v3": "DeepseekV3MoE",
              "llama4_text": "Llama4TextMoe", "dbrx": "DbrxFFN"}
# A float64 model against the float64 reference, but the routing weights are float32 on both sides (our router's
# dtype; transformers' routers take softmax(dtype=torch.float)): each of the k <= 8 weights carries a relative error
# of about 8 float32 roundings (2**-24 ~ 6e-8: the logit sum as seen through the softmax, exp, the normalisations),
# so |error| <= k * 8 * 6e-8 * max|expert output| ~ 4e-6 of the output's scale; the expert MLPs themselves add
# float64 rounding only (~1e-13). Measured: 7e-8 to 1.6e-7.
REL_TOL = 4e-6


def moe_blocks(model, model_type: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == MOE_BLOCKS[model_type]]


def block_error(block, cfg, x: torch.Tensor) -> tuple[float, float]:
    """(max |HF block - float64 reference of ``cfg``'s layer holding the block's weights|, max |reference|)."""
    moe = from_hf_moe_block(block, cfg)
    ref = reference_for_moe(moe, x)
    return float((hf_output(block, x) - ref).abs().max()), float(ref.abs().max())


@pytest.fixture(scope="module", params=builtin_config_names())
def built(request):
    name = request.param
    model = build_hf_model(name, num_layers=2, scale=SCALE, dtype=torch.float64)
    model.set_experts_implementation("eager")  # transformers' default, grouped_mm, has no float64 kernel
    return name, model


def test_every_shipped_config_builds_and_runs(built):
    name, model = built
    cfg = load_model_config(name)
    small = cfg.scaled(SCALE)
    assert isinstance(model, transformers.PreTrainedModel) and type(model).__name__.endswith("ForCausalLM")
    assert not model.training
    assert model.config.model_type == cfg.hf_model_type
    # from_hf_config reads the same scaled MoE layer back, with exactly the 2 MoE layers asked for
    back = from_hf_config(model.config)
    assert (back.num_experts, back.top_k, back.hidden_size, back.intermediate_size) == (
        small.num_experts, small.top_k, small.hidden_size, small.intermediate_size)
    assert back.router == small.router and back.num_moe_layers == 2
    assert len(moe_blocks(model, cfg.hf_model_type)) == 2
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 6, vocab) and logits.dtype == torch.float64
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_moe_blocks_compute_the_configs_layer(built):
    """Each MoE block equals the float64 reference of the shipped config's layer (scaled) holding its weights:
    the transformers model computes what the config says, not only what from_hf_config reads back."""
    name, model = built
    cfg = load_model_config(name).scaled(SCALE)
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for block in moe_blocks(model, cfg.hf_model_type):
        err, size = block_error(block, cfg, x)
        assert size > 0 and err <= REL_TOL * size, (name, err, size)


def test_block_check_rejects_another_layer():
    """Negative control for the check above: the reference of a layer that renormalises Qwen3's top-8 weights
    differently (no renormalisation) is far outside the bound."""
    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, dtype=torch.float64)
    model.set_experts_implementation("eager")
    cfg = load_model_config("qwen3-30b-a3b").scaled(SCALE)
    wrong = dataclasses.replace(cfg, experts={**cfg.experts, "normalize_top_k_affinities": False})
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (block,) = moe_blocks(model, "qwen3_moe")
    err, size = block_error(block, wrong, x)
    assert err > 1e3 * REL_TOL * size, (err, size)


@pytest.mark.parametrize("name", builtin_config_names())
def test_full_size_config_reads_back_as_the_shipped_one(name):
    """At scale 1 the transformers config is the real model's: from_hf_config recognises the shipped config (its
    E, k, H, I) and counts its MoE layers."""
    hf_config = build_hf_config(name)
    back = from_hf_config(hf_config)
    cfg = load_model_config(name)
    assert back.name == f"hf:{name}" and back.num_moe_layers == cfg.num_moe_layers


def test_widths_scale_and_head_counts_stay():
    # Qwen3-30B-A3B at scale 16, by hand: H 2048/16, I 768/16, dense 6144/16, head_dim 128/16 = 8, vocab
    # ceil(151936/16/8)*8 = 9496; 32 query and 4 kv heads as in the real model.
    c = build_hf_config("qwen3-30b-a3b", scale=16)
    assert (c.hidden_size, c.moe_intermediate_size, c.intermediate_size, c.head_dim, c.vocab_size) == (
        128, 48, 384, 8, 9496)
    assert (c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (32, 4, 48)
    # DeepSeek-V3 at 16: the latent-attention widths shrink too (1536, 512, 128, 64, 128 / 16)
    d = build_hf_config("deepseek-v3", scale=16, num_layers=1)
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (
        96, 32, 8, 8, 8)
    assert d.num_attention_heads == 128 and d.intermediate_size == 1152


def test_quantization_rounds_the_moe_widths_to_the_format_blocks():
    """patch_model(quantization="mxfp4") needs H and I in whole 32-column blocks: GPT-OSS's 2880 / 64 = 45 rounds
    to 48 (multiples of 8) unquantized, to 64 for MxFP4."""
    plain = build_hf_config("gpt-oss-20b", scale=64)
    mx = build_hf_config("gpt-oss-20b", scale=64, quantization="mxfp4")
    assert (plain.hidden_size, plain.intermediate_size) == (48, 48)
    assert (mx.hidden_size, mx.intermediate_size) == (64, 64)


def test_dbrx_head_counts_follow_the_width():
    """DBRX's head width is d_model / n_heads: the heads must leave an even width (rope rotates pairs)."""
    assert (build_hf_config("dbrx", scale=16).n_heads, build_hf_config("dbrx", scale=16).attn_config.kv_n_heads) \
        == (48, 8)  # d_model 384: 48 heads of 8
    c = build_hf_config("dbrx", scale=3)  # d_model 2048 is not a multiple of 48: 16 heads of 128, 8 kv heads
    assert (c.d_model, c.n_heads, c.attn_config.kv_n_heads) == (2048, 16, 8)


def test_dense_layers_come_on_top_of_the_moe_layers():
    deepseek = build_hf_model("deepseek-v3", num_layers=1, scale=SCALE)
    kinds = [type(layer.mlp).__name__ for layer in deepseek.model.layers]
    assert kinds == ["DeepseekV3MLP"] * 3 + ["DeepseekV3MoE"]
    maverick = build_hf_model("llama4-maverick", num_layers=2, scale=SCALE)
    kinds = [type(layer.feed_forward).__name__ for layer in maverick.model.layers]
    assert kinds == ["Llama4TextMLP", "Llama4TextMoe"] * 2


def test_qwen2_moe_without_a_transformers_section_takes_transformers_defaults():
    """No shipped Qwen2-MoE config: one read from transformers' Qwen2MoeConfig (Qwen1.5-MoE-A2.7B) builds, with
    the class's attention (16 heads of hidden_size / 16) and its gated shared expert."""
    cfg = from_hf_config(transformers.Qwen2MoeConfig())
    assert not cfg.transformers
    model = build_hf_model(cfg, num_layers=1, scale=16)
    assert (model.config.hidden_size, model.config.num_attention_heads, model.config.vocab_size) == (128, 16, 9496)
    assert model.config.shared_expert_intermediate_size == 352  # 5632 / 16
    assert from_hf_config(model.config).shared_experts.gate


def test_seed_dtype_and_caller_rng():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_hf_model("mixtral-8x7b", num_layers=1, scale=SCALE, seed=5)
    assert torch.equal(torch.rand(1), expected_next)  # the caller's random stream is untouched
    b = build_hf_model("mixtral-8x7b", num_layers=1, scale=SCALE, seed=5)
    c = build_hf_model("mixtral-8x7b", num_layers=1, scale=SCALE, seed=6, dtype="bfloat16")
    for (key, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), key
        assert pc.dtype == torch.bfloat16
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(a.state_dict()[router].bfloat16(), c.state_dict()[router])


def test_attn_implementation_is_passed_on():
    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match="built-in"):
        build_hf_model("no-such-model")
    with pytest.raises(ValueError, match="num_layers"):
        build_hf_config("qwen3-30b-a3b", num_layers=0)
    with pytest.raises(TypeError, match="num_layers"):
        build_hf_config("qwen3-30b-a3b", num_layers=1.5)
    with pytest.raises(ValueError, match="scale"):
        build_hf_config("qwen3-30b-a3b", scale=0)
    with pytest.raises(TypeError, match="dtype"):
        build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, dtype="int8")
    base = load_model_config("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="hf_model_type None.*supported"):
        build_hf_config(dataclasses.replace(base, hf_model_type=None))
    with pytest.raises(ValueError, match="num_moe_layers.*num_layers"):
        build_hf_config(dataclasses.replace(base, num_moe_layers=None))
    with pytest.raises(ValueError, match=r"\['num_atention_heads'\].*Qwen3MoeConfig"):
        build_hf_config(dataclasses.replace(base, transformers={**base.transformers, "num_atention_heads": 8}))
    with pytest.raises(ValueError, match=r"\['layer_types'\].*layer count"):
        build_hf_config(dataclasses.replace(base, transformers={"layer_types": ["full_attention"]}))
    with pytest.raises(ValueError, match=r"\['moe_intermediate_size'\].*MoE fields"):
        build_hf_config(dataclasses.replace(base, transformers={"moe_intermediate_size": 64}))
    # a layer transformers' Qwen3-MoE cannot compute (sigmoid router) is refused, naming what differs
    sigmoid = dataclasses.replace(base, router=dataclasses.replace(base.router, act_fn="sigmoid"))
    with pytest.raises(ValueError, match="not a transformers qwen3_moe model: router"):
        build_hf_config(sigmoid)
    with pytest.raises(TypeError, match="transformers must be a mapping"):
        dataclasses.replace(base, transformers=["vocab_size"])
