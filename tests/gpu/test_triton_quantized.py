"""The triton backend with quantized expert weights (FP8 per-channel, FP8 128x128 blocks, MxFP4): the stored bytes
are read and dequantized inside the GEMMs' weight-tile loads. Checked against a torch-backend layer holding the
dequantized weights (the same function, so a tight tolerance) in every mode, and the error against the original
bf16 weights is reported by the quantization suite, not here.

On a GPU at realistic sizes; without one under Triton's interpreter at small sizes (see test_triton_backend.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nxd_moe.experts.backends import TorchBackend
from nxd_moe.quantization.quantizer import quantize_experts
from nxd_moe.quantization.weight import dequantized
from nxd_moe.triton_kernels.backend import TritonBackend
from nxd_moe.triton_kernels.launch_configs import default_config
from conftest import MODES, make_config, make_experts, randn, random_routing


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FORMATS = ("fp8", "fp8_block", "mxfp4")
# (T, E, k, H, I): H and I multiples of 128 (FP8 blocks), I not a multiple of the column tiles on the GPU.
SHAPES = [(13, 4, 2, 128, 128)] + ([(1, 64, 8, 256, 384), (300, 16, 4, 512, 384)] if CUDA else [])


def _layers(name, shape, dtype, edit_scales=None, configs=None):
    """(triton layer with quantized weights, torch layer holding the dequantized weights), on DEVICE.
    ``edit_scales(scale)`` may rewrite each projection's stored scales in place first; ``configs`` pins the
    triton backend's launch configuration."""
    num_tokens, num_experts, top_k, hidden, inter = shape
    config = make_config(num_experts, hidden, inter, top_k, "swiglu_gptoss", bias=True, capacity_factor=1.0,
                         normalize_top_k_affinities=True)
    quantized = make_experts(config, block_size=16, dtype=dtype, seed=1)
    quantize_experts(quantized, name)
    if edit_scales is not None:
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                edit_scales(getattr(quantized.mlp_op, proj).scale)
    holding = make_experts(config, block_size=16, dtype=dtype, seed=1)
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            getattr(holding.mlp_op, proj).weight.copy_(dequantized(getattr(quantized.mlp_op, proj).stored_weight()))
    quantized = quantized.to(DEVICE)
    quantized.backend = TritonBackend(configs=configs)
    holding = holding.to(DEVICE)
    holding.backend = TorchBackend()
    return quantized, holding


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_quantized_triton_equals_dequantized_torch_in_every_mode(name, mode):
    shape = SHAPES[0]
    tested, holding = _layers(name, shape, torch.float32)
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=2).to(DEVICE)
    affinities, index = random_routing(num_tokens, num_experts, top_k, seed=3)
    affinities, index = affinities.to(DEVICE), index.to(DEVICE)
    with torch.no_grad():
        out = tested(x, affinities, index, mode=mode)
        expected = holding(x, affinities, index, mode=mode)
    scale = max(1.0, expected.abs().max().item())
    assert torch.isfinite(out).all()
    assert (out - expected).abs().max().item() < 2e-5 * scale, name


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_triton_in_bfloat16(name, shape):
    tested, holding = _layers(name, shape, torch.bfloat16)
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=4).to(DEVICE, torch.bfloat16)
    affinities, index = random_routing(num_tokens, num_experts, top_k, seed=5, skew=0.05)
    affinities, index = affinities.to(DEVICE), index.to(DEVICE)
    with torch.no_grad():
        for seq_len in (1, None):
            out = tested(x, affinities, index, seq_len=seq_len)
            expected = holding(x, affinities, index, seq_len=seq_len)
            scale = max(1.0, expected.abs().max().item())
            assert (out.float() - expected.float()).abs().max().item() < 3e-2 * scale, (name, seq_len)


def _fp32_matches(tested, holding, shape, seed):
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=seed).to(DEVICE)
    affinities, index = random_routing(num_tokens, num_experts, top_k, seed=seed + 1)
    with torch.no_grad():
        out = tested(x, affinities.to(DEVICE), index.to(DEVICE))
        expected = holding(x, affinities.to(DEVICE), index.to(DEVICE))
    assert torch.isfinite(out).all()
    return (out - expected).abs().max().item() <= 2e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_tiles_scale_the_weight_tile(name):
    """Row tiles of 64+ (prefill) dequantize the weight tile instead of scaling the product (see
    _quantized_dot); the small shape above only reaches them when the tile size is pinned."""
    shape = SHAPES[0]
    num_tokens, num_experts, top_k, hidden, inter = shape
    prefill = default_config(num_experts, hidden, inter, top_k, 4096)
    assert prefill["block_m"] >= 64
    assert _fp32_matches(*_layers(name, shape, torch.float32, configs=prefill), shape, seed=6)


@pytest.mark.parametrize("block_m", [16, 64])
def test_mxfp4_extreme_scales_stay_exact(block_m):
    """E8M0 scales from byte 0 (the subnormal 2**-127) to 2**73 in one layer, in both places the kernel applies
    them (the group's product at decode, the weight tile at prefill): built from their bits, exactly."""
    shape = SHAPES[0]

    def edit(scale):
        choices = torch.tensor([0, 1, 60, 127, 150, 200], dtype=torch.uint8)
        picks = torch.randint(0, len(choices), scale.shape, generator=torch.Generator().manual_seed(7))
        scale.copy_(choices[picks])

    num_tokens, num_experts, top_k, hidden, inter = shape
    configs = {**default_config(num_experts, hidden, inter, top_k, num_tokens), "block_m": block_m}
    assert _fp32_matches(*_layers("mxfp4", shape, torch.float32, edit_scales=edit, configs=configs), shape, seed=8)


@pytest.mark.parametrize("block_m", [16, 64])
def test_mxfp4_in_bfloat16_applies_each_groups_scale_to_its_columns(block_m):
    """bf16 MxFP4 layers at decode (group products scaled) and prefill (weight tiles scaled) tiles: scales that
    differ by up to 2**14 between neighbouring groups and columns would make a mis-indexed one an O(1) error
    (bf16 roundings alone are ~1 %)."""
    shape = (40, 4, 2, 256, 128) if CUDA else SHAPES[0]

    def edit(scale):
        picks = torch.randint(120, 135, scale.shape, generator=torch.Generator().manual_seed(9), dtype=torch.int32)
        scale.copy_(picks.to(torch.uint8))

    num_tokens, num_experts, top_k, hidden, inter = shape
    configs = {**default_config(num_experts, hidden, inter, top_k, num_tokens), "block_m": block_m}
    tested, holding = _layers("mxfp4", shape, torch.bfloat16, edit_scales=edit, configs=configs)
    x = randn(num_tokens, hidden, seed=10).to(DEVICE, torch.bfloat16)
    affinities, index = random_routing(num_tokens, num_experts, top_k, seed=11)
    with torch.no_grad():
        out = tested(x, affinities.to(DEVICE), index.to(DEVICE)).float()
        expected = holding(x, affinities.to(DEVICE), index.to(DEVICE)).float()
    assert torch.isfinite(out).all()
    assert (out - expected).norm() <= 3e-2 * expected.norm(), ((out - expected).norm() / expected.norm()).item()
