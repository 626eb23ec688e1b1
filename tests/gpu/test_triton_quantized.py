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

from conftest import (
    MODES,
    TORCH_ROUNDINGS,
    TRITON_ROUNDINGS,
    assert_backends_close,
    assert_rounding_close,
    make_config,
    quantized_pair,
    randn,
    random_routing,
    rounding_tolerance,
)

from nxd_moe.quantization.formats import get_format, k_fastest
from nxd_moe.quantization.weight import QuantizedWeight
from nxd_moe.reference import first_come_first_served, reference_for_experts
from nxd_moe.triton_kernels.backend import TritonBackend
from nxd_moe.triton_kernels.grouped_gemm import down_projection
from nxd_moe.triton_kernels.launch_configs import default_config
from nxd_moe.triton_kernels.routing_metadata import TileLayout

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FORMATS = ("fp8", "fp8_block", "mxfp4")
# (T, E, k, H, I): H and I multiples of 128 (FP8 blocks), I not a multiple of the column tiles on the GPU.
SHAPES = [(13, 4, 2, 128, 128)] + ([(1, 64, 8, 256, 384), (300, 16, 4, 512, 384)] if CUDA else [])
# The longest sum here: H or I <= 512 terms. Tolerances: conftest.rounding_tolerance. The weights are the same
# values on both sides (the torch layer holds the dequantized ones): only the computation's roundings differ.
DEPTH = 512
# fp32: the triton layer against the torch one, both rounding.
FP32_PAIR = rounding_tolerance(torch.float32, DEPTH, triton_roundings=TRITON_ROUNDINGS, torch_roundings=TORCH_ROUNDINGS)


def _layers(name, shape, dtype, edit_scales=None, configs=None):
    """(triton layer with quantized weights, torch layer holding the dequantized weights), on DEVICE.
    ``edit_scales(scale)`` may rewrite each projection's stored scales in place first; ``configs`` pins the
    triton backend's launch configuration."""
    num_tokens, num_experts, top_k, hidden, inter = shape
    config = make_config(num_experts, hidden, inter, top_k, "swiglu_gptoss", bias=True, capacity_factor=1.0,
                         normalize_top_k_affinities=True)

    def edit(quantized):
        for proj in ("gate_up_proj", "down_proj"):
            edit_scales(getattr(quantized.mlp_op, proj).scale)

    return quantized_pair(config, name, dtype, TritonBackend(configs=configs), DEVICE,
                          edit=edit if edit_scales is not None else None)


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
    assert_rounding_close(out, expected, FP32_PAIR, name)


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
            out, stats = tested(x, affinities, index, seq_len=seq_len, return_stats=True)
            assert_backends_close(out, holding(x, affinities, index, seq_len=seq_len),
                                  _reference(tested, x, affinities, index, stats), torch.bfloat16, DEPTH,
                                  f"{name} seq_len={seq_len}")


def _reference(tested, x, affinities, index, stats):
    """The float64 layer, capacity drops included (the layers here have a capacity factor, which prefill takes)."""
    keep = None if stats.capacity is None else first_come_first_served(index.cpu(), tested.num_experts,
                                                                       stats.capacity)
    return reference_for_experts(tested, x, affinities, index, keep=keep)


def _check_fp32(tested, holding, shape, seed):
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=seed).to(DEVICE)
    affinities, index = random_routing(num_tokens, num_experts, top_k, seed=seed + 1)
    with torch.no_grad():
        out = tested(x, affinities.to(DEVICE), index.to(DEVICE))
        expected = holding(x, affinities.to(DEVICE), index.to(DEVICE))
    assert_rounding_close(out, expected, FP32_PAIR, "fp32")


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_tiles_scale_the_weight_tile(name):
    """Row tiles of 64+ (prefill: the wide MMA, weight tiles staged through shared memory); the small shape above
    only reaches them when the tile size is pinned."""
    shape = SHAPES[0]
    num_tokens, num_experts, top_k, hidden, inter = shape
    prefill = default_config(num_experts, hidden, inter, top_k, 4096)
    assert prefill["block_m"] >= 64
    _check_fp32(*_layers(name, shape, torch.float32, configs=prefill), shape, seed=6)


@pytest.mark.parametrize("block_m", [16, 64])
def test_mxfp4_extreme_scales_stay_exact(block_m):
    """E8M0 scales from byte 0 (the subnormal 2**-127) to 2**73 in one layer, at decode and prefill tiles: built
    from their bits, exactly."""
    shape = SHAPES[0]

    def edit(scale):
        choices = torch.tensor([0, 1, 60, 127, 150, 200], dtype=torch.uint8)
        picks = torch.randint(0, len(choices), scale.shape, generator=torch.Generator().manual_seed(7))
        scale.copy_(choices[picks])

    num_tokens, num_experts, top_k, hidden, inter = shape
    configs = {**default_config(num_experts, hidden, inter, top_k, num_tokens), "block_m": block_m}
    _check_fp32(*_layers("mxfp4", shape, torch.float32, edit_scales=edit, configs=configs), shape, seed=8)


@pytest.mark.parametrize("block_m", [16, 64])
def test_mxfp4_in_bfloat16_applies_each_groups_scale_to_its_columns(block_m):
    """bf16 MxFP4 layers at decode and prefill tiles: scales that differ by up to 2**14 between neighbouring
    groups and columns would make a mis-indexed one an O(1) error (bf16 roundings alone are ~1 %)."""
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
        out, stats = tested(x, affinities.to(DEVICE), index.to(DEVICE), return_stats=True)
        expected = holding(x, affinities.to(DEVICE), index.to(DEVICE))
    assert_backends_close(out, expected, _reference(tested, x, affinities, index, stats), torch.bfloat16, DEPTH,
                          f"block_m={block_m}")


