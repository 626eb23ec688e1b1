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
