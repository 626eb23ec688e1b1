"""What the two ``nxd_moe.hf`` test files share: sizes, random initialisation, inputs and the parity check."""

from __future__ import annotations

import pytest
import torch

HIDDEN = 32
ATOL_FP32 = 1e-5
# Small transformer shells around the MoE blocks; only the MoE sizes matter to these tests.
LAYERS = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64)


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """The tensors here are tiny: one thread is faster than two, and immune to spin-waiting when other
    processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def randomize_hf_(module: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Every parameter and floating buffer ~ N(0, std^2) (several are created with torch.empty or zeros, and
    zero router weights would make routing trivial); DeepSeek's correction bias gets half the scale so it
    reorders experts without swamping the sigmoid scores."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_floating_point():
            scale = std / 2 if name.endswith("e_score_correction_bias") else std
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)
    return module


def inputs(batch: int, seq_len: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, seq_len, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_parity(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL_FP32) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    scale = ref.abs().mean().item()
    assert 0.05 < scale < 5, f"reference output scale {scale:.3g} is outside the intended O(0.1-1)"
    assert err <= atol, f"max abs error {err:.3e} > {atol:.1e} (reference mean |y| {scale:.3g})"


# ----------------------------------------------------------------------------------------------------------
# tiny whole models of the families whose experts transformers dispatches by name (the experts-backend tests)

DISPATCHING_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3")
# Whole-model logits, nxd_moe against transformers' eager experts (the brief's bound). Both sides fp32, differing only
# in summation order (grouped vs per-expert matmuls, the combine): each dot of length n <= 64 is off by at most
# n * 2**-24 ~ 4e-6 relative, and two layers of attention and norms amplify that by O(1); 1e-4 leaves room without
# accepting a wrong gate layout (the tests' negative controls).
LOGITS_RTOL = 1e-4


def family_config(family: str):
    """A small transformers config of ``family`` (one of :data:`DISPATCHING_FAMILIES`); the GPT-OSS limit is low
    enough that its clamps are active on these activations."""
    import transformers

    if family == "mixtral":
        return transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=24, num_local_experts=8,
                                          num_experts_per_tok=2, **LAYERS)
    if family in ("qwen3_moe", "qwen2_moe"):
        extra = dict(head_dim=16, norm_topk_prob=True) if family == "qwen3_moe" else dict(
            shared_expert_intermediate_size=40)
        config_cls = transformers.Qwen3MoeConfig if family == "qwen3_moe" else transformers.Qwen2MoeConfig
        return config_cls(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                          **extra, **LAYERS)
    if family == "gpt_oss":
        return transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=24, num_local_experts=8,
                                         num_experts_per_tok=2, swiglu_limit=1.0, head_dim=16, **LAYERS)
    if family == "deepseek_v3":  # MLA needs as many key/value heads as heads
        return transformers.DeepseekV3Config(
            hidden_size=HIDDEN, moe_intermediate_size=16, intermediate_size=48, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
            norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, **{**LAYERS, "num_key_value_heads": 2})
    raise ValueError(f"family must be one of {DISPATCHING_FAMILIES}, got {family!r}")


def tiny_causal_lm(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """A random ``AutoModelForCausalLM`` of ``family`` on transformers' eager experts, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(family_config(family), experts_implementation="eager")
    return randomize_hf_(model, seed=0).to(device=device, dtype=dtype).eval()


def token_ids(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, LAYERS["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(seed))


class ExpertsModeSpy:
    """Records the mode of every call of the nxd_moe experts implementations (and so proves they ran)."""

    def __init__(self, monkeypatch):
        import nxd_moe.models.experts_backend as backend_module

        self.modes = []
        original = backend_module.experts_forward_pairs

        def spy(*args, **kwargs):
            self.modes.append(args[6].value)  # experts_forward_pairs(backend, x, ids, weights, W, slots, mode, ...)
            return original(*args, **kwargs)

        monkeypatch.setattr(backend_module, "experts_forward_pairs", spy)
