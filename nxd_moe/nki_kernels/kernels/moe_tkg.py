"""Decode ("token generation") MoE kernels: all-experts and selective loading (the NKI library's ``moe_tkg``).

- :func:`moe_tkg_all_expert`: every expert's weights are read once, at static addresses (no indirection), and
  every token goes through every expert; unchosen experts' outputs are weighted by zero. With two cores each takes
  half of the experts and the two partial sums are added through shared HBM.
- :func:`moe_tkg_selective_expert`: for each token and each of its k experts, that expert's weights are loaded
  at the expert index read on the device (a runtime ``scalar_offset``) and a GEMV-shaped MLP runs: ``T * k``
  weight loads, which is why it only pays while ``T * k`` is below the number of experts. With two cores each
  takes half of the tokens.

Inputs: ``hidden_states (T, H)``; weights and biases as in :mod:`~nxd_moe.nki_kernels.kernels.block`;
``expert_affinities_masked (T * E, 1)`` (zero off the chosen experts and for padded tokens); ``expert_index (T, k)``
int32 (selective only); ``expert_mask (T * E, 1)`` (1 for a chosen expert of a real token) for PRE_SCALE, where the
affinity scales the input and the mask decides which outputs count -- an expert's output on a zero input is not
zero when it has biases.
"""

from __future__ import annotations

from dataclasses import replace

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.dtypes import is_integer
from nxd_moe.nki_kernels.hardware import PMAX
from nxd_moe.nki_kernels.kernels.expert_mlp import (
    HIDDEN_CHUNK,
    ExpertAffinityScaleMode,
    MlpShard,
    allocate_weights,
    check_expert_weights,
    computed_intermediate,
    down_projection,
    gate_up_activation,
    load_down_bias,
    load_gate_up_bias,
    load_weights,
    quantized_inputs,
    transpose_tokens,
    weight_chunks,
)
from nxd_moe.nki_kernels.kernels.tiling import split, tiles
from nxd_moe.nki_kernels.machine import counted_once_per_signature
from nxd_moe.nki_kernels.tensor import NkiTensor


def _prologue(hidden_states, gate_up_proj_weight, down_proj_weight, expert_affinities_masked, expert_mask,
              activation: ExpertActivation, scaling_mode, gate_up_proj_scale, down_proj_scale, weight_format):
    """Both kernels' prologue: the weights taken with their scales (:func:`quantized_inputs`), the inputs checked;
    returns ``(gate_up_proj_weight, down_proj_weight, shard, mode)``."""
    gate_up_proj_weight, down_proj_weight = quantized_inputs(gate_up_proj_weight, down_proj_weight, gate_up_proj_scale,
                                                             down_proj_scale, weight_format, hidden_states.dtype,
                                                             activation.glu_mlp)
    tokens, hidden = hidden_states.shape
    experts, _, inter = check_expert_weights(gate_up_proj_weight, down_proj_weight, hidden, activation)
    if expert_affinities_masked.shape != (tokens * experts, 1):
        raise ValueError(f"expert_affinities_masked must be (T * E, 1) = {(tokens * experts, 1)}, got "
                         f"{expert_affinities_masked.shape}")
    mode = ExpertAffinityScaleMode(scaling_mode)
    pre = mode is ExpertAffinityScaleMode.PRE_SCALE
    if pre and (expert_mask is None or expert_mask.shape != (tokens * experts, 1)):
        raise ValueError(f"PRE_SCALE needs expert_mask (T * E, 1) = {(tokens * experts, 1)}")
    i_range = (0, computed_intermediate(activation, inter))
    return (gate_up_proj_weight, down_proj_weight,
            MlpShard(hidden, inter, (0, hidden), (0, hidden), i_range, activation.glu_mlp), mode)


