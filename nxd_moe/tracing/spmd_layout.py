"""A parallel layout of the MoE layer as one SPMD program (:class:`SPMDLayout`: TP, EP, TP x EP, sequence-parallel
prefill, hybrid prefill/decode sharding, expert-data-parallel copies), and each rank's layer built under it.

Trainium runs a model over many NeuronCores with one compiled program that every core runs (SPMD): the rank is a
tensor input (:class:`~nxd_moe.parallel_state.SPMDRank`), the weights are the rank's shard (same shapes on every
rank), and the collectives are XLA ops over the layout's replica groups.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.parallel.sharding import load_full_state_dict


@dataclass(frozen=True)
class SPMDLayout:
    """A parallel layout: NxD's TP / EP sizes, sequence-parallel prefill, the MoE's own split for decode (hybrid
    sharding; default the same as prefill), and ``expert_data_parallel_size`` copies of the ``TP * EP``-rank MoE
    block (NxD's expert-data-parallel replicas, each with its own tokens): ``world_size = TP * EP * copies``."""

    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    moe_decode_tensor_model_parallel_size: int | None = None
    moe_decode_expert_model_parallel_size: int | None = None
    expert_data_parallel_size: int = 1

    @property
    def block_size(self) -> int:
        return self.tensor_model_parallel_size * self.expert_model_parallel_size

    @property
    def world_size(self) -> int:
        return self.block_size * self.expert_data_parallel_size

    def moe_expert_parallel_size(self, mode: str) -> int:
        """The MoE's expert-parallel size in ``mode``: decode has its own under hybrid sharding."""
        if mode == "decode":
            return self.moe_decode_expert_model_parallel_size or self.expert_model_parallel_size
        return self.expert_model_parallel_size

    def _sizes(self) -> dict:
        return dict(tensor_model_parallel_size=self.tensor_model_parallel_size,
                    expert_model_parallel_size=self.expert_model_parallel_size,
                    moe_decode_tensor_model_parallel_size=self.moe_decode_tensor_model_parallel_size,
                    moe_decode_expert_model_parallel_size=self.moe_decode_expert_model_parallel_size)

    def check(self, num_experts: int, tokens: int, mode: str) -> parallel_state.ParallelLayout:
        """The rank lists, after the checks that must fail before anything is traced: sizes that do not divide the
        world or the experts, and a sequence-parallel prefill whose tokens do not split over TP (``ValueError``
        naming the argument)."""
        layout = parallel_state.model_parallel_layout(self.world_size, num_experts=num_experts, **self._sizes())
        if self.sequence_parallel and mode == "prefill" and tokens % self.tensor_model_parallel_size:
            raise ValueError(f"sequence parallelism splits the prefill tokens ({tokens}) over the "
                             f"tensor-parallel size ({self.tensor_model_parallel_size}): tokens must be divisible "
                             "by it")
        return layout

    @contextlib.contextmanager
    def initialized(self, rank: int = 0) -> Iterator[None]:
        """:mod:`nxd_moe.parallel_state` set to this layout's SPMD program, building ``rank``'s shard."""
        parallel_state.initialize_spmd_model_parallel(self.world_size, rank=rank, **self._sizes())
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()

    def local(self, world: torch.Tensor, rank: int, sharded: bool) -> torch.Tensor:
        """Rank ``rank``'s part of a world-wide ``(copies * D * B, S, ...)`` tensor: each MoE block's ``D`` token
        groups (the dense layers' TP groups; see :class:`~nxd_moe.parallel.TokenLayout`) of ``B`` rows, blocks one
        after another. The rank gets its group's rows, and with ``sharded`` (sequence-parallel prefill) its
        ``S / TP`` positions of them."""
        tp, groups = self.tensor_model_parallel_size, self.expert_model_parallel_size
        layout = parallel_state.model_parallel_layout(self.world_size, **self._sizes())
        group = rank // self.block_size * groups + layout.index_in_groups("expert_model_parallel_groups")[rank]
        position = layout.index_in_groups("tensor_model_parallel_groups")[rank]
        batch = world.shape[0] // (groups * self.expert_data_parallel_size)
        mine = world[group * batch:(group + 1) * batch]
        if not sharded:
            return mine
        width = world.shape[1] // tp
        return mine[:, position * width:(position + 1) * width]

    def per_block(self, layer: Callable[..., Any], world: Sequence[torch.Tensor]) -> torch.Tensor:
        """``layer`` (the single-device layer) applied to each MoE block's tokens of the world-wide inputs on its
        own -- what the block computes -- and the outputs stacked as the inputs are."""
        rows = world[0].shape[0] // self.expert_data_parallel_size
        with torch.no_grad():
            return torch.cat([layer(*(t[b * rows:(b + 1) * rows] for t in world))[0]
                              for b in range(self.expert_data_parallel_size)])

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, **self._sizes(), "sequence_parallel": self.sequence_parallel,
                "expert_data_parallel_size": self.expert_data_parallel_size}


def build_rank_layers(build: Callable[..., nn.Module], layout: SPMDLayout) -> tuple[nn.Module, list[nn.Module]]:
    """The single-device layer ``build(model_parallel=False)`` and, per rank, ``build()`` under the layout's SPMD
    state with that rank's shard of the single-device layer's weights loaded. ``build`` must draw the same
    replicated weights every call (a fixed seed)."""
    full = build(model_parallel=False)
    state = full.state_dict()
    ranks = []
    for rank in range(layout.world_size):
        with layout.initialized(rank):
            ranks.append(load_full_state_dict(build(), state))
    return full, ranks
