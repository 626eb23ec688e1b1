"""The ``@triton.jit`` tile math of the grouped GEMMs (:mod:`~nxd_moe.triton_kernels.grouped_gemm`,
:mod:`~nxd_moe.triton_kernels.prefill_gemm`, :mod:`~nxd_moe.triton_kernels.w8a8`): one K step's product of a
gathered activation tile and a weight tile read in its stored format, and the order in which programs take tiles.

- :func:`tile_dot`: ``acc + a @ b`` of two loaded tiles (under Triton's interpreter, 16-bit operands as fp32);
- :func:`tile_and_column` / :func:`grouped_order`: program (or work item) -> ``(tile, column slice)``, ``GROUP_M``
  tiles at a time;
- :func:`quantized_dot`: ``acc (M, N) + A (M, BLOCK_K) @ W[e] (BLOCK_K, N)`` with ``W`` as stored -- FP8 per
  channel, FP8 128x128 blocks, MxFP4 (E2M1 nibbles decoded by inline PTX, E8M0 group scales) -- dequantized in
  registers;
- :func:`swapped_dot`: ``acc_t (N, M) + W.T @ A.T`` with ``W`` repacked into the MMA operand order
  (:mod:`~nxd_moe.triton_kernels.repack`): the weight's columns are the MMA's rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def quantized_dot(a_rows, row_ok, acc, w_ptr, scale_ptr, expert, k0, k_end, cols, col_ok, stride_we, stride_wk,
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
    """What the PTX of :func:`swapped_dot` computes, for Triton's interpreter (no PTX there): each value's code
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
def swapped_dot(acc_t, a_rows, row_ok, w_ptr, scale_ptr, expert, k0, k_end, n0, n_end, stride_we, stride_wn,
                 stride_se, stride_sk, stride_sn, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc_t (BLOCK_N, M) + W[expert][k0 : k0 + BLOCK_K, n0 : n0 + BLOCK_N].T @ A[:, k0 : k0 + BLOCK_K].T`` with
    ``W`` repacked (:mod:`~nxd_moe.triton_kernels.repack`; ``FORMAT`` 4 MxFP4, 5 FP8 per channel, 6 FP8 128x128
    blocks): the weight's columns are the MMA's rows and the dequantized weight its register operand, each thread
    loading 16 contiguous bytes per row and K chunk. Columns from ``n_end`` and K from ``k_end`` count as zero.
    Dequantization as :func:`quantized_dot` (MxFP4: exact bf16 products; FP8: fp32 product, one rounding)."""
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
