"""Blockwise matmul, LNC2 sharded over blocks ("block parallel"): each core computes whole expert MLPs for its
blocks -- HI_LO: the first half of the blocks on core 0, the second half on core 1; PING_PONG: even blocks on core 0,
odd on core 1 -- and accumulates into its own output slot ``output[:, core, :]``. At the end the cores meet at a
barrier and each sums one half of the rows of the two slots into slot 0 inside the DMA engines (``dma_compute``).

With ``conditions`` (one per iteration of this core's loop, a trailing 0; see :func:`shard_conditions`) the blocks
after the first ``num_static_blocks`` run in a hardware loop whose trip count is reduced from the conditions on the
device: both cores run the same number of iterations (their control flow must not differ), computing the active
blocks and, where the active count is not a multiple of two, one padding block. Weight skipping compares each
block with the previous block *of the same core*.
"""

from __future__ import annotations

import numpy as np

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.moe_configs import BlockShardStrategy, SkipMode
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.hardware import PMAX
from nxd_moe.nki_kernels.kernels.block import (
    NO_SKIP,
    BlockwiseInputs,
    check_conditions,
    compute_block,
    dynamic_loop,
    resident_weight_skipping,
    weight_load_experts,
    zero_output_rows,
)
from nxd_moe.nki_kernels.kernels.expert_mlp import ExpertAffinityScaleMode, allocate_weights
from nxd_moe.nki_kernels.kernels.tiling import split, tiles


def core_blocks(num_blocks: int, cores: int, core: int, strategy: BlockShardStrategy) -> tuple[int, int, int]:
    """``(first, step, count)``: the global indices of the blocks ``core`` computes, in order."""
    per_core = num_blocks // cores
    if BlockShardStrategy(strategy) is BlockShardStrategy.PING_PONG:
        return core, cores, per_core
    return core * per_core, 1, per_core


def shard_conditions(conditions: np.ndarray, cores: int, strategy: BlockShardStrategy) -> np.ndarray:
    """``(N,)`` block conditions -> ``(N / cores + 1,)`` int32: whether iteration ``j`` of the loop has an active
    block on any core, plus a trailing 0. Active blocks are a prefix, so core 0's block of an iteration is active
    whenever any core's is: PING_PONG reads ``conditions[0::2]``, HI_LO the first half."""
    per_core = len(conditions) // cores
    first, step, _ = core_blocks(len(conditions), cores, 0, strategy)
    own = np.asarray(conditions, dtype=np.int32)[first:first + step * per_core:step]
    return np.concatenate([own, np.zeros(1, dtype=np.int32)])


def bwmm_shard_on_block(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                        token_position_to_id, block_to_expert, block_size: int, gate_and_up_proj_bias=None,
                        down_proj_bias=None, conditions=None, *, activation: ExpertActivation,
                        block_sharding_strategy: BlockShardStrategy = BlockShardStrategy.PING_PONG,
                        num_static_blocks: int | None = None, skip_dma: SkipMode = NO_SKIP,
                        expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
                        is_tensor_update_accumulating: bool = True,
                        gate_up_proj_scale=None, down_proj_scale=None, weight_format: str = "bf16"):
    """Returns ``output (T_rows, cores, H)``; the result is ``output[:, 0]``. ``N`` must be a multiple of the
    number of cores. ``num_static_blocks``: blocks always computed (rounded up to whole iterations; default all
    of them without ``conditions``, none with). Every slot is zero-initialised: the final sum reads both."""
    io = BlockwiseInputs.create(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                                token_position_to_id, block_to_expert, block_size, gate_and_up_proj_bias,
                                down_proj_bias, activation, skip_dma, expert_affinities_scaling_mode,
                                is_tensor_update_accumulating, gate_up_proj_scale, down_proj_scale, weight_format)
    cores, core = nl.num_programs(0), nl.program_id(0)
    if io.num_blocks % cores:
        raise ValueError(f"bwmm_shard_on_block on {cores} cores needs a number of blocks divisible by {cores}, got "
                         f"{io.num_blocks} (pad the mapping with an empty block)")
    first, step, per_core = core_blocks(io.num_blocks, cores, core, block_sharding_strategy)
    check_conditions(conditions, per_core, "(N / cores + 1,)")
    if num_static_blocks is None:
        num_static_blocks = io.num_blocks if conditions is None else 0
    static = min(-(-num_static_blocks // cores), per_core)
    shard = io.shard(h_in=(0, io.hidden), h_out=(0, io.hidden), i_range=(0, io.intermediate_actual))
    output = nl.ndarray((io.rows, cores, io.hidden), io.dtype, buffer=nl.shared_hbm, name="output")
    io = io.with_output(output, slot=core)
    zero_output_rows(io, (0, io.rows), (0, io.hidden))
    weights = allocate_weights(shard, io.dtype)
    weight_experts = weight_load_experts(io, first, step, per_core) if resident_weight_skipping(io, shard) else None
    for j in nl.sequential_range(static):
        compute_block(io, first + step * j, weights, shard, weight_experts)
    if conditions is not None:
        block = nl.ndarray((1, 1), nl.int32, name="block_index_sb")
        for position in dynamic_loop(conditions, static):
            nisa.tensor_scalar(block, position, nl.multiply, step, op1=nl.add, operand1=first)
            compute_block(io, block, weights, shard, weight_experts)
    if cores == 2:
        nisa.core_barrier(output, (0, 1))
        rows = tiles(*split(io.rows, cores, core), PMAX)
        for r in nl.affine_range(len(rows)):
            r0, r1 = rows[r]
            nisa.dma_compute(output[r0:r1, 0, :], [output[r0:r1, 0, :], output[r0:r1, 1, :]], nl.add)
    return output