def moe_tkg_all_expert(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                       gate_and_up_proj_bias=None, down_proj_bias=None, expert_mask=None, *,
                       activation: ExpertActivation,
                       expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE, gate_up_proj_scale=None,
                       down_proj_scale=None, weight_format: str = "bf16"):
    """Returns ``output (T, H)``: ``sum_e weight[t, e] * MLP_e(x_t)`` over all experts (``weight`` the affinity,
    or the mask with PRE_SCALE)."""
    gate_up_proj_weight, down_proj_weight, shard, mode = _prologue(
        hidden_states, gate_up_proj_weight, down_proj_weight, expert_affinities_masked, expert_mask, activation,
        expert_affinities_scaling_mode, gate_up_proj_scale, down_proj_scale, weight_format)
    tokens, hidden = hidden_states.shape
    experts = gate_up_proj_weight.shape[0]
    dtype = hidden_states.dtype
    cores, core = nl.num_programs(0), nl.program_id(0)
    token_tiles = tiles(0, tokens, PMAX)
    x = nl.ndarray((PMAX, len(token_tiles), hidden), dtype, name="hidden_sb")
    weights_by_token = nl.ndarray((PMAX, len(token_tiles), experts), expert_affinities_masked.dtype,
                                  name="affinities_sb")
    combine = weights_by_token
    scale = None
    if mode is ExpertAffinityScaleMode.PRE_SCALE:
        scale = weights_by_token
        combine = nl.ndarray((PMAX, len(token_tiles), experts), expert_mask.dtype, name="expert_mask_sb")
    for j, (t0, t1) in enumerate(token_tiles):
        nisa.dma_copy(x[:t1 - t0, j], hidden_states[t0:t1, :])
        nisa.dma_copy(weights_by_token[:t1 - t0, j], expert_affinities_masked.ap([[experts, t1 - t0], [1, experts]],
                                                                                 offset=t0 * experts))
        if scale is not None:
            nisa.dma_copy(combine[:t1 - t0, j], expert_mask.ap([[experts, t1 - t0], [1, experts]], offset=t0 * experts))
    acc = nl.ndarray((PMAX, len(token_tiles), hidden), nl.float32, name="output_acc_sb")
    nisa.memset(acc, 0.0)
    x_t = transpose_tokens(x, tokens, shard, dtype) if scale is None else None
    weights = allocate_weights(shard, dtype)
    first, last = split(experts, cores, core)
    for e in nl.sequential_range(first, last):
        _expert_pass(e, tokens, x, x_t, scale, combine, acc, weights, gate_up_proj_weight, down_proj_weight,
                     gate_and_up_proj_bias, down_proj_bias, shard, activation)
    output = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm, name="output")
    if cores == 1:
        _store_rows(output, acc, token_tiles, dtype)
        return output
    partial = nl.ndarray((cores, tokens, hidden), nl.float32, buffer=nl.shared_hbm, name="partial_output")
    for j, (t0, t1) in enumerate(token_tiles):
        nisa.dma_copy(partial[core, t0:t1, :], acc[:t1 - t0, j])
    nisa.core_barrier(partial, (0, 1))
    rows = tiles(*split(tokens, cores, core), PMAX)
    for r in nl.affine_range(len(rows)):
        r0, r1 = rows[r]
        mine = nl.ndarray((r1 - r0, hidden), nl.float32, name="partial_rows_sb")
        theirs = nl.ndarray((r1 - r0, hidden), nl.float32, name="peer_rows_sb")
        nisa.dma_copy(mine, partial[0, r0:r1, :])
        nisa.dma_copy(theirs, partial[1, r0:r1, :])
        out = nl.ndarray((r1 - r0, hidden), dtype, name="output_rows_sb")
        nisa.tensor_tensor(out, mine, theirs, nl.add)
        nisa.dma_copy(output[r0:r1, :], out)
    return output


