"""What a kernel did, counted by the simulator: the raw facts the cost model turns into time.

Everything is counted per core (a physical NeuronCore); :meth:`Accounting.merged` sums the cores of an LNC2
launch. DMA traffic is keyed by ``(tensor, direction)`` -- the HBM tensor a transfer reads or writes (the source
for on-chip to on-chip copies) and ``"hbm->sbuf"``-style directions -- so a test can ask exactly how many bytes of
``hidden_states`` were loaded. Engine instructions are kept as a histogram of :class:`EngineOp` (engine, opcode,
free size, element width), which is all the cost model needs and stays small however long the kernel runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
_COUNTS = ("matmul_flops", "matmuls", "transposes", "barriers", "dynamic_iterations", "branches")


@dataclass
class DmaTraffic:
    """``bytes`` moved; ``transfers``: DMA instructions that moved data; ``rows``: partition rows (descriptors)
    moved; ``skipped_rows`` / ``skipped_transfers``: rows and whole instructions dropped by ``oob_mode=skip``."""

    bytes: int = 0
    transfers: int = 0
    rows: int = 0
    skipped_rows: int = 0
    skipped_transfers: int = 0

    def add(self, other: "DmaTraffic", sign: int = 1) -> None:
        self.bytes += sign * other.bytes
        self.transfers += sign * other.transfers
        self.rows += sign * other.rows
        self.skipped_rows += sign * other.skipped_rows
        self.skipped_transfers += sign * other.skipped_transfers


class EngineOp(NamedTuple):
    """One kind of instruction: ``free_size`` is the elements per partition it streams (for ``nc_matmul`` the
    moving tensor's free size), ``wide`` whether its data are 4-byte elements (fp32 / int32)."""

    engine: str
    op: str
    free_size: int
    wide: bool


@dataclass
class Accounting:
    dma: dict[tuple[str, str], DmaTraffic] = field(default_factory=dict)
    engine_ops: Counter = field(default_factory=Counter)
    matmul_flops: int = 0
    matmuls: int = 0
    transposes: int = 0
    sbuf_high_water: int = 0
    psum_high_water_banks: int = 0
    barriers: int = 0
    dynamic_iterations: int = 0
    branches: int = 0

    def record_dma(self, tensor: str, direction: str, traffic: DmaTraffic) -> None:
        self.dma.setdefault((tensor, direction), DmaTraffic()).add(traffic)
        self.engine_ops[EngineOp("dma", "dma_copy", 0, False)] += 1

    def record(self, engine: str, op: str, free_size: int, wide: bool) -> None:
        self.engine_ops[EngineOp(engine, op, int(free_size), bool(wide))] += 1

    # ------------------------------------------------------------------------------------------------ queries

    def traffic(self, tensor: str | None = None, direction: str | None = None) -> DmaTraffic:
        """DMA traffic summed over the matching ``(tensor, direction)`` keys (``None`` matches any)."""
        out = DmaTraffic()
        for (name, way), t in self.dma.items():
            if (tensor is None or name == tensor) and (direction is None or way == direction):
                out.add(t)
        return out

    def dma_bytes(self, tensor: str | None = None, direction: str | None = None) -> int:
        return self.traffic(tensor, direction).bytes

    def instructions(self, engine: str | None = None, op: str | None = None) -> int:
        return sum(n for k, n in self.engine_ops.items()
                   if (engine is None or k.engine == engine) and (op is None or k.op == op))

    def instructions_by_engine(self) -> dict[str, int]:
        return {engine: self.instructions(engine) for engine in ENGINES}

    def add(self, other: "Accounting", sign: int = 1) -> None:
        """Add (``sign=-1``: subtract) another accounting's counts; high-water marks take the larger."""
        for key, t in other.dma.items():
            self.dma.setdefault(key, DmaTraffic()).add(t, sign)
        for key, n in other.engine_ops.items():
            self.engine_ops[key] += sign * n
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + sign * getattr(other, name))
        self.sbuf_high_water = max(self.sbuf_high_water, other.sbuf_high_water)
        self.psum_high_water_banks = max(self.psum_high_water_banks, other.psum_high_water_banks)

    def copy(self) -> "Accounting":
        out = Accounting()
        out.add(self)
        return out

    def since(self, earlier: "Accounting") -> "Accounting":
        """The counts added after ``earlier`` (a :meth:`copy` taken then)."""
        out = self.copy()
        out.add(earlier, -1)
        out.dma = {k: t for k, t in out.dma.items() if t != DmaTraffic()}
        out.engine_ops = Counter({k: n for k, n in out.engine_ops.items() if n})
        return out

    @classmethod
    def merged(cls, parts: list["Accounting"]) -> "Accounting":
        """Counts summed over cores; high-water marks are the largest single core's."""
        out = cls()
        for part in parts:
            out.add(part)
        return out

    def summary(self) -> dict:
        """Plain numbers for reports and JSON."""
        return {
            "dma_bytes": self.dma_bytes(),
            "dma_transfers": self.traffic().transfers,
            "dma_bytes_by_tensor": {f"{name} {way}": t.bytes for (name, way), t in sorted(self.dma.items())},
            "matmul_flops": self.matmul_flops,
            "matmuls": self.matmuls,
            "transposes": self.transposes,
            "instructions": self.instructions_by_engine(),
            "sbuf_high_water_bytes_per_partition": self.sbuf_high_water,
            "psum_high_water_banks": self.psum_high_water_banks,
            "barriers": self.barriers,
            "dynamic_iterations": self.dynamic_iterations,
        }
