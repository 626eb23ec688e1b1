"""One block of the blockwise matmul, as every BWMM kernel computes it (the NKI library's ``compute_one_block``):
read the block's token ids and expert, load that expert's weights (or skip the load), gather the token rows and
affinities, run the expert MLP, and read-modify-write the output rows.

The inputs follow NKI's contract (reference section 1.2):

- ``hidden_states (T_rows, H)``: ``T_rows = T + 1`` with an all-zero row ``T`` when padding slots hold ``T``
  (token skipping off), or ``T`` when they hold ``-1`` (token skipping on: padded rows are never transferred);
- ``expert_affinities_masked (T_rows * E, 1)``: the router weights, zero off the chosen experts, addressed by
  ``token * E + expert``;
- ``gate_up_proj_weight (E, H, 2, I)`` (``(E, H, 1, I)`` for a non-GLU MLP), ``down_proj_weight (E, I, H)``,
  optional ``gate_and_up_proj_bias (E, 2, I)`` and ``down_proj_bias (E, H)``;
- ``token_position_to_id (N * B,)`` int32, ``block_to_expert (N, 1)`` int32.

``block`` is a Python int in a static loop, or an int32 ``(1, 1)`` SBUF tensor holding the block index in a dynamic
loop, in which case every access that depends on it uses it as a runtime ``scalar_offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.moe_configs import SkipMode
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.dtypes import is_integer
from nxd_moe.nki_kernels.hardware import PMAX
from nxd_moe.nki_kernels.kernels.expert_mlp import (
    HIDDEN_CHUNK,
    ExpertAffinityScaleMode,
    MlpShard,
    array_shape,
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
from nxd_moe.nki_kernels.kernels.tiling import tiles
from nxd_moe.nki_kernels.machine import counted_once_per_signature
from nxd_moe.nki_kernels.tensor import NkiTensor, scalar_value

NO_SKIP = SkipMode(False, False)


@dataclass(frozen=True)
class BlockwiseInputs:
    """A BWMM kernel's HBM tensors and static settings, checked against NKI's contract."""

    hidden_states: NkiTensor
    expert_affinities_masked: NkiTensor
    gate_up_proj_weight: NkiTensor
    down_proj_weight: NkiTensor
    token_position_to_id: NkiTensor
    block_to_expert: NkiTensor
    gate_and_up_proj_bias: NkiTensor | None
    down_proj_bias: NkiTensor | None
    block_size: int
    activation: ExpertActivation
    skip_dma: SkipMode
    scaling_mode: ExpertAffinityScaleMode
    accumulate: bool
    output: NkiTensor | None = None
    output_slot: int = 0

    @classmethod
    def create(cls, hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
               token_position_to_id, block_to_expert, block_size, gate_and_up_proj_bias, down_proj_bias,
               activation, skip_dma, expert_affinities_scaling_mode,
               is_tensor_update_accumulating, gate_up_proj_scale=None, down_proj_scale=None,
               weight_format: str = "bf16") -> "BlockwiseInputs":
        """The blockwise kernels' shared prologue: quantized weights taken with their scales (``weight_format``,
        :func:`~nxd_moe.nki_kernels.kernels.expert_mlp.quantized_inputs`), every input checked, the options
        normalised."""
        gate_up_proj_weight, down_proj_weight = quantized_inputs(gate_up_proj_weight, down_proj_weight,
                                                                 gate_up_proj_scale, down_proj_scale, weight_format,
                                                                 hidden_states.dtype, activation.glu_mlp)
        skip_dma = SkipMode(*skip_dma)
        mode = ExpertAffinityScaleMode(expert_affinities_scaling_mode)
        rows, hidden = array_shape(hidden_states, "hidden_states", 2)
        experts, num_proj, inter = check_expert_weights(gate_up_proj_weight, down_proj_weight, hidden, activation)
        if expert_affinities_masked.shape != (rows * experts, 1):
            raise ValueError(f"expert_affinities_masked must be (T_rows * E, 1) = {(rows * experts, 1)}, got "
                             f"{expert_affinities_masked.shape}")
        blocks = array_shape(block_to_expert, "block_to_expert", 2)[0]
        if block_to_expert.shape != (blocks, 1) or not is_integer(block_to_expert.dtype):
            raise ValueError(f"block_to_expert must be an int32 (N, 1) tensor, got {block_to_expert!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if token_position_to_id.shape != (blocks * block_size,) or not is_integer(token_position_to_id.dtype):
            raise ValueError(f"token_position_to_id must be an int32 (N * B,) = ({blocks * block_size},) tensor, got "
                             f"{token_position_to_id!r}")
        for t, name, shape in ((gate_and_up_proj_bias, "gate_and_up_proj_bias", (experts, num_proj, inter)),
                               (down_proj_bias, "down_proj_bias", (experts, hidden))):
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} must be {shape}, got {t.shape}")
        for t, name in ((gate_up_proj_weight, "gate_up_proj_weight"), (down_proj_weight, "down_proj_weight")):
            if t.dtype != hidden_states.dtype:
                raise TypeError(f"{name} dtype {t.dtype} must be hidden_states' dtype {hidden_states.dtype}")
        return cls(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                   token_position_to_id, block_to_expert, gate_and_up_proj_bias, down_proj_bias, block_size,
                   activation, skip_dma, mode, bool(is_tensor_update_accumulating))

    @property
    def rows(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def hidden(self) -> int:
        return self.hidden_states.shape[1]

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj_weight.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.block_to_expert.shape[0]

    @property
    def intermediate(self) -> int:
        """I as stored; the kernels compute only the first ``intermediate_size_actual`` columns."""
        return self.gate_up_proj_weight.shape[3]

    @property
    def intermediate_actual(self) -> int:
        return computed_intermediate(self.activation, self.intermediate)

    @property
    def dtype(self) -> np.dtype:
        return self.hidden_states.dtype

    @property
    def token_oob(self) -> str:
        return nisa.oob_mode.skip if self.skip_dma.skip_token else nisa.oob_mode.error

    def shard(self, h_in: tuple[int, int], h_out: tuple[int, int], i_range: tuple[int, int]) -> MlpShard:
        return MlpShard(self.hidden, self.intermediate, h_in, h_out, i_range, self.activation.glu_mlp)

    def with_output(self, output: NkiTensor, slot: int = 0) -> "BlockwiseInputs":
        return replace(self, output=output, output_slot=slot)


# ----------------------------------------------------------------------------------------------------------------
# block-indexed reads


def block_row(tensor: NkiTensor, pattern, block, offset: int = 0):
    """An access pattern into row ``block`` of ``tensor`` (dim 0): static offset or runtime ``scalar_offset``."""
    if isinstance(block, int):
        return tensor.ap(pattern, offset=offset + block * int(np.prod(tensor.shape[1:])))
    return tensor.ap(pattern, offset=offset, scalar_offset=block, indirect_dim=0)


def load_block_expert(block_to_expert: NkiTensor, block, partitions: int = 1):
    """``(partitions, 1)`` int32: the block's expert on every partition (a stride-0 DMA broadcast)."""
    expert = nl.ndarray((partitions, 1), nl.int32, name="block_expert_sb")
    nisa.dma_copy(expert, block_row(block_to_expert, [[0, partitions], [1, 1]], block))
    return expert


