"""``nxd_moe.hf``: configs and numerical parity with the transformers MoE blocks.

Every parity test compares ``from_hf_moe_block(block, config)(x)[0]`` with the output of the transformers block
itself (randomly initialised, small), in every expert-algorithm mode the semantics allow. Capacity-factor mode
drops tokens by design, so it is not compared. A few negative controls show that the knobs each model relies on
are load-bearing, i.e. that these comparisons can fail.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from hf_helpers import ATOL_FP32, HIDDEN, LAYERS, assert_parity, hf_output, inputs, one_intra_op_thread, randomize_hf_  # noqa: E402,F401 (autouse fixture)
from transformers import (  # noqa: E402
    DbrxConfig,
    DeepseekV3Config,
    GptOssConfig,
    Llama4Config,
    Llama4TextConfig,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.dbrx.modeling_dbrx import DbrxFFN  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from nxd_moe.config import MoEModelConfig, RouterSpec, SharedExpertsSpec  # noqa: E402
from nxd_moe.experts.backends import TorchBackend  # noqa: E402
from nxd_moe.hf import from_hf_config, from_hf_moe_block  # noqa: E402

# The GPT-OSS variants' swiglu_limit. transformers 5.17 ignores it (GptOssExperts hard-codes 7.0): there the gate/up
# projection is scaled by limit / GPT_OSS_LIMIT and the down projection by its inverse squared (the SwiGLU is about
# quadratic in it), so the clamps stay as active and the outputs O(1) whichever limit the installed release uses.
GPT_OSS_LIMIT = 1.0


# name -> (config factory, transformers block class). Sizes keep E*k small so every mode is reachable; the
# GPT-OSS limit is low enough that its clamps are active on these activations.
VARIANTS = {
    "mixtral": (lambda: MixtralConfig(hidden_size=HIDDEN, intermediate_size=24, num_local_experts=8,
                                      num_experts_per_tok=2, **LAYERS), MixtralSparseMoeBlock),
    "qwen3_moe": (lambda: Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, **LAYERS),
                  Qwen3MoeSparseMoeBlock),
    "qwen3_moe_unnormalized": (lambda: Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=8,
                                                      num_experts_per_tok=2, norm_topk_prob=False, head_dim=16,
                                                      **LAYERS), Qwen3MoeSparseMoeBlock),
    "qwen2_moe": (lambda: Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=40, **LAYERS),
                  Qwen2MoeSparseMoeBlock),
    "gpt_oss": (lambda: GptOssConfig(hidden_size=HIDDEN, intermediate_size=24, num_local_experts=8,
                                     num_experts_per_tok=2, swiglu_limit=GPT_OSS_LIMIT, head_dim=16, **LAYERS),
                GptOssMLP),
    "deepseek_v3": (lambda: DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=16, intermediate_size=48,
                                             n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                             n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                             first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8,
                                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **LAYERS),
                    DeepseekV3MoE),
    "deepseek_v3_unnormalized": (lambda: DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=16,
                                                          n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                                          topk_group=2, n_shared_experts=1, norm_topk_prob=False,
                                                          routed_scaling_factor=1.5, first_k_dense_replace=0,
                                                          q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                                                          qk_nope_head_dim=4, v_head_dim=4, **LAYERS),
                                 DeepseekV3MoE),
    "llama4_text": (lambda: Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=24, intermediate_size_mlp=48,
                                             num_local_experts=8, num_experts_per_tok=1, head_dim=16, **LAYERS),
                    Llama4TextMoe),
    "llama4_text_top2": (lambda: Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=24, intermediate_size_mlp=48,
                                                  num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                                  **LAYERS), Llama4TextMoe),
    "dbrx": (lambda: DbrxConfig(d_model=HIDDEN, n_layers=2, n_heads=2, vocab_size=64,
                                attn_config=dict(kv_n_heads=1),
                                ffn_config=dict(ffn_hidden_size=24, moe_num_experts=8, moe_top_k=2,
                                                moe_normalize_expert_weights=1.0)), DbrxFFN),
    "dbrx_unnormalized": (lambda: DbrxConfig(d_model=HIDDEN, n_layers=2, n_heads=2, vocab_size=64,
                                             attn_config=dict(kv_n_heads=1),
                                             ffn_config=dict(ffn_hidden_size=24, moe_num_experts=8, moe_top_k=2,
                                                             moe_normalize_expert_weights=None)), DbrxFFN),
}

# Blocks whose experts dispatch on config._experts_implementation (Llama 4 and DBRX have one forward).
_DISPATCHING = (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, GptOssMLP, DeepseekV3MoE)
HF_IMPLS = ("eager", "grouped_mm")

# name -> (batch, seq_len, build_moe overrides, mode the MoE must pick). E*k is 16 for k=2 (E=8) and 64 for
# DeepSeek (E=16, k=4); the shapes are chosen so that each name's mode holds for every variant.
SCENARIOS = {
    "prefill_blockwise": (2, 40, dict(block_size=16), "blockwise"),
    "prefill_blockwise_odd": (2, 37, dict(block_size=8, block_pad_num_blocks_to_even=True), "blockwise"),
    "prefill_all_experts": (2, 5, {}, "all_experts"),
    "prefill_selective_loading": (1, 3, {}, "selective_loading"),
    "decode_selective_loading": (2, 1, {}, "selective_loading"),
    "decode_all_experts": (8, 1, {}, "all_experts"),
}




def make_block(variant: str, impl: str | None = "eager", seed: int = 0, dtype: torch.dtype = torch.float32):
    """``(config, block)``: a random transformers MoE block of ``variant``, in eval mode."""
    factory, block_cls = VARIANTS[variant]
    config = factory()
    config._experts_implementation = impl or "eager"
    block = randomize_hf_(block_cls(config), seed)
    if isinstance(block, GptOssMLP):
        stretch = block.experts.limit / GPT_OSS_LIMIT
        with torch.no_grad():
            block.experts.gate_up_proj.mul_(stretch)
            block.experts.gate_up_proj_bias.mul_(stretch)
            block.experts.down_proj.div_(stretch ** 2)
    return config, block.to(dtype).eval()


def nxd_output(moe, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    with torch.no_grad():
        out, stats = moe(x, return_stats=True)
    return out, stats.mode.value


def _matrix():
    for variant, (_, block_cls) in VARIANTS.items():
        for impl in HF_IMPLS if issubclass(block_cls, _DISPATCHING) else (None,):
            for scenario in SCENARIOS:
                yield pytest.param(variant, impl, scenario, id=f"{variant}-{impl or 'eager'}-{scenario}")


# ----------------------------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("variant,impl,scenario", list(_matrix()))
def test_parity_fp32(variant, impl, scenario):
    batch, seq_len, overrides, mode = SCENARIOS[scenario]
    config, block = make_block(variant, impl)
    moe = from_hf_moe_block(block, config, **overrides)
    x = inputs(batch, seq_len)
    ours, used = nxd_output(moe, x)
    assert used == mode
    assert_parity(ours, hf_output(block, x))


@pytest.mark.parametrize("mode", ["blockwise", "selective_loading", "all_experts"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_every_forced_mode(variant, mode):
    """The same prefill through each dropless algorithm, forced on ``expert_mlps``."""
    config, block = make_block(variant)
    moe = from_hf_moe_block(block, config, block_size=8)
    x = inputs(2, 12, seed=3)
    flat = x.reshape(-1, HIDDEN)
    with torch.no_grad():
        _, affinities, expert_index = moe.router(flat)
        ours = moe.expert_mlps(flat, affinities, expert_index, seq_len=12, mode=mode)
        if moe.shared_experts is not None:
            ours = ours + moe.shared_experts(flat)
    assert_parity(ours.reshape(x.shape), hf_output(block, x))


@pytest.mark.parametrize("matmul", ["gather", "grouped_mm"])
@pytest.mark.parametrize("variant", ["mixtral", "gpt_oss", "deepseek_v3", "llama4_text", "dbrx"])
def test_parity_blockwise_matmul_impls(variant, matmul):
    config, block = make_block(variant)
    moe = from_hf_moe_block(block, config, block_size=16, backend=TorchBackend(matmul=matmul))
    x = inputs(2, 40, seed=4)
    ours, used = nxd_output(moe, x)
    assert used == "blockwise"
    assert_parity(ours, hf_output(block, x))


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "llama4_text",
                                     "dbrx"])
def test_parity_bf16_smoke(variant):
    """bf16 weights and activations on both sides. Our router runs in float32 (NxD's default) where most of
    these blocks route in bf16, so a near-tie can route a token differently: nearly all tokens must agree to
    bf16 precision, and the whole output must agree on average."""
    config, block = make_block(variant, dtype=torch.bfloat16)
    moe = from_hf_moe_block(block, config, block_size=16)
    assert moe.expert_mlps.dtype == torch.bfloat16
    x = inputs(2, 40, seed=5, dtype=torch.bfloat16)
    ours, used = nxd_output(moe, x)
    assert used == "blockwise"
    ref = hf_output(block, x).float()
    ours = ours.float()
    token_ok = torch.isclose(ours, ref, atol=3e-2, rtol=3e-2).all(dim=-1)
    assert token_ok.float().mean().item() >= 0.95, f"{int((~token_ok).sum())} of {token_ok.numel()} tokens differ"
    assert (ours - ref).abs().mean().item() <= 0.02 * ref.abs().mean().item() + 1e-3


# Each override removes one piece of the model's semantics; the output must then stop matching.
NEGATIVE_CONTROLS = {
    "mixtral": dict(normalize_top_k_affinities=False),
    "qwen3_moe": dict(normalize_top_k_affinities=False),
    "qwen3_moe_unnormalized": dict(normalize_top_k_affinities=True),
    "gpt_oss": dict(gate_clamp_upper_limit=None, up_clamp_lower_limit=None, up_clamp_upper_limit=None),
    "llama4_text": dict(early_expert_affinity_modulation=False),
    "dbrx": dict(normalize_top_k_affinities=False),
}


@pytest.mark.parametrize("variant", list(NEGATIVE_CONTROLS))
def test_semantics_are_load_bearing(variant):
    config, block = make_block(variant)
    x = inputs(2, 20, seed=6)
    ref = hf_output(block, x)
    ours, _ = nxd_output(from_hf_moe_block(block, config, **NEGATIVE_CONTROLS[variant]), x)
    assert (ours - ref).abs().max().item() > 100 * ATOL_FP32


def test_deepseek_correction_bias_changes_the_choice():
    """The correction bias must reach the router: without it other experts are chosen."""
    config, block = make_block("deepseek_v3")
    moe = from_hf_moe_block(block, config)
    assert torch.equal(moe.router.e_score_correction_bias, block.gate.e_score_correction_bias)
    x = inputs(2, 20, seed=7)
    ref = hf_output(block, x)
    assert_parity(nxd_output(moe, x)[0], ref)
    moe.router.e_score_correction_bias.zero_()
    assert (nxd_output(moe, x)[0] - ref).abs().max().item() > 100 * ATOL_FP32


def test_gpt_oss_clamps_are_exercised():
    """Some gate/up pre-activations exceed the limit, so the clamp comparison above means something."""
    config, block = make_block("gpt_oss")
    x = inputs(2, 20, seed=6).reshape(-1, HIDDEN)
    with torch.no_grad():
        pre = torch.einsum("th,ehi->eti", x, block.experts.gate_up_proj) + block.experts.gate_up_proj_bias[:, None]
    assert (pre.abs() > block.experts.limit).float().mean().item() > 0.05


def test_from_hf_moe_block_copies_weights_and_checks_them():
    config, block = make_block("qwen2_moe")
    moe = from_hf_moe_block(block, config)
    assert torch.equal(moe.shared_experts.shared_expert_gate.weight, block.shared_expert_gate.weight)
    assert moe.router.linear_router.weight.dtype == torch.float32
    with torch.no_grad():
        block.experts.down_proj[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        from_hf_moe_block(block, config)


def test_from_hf_moe_block_rejects_a_block_of_another_model():
    config, _ = make_block("mixtral")
    _, other = make_block("qwen3_moe")
    with pytest.raises(TypeError, match="MixtralSparseMoeBlock"):
        from_hf_moe_block(other, config)
    with pytest.raises(TypeError, match="scale"):
        from_hf_moe_block(make_block("mixtral")[1], config, scale=2)


def test_from_hf_moe_block_loads_the_stored_format():
    """A bf16 block builds a bf16 layer; asking for another format is named (quantize_experts does that), and a
    block without values (meta device) gives a layer on the meta device, to be loaded later."""
    config, block = make_block("qwen2_moe")
    with pytest.raises(ValueError, match=r"the block's routed experts are stored as 'bf16' in the checkpoint, the "
                                         r"layer's as 'fp8': build with quantization='bf16'"):
        from_hf_moe_block(block, config, quantization="fp8")
    with pytest.raises(ValueError, match=r"shared experts are stored as 'bf16'.*shared_quantization='bf16'"):
        from_hf_moe_block(block, config, shared_quantization="fp8")
    with torch.device("meta"):
        empty = VARIANTS["qwen2_moe"][1](config)
    moe = from_hf_moe_block(empty, config)
    assert all(t.is_meta for t in moe.state_dict().values())
    assert {k: v.shape for k, v in moe.state_dict().items()} == {
        k: v.shape for k, v in from_hf_moe_block(block, config).state_dict().items()}


def test_from_hf_moe_block_rejects_shape_mismatch():
    config, block = make_block("mixtral")
    bigger = MixtralConfig(**{**config.to_dict(), "intermediate_size": 32})
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj.*shape"):
        from_hf_moe_block(block, bigger)


# ----------------------------------------------------------------------------------------------
# from_hf_config


def _routing(cfg: MoEModelConfig) -> tuple:
    return cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size


def test_config_mixtral():
    cfg = from_hf_config(MixtralConfig(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                       num_experts_per_tok=2, num_hidden_layers=32))
    assert _routing(cfg) == (8, 2, 4096, 14336)
    assert cfg.router == RouterSpec(type="topk", act_fn="softmax")
    assert cfg.experts == dict(hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    assert cfg.shared_experts is None
    assert (cfg.hf_model_type, cfg.num_moe_layers) == ("mixtral", 32)
    # The architecture of the shipped configs/mixtral-8x7b.yaml: its name and blockwise section are reused.
    assert cfg.name == "hf:mixtral-8x7b"
    assert cfg.blockwise == {"block_size": 512}


def test_config_qwen3_counts_sparse_layers_and_reuses_the_shipped_blockwise_section():
    cfg = from_hf_config(Qwen3MoeConfig(hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                                        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=94))
    assert _routing(cfg) == (128, 8, 4096, 1536)
    assert cfg.experts["normalize_top_k_affinities"] is True
    assert cfg.num_moe_layers == 94
    assert cfg.name == "hf:qwen3-235b-a22b"
    assert cfg.blockwise_config().use_shard_on_intermediate_dynamic_while
    sparse = from_hf_config(Qwen3MoeConfig(num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[1],
                                           norm_topk_prob=False))
    assert sparse.num_moe_layers == 3  # layers 3, 5, 7 (1 is dense-only)
    assert sparse.experts["normalize_top_k_affinities"] is False
    assert sparse.blockwise == {"block_size": 512}


def test_config_qwen2_shared_expert_with_gate():
    cfg = from_hf_config(Qwen2MoeConfig(moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                        num_experts=60, num_experts_per_tok=4))
    assert cfg.shared_experts == SharedExpertsSpec(num_shared_experts=1, intermediate_size=5632, gate=True)
    assert cfg.shared_intermediate_size == 5632
    assert cfg.intermediate_size == 1408
    assert cfg.experts["normalize_top_k_affinities"] is False


def test_config_gpt_oss():
    cfg = from_hf_config(GptOssConfig(swiglu_limit=7.0, swiglu_alpha=1.702, num_local_experts=32,
                                      num_hidden_layers=24))
    assert _routing(cfg) == (32, 4, 2880, 2880)
    assert cfg.router == RouterSpec(type="topk", act_fn="softmax", apply_act_fn_over_topk=True, bias=True)
    rc = cfg.routed_experts_config()
    assert (rc.hidden_act, rc.glu_type.value, rc.hidden_act_scaling_factor, rc.hidden_act_bias) == (
        "sigmoid", "swiglu", 1.702, 1.0)
    assert (rc.gate_clamp_lower_limit, rc.gate_clamp_upper_limit) == (None, 7.0)
    assert (rc.up_clamp_lower_limit, rc.up_clamp_upper_limit) == (-7.0, 7.0)
    assert rc.bias and not rc.normalize_top_k_affinities
    assert cfg.name == "hf:gpt-oss-20b" and cfg.num_moe_layers == 24


# Later transformers 5 releases keep GPT-OSS's SwiGLU constants in the config; 5.17's GptOssExperts hard-codes them.
CONFIG_HOLDS_SWIGLU = hasattr(GptOssConfig, "swiglu_alpha")


def _swiglu_of(config) -> tuple:
    rc = from_hf_config(config).routed_experts_config()
    return (rc.hidden_act_scaling_factor, rc.gate_clamp_lower_limit, rc.gate_clamp_upper_limit,
            rc.up_clamp_lower_limit, rc.up_clamp_upper_limit)


@pytest.mark.skipif(not CONFIG_HOLDS_SWIGLU, reason="this transformers' GptOssConfig has no swiglu_alpha")
def test_config_gpt_oss_swiglu_from_the_config_fields():
    assert _swiglu_of(GptOssConfig(swiglu_alpha=1.5, swiglu_limit=3.0)) == (1.5, None, 3.0, -3.0, 3.0)


@pytest.mark.skipif(CONFIG_HOLDS_SWIGLU, reason="this transformers' GptOssConfig has swiglu_alpha")
def test_config_gpt_oss_swiglu_hard_coded_by_the_experts_module():
    """transformers 5.17: the model computes 1.702 / 7.0 whatever the config says, and so must we."""
    assert _swiglu_of(GptOssConfig()) == (1.702, None, 7.0, -7.0, 7.0)
    assert _swiglu_of(GptOssConfig(swiglu_alpha=1.5, swiglu_limit=3.0)) == (1.702, None, 7.0, -7.0, 7.0)


def _gpt_oss_fields(**swiglu) -> SimpleNamespace:
    return SimpleNamespace(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, hidden_size=HIDDEN,
                           intermediate_size=24, num_hidden_layers=2, **swiglu)


def test_config_gpt_oss_swiglu_from_either_config_shape(monkeypatch):
    """Both shapes on any installed release: a config without the fields read by an experts class that hard-codes
    the constants (5.17's), and one with them read by a class that takes them from the config (later releases)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    class HardCoded(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.alpha, self.limit = 1.702, 7.0

    class FromConfig(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    monkeypatch.setattr(modeling_gpt_oss, "GptOssExperts", HardCoded)
    assert _swiglu_of(_gpt_oss_fields()) == (1.702, None, 7.0, -7.0, 7.0)
    monkeypatch.setattr(modeling_gpt_oss, "GptOssExperts", FromConfig)
    assert _swiglu_of(_gpt_oss_fields(swiglu_alpha=1.25, swiglu_limit=2.0)) == (1.25, None, 2.0, -2.0, 2.0)
    assert _swiglu_of(_gpt_oss_fields(swiglu_alpha=1.25, swiglu_limit=None))[0] == 1.25
    with pytest.raises(ValueError, match=r"config\.swiglu_alpha must be a number, got None"):
        _swiglu_of(_gpt_oss_fields(swiglu_alpha=None, swiglu_limit=2.0))
    with pytest.raises(ValueError, match=r"config\.swiglu_limit must be a number or None, got '7'"):
        _swiglu_of(_gpt_oss_fields(swiglu_alpha=1.0, swiglu_limit="7"))


def test_config_deepseek_v3():
    cfg = from_hf_config(DeepseekV3Config())
    assert _routing(cfg) == (256, 8, 7168, 2048)
    assert cfg.router == RouterSpec(type="group_limited", act_fn="sigmoid", n_group=8, topk_group=4, normalize=True,
                                    routed_scaling_factor=2.5)
    assert cfg.experts["normalize_top_k_affinities"] is False
    assert cfg.shared_experts == SharedExpertsSpec(num_shared_experts=1, intermediate_size=2048)
    assert cfg.num_moe_layers == 61 - 3
    assert cfg.name == "hf:deepseek-v3"


def test_config_llama4_text_and_full():
    text = dict(num_local_experts=128, num_experts_per_tok=1, hidden_size=5120, intermediate_size=8192,
                num_hidden_layers=48, interleave_moe_layer_step=2)
    cfg = from_hf_config(Llama4TextConfig(**text))
    assert _routing(cfg) == (128, 1, 5120, 8192)
    assert cfg.router == RouterSpec(type="topk", act_fn="sigmoid")
    assert cfg.experts["early_expert_affinity_modulation"] is True
    assert cfg.experts["normalize_top_k_affinities"] is False
    assert cfg.shared_experts == SharedExpertsSpec(num_shared_experts=1, intermediate_size=8192)
    assert cfg.num_moe_layers == 24 and cfg.hf_model_type == "llama4_text"
    assert cfg.name == "hf:llama4-maverick" and cfg.blockwise["block_size"] == 256
    assert from_hf_config(Llama4Config(text_config=text)) == cfg
    assert from_hf_config(Llama4Config(text_config=text).to_diff_dict()) == cfg
    small = from_hf_config(Llama4TextConfig(num_local_experts=4, hidden_size=64, intermediate_size=32,
                                            num_hidden_layers=6, moe_layers=[1, 4]))
    assert small.num_moe_layers == 2
    # Not a shipped architecture: only the block size every shipped Llama 4 config uses is inherited.
    assert small.blockwise == {"block_size": 256}


def test_config_dbrx():
    def dbrx(p):
        return DbrxConfig(d_model=6144, n_layers=40, ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16,
                                                                     moe_top_k=4, moe_normalize_expert_weights=p))

    cfg = from_hf_config(dbrx(1.0))
    assert _routing(cfg) == (16, 4, 6144, 10752)
    assert cfg.experts == dict(hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    assert cfg.num_moe_layers == 40 and cfg.name == "hf:dbrx"
    assert from_hf_config(dbrx(None)).experts["normalize_top_k_affinities"] is False
    with pytest.raises(ValueError, match="moe_normalize_expert_weights=2.0"):
        from_hf_config(dbrx(2.0))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_from_dict_equals_from_object(variant):
    config = VARIANTS[variant][0]()
    # save_pretrained writes only the keys that differ from the defaults; the defaults must come back.
    assert from_hf_config(config.to_diff_dict()) == from_hf_config(config)
    full = config.to_dict()
    try:
        type(config).from_dict(full)
    except ValueError as e:  # transformers 5.17's DBRX: to_dict() nests keys its DbrxFFNConfig refuses
        pytest.skip(f"this transformers cannot read its own {type(config).__name__}.to_dict() back: {e}")
    assert from_hf_config(full) == from_hf_config(config)


def test_config_blockwise_override():
    cfg = from_hf_config(VARIANTS["mixtral"][0](), blockwise=dict(block_size=64, skip_dma_token=True))
    assert cfg.blockwise_config().block_size == 64 and cfg.blockwise_config().skip_dma_token


def test_config_accepts_an_existing_model_config_in_the_converters():
    config, block = make_block("mixtral")
    cfg = dataclasses.replace(from_hf_config(config), blockwise={"block_size": 8})
    moe = from_hf_moe_block(block, cfg)
    assert moe.expert_mlps.blockwise_matmul_config.block_size == 8
    with pytest.raises(ValueError, match="hf_model_type"):
        from_hf_moe_block(block, dataclasses.replace(cfg, hf_model_type=None))


@pytest.mark.parametrize("config,match", [
    (dict(model_type="llama"), "model_type 'llama' is not supported"),
    (dict(hidden_size=8), "needs a 'model_type'"),
    (transformers.LlamaConfig(), "model_type 'llama' is not supported"),
    (Qwen3MoeConfig(num_experts=0), "num_experts is 0"),
    (DeepseekV3Config(num_hidden_layers=3, first_k_dense_replace=3), "no MoE layer"),
    (MixtralConfig(hidden_act="gelu_pytorch_tanh"), "hidden_act='gelu_pytorch_tanh' is not supported"),
    (DbrxConfig(ffn_config=dict(ffn_act_fn={"name": "gelu_new"})), r"ffn_act_fn\['name'\]='gelu_new'"),
    (DbrxConfig(ffn_config=dict(moe_normalize_expert_weights=2.0)), "moe_normalize_expert_weights=2.0"),
])
def test_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(config)


def test_config_type_errors():
    with pytest.raises(TypeError, match="PretrainedConfig or a dict"):
        from_hf_config(42)
    with pytest.raises(TypeError, match="already an MoEModelConfig"):
        from_hf_config(from_hf_config(VARIANTS["mixtral"][0]()))
