"""Blockwise matmul, LNC2 sharded on the hidden dimension (NxD's default LNC2 sharding; one core: the whole layer).

Each core loads its half of H of every token row and of the expert's weights, contracts gate/up over its half
and all-reduces the fp32 partial sums with its peer (``sendrecv``), so both hold the full activations; the down
projection then produces each core's half of H, written to its own output columns. Each core reads and writes
only its own columns of ``output``, so no core barrier is needed between blocks.
"""

from __future__ import annotations

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.moe_configs import SkipMode
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.kernels.block import (
    NO_SKIP,
    BlockwiseInputs,
    compute_block,
    resident_weight_skipping,
    weight_load_experts,
    zero_output_rows,
)
from nxd_moe.nki_kernels.kernels.expert_mlp import ExpertAffinityScaleMode, allocate_weights
from nxd_moe.nki_kernels.kernels.tiling import split


def bwmm_shard_on_H(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                    token_position_to_id, block_to_expert, block_size: int, gate_and_up_proj_bias=None,
                    down_proj_bias=None, *, activation: ExpertActivation, skip_dma: SkipMode = NO_SKIP,
                    expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
                    is_tensor_update_accumulating: bool = True,
                    gate_up_proj_scale=None, down_proj_scale=None, weight_format: str = "bf16"):
    """Every block in a static loop. Returns ``output (T_rows, H)``; with ``is_tensor_update_accumulating`` it is
    zero-initialised and each block adds its contribution (top-k > 1), otherwise each row is written once.
    Inputs: see :mod:`nxd_moe.nki_kernels.kernels.block`."""
    io = BlockwiseInputs.create(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                                token_position_to_id, block_to_expert, block_size, gate_and_up_proj_bias,
                                down_proj_bias, activation, skip_dma, expert_affinities_scaling_mode,
                                is_tensor_update_accumulating, gate_up_proj_scale, down_proj_scale, weight_format)
    columns = split(io.hidden, nl.num_programs(0), nl.program_id(0))
    shard = io.shard(h_in=columns, h_out=columns, i_range=(0, io.intermediate_actual))
    output = nl.ndarray((io.rows, io.hidden), io.dtype, buffer=nl.shared_hbm, name="output")
    io = io.with_output(output)
    if io.accumulate:
        zero_output_rows(io, (0, io.rows), columns)
    weights = allocate_weights(shard, io.dtype)
    weight_experts = weight_load_experts(io, 0, 1, io.num_blocks) if resident_weight_skipping(io, shard) else None
    exchange = "gate_up" if nl.num_programs(0) == 2 else None
    for block in nl.sequential_range(io.num_blocks):
        compute_block(io, block, weights, shard, weight_experts, exchange)
    return output
