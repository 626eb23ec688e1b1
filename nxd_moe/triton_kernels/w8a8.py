"""FP8 x FP8 (W8A8) expert GEMMs: FP8 activations times FP8 weights on the tensor cores, scales in fp32.

For a layer with ``activation_quantization="fp8"`` (:mod:`nxd_moe.quantization.activations`) the triton backend
runs, over the same :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout` and combine as every other layer:

1. :func:`quantize_rows` -- the token rows ``(T, H)`` to float8_e4m3fn with one fp32 scale per row and group (one
   launch; each token once, not once per chosen expert);
2. gate/up -- each tile gathers its tokens' FP8 rows by id, ``tl.dot`` on FP8 operands (Hopper's FP8 MMA, twice
   the bf16 rate) into fp32; a scale that varies along K (per-group activations, 128x128 weight blocks) multiplies
   each K step's product (``acc += (a @ w) * a_scale * w_scale``, DeepSeek-V3's recipe), the others multiply the
   accumulator once in the epilogue. The epilogue then runs the activation function as in the bf16 kernel and
   QUANTIZES THE INTERMEDIATE ROWS FOR THE DOWN GEMM IN PLACE: when the activation group divides the column tile
   (128-column groups, the default with ``fp8_block`` weights) each program sees whole groups of its rows, takes
   their max, and writes FP8 values and scales -- the intermediate never exists in 16 bits. A group wider than
   the tile (per token: the whole row, the default with ``fp8`` weights) spans several programs, so the epilogue
   writes the activated rows in the layer's dtype and :func:`quantize_rows` quantizes them (one more launch).
   Either way the values quantized are the layer-dtype values the bf16 path would store (one rounding, then the
   quantization), as the torch backend's reference computes them;
3. down -- FP8 intermediate rows times FP8 weights the same way (optionally split along K into fp32 partial sums,
   summed by the combine).

FP8 weights of a W8A8 layer are stored K-major (``ExpertLinear(k_major=True)``): FP8 tensor-core products read
both operands K-major from shared memory (a weight stored N-major would be transposed in registers on every tile
and lose the pipelined load). Large tiles load them with the bulk copy engine (TMA) as ``(N, K)`` boxes.
Within a chain of FP8 MMAs Hopper accumulates with reduced precision; products are added into the fp32 accumulator
every ``BLOCK_K`` (<= 256) columns (``max_num_imprecise_acc``, or the per-step scale multiply).

Quantization is the one of :class:`~nxd_moe.quantization.activations.ActivationQuantization` bit for bit:
``scale = amax * fp32(1/448)`` (1 for an all-zero group), ``q = rn(clamp(x * rn(1 / scale)))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.gpu_info import capability
from nxd_moe.moe_configs import GLUType
from nxd_moe.quantization.activations import INV_FP8_MAX
from nxd_moe.triton_kernels import interpreting
from nxd_moe.triton_kernels.grouped_gemm import ACTIVATIONS, gate_up_epilogue
from nxd_moe.triton_kernels.launch_configs import (
    default_config,
    device_name,
    rule_multiprocessors,
    shape_key,
    tuned_table,
)
from nxd_moe.triton_kernels.routing_metadata import TileLayout
from nxd_moe.triton_kernels.tile_math import tile_and_column

# The smallest K of an FP8 tensor-core product (and of Triton's FP8 dot).
MIN_FP8_K = 32
FP8_BLOCK = 128  # rows and columns of an fp8_block weight scale
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)
# Elements one quantize_rows program holds at a time.
QUANTIZE_TILE = 4096
# The layer dtype the epilogue rounds to before quantizing (the value the bf16 path would store).
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _group_scale(amax):
    """``amax * fp32(1/448)``; 1 for an all-zero (or underflowing) group."""
    scale = amax * _INV_FP8_MAX
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def _e4m3(v, INTERPRET: tl.constexpr):
    """fp32 -> float8e4nv: clamped to +-448, rounded to nearest, ties to even (on a GPU the hardware conversion).
    Triton's interpreter (3.6, 3.7) converts wrongly (ties, overflow, NaN -> 384); there the E4M3 bits are built
    from the fp32 bits: 3 mantissa bits rounded half to even from 2**-6 up, multiples of 2**-9 below."""
    v = tl.where(v > 448.0, 448.0, v)  # where, not min/max: NaN stays NaN
    v = tl.where(v < -448.0, -448.0, v)
    if INTERPRET:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits & 0x7FFFFFFF) + 0x7FFFF + ((bits >> 20) & 1)
        normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
        magnitude = tl.abs(v)
        subnormal = ((magnitude * 512.0 + 12582912.0) - 12582912.0).to(tl.uint32)  # 1.5 * 2**23: rint
        code = tl.where(magnitude < 0.015625, subnormal, normal)
        code = tl.where(v != v, 0x7F, code) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize(v, scale, INTERPRET: tl.constexpr):
    """``v * (1 / scale)`` in E4M3: one IEEE division per scale, then one multiply per value."""
    return _e4m3(v * tl.math.div_rn(1.0, scale), INTERPRET)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_rows, group, stride_x, stride_q, stride_s,
                          INTERPRET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row block, group): the rows' max magnitude over the group's columns, then the FP8 values."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    row_ok = rows < num_rows
    rows = rows.to(tl.int64)
    x_rows = x_ptr + rows[:, None] * stride_x + g * group
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c in range(0, group, BLOCK_C):
        cols = c + tl.arange(0, BLOCK_C)
        v = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols < group)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    scale = _group_scale(amax)
    for c in range(0, group, BLOCK_C):
        cols = c + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < group)[None, :]
        v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + rows[:, None] * stride_q + g * group + cols[None, :], _quantize(v, scale[:, None], INTERPRET),
                 mask=mask)
    tl.store(scale_ptr + rows * stride_s + g, scale, mask=row_ok)


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (M, K)`` -> ``(float8_e4m3fn (M, K), fp32 scales (M, K / group))``, one scale per row and ``group``
    columns (:meth:`~nxd_moe.quantization.activations.ActivationQuantization.quantize`, bit for bit)."""
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, width // group, dtype=torch.float32, device=x.device)
    block_c = min(triton.next_power_of_2(group), 1024)
    block_r = max(1, QUANTIZE_TILE // block_c)
    grid = (triton.cdiv(rows, block_r), width // group)
    _quantize_rows_kernel[grid](x, q, scale, rows, group, x.stride(0), q.stride(0), scale.stride(0),
                                INTERPRET=interpreting(), BLOCK_R=block_r,
                                BLOCK_C=block_c)
    return q, scale


@triton.jit
def _accumulate(acc, a, w, a_scale, w_scale, A_SCALED: tl.constexpr, W_SCALED: tl.constexpr, SWAP_AB: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """``acc + a @ w`` for FP8 ``a (M, K)``, ``w (K, N)``; ``a_scale (M,)`` and the scalar ``w_scale`` (one 128x128
    weight block covers the tile) multiply the step's product when they change along K (else the epilogue applies
    them once). Either way the FP8 MMA's reduced-precision sums reach the fp32 accumulator every ``BLOCK_K``
    columns.

    ``SWAP_AB``: ``acc`` is ``(N, M)`` and gets ``w.T @ a.T``: Hopper's FP8 MMA (``wgmma``) needs 64+ rows, so
    decode tiles of 16-32 token rows put the weight's columns in the MMA's rows (both operands stay K-major);
    unswapped, Triton would run them on the older MMA with the FP8 operands converted to fp16 in registers."""
    if SWAP_AB:
        product = tl.dot(w.T, a.T) if A_SCALED or W_SCALED else tl.dot(w.T, a.T, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        product = tl.dot(a, w) if A_SCALED or W_SCALED else tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    if A_SCALED:
        row_scale = a_scale * w_scale if W_SCALED else a_scale
        acc += product * (row_scale[None, :] if SWAP_AB else row_scale[:, None])
    elif W_SCALED:
        acc += product * w_scale
    else:
        acc = product
    return acc


@triton.jit
def _weight_tile(w_cols, stride_wk, w_desc, expert, n0, k0, k_ok, col_ok, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The ``(BLOCK_K, BLOCK_N)`` FP8 weight tile at ``(k0, n0)`` (``w_cols (N,)``: the columns' pointers at
    ``k = 0``): a K-major TMA box transposed in place, or a masked pointer load."""
    if TMA:
        return w_desc.load([expert.to(tl.int32), n0, k0]).reshape(BLOCK_N, BLOCK_K).T
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_cols[None, :] + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """``x`` rounded to the layer's dtype and back (0 fp32, 1 bf16, 2 fp16)."""
    if ROUND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    if ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _w8a8_gate_up_kernel(
    xq_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, bias_ptr, affinity_ptr, out_ptr, out_scale_ptr,
    row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    hidden, inter, inter_actual, num_experts,
    stride_xt, stride_xs, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be,
    stride_or, stride_os,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, X_GROUP: tl.constexpr, W_BLOCKED: tl.constexpr, OUT_GROUP: tl.constexpr,
    ROUND: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Program (tile, column slice): ``act(x_q @ w_q)`` for the tile's rows, ``[gate | up]`` side by side.
    ``X_GROUP``: columns per input scale, 0 for one per row; ``OUT_GROUP``: quantize the output here in groups of
    that many columns (dividing ``BLOCK_N``), 0 to write it in the layer's dtype."""
    tile, column = tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if tile < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = tl.load(row_token_ptr + rows)
    row_ok = token >= 0
    token = tl.where(row_ok, token, 0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    # Row and column base pointers only: whole tiles of pointers carried across iterations would take two
    # registers per element.
    a_rows = xq_ptr + token.to(tl.int64) * stride_xt
    w_cols = w_ptr + expert * stride_we + cols * stride_wn
    ws_base = ws_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k0 = k * BLOCK_K
        k_ok = ks < hidden - k0
        a = tl.load(a_rows[:, None] + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(xs_ptr + token * stride_xs + k0 // X_GROUP, mask=row_ok, other=1.0) if X_GROUP > 0 else row_ok
        w = _weight_tile(w_cols, stride_wk, w_desc, expert, column * BLOCK_N, k0, k_ok, col_ok, TMA, BLOCK_N, BLOCK_K)
        w_s = tl.load(ws_base + (k0 // 128) * stride_sk + (column * BLOCK_N // 128) * stride_sn) if W_BLOCKED else 1.0
        acc = _accumulate(acc, a, w, a_s, w_s, X_GROUP > 0, W_BLOCKED, SWAP_AB, BLOCK_K)
        if GLU:
            w_up = _weight_tile(w_cols + inter * stride_wn, stride_wk, w_desc, expert, column * BLOCK_N + inter, k0,
                                k_ok, col_ok, TMA, BLOCK_N, BLOCK_K)
            w_up_s = tl.load(ws_base + (k0 // 128) * stride_sk + ((column * BLOCK_N + inter) // 128) * stride_sn) \
                if W_BLOCKED else 1.0
            acc_up = _accumulate(acc_up, a, w_up, a_s, w_up_s, X_GROUP > 0, W_BLOCKED, SWAP_AB, BLOCK_K)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    # Scales constant along K, once: the token's (per-row activations), the column's (per-channel weights).
    if X_GROUP == 0:
        row_scale = tl.load(xs_ptr + token * stride_xs, mask=row_ok, other=1.0)
        acc = acc * row_scale[:, None]
        acc_up = acc_up * row_scale[:, None]
    if not W_BLOCKED:
        acc = acc * tl.load(ws_base + cols * stride_sn, mask=col_ok, other=1.0)[None, :]
        if GLU:
            acc_up = acc_up * tl.load(ws_base + (cols + inter) * stride_sn, mask=col_ok, other=1.0)[None, :]
    out = gate_up_epilogue(acc, acc_up, token, row_ok, expert, cols, col_ok, bias_ptr, affinity_ptr, inter,
                            inter_actual, num_experts, stride_be, scaling, act_bias, gate_lower, gate_upper, up_lower,
                            up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE, GATE_LOWER, GATE_UPPER, UP_LOWER,
                            UP_UPPER, MASK_PADDED_COLUMNS)
    store = row_ok[:, None] & col_ok[None, :]
    if OUT_GROUP == 0:
        tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=store)
    else:
        # Whole groups of each row are in this tile: quantize them for the down GEMM here. Columns past I
        # (never stored) are zeroed so they cannot widen a group's range.
        v = tl.where(col_ok[None, :], _round_to(out, ROUND), 0.0)
        if OUT_GROUP == BLOCK_N:
            scale = _group_scale(tl.max(tl.abs(v), axis=1))
            q = _quantize(v, scale[:, None], INTERPRET)
            tl.store(out_scale_ptr + rows * stride_os + column, scale, mask=row_ok)
        else:
            groups = tl.reshape(v, (BLOCK_M, BLOCK_N // OUT_GROUP, OUT_GROUP))
            scale = _group_scale(tl.max(tl.abs(groups), axis=2))
            q = tl.reshape(_quantize(groups, scale[:, :, None], INTERPRET), (BLOCK_M, BLOCK_N))
            group = column * (BLOCK_N // OUT_GROUP) + tl.arange(0, BLOCK_N // OUT_GROUP)
            tl.store(out_scale_ptr + rows[:, None] * stride_os + group[None, :], scale,
                     mask=row_ok[:, None] & (group * OUT_GROUP < inter)[None, :])
        tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], q, mask=store)


@triton.jit
def _w8a8_down_kernel(
    hq_ptr, hs_ptr, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr,
    row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    inter, hidden, k_per_split,
    stride_hr, stride_hs, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_be, stride_os,
    stride_or,
    H_GROUP: tl.constexpr, W_BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
    TMA: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Program (tile, column slice, K split): ``h_q @ w_q`` (+ bias on split 0). ``H_GROUP``: columns per
    intermediate scale, 0 for one per row."""
    tile, column = tile_and_column(tl.program_id(0), num_tiles_ptr, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    if tile < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.load(row_token_ptr + rows) >= 0
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, inter)
    ks = tl.arange(0, BLOCK_K)
    a_rows = hq_ptr + rows.to(tl.int64) * stride_hr
    w_cols = w_ptr + expert * stride_we + cols * stride_wn
    ws_base = ws_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The gate/up kernel's K loop over one split of K (a jit loop cannot take its body as an argument).
    for k in range(0, tl.cdiv(k_end - k_begin, BLOCK_K)):
        k0 = k_begin + k * BLOCK_K
        k_ok = ks < k_end - k0
        # A is masked past the split's end, so a TMA box reaching into the next split multiplies zeros.
        a = tl.load(a_rows[:, None] + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(hs_ptr + rows * stride_hs + k0 // H_GROUP, mask=row_ok, other=1.0) if H_GROUP > 0 else row_ok
        w = _weight_tile(w_cols, stride_wk, w_desc, expert, column * BLOCK_N, k0, k_ok, col_ok, TMA, BLOCK_N, BLOCK_K)
        w_s = tl.load(ws_base + (k0 // 128) * stride_sk + (column * BLOCK_N // 128) * stride_sn) if W_BLOCKED else 1.0
        acc = _accumulate(acc, a, w, a_s, w_s, H_GROUP > 0, W_BLOCKED, SWAP_AB, BLOCK_K)
    if SWAP_AB:
        acc = tl.trans(acc)
    if H_GROUP == 0:
        acc = acc * tl.load(hs_ptr + rows * stride_hs, mask=row_ok, other=1.0)[:, None]
    if not W_BLOCKED:
        acc = acc * tl.load(ws_base + cols * stride_sn, mask=col_ok, other=1.0)[None, :]
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + split * stride_os + rows[:, None] * stride_or + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def default_w8a8_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                        multiprocessors: int = 132) -> dict:
    """The rule for W8A8 shapes without a tuned entry: :func:`~nxd_moe.triton_kernels.launch_configs.default_config`'s
    row tile and decode split-K, with FP8 tiles. ``BLOCK_K`` counts FP8 elements (256 at decode: the bytes of a
    128-wide bf16 step); 128-column gate/up tiles hold whole 128-column intermediate groups, so the epilogue
    quantizes them (the decode tiles swap operands into 128-row MMAs, see :func:`_accumulate`)."""
    base = default_config(num_experts, hidden, inter, top_k, num_tokens, multiprocessors)
    block_m = base["block_m"]
    if block_m >= 64:
        # Four stages won or tied three stages on the four W8A8 prefill cases of benchmarks/gpu_quantized.py (H100).
        gate_up = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "TMA": True}
        down = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "SPLIT_K": 1, "TMA": True}
    else:
        gate_up = {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
        down = {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4, "SPLIT_K": base["down"]["SPLIT_K"]}
    return {"block_m": block_m, "gate_up": gate_up, "down": down}


def w8a8_launch_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                       device: torch.device, dtype: torch.dtype, quantization: str) -> dict:
    """The tuned W8A8 entry for this GPU and shape (key suffix ``,a=fp8``), else :func:`default_w8a8_config` (the
    W8A16 and bf16 entries are not used: their tiles are tuned for 16-bit MMAs). ``dtype`` does not matter: the
    GEMM operands are FP8 whatever the layer's dtype."""
    key = shape_key(num_experts, hidden, inter, top_k, num_tokens, quantization) + ",a=fp8"
    entry = tuned_table(device_name(device)).get(key)
    if entry is not None:
        return entry
    return default_w8a8_config(num_experts, hidden, inter, top_k, num_tokens, rule_multiprocessors(device))


def fp8_block_k(block_k: int, *periods: int | None) -> int:
    """The FP8 K tile: ``block_k`` halved until it divides every scale period along K (an activation group,
    128-row weight blocks)."""
    tile = block_k
    for period in periods:
        while period is not None and tile > 1 and period % tile:
            tile //= 2
    if tile < MIN_FP8_K:
        raise ValueError(f"the triton backend's FP8 x FP8 GEMMs need K steps of at least {MIN_FP8_K} columns inside "
                         f"one scale group; the activation / weight scale periods {periods} allow only {tile} "
                         "(pick an activation_quantization_group_size that is a multiple of 32)")
    return tile


def _k_major_descriptor(weight: torch.Tensor, block_k: int, block_n: int, wanted: bool):
    """A TMA descriptor of a K-major ``weight (E, K, N)`` (strides ``(K*N, 1, K)``) as ``(E, N, K)`` with
    ``(1, block_n, block_k)`` boxes, when asked for and possible (Hopper or newer, 16-byte aligned); else None."""
    if not wanted or weight.device.type != "cuda" or capability(weight.device)[0] < 9:
        return None
    view = weight.transpose(1, 2)
    if view.stride(-1) != 1 or any(s % 16 for s in view.stride()[:-1]) or view.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [1, block_n, block_k])


def _launch(config: dict, block_m: int, device: torch.device) -> dict:
    interpret = interpreting()
    # Tiles of fewer than 64 token rows swap the operands on Hopper and newer (see _accumulate); the interpreter
    # takes the same path so that CI runs it.
    hopper = interpret or (device.type == "cuda" and capability(device)[0] >= 9)
    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"], "INTERPRET": interpret,
            "GROUP_M": config.get("GROUP_M", 8), "SWAP_AB": hopper and block_m < 64 and config["BLOCK_N"] >= 64}


def w8a8_expert_rows(hidden_states: torch.Tensor, layout: TileLayout, weights: ExpertWeights,
                     affinities: torch.Tensor | None, config: dict) -> torch.Tensor:
    """``hidden_states (T, H)`` -> ``(S, R, H)`` expert output rows in tile order (``S`` split-K partial sums,
    fp32 when ``S > 1``), W8A8: the three steps of the module docstring. ``affinities (T, E)`` when the expert
    input is pre-scaled by its affinity (applied to the fp32 product in the epilogue), else None."""
    spec, activation = weights.activation_quantization, weights.activation
    gate_up, down = weights.gate_up_proj, weights.down_proj
    if activation.hidden_act not in ACTIVATIONS:
        raise ValueError(f"the triton backend supports hidden_act in {sorted(ACTIVATIONS)}, got "
                         f"{activation.hidden_act!r}")
    num_experts, hidden, width = gate_up.shape
    inter = down.shape[1]
    blocked = gate_up.format.name == "fp8_block"
    weight_period = FP8_BLOCK if blocked else None
    dtype = hidden_states.dtype
    device = hidden_states.device
    x_group, mid_group = spec.group(hidden), spec.group(inter)
    # Per-row scales are applied in the epilogue: only a group narrower than the row varies along K.
    x_period, mid_period = (x_group if x_group < hidden else None), (mid_group if mid_group < inter else None)
    xq, xs = quantize_rows(hidden_states, x_group)

    # gate/up
    first = config["gate_up"]
    # A column tile of blocked weights stays inside one 128-column scale block (one scale per K step).
    block_m, block_n = layout.block_m, min(first["BLOCK_N"], FP8_BLOCK) if blocked else first["BLOCK_N"]
    block_k = fp8_block_k(first["BLOCK_K"], x_period, weight_period)
    out_group = mid_group if mid_group <= block_n and block_n % mid_group == 0 else 0
    if out_group:
        mid = torch.empty(layout.num_rows, inter, dtype=torch.float8_e4m3fn, device=device)
        mid_scale = torch.empty(layout.num_rows, inter // mid_group, dtype=torch.float32, device=device)
    else:
        mid = torch.empty(layout.num_rows, inter, dtype=dtype, device=device)
        mid_scale = xs  # unused
    actual = activation.intermediate_size_actual
    limits = (activation.gate_lower, activation.gate_upper, activation.up_lower, activation.up_upper)
    bias = weights.gate_up_bias if weights.gate_up_bias is not None else hidden_states
    descriptor = _k_major_descriptor(gate_up.weight, block_k, block_n, first.get("TMA", False))
    grid = ((layout.num_rows // block_m) * triton.cdiv(inter, block_n),)
    _w8a8_gate_up_kernel[grid](
        xq, xs, gate_up.weight, gate_up.weight if descriptor is None else descriptor, gate_up.scale, bias,
        affinities if affinities is not None else hidden_states, mid, mid_scale,
        layout.row_token, layout.tile_expert, layout.num_tiles,
        hidden, inter, inter if actual is None else actual, num_experts,
        xq.stride(0), xs.stride(0), *gate_up.weight.stride(), *gate_up.scale.stride(), bias.stride(0),
        mid.stride(0), mid_scale.stride(0),
        float(activation.scaling_factor), float(activation.act_bias), *(0.0 if v is None else float(v) for v in limits),
        ACT=ACTIVATIONS[activation.hidden_act], GLU=activation.glu_mlp, SWIGLU=activation.glu_type is GLUType.SWIGLU,
        HAS_BIAS=weights.gate_up_bias is not None, PRESCALE=affinities is not None,
        GATE_LOWER=limits[0] is not None, GATE_UPPER=limits[1] is not None, UP_LOWER=limits[2] is not None,
        UP_UPPER=limits[3] is not None, MASK_PADDED_COLUMNS=actual is not None and actual < inter,
        X_GROUP=x_period or 0, W_BLOCKED=blocked, OUT_GROUP=out_group, ROUND=ROUNDING[dtype],
        TMA=descriptor is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **_launch(first, block_m, device))
    if not out_group:
        mid, mid_scale = quantize_rows(mid, mid_group)

    # down
    second = config["down"]
    block_n = min(second["BLOCK_N"], FP8_BLOCK) if blocked else second["BLOCK_N"]
    block_k = fp8_block_k(second["BLOCK_K"], mid_period, weight_period)
    k_per_split = triton.cdiv(triton.cdiv(inter, second["SPLIT_K"]), block_k) * block_k
    split = triton.cdiv(inter, k_per_split)
    out = torch.empty(split, layout.num_rows, hidden, dtype=dtype if split == 1 else torch.float32, device=device)
    bias = weights.down_bias if weights.down_bias is not None else out
    descriptor = _k_major_descriptor(down.weight, block_k, block_n, second.get("TMA", False))
    grid = ((layout.num_rows // block_m) * triton.cdiv(hidden, block_n), split)
    _w8a8_down_kernel[grid](
        mid, mid_scale, down.weight, down.weight if descriptor is None else descriptor, down.scale, bias, out,
        layout.row_token, layout.tile_expert, layout.num_tiles,
        inter, hidden, k_per_split, mid.stride(0), mid_scale.stride(0), *down.weight.stride(), *down.scale.stride(),
        bias.stride(0), out.stride(0), out.stride(1),
        H_GROUP=mid_period or 0, W_BLOCKED=blocked, HAS_BIAS=weights.down_bias is not None,
        TMA=descriptor is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **_launch(second, block_m, device))
    return out
