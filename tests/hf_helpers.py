"""What the two ``nxd_moe.hf`` test files share: sizes, random initialisation, inputs and the parity check."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

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
    """Every parameter and floating buffer of the state dict ~ N(0, std^2) (several are created with torch.empty or
    zeros, and zero router weights would make routing trivial); DeepSeek's correction bias gets half the scale so
    it reorders experts without swamping the sigmoid scores. Buffers outside the state dict (a whole model's
    rotary frequencies) are derived ones and stay."""
    gen = torch.Generator().manual_seed(seed)
    persistent = set(module.state_dict())
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_floating_point() and name in persistent:
            scale = std / 2 if name.endswith("e_score_correction_bias") else std
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)
    return module


def inputs(batch: int, seq_len: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, seq_len, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def hf_output(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's output as ``(B, S, H)`` (GPT-OSS and Llama 4 return tuples; Llama 4 flattens tokens)."""
    with torch.no_grad():
        out = block(x)
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


def assert_parity(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL_FP32) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    scale = ref.abs().mean().item()
    assert 0.05 < scale < 5, f"reference output scale {scale:.3g} is outside the intended O(0.1-1)"
    assert err <= atol, f"max abs error {err:.3e} > {atol:.1e} (reference mean |y| {scale:.3g})"


# ----------------------------------------------------------------------------------------------
# small whole models


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """A small transformers causal LM of one model type.

    ``config(hidden, intermediate)``: its config with ``hidden_size`` and the routed experts' width (the other sizes
    fixed); ``layers``: attribute path of the decoder layers; ``block_attr``: the MoE block's attribute in a layer;
    ``moe_layers``: the sparse layers (Qwen3, DeepSeek and Llama 4 have a dense layer 0, so dense-MLP keys must
    pass through); ``hub_differs``: whether ``save_pretrained`` writes per-expert tensors.
    """

    model_class: str
    config: Callable[[int, int], Any]
    intermediate: int
    layers: str
    block_attr: str
    moe_layers: tuple[int, ...]
    hub_differs: bool

    def make(self, hidden: int = HIDDEN, intermediate: int | None = None) -> torch.nn.Module:
        """The model with transformers' initialisation, in eval mode, its experts on the ``eager`` loop."""
        import transformers

        model = getattr(transformers, self.model_class)(self.config(hidden, intermediate or self.intermediate))
        model.config._experts_implementation = "eager"
        return model.eval()


def _config(name: str, **kwargs) -> Any:
    import transformers

    return getattr(transformers, name)(**kwargs)


MODELS = {
    "mixtral": TinyModel("MixtralForCausalLM", lambda h, i: _config(
        "MixtralConfig", hidden_size=h, intermediate_size=i, num_local_experts=8, num_experts_per_tok=2, **LAYERS),
        24, "model.layers", "mlp", (0, 1), True),
    "qwen3_moe": TinyModel("Qwen3MoeForCausalLM", lambda h, i: _config(
        "Qwen3MoeConfig", hidden_size=h, moe_intermediate_size=i, intermediate_size=40, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, mlp_only_layers=[0], **LAYERS),
        24, "model.layers", "mlp", (1,), True),
    "qwen2_moe": TinyModel("Qwen2MoeForCausalLM", lambda h, i: _config(
        "Qwen2MoeConfig", hidden_size=h, moe_intermediate_size=i, shared_expert_intermediate_size=40, num_experts=8,
        num_experts_per_tok=2, **LAYERS), 24, "model.layers", "mlp", (0, 1), True),
    "deepseek_v3": TinyModel("DeepseekV3ForCausalLM", lambda h, i: _config(
        "DeepseekV3Config", hidden_size=h, moe_intermediate_size=i, intermediate_size=48, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=8,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
        **{**LAYERS, "num_key_value_heads": 2}),  # attention without key/value groups (MLA)
        16, "model.layers", "mlp", (1,), True),
    "gpt_oss": TinyModel("GptOssForCausalLM", lambda h, i: _config(
        "GptOssConfig", hidden_size=h, intermediate_size=i, num_local_experts=8, num_experts_per_tok=2,
        swiglu_limit=1.0, head_dim=16, **LAYERS), 24, "model.layers", "mlp", (0, 1), False),
    "llama4_text": TinyModel("Llama4ForCausalLM", lambda h, i: _config(
        "Llama4TextConfig", hidden_size=h, intermediate_size=i, intermediate_size_mlp=48, num_local_experts=8,
        num_experts_per_tok=1, head_dim=16, interleave_moe_layer_step=2, **LAYERS),
        24, "model.layers", "feed_forward", (1,), False),
    "dbrx": TinyModel("DbrxForCausalLM", lambda h, i: _config(
        "DbrxConfig", d_model=h, n_layers=2, n_heads=2, vocab_size=64,
        attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),  # transformers 5 cannot run without it
        ffn_config=dict(ffn_hidden_size=i, moe_num_experts=8, moe_top_k=2)),
        24, "transformer.blocks", "ffn", (0, 1), False),
}


