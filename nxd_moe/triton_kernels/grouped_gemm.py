"""The two expert projections as grouped GEMMs over a :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout`.

Each program owns one ``BLOCK_M``-row tile of one expert and one ``BLOCK_N`` column slice; programs whose tile is
past the device-side tile count exit before loading anything (the GPU form of dynamic-while block skipping), so
one launch shape -- and one captured CUDA graph -- serves every routing. Programs are ordered tile-major, so the
column slices of one tile run together (its gathered rows stay in L2) and the tiles of one expert follow each
other (its weights are read from HBM about once).

- :func:`gate_up_projection`: rows gathered straight from ``hidden_states`` by token id inside the A-tile load
  (padding rows are masked, never loaded), ``x @ gate_up_proj[e]``, and the whole activation in the epilogue:
  affinity pre-scaling (Llama 4), bias, clamps, GLU / SwiGLU with GPT-OSS's scaling and ``hidden_act_bias``,
  checkpoint-padding columns zeroed. ``[gate | up]`` are two column slices of the same ``(E, H, 2I)`` weight,
  accumulated side by side so the activation sees both. Optionally split along ``H`` (decode at small ``T``):
  fp32 partial sums, then a second launch adds them in a fixed order and applies the activation.
- :func:`down_projection`: ``act @ down_proj[e]`` plus bias, optionally split along ``K`` into fp32 partial sums
  (summed, in a fixed order, by the combine) so that decode puts enough programs on the GPU.

Accumulation is fp32; results are rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.config import GLUType
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.gpu_info import capability
from nxd_moe.triton_kernels import interpreting
from nxd_moe.triton_kernels.repack import RepackedWeight
from nxd_moe.triton_kernels.routing_metadata import TileLayout

ACTIVATIONS = {"silu": 0, "gelu": 1, "relu": 2, "sigmoid": 3, "tanh": 4, "leaky_relu": 5}


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:
        return tl.where(x > 0, x, 0.0)
    elif ACT == 3:
        return tl.sigmoid(x)
    elif ACT == 4:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0
    else:
        return tl.where(x >= 0, x, 0.01 * x)


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    # Triton's interpreter (3.6 to 3.9) returns garbage for 16-bit dots; under it the operands go in as fp32.
    if INTERPRET and a.dtype != tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def tile_and_column(pid, num_tiles_ptr, num_n, GROUP_M: tl.constexpr):
    """Program -> (tile, column slice), ``GROUP_M`` tiles at a time: the group's gathered rows and each column
    slice of the weights are read from HBM once and reused from L2 by the whole group (tile-major order would
    re-read an expert's weights once per tile). ``tile = -1``: past the device-side tile count, nothing to do."""
    return grouped_order(pid, tl.load(num_tiles_ptr), num_n, GROUP_M)


@triton.jit
def grouped_order(pid, num_tiles, num_n, GROUP_M: tl.constexpr):
    """:func:`tile_and_column` for a tile count already loaded (work item ``pid`` of a persistent program)."""
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles - first, GROUP_M)
    in_group = pid % per_group
    tile = first + in_group % tl.maximum(group_size, 1)
    column = in_group // tl.maximum(group_size, 1)
    return tl.where(pid < num_tiles * num_n, tile, -1), column


@triton.jit
def _e2m1_as_fp16(packed, SHIFT: tl.constexpr):
    """The E2M1 nibbles at bit ``SHIFT`` (0 or 4) of ``packed`` as fp16 values times ``2**-14``, exactly: the
    nibble's sign, exponent and mantissa bits moved to fp16's sign and lowest exponent and top mantissa bits
    (E2M1's subnormal 0.5 lands on fp16's subnormal ``2**-15``), with no arithmetic, select or table."""
    code = (packed >> SHIFT).to(tl.uint16)
    return (((code & 8) << 12) | ((code & 7) << 9)).to(tl.float16, bitcast=True)


def _nibbles_as_bf16x2(out: str, pair: str, nibble: int) -> str:
    """PTX: the 4-bit code at bit ``4 * nibble`` of each 16-bit half of ``pair`` -> ``out``, two bf16 holding the
    E2M1 values times ``2**-126`` (code bit 3 -> the sign bit 15; bits 0-2 -> exponent bits 7-8 and mantissa bit 6),
    then multiplied by ``c = 2**126`` (``z = -0`` keeps the fma an exact multiply)."""
    return (f"shl.b32 t0, {pair}, {12 - 4 * nibble}; shl.b32 t1, {pair}, {6 - 4 * nibble}; "
            "and.b32 t0, t0, 0x80008000; and.b32 t1, t1, 0x01C001C0; or.b32 t0, t0, t1; "
            f"fma.rn.bf16x2 {out}, t0, c, z;\n")


# $4: four bytes b0..b3. prmt spreads b0,b1 (b2,b3) over the two 16-bit halves of x01 (x23); $0,$1 take the low
# nibbles of b0,b1 and b2,b3; $2,$3 the high ones. 0x7E80 is bf16 2**126.
_E2M1_PAIRS_PTX = tl.constexpr(
    "{\n.reg .b32 x01, x23, t0, t1, c, z;\nmov.b32 c, 0x7E807E80;\nmov.b32 z, 0x80008000;\n"
    "prmt.b32 x01, $4, 0, 0x4140;\nprmt.b32 x23, $4, 0, 0x4342;\n"
    + _nibbles_as_bf16x2("$0", "x01", 0) + _nibbles_as_bf16x2("$1", "x23", 0)
    + _nibbles_as_bf16x2("$2", "x01", 1) + _nibbles_as_bf16x2("$3", "x23", 1) + "}")


