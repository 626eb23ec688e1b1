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

Accumulation is fp32; results are rounded once. The products of one K step (plain, stored-quantized and repacked
weights) and the program order are :mod:`~nxd_moe.triton_kernels.tile_math`'s; this module holds the gate/up
epilogue, the kernels and their host launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.gpu_info import capability
from nxd_moe.moe_configs import GLUType
from nxd_moe.triton_kernels import interpreting
from nxd_moe.triton_kernels.repack import RepackedWeight
from nxd_moe.triton_kernels.routing_metadata import TileLayout
from nxd_moe.triton_kernels.tile_math import quantized_dot, swapped_dot, tile_and_column, tile_dot

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
def _clamp(x, lower, upper, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    # where-based so that NaN stays NaN (a hardware min/max would return the other operand).
    if HAS_LOWER:
        x = tl.where(x < lower, lower, x)
    if HAS_UPPER:
        x = tl.where(x > upper, upper, x)
    return x


@triton.jit
def tile_rows(tile, row_token_ptr, tile_expert_ptr, row_count, BLOCK_M: tl.constexpr, DIRECT_ROWS: tl.constexpr):
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
            acc_t = swapped_dot(acc_t, a_rows, row_ok, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K, k_end,
                                 first_col, inter, stride_we, stride_wn, stride_se, stride_sk, stride_sn, FORMAT,
                                 BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
            if GLU:
                acc_up_t = swapped_dot(acc_up_t, a_rows, row_ok, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K,
                                        k_end, inter + first_col, 2 * inter, stride_we, stride_wn, stride_se,
                                        stride_sk, stride_sn, FORMAT, BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
        acc = tl.trans(acc_t)
        acc_up = tl.trans(acc_up_t)
    else:
        for k in range(0, steps):
            if FORMAT != 0:
                a_rows = x_ptr + token * stride_xt
                acc = quantized_dot(a_rows, row_ok, acc, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K, k_end,
                                     cols, col_ok, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                                     FORMAT, BLOCK_K, PRECISION, INTERPRET)
                if GLU:
                    acc_up = quantized_dot(a_rows, row_ok, acc_up, w_ptr, scale_ptr, expert, k_begin + k * BLOCK_K,
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
    rows, token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, bias_ptr, affinity_ptr, out_ptr,
    hidden, inter, inter_actual, num_experts,
    stride_xt, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of the activated rows (see :func:`gate_up_projection`; weight halves:
    :func:`_gate_up_sums`): output rows ``rows (M,)``, their ``token (M,)`` (0 where not ``row_ok``) and ``expert``
    (a scalar) -- from :func:`tile_rows`, or found by the caller."""
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


# gate_up_tile's parameters, passed through one by one (Triton jit functions take no **kwargs).
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
    rows, token, row_ok, expert = tile_rows(tile, row_token_ptr, tile_expert_ptr, 0, BLOCK_M, False)
    gate_up_tile(rows, token, row_ok, expert, column, x_ptr, w_ptr, w_up_ptr, w_desc, scale_ptr, bias_ptr,
                 affinity_ptr, out_ptr, hidden, inter, inter_actual, num_experts, stride_xt, stride_we, stride_wk,
                 stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_or, scaling, act_bias, gate_lower,
                 gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER, GATE_UPPER,
                 UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS, PRECISION, INTERPRET, TMA, FORMAT, BLOCK_M, BLOCK_N,
                 BLOCK_K, GATE_UP_INTERLEAVED)


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
    rows, token, row_ok, expert = tile_rows(tile, row_token_ptr, tile_expert_ptr, 0, BLOCK_M, False)
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
    rows, token, row_ok, expert = tile_rows(tile, row_token_ptr, tile_expert_ptr, 0, BLOCK_M, False)
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
    rows, _, row_ok, expert = tile_rows(tile, row_token_ptr, tile_expert_ptr, row_count, BLOCK_M, DIRECT_ROWS)
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
            acc_t = swapped_dot(acc_t, h_ptr + rows * stride_hr, row_ok, w_ptr, scale_ptr, expert,
                                 k_begin + k * BLOCK_K, k_end, column * BLOCK_N, hidden, stride_we, stride_wn,
                                 stride_se, stride_sk, stride_sn, FORMAT, BLOCK_N, BLOCK_K, PRECISION, INTERPRET)
        acc = tl.trans(acc_t)
    else:
        for k in range(0, tl.cdiv(k_end - k_begin, BLOCK_K)):
            if FORMAT != 0:
                acc = quantized_dot(h_ptr + rows * stride_hr, row_ok, acc, w_ptr, scale_ptr, expert,
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

# QuantizationFormat.name -> the kernels' FORMAT code (see tile_math.quantized_dot).
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
