"""Prefill grouped GEMMs for Hopper: persistent programs fed by the bulk tensor copy engine (TMA).

The same function as :func:`~nxd_moe.triton_kernels.grouped_gemm.gate_up_projection` followed by
:func:`~nxd_moe.triton_kernels.grouped_gemm.down_projection` over the same
:class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout`, built for prefill-sized problems (``block_m`` >= 64
rows per tile) of 16-bit unquantized weights on sm_90 and newer:

1. :func:`permute_rows` (optional, ``A_TMA``): the token rows copied once into tile order, ``x_sorted (R, H)``
   (padding rows zero), so that the gate/up GEMM loads its A tiles as whole ``BLOCK_M x BLOCK_K`` boxes through
   TMA like its weights (Hopper's TMA cannot gather rows by index). Without it the A tile is gathered by token id
   with per-thread asynchronous copies (``cp.async``), as the tile-per-program kernel does.
2. gate/up: ``x @ gate_up_proj[e]`` with the whole activation in the epilogue
   (:func:`~nxd_moe.triton_kernels.grouped_gemm.gate_up_epilogue`, shared with the other kernels).
3. down: ``act @ down_proj[e] + b``: the activated rows are already in tile order, so both operands come by TMA.

Both GEMMs are *persistent*: one program per multiprocessor (``NUM_PROGRAMS``), each looping over work items
``(tile, column slice)`` from its program id up to the device-side tile count times the column slices, in steps of
the grid size -- no host sync, one launch shape for every routing (one CUDA graph serves them all), and programs
with nothing left exit. Items are numbered in the grouped order of
:func:`~nxd_moe.triton_kernels.tile_math.grouped_order`, so the programs running at any time share the
weight slices of a few experts through L2. The K loop is software-pipelined ``num_stages`` deep (TMA loads with
mbarriers, asynchronous ``wgmma``); the item loop is either flattened with it (``FLATTEN``: Triton fuses the two
loops so the next item's first loads are issued during this item's epilogue), or left as an outer loop (each item
then pipelines like the tile-per-program kernel, without a launch per tile).

What Triton 3.6 does with these kernels on sm_90 (offline compiles and an H100):

- TMA descriptors (host ``TensorDescriptor``) for 3-D weights, the permuted rows, the activated rows and the
  outputs (``OUT_TMA``: the epilogue stores a box, clipped at the tensor's edge): all compile and run; Triton's
  interpreter emulates them, so CI runs these kernels on CPU tensors too.
- ``tl.range(..., warp_specialize=True)``: the Hopper warp-specialisation pass applies only with ``num_warps=4``
  (it then runs 12 warps: one TMA producer group, two MMA consumer groups), TMA-loaded A tiles (not the gathered
  ones) and no TMA store; with 8 warps it is silently not applied. The kernels it produced compiled but never
  finished on an H100 (both GEMMs, every shape tried), so ``WARP_SPECIALIZE`` is refused on sm_90 with Triton
  older than 3.7.
- Flattened loops keep two 128x128 fp32 accumulators and the next item's addresses live: gate/up compiles to 255
  registers with spills (169 with the output by TMA).

Which GEMM runs persistent is :func:`default_prefill_config`'s rule; measured times: docs/gpu.md ("Prefill
GEMMs") and ``benchmarks/notes/issue19_gpu_prefill.md``.

Padding rows of a tile (an expert's last, partial tile) are computed from zero (or, unpermuted, masked) A rows
and never read by the combine; the activated rows of padding are written only where the output goes by TMA.
Results are deterministic: every output element is written once, sums run in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.gpu_info import capability, multiprocessors
from nxd_moe.triton_kernels import interpreting
from nxd_moe.triton_kernels.grouped_gemm import (
    down_projection,
    epilogue_arguments,
    gate_up_epilogue,
    gate_up_projection,
    launch_options,
)
from nxd_moe.triton_kernels.routing_metadata import TileLayout
from nxd_moe.triton_kernels.tile_math import grouped_order, tile_dot

# Rows and columns one permute_rows program copies.
PERMUTE_ROWS = 16
PERMUTE_COLUMNS = 512


@triton.jit
def _permute_rows_kernel(x_ptr, out_ptr, row_token_ptr, num_tiles_ptr, hidden, stride_xt, stride_or,
                         TILE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (row block, column block): ``out[r] = x[row_token[r]]`` (0 for padding rows) for rows of tiles in
    use; row blocks past the device-side tile count exit."""
    first = tl.program_id(0) * BLOCK_R
    if first >= tl.load(num_tiles_ptr) * TILE_ROWS:
        return
    rows = first + tl.arange(0, BLOCK_R)
    token = tl.load(row_token_ptr + rows)
    row_ok = token >= 0
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    values = tl.load(x_ptr + tl.where(row_ok, token, 0)[:, None] * stride_xt + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :], values, mask=col_ok[None, :])