# ----------------------------------------------------------------------------------------------------------
# tiny whole models of the families whose experts transformers dispatches by name (the experts-backend tests)

DISPATCHING_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3")
# Whole-model logits, nxd_moe against transformers' eager experts (the brief's bound). Both sides fp32, differing only
# in summation order (grouped vs per-expert matmuls, the combine): each dot of length n <= 64 is off by at most
# n * 2**-24 ~ 4e-6 relative, and two layers of attention and norms amplify that by O(1); 1e-4 leaves room without
# accepting a wrong gate layout (the tests' negative controls).
LOGITS_RTOL = 1e-4


def family_config(family: str):
    """A small transformers config of ``family`` (one of :data:`DISPATCHING_FAMILIES`): :data:`MODELS`' (the GPT-OSS
    limit there is low enough that its clamps are active on these activations)."""
    if family not in DISPATCHING_FAMILIES:
        raise ValueError(f"family must be one of {DISPATCHING_FAMILIES}, got {family!r}")
    model = MODELS[family]
    return model.config(HIDDEN, model.intermediate)


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

# ----------------------------------------------------------------------------------------------------------------
# a small transformers model whose sparse-MoE blocks are our layer

@torch.no_grad()
def tiny_qwen3_moe(backend: str = "torch", *, hidden: int = HIDDEN, num_experts: int = 8, top_k: int = 2,
                   moe_intermediate: int = 24, vocab: int = 64, dtype: torch.dtype = torch.float32, device="cpu",
                   seed: int = 0):
    """A 2-layer ``Qwen3MoeForCausalLM`` with random weights, patched (``nxd_moe.hf.patch_model``, ``backend``).
    Weights are N(0, 4 / fan_in) (norms stay 1): larger than transformers' init, so that greedy decoding does not
    settle into repeating one token and a wrong layer changes the tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from nxd_moe.hf import patch_model

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=moe_intermediate, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, head_dim=16, intermediate_size=2 * hidden,
                            max_position_embeddings=64, **LAYERS | dict(vocab_size=vocab))
    model = Qwen3MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 2 / p.shape[-1] ** 0.5)
    model = model.to(device=device, dtype=dtype).eval()
    return patch_model(model, backend=backend)


@torch.no_grad()
def generate_tokens(model, prompt: torch.Tensor, *, compiled: bool, new_tokens: int = 12, mode: str | None = None,
                    backend="inductor", **generate_options) -> torch.Tensor:
    """``new_tokens`` greedy tokens after ``prompt`` with a static cache; ``compiled``: transformers' compiled decode
    (prefill eager, every decode step through ``torch.compile(model, fullgraph=True, ...)``), on any device.
    ``generate_options`` go to ``generate`` (``synced_gpus``; ``past_key_values``: a ``StaticCache`` of one's own)."""
    from transformers.generation import CompileConfig

    static = None if "past_key_values" in generate_options else "static"  # transformers takes only one of them
    options = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation=static, **generate_options)
    if not compiled:
        return model.generate(prompt, disable_compile=True, **options)[:, prompt.shape[1]:]
    config = CompileConfig(fullgraph=True, mode=mode, backend=backend)
    if model.device.type == "cpu":
        config._compile_all_devices = True  # transformers compiles on its own only on accelerators
    return model.generate(prompt, compile_config=config, **options)[:, prompt.shape[1]:]
