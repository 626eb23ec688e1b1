"""Which part of the experts' weights a module holds, described without ranks or process groups.

A :class:`ShardSpec` says how one local tensor comes from the full (single-device) checkpoint tensor; modules that
hold part of a layer list one per sharded tensor in ``shard_specs()``. The mechanism that applies them to a
checkpoint is :mod:`nxd_moe.parallel.sharding`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    """How a local tensor comes from a full one: keep ``experts`` (rows of dim 0; all if None), then split ``dim``
    (if not None) over ``tp_size`` ranks with ``stride`` interleaved groups and keep rank ``tp_rank``'s slice.
    ``source`` is the full checkpoint's key (hybrid sharding loads two local copies from one full tensor)."""

    source: str
    experts: tuple[int, ...] | None = None
    dim: int | None = None
    tp_size: int = 1
    tp_rank: int = 0
    stride: int = 1


@dataclass(frozen=True)
class WeightShard:
    """The routed experts' weights one module holds for one phase: the experts whose global ids are
    ``experts`` (in local order), each cut to part ``intermediate_part`` of ``intermediate_parts`` equal slices of
    the intermediate dimension. Who computes which pair, and how tokens travel, is the parallel layer's business
    (:mod:`nxd_moe.parallel`)."""

    experts: tuple[int, ...]
    intermediate_parts: int = 1
    intermediate_part: int = 0

    def holds_same_weights_as(self, other: "WeightShard") -> bool:
        return self == other

    def spec(self, source: str, dim: int | None = None, stride: int = 1) -> ShardSpec:
        """How a tensor of these experts comes from the full checkpoint's ``source``: their rows, then (``dim``
        not None) this shard's slice of the intermediate dimension along ``dim``."""
        if dim is None or self.intermediate_parts == 1:
            return ShardSpec(source, self.experts)
        return ShardSpec(source, self.experts, dim, self.intermediate_parts, self.intermediate_part, stride)
