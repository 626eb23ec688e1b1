"""Dropless blockwise prefill that skips the padding blocks with an on-device while loop.

The worst-case block count ``N`` provisions for the most skewed routing; a typical routing fills far fewer
blocks, and the rest hold only padding. NxD's dynamic-while kernels (``use_shard_on_intermediate_dynamic_while``,
``use_shard_on_block_dynamic_while``) compute a static prefix of blocks unconditionally, then loop over the
remaining blocks while the ``conditions`` vector says the next block holds a real token -- the trip count is
read on the device, so the graph stays static and the skipped blocks cost nothing.

Here the same schedule runs as one graph everywhere (see :mod:`nxd_moe.experts.while_loop`):

- blocks ``[0, S)`` go through one grouped matmul, ``S = num_static_blocks`` (NxD's default
  ``ceil(T*k / B)``: the blocks a perfectly balanced routing fills);
- then, while ``conditions[b] == 1``, each iteration computes ``P`` blocks ``b .. b+P-1`` through their
  experts and writes them into the block output; ``P = 2`` for shard-on-block (NxD hands one block to each of
  the two cores of a logical NeuronCore and tests only every second condition), ``P = 1`` for
  shard-on-intermediate (the two cores split ``I`` inside one block, which does not change the schedule);
- tokens then gather their ``k`` rows as in :func:`~nxd_moe.experts.blockwise.blockwise_forward`.

Active blocks are a prefix (the mapping puts padding blocks last), which is what makes "stop at the first
inactive block" skip exactly the padding. The loop also counts, on the device, the blocks it computed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nxd_moe.experts.blockwise import gather_block_inputs
from nxd_moe.experts.mlp import ExpertWeights, ExpertWeightsLayout, combine, grouped_expert_mlp
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import BlockMapping, num_static_blocks
from nxd_moe.experts.while_loop import while_loop_into
from nxd_moe.moe_configs import BlockwiseMatmulConfig


class DynamicWhileResult(NamedTuple):
    """``output (T, H)``; ``computed_blocks``: 0-d int64 on the output's device, blocks actually computed
    (static prefix + loop iterations), counted inside the loop."""

    output: torch.Tensor
    computed_blocks: torch.Tensor


def blocks_per_iteration(config: BlockwiseMatmulConfig) -> int:
    """2 for shard-on-block (one block per core of a logical NeuronCore), else 1."""
    return 2 if config.use_shard_on_block_dynamic_while else 1


def static_block_count(config: BlockwiseMatmulConfig, num_tokens: int, top_k: int, num_blocks: int) -> int:
    """``config.num_static_blocks`` if set, else NxD's ``ceil(T*k / B)``; at most ``num_blocks``."""
    static = config.num_static_blocks
    if static is None:
        static = num_static_blocks(num_tokens, top_k, config.block_size)
    return min(static, num_blocks)


def dynamic_while_blockwise_forward(
    hidden_states: torch.Tensor,
    routing: Routing,
    mapping: BlockMapping,
    weights: ExpertWeights,
    config: BlockwiseMatmulConfig,
    matmul_impl: str = "auto",
) -> DynamicWhileResult:
    """``(T, H) -> (T, H)``, computing only the static prefix and the active blocks after it.

    ``matmul_impl`` applies to the static prefix; the loop body multiplies ``P`` blocks by their experts'
    weights directly (``gather``), as a kernel loads one block's expert weights per iteration.
    """
    # shape[0], not the num_blocks property: Dynamo 2.9 cannot use a NamedTuple property in builtins (min).
    n_blocks, block_size = mapping.block_to_expert.shape[0], mapping.block_size
    step = blocks_per_iteration(config)
    static = static_block_count(config, hidden_states.shape[0], routing.expert_index.shape[1], n_blocks)
    x = gather_block_inputs(hidden_states, routing, mapping)  # (N, B, H)
    out = x.new_zeros(n_blocks, block_size, x.shape[-1])
    if static:
        y = grouped_expert_mlp(x[:static], weights, mapping.block_to_expert[:static],
                               mapping.conditions[:static].bool(), matmul_impl)
        out = torch.cat([y, out[static:]])
    computed = torch.full((), static, dtype=torch.int64, device=x.device)
    if static < n_blocks:
        # Trailing zeros: the loop reads conditions[b] for b up to N - 1 + P, and must stop there.
        conditions = torch.cat([mapping.conditions, mapping.conditions.new_zeros(step)])
        start = torch.full((), static, dtype=torch.int64, device=x.device)
        weight_tensors, layout = weights.flatten()
        loop = _BlockLoop(step, n_blocks, layout)
        _, computed, out = while_loop_into(out, loop.next_block_active, loop.compute_blocks, (start, computed),
                                           (conditions, x, mapping.block_to_expert, *weight_tensors))
    output = combine(out.reshape(-1, out.shape[-1]), mapping.token_slot, routing.pair_weights(), routing.has_padding)
    return DynamicWhileResult(output, computed)


class _BlockLoop(NamedTuple):
    """Condition and body of the block loop. Every tensor they read arrives as an argument (the XLA lowering
    traces them on placeholders); only Python constants and the activation (no tensors) are held here.

    Carried: ``(next_block, computed)``; invariants: ``(conditions (N+P,), x (N, B, H), block_to_expert (N,),
    *weight tensors)`` (the stored tensors of :meth:`ExpertWeights.flatten`, scales included). The body returns the
    ``P`` computed blocks and their indices, which the loop writes into the block output ``(N, B, H)``.
    """

    step: int
    num_blocks: int
    weights: ExpertWeightsLayout

    def next_block_active(self, next_block, computed, conditions, *rest) -> torch.Tensor:
        return conditions.index_select(0, next_block.view(1)).squeeze(0) != 0

    def compute_blocks(self, next_block, computed, conditions, x, block_to_expert, *weight_tensors):
        offsets = torch.arange(self.step, device=next_block.device)
        # Past the last block (odd N with two blocks per iteration) the pair repeats block N-1: same value twice.
        blocks = (next_block + offsets).clamp(max=self.num_blocks - 1)
        weights = self.weights.rebuild(weight_tensors)
        y = grouped_expert_mlp(x.index_select(0, blocks), weights, block_to_expert.index_select(0, blocks),
                               impl="gather")
        remaining = (self.num_blocks - next_block).clamp(max=self.step)
        return next_block + self.step, computed + remaining, blocks, y
