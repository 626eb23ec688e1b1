"""The routed experts on given (token, expert) pairs: the one entry point every caller of the algorithms shares.

:func:`run_experts` runs one mode's backend call on a prepared :class:`~nxd_moe.experts.routing_inputs.Routing`;
:func:`experts_forward_pairs` first turns ``(N, k)`` pairs into that routing. ``ExpertMLPsV2.compute`` (the router's
``(T, E)`` routing on one device, or the pairs a dispatcher moved to this rank) and the
transformers experts backend (:mod:`nxd_moe.models.experts_backend`, HF's ``(T, k)`` top-k) all end here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nxd_moe.experts.backends import ExpertsBackend, TorchBackend
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import BlockMapping, num_blocks
from nxd_moe.moe_configs import BlockwiseMatmulConfig


class ExpertsRun(NamedTuple):
    """What one call computed: ``output (N, H)``, the dropped assignments (0-d int64; capacity factor only), the
    routing it ran on and, for blockwise, the block mapping and its sizes (None otherwise)."""

    output: torch.Tensor
    dropped: torch.Tensor
    routing: Routing
    mapping: BlockMapping | None = None
    block_size: int | None = None
    num_blocks: int | None = None


def run_experts(backend: ExpertsBackend, hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights,
                mode: ExpertsMode, blockwise_config: BlockwiseMatmulConfig, capacity: int | None = None,
                addend: torch.Tensor | None = None) -> ExpertsRun:
    """``hidden_states (N, H)`` through ``routing``'s experts with ``mode``'s algorithm on ``backend``, plus
    ``addend (N, H)`` if given (inside the backend's last pass where it fuses one). ``capacity``: the capacity
    factor's slots per expert (that mode only)."""
    if mode is ExpertsMode.BLOCKWISE and blockwise_config.use_torch_block_wise and not isinstance(backend,
                                                                                               TorchBackend):
        backend = TorchBackend()
    fused = {"addend": addend} if addend is not None and backend.fuses_addend else {}
    dropped = torch.zeros((), dtype=torch.int64, device=hidden_states.device)
    mapping = block_size = n_blocks = None
    if mode is ExpertsMode.BLOCKWISE:
        block_size = blockwise_config.block_size
        # Shapes, not a config: on a shard the routing covers its local experts and k' pairs.
        n_blocks = num_blocks(hidden_states.shape[0], routing.expert_index.shape[1], routing.expert_mask.shape[1],
                              block_size, blockwise_config.pad_num_blocks_to_even)
        mapping = backend.block_mapping(routing, weights, block_size, n_blocks,
                                        blockwise_config.optimized_block_to_token_mapping)
        out = backend.blockwise(hidden_states, routing, mapping, weights, blockwise_config, **fused)
    elif mode is ExpertsMode.CAPACITY_FACTOR:
        out, dropped = backend.capacity_factor(hidden_states, routing, capacity, weights, **fused)
    elif mode is ExpertsMode.SELECTIVE_LOADING:
        out = backend.selective_loading(hidden_states, routing, weights, **fused)
    else:
        out = backend.all_experts(hidden_states, routing, weights, **fused)
    if addend is not None and not fused:
        out = out + addend
    return ExpertsRun(out, dropped, routing, mapping, block_size, n_blocks)


def experts_forward_pairs(backend: ExpertsBackend, hidden_states: torch.Tensor, pair_expert: torch.Tensor,
                          pair_weight: torch.Tensor, weights: ExpertWeights, local_slot: torch.Tensor,
                          mode: ExpertsMode, blockwise_config: BlockwiseMatmulConfig, capacity: int | None = None,
                          prescale: bool = False) -> ExpertsRun:
    """``hidden_states (N, H)``: each row's pairs through their experts, weighted and summed: ``output[n] =
    sum_j pair_weight[n, j] * expert_{pair_expert[n, j]}(row n)``.

    ``pair_expert (N, k)``: a global expert id per pair, ``-1`` for a pair computed nowhere here (it contributes
    nothing, and its row is not read for it); ``pair_weight (N, k)``: each pair's final combine weight (summed in
    fp32 or better); ``weights``: the ``E_l`` experts held here, ``local_slot (E,)`` the local index of each global
    expert (``-1`` where not held; ``arange(E)`` on one device). The mode, its capacity and the blockwise layout are
    the caller's (from the token count: see ``ExpertsBackend.select_mode_from_tokens``). No host sync, static
    shapes."""
    # The weight's shape, not ExpertWeights.num_experts: Dynamo 2.9 cannot compute with a NamedTuple's property.
    num_local = weights.gate_up_proj.shape[0]
    routing = backend.build_local_routing(pair_expert, pair_weight, local_slot, num_local, prescale)
    return run_experts(backend, hidden_states, routing, weights, mode, blockwise_config, capacity)