def _one_hot_rows_through_down(stored: QuantizedWeight, dtype: torch.dtype, block_m: int) -> torch.Tensor:
    """Every row of every expert's ``(K, N)`` weight as the kernel dequantizes it: ``down_projection`` of
    one-hot rows (``1.0`` times each weight, one nonzero term per sum, so nothing is rounded but the weight)."""
    num_experts, k, n = stored.shape
    eye = torch.eye(k, dtype=dtype, device=stored.device)
    activated = eye.repeat(num_experts, 1)
    tiles = num_experts * k // block_m
    tile_expert = torch.arange(num_experts, dtype=torch.int32, device=stored.device).repeat_interleave(k // block_m)
    layout = TileLayout(torch.arange(num_experts * k, device=stored.device), tile_expert,
                        torch.tensor([tiles], dtype=torch.int32, device=stored.device),
                        torch.zeros(1, 1, dtype=torch.int64, device=stored.device), block_m)
    config = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    return down_projection(activated, layout, stored, None, config)[0].reshape(num_experts, k, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_m", [16, 64])
def test_mxfp4_kernel_decodes_every_code_and_scale_exactly(dtype, block_m):
    """All 256 bytes (every pair of E2M1 codes) under scales from the subnormal 2**-127 to 2**100: the kernel's
    weights equal the format's own dequantization exactly (subnormal results included)."""
    fmt = get_format("mxfp4")
    num_experts, k, n = 2, 128, 64
    gen = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 256, (num_experts, k // 2, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[0, :, 0] = torch.arange(256, dtype=torch.int32).reshape(4, k // 2)[0].to(torch.uint8)
    codes[1, :, 1] = torch.arange(256, dtype=torch.int32).reshape(4, k // 2)[3].to(torch.uint8)
    exponents = torch.tensor([0, 1, 2, 60, 110, 127, 140, 227], dtype=torch.int32)
    scale = exponents[torch.randint(0, len(exponents), (num_experts, k // 32, n), generator=gen)].to(torch.uint8)
    stored = QuantizedWeight.create(fmt, k_fastest(codes), scale, dtype)
    expected = stored.dequantize()
    got = _one_hot_rows_through_down(QuantizedWeight.create(fmt, k_fastest(codes).to(DEVICE), scale.to(DEVICE), dtype),
                                     dtype, block_m).cpu()
    # Equal values (a one-hot sum turns -0 into +0); below the smallest normal a bf16 result may be flushed (the
    # interpreter's rounding does it), which only results under 1.2e-38 can show.
    tiny = torch.finfo(dtype).tiny
    normal = expected.abs() >= tiny
    assert torch.equal(got[normal], expected[normal]), (got - expected)[normal].abs().max()
    assert (got[~normal] - expected[~normal]).abs().max() < tiny
    assert normal.float().mean() > 0.6 and (~normal & (expected != 0)).any()  # both kinds are there


def test_mxfp4_kernel_reads_either_memory_order():
    """MxFP4 is stored K-fastest (the fast order on a GPU), but an N-fastest copy of the same values computes the
    same result: the kernel follows the strides it is given."""
    fmt = get_format("mxfp4")
    num_experts, k, n = 2, 128, 64
    gen = torch.Generator().manual_seed(13)
    codes = torch.randint(0, 256, (num_experts, k // 2, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(120, 130, (num_experts, k // 32, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    k_first, n_first = k_fastest(codes).to(DEVICE), codes.contiguous().to(DEVICE)
    assert k_first.stride(1) == 1 and n_first.stride(2) == 1
    outs = [_one_hot_rows_through_down(QuantizedWeight.create(fmt, w, scale.to(DEVICE), torch.float32),
                                       torch.float32, 16) for w in (k_first, n_first)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0].cpu(), QuantizedWeight.create(fmt, codes, scale, torch.float32).dequantize())


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_shared_experts_join_the_triton_combine(name):
    """Shared experts asked to be quantized: their output (dequantized in torch) is the addend the triton
    combine sums with the routed experts'; the whole MoE equals the torch backend's."""
    from nxd_moe.build import build_moe

    layers = [build_moe("llama4-scout", scale=32, quantization=name, shared_quantization=name, seed=0,
                        block_size=16, device=DEVICE, backend=backend) for backend in ("triton", "torch")]
    assert layers[0].shared_experts.down_proj.format.name == name
    x = randn(1, 5, layers[0].expert_mlps.routed_experts_mlp_config.hidden_size, seed=3).to(DEVICE)
    with torch.no_grad():
        got, expected = (layer(x)[0] for layer in layers)
    assert_rounding_close(got, expected, FP32_PAIR, name)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("broken", ["columns_scale_shifted", pytest.param("scale_4_percent", marks=pytest.mark.slow)])
def test_bound_rejects_a_broken_dequantization(name, broken):
    """Negative control: the triton layer's gate/up weight dequantized with its scales shifted by one column
    (block) -- a mis-indexed scale -- or 4 % too large (FP8 scales are fp32; an E8M0 one can only double) must fail
    the bound of the fp32 comparisons."""
    if broken == "scale_4_percent" and name == "mxfp4":
        pytest.skip("E8M0 scales are powers of two")
    tested, holding = _layers(name, SHAPES[0], torch.float32)
    _check_fp32(tested, holding, SHAPES[0], seed=70)
    scale = tested.mlp_op.gate_up_proj.scale
    with torch.no_grad():
        if broken == "columns_scale_shifted":
            scale.copy_(scale.roll(1, dims=-1))
        else:
            scale.mul_(1.04)
    with pytest.raises(AssertionError):
        _check_fp32(tested, holding, SHAPES[0], seed=70)
