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


# ----------------------------------------------------------------------------------------------------------------
# a small transformers model whose sparse-MoE blocks are our layer (until nxd_moe.hf.patch_model exists)


class NxdBlock(torch.nn.Module):
    """Stands in for a transformers sparse-MoE block: our layer on the block's ``(B, S, H)`` input, its output."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden_states)[0]


@torch.no_grad()
def tiny_qwen3_moe(backend: str = "torch", *, hidden: int = HIDDEN, num_experts: int = 8, top_k: int = 2,
                   moe_intermediate: int = 24, vocab: int = 64, dtype: torch.dtype = torch.float32, device="cpu",
                   seed: int = 0):
    """A 2-layer ``Qwen3MoeForCausalLM`` with random weights, every sparse block replaced by ``from_hf_moe_block``
    of it (``backend``). Weights are N(0, 4 / fan_in) (norms stay 1): larger than transformers' init, so that greedy
    decoding does not settle into repeating one token and a wrong layer changes the tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from nxd_moe.hf import from_hf_moe_block

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=moe_intermediate, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, head_dim=16, intermediate_size=2 * hidden,
                            max_position_embeddings=64, **LAYERS | dict(vocab_size=vocab))
    model = Qwen3MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 2 / p.shape[-1] ** 0.5)
    model = model.to(device=device, dtype=dtype).eval()
    for block in model.model.layers:
        block.mlp = NxdBlock(from_hf_moe_block(block.mlp, config, backend=backend))
    return model


@torch.no_grad()
def generate_tokens(model, prompt: torch.Tensor, *, compiled: bool, new_tokens: int = 12, mode: str | None = None,
                    backend="inductor") -> torch.Tensor:
    """``new_tokens`` greedy tokens after ``prompt`` with a static cache; ``compiled``: transformers' compiled decode
    (prefill eager, every decode step through ``torch.compile(model, fullgraph=True, ...)``), on any device."""
    from transformers.generation import CompileConfig

    options = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    if not compiled:
        return model.generate(prompt, disable_compile=True, **options)[:, prompt.shape[1]:]
    config = CompileConfig(fullgraph=True, mode=mode, backend=backend)
    if model.device.type == "cpu":
        config._compile_all_devices = True  # transformers compiles on its own only on accelerators
    return model.generate(prompt, compile_config=config, **options)[:, prompt.shape[1]:]