def permute_rows(hidden_states: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """``hidden_states (T, H)`` -> ``(R, H)``: row ``r`` is token ``layout.row_token[r]``'s row, zeros for padding
    rows; rows past the tiles in use are left unwritten."""
    num_rows, hidden = layout.num_rows, hidden_states.shape[1]
    out = torch.empty(num_rows, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    block_h = min(PERMUTE_COLUMNS, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_rows, PERMUTE_ROWS), triton.cdiv(hidden, block_h))
    _permute_rows_kernel[grid](hidden_states, out, layout.row_token, layout.num_tiles, hidden,
                               hidden_states.stride(0), out.stride(0), TILE_ROWS=layout.block_m,
                               BLOCK_R=PERMUTE_ROWS, BLOCK_H=block_h, num_warps=4)
    return out


@triton.jit
def _item_origin(item, num_tiles, num_n, tile_expert_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Work item -> ``(expert, first row, first column)`` of its tile and column slice, in grouped order."""
    tile, column = grouped_order(item, num_tiles, num_n, GROUP_M)
    return tl.load(tile_expert_ptr + tile), tile * BLOCK_M, column * BLOCK_N


@triton.jit
def _gate_up_persistent_kernel(
    x_ptr, x_desc, w_desc, bias_ptr, affinity_ptr, out_ptr, out_desc,
    row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    hidden, inter, inter_actual, num_experts, stride_xt, stride_be, stride_or,
    scaling, act_bias, gate_lower, gate_upper, up_lower, up_upper,
    ACT: tl.constexpr, GLU: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALE: tl.constexpr,
    GATE_LOWER: tl.constexpr, GATE_UPPER: tl.constexpr, UP_LOWER: tl.constexpr, UP_UPPER: tl.constexpr,
    MASK_PADDED_COLUMNS: tl.constexpr, A_TMA: tl.constexpr, OUT_TMA: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
):
    """Persistent programs over items ``(tile, column slice)`` of :func:`gate_up_projection`; ``A_TMA``: the A
    tiles are boxes of ``x_desc`` over the permuted rows, else gathered from ``x_ptr`` by token id."""
    tl.static_assert(not GATE_UP_INTERLEAVED, "TMA boxes read adjacent columns: interleaved gate/up cannot be split")
    num_n = tl.cdiv(inter, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    k_steps = tl.cdiv(hidden, BLOCK_K)
    for item in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        expert, first_row, first_col = _item_origin(item, num_tiles, num_n, tile_expert_ptr, BLOCK_M, BLOCK_N,
                                                    GROUP_M)
        rows = first_row + tl.arange(0, BLOCK_M)
        token = tl.load(row_token_ptr + rows)
        row_ok = token >= 0
        token = tl.where(row_ok, token, 0)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            k0 = k * BLOCK_K
            if A_TMA:
                a = x_desc.load([first_row, k0])
            else:
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (ks < hidden - k0)[None, :], other=0.0)
            # Past H the copy engine zero-fills; gate columns past I read up columns, which are never stored.
            w = w_desc.load([expert, k0, first_col]).reshape(BLOCK_K, BLOCK_N)
            acc = tile_dot(a, w, acc, PRECISION, INTERPRET)
            if GLU:
                w_up = w_desc.load([expert, k0, first_col + inter]).reshape(BLOCK_K, BLOCK_N)
                acc_up = tile_dot(a, w_up, acc_up, PRECISION, INTERPRET)
        cols = first_col + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        out = gate_up_epilogue(acc, acc_up, token, row_ok, expert.to(tl.int64), cols, col_ok, bias_ptr,
                                affinity_ptr, inter, inter_actual, num_experts, stride_be, scaling, act_bias,
                                gate_lower, gate_upper, up_lower, up_upper, ACT, GLU, SWIGLU, HAS_BIAS, PRESCALE,
                                GATE_LOWER, GATE_UPPER, UP_LOWER, UP_UPPER, MASK_PADDED_COLUMNS)
        if OUT_TMA:  # clipped at I; padding rows get the activation of zero rows, never read
            out_desc.store([first_row, first_col], out.to(out_desc.dtype))
        else:
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Its item loop is the gate/up kernel's: a Triton jit loop cannot take its body as an argument, so each kernel
# writes the loop around its own body.
@triton.jit
def _down_persistent_kernel(
    h_desc, w_desc, bias_ptr, out_ptr, out_desc, row_token_ptr, tile_expert_ptr, num_tiles_ptr,
    inter, hidden, stride_be, stride_or,
    HAS_BIAS: tl.constexpr, OUT_TMA: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """Persistent programs over items ``(tile, column slice)`` of ``act @ down_proj[e] + b``, both operands by
    TMA (past ``I`` the copy engine zero-fills both)."""
    num_n = tl.cdiv(hidden, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    k_steps = tl.cdiv(inter, BLOCK_K)
    for item in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        expert, first_row, first_col = _item_origin(item, num_tiles, num_n, tile_expert_ptr, BLOCK_M, BLOCK_N,
                                                    GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            k0 = k * BLOCK_K
            a = h_desc.load([first_row, k0])
            w = w_desc.load([expert, k0, first_col]).reshape(BLOCK_K, BLOCK_N)
            acc = tile_dot(a, w, acc, PRECISION, INTERPRET)
        cols = first_col + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok,
                           other=0.0).to(tl.float32)[None, :]
        if OUT_TMA:  # padding rows hold sums of unwritten activated rows: never read
            out_desc.store([first_row, first_col], acc.to(out_desc.dtype))
        else:
            rows = first_row + tl.arange(0, BLOCK_M)
            row_ok = tl.load(row_token_ptr + rows) >= 0
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _descriptor(tensor: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block)


def _tma_ready(tensor: torch.Tensor) -> bool:
    """Rows contiguous, every other stride and the base 16-byte aligned (what a TMA descriptor needs)."""
    size = tensor.element_size()
    return (tensor.stride(-1) == 1 and all(s * size % 16 == 0 for s in tensor.stride()[:-1])
            and tensor.data_ptr() % 16 == 0)


def applies(hidden_states: torch.Tensor, weights: ExpertWeights, block_m: int) -> bool:
    """Whether the prefill path can run this layer: a CUDA device with TMA (sm_90+), not Triton's interpreter
    (there the backend keeps the tile-per-program kernels; tests call these kernels directly), 16-bit activations
    (fp32 layers keep IEEE fp32 products, which the tensor-core path does not have), unquantized 16-bit weights of
    the same dtype, prefill tiles (``block_m`` >= 64: the smallest Hopper MMA), and 16-byte-aligned rows for the
    descriptors."""
    if (hidden_states.device.type != "cuda" or interpreting()
            or capability(hidden_states.device)[0] < 9 or block_m < 64):
        return False
    dtype, gate_up, down = hidden_states.dtype, weights.gate_up_proj, weights.down_proj
    if dtype not in (torch.bfloat16, torch.float16) or not all(
            isinstance(w, torch.Tensor) and w.dtype == dtype for w in (gate_up, down)):  # not a QuantizedWeight
        return False
    inter = down.shape[1]
    return (_tma_ready(gate_up) and _tma_ready(down) and hidden_states.shape[1] % 8 == 0 and inter % 8 == 0)


# Down projections with at most this many rows of K (the intermediate size) run persistent by default.
PERSISTENT_DOWN_MAX_K = 1024


def default_prefill_config(block_m: int, inter: int) -> dict:
    """The rule for the prefill path: per GEMM either ``{"persistent": False}`` (the tile-per-program kernel of
    ``grouped_gemm.py`` with the layer's launch configuration) or a persistent launch configuration.

    Measured on H100s (``benchmarks/gpu_prefill.py``, two runs on two machines; benchmarks/notes/
    issue19_gpu_prefill.md): the persistent down projection won where its K loop is short and one tile's epilogue
    overlapping the next tile's loads matters (Qwen3-30B-A3B, ``I`` = 768: 240 us against 260-268, both runs); with
    long K loops (GPT-OSS ``I`` = 2880, Mixtral 14336) it was within 2% in one run and 14-20% slower in the other,
    so those keep the tile-per-program kernel. Flattened persistent gate/up was 28-40% slower on every shape (two
    accumulators plus the next tile's addresses: 255 registers, spills); not flattened it was within 4% of the
    tile-per-program kernel (one run).
    """
    warps = 8 if block_m == 128 else 4
    persistent = {"persistent": True, "BLOCK_K": 64, "num_warps": warps, "num_stages": 4, "OUT_TMA": False,
                  "WARP_SPECIALIZE": False, "FLATTEN": True, "GROUP_M": 8, "programs_per_sm": 1}
    return {"gate_up": {**persistent, "persistent": False, "BLOCK_N": 128, "A_TMA": False},
            "down": {**persistent, "persistent": inter <= PERSISTENT_DOWN_MAX_K,
                     "BLOCK_N": 256 if block_m == 128 else 128}}


def _persistent_options(part: dict, like: torch.Tensor, items: int) -> tuple[tuple[int], dict]:
    """Grid (one program per multiprocessor, at most one per worst-case item) and launch options."""
    cuda = like.device.type == "cuda"
    programs = max(1, min((multiprocessors(like.device) if cuda else 4) * part.get("programs_per_sm", 1), items))
    ws = bool(part.get("WARP_SPECIALIZE", False))
    if ws and cuda and capability(like.device)[0] == 9 and _triton_version() < (3, 7):
        raise ValueError("WARP_SPECIALIZE=True: Triton 3.6's Hopper warp specialisation compiles these kernels "
                         "(num_warps=4, TMA operands, no TMA store) but the launches never finished on an H100 "
                         "(benchmarks/notes/issue19_gpu_prefill.md); use FLATTEN instead")
    # Triton cannot flatten a warp-specialised loop on Hopper.
    return (programs,), {**launch_options(part, like.dtype), "NUM_PROGRAMS": programs, "WARP_SPECIALIZE": ws,
                         "FLATTEN": bool(part.get("FLATTEN", True)) and not ws}


def _triton_version() -> tuple[int, int]:
    return tuple(int(v) for v in triton.__version__.split(".")[:2])


def gate_up_rows(hidden_states: torch.Tensor, layout: TileLayout, gate_up_proj: torch.Tensor,
                 gate_up_bias: torch.Tensor | None, activation, affinities: torch.Tensor | None,
                 part: dict) -> torch.Tensor:
    """``hidden_states (T, H)`` -> ``(R, I)`` activated rows in tile order (:func:`gate_up_projection`'s
    result; padding rows unwritten, or with ``OUT_TMA`` the activation of zero rows)."""
    num_experts, hidden, width = gate_up_proj.shape
    inter = width // 2 if activation.glu_mlp else width
    scalars, constexprs = epilogue_arguments(activation, inter, gate_up_bias is not None, affinities is not None)
    block_m, block_n, block_k = layout.block_m, part["BLOCK_N"], part["BLOCK_K"]
    out = torch.empty(layout.num_rows, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    a_tma = bool(part.get("A_TMA", False))
    x = permute_rows(hidden_states, layout) if a_tma else hidden_states
    x_desc = _descriptor(x, [block_m, block_k]) if a_tma else x
    out_tma = bool(part.get("OUT_TMA", False))
    out_desc = _descriptor(out, [block_m, block_n]) if out_tma else out
    bias = gate_up_bias if gate_up_bias is not None else hidden_states
    grid, options = _persistent_options(part, hidden_states,
                                        (layout.num_rows // block_m) * triton.cdiv(inter, block_n))
    _gate_up_persistent_kernel[grid](
        x, x_desc, _descriptor(gate_up_proj, [1, block_k, block_n]), bias,
        affinities if affinities is not None else hidden_states, out, out_desc,
        layout.row_token, layout.tile_expert, layout.num_tiles,
        hidden, inter, scalars[0], num_experts, x.stride(0), bias.stride(0), out.stride(0), *scalars[1:],
        A_TMA=a_tma, OUT_TMA=out_tma, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **constexprs, **options)
    return out


def down_rows(activated: torch.Tensor, layout: TileLayout, down_proj: torch.Tensor, down_bias: torch.Tensor | None,
              part: dict) -> torch.Tensor:
    """``activated (R, I)`` in tile order -> ``(1, R, H)`` (the one split of :func:`down_projection`)."""
    num_experts, inter, hidden = down_proj.shape
    block_m, block_n, block_k = layout.block_m, part["BLOCK_N"], part["BLOCK_K"]
    out = torch.empty(1, layout.num_rows, hidden, dtype=activated.dtype, device=activated.device)
    out_tma = bool(part.get("OUT_TMA", False))
    out_desc = _descriptor(out[0], [block_m, block_n]) if out_tma else out
    bias = down_bias if down_bias is not None else activated
    grid, options = _persistent_options(part, activated,
                                        (layout.num_rows // block_m) * triton.cdiv(hidden, block_n))
    _down_persistent_kernel[grid](
        _descriptor(activated, [block_m, block_k]), _descriptor(down_proj, [1, block_k, block_n]), bias, out,
        out_desc, layout.row_token, layout.tile_expert, layout.num_tiles, inter, hidden, bias.stride(0),
        out.stride(1), HAS_BIAS=down_bias is not None, OUT_TMA=out_tma, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **options)
    return out


def expert_rows(hidden_states: torch.Tensor, layout: TileLayout, weights: ExpertWeights,
                affinities: torch.Tensor | None, prefill: dict, launch: dict) -> torch.Tensor:
    """gate/up then down over ``layout``: ``(S, R, H)`` rows for the combine. ``prefill``: ``gate_up`` and
    ``down`` entries as :func:`default_prefill_config`; a GEMM that is not persistent there runs the
    tile-per-program kernel with its entry in ``launch`` (the layer's launch configuration), as does gate/up with
    interleaved gate/up columns (TMA boxes are runs of adjacent columns)."""
    gate_up, down = prefill["gate_up"], prefill["down"]
    if gate_up.get("persistent", True) and not weights.activation.gate_up_interleaved:
        activated = gate_up_rows(hidden_states, layout, weights.gate_up_proj, weights.gate_up_bias,
                                 weights.activation, affinities, gate_up)
    else:
        activated = gate_up_projection(hidden_states, layout, weights.gate_up_proj, weights.gate_up_bias,
                                       weights.activation, affinities, launch["gate_up"])
    if down.get("persistent", True):
        return down_rows(activated, layout, weights.down_proj, weights.down_bias, down)
    return down_projection(activated, layout, weights.down_proj, weights.down_bias, launch["down"])