def moe_tkg_selective_expert(hidden_states, expert_affinities_masked, expert_index, gate_up_proj_weight,
                             down_proj_weight, gate_and_up_proj_bias=None, down_proj_bias=None, expert_mask=None, *,
                             activation: ExpertActivation,
                             expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE, gate_up_proj_scale=None,
                       down_proj_scale=None, weight_format: str = "bf16"):
    """Returns ``output (T, H)``: ``sum_j weight[t, j] * MLP_{index[t, j]}(x_t)``, loading each pair's expert."""
    gate_up_proj_weight, down_proj_weight, shard, mode = _prologue(
        hidden_states, gate_up_proj_weight, down_proj_weight, expert_affinities_masked, expert_mask, activation,
        expert_affinities_scaling_mode, gate_up_proj_scale, down_proj_scale, weight_format)
    tokens, hidden = hidden_states.shape
    if not isinstance(expert_index, NkiTensor) or len(expert_index.shape) != 2 or expert_index.shape[0] != tokens \
            or not is_integer(expert_index.dtype):
        raise ValueError(f"expert_index must be an int32 (T={tokens}, k) tensor, got {expert_index!r}")
    top_k = expert_index.shape[1]
    dtype = hidden_states.dtype
    first, last = split(tokens, nl.num_programs(0), nl.program_id(0))
    if first == last:
        return nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm, name="output")
    mine = last - first
    if mine > PMAX:
        raise ValueError(f"moe_tkg_selective_expert handles at most {PMAX} tokens per core, got {mine}")
    x = nl.ndarray((mine, 1, hidden), dtype, name="hidden_sb")
    nisa.dma_copy(x[:, 0], hidden_states[first:last, :])
    pre = mode is ExpertAffinityScaleMode.PRE_SCALE
    x_t = None if pre else transpose_tokens(x, mine, shard, dtype)
    weights = allocate_weights(shard, dtype)
    output = nl.ndarray((tokens, hidden), dtype, buffer=nl.shared_hbm, name="output")
    for t in nl.sequential_range(first, last):
        acc = nl.ndarray((1, hidden), nl.float32, name="token_acc_sb")
        nisa.memset(acc, 0.0)
        for j in nl.sequential_range(top_k):
            _selected_pair(t, j, t - first, x, x_t, acc, weights, expert_affinities_masked, expert_index,
                           expert_mask if pre else None, gate_up_proj_weight, down_proj_weight,
                           gate_and_up_proj_bias, down_proj_bias, shard, activation)
        row = nl.ndarray((1, hidden), dtype, name="output_row_sb")
        nisa.tensor_copy(row, acc)
        nisa.dma_copy(output[t:t + 1, :], row)
    return output


def _same_counts(*args, **kwargs) -> tuple:
    """Every expert pass (and every selected pair) runs the same instructions: no data-dependent skipping."""
    return ()


@counted_once_per_signature(_same_counts)
def _expert_pass(e: int, tokens: int, x, x_t, scale, combine, acc, weights, gate_up_proj_weight, down_proj_weight,
                 gate_and_up_proj_bias, down_proj_bias, shard: MlpShard, activation: ExpertActivation) -> None:
    """Expert ``e`` (static address) on every token, added into ``acc`` with its combine weights (PRE_SCALE when
    ``scale`` holds the affinities: the input is scaled and re-transposed for this expert)."""
    dtype = x.dtype
    token_tiles = tiles(0, tokens, PMAX)
    # broadcast onto the partitions the token tiles use, not all 128 (a broadcast DMA reads the row per partition)
    d_bias = None if down_proj_bias is None else load_down_bias(down_proj_bias, e, shard, dtype, min(tokens, PMAX))
    x_e = x_t
    if scale is not None:
        scaled = nl.ndarray(x.shape, dtype, name="scaled_hidden_sb")
        for j, (t0, t1) in enumerate(token_tiles):
            nisa.tensor_scalar(scaled[:t1 - t0, j], x[:t1 - t0, j], nl.multiply, scale[:t1 - t0, j, e:e + 1])
        x_e = transpose_tokens(scaled, tokens, shard, dtype)
    for piece, part in _expert_pieces(e, weights, gate_up_proj_weight, down_proj_weight, shard, dtype):
        gu_bias = None if gate_and_up_proj_bias is None else load_gate_up_bias(gate_and_up_proj_bias, e, part, dtype)
        h = gate_up_activation(x_e, weights[0], tokens, part, activation, gu_bias, dtype)
        for j, (t0, t1) in enumerate(token_tiles):
            _accumulate(acc[:t1 - t0, j], h, weights[1], t0, t1 - t0, d_bias if piece == 0 else None,
                        combine[:t1 - t0, j, e:e + 1], part)


