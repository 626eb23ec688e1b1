"""The collectives of the parallel MoE, each recording the bytes it moves.

Bytes are what one rank *receives* over the network under the usual algorithms, so that dispatch strategies
compare on the traffic they cause rather than on how a backend happens to implement them:

- all-gather of a per-rank chunk of ``b`` bytes over ``G`` ranks: ``(G - 1) * b``;
- reduce-scatter of a ``G * b``-byte input: ``(G - 1) * b`` (ring);
- all-reduce of ``n`` bytes: ``2 * (G - 1) / G * n`` (ring: a reduce-scatter then an all-gather);
- all-to-all-v: the bytes of the rows the other ranks send here (a rank's rows to itself never leave it).

A group of one rank moves nothing and calls nothing. A :class:`~nxd_moe.parallel_state.ReplicaGroups` group (an
SPMD layout) issues the same collective as an XLA op (:mod:`~nxd_moe.parallel.xla_collectives`), counted the
same way; the exchanges whose sizes are read on the host (``all_to_all_v``, ``exchange_counts``) have no SPMD
form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from nxd_moe.parallel import xla_collectives
from nxd_moe.parallel_state import ReplicaGroups

# torch 2.13 renamed the tensor all-gather and reduce-scatter and deprecated the old names (same signatures);
# older releases have only the old ones.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommLedger:
    """Bytes this rank received, per named step of one forward (``steps`` keeps the order of the steps)."""

    steps: dict[str, int] = field(default_factory=dict)

    def add(self, step: str, nbytes: int) -> None:
        self.steps[step] = self.steps.get(step, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.steps.values())


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def group_size(group) -> int:
    if group is None:
        return 1
    return group.size if isinstance(group, ReplicaGroups) else dist.get_world_size(group)


def _host_sized(group, what: str) -> None:
    if isinstance(group, ReplicaGroups):
        raise ValueError(f"{what} reads split sizes on the host, which an SPMD program cannot do; use "
                         "ExpertParallelConfig(all_to_all_splits='static')")


def all_gather(x: torch.Tensor, group, ledger: CommLedger, step: str) -> torch.Tensor:
    """``x (n, ...)`` from each of the ``G`` ranks -> ``(G, n, ...)`` in group-rank order (same shape everywhere)."""
    size = group_size(group)
    if size == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    if isinstance(group, ReplicaGroups):
        out = xla_collectives.all_gather(x, group)
    else:
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the rank chunks concatenated along dim 0
        _all_gather_into(out, x, group=group)
    ledger.add(step, (size - 1) * _nbytes(x))
    return out.view(size, *x.shape)


def reduce_scatter(x: torch.Tensor, group, ledger: CommLedger, step: str) -> torch.Tensor:
    """``x (G, n, ...)`` -> ``(n, ...)``: this rank's slice of the sum over ranks."""
    size = group_size(group)
    if x.shape[0] != size:
        raise ValueError(f"reduce_scatter: leading dimension {x.shape[0]} must equal the group size {size}")
    if size == 1:
        return x[0]
    flat = x.reshape(size * x.shape[1], *x.shape[2:]).contiguous()
    if isinstance(group, ReplicaGroups):
        out = xla_collectives.reduce_scatter(flat, group)
    else:
        out = x.new_empty(x.shape[1:])
        _reduce_scatter_into(out, flat, group=group)
    ledger.add(step, (size - 1) * _nbytes(out))
    return out


def all_reduce(x: torch.Tensor, group, ledger: CommLedger, step: str) -> torch.Tensor:
    """Sum over ranks (out of place)."""
    size = group_size(group)
    if size == 1:
        return x
    if isinstance(group, ReplicaGroups):
        out = xla_collectives.all_reduce(x.contiguous(), group)
    else:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
    ledger.add(step, 2 * (size - 1) * _nbytes(out) // size)
    return out


def all_to_all_v(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group, rank: int,
                 ledger: CommLedger, step: str) -> torch.Tensor:
    """Rows ``x[sum(send_counts[:r]) : ...]`` go to group rank ``r``; returns the received rows in group-rank order.

    ``rank`` is this rank's index in ``group`` (its own rows are not counted as traffic).
    """
    _host_sized(group, "all_to_all_v")
    size = group_size(group)
    if len(send_counts) != size or len(recv_counts) != size:
        raise ValueError(f"all_to_all_v: need {size} send and receive counts, got {len(send_counts)} and "
                         f"{len(recv_counts)}")
    if sum(send_counts) != x.shape[0]:
        raise ValueError(f"all_to_all_v: send counts sum to {sum(send_counts)} but x has {x.shape[0]} rows")
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    if size == 1:
        out.copy_(x)
        return out
    dist.all_to_all_single(out, x.contiguous(), list(recv_counts), list(send_counts), group=group)
    ledger.add(step, (sum(recv_counts) - recv_counts[rank]) * row_bytes)
    return out


class PendingExchange:
    """An exchange in flight: :meth:`wait` returns what it received once this rank may read it (on CUDA: the
    current stream waits for it, the host does not; on gloo: the host waits). Until then the exchange runs beside
    whatever is issued after it -- on NCCL, on the communicator's own stream."""

    def __init__(self, out: torch.Tensor, work=None):
        self._out, self._work = out, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out


def start_all_to_all(x: torch.Tensor, group, ledger: CommLedger, step: str) -> PendingExchange:
    """:func:`all_to_all` started without waiting for it. Done at once in an SPMD program (an XLA op: the compiler
    schedules it), in a group of one, and while ``torch.compile`` traces the call (Dynamo's functional collectives
    take the blocking form)."""
    if isinstance(group, ReplicaGroups) or group_size(group) == 1 or torch.compiler.is_compiling():
        return PendingExchange(all_to_all(x, group, ledger, step))
    size = group_size(group)
    check_equal_splits(x, size)
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x.contiguous(), group=group, async_op=True)
    ledger.add(step, (size - 1) * _nbytes(x) // size)
    return PendingExchange(out, work)


def check_equal_splits(x: torch.Tensor, size: int) -> None:
    """A named error unless ``x``'s rows split into ``size`` equal parts (an equal-split all-to-all)."""
    if x.shape[0] % size:
        raise ValueError(f"all_to_all: {x.shape[0]} rows do not split into {size} equal parts")


def all_to_all(x: torch.Tensor, group, ledger: CommLedger, step: str) -> torch.Tensor:
    """``x (G * n, ...)``: rows ``[r * n, (r + 1) * n)`` go to group rank ``r``; returns the ``(G * n, ...)`` rows
    received, in group-rank order. Equal splits: no sizes on the host, so a CUDA graph can capture it."""
    size = group_size(group)
    check_equal_splits(x, size)
    if size == 1:
        return x
    if isinstance(group, ReplicaGroups):
        out = xla_collectives.all_to_all(x.contiguous(), group)
    else:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
    ledger.add(step, (size - 1) * _nbytes(x) // size)
    return out


def exchange_counts(send_counts: torch.Tensor, group, rank: int, ledger: CommLedger, step: str) -> list[int]:
    """Each rank tells every other how many rows it will send it: ``(G,)`` int64 -> the ``(G,)`` counts this rank
    receives, as Python ints (a host sync: the next all-to-all-v needs its sizes on the host)."""
    _host_sized(group, "exchange_counts")
    size = group_size(group)
    if size == 1:
        return send_counts.tolist()
    out = torch.empty_like(send_counts)
    dist.all_to_all_single(out, send_counts.contiguous(), group=group)
    ledger.add(step, (size - 1) * send_counts.element_size())
    return out.tolist()
