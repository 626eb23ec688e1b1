"""The static all-to-all over NVLink without NCCL: each rank writes its rows straight into the peers' receive
buffers (``ExpertParallelConfig(transport="nvlink")``; DeepEP's intranode design, here through torch's symmetric
memory with NVLink multicast left off).

A receive buffer per exchange shape -- ``(M * n, row_bytes)`` bytes, allocated once as symmetric memory (every
rank maps every peer's copy) and kept -- serves every call of that shape. One exchange is three kernels on the
caller's stream: a barrier (every rank has finished reading its buffer from the previous exchange of the shape:
its reads were issued before its barrier), one kernel writing this rank's ``n`` rows for each destination at row
``me * n`` of that destination's buffer (:mod:`nxd_moe.triton_kernels.peer_put`), and a barrier (every peer's rows
have landed). Nothing is read on the host, so a CUDA graph captures it; no second stream, no NCCL kernel.

What it returns is the receive buffer itself: valid until the next exchange of the same shape on this rank, which
a forward never reaches while it still reads the rows (the dispatch's and the combine's shapes differ; layers run
one after another). So micro-batches, whose next part is exchanged before the previous one is read, take NCCL.

NCCL's all-to-all stands in (the same bytes and result) where this cannot run: off CUDA, under ``torch.compile`` or
an SPMD program, rows that are not whole 4-byte words, ranks on several hosts or without peer access (asked once per
group, collectively), and a shape first met inside a CUDA-graph capture (the rendezvous is host work).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nxd_moe.parallel.collectives import CommLedger, PendingExchange, check_equal_splits, group_size, start_all_to_all
from nxd_moe.parallel_state import ReplicaGroups


class PeerExchange:
    """The symmetric receive buffer of one exchange shape over ``group``, its handle, and the ``(M,)`` table of the
    peers' buffer addresses the kernel writes through."""

    def __init__(self, group, num_rows: int, row_bytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(num_rows, row_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.peer_ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.rank = self.handle.rank

    def __call__(self, send: torch.Tensor) -> torch.Tensor:
        from nxd_moe.triton_kernels.peer_put import put_to_peers

        self.handle.barrier(channel=0)
        put_to_peers(send.contiguous().view(torch.uint8).view(torch.int32).reshape(-1), self.peer_ptrs, self.rank)
        self.handle.barrier(channel=1)
        return self.buffer


_exchanges: dict[tuple, PeerExchange] = {}
_peer_access: dict[str, bool] = {}  # per group: whether every rank maps every other's memory


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def usable(x: torch.Tensor, group) -> bool:
    """Whether the exchange of ``x`` over ``group`` can go straight over NVLink, as far as ``x`` tells (the group's
    peer access is asked once, collectively: :func:`peer_access`)."""
    return (x.is_cuda and not isinstance(group, ReplicaGroups) and group_size(group) > 1
            and not torch.compiler.is_compiling() and x.shape[0] > 0 and _row_bytes(x) % 4 == 0)


def peer_access(group, device: torch.device) -> bool:
    """Whether every rank of ``group`` is on one host and can access every other's GPU -- decided on the first call
    with the ranks' hosts and devices exchanged, the same answer on every rank, and kept."""
    name = group.group_name
    if name not in _peer_access:
        import socket

        places: list = [None] * group_size(group)
        me = str(torch.cuda.get_device_properties(device).uuid)
        dist.all_gather_object(places, (socket.gethostname(), me, device.index), group=group)
        same_host = len({host for host, _, _ in places}) == 1
        mine = all(uuid == me or torch.cuda.can_device_access_peer(device.index, index) for _, uuid, index in places)
        verdicts: list = [None] * group_size(group)
        dist.all_gather_object(verdicts, same_host and mine, group=group)
        _peer_access[name] = all(verdicts)
    return _peer_access[name]


def start_nvlink_all_to_all(x: torch.Tensor, group, ledger: CommLedger, step: str) -> PendingExchange:
    """:func:`~nxd_moe.parallel.collectives.start_all_to_all`'s exchange over NVLink where it can run (done when it
    returns: the caller's stream already waits for it), else NCCL's (see the module docstring)."""
    if not usable(x, group):
        return start_all_to_all(x, group, ledger, step)
    size = group_size(group)
    check_equal_splits(x, size)
    key = (group.group_name, x.shape[0], _row_bytes(x), str(x.device))
    exchange = _exchanges.get(key)
    if exchange is None:
        # Host work, collective: not inside a capture (every rank captures the same step, so all take NCCL there).
        if torch.cuda.is_current_stream_capturing() or not peer_access(group, x.device):
            return start_all_to_all(x, group, ledger, step)
        exchange = _exchanges[key] = PeerExchange(group, x.shape[0], _row_bytes(x), x.device)
    received = exchange(x)
    ledger.add(step, (size - 1) * x.numel() * x.element_size() // size)
    return PendingExchange(received.view(x.dtype).view(x.shape))
