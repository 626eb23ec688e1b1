"""Quantized weights repacked into the decode GEMMs' operand order (``triton_kernels/repack.py``) and the swapped
decode GEMMs that read them (``tile_math.swapped_dot``).

The repack itself on CPU in pure torch (round trips, the bit placement against a torch emulation of the kernel's
PTX, the cache); the kernels against the float64 reference and the torch backend on the dequantized weights --
every format, both stored orders, odd sizes, adversarial routings, NaN isolation, exact decoding of every code
and scale -- on a GPU, and under Triton's interpreter on CPU (which runs an independent gather decoder in place of
the PTX); CUDA-graph replays on a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")

from conftest import (
    TORCH_ROUNDINGS,
    TRITON_ROUNDINGS,
    assert_backends_close,
    assert_nan_stays_in_its_row,
    assert_rounding_close,
    capture_cuda_graph,
    make_config,
    quantized_pair,
    randn,
    random_routing,
    rounding_tolerance,
)

from nxd_moe.quantization.formats import E2M1_GRID, get_format, k_fastest
from nxd_moe.quantization.weight import QuantizedWeight
from nxd_moe.reference import reference_for_experts
from nxd_moe.triton_kernels import repack
from nxd_moe.triton_kernels.backend import TritonBackend
from nxd_moe.triton_kernels.grouped_gemm import down_projection
from nxd_moe.triton_kernels.routing_metadata import TileLayout

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FORMATS = ("mxfp4", "fp8", "fp8_block")


def _codes_and_scales(e, k, n, seed, scales=(0, 1, 100, 127, 140, 254)):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, k // 2, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    choice = torch.tensor(scales, dtype=torch.int32)
    scale = choice[torch.randint(0, len(choice), (e, k // 32, n), generator=gen)].to(torch.uint8)
    return packed, scale


@pytest.mark.parametrize("shape", [(2, 64, 32), (3, 96, 48), (1, 2880, 64), (2, 160, 16)])
@pytest.mark.parametrize("order", ["k_fastest", "n_fastest"])
def test_mxfp4_repack_round_trips(shape, order):
    """pack -> repack -> unpack gives the stored bytes back, K not a multiple of the 64-deep chunk included (the
    repack pads it), from either stored memory order."""
    packed, scale = _codes_and_scales(*shape, seed=1)
    stored = k_fastest(packed) if order == "k_fastest" else packed
    values, words = repack.repack_mxfp4(stored, scale)
    e, k, n = shape
    assert values.shape == (e, n // 2, -(-k // 64) * 64) and words.shape == (e, n // 2, -(-k // 64))
    back, back_scale = repack.unpack_mxfp4(values, words, k)
    assert torch.equal(back, packed) and torch.equal(back_scale, scale)


def test_mxfp4_repack_refuses_unpaired_rows():
    packed, scale = _codes_and_scales(1, 64, 24, seed=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        repack.repack_mxfp4(packed, scale)


@pytest.mark.parametrize("k", [64, 200])
@pytest.mark.parametrize("order", ["n_fastest", "k_major"])
def test_fp8_repack_round_trips(k, order):
    weight, _ = get_format("fp8").quantize(torch.randn(2, k, 48, generator=torch.Generator().manual_seed(3)))
    stored = weight if order == "n_fastest" else weight.transpose(1, 2).contiguous().transpose(1, 2)
    values = repack.repack_fp8(stored)
    assert values.shape == (2, 48, -(-k // 64) * 64)
    assert torch.equal(repack.unpack_fp8(values, k).view(torch.uint8), weight.view(torch.uint8))


def _emulate_operand_ptx(values: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """What ``tile_math._MX_OPERAND_PTX`` computes, in torch, from the repacked tensors: each 32-bit word's four
    register pairs by the kernel's shifts and masks, as bf16 bits times 2**126, times the row's E8M0 scale (exact,
    in float64); laid out as the logical ``(E, K', N)``. Written from the PTX, independently of
    ``repack.MX_CODE_BITS``."""
    e, half_n, kp = values.shape
    w = values.to(torch.int64).reshape(e, half_n, kp // 64, 4, 4, 4)  # e n' c t j byte
    w = sum(w[..., i] << (8 * i) for i in range(4))  # e n' c t j
    m = 0x81C081C0
    pairs = [w & m, (w << 3) & m, (w << 6) & m,
             ((w >> 6) & 0x01800180) | ((w >> 4) & 0x00400040) | ((w << 4) & 0x80008000)]
    s = words.to(torch.int64)[:, :, :, None, None].expand(-1, -1, -1, 4, 4)  # e n' c t j
    out = torch.zeros(e, half_n, kp // 64, 4, 4, 4, 2, dtype=torch.float64)  # e n' c t j pair half
    for i, bits in enumerate(pairs):
        row = i // 2  # pairs 0, 1: row n; 2, 3: row n + 8
        for half in range(2):
            h = (bits >> (16 * half)) & 0xFFFF
            as_f32 = (h << 16).to(torch.int32).view(torch.float32).to(torch.float64) * 2.0 ** 126
            j = torch.arange(4)
            byte = (s >> (8 * (2 * (j // 2) + row))) & 0xFF  # group j // 2 of the chunk
            scale = torch.exp2(byte.double() - 127)  # E8M0, byte 0 included (2**-127)
            out[..., i, half] = as_f32 * scale
    # pair i = 2 * row + kh; k = 64c + 16j + 8kh + 2t + half; rows n = 16a + 8row + g with n' = 8a + g
    out = out.reshape(e, half_n // 8, 8, kp // 64, 4, 4, 2, 2, 2)  # e a g c t j row kh half
    out = out.permute(0, 3, 5, 7, 4, 8, 1, 6, 2)  # e c j kh t half a row g
    return out.reshape(e, kp, 2 * half_n)


def test_mx_code_bits_decode_through_the_kernels_bit_operations():
    """Every byte value in every word position, under scales from 2**-127 to 2**127: the repacked words run
    through the kernel's bit operations (emulated) give exactly the format's own dequantization."""
    e, k, n = 2, 128, 32
    packed, scale = _codes_and_scales(e, k, n, seed=4, scales=(0, 1, 64, 127, 128, 200, 254))
    packed[0, :, 0] = torch.arange(64, dtype=torch.uint8)
    packed[0, :, 1] = torch.arange(64, 128, dtype=torch.uint8)
    packed[1, :, 8] = torch.arange(128, 192, dtype=torch.uint8)
    packed[1, :, 17] = torch.arange(192, 256, dtype=torch.uint8)
    values, words = repack.repack_mxfp4(packed, scale)
    expected = get_format("mxfp4").dequantize(packed, scale, torch.bfloat16)
    # bf16 products: exact, or past bf16's range Inf (as the fp32 product rounded to bf16)
    assert torch.equal(_emulate_operand_ptx(values, words)[:, :k].to(torch.bfloat16), expected)
    assert set(E2M1_GRID) <= set(expected.float().abs()[expected.abs() < 7].tolist()) and expected.isinf().any()


def test_repacked_copy_is_cached_until_the_stored_tensors_change():
    fmt = get_format("mxfp4")
    packed, scale = _codes_and_scales(2, 64, 32, seed=5)
    weight = QuantizedWeight.create(fmt, k_fastest(packed), scale, torch.bfloat16)
    first = repack.repacked(weight)
    assert repack.repacked(weight) is first and first.code == repack.REPACKED_CODES["mxfp4"]
    with torch.no_grad():
        weight.scale.add_(1)  # a weight update (load_state_dict writes in place the same way)
    second = repack.repacked(weight)
    assert second is not first
    assert torch.equal(repack.unpack_mxfp4(second.weight, second.scale, 64)[1], scale)
    key = id(weight.weight)
    del weight, first, second
    gc.collect()
    assert key not in repack._CACHE


def _n_fastest(quantized):
    """An N-fastest copy of the same stored bytes (every backend reads either order)."""
    for proj in ("gate_up_proj", "down_proj"):
        lin = getattr(quantized.mlp_op, proj)
        lin.weight = torch.nn.Parameter(lin.weight.contiguous(), requires_grad=False)


def _layers(name, shape, dtype, order="stored", one_launch=True, seed=1):
    """(triton layer with quantized weights, torch layer holding the dequantized weights) on DEVICE."""
    num_tokens, num_experts, top_k, hidden, inter = shape
    config = make_config(num_experts, hidden, inter, top_k, "swiglu_gptoss", bias=True,
                         normalize_top_k_affinities=True)
    return quantized_pair(config, name, dtype, TritonBackend(one_launch=one_launch), DEVICE, seed=seed,
                          edit=_n_fastest if order == "n_fastest" else None)


def _check(tested, holding, x, affinities, index, dtype, what, **kwargs):
    with torch.no_grad():
        out = tested(x, affinities, index, seq_len=1, **kwargs)
        expected = holding(x, affinities, index, seq_len=1, **kwargs)
    ref = reference_for_experts(tested, x, affinities, index)
    if "addend" in kwargs:
        ref = ref + kwargs["addend"].double().cpu()
    if dtype == torch.float32:
        assert_rounding_close(out, ref, rounding_tolerance(dtype, DEPTH, triton_roundings=TRITON_ROUNDINGS), what)
        assert_rounding_close(out, expected, rounding_tolerance(dtype, DEPTH, triton_roundings=TRITON_ROUNDINGS,
                                                                torch_roundings=TORCH_ROUNDINGS), what)
    else:
        assert_backends_close(out, expected, ref, dtype, DEPTH, what)
    return out


# (T, E, k, H, I): K of both projections not a multiple of the 64-deep chunk for mxfp4 / fp8 (padded); fp8_block
# needs multiples of 128.
SHAPES = {"mxfp4": (7, 6, 2, 160, 96), "fp8": (7, 6, 2, 160, 96), "fp8_block": (5, 4, 2, 256, 128)}
GPU_SHAPES = [(1, 64, 8, 2048, 768), (16, 32, 4, 1024, 512)]
# The longest sum here: H or I <= 2048 terms. Tolerances: conftest.rounding_tolerance.
DEPTH = 2048


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_launch", [True, False])
def test_repacked_decode_matches_reference(name, dtype, one_launch):
    """Decode (the one-launch kernel and the separate kernels) reads the repacked copy and equals the float64
    reference and the torch backend on the dequantized weights."""
    shape = SHAPES[name]
    tested, holding = _layers(name, shape, dtype, one_launch=one_launch)
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=2).to(DEVICE, dtype)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=3))
    repack._CACHE.clear()
    _check(tested, holding, x, affinities, index, dtype, f"{name} {dtype}")
    assert len(repack._CACHE) == 2  # both projections read their repacked copies


@pytest.mark.parametrize("name", ["mxfp4", "fp8"])
def test_repacked_decode_from_either_stored_order(name):
    """MxFP4 stored K-fastest (GPT-OSS) or N-fastest; FP8 stored N-fastest (W8A16) or K-major (as W8A8 layers
    store it): the same repacked copy, the same result."""
    shape = SHAPES[name]
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=4).to(DEVICE, torch.bfloat16)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=5))
    outs = []
    for order in ("stored", "n_fastest" if name == "mxfp4" else "k_major"):
        tested, holding = _layers(name, shape, torch.bfloat16, order="n_fastest" if order == "n_fastest" else "stored")
        if order == "k_major":
            with torch.no_grad():
                for proj in ("gate_up_proj", "down_proj"):
                    lin = getattr(tested.mlp_op, proj)
                    lin.weight = torch.nn.Parameter(lin.weight.transpose(1, 2).contiguous().transpose(1, 2),
                                                    requires_grad=False)
        outs.append(_check(tested, holding, x, affinities, index, torch.bfloat16, f"{name} {order}"))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not CUDA, reason="realistic sizes need a GPU")
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_repacked_decode_at_realistic_sizes(name, shape):
    tested, holding = _layers(name, shape, torch.bfloat16)
    num_tokens, num_experts, top_k, hidden, _ = shape
    x = randn(num_tokens, hidden, seed=6).to(DEVICE, torch.bfloat16)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=7))
    _check(tested, holding, x, affinities, index, torch.bfloat16, f"{name} {shape}")


@pytest.mark.parametrize("name", ["mxfp4", "fp8_block"])
@pytest.mark.parametrize("case", ["all_to_one", "empty_experts", "padding_rows"])
def test_repacked_decode_adversarial_routings(name, case):
    """All tokens on one expert (several tiles of it), most experts empty, padding rows with an addend."""
    num_tokens, num_experts, top_k = 40, 8, 2
    shape = (num_tokens, num_experts, top_k, *SHAPES[name][3:])
    tested, holding = _layers(name, shape, torch.float32)
    x = randn(num_tokens, shape[3], seed=8).to(DEVICE)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=9))
    kwargs = {}
    if case == "all_to_one":
        index = torch.stack([torch.full((num_tokens,), 5), torch.full((num_tokens,), 2)], 1).to(DEVICE)
    elif case == "empty_experts":
        index = index % 3
        index[:, 1] = torch.where(index[:, 0] == index[:, 1], (index[:, 1] + 1) % 3, index[:, 1])
    else:
        padding = torch.zeros(num_tokens, dtype=torch.bool, device=DEVICE)
        padding[[3, 17, 30]] = True
        kwargs = dict(addend=randn(num_tokens, shape[3], seed=10).to(DEVICE))
        with torch.no_grad():
            out = tested(x, affinities, index, seq_len=1, padding_mask=padding, **kwargs)
        assert torch.equal(out[~padding], kwargs["addend"][~padding])
        return
    _check(tested, holding, x, affinities, index, torch.float32, case, **kwargs)


@pytest.mark.parametrize("name", FORMATS)
def test_repacked_decode_keeps_a_nan_token_to_itself(name):
    tested, _ = _layers(name, SHAPES[name], torch.bfloat16)
    num_tokens, num_experts, top_k, hidden, _ = SHAPES[name]
    x = randn(num_tokens, hidden, seed=11).to(DEVICE, torch.bfloat16)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=12))
    assert_nan_stays_in_its_row(lambda tokens: tested(tokens, affinities, index, seq_len=1), x, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_repacked_mxfp4_kernel_decodes_every_code_and_scale_exactly(dtype):
    """All 256 bytes under scales from the subnormal 2**-127 to 2**100 through the swapped down GEMM (one-hot rows:
    one nonzero term per sum, so nothing is rounded but the weight): equal to the format's dequantization."""
    fmt = get_format("mxfp4")
    num_experts, k, n = 2, 128, 64
    packed, scale = _codes_and_scales(num_experts, k, n, seed=13, scales=(0, 1, 2, 60, 110, 127, 140, 227))
    packed[0, :, 0] = torch.arange(64, dtype=torch.uint8)
    packed[1, :, 9] = torch.arange(192, 256, dtype=torch.uint8)
    stored = QuantizedWeight.create(fmt, k_fastest(packed).to(DEVICE), scale.to(DEVICE), dtype)
    weight = repack.repacked(stored)
    block_m = 16
    activated = torch.eye(k, dtype=dtype, device=DEVICE).repeat(num_experts, 1)
    tiles = num_experts * k // block_m
    layout = TileLayout(torch.arange(num_experts * k, device=DEVICE),
                        torch.arange(num_experts, dtype=torch.int32, device=DEVICE).repeat_interleave(k // block_m),
                        torch.tensor([tiles], dtype=torch.int32, device=DEVICE),
                        torch.zeros(1, 1, dtype=torch.int64, device=DEVICE), block_m)
    config = {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    got = down_projection(activated, layout, weight, None, config)[0].reshape(num_experts, k, n).cpu()
    expected = fmt.dequantize(packed, scale, dtype)
    # A one-hot sum turns -0 into +0 and may flush results below the smallest normal (the interpreter does).
    tiny = torch.finfo(dtype).tiny
    normal = expected.abs() >= tiny
    assert torch.equal(got[normal], expected[normal])
    assert (got[~normal] - expected[~normal]).abs().max() < tiny
    assert normal.float().mean() > 0.6 and (~normal & (expected != 0)).any()  # both kinds are there


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", FORMATS)
def test_cuda_graph_replays_new_routings_on_the_repacked_copy(name):
    """The copy is made by the warm-up call; the captured decode reads it and serves every routing (all tokens on
    one expert included), replay and eager bitwise equal. A capture with no copy yet reads the stored layout."""
    shape = (16, 32, 4, 1024, 512)
    tested, holding = _layers(name, shape, torch.bfloat16)
    num_tokens, num_experts, top_k, hidden, _ = shape
    static_x = randn(num_tokens, hidden, seed=14).to(DEVICE, torch.bfloat16)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=15))
    static_aff, static_index = affinities.clone(), index.clone()
    repack._CACHE.clear()
    with torch.no_grad():
        graph, static_out = capture_cuda_graph(lambda: tested(static_x, static_aff, static_index, seq_len=1))
        assert len(repack._CACHE) == 2
        for seed in range(3):
            affinities, index = random_routing(num_tokens, num_experts, top_k, seed=20 + seed)
            if seed == 2:
                index[:, 0] = 7
                index[:, 1:] = torch.arange(1, top_k)
            static_aff.copy_(affinities)
            static_index.copy_(index)
            static_x.copy_(randn(num_tokens, hidden, seed=30 + seed).to(torch.bfloat16))
            graph.replay()
            _check(tested, holding, static_x, static_aff, static_index, torch.bfloat16, f"replay {seed}")
            assert torch.equal(static_out, tested(static_x, static_aff, static_index, seq_len=1))
        repack._CACHE.clear()
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            assert repack.repacked(tested.mlp_op.down_proj.stored_weight()) is None