def load_token_ids(io: BlockwiseInputs, block):
    """``(128, NT)`` int32: slot ``j*128 + p`` of the block on partition ``p`` of column ``j``."""
    num_tiles = -(-io.block_size // PMAX)
    ids = nl.ndarray((PMAX, num_tiles), nl.int32, name="token_ids_sb")
    if isinstance(block, int):
        start, scalar = block * io.block_size, None
    else:
        # token_position_to_id is flat: the block's first slot is block * B, computed on the device.
        scalar = nl.ndarray((1, 1), nl.int32, name="block_slot_sb")
        nisa.tensor_scalar(scalar, block, nl.multiply, io.block_size)
        start = 0
    for j, (s0, s1) in enumerate(tiles(0, io.block_size, PMAX)):
        src = io.token_position_to_id.ap([[1, s1 - s0], [1, 1]], offset=start + s0, scalar_offset=scalar)
        nisa.dma_copy(ids[:s1 - s0, j:j + 1], src)
    return ids


def token_tiles(io: BlockwiseInputs) -> list[tuple[int, int]]:
    return tiles(0, io.block_size, PMAX)


def gather_affinities(io: BlockwiseInputs, ids, block):
    """``(128, NT)``: each slot's affinity for the block's expert, read at ``token * E + expert``. Padding slots
    (``-1``) give a negative address, which is out of bounds: skipped, and the pre-zeroed tile keeps 0."""
    addresses = nl.ndarray(ids.shape, nl.int32, name="affinity_address_sb")
    expert = load_block_expert(io.block_to_expert, block, PMAX)
    nisa.tensor_scalar(addresses, ids, nl.multiply, io.num_experts, op1=nl.add, operand1=expert)
    affinities = nl.ndarray(ids.shape, io.expert_affinities_masked.dtype, name="affinities_sb")
    if io.skip_dma.skip_token:
        nisa.memset(affinities, 0.0)
    for j, (s0, s1) in enumerate(token_tiles(io)):
        src = io.expert_affinities_masked.ap([[1, s1 - s0], [1, 1]], vector_offset=addresses[:s1 - s0, j:j + 1])
        nisa.dma_copy(affinities[:s1 - s0, j:j + 1], src, oob_mode=io.token_oob)
    return affinities


def gather_hidden(io: BlockwiseInputs, ids, shard: MlpShard, affinities):
    """``(128, NT, Hin)``: the block's token rows (this core's hidden columns), scaled by the affinity in
    PRE_SCALE mode. Skipped padding rows stay zero."""
    h0, h1 = shard.h_in
    x = nl.ndarray((PMAX, len(token_tiles(io)), h1 - h0), io.dtype, name="hidden_sb")
    if io.skip_dma.skip_token:
        nisa.memset(x, 0.0)
    for j, (s0, s1) in enumerate(token_tiles(io)):
        src = io.hidden_states.ap([[io.hidden, s1 - s0], [1, h1 - h0]], offset=h0, vector_offset=ids[:s1 - s0, j:j + 1])
        nisa.dma_copy(x[:s1 - s0, j], src, oob_mode=io.token_oob)
        if io.scaling_mode is ExpertAffinityScaleMode.PRE_SCALE:
            nisa.tensor_scalar(x[:s1 - s0, j], x[:s1 - s0, j], nl.multiply, affinities[:s1 - s0, j:j + 1])
    return x


def output_rows(io: BlockwiseInputs, ids_column, num_rows: int, col0: int, col1: int):
    """The output rows of a token tile (a row gather/scatter), columns ``[col0, col1)`` of this core's slot."""
    out = io.output
    row_stride = int(np.prod(out.shape[1:]))
    return out.ap([[row_stride, num_rows], [1, col1 - col0]], offset=io.output_slot * io.hidden + col0,
                  vector_offset=ids_column)


def zero_output_rows(io: BlockwiseInputs, rows: tuple[int, int], cols: tuple[int, int]) -> None:
    """Write zeros into ``output`` rows ``rows``, columns ``cols`` of this core's slot (before accumulating)."""
    zeros = nl.ndarray((PMAX, cols[1] - cols[0]), io.dtype, name="zeros_sb")
    nisa.memset(zeros, 0.0)
    for r0, r1 in tiles(*rows, PMAX):
        if len(io.output.shape) == 3:
            dst = io.output[r0:r1, io.output_slot, cols[0]:cols[1]]
        else:
            dst = io.output[r0:r1, cols[0]:cols[1]]
        nisa.dma_copy(dst, zeros[:r1 - r0])


# ----------------------------------------------------------------------------------------------------------------
# the block


def weight_load_experts(io: BlockwiseInputs, first: int, step: int, count: int) -> NkiTensor:
    """Weight skipping: for the blocks ``first, first+step, ...`` this core computes, in order, the expert whose
    weights to load -- or ``E`` (out of bounds: the load is skipped and the SBUF buffers keep the previous
    block's weights) when it equals the previous block's. Computed on the device into private HBM ``(N, 1)``,
    read per block like ``block_to_expert``."""
    experts = nl.ndarray((1, count), nl.int32, name="core_block_experts_sb")
    nisa.dma_copy(experts, io.block_to_expert.ap([[1, 1], [step, count]], offset=first))
    same = nl.ndarray((1, count), nl.int32, name="same_expert_sb")
    nisa.memset(same, 0)
    if count > 1:
        nisa.tensor_tensor(same[:, 1:], experts[:, 1:], experts[:, :-1], nl.equal)
    # load = expert + same * (E - expert)
    load = nl.ndarray((1, count), nl.int32, name="load_expert_sb")
    nisa.tensor_scalar(load, experts, nl.multiply, -1, op1=nl.add, operand1=io.num_experts)
    nisa.tensor_tensor(load, load, same, nl.multiply)
    nisa.tensor_tensor(load, load, experts, nl.add)
    out = nl.ndarray((io.num_blocks, 1), nl.int32, buffer=nl.private_hbm, name="weight_load_expert")
    nisa.dma_copy(out.ap([[1, 1], [step, count]], offset=first), load)
    return out


def block_signature(io: BlockwiseInputs, block, weights: tuple, shard: MlpShard,
                    weight_experts: NkiTensor | None = None, exchange: str | None = None) -> tuple:
    """What a block's counts depend on: static or dynamic index, the in-bounds and out-of-bounds slots of each
    token tile (token skipping drops rows), and whether its weights are loaded (weight skipping)."""
    index = block if isinstance(block, int) else scalar_value(block)
    ids = io.token_position_to_id.data[index * io.block_size:(index + 1) * io.block_size]
    in_bounds = (ids >= 0) & (ids < io.rows)
    rows = tuple((int(in_bounds[s0:s1].sum()), s1 - s0) for s0, s1 in token_tiles(io))
    loaded = weight_experts is None or int(weight_experts.data[index, 0]) < io.num_experts
    return isinstance(block, int), rows, loaded, exchange


@counted_once_per_signature(block_signature)
def compute_block(io: BlockwiseInputs, block, weights: tuple, shard: MlpShard,
                  weight_experts: NkiTensor | None = None, exchange: str | None = None) -> None:
    """Block ``block`` through its expert into ``io.output`` (this core's share of it).

    ``weights``: the SBUF buffers of :func:`~nxd_moe.nki_kernels.kernels.expert_mlp.allocate_weights`.
    ``weight_experts``: from :func:`weight_load_experts` when weight skipping is on (see
    :func:`resident_weight_skipping`). ``exchange``: ``None``; ``"gate_up"`` (shard-on-H: all-reduce the gate/up
    partial sums over H); ``"down"`` (shard-on-I: each core holds a partial down projection over its I half --
    reduce-scatter over token tiles, each core finishes half).
    """
    ids = load_token_ids(io, block)
    expert = load_block_expert(io.block_to_expert, block)
    d_bias = None if io.down_proj_bias is None else load_down_bias(io.down_proj_bias, expert, shard, io.dtype)
    affinities = gather_affinities(io, ids, block)
    x = gather_hidden(io, ids, shard, affinities)
    x_t = transpose_tokens(x, io.block_size, shard, io.dtype)
    tiles_ = token_tiles(io)
    w_gu, w_d = weights
    chunks = weight_chunks(shard, io.dtype.itemsize)
    if len(chunks) == 1:
        load_expert = expert if weight_experts is None else load_block_expert(weight_experts, block)
        oob = nisa.oob_mode.error if weight_experts is None else nisa.oob_mode.skip
        load_weights(w_gu, w_d, io.gate_up_proj_weight, io.down_proj_weight, load_expert, shard, oob)
        gu_bias = None if io.gate_and_up_proj_bias is None else load_gate_up_bias(io.gate_and_up_proj_bias, expert,
                                                                                   shard, io.dtype)
        h = gate_up_activation(x_t, w_gu, io.block_size, shard, io.activation, gu_bias, io.dtype,
                               sum_across_cores=exchange == "gate_up")
        if exchange != "down":
            for j in nl.affine_range(len(tiles_)):
                s0, s1 = tiles_[j]
                _finish_tile(io, j, ids, affinities, d_bias, shard,
                             lambda c0, c1, s0=s0, s1=s1: down_projection(h, w_d, s0, s1 - s0, c0, c1, shard))
            return

        def rows(j):
            return _down_rows(h, w_d, tiles_[j], shard)
    else:
        y = _streamed_down(io, x_t, expert, weights, shard, chunks, sum_across_cores=exchange == "gate_up")
        if exchange != "down":
            for j in nl.affine_range(len(tiles_)):
                s0, s1 = tiles_[j]
                _finish_tile(io, j, ids, affinities, d_bias, shard, lambda c0, c1, j=j, n=s1 - s0: y[:n, j, c0:c1])
            return

        def rows(j):
            return y[:tiles_[j][1] - tiles_[j][0], j]
    half = len(tiles_) // 2
    peer = 1 - nl.program_id(0)
    for m in nl.affine_range(half):
        own, other = nl.program_id(0) * half + m, peer * half + m
        mine, theirs = rows(own), rows(other)
        received = nl.ndarray(mine.shape, nl.float32, name="peer_down_sb")
        nisa.sendrecv(src=theirs, dst=received, send_to_rank=peer, recv_from_rank=peer, pipe_id=0)
        nisa.tensor_tensor(mine, mine, received, nl.add)
        _finish_tile(io, own, ids, affinities, d_bias, shard, lambda c0, c1, y=mine: y[:, c0:c1])


def check_conditions(conditions, iterations: int, expected: str) -> None:
    """``conditions``, when given, must be an int32 ``(iterations + 1,)`` tensor (``expected``: that shape in the
    kernel's terms, for the message)."""
    if conditions is not None and (conditions.shape != (iterations + 1,) or not is_integer(conditions.dtype)):
        raise ValueError(f"conditions must be an int32 {expected} = ({iterations + 1},) tensor, got {conditions!r}")


def dynamic_loop(conditions: NkiTensor, start: int) -> Iterator[NkiTensor]:
    """The hardware loop that follows ``start`` static iterations: ``conditions (iterations + 1,)`` (1 = the
    iteration has an active block, a trailing 0) is summed on the device into a register, the trip count, so
    iterations past the active ones never run. Yields, for each iteration, an int32 ``(1, 1)`` SBUF tensor holding
    its index (``start``, ``start + 1``, ...), to address the block with at runtime."""
    flags = nl.ndarray((1, conditions.shape[0]), nl.int32, name="conditions_sb")
    nisa.dma_copy(flags, conditions)
    active = nl.ndarray((1, 1), nl.int32, name="active_iterations_sb")
    nisa.tensor_reduce(active, nl.add, flags, axis=1, keepdims=True)
    trip_count = nisa.register_alloc()
    nisa.register_load(trip_count, active)
    index = nl.ndarray((1, 1), nl.int32, name="iteration_sb")
    nisa.memset(index, start)
    for _ in nl.dynamic_range(start, trip_count):
        yield index
        nisa.tensor_scalar(index, index, nl.add, 1)


def resident_weight_skipping(io: BlockwiseInputs, shard: MlpShard) -> bool:
    """Weight skipping applies: it is on, and the expert's weights fit SBUF whole, so they can stay resident."""
    return io.skip_dma.skip_weight and len(weight_chunks(shard, io.dtype.itemsize)) == 1


def _streamed_down(io: BlockwiseInputs, x_t, expert, weights: tuple, shard: MlpShard, chunks, sum_across_cores: bool):
    """``(128, NT, Hout)`` fp32: the block's down projection with the expert's intermediate columns streamed in
    ``chunks`` (weights, activation and down partial per chunk, partials summed in SBUF)."""
    w_gu, w_d = weights
    tiles_ = token_tiles(io)
    cols = tiles(0, shard.h_out_width, HIDDEN_CHUNK)
    y = nl.ndarray((PMAX, len(tiles_), shard.h_out_width), nl.float32, name="down_acc_sb")
    for ci in nl.affine_range(len(chunks)):
        part = replace(shard, i_range=chunks[ci])
        load_weights(w_gu, w_d, io.gate_up_proj_weight, io.down_proj_weight, expert, part, nisa.oob_mode.error)
        gu_bias = None if io.gate_and_up_proj_bias is None else load_gate_up_bias(io.gate_and_up_proj_bias, expert,
                                                                                   part, io.dtype)
        h = gate_up_activation(x_t, w_gu, io.block_size, part, io.activation, gu_bias, io.dtype, sum_across_cores)
        for j in nl.affine_range(len(tiles_)):
            s0, s1 = tiles_[j]
            for c in nl.affine_range(len(cols)):
                c0, c1 = cols[c]
                partial = down_projection(h, w_d, s0, s1 - s0, c0, c1, part)
                acc = y[:s1 - s0, j, c0:c1]
                if ci == 0:
                    nisa.tensor_copy(acc, partial)
                else:
                    nisa.tensor_tensor(acc, acc, partial, nl.add)
    return y


def _down_rows(h, w_d, token_tile: tuple[int, int], shard: MlpShard):
    """``(tsz, Hout)`` fp32 SBUF: the down projection of one token tile (for the shard-on-I exchange)."""
    s0, s1 = token_tile
    y = nl.ndarray((s1 - s0, shard.h_out_width), nl.float32, name="down_sb")
    chunks = tiles(0, shard.h_out_width, HIDDEN_CHUNK)
    for c in nl.affine_range(len(chunks)):
        c0, c1 = chunks[c]
        nisa.tensor_copy(y[:, c0:c1], down_projection(h, w_d, s0, s1 - s0, c0, c1, shard))
    return y


def _finish_tile(io: BlockwiseInputs, j: int, ids, affinities, d_bias, shard: MlpShard, rows_of) -> None:
    """Token tile ``j``: ``out[ids] = old + (y + b_d) * affinity`` for this core's hidden columns; ``rows_of(c0, c1)``
    gives ``y``'s columns ``[c0, c1)`` (a PSUM bank or an SBUF view)."""
    s0, s1 = token_tiles(io)[j]
    num = s1 - s0
    col0, col1 = shard.h_out
    ids_column = ids[:num, j:j + 1]
    old = None
    if io.accumulate:
        # Rows skipped here (padding) are never stored either, so old needs no zeroing.
        old = nl.ndarray((num, col1 - col0), io.output.dtype, name="old_rows_sb")
        nisa.dma_copy(old, output_rows(io, ids_column, num, col0, col1), oob_mode=io.token_oob)
    new = nl.ndarray((num, col1 - col0), io.output.dtype, name="new_rows_sb")
    weight = affinities[:num, j:j + 1]
    chunks = tiles(0, col1 - col0, HIDDEN_CHUNK)
    for c in nl.affine_range(len(chunks)):
        c0, c1 = chunks[c]
        y = rows_of(c0, c1)
        if d_bias is not None:
            biased = nl.ndarray(y.shape, nl.float32, name="biased_sb")
            nisa.tensor_tensor(biased, y, d_bias[:num, c0:c1], nl.add)
            y = biased
        post = io.scaling_mode is ExpertAffinityScaleMode.POST_SCALE
        if old is not None and post:
            nisa.scalar_tensor_tensor(new[:, c0:c1], y, nl.multiply, weight, nl.add, old[:, c0:c1])
        elif old is not None:
            nisa.tensor_tensor(new[:, c0:c1], y, old[:, c0:c1], nl.add)
        elif post:
            nisa.tensor_scalar(new[:, c0:c1], y, nl.multiply, weight)
        else:
            nisa.tensor_copy(new[:, c0:c1], y)
    nisa.dma_copy(output_rows(io, ids_column, num, col0, col1), new, oob_mode=io.token_oob)