@triton.jit
def _e2m1_pairs_as_bf16(packed, INTERPRET: tl.constexpr):
    """``packed (P, N)`` uint8 -> ``(2P, N)`` bf16 E2M1 values, exactly: row ``2j`` from byte ``j``'s low nibble,
    ``2j + 1`` from its high one (so a thread holding one byte holds the k-pair a 16-bit MMA operand register
    takes).

    On a GPU, four bytes at a time in 32-bit registers: each nibble's bits go to bf16's sign, two lowest exponent
    and top mantissa bits (the value times ``2**-126``; E2M1's subnormal 0.5 lands on bf16's subnormals), then a
    bf16x2 multiply by ``2**126`` -- about 3 instructions a value where per-element 16-bit code takes 5. Triton's
    interpreter cannot run PTX: there the same values come from :func:`_e2m1_as_fp16`."""
    if INTERPRET:
        low = (_e2m1_as_fp16(packed, 0).to(tl.float32) * 16384.0).to(tl.bfloat16)
        high = (_e2m1_as_fp16(packed, 4).to(tl.float32) * 16384.0).to(tl.bfloat16)
    else:
        low, high = tl.inline_asm_elementwise(
            asm=_E2M1_PAIRS_PTX,
            constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    pairs = tl.join(low, high)
    return tl.reshape(tl.permute(pairs, (0, 2, 1)), (2 * packed.shape[0], packed.shape[1]))


@triton.jit
def _scaled(w, scale, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``w (K, N) * scale (N,)`` in ``dtype``, as the dequantization rounds it (fp32 product, one rounding).
    For bf16 the product is taken in bf16: ``w`` is a bf16-exact E2M1 value and ``scale`` a power of two, so it
    is exact (a packed bf16x2 multiply, half the instructions of the fp32 round trip). Triton's interpreter has
    no bf16 arithmetic: there the product is taken in fp32, to the same value."""
    if dtype == tl.bfloat16 and not INTERPRET:
        return w * scale.to(tl.bfloat16)[None, :]
    return (w.to(tl.float32) * scale[None, :]).to(dtype)


@triton.jit
def _e8m0(scale_bits):
    """E8M0 scales as float32 ``2**(s - 127)``, exactly, from their bits (``s == 0`` is the subnormal 2**-127)."""
    exponent = scale_bits.to(tl.int32)
    return tl.where(exponent > 0, exponent << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def _quantized_dot(a_rows, row_ok, acc, w_ptr, scale_ptr, expert, k0, k_end, cols, col_ok, stride_we, stride_wk,
                   stride_wn, stride_se, stride_sk, stride_sn, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + A[:, k0 : k0 + BLOCK_K] @ W[expert][k0 : k0 + BLOCK_K, cols]`` with ``W`` read in its stored
    format (``FORMAT``: 1 FP8 per-channel, 2 FP8 128x128 blocks, 3 MxFP4) and dequantized in registers; ``A``'s
    rows start at the pointers ``a_rows (M,)``; rows of ``W`` from ``k_end`` on count as zero.

    FP8 tiles are dequantized as :meth:`QuantizationFormat.dequantize` does it (fp32 product, one rounding):
    elementwise on the loaded tile, which lets it go from its load straight into the MMA operand layout.
    MxFP4 holds rows ``2j`` and ``2j+1`` in the low and high nibbles of one byte, and is stored K-fastest
    (:class:`~nxd_moe.quantization.formats.MxFp4`): a thread loads whole runs of k-pairs of one column, and each
    byte unpacks into one register of the 16-bit MMA operand (no byte-wise shuffles through shared memory,
    which an N-fastest layout costs). Each 32-row group's E8M0 scale multiplies its weight tile (exact: see
    :func:`_scaled`), so one MMA covers the group and one accumulator chain runs over all of ``K`` (scaling the
    group's product instead would take a fresh accumulator and an fp32 ``M x N`` multiply-add per 32 rows).
    Instruction counts and H100 times: docs/gpu.md."""
    w_base = w_ptr + expert * stride_we
    scale_base = scale_ptr + expert * stride_se
    if FORMAT == 3:
        for group in tl.static_range(BLOCK_K // 32):
            first = k0 + 32 * group
            in_range = first < k_end
            pairs = first // 2 + tl.arange(0, 16)
            packed = tl.load(w_base + pairs[:, None] * stride_wk + cols[None, :] * stride_wn,
                             mask=in_range & col_ok[None, :], other=0)
            scale = _e8m0(tl.load(scale_base + (first // 32) * stride_sk + cols * stride_sn,
                                  mask=in_range & col_ok, other=0))
            a = tl.load(a_rows[:, None] + (first + tl.arange(0, 32))[None, :], mask=row_ok[:, None] & in_range,
                        other=0.0)
            w = _scaled(_e2m1_pairs_as_bf16(packed, INTERPRET), scale, a.dtype, INTERPRET)
            acc = tile_dot(a, w, acc, PRECISION, INTERPRET)
        return acc
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < k_end
    a = tl.load(a_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                other=0.0)
    if FORMAT == 1:
        scale = tl.load(scale_base + cols * stride_sn, mask=col_ok, other=0.0)
    else:
        # The K tile lies inside one 128-row block (BLOCK_K divides 128): one row of column scales.
        scale = tl.load(scale_base + (k0 // 128) * stride_sk + (cols // 128) * stride_sn, mask=col_ok, other=0.0)
    return tile_dot(a, (w.to(tl.float32) * scale[None, :]).to(a.dtype), acc, PRECISION, INTERPRET)


def _mx_word_ptx(j: int) -> str:
    """PTX: word ``j`` (``$16 + j``) of a thread's 16 repacked MxFP4 bytes -> its four bf16 operand registers (rows
    ``n`` / ``n + 8`` x K pairs ``t`` / ``t + 4`` of K step ``j``). Each pair's codes sit where one shift and mask
    put them into bf16's sign, two lowest exponent and top mantissa bits (``repack.MX_CODE_BITS``): the E2M1 value
    times ``2**-126`` (E2M1's subnormal 0.5 lands on bf16's subnormals), then two exact bf16x2 multiplies: by
    ``2**126`` and by the group's E8M0 scale (``z = -0`` keeps an fma a plain multiply)."""
    x, rows = f"${16 + j}", ("sa", "sb") if j < 2 else ("sc", "sd")
    pairs = [f"and.b32 t, {x}, 0x81C081C0;\n",
             f"shl.b32 t, {x}, 3;\nand.b32 t, t, 0x81C081C0;\n",
             f"shl.b32 t, {x}, 6;\nand.b32 t, t, 0x81C081C0;\n",
             f"shr.b32 t, {x}, 6;\nand.b32 t, t, 0x01800180;\nshr.b32 u, {x}, 4;\nand.b32 u, u, 0x00400040;\n"
             f"or.b32 t, t, u;\nshl.b32 u, {x}, 4;\nand.b32 u, u, 0x80008000;\nor.b32 t, t, u;\n"]
    outs = (2 * j, 2 * j + 1, 8 + 2 * j, 9 + 2 * j)
    return "".join(f"{pairs[i]}fma.rn.bf16x2 t, t, c, z;\nfma.rn.bf16x2 ${outs[i]}, t, {rows[i // 2]}, z;\n"
                   for i in range(4))


def _scale_splat_ptx(name: str, byte: int) -> str:
    """PTX: byte ``byte`` of the chunk's scale word ``$20`` as a bf16x2 splat of ``2**(s - 127)`` (bits ``s << 7``;
    ``s = 0`` is the subnormal ``0x0040``)."""
    return f"prmt.b32 {name}, $20, 0, 0x4{byte}4{byte};\nshl.b32 {name}, {name}, 7;\nmax.u16x2 {name}, {name}, m;\n"


# $0-$7 / $8-$15: rows n / n + 8, 16 bf16 each (operand register order); $16-$19: the 16 bytes; $20: scale word.
_MX_OPERAND_PTX = tl.constexpr(
    "{\n.reg .b32 t, u, c, z, m, sa, sb, sc, sd;\nmov.b32 c, 0x7E807E80;\nmov.b32 z, 0x80008000;\n"
    "mov.b32 m, 0x00400040;\n" + "".join(_scale_splat_ptx(n, b) for n, b in zip(("sa", "sb", "sc", "sd"), range(4)))
    + "".join(_mx_word_ptx(j) for j in range(4)) + "}")
_MX_OPERAND_CONSTRAINTS = tl.constexpr("=r," * 16 + "r," * 4 + ",".join(["r"] * 16))


@triton.jit
def _operand_order(raw, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``raw (ROWS * C, 64)``: each row's 64-deep K chunks as repacked (position ``16t + 4j + 2h + b``) ->
    ``(ROWS, BLOCK_K)`` with ``k = 64c + 16j + 8h + 2t + b``: a relabelling, which the compiler resolves to the
    registers that the MMA operand's thread ``t`` holds (no data moves)."""
    chunks: tl.constexpr = BLOCK_K // 64
    return tl.reshape(tl.permute(tl.reshape(raw, (ROWS, chunks, 4, 4, 2, 2)), (0, 1, 3, 4, 2, 5)), (ROWS, BLOCK_K))


@triton.jit
def _mx_tile_interpreted(w_base, scale_base, n0, n_end, k0, k_end, stride_sk, stride_sn, stride_wn, dtype: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """What the PTX of :func:`_swapped_dot` computes, for Triton's interpreter (no PTX there): each value's code
    bits gathered from its word of the repacked layout (``repack.MX_CODE_BITS``), decoded in fp32."""
    n = n0 + tl.arange(0, BLOCK_N)
    k = k0 + tl.arange(0, BLOCK_K)
    pair = (n // 16) * 8 + n % 8
    r = (n // 8) % 2
    c, j, kh, t, b = k // 64, (k // 16) % 4, (k // 8) % 2, (k // 2) % 4, k % 2
    ok = (n < n_end)[:, None] & (c * 64 < k_end)[None, :]
    at = w_base + pair[:, None] * stride_wn + (64 * c + 16 * t + 4 * j)[None, :]
    word = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int64)
    for i in tl.static_range(4):
        word = word | (tl.load(at + i, mask=ok, other=0).to(tl.int64) << (8 * i))
    which = 2 * r[:, None] + kh[None, :]
    half = 16 * b[None, :]
    sign = tl.where(which == 3, 11, 15 - 3 * which) + half
    e_hi = tl.where(which == 3, 14, 8 - 3 * which) + half
    mantissa = tl.where(which == 3, 10, 6 - 3 * which) + half
    exponent = 2 * ((word >> e_hi) & 1) + ((word >> (e_hi - 1)) & 1)
    m = ((word >> mantissa) & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * m, tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    value = tl.where(((word >> sign) & 1) == 1, -magnitude, magnitude)
    scale_word = tl.load(scale_base + c[None, :] * stride_sk + pair[:, None] * stride_sn, mask=ok, other=0)
    scale = _e8m0((scale_word.to(tl.int64) >> (8 * (2 * (j[None, :] // 2) + r[:, None]))) & 255)
    return (value * scale).to(dtype)


@triton.jit
def _swapped_dot(acc_t, a_rows, row_ok, w_ptr, scale_ptr, expert, k0, k_end, n0, n_end, stride_we, stride_wn,
                 stride_se, stride_sk, stride_sn, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc_t (BLOCK_N, M) + W[expert][k0 : k0 + BLOCK_K, n0 : n0 + BLOCK_N].T @ A[:, k0 : k0 + BLOCK_K].T`` with
    ``W`` repacked (:mod:`~nxd_moe.triton_kernels.repack`; ``FORMAT`` 4 MxFP4, 5 FP8 per channel, 6 FP8 128x128
    blocks): the weight's columns are the MMA's rows and the dequantized weight its register operand, each thread
    loading 16 contiguous bytes per row and K chunk. Columns from ``n_end`` and K from ``k_end`` count as zero.
    Dequantization as :func:`_quantized_dot` (MxFP4: exact bf16 products; FP8: fp32 product, one rounding)."""
    chunks: tl.constexpr = BLOCK_K // 64
    chunk = k0 // 64 + tl.arange(0, chunks)
    chunk_ok = chunk * 64 < k_end
    w_base = w_ptr + expert * stride_we
    scale_base = scale_ptr + expert * stride_se
    ks = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows[None, :] + ks[:, None], mask=row_ok[None, :] & (ks < k_end)[:, None], other=0.0)
    if FORMAT == 4:
        if INTERPRET:
            w = _mx_tile_interpreted(w_base, scale_base, n0, n_end, k0, k_end, stride_sk, stride_sn, stride_wn,
                                     a.dtype, BLOCK_N, BLOCK_K)
        else:
            HALF: tl.constexpr = BLOCK_N // 2
            pair = n0 // 2 + tl.arange(0, HALF)
            ok = (pair < n_end // 2)[:, None] & chunk_ok[None, :]
            at = tl.multiple_of(tl.reshape(pair[:, None] * stride_wn + chunk[None, :] * 64, (HALF * chunks,)), 16)
            raw = tl.load(w_base + at[:, None] + tl.arange(0, 64)[None, :],
                          mask=tl.reshape(ok, (HALF * chunks,))[:, None], other=0)
            words = tl.load(scale_base + chunk[None, :] * stride_sk + pair[:, None] * stride_sn, mask=ok, other=0)
            words = tl.reshape(tl.broadcast_to(words[:, :, None], (HALF, chunks, 64)), (HALF, BLOCK_K))
            rows_n, rows_n8 = tl.inline_asm_elementwise(
                asm=_MX_OPERAND_PTX, constraints=_MX_OPERAND_CONSTRAINTS, args=[_operand_order(raw, HALF, BLOCK_K),
                                                                                words],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=16)
            w = tl.permute(tl.reshape(tl.join(rows_n, rows_n8), (BLOCK_N // 16, 8, BLOCK_K, 2)), (0, 3, 1, 2))
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(a.dtype)
    else:
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_end
        at = tl.multiple_of(tl.reshape(cols[:, None] * stride_wn + chunk[None, :] * 64, (BLOCK_N * chunks,)), 16)
        ok = tl.reshape(col_ok[:, None] & chunk_ok[None, :], (BLOCK_N * chunks,))
        raw = tl.load(w_base + at[:, None] + tl.arange(0, 64)[None, :], mask=ok[:, None], other=0)
        q = _operand_order(raw, BLOCK_N, BLOCK_K).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if FORMAT == 5:
            scale = tl.load(scale_base + cols * stride_sn, mask=col_ok, other=0.0)
        else:  # the K tile lies inside one 128-row block (BLOCK_K divides 128)
            scale = tl.load(scale_base + (k0 // 128) * stride_sk + (cols // 128) * stride_sn, mask=col_ok, other=0.0)
        w = (q * scale[:, None]).to(a.dtype)
    return tile_dot(w, a, acc_t, PRECISION, INTERPRET)


@triton.jit
def _clamp(x, lower, upper, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    # where-based so that NaN stays NaN (a hardware min/max would return the other operand).
    if HAS_LOWER:
        x = tl.where(x < lower, lower, x)
    if HAS_UPPER:
        x = tl.where(x > upper, upper, x)
    return x


@triton.jit
def _tile_rows(tile, row_token_ptr, tile_expert_ptr, row_count, BLOCK_M: tl.constexpr, DIRECT_ROWS: tl.constexpr):
    """``(rows, token, row_ok, expert)`` of one tile. ``DIRECT_ROWS``: row ``r`` is token ``r`` (``r < row_count``)
    of expert 0 -- a dense MLP every token goes through (the shared expert); else both come from the layout."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if DIRECT_ROWS:
        token = tl.where(rows < row_count, rows, -1).to(tl.int64)
        expert = tile * 0
    else:
        token = tl.load(row_token_ptr + rows)
        expert = tl.load(tile_expert_ptr + tile)
    row_ok = token >= 0
    return rows, tl.where(row_ok, token, 0), row_ok, expert.to(tl.int64)


@triton.jit
def _gate_up_sums(
    token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, k_begin, k_end, inter,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
    GLU: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr,
):
    """The fp32 gate and up sums ``(BLOCK_M, BLOCK_N)`` of rows ``token`` and column slice ``column`` over the
    hidden rows ``k_begin .. k_end`` (``k_begin`` a multiple of ``BLOCK_K``; the whole of ``H`` unless split along
    K). TMA loads only for the whole of ``H``: past ``k_end`` the copy engine would read the next slice. The up
    half of a GLU weight is read from ``w_up_ptr`` (same strides as ``w_ptr``: the second half of ``gate_up_proj``,
    or a separate up projection) on the pointer path, at columns ``+ inter`` on the TMA and quantized paths; with
    ``GATE_UP_INTERLEAVED`` both come from ``w_ptr`` (or ``w_desc``), see :func:`_interleaved_gate_up_sums`."""
    if GATE_UP_INTERLEAVED:
        tl.static_assert(FORMAT == 0, "interleaved gate/up columns are read from unquantized weights only")
        acc, acc_up = _interleaved_gate_up_sums(token, row_ok, expert, column, x_ptr, w_ptr, w_desc, k_begin, k_end,
                                                inter, stride_xt, stride_we, stride_wk, stride_wn, PRECISION,
                                                INTERPRET, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc, acc_up = _separate_gate_up_sums(token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_desc,
                                             scale_ptr, k_begin, k_end, inter, stride_xt, stride_we, stride_wk,
                                             stride_wn, stride_se, stride_sk, stride_sn, GLU, PRECISION, INTERPRET,
                                             TMA, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc, acc_up


@triton.jit
def _separate_gate_up_sums(
    token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, k_begin, k_end, inter,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
    GLU: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """:func:`_gate_up_sums` of weights whose gate and up columns are separate runs."""
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = k_begin + tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    w_offsets = expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_col = column * BLOCK_N
    steps = tl.cdiv(k_end - k_begin, BLOCK_K)
    if FORMAT >= 4:  # repacked weights: the swapped product, (columns, rows), transposed once at the end
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        a_rows = x_ptr + token * stride_xt
        for k in range(0, steps):
            acc_t = _swapped_dot(acc_t, a_rows, row_ok, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K, k_end,
                                 first_col, inter, stride_we, stride_wn, stride_se, stride_sk, stride_sn, FORMAT,
                                 BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
            if GLU:
                acc_up_t = _swapped_dot(acc_up_t, a_rows, row_ok, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K,
                                        k_end, inter + first_col, 2 * inter, stride_we, stride_wn, stride_se,
                                        stride_sk, stride_sn, FORMAT, BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
        acc = tl.trans(acc_t)
        acc_up = tl.trans(acc_up_t)
    else:
        for k in range(0, steps):
            if FORMAT != 0:
                a_rows = x_ptr + token * stride_xt
                acc = _quantized_dot(a_rows, row_ok, acc, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K, k_end,
                                     cols, col_ok, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                                     FORMAT, BLOCK_K, PRECISION, INTERPRET)
                if GLU:
                    acc_up = _quantized_dot(a_rows, row_ok, acc_up, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K,
                                            k_end, cols + inter, col_ok, stride_we, stride_wk, stride_wn, stride_se,
                                            stride_sk, stride_sn, FORMAT, BLOCK_K, PRECISION, INTERPRET)
            else:
                k_ok = ks < k_end - k * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                # The copy engine zero-fills past H; gate columns past I read up columns, which are never stored.
                if TMA:
                    w = w_desc.load([expert.to(tl.int32), k * BLOCK_K, first_col]).reshape(BLOCK_K, BLOCK_N)
                    if GLU:
                        w_up = w_desc.load([expert.to(tl.int32), k * BLOCK_K, first_col + inter]).reshape(BLOCK_K,
                                                                                                           BLOCK_N)
                else:
                    w = tl.load(w_ptr + w_offsets, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    if GLU:
                        w_up = tl.load(w_up_ptr + w_offsets, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tile_dot(a, w, acc, PRECISION, INTERPRET)
                if GLU:
                    acc_up = tile_dot(a, w_up, acc_up, PRECISION, INTERPRET)
            a_ptrs += BLOCK_K
            w_offsets += BLOCK_K * stride_wk
    return acc, acc_up


@triton.jit
def _interleaved_gate_up_sums(
    token, row_ok, expert, column, x_ptr, w_ptr, w_desc, k_begin, k_end, inter,
    stride_xt, stride_we, stride_wk, stride_wn,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """:func:`_gate_up_sums` of weights whose gate and up columns alternate (``g0, u0, g1, u1, ...``, GPT-OSS's
    stored order): gate/up columns ``c .. c + BLOCK_N`` are the ``2 * BLOCK_N`` adjacent stored columns from
    ``2c``, read whole -- one TMA box or vectorised rows, instead of two loads of every other column -- into one
    ``(BLOCK_M, 2 * BLOCK_N)`` product, whose even and odd columns are then the gate and up sums."""
    first_pair_col = 2 * column * BLOCK_N
    pair_cols = first_pair_col + tl.arange(0, 2 * BLOCK_N)
    pair_ok = pair_cols < 2 * inter
    ks = k_begin + tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    w_offsets = expert * stride_we + ks[:, None] * stride_wk + pair_cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_end - k_begin, BLOCK_K)):
        k_ok = ks < k_end - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:  # the copy engine zero-fills past H and past 2I
            w = w_desc.load([expert.to(tl.int32), k * BLOCK_K, first_pair_col]).reshape(BLOCK_K, 2 * BLOCK_N)
        else:
            w = tl.load(w_ptr + w_offsets, mask=k_ok[:, None] & pair_ok[None, :], other=0.0)
        acc = tile_dot(a, w, acc, PRECISION, INTERPRET)
        a_ptrs += BLOCK_K
        w_offsets += BLOCK_K * stride_wk
    return tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))


@triton.jit
def gate_up_tile(
    tile, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, bias_ptr, affinity_ptr, out_ptr,
    row_token_ptr, tile_expert_ptr, row_count,
    hidden, inter, inter_actual, num_experts,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DIRECT_ROWS: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr = False,
):
    """One ``BLOCK_M x BLOCK_N`` tile of the activated rows (see :func:`gate_up_projection`; weight halves:
    :func:`_gate_up_sums`)."""
    rows, token, row_ok, expert = _tile_rows(tile, row_token_ptr, tile_expert_ptr, row_count, BLOCK_M, DIRECT_ROWS)
    acc, acc_up = _gate_up_sums(token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, 0, hidden,
                                inter, stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                                GLU, PRECISION, INTERPRET, TMA, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K,
                                GATE_UP_INTERLEAVED)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    out = gate_up_epilogue(acc, acc_up, token, row_ok, expert, cols, col_ok, bias_ptr, affinity_ptr, inter,
                            inter_actual, num_experts, stride_be, scaling, act_bias, gate_lower, gate_upper,
                            up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER, GATE_UPPER,
                            UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, GATE_UP_INTERLEAVED)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gate_up_epilogue(
    acc, acc_up, token, row_ok, expert, cols, col_ok, bias_ptr, affinity_ptr, inter, inter_actual, num_experts,
    stride_be, scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr = False,
):
    """The activated fp32 tile from the gate (and up) accumulators of rows ``token (M,)`` (``row_ok``: real rows)
    and columns ``cols (N,)`` of ``expert``: affinity pre-scaling, bias, clamps, GLU / SwiGLU, padded columns
    zeroed (see :func:`gate_up_projection`). ``GATE_UP_INTERLEAVED``: the bias holds ``g0, u0, g1, u1, ...``."""
    if PRESCALE:
        scale = tl.load(affinity_ptr + token * num_experts + expert, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        acc_up = acc_up * scale[:, None]
    if HAS_BIAS:
        gate_bias = bias_ptr + expert * stride_be + (2 * cols if GATE_UP_INTERLEAVED else cols)
        acc += tl.load(gate_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            up_bias = gate_bias + (1 if GATE_UP_INTERLEAVED else inter)
            acc_up += tl.load(up_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        gate = _clamp(acc, gate_lower, gate_upper, GATE_LOWER, GATE_UPPER)
        up = _clamp(acc_up, up_lower, up_upper, UP_LOWER, UP_UPPER)
        out = _activation(gate * scaling, ACT)
        if SWIGLU:
            out = gate * out
        out = out * (up + act_bias)
    else:
        out = _activation(acc, ACT)
    if MASK_PADDED_COLUMNS:
        out = tl.where((cols < inter_actual)[None, :], out, 0.0)
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, affinity_ptr, out_ptr,
    row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    hidden, inter, inter_actual, num_experts,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
):
    tile, column = tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if tile < 0:
        return
    w_up_ptr = w_ptr + inter * stride_wn  # interleaved weights read both halves from w_ptr
    gate_up_tile(tile, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, bias_ptr, affinity_ptr,
                  out_ptr, row_token_ptr, tile_expert_ptr, 0, hidden, inter, inter_actual, num_experts,
                  stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or,
                  scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS,
                  PRESCALE, GATE_LOWER, GATE_UPPER, UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, PRECISION, INTERPRET,
                  TMA, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, False, GATE_UP_INTERLEAVED)


@triton.jit
def _gate_up_partial_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, row_token_ptr, tile_expert_ptr, num_tiles_ptr, hidden, inter, k_per_split,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_os, stride_or,
    GLU: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
):
    """Split ``program_id(1)``'s fp32 gate (columns ``0 .. I``) and up (``I .. 2I``) sums over its slice of ``H``,
    before bias and activation (which need the whole sum: :func:`_gate_up_reduce_kernel`)."""
    tile, column = tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if tile < 0:
        return
    split = tl.program_id(1)
    rows, token, row_ok, expert = _tile_rows(tile, row_token_ptr, tile_expert_ptr, 0, BLOCK_M, False)
    k_begin = split * k_per_split
    w_up_ptr = w_ptr + inter * stride_wn  # interleaved weights read both halves from w_ptr
    k_end = tl.minimum(k_begin + k_per_split, hidden)
    acc, acc_up = _gate_up_sums(token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_ptr, scale_ptr, k_begin,
                                k_end, inter, stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk,
                                stride_sn, GLU, PRECISION, INTERPRET, False, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K,
                                GATE_UP_INTERLEAVED)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    at = out_ptr + split * stride_os + rows[:, None] * stride_or + cols[None, :]
    ok = row_ok[:, None] & (cols < inter)[None, :]
    tl.store(at, acc, mask=ok)
    if GLU:
        tl.store(at + inter, acc_up, mask=ok)


@triton.jit
def _gate_up_reduce_kernel(
    partial_ptr, bias_ptr, affinity_ptr, out_ptr, row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    inter, inter_actual, num_experts, num_splits, stride_ps, stride_pr, stride_be, stride_or,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The split-K partials of one tile's column slice summed in split order (no atomics: the same bits on every
    run), then the activation epilogue of the unsplit kernel. Padding rows are neither read nor written."""
    tile, column = tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(inter, BLOCK_N), 1)
    if tile < 0:
        return
    rows, token, row_ok, expert = _tile_rows(tile, row_token_ptr, tile_expert_ptr, 0, BLOCK_M, False)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ok = row_ok[:, None] & col_ok[None, :]
    at = partial_ptr + rows[:, None] * stride_pr + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, num_splits):
        acc += tl.load(at + s * stride_ps, mask=ok, other=0.0)
        if GLU:
            acc_up += tl.load(at + s * stride_ps + inter, mask=ok, other=0.0)
    out = gate_up_epilogue(acc, acc_up, token, row_ok, expert, cols, col_ok, bias_ptr, affinity_ptr, inter,
                            inter_actual, num_experts, stride_be, scaling, act_bias, gate_lower, gate_upper,
                            up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER, GATE_UPPER,
                            UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, GATE_UP_INTERLEAVED)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def down_tile(
    tile, column, split, h_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, out_ptr,
    row_token_ptr, tile_expert_ptr, row_count, inter, hidden, k_per_split,
    stride_hr, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_os, stride_or,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT_ROWS: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of split ``split``'s partial sums (see :func:`down_projection`)."""
    rows, _, row_ok, expert = _tile_rows(tile, row_token_ptr, tile_expert_ptr, row_count, BLOCK_M, DIRECT_ROWS)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, inter)
    ks = k_begin + tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hr + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FORMAT >= 4:  # repacked weights: the swapped product (see gate_up_tile)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, tl.cdiv(k_end - k_begin, BLOCK_K)):
            acc_t = _swapped_dot(acc_t, h_ptr + rows * stride_hr, row_ok, w_ptr, scale_ptr, expert,
                                 k_begin + k * BLOCK_K, k_end, column * BLOCK_N, hidden, stride_we, stride_wn,
                                 stride_se, stride_sk, stride_sn, FORMAT, BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
        acc = tl.trans(acc_t)
    else:
        for k in range(0, tl.cdiv(k_end - k_begin, BLOCK_K)):
            if FORMAT != 0:
                acc = _quantized_dot(h_ptr + rows * stride_hr, row_ok, acc, w_ptr, scale_ptr, expert,
                                     k_begin + k * BLOCK_K, k_end, cols, col_ok, stride_we, stride_wk, stride_wn,
                                     stride_se, stride_sk, stride_sn, FORMAT, BLOCK_K, PRECISION, INTERPRET)
            else:
                k_ok = ks < k_end - k * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if TMA:  # unsplit only: past I the copy engine zero-fills
                    w = w_desc.load([expert.to(tl.int32), k_begin + k * BLOCK_K, column * BLOCK_N]).reshape(BLOCK_K,
                                                                                                             BLOCK_N)
                else:
                    w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tile_dot(a, w, acc, PRECISION, INTERPRET)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + split * stride_os + rows[:, None] * stride_or + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, out_ptr,
    row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    inter, hidden, k_per_split,
    stride_hr, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_os, stride_or,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tile, column = tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if tile < 0:
        return
    down_tile(tile, column, tl.program_id(1), h_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, out_ptr, row_token_ptr,
               tile_expert_ptr, 0, inter, hidden, k_per_split, stride_hr, stride_we, stride_wk, stride_wn, stride_se,
               stride_sk, stride_sn, stride_be, stride_os, stride_or, HAS_BIAS, PRECISION, INTERPRET, TMA, FORMAT,
               BLOCK_M, BLOCK_N, BLOCK_K, False)


def _weight_descriptor(weight: torch.Tensor, block_k: int, block_n: int, wanted: bool):
    """A bulk-copy (TMA) descriptor of ``weight (E, K, N)`` for ``(1, block_k, block_n)`` tiles, when asked for
    and possible (Hopper or newer, 16-byte aligned rows); else None and the kernel loads through pointers."""
    if not wanted or weight.device.type != "cuda" or capability(weight.device)[0] < 9:
        return None
    if weight.stride(-1) != 1 or any(s * weight.element_size() % 16 for s in weight.stride()[:-1]) \
            or weight.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [1, block_k, block_n])


# Columns one program of the split-K gate/up reduction sums and activates (an elementwise pass over (R, I)).
REDUCE_BLOCK_N = 128

# QuantizationFormat.name -> the kernels' FORMAT code (see _quantized_dot).
FORMAT_CODES = {"bf16": 0, "fp8": 1, "fp8_block": 2, "mxfp4": 3}


def stored_operands(weight, block_k: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], int, int]:
    """``(stored weight, scale, scale strides, FORMAT code, K tile)`` of a plain tensor, a ``QuantizedWeight`` or a
    :class:`~nxd_moe.triton_kernels.repack.RepackedWeight` (its tensors as ``(E, K', rows)`` / ``(E, K'/64, rows)``
    views, so that the kernels' ``stride_wn`` / ``stride_sn`` step along rows); the K tile is adjusted to the
    format: inside one 128-row FP8 block; at least 32 rows of MxFP4 (16 per nibble plane, the smallest 16-bit dot);
    whole 64-deep chunks of a repacked weight."""
    if isinstance(weight, torch.Tensor):
        return weight, weight, (0, 0, 0), 0, block_k
    if isinstance(weight, RepackedWeight):
        block_k = max(64, block_k // 64 * 64)
        block_k = min(block_k, 128) if weight.code == 6 else block_k
        scale = weight.scale.transpose(1, 2) if weight.code == 4 else weight.scale
        return weight.weight.transpose(1, 2), scale, tuple(scale.stride()), weight.code, block_k
    fmt = FORMAT_CODES[weight.format.name]
    block_k = min(block_k, 128) if fmt == 2 else max(block_k, 32) if fmt == 3 else block_k
    return weight.weight, weight.scale, tuple(weight.scale.stride()), fmt, block_k


def launch_options(config: dict, dtype: torch.dtype) -> dict:
    # fp32 models get fp32 products (tf32 would cost them ~1e-3 relative error); 16-bit inputs ignore it.
    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"],
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "INTERPRET": interpreting(),
            "GROUP_M": config.get("GROUP_M", 8)}


def epilogue_arguments(activation: ExpertActivation, inter: int, has_bias: bool, prescale: bool) -> tuple[tuple, dict]:
    """The gate/up epilogue for ``activation`` as ``(inter_actual, scaling, act_bias, gate_lower, gate_upper,
    up_lower, up_upper)`` and the matching constexprs of :func:`gate_up_tile` (``GATE_UP_INTERLEAVED``: the
    weight's and bias's gate/up columns alternate, GPT-OSS's stored order)."""
    if activation.hidden_act not in ACTIVATIONS:
        raise ValueError(f"the triton backend supports hidden_act in {sorted(ACTIVATIONS)}, got "
                         f"{activation.hidden_act!r}")
    actual = activation.intermediate_size_actual
    limits = (activation.gate_lower, activation.gate_upper, activation.up_lower, activation.up_upper)
    scalars = (inter if actual is None else actual, float(activation.scaling_factor), float(activation.act_bias),
               *(0.0 if v is None else float(v) for v in limits))
    constexprs = dict(ACT=ACTIVATIONS[activation.hidden_act], GLU=activation.glu_mlp,
                      SWIGLU=activation.glu_type is GLUType.SWIGLU, HAS_BIAS=has_bias, PRESCALE=prescale,
                      GATE_LOWER=limits[0] is not None, GATE_UPPER=limits[1] is not None,
                      UP_LOWER=limits[2] is not None, UP_UPPER=limits[3] is not None,
                      MASK_PADDED_COLUMNS=actual is not None and actual < inter,
                      GATE_UP_INTERLEAVED=activation.glu_mlp and activation.gate_up_interleaved)
    return scalars, constexprs


def split_k_slices(depth: int, split: int, block_k: int) -> tuple[int, int]:
    """``(K rows per split, number of splits)`` for a sum of ``depth`` terms asked to split ``split`` ways: whole
    ``block_k`` tiles per split (so an FP8 block's K tile never straddles two splits), no empty split."""
    if type(split) is not int or split < 1:
        raise ValueError(f"SPLIT_K must be an int >= 1, got {split!r}")
    per_split = triton.cdiv(triton.cdiv(depth, split), block_k) * block_k
    return per_split, triton.cdiv(depth, per_split)


def gate_up_projection(hidden_states: torch.Tensor, layout: TileLayout, gate_up_proj: torch.Tensor,
                       gate_up_bias: torch.Tensor | None, activation: ExpertActivation,
                       affinities: torch.Tensor | None, config: dict) -> torch.Tensor:
    """``hidden_states (T, H)`` -> ``(R, I)`` activated rows in tile order (padding rows unwritten).

    ``gate_up_proj (E, H, 2I)`` (``(E, H, I)`` without GLU; any strides), a tensor or a
    :class:`~nxd_moe.quantization.weight.QuantizedWeight` (its stored bytes are read, dequantized in registers);
    ``affinities (T, E)`` when the expert input is pre-scaled by its affinity, else None.
    ``config["SPLIT_K"]`` (default 1) > 1 splits ``H`` over that many programs per tile and column slice: fp32
    partial sums ``(S, R, 2I)``, then one more launch adds them in split order and applies the activation --
    bitwise reproducible (more programs for a decode at small ``T``; no rule turns it on, see launch_configs).
    """
    num_experts, hidden, width = gate_up_proj.shape
    inter = width // 2 if activation.glu_mlp else width
    scalars, constexprs = epilogue_arguments(activation, inter, gate_up_bias is not None, affinities is not None)
    block_m, block_n = layout.block_m, config["BLOCK_N"]
    out = torch.empty(layout.num_rows, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    bias = gate_up_bias if gate_up_bias is not None else hidden_states
    grid = ((layout.num_rows // block_m) * triton.cdiv(inter, block_n),)
    stored, scale, scale_strides, fmt, block_k = stored_operands(gate_up_proj, config["BLOCK_K"])
    k_per_split, split = split_k_slices(hidden, config.get("SPLIT_K", 1), block_k)
    interleaved = constexprs["GATE_UP_INTERLEAVED"]
    if interleaved and fmt != 0:
        raise ValueError("gate_up_projection: interleaved gate/up columns are read from unquantized weights only, "
                         f"got a {type(gate_up_proj).__name__}")
    affinity = affinities if affinities is not None else hidden_states
    options = launch_options(config, hidden_states.dtype)
    if split > 1:
        partials = torch.empty(split, layout.num_rows, width, dtype=torch.float32, device=hidden_states.device)
        _gate_up_partial_kernel[(grid[0], split)](
            hidden_states, stored, scale, partials, layout.row_token, layout.tile_expert, layout.num_tiles, hidden,
            inter, k_per_split, hidden_states.stride(0), *stored.stride(), *scale_strides, partials.stride(0),
            partials.stride(1), GLU=constexprs["GLU"], FORMAT=fmt, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, GATE_UP_INTERLEAVED=interleaved, **options)
        _gate_up_reduce_kernel[((layout.num_rows // block_m) * triton.cdiv(inter, REDUCE_BLOCK_N),)](
            partials, bias, affinity, out, layout.row_token, layout.tile_expert, layout.num_tiles, inter, scalars[0],
            num_experts, split, partials.stride(0), partials.stride(1), bias.stride(0), out.stride(0), *scalars[1:],
            BLOCK_M=block_m, BLOCK_N=REDUCE_BLOCK_N, **constexprs)
        return out
    # Interleaved weights are read as boxes of 2 * BLOCK_N adjacent columns (a TMA box side is at most 256).
    box_n = 2 * block_n if interleaved else block_n
    descriptor = _weight_descriptor(stored, block_k, box_n, config.get("TMA", False) and fmt == 0 and box_n <= 256)
    _gate_up_kernel[grid](
        hidden_states, stored, stored if descriptor is None else descriptor, scale, bias, affinity, out,
        layout.row_token, layout.tile_expert, layout.num_tiles,
        hidden, inter, scalars[0], num_experts,
        hidden_states.stride(0), *stored.stride(), *scale_strides, bias.stride(0), out.stride(0), *scalars[1:],
        TMA=descriptor is not None, FORMAT=fmt, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **constexprs,
        **options)
    return out


def down_projection(activated: torch.Tensor, layout: TileLayout, down_proj: torch.Tensor,
                    down_bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """``activated (R, I)`` -> ``(S, R, H)``: ``S = config["SPLIT_K"]`` partial sums over slices of ``I``
    (fp32 when ``S > 1``, else the input dtype). Padding rows are unwritten."""
    num_experts, inter, hidden = down_proj.shape
    split = config["SPLIT_K"]
    stored, scale, scale_strides, fmt, block_k = stored_operands(down_proj, config["BLOCK_K"])
    block_m, block_n = layout.block_m, config["BLOCK_N"]
    k_per_split, split = split_k_slices(inter, split, block_k)
    dtype = activated.dtype if split == 1 else torch.float32
    out = torch.empty(split, layout.num_rows, hidden, dtype=dtype, device=activated.device)
    bias = down_bias if down_bias is not None else activated
    grid = ((layout.num_rows // block_m) * triton.cdiv(hidden, block_n), split)
    descriptor = _weight_descriptor(stored, block_k, block_n, config.get("TMA", False) and split == 1 and fmt == 0)
    _down_kernel[grid](
        activated, stored, stored if descriptor is None else descriptor, scale, bias, out,
        layout.row_token, layout.tile_expert, layout.num_tiles,
        inter, hidden, k_per_split, activated.stride(0), *stored.stride(), *scale_strides, bias.stride(0),
        out.stride(0), out.stride(1), HAS_BIAS=down_bias is not None, TMA=descriptor is not None, FORMAT=fmt,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k,
        **launch_options(config, activated.dtype))
    return out
