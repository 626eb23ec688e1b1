"""The blocks a dynamic-while blockwise forward computed, counted on the device while it runs under XLA: the
loop's own counter against the schedule (a static prefix, then whole iterations while the next block holds a real
token), so a check can tell that padding blocks were skipped."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn

from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts.backends import TorchBackend
from nxd_moe.experts.dynamic_while import blocks_per_iteration, dynamic_while_blockwise_forward, static_block_count


@dataclass
class BlockCount:
    """What one dynamic-while blockwise call computed, read from the device: ``computed`` is the loop's own
    counter (static prefix + loop iterations), ``active`` the number of blocks holding a real token."""

    num_blocks: int
    static_blocks: int
    blocks_per_iteration: int
    computed: int
    active: int

    @property
    def expected(self) -> int:
        """The schedule: the static prefix, then whole iterations while the next block is active."""
        beyond = max(self.active - self.static_blocks, 0)
        iterations = -(-beyond // self.blocks_per_iteration)
        return min(self.static_blocks + iterations * self.blocks_per_iteration, self.num_blocks)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "skipped": self.num_blocks - self.computed, "expected": self.expected}


class _PendingBlockCount(NamedTuple):
    """A :class:`BlockCount` whose counts are still device tensors (part of the traced graph)."""

    num_blocks: int
    static_blocks: int
    blocks_per_iteration: int
    computed: torch.Tensor
    active: torch.Tensor

    def read(self) -> BlockCount:
        return BlockCount(self.num_blocks, self.static_blocks, self.blocks_per_iteration, int(self.computed.cpu()),
                          int(self.active.cpu()))


class _CountingBackend(TorchBackend):
    """The torch backend, keeping the dynamic-while loop's block counter (a device tensor) of every call."""

    def __init__(self, matmul: str):
        super().__init__(matmul)
        self.records: list[_PendingBlockCount] = []

    def blockwise(self, hidden_states, routing, mapping, weights, config):
        if not config.use_dynamic_while:
            return super().blockwise(hidden_states, routing, mapping, weights, config)
        result = dynamic_while_blockwise_forward(hidden_states, routing, mapping, weights, config, self.matmul)
        static = static_block_count(config, hidden_states.shape[0], routing.expert_index.shape[1],
                                    mapping.num_blocks)
        self.records.append(_PendingBlockCount(mapping.num_blocks, static, blocks_per_iteration(config),
                                               result.computed_blocks, mapping.conditions.sum()))
        return result.output


@contextlib.contextmanager
def counting_blocks(module: nn.Module) -> Iterator[list[_CountingBackend]]:
    """Swap the torch backend of every dynamic-while ``ExpertMLPsV2`` in ``module`` for a counting one."""
    swapped = []
    for sub in module.modules():
        if (isinstance(sub, ExpertMLPsV2) and type(sub.backend) is TorchBackend
                and sub.blockwise_matmul_config.use_dynamic_while):
            swapped.append((sub, sub.backend))
            sub.backend = _CountingBackend(sub.backend.matmul)
    try:
        yield [sub.backend for sub, _ in swapped]
    finally:
        for sub, backend in swapped:
            sub.backend = backend
