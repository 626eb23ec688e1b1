"""The stored weight formats (:mod:`nxd_moe.quantization.formats`) against their definitions, piece by piece.

References are written from the formats' specifications (OCP FP8 E4M3FN: sign, 4 exponent bits of bias 7, 3 mantissa
bits, no infinities; OCP MX E2M1: sign, 2 exponent bits of bias 1, 1 mantissa bit; E8M0: ``2**(s - 127)``) and from
the module docstring's table, decoded bit by bit here -- never by the package's own quantize / dequantize.
"""

from __future__ import annotations

import math

import pytest
import torch

from nxd_moe.quantization.formats import (
    FORMATS,
    QUANTIZATION_CHOICES,
    Shape,
    describe_weights,
    get_format,
    k_fastest,
    reported_format,
)

# ----------------------------------------------------------------------------------------------------------
# references from the specifications


def e4m3fn_value(byte: int) -> float:
    """OCP FP8 E4M3FN: ``s eeee mmm``, bias 7, subnormals at exponent 0, only ``s 1111 111`` is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa / 8, -6)
    return sign * math.ldexp(1 + mantissa / 8, exponent - 7)


E4M3FN_FINITE = sorted({e4m3fn_value(b) for b in range(256) if not math.isnan(e4m3fn_value(b))})


def e2m1_value(code: int) -> float:
    """OCP MX E2M1: ``s ee m``, bias 1, subnormal ``0.5 * m`` at exponent 0."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    return sign * (0.5 * mantissa if exponent == 0 else math.ldexp(1 + mantissa / 2, exponent - 1))


def fp8_decoded(weight: torch.Tensor) -> torch.Tensor:
    """float64 values of float8_e4m3fn storage, bit by bit."""
    table = torch.tensor([e4m3fn_value(b) for b in range(256)], dtype=torch.float64)
    return table[weight.view(torch.uint8).long()]


