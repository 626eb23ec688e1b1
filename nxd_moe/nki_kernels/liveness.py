"""On-chip memory as the NKI compiler allocates it, for kernels written for the real compiler (the ``compat`` front
door): what a kernel needs of SBUF and PSUM at once, and whether that fits.

Real NKI kernels are traced Python: ``nl.ndarray`` declares a tensor, and the compiler -- not the program order --
decides when its memory is taken. It frees a tensor after its last use, and it schedules instructions in any order
their data dependencies allow, so a tile written early and read much later need not occupy memory in between if the
instructions around it do not depend on it (nki-library's ``moe_cte`` fills twelve PSUM banks in program order and
reads them afterwards; the compiler evacuates each bank as soon as its accumulation ends).

So capacity is checked against what *every* valid schedule must hold: a value of a tensor is necessarily live at an
instruction ``I`` when one of its writes precedes ``I`` and one of its reads follows ``I`` in the dependency graph
(read-after-write, write-after-read and write-after-write on the same tensor; ``core_barrier``, ``sendrecv``,
registers and hardware loops are fences nothing moves across). A kernel whose necessary footprint exceeds SBUF or
PSUM cannot fit under any schedule and raises :class:`~nxd_moe.nki_kernels.hardware.HardwareLimitError` naming the
tensors; one that fits in program order (the common case) is not analysed further.

The trace records, per instruction, the tensors it reads and writes (``Trace.access``) -- a *value* (generation) of
a tensor begins with a write that covers all of it and reads nothing of it, and ends with its last read.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

MAX_PROBES = 4096  # instructions at which the necessary footprint is evaluated (the fullest in program order)


class Generation:
    """One value of an on-chip tensor: the instructions that wrote it and those that read it (each list in
    instruction order)."""

    __slots__ = ("writes", "reads")

    def __init__(self):
        self.writes: list[int] = []
        self.reads: list[int] = []

    def span(self) -> tuple[int, int]:
        w, r = self.writes, self.reads
        if not w:
            return r[0], r[-1]
        if not r:
            return w[0], w[-1]
        return min(w[0], r[0]), max(w[-1], r[-1])


class Tensor:
    """What the check needs of an on-chip allocation."""

    __slots__ = ("name", "buffer", "bytes_per_partition")

    def __init__(self, name: str, buffer, bytes_per_partition: int):
        self.name, self.buffer, self.bytes_per_partition = name, buffer, bytes_per_partition


@dataclass
class Footprint:
    """The result of a check: the peak (bytes per partition, or banks) and the tensors live at it."""

    peak: int
    tensors: list[str]


class Trace:
    """The instruction stream of one core: dependency edges, and the values of its on-chip tensors."""

    def __init__(self):
        self.preds: list[list[int]] = []
        self.depth = 0
        self.current = -1
        self.fence = -1
        # Keyed by the allocation's serial number; the trace keeps no reference to tensors, so their memory goes when
        # the kernel drops them.
        self._deps: dict[int, list] = {}  # allocation -> [last write, reads since]
        self.values: dict[int, tuple[Tensor, list[Generation]]] = {}  # on-chip allocation -> its values

    @contextmanager
    def instruction(self, fence: bool = False):
        """One instruction (nested calls -- one instruction implemented by another -- are part of it)."""
        if self.depth == 0:
            self.begin(fence)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def begin(self, fence: bool = False) -> int:
        i = len(self.preds)
        preds = [] if self.fence < 0 else [self.fence]
        if fence:
            preds = list(range(self.fence + 1, i)) or preds
            self.fence = i
        self.preds.append(preds)
        self.current = i
        return i

    def access(self, alloc, write: bool, covers: bool = False) -> None:
        """The current instruction reads or writes ``alloc`` (``covers``: a write of all of it)."""
        if self.current < 0:
            self.begin()
        i = self.current
        preds = self.preds[i]
        state = self._deps.get(alloc.serial)
        if state is None:
            state = self._deps[alloc.serial] = [-1, []]
        last_write, reads = state
        if 0 <= last_write != i:
            preds.append(last_write)
        if write:
            preds.extend(r for r in reads if r != i)
            state[0], state[1] = i, []
        else:
            reads.append(i)
        if not alloc.buffer.on_chip:
            return
        entry = self.values.get(alloc.serial)
        if entry is None:
            entry = self.values[alloc.serial] = (Tensor(alloc.name, alloc.buffer, alloc.bytes_per_partition),
                                                 [Generation()])
        values = entry[1]
        value = values[-1]
        if write:
            fresh = covers and value.reads and value.reads[-1] != i  # not read by this instruction either
            if fresh:
                value = Generation()
                values.append(value)
            value.writes.append(i)
        else:
            value.reads.append(i)
            if len(values) > 1 and value.writes and value.writes[0] == i:
                values[-2].reads.append(i)  # read-modify-write: the old value lives until this instruction

    # ------------------------------------------------------------------------------------------------ the check

    def footprint(self, buffer, size, capacity: int) -> Footprint:
        """The most of ``buffer`` live at once (``size(alloc)`` each): in program order when that fits
        ``capacity``, else the part every schedule must hold."""
        n = len(self.preds)
        values = [(alloc, v) for alloc, gens in self.values.values() if alloc.buffer is buffer for v in gens]
        if not values or n == 0:
            return Footprint(0, [])
        sizes = np.array([size(a) for a, _ in values], dtype=np.int64)
        spans = np.array([v.span() for _, v in values], dtype=np.int64)
        usage = np.zeros(n + 1, dtype=np.int64)
        np.add.at(usage, spans[:, 0], sizes)
        np.add.at(usage, spans[:, 1] + 1, -sizes)
        usage = np.cumsum(usage[:n])
        if usage.max() <= capacity:
            at = int(usage.argmax())
            return Footprint(int(usage[at]), _names(values, (spans[:, 0] <= at) & (at <= spans[:, 1])))
        over = np.flatnonzero(usage > capacity)
        probes = over if len(over) <= MAX_PROBES else np.sort(over[np.argsort(-usage[over], kind="stable")
                                                                    [:MAX_PROBES]])
        need, live_at = self._necessary(values, spans, sizes, probes)
        at = int(need.argmax())
        peak = int(need[at])
        outside = np.delete(usage, over)
        if outside.size and outside.max() > peak:  # the peak lies where program order already fits
            at = int(np.flatnonzero(usage == outside.max())[0])
            return Footprint(int(usage[at]), _names(values, (spans[:, 0] <= at) & (at <= spans[:, 1])))
        return Footprint(peak, _names(values, live_at(at)))

    def _necessary(self, values, spans, sizes, probes: np.ndarray):
        """``(need, live_at)``: per probe, the size of the values live there under every schedule; ``live_at(k)``
        the values (bool per value) live at probe ``k``."""
        n, width = len(self.preds), len(probes)
        bit = {int(p): 1 << k for k, p in enumerate(probes)}
        nbytes = (width + 7) // 8
        # ancestors[i]: the probes that must run before (or are) instruction i; descendants[i]: those after it.
        ancestors: list[int] = [0] * n
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, preds in enumerate(self.preds):
            acc = bit.get(i, 0)
            for p in preds:
                acc |= ancestors[p]
                succs[p].append(i)
            ancestors[i] = acc
        descendants: list[int] = [0] * n
        for i in range(n - 1, -1, -1):
            acc = bit.get(i, 0)
            for s in succs[i]:
                acc |= descendants[s]
            descendants[i] = acc
        lo, hi = int(probes.min()), int(probes.max())
        need = np.zeros(width, dtype=np.int64)
        lives = [0] * len(values)
        for row, ((_, value), (start, end)) in enumerate(zip(values, spans)):
            if end < lo or start > hi:
                continue
            after_a_write = 0
            for w in value.writes:
                after_a_write |= descendants[w]
            before_a_read = 0
            for r in value.reads:
                before_a_read |= ancestors[r]
            if not value.reads:  # a value nobody reads occupies memory only while it is written
                before_a_read = after_a_write & _bits(value.writes, bit)
            if not value.writes:  # read but never written (fresh memory): live only while read
                after_a_write = before_a_read & _bits(value.reads, bit)
            live = lives[row] = after_a_write & before_a_read
            if live:
                bits = np.unpackbits(np.frombuffer(live.to_bytes(nbytes, "little"), np.uint8), bitorder="little")
                need += sizes[row] * bits[:width]
        return need, lambda k: np.array([(live >> k) & 1 for live in lives], dtype=bool)


def _bits(instructions, bit) -> int:
    acc = 0
    for i in instructions:
        acc |= bit.get(i, 0)
    return acc


def _names(values, live) -> list[str]:
    return sorted({values[k][0].name for k in np.flatnonzero(live)})


def psum_banks(alloc, bank_bytes: int) -> int:
    return math.ceil(alloc.bytes_per_partition / bank_bytes)
