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
  accumulated side by side so the activation sees both.
- :func:`down_projection`: ``act @ down_proj[e]`` plus bias, optionally split along ``K`` into fp32 partial sums
  (summed, in a fixed order, by the combine) so that decode puts enough programs on the GPU.

Accumulation is fp32; results are rounded once.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.config import GLUType
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
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    # Triton's interpreter (3.6 to 3.9) returns garbage for 16-bit dots; under it the operands go in as fp32.
    if INTERPRET and a.dtype != tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_and_column(pid, num_tiles_ptr, num_n, GROUP_M: tl.constexpr):
    """Program -> (tile, column slice), ``GROUP_M`` tiles at a time: the group's gathered rows and each column
    slice of the weights are read from HBM once and reused from L2 by the whole group (tile-major order would
    re-read an expert's weights once per tile). ``tile = -1``: past the device-side tile count, nothing to do."""
    return _grouped_order(pid, tl.load(num_tiles_ptr), num_n, GROUP_M)


@triton.jit
def _grouped_order(pid, num_tiles, num_n, GROUP_M: tl.constexpr):
    """:func:`_tile_and_column` for a tile count already loaded (work item ``pid`` of a persistent program)."""
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
            acc = _dot(a, w, acc, PRECISION, INTERPRET)
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
    return _dot(a, (w.to(tl.float32) * scale[None, :]).to(a.dtype), acc, PRECISION, INTERPRET)


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
def _gate_up_tile(
    tile, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, bias_ptr, affinity_ptr, out_ptr,
    row_token_ptr, tile_expert_ptr, row_count,
    hidden, inter, inter_actual, num_experts,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DIRECT_ROWS: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of the activated rows (see :func:`gate_up_projection`). The up half of a GLU
    weight is read from ``w_up_ptr`` (same strides as ``w_ptr``: the second half of ``gate_up_proj``, or a
    separate up projection) on the pointer path, at columns ``+ inter`` on the TMA and quantized paths."""
    rows, token, row_ok, expert = _tile_rows(tile, row_token_ptr, tile_expert_ptr, row_count, BLOCK_M, DIRECT_ROWS)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    w_offsets = expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_col = column * BLOCK_N
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        if FORMAT != 0:
            a_rows = x_ptr + token * stride_xt
            acc = _quantized_dot(a_rows, row_ok, acc, w_ptr, scale_ptr, expert, k * BLOCK_K, hidden, cols, col_ok,
                                 stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, FORMAT, BLOCK_K,
                                 PRECISION, INTERPRET)
            if GLU:
                acc_up = _quantized_dot(a_rows, row_ok, acc_up, w_ptr, scale_ptr, expert, k * BLOCK_K, hidden,
                                        cols + inter, col_ok, stride_we, stride_wk, stride_wn, stride_se, stride_sk,
                                        stride_sn, FORMAT, BLOCK_K, PRECISION, INTERPRET)
        else:
            k_ok = ks < hidden - k * BLOCK_K
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
            acc = _dot(a, w, acc, PRECISION, INTERPRET)
            if GLU:
                acc_up = _dot(a, w_up, acc_up, PRECISION, INTERPRET)
        a_ptrs += BLOCK_K
        w_offsets += BLOCK_K * stride_wk
    out = _gate_up_epilogue(acc, acc_up, token, row_ok, expert, cols, col_ok, bias_ptr, affinity_ptr, inter,
                            inter_actual, num_experts, stride_be, scaling, act_bias, gate_lower, gate_upper,
                            up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER, GATE_UPPER,
                            UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_epilogue(
    acc, acc_up, token, row_ok, expert, cols, col_ok, bias_ptr, affinity_ptr, inter, inter_actual, num_experts,
    stride_be, scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr,
):
    """The activated fp32 tile from the gate (and up) accumulators of rows ``token (M,)`` (``row_ok``: real rows)
    and columns ``cols (N,)`` of ``expert``: affinity pre-scaling, bias, clamps, GLU / SwiGLU, padded columns
    zeroed (see :func:`gate_up_projection`)."""
    if PRESCALE:
        scale = tl.load(affinity_ptr + token * num_experts + expert, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        acc_up = acc_up * scale[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(bias_ptr + expert * stride_be + inter + cols, mask=col_ok,
                              other=0.0).to(tl.float32)[None, :]
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
):
    tile, column = _tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if tile < 0:
        return
    _gate_up_tile(tile, column, x_ptr, w_ptr, w_ptr + inter * stride_wn, w_desc, scale_ptr, bias_ptr, affinity_ptr,
                  out_ptr, row_token_ptr, tile_expert_ptr, 0, hidden, inter, inter_actual, num_experts,
                  stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or,
                  scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS,
                  PRESCALE, GATE_LOWER, GATE_UPPER, UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, PRECISION, INTERPRET,
                  TMA, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, False)


@triton.jit
def _down_tile(
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
    for k in range(0, tl.cdiv(k_end - k_begin, BLOCK_K)):
        if FORMAT != 0:
            acc = _quantized_dot(h_ptr + rows * stride_hr, row_ok, acc, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K,
                                 k_end, cols, col_ok, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                                 FORMAT, BLOCK_K, PRECISION, INTERPRET)
        else:
            k_ok = ks < k_end - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if TMA:  # unsplit only: past I the copy engine zero-fills
                w = w_desc.load([expert.to(tl.int32), k_begin + k * BLOCK_K, column * BLOCK_N]).reshape(BLOCK_K,
                                                                                                         BLOCK_N)
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, PRECISION, INTERPRET)
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
    tile, column = _tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if tile < 0:
        return
    _down_tile(tile, column, tl.program_id(1), h_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, out_ptr, row_token_ptr,
               tile_expert_ptr, 0, inter, hidden, k_per_split, stride_hr, stride_we, stride_wk, stride_wn, stride_se,
               stride_sk, stride_sn, stride_be, stride_os, stride_or, HAS_BIAS, PRECISION, INTERPRET, TMA, FORMAT,
               BLOCK_M, BLOCK_N, BLOCK_K, False)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _weight_descriptor(weight: torch.Tensor, block_k: int, block_n: int, wanted: bool):
    """A bulk-copy (TMA) descriptor of ``weight (E, K, N)`` for ``(1, block_k, block_n)`` tiles, when asked for
    and possible (Hopper or newer, 16-byte aligned rows); else None and the kernel loads through pointers."""
    if not wanted or weight.device.type != "cuda" or _capability(weight.device)[0] < 9:
        return None
    if weight.stride(-1) != 1 or any(s * weight.element_size() % 16 for s in weight.stride()[:-1]) \
            or weight.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [1, block_k, block_n])


# QuantizationFormat.name -> the kernels' FORMAT code (see _quantized_dot).
FORMAT_CODES = {"bf16": 0, "fp8": 1, "fp8_block": 2, "mxfp4": 3}


def _stored(weight, block_k: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], int, int]:
    """``(stored weight, scale, scale strides, FORMAT code, K tile)`` of a plain tensor or a ``QuantizedWeight``;
    the K tile is adjusted to the format: inside one 128-row FP8 block; at least 32 rows of MxFP4 (16 per nibble
    plane, the smallest 16-bit dot)."""
    if isinstance(weight, torch.Tensor):
        return weight, weight, (0, 0, 0), 0, block_k
    fmt = FORMAT_CODES[weight.format.name]
    block_k = min(block_k, 128) if fmt == 2 else max(block_k, 32) if fmt == 3 else block_k
    return weight.weight, weight.scale, tuple(weight.scale.stride()), fmt, block_k


def _launch_options(config: dict, dtype: torch.dtype) -> dict:
    # fp32 models get fp32 products (tf32 would cost them ~1e-3 relative error); 16-bit inputs ignore it.
    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"],
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "INTERPRET": os.environ.get("TRITON_INTERPRET") == "1",
            "GROUP_M": config.get("GROUP_M", 8)}


def epilogue_arguments(activation: ExpertActivation, inter: int, has_bias: bool, prescale: bool) -> tuple[tuple, dict]:
    """The gate/up epilogue for ``activation`` as ``(inter_actual, scaling, act_bias, gate_lower, gate_upper,
    up_lower, up_upper)`` and the matching constexprs of :func:`_gate_up_tile`."""
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
                      MASK_PADDED_COLUMNS=actual is not None and actual < inter)
    return scalars, constexprs


def gate_up_projection(hidden_states: torch.Tensor, layout: TileLayout, gate_up_proj: torch.Tensor,
                       gate_up_bias: torch.Tensor | None, activation: ExpertActivation,
                       affinities: torch.Tensor | None, config: dict) -> torch.Tensor:
    """``hidden_states (T, H)`` -> ``(R, I)`` activated rows in tile order (padding rows unwritten).

    ``gate_up_proj (E, H, 2I)`` (``(E, H, I)`` without GLU), a tensor or a
    :class:`~nxd_moe.quantization.weight.QuantizedWeight` (its stored bytes are read, dequantized in registers);
    ``affinities (T, E)`` when the expert input is pre-scaled by its affinity, else None.
    """
    num_experts, hidden, width = gate_up_proj.shape
    inter = width // 2 if activation.glu_mlp else width
    scalars, constexprs = epilogue_arguments(activation, inter, gate_up_bias is not None, affinities is not None)
    block_m, block_n = layout.block_m, config["BLOCK_N"]
    out = torch.empty(layout.num_rows, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    bias = gate_up_bias if gate_up_bias is not None else hidden_states
    grid = ((layout.num_rows // block_m) * triton.cdiv(inter, block_n),)
    stored, scale, scale_strides, fmt, block_k = _stored(gate_up_proj, config["BLOCK_K"])
    descriptor = _weight_descriptor(stored, block_k, block_n, config.get("TMA", False) and fmt == 0)
    _gate_up_kernel[grid](
        hidden_states, stored, stored if descriptor is None else descriptor, scale, bias,
        affinities if affinities is not None else hidden_states, out,
        layout.row_token, layout.tile_expert, layout.num_tiles,
        hidden, inter, scalars[0], num_experts,
        hidden_states.stride(0), *stored.stride(), *scale_strides, bias.stride(0), out.stride(0), *scalars[1:],
        TMA=descriptor is not None, FORMAT=fmt, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **constexprs,
        **_launch_options(config, hidden_states.dtype))
    return out


def down_projection(activated: torch.Tensor, layout: TileLayout, down_proj: torch.Tensor,
                    down_bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """``activated (R, I)`` -> ``(S, R, H)``: ``S = config["SPLIT_K"]`` partial sums over slices of ``I``
    (fp32 when ``S > 1``, else the input dtype). Padding rows are unwritten."""
    num_experts, inter, hidden = down_proj.shape
    split = config["SPLIT_K"]
    stored, scale, scale_strides, fmt, block_k = _stored(down_proj, config["BLOCK_K"])
    block_m, block_n = layout.block_m, config["BLOCK_N"]
    k_per_split = triton.cdiv(triton.cdiv(inter, split), block_k) * block_k
    split = triton.cdiv(inter, k_per_split)
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
        **_launch_options(config, activated.dtype))
    return out