def mxfp4_decoded(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``(E, K, N)`` of ``packed (E, K/2, N)`` (row 2j the low nibble, 2j+1 the high) and E8M0
    ``scale (E, K/32, N)``."""
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    e, half_k, n = packed.shape
    codes = torch.empty(e, 2 * half_k, n, dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = (packed & 0xF).long(), (packed >> 4).long()
    per_row = torch.tensor([math.ldexp(1.0, s - 127) for s in range(256)], dtype=torch.float64)[scale.long()]
    return table[codes] * per_row.repeat_interleave(32, dim=1)


def assert_nearest_fp8(stored: torch.Tensor, target: torch.Tensor, expect_ties: bool = True) -> None:
    """Every stored E4M3FN value is the finite E4M3FN value nearest ``target``, ties to an even mantissa."""
    grid = torch.tensor(E4M3FN_FINITE, dtype=torch.float64)
    got = fp8_decoded(stored)
    target = target.double()
    above = torch.searchsorted(grid, target).clamp(1, len(grid) - 1)  # the grid values either side of the target
    lower, upper = (target - grid[above - 1]).abs(), (target - grid[above]).abs()
    assert torch.equal((got - target).abs(), torch.minimum(lower, upper))
    ties = lower == upper
    assert bool(ties.any()) or not expect_ties  # the data has ties, so the rule is seen
    assert not bool((stored.view(torch.uint8)[ties] & 1).any())


def mx_exponent(amax: float) -> int:
    """The smallest power of two ``2**X`` (``-127 <= X``) with ``amax <= 6 * 2**X``, by search."""
    x = -127
    while amax > 6 * math.ldexp(1.0, x):
        x += 1
    return x


def mx_code(value: float) -> int:
    """The E2M1 code nearest ``value`` (ties to the even code); a value rounding to zero is +0."""
    magnitudes = [e2m1_value(c) for c in range(8)]
    distances = [abs(abs(value) - m) for m in magnitudes]
    best = min(distances)
    code = [c for c in range(8) if distances[c] == best]
    code = code[0] if len(code) == 1 else next(c for c in code if c % 2 == 0)
    return code | 0x8 if value < 0 and code else code


# ----------------------------------------------------------------------------------------------------------
# names, aliases, attributes


@pytest.mark.parametrize("alias,name", [
    (None, "bf16"), ("None", "bf16"), ("BF16", "bf16"), ("FP8_Per_Channel", "fp8"),
    ("EXPERT_WISE_PER_CHANNEL_SYMMETRIC", "fp8"), ("F8E4M3", "fp8"), ("Blockwise_Symmetric", "fp8_block"),
    ("F4E2M1FN_X4", "mxfp4"), ("FP8_BLOCK", "fp8_block"), ("MxFp4", "mxfp4")])
def test_every_nxd_alias_names_its_format_in_any_case(alias, name):
    assert get_format(alias) is FORMATS[name]
    assert get_format(FORMATS[name]) is FORMATS[name]


def test_an_unknown_format_is_named_with_the_choices_and_the_aliases():
    with pytest.raises(ValueError) as error:
        get_format("int4", "experts.weight_format")
    assert str(error.value) == (
        "experts.weight_format must be one of ['bf16', 'fp8', 'fp8_block', 'mxfp4'] (or an NxD alias "
        "['blockwise_symmetric', 'expert_wise_per_channel_symmetric', 'f4e2m1fn_x4', 'f8e4m3', 'fp8_per_channel', "
        "'none']), got 'int4'")
    with pytest.raises(ValueError, match=r"^quantization must be one of .*got 7$"):
        get_format(7)
    assert QUANTIZATION_CHOICES == ("bf16", "fp8", "fp8_block", "mxfp4")


def test_reports_name_unquantized_weights_by_their_dtype():
    assert [reported_format(q) for q in (None, "bf16", "FP8", FORMATS["fp8_block"], "f4e2m1fn_x4")] == [
        "none", "none", "fp8", "fp8_block", "mxfp4"]
    assert describe_weights("bf16", torch.float16) == "float16 (unquantized)"
    assert describe_weights(None, "torch.bfloat16") == "bfloat16 (unquantized)"
    assert describe_weights("blockwise_symmetric", torch.float16) == "fp8_block"
    assert repr(FORMATS["mxfp4"]) == "QuantizationFormat('mxfp4')"


# The module docstring's table (NxD's vocabulary, stored dtypes, blocks), format by format.
TABLE = {
    "bf16": (False, None, None, None),
    "fp8": (True, "EXPERT_WISE_PER_CHANNEL_SYMMETRIC", "F8E4M3FN", "F32"),
    "fp8_block": (True, "BLOCKWISE_SYMMETRIC", "F8E4M3FN", "F32"),
    "mxfp4": (True, "BLOCKWISE_SYMMETRIC (OCP MX)", "F4E2M1FN_X4", "F8E8M0"),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_formats_carry_nxds_vocabulary(name):
    fmt = FORMATS[name]
    assert fmt.name == name
    assert (fmt.quantized, fmt.nxd_quantization_type, fmt.nxd_quantized_dtype, fmt.nxd_scale_dtype) == TABLE[name]


# (E, K, N) = (3, 256, 384): every block size divides, no two dims equal, so a swapped dim shows.
E, K, N = 3, 256, 384
SHAPES = {  # weight shape and dtype, scale shape and dtype, stored bytes
    "fp8": ((E, K, N), torch.float8_e4m3fn, (E, 1, N), torch.float32, E * K * N + 4 * E * N),
    "fp8_block": ((E, K, N), torch.float8_e4m3fn, (E, 2, 3), torch.float32, E * K * N + 4 * E * 2 * 3),
    "mxfp4": ((E, K // 2, N), torch.uint8, (E, K // 32, N), torch.uint8, E * K * N // 2 + E * K // 32 * N),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_storage_shapes_dtypes_and_bytes(name):
    fmt, shape = FORMATS[name], Shape(E, K, N)
    w_shape, w_dtype, s_shape, s_dtype, nbytes = SHAPES[name]
    assert fmt.weight_shape(shape) == w_shape and fmt.scale_shape(shape) == s_shape
    assert (fmt.weight_dtype, fmt.scale_dtype) == (w_dtype, s_dtype)
    assert fmt.stored_bytes(shape) == nbytes
    weight, scale = fmt.empty(shape)
    assert (tuple(weight.shape), weight.dtype, tuple(scale.shape), scale.dtype) == (w_shape, w_dtype, s_shape, s_dtype)
    assert torch.equal(weight.view(torch.uint8), torch.zeros(w_shape, dtype=torch.uint8))
    # the scales of empty storage are valid: 1.0 (FP8) or E8M0 127 = 2**0 (MxFP4)
    assert torch.equal(scale, torch.full(s_shape, 127 if name == "mxfp4" else 1.0, dtype=s_dtype))
    fmt.check(weight, scale, shape, "empty")
    if name == "mxfp4":  # K-fastest: each output column's K/2 bytes contiguous
        assert weight.stride() == (N * K // 2, 1, K // 2)
    meta_w, meta_s = fmt.empty(shape, "meta")
    assert meta_w.is_meta and meta_s.is_meta and meta_w.dtype == w_dtype and meta_s.dtype == s_dtype


def test_bf16_has_no_blocks():
    fmt = FORMATS["bf16"]
    assert (fmt.block_k, fmt.block_n, fmt.values_per_byte) == (None, 1, 1)
    fmt.check_shape(Shape(2, 3, 5), "odd")  # any shape


# ----------------------------------------------------------------------------------------------------------
# checks and their messages


@pytest.mark.parametrize("name,shape,message", [
    ("fp8_block", Shape(2, 192, 256), "w1: format 'fp8_block' needs the in (K) dimension divisible by its block size "
                                      "128, got 192 (shape (E, K, N) = (2, 192, 256))"),
    ("fp8_block", Shape(2, 256, 320), "w1: format 'fp8_block' needs the out (N) dimension divisible by its block size "
                                      "128, got 320 (shape (E, K, N) = (2, 256, 320))"),
    ("mxfp4", Shape(2, 48, 7), "w1: format 'mxfp4' needs the in (K) dimension divisible by its block size 32, got 48 "
                               "(shape (E, K, N) = (2, 48, 7))"),
])
def test_check_shape_names_the_dimension_and_block(name, shape, message):
    with pytest.raises(ValueError) as error:
        FORMATS[name].check_shape(shape, "w1")
    assert str(error.value) == message


def test_blocks_that_divide_pass_the_shape_check():
    FORMATS["fp8"].check_shape(Shape(2, 7, 5), "w")  # per channel: any K, any N
    FORMATS["mxfp4"].check_shape(Shape(2, 64, 7), "w")  # any N
    FORMATS["fp8_block"].check_shape(Shape(2, 256, 128), "w")


def test_scale_split_dims():
    # N (dim 2) always cuts the scale's dim 2; K cuts the scale's dim 1 where it has blocks along K
    assert [FORMATS["fp8"].scale_split_dim(d) for d in (1, 2)] == [None, 2]
    assert [FORMATS["fp8_block"].scale_split_dim(d) for d in (1, 2)] == [1, 2]
    assert [FORMATS["mxfp4"].scale_split_dim(d) for d in (1, 2)] == [1, 2]


@pytest.mark.parametrize("name,dim,parts,stride", [
    ("fp8_block", 1, 2, 1), ("fp8_block", 2, 3, 1), ("fp8_block", 2, 1, 3),  # 384 = 3 x 128
    ("mxfp4", 1, 4, 2), ("mxfp4", 2, 384, 1),  # K: 256 = 8 x 32; N: per channel
    ("fp8", 1, 256, 1), ("fp8", 2, 3, 128),  # fp8: K needs nothing (a scale spans K), N per channel
])
def test_splits_of_whole_blocks_pass(name, dim, parts, stride):
    FORMATS[name].check_split(Shape(E, K, N), dim, parts, stride, "w")


@pytest.mark.parametrize("name,dim,parts,stride,message", [
    ("fp8_block", 1, 4, 1, "w2: format 'fp8_block' cannot split its in (K) dimension of 256 into 4 slices of whole "
                           "128-wide blocks (a slice would be 64); pick a tensor-parallel size that makes each slice "
                           "a multiple of 128"),
    ("fp8_block", 2, 2, 1, "w2: format 'fp8_block' cannot split its out (N) dimension of 384 into 2 slices of whole "
                           "128-wide blocks (a slice would be 192); pick a tensor-parallel size that makes each slice "
                           "a multiple of 128"),
    ("fp8_block", 2, 1, 2, "w2: format 'fp8_block' cannot split its out (N) dimension of 384 into 2 slices of whole "
                           "128-wide blocks (a slice would be 192); pick a tensor-parallel size that makes each slice "
                           "a multiple of 128"),
    ("mxfp4", 1, 2, 8, "w2: format 'mxfp4' cannot split its in (K) dimension of 256 into 16 slices of whole 32-wide "
                       "blocks (a slice would be 16); pick a tensor-parallel size that makes each slice a multiple of "
                       "32"),
    ("mxfp4", 2, 5, 1, "w2: format 'mxfp4' cannot split its out (N) dimension of 384 into 5 slices of whole 1-wide "
                       "blocks (a slice would be 76.8); pick a tensor-parallel size that makes each slice a multiple "
                       "of 1"),
    ("fp8", 1, 3, 1, "w2: format 'fp8' cannot split its in (K) dimension of 256 into 3 slices of whole 1-wide blocks "
                     "(a slice would be 85.3333); pick a tensor-parallel size that makes each slice a multiple of 1"),
])
def test_splits_that_cut_a_block_are_refused_with_the_sizes(name, dim, parts, stride, message):
    with pytest.raises(ValueError) as error:
        FORMATS[name].check_split(Shape(E, K, N), dim, parts, stride, "w2")
    assert str(error.value) == message


def test_a_split_counts_stride_times_parts_slices():
    # 388 columns in 4 groups of 2: 8 slices of 48.5 (388 is a multiple of 4 / 2, not of 4 x 2)
    with pytest.raises(ValueError, match=r"dimension of 388 into 8 slices of whole 1-wide blocks \(a slice would be "
                                         r"48\.5\)"):
        FORMATS["fp8"].check_split(Shape(1, 128, 388), 2, 2, 4, "w")


def test_mxfp4_splits_of_k_keep_packed_pairs_whole_without_blocks():
    # a format with packed pairs but no K blocks would split K at pairs: the block_k=None fallback
    fmt = FORMATS["mxfp4"]
    unblocked = type("Unblocked", (type(fmt),), {"block_k": None, "name": "unblocked"})()
    unblocked.check_split(Shape(1, 6, 1), 1, 3, 1, "w")  # 3 slices of 2 rows: whole bytes
    with pytest.raises(ValueError, match=r"of whole 2-wide blocks \(a slice would be 1\)"):
        unblocked.check_split(Shape(1, 6, 1), 1, 6, 1, "w")


@pytest.mark.parametrize("name", ["fp8", "fp8_block", "mxfp4"])
def test_check_names_the_tensor_its_dtype_and_shape(name):
    fmt, shape = FORMATS[name], Shape(2, 128, 256)
    weight, scale = fmt.empty(shape)
    w_dtype, s_dtype = fmt.weight_dtype, fmt.scale_dtype
    with pytest.raises(TypeError, match=r"^p\.weight must be a torch\.Tensor, got list$"):
        fmt.check([0], scale, shape, "p")
    with pytest.raises(TypeError, match=r"^p\.scale must be a torch\.Tensor, got NoneType$"):
        fmt.check(weight, None, shape, "p")
    wrong = torch.zeros(tuple(weight.shape), dtype=torch.float16)
    with pytest.raises(ValueError) as error:
        fmt.check(wrong, scale, shape, "p")
    assert str(error.value) == (f"p.weight: format {name!r} stores weight as {w_dtype} of shape "
                                f"{tuple(weight.shape)}, got torch.float16 of shape {tuple(weight.shape)}")
    with pytest.raises(ValueError) as error:
        fmt.check(weight, scale[:1], shape, "p")
    assert str(error.value) == (f"p.scale: format {name!r} stores scale as {s_dtype} of shape {tuple(scale.shape)}, "
                                f"got {s_dtype} of shape {(1,) + tuple(scale.shape)[1:]}")
    if name != "fp8":  # the blocks must divide the shape first (fp8's per-channel scale takes any K)
        with pytest.raises(ValueError, match=r"^p: format .* needs the in \(K\) dimension"):
            fmt.check(weight, scale, Shape(2, 80, 256), "p")


@pytest.mark.parametrize("name,bad,count,message", [
    ("fp8", [0.0, -2.0, math.inf, math.nan], 4, "scale(s) are NaN, Inf, zero or negative; format 'fp8' needs finite "
                                                 "positive float32 scales"),
    ("fp8_block", [-1e-30], 1, "scale(s) are NaN, Inf, zero or negative; format 'fp8_block' needs finite positive "
                               "float32 scales"),
    ("mxfp4", [255, 255], 2, "E8M0 scale(s) are 0xFF (NaN); format 'mxfp4' scales are biased exponents 0..254"),
])
def test_bad_scale_values_are_counted_and_named(name, bad, count, message):
    fmt, shape = FORMATS[name], Shape(2, 128, 256)
    weight, scale = fmt.empty(shape)
    flat = scale.view(-1)
    for i, value in enumerate(bad):
        flat[2 * i + 1] = value
    with pytest.raises(ValueError) as error:
        fmt.check(weight, scale, shape, "layer.scale_holder")
    assert str(error.value) == f"layer.scale_holder.scale: {count} {message}"
    fmt.check(weight, scale, shape, "layer", values=False)  # shapes and dtypes only
    fmt.check(weight.to("meta"), scale.to("meta"), shape, "layer")  # a meta scale has no values to read


def test_mxfp4_scales_other_than_0xff_are_valid():
    fmt, shape = FORMATS["mxfp4"], Shape(1, 32, 3)
    weight, _ = fmt.empty(shape)
    fmt.check(weight, torch.tensor([[[0, 254, 1]]], dtype=torch.uint8), shape, "edge")


# ----------------------------------------------------------------------------------------------------------
# quantize / dequantize against the specifications


def random_weights(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over several octaves, so scales and E4M3 subnormals both occur
    return torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 4, shape, generator=gen).float())


def test_fp8_per_channel_by_definition():
    w = random_weights((2, 48, 40), seed=1)
    w[1, :, 3] = 0.0  # an all-zero channel: scale 1
    w[0, :, 5] *= 1e4  # one loud channel: its own scale
    data, scale = FORMATS["fp8"].quantize(w.to(torch.bfloat16))
    w = w.to(torch.bfloat16).double()
    amax = w.abs().amax(dim=1, keepdim=True)
    expected_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert scale.dtype == torch.float32 and data.dtype == torch.float8_e4m3fn
    assert torch.allclose(scale.double(), expected_scale, rtol=2 ** -23, atol=0)  # float32 division of the amax
    assert scale[1, 0, 3].item() == 1.0
    assert_nearest_fp8(data, w.float() / scale)  # the float32 quotient rounded once to E4M3
    maxes = fp8_decoded(data).abs().amax(1)  # each channel's max lands on E4M3's max
    assert torch.equal(maxes[amax[:, 0] > 0], torch.full_like(maxes[amax[:, 0] > 0], 448.0))
    # dequantize: float32(weight) * scale, rounded once to the dtype
    expected = (fp8_decoded(data) * scale.double()).float()
    for dtype in (torch.float32, torch.bfloat16):
        got = FORMATS["fp8"].dequantize(data, scale, dtype)
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype))


def test_fp8_block_by_definition():
    w = random_weights((2, 256, 384), seed=2).to(torch.bfloat16)  # few mantissa bits: ties occur
    w[0, 128:, 256:] *= 300.0  # one tile far larger: tile (1, 2) of expert 0
    w[1, :128, :128] = 0.0  # an all-zero tile: scale 1
    data, scale = FORMATS["fp8_block"].quantize(w)
    tiles = w.double().reshape(2, 2, 128, 3, 128).abs().amax(dim=(2, 4))
    expected_scale = torch.where(tiles > 0, tiles / 448, torch.ones_like(tiles))
    assert scale.shape == (2, 2, 3) and scale.dtype == torch.float32  # float32 whatever the weights' dtype
    assert torch.allclose(scale.double(), expected_scale, rtol=2 ** -23, atol=0)
    assert scale[1, 0, 0].item() == 1.0
    spread = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert_nearest_fp8(data, w / spread.float())
    expected = (fp8_decoded(data) * spread).float()
    got = FORMATS["fp8_block"].dequantize(data, scale, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, expected.half())
    # any subset of experts dequantizes alone
    assert torch.equal(FORMATS["fp8_block"].dequantize(data[1:], scale[1:], torch.float32), expected[1:].float())


def test_mxfp4_by_definition():
    e, k, n = 2, 96, 5
    w = random_weights((e, k, n), seed=3)
    w[0, 32:64, 1] = 0.0  # an all-zero block: the smallest scale, 2**-127
    w[1, :32, 2] = 2.0 ** -140  # tinier than 6 * 2**-127: the scale clamps at 2**-127
    w[1, 64:96, 3] = torch.linspace(-6.5, 6.5, 32)  # amax 6.5: needs 2**1, not 2**0
    w[0, :32, 4] = torch.tensor([-3.0] + [0.25 * j for j in range(-15, 16)])  # ties at 0.25 steps, scale 2**0
    data, scale = FORMATS["mxfp4"].quantize(w)
    assert data.shape == (e, k // 2, n) and data.dtype == torch.uint8 and data.stride() == (n * k // 2, 1, k // 2)
    expected_scale = torch.empty(e, k // 32, n, dtype=torch.long)
    codes = torch.empty(e, k, n, dtype=torch.long)
    for x in range(e):
        for b in range(k // 32):
            for c in range(n):
                block = w[x, 32 * b:32 * b + 32, c].tolist()
                exponent = mx_exponent(max(abs(v) for v in block))
                expected_scale[x, b, c] = exponent + 127
                for r, v in enumerate(block):
                    codes[x, 32 * b + r, c] = mx_code(v / math.ldexp(1.0, exponent))
    assert torch.equal(scale.long(), expected_scale)
    assert scale[0, 1, 1].item() == 0 and scale[1, 0, 2].item() == 0 and scale[1, 2, 3].item() == 128
    assert torch.equal(data.long(), codes[:, 0::2] | (codes[:, 1::2] << 4))
    # dequantize: e2m1(nibble) * 2**(scale - 127), rounded once to the dtype
    expected = mxfp4_decoded(data, scale)
    for dtype in (torch.float32, torch.bfloat16):
        got = FORMATS["mxfp4"].dequantize(data, scale, dtype)
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype))
    # error bound of the definition: at most half of E2M1's top spacing (2 * 2**X), nothing saturates
    step = expected_scale.double().sub(127).exp2().repeat_interleave(32, 1)  # half of E2M1's top spacing 2
    assert bool(((expected - w.double()).abs() <= step).all())


def test_mxfp4_quantizes_float16_weights_in_float32():
    # float16 cannot hold 2**-127, the scale of an all-zero block: the working copy must be float32
    w = torch.zeros(1, 64, 2, dtype=torch.float16)
    w[0, 32:, 0] = torch.linspace(-3.0, 3.0, 32, dtype=torch.float16)  # amax 3: scale 2**-1
    data, scale = FORMATS["mxfp4"].quantize(w)
    assert scale.tolist() == [[[0, 0], [126, 0]]]
    assert torch.equal(data[0, :16], torch.zeros(16, 2, dtype=torch.uint8))
    codes = torch.tensor([mx_code(v / 0.5) for v in w[0, 32:, 0].tolist()])
    assert torch.equal(data[0, 16:, 0].long(), codes[0::2] | (codes[1::2] << 4))


def test_mxfp4_dequantizes_every_code_and_scale_byte():
    # all 16 codes in both nibbles, scales from 2**-127 to 2**127
    low = torch.arange(16, dtype=torch.uint8).repeat(2)  # rows 2j: 32 codes
    high = torch.arange(15, -1, -1, dtype=torch.uint8).repeat(2)
    packed = (low | (high << 4)).view(1, 32, 1).repeat(1, 1, 4)  # (1, K/2 = 32, 4): K = 64, two scale blocks
    scale = torch.tensor([[[0, 100, 127, 250], [250, 127, 130, 1]]], dtype=torch.uint8)  # 6 * 2**123 fits float32
    got = FORMATS["mxfp4"].dequantize(packed, scale, torch.float64)
    assert torch.equal(got, mxfp4_decoded(packed, scale))
    # K-row 14: low nibble of byte 7 (code 7); K-rows 13, 9, 1: high nibbles 15 - 6 = 9, 15 - 4 = 11, 15
    assert [got[0, r, 2].item() for r in (14, 13, 9, 1)] == [6.0, -0.5, -1.5, -6.0]


def test_quantize_by_expert_stays_on_the_weights_device():
    class Probe(type(FORMATS["fp8"])):  # quantize stubbed: what is checked is where quantize_by_expert stores
        def quantize(self, weight):
            return (torch.zeros(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device),
                    torch.ones(weight.shape[0], 1, weight.shape[2], device=weight.device))

    data, scale = Probe().quantize_by_expert(torch.empty(2, 16, 8, device="meta"))
    assert data.is_meta and scale.is_meta and data.shape == (2, 16, 8) and scale.shape == (2, 1, 8)
    assert data.stride() == (128, 8, 1)  # N-fastest unless asked K-major


def test_quantize_by_expert_quantizes_every_expert():
    w = random_weights((5, 2, 3), seed=5)  # more experts than rows of K: each one still quantized
    data, scale = FORMATS["fp8"].quantize_by_expert(w)
    amax = w.abs().amax(dim=1, keepdim=True)
    assert torch.equal(scale, amax / 448)
    assert_nearest_fp8(data, w / scale, expect_ties=False)


def test_k_fastest_keeps_values_and_makes_k_contiguous():
    packed = torch.arange(2 * 3 * 5, dtype=torch.uint8).view(2, 3, 5)
    out = k_fastest(packed)
    assert torch.equal(out, packed) and out.stride() == (15, 1, 3)
    with pytest.raises(ValueError) as error:
        k_fastest(packed[0])
    assert str(error.value) == "k_fastest: packed must be (E, K/2, N), got shape (3, 5)"