@counted_once_per_signature(_same_counts)
def _selected_pair(t: int, j: int, row: int, x, x_t, acc, weights, expert_affinities_masked, expert_index,
                   expert_mask, gate_up_proj_weight, down_proj_weight, gate_and_up_proj_bias, down_proj_bias,
                   shard: MlpShard, activation: ExpertActivation) -> None:
    """Token ``t``'s ``j``-th expert: read its index on the device, load its weights, add its output to ``acc``
    (PRE_SCALE when ``expert_mask`` is given: the affinity scales the input, the mask weighs the output)."""
    dtype = x.dtype
    experts = gate_up_proj_weight.shape[0]
    expert = nl.ndarray((1, 1), nl.int32, name="expert_sb")
    nisa.dma_copy(expert, expert_index[t:t + 1, j:j + 1])
    address = nl.ndarray((1, 1), nl.int32, name="affinity_address_sb")
    nisa.tensor_scalar(address, expert, nl.add, t * experts)
    affinity = _load_at(expert_affinities_masked, address, "affinity_sb")
    pre = expert_mask is not None
    weight = _load_at(expert_mask, address, "mask_sb") if pre else affinity
    d_bias = None if down_proj_bias is None else load_down_bias(down_proj_bias, expert, shard, dtype, 1)
    if pre:
        scaled = nl.ndarray((1, 1, x.shape[2]), dtype, name="scaled_hidden_sb")
        nisa.tensor_scalar(scaled[:, 0], x[row:row + 1, 0], nl.multiply, affinity)
        column = transpose_tokens(scaled, 1, shard, dtype)
    else:
        column = x_t[:, :, row:row + 1]
    for piece, part in _expert_pieces(expert, weights, gate_up_proj_weight, down_proj_weight, shard, dtype):
        gu_bias = None if gate_and_up_proj_bias is None else load_gate_up_bias(gate_and_up_proj_bias, expert, part,
                                                                                dtype)
        h = gate_up_activation(column, weights[0], 1, part, activation, gu_bias, dtype)
        _accumulate(acc, h, weights[1], 0, 1, d_bias if piece == 0 else None, weight, part)


def _expert_pieces(expert, weights, gate_up_proj_weight, down_proj_weight, shard: MlpShard, dtype):
    """Load the expert's weights piece by piece -- one piece when they fit SBUF (see
    :func:`~nxd_moe.nki_kernels.kernels.expert_mlp.weight_chunks`) -- yielding ``(index, shard of the piece)``.
    The down projection is linear in the intermediate columns, so each piece's output adds into the sum; the
    down bias belongs to the expert and is added with piece 0 only."""
    chunks = weight_chunks(shard, dtype.itemsize)
    for piece in nl.affine_range(len(chunks)):
        part = replace(shard, i_range=chunks[piece])
        load_weights(*weights, gate_up_proj_weight, down_proj_weight, expert, part, nisa.oob_mode.error)
        yield piece, part


def _load_at(tensor: NkiTensor, address, name: str):
    value = nl.ndarray((1, 1), tensor.dtype, name=name)
    nisa.dma_copy(value, tensor.ap([[1, 1], [1, 1]], scalar_offset=address, indirect_dim=0))
    return value


def _accumulate(acc, h, w_d, token0: int, num_tokens: int, d_bias, weight, shard: MlpShard) -> None:
    """``acc += (h.T @ w_d + b_d) * weight`` for ``num_tokens`` tokens (``weight`` one value per token)."""
    chunks = tiles(0, shard.h_out_width, HIDDEN_CHUNK)
    for c in nl.affine_range(len(chunks)):
        c0, c1 = chunks[c]
        y = down_projection(h, w_d, token0, num_tokens, c0, c1, shard)
        if d_bias is not None:
            biased = nl.ndarray(y.shape, nl.float32, name="biased_sb")
            nisa.tensor_tensor(biased, y, d_bias[:num_tokens, c0:c1], nl.add)
            y = biased
        nisa.scalar_tensor_tensor(acc[:, c0:c1], y, nl.multiply, weight, nl.add, acc[:, c0:c1])


def _store_rows(output, acc, token_tiles, dtype) -> None:
    for j, (t0, t1) in enumerate(token_tiles):
        rows = nl.ndarray((t1 - t0, output.shape[1]), dtype, name="output_rows_sb")
        nisa.tensor_copy(rows, acc[:t1 - t0, j])
        nisa.dma_copy(output[t0:t1, :], rows)

