"""Blockwise matmul, LNC2 sharded on the intermediate dimension, with the hybrid static + dynamic-while loop.

Each core uses its half of I: all of H of every token row, its half of the gate/up columns and of the down rows.
After the down projection each core holds a partial ``(B, H)`` sum; they reduce-scatter it over token tiles
(``sendrecv`` the peer's tiles, add the received ones), and each core finishes and stores half of the block's
tokens. A token may sit in different halves of consecutive blocks, so the cores meet at a ``core_barrier`` after
every block before the next read-modify-write of the output.

The block loop (NKI library ``blockwise_mm_baseline_shard_intermediate_hybrid``): the first
``num_static_block`` blocks in a static loop; then the number of active blocks, ``sum(conditions)``, is reduced on
the device, loaded into a register, and a hardware loop runs the remaining active blocks -- fully padded blocks
at the end are never computed. This relies on active blocks being a prefix, which the token-to-block mapping
guarantees.
"""

from __future__ import annotations

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.moe_configs import SkipMode
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.kernels.block import (
    NO_SKIP,
    BlockwiseInputs,
    check_conditions,
    compute_block,
    dynamic_loop,
    resident_weight_skipping,
    token_tiles,
    weight_load_experts,
    zero_output_rows,
)
from nxd_moe.nki_kernels.kernels.expert_mlp import ExpertAffinityScaleMode, allocate_weights
from nxd_moe.nki_kernels.kernels.tiling import split


def bwmm_shard_on_I(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                    token_position_to_id, block_to_expert, block_size: int, gate_and_up_proj_bias=None,
                    down_proj_bias=None, conditions=None, *, activation: ExpertActivation,
                    num_static_block: int | None = None, skip_dma: SkipMode = NO_SKIP,
                    expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
                    is_tensor_update_accumulating: bool = True,
                    gate_up_proj_scale=None, down_proj_scale=None, weight_format: str = "bf16"):
    """Returns ``output (T_rows, H)``.

    ``conditions (N + 1,)`` int32 (1 = the block holds a real token, the last entry 0) switches on the dynamic
    loop; without it every block runs in the static loop. ``num_static_block``: blocks always computed (default
    ``N - E``, the NKI library's; NxD passes ``ceil(T * k / B)``). With two cores ``block_size`` must be a
    multiple of 256 (each core finishes whole 128-token tiles).
    """
    io = BlockwiseInputs.create(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                                token_position_to_id, block_to_expert, block_size, gate_and_up_proj_bias,
                                down_proj_bias, activation, skip_dma, expert_affinities_scaling_mode,
                                is_tensor_update_accumulating, gate_up_proj_scale, down_proj_scale, weight_format)
    cores, core = nl.num_programs(0), nl.program_id(0)
    if cores == 2 and (io.block_size % 256 or len(token_tiles(io)) % 2):
        raise ValueError(f"bwmm_shard_on_I with two cores needs block_size % 256 == 0, got {io.block_size}")
    num_blocks = io.num_blocks
    check_conditions(conditions, num_blocks, "(N + 1,)")
    static = num_blocks if conditions is None else num_blocks - io.num_experts if num_static_block is None \
        else num_static_block
    static = min(max(static, 0), num_blocks)
    shard = io.shard(h_in=(0, io.hidden), h_out=(0, io.hidden), i_range=split(io.intermediate_actual, cores, core))
    output = nl.ndarray((io.rows, io.hidden), io.dtype, buffer=nl.shared_hbm, name="output")
    io = io.with_output(output)
    if io.accumulate:
        zero_output_rows(io, split(io.rows, cores, core), (0, io.hidden))
        nisa.core_barrier(output, (0, 1))
    weights = allocate_weights(shard, io.dtype)
    weight_experts = weight_load_experts(io, 0, 1, num_blocks) if resident_weight_skipping(io, shard) else None
    exchange = "down" if cores == 2 else None
    for block in nl.sequential_range(static):
        compute_block(io, block, weights, shard, weight_experts, exchange)
        nisa.core_barrier(output, (0, 1))
    if conditions is None:
        return output
    # One block per iteration: the iteration index is the block index.
    for block in dynamic_loop(conditions, static):
        compute_block(io, block, weights, shard, weight_experts, exchange)
        nisa.core_barrier(output, (0, 1))
    return output
