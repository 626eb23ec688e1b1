"""A Trn2 cost model: estimated time per engine and in total, from what the simulator counted.

This is a model, not a measurement. It turns instruction and DMA counts into time with the per-instruction
costs and bandwidths the Neuron documentation states (reference ``nki-kernels-and-trn2.md`` section 4), assumes
the engines overlap perfectly (the total is the busiest engine, plus barrier waits) and ignores dependencies,
queueing, SBUF bank conflicts and the compiler's scheduling. Use it to compare kernel variants and block sizes
with each other, not to predict a wall-clock number. :meth:`Trn2.assumptions` lists every assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

from nxd_moe.nki_kernels.accounting import ENGINES, Accounting, EngineOp
from nxd_moe.nki_kernels.lnc import KernelRun

_TWO_INPUT_OPS = ("tensor_tensor", "scalar_tensor_tensor")


@dataclass(frozen=True)
class Trn2:
    """One Trn2 NeuronCore-v3 (a physical core; LNC2 pairs two of them)."""

    tensor_ghz: float = 2.4
    tensor_min_cycles: int = 64  # MM_INIT_LATENCY: the shortest matmul still costs this many cycles
    tensor_fp32_slowdown: int = 4
    scalar_ghz: float = 1.2
    scalar_min_ii: int = 64  # activation: max(MIN_II, N) + MIN_II cycles
    vector_ghz: float = 0.96
    vector_elements_per_cycle_narrow: int = 4  # 512 bf16/fp16 elements per cycle over 128 lanes
    vector_elements_per_cycle_wide: int = 2  # 256 fp32/int32 elements per cycle over 128 lanes
    vector_static_cycles: int = 100
    gpsimd_ghz: float = 1.2
    gpsimd_static_cycles: int = 100
    dma_engines: int = 16
    dma_bytes_per_ns_per_engine: float = 23.0
    dma_fixed_ns: float = 1300.0
    hbm_bytes_per_ns_per_chip: float = 2900.0
    cores_per_chip: int = 8
    barrier_ns: float = 1300.0

    @property
    def peak_bf16_flops_per_ns(self) -> float:
        """128 x 128 PEs, 2 FLOPs each per cycle: 78.6 TFLOPS at 2.4 GHz (the documented 79)."""
        return 2 * 128 * 128 * self.tensor_ghz

    @property
    def hbm_bytes_per_ns(self) -> float:
        """One core's share of the chip's HBM bandwidth."""
        return self.hbm_bytes_per_ns_per_chip / self.cores_per_chip

    @property
    def dma_bytes_per_ns(self) -> float:
        return self.dma_engines * self.dma_bytes_per_ns_per_engine

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a core is compute-bound in this model."""
        return self.peak_bf16_flops_per_ns / min(self.hbm_bytes_per_ns, self.dma_bytes_per_ns)

    def instruction_ns(self, op: EngineOp) -> float:
        """Time of one instruction on its engine (DMA transfers are costed from the byte counts instead)."""
        n = op.free_size
        if op.engine == "tensor":
            cycles = max(n, self.tensor_min_cycles) * (self.tensor_fp32_slowdown if op.wide else 1)
            return cycles / self.tensor_ghz
        if op.engine == "scalar":
            return (max(n, self.scalar_min_ii) + self.scalar_min_ii) / self.scalar_ghz
        if op.engine == "vector":
            rate = self.vector_elements_per_cycle_wide if op.wide else self.vector_elements_per_cycle_narrow
            inputs = 2 if op.op in _TWO_INPUT_OPS else 1
            return (inputs * n / rate + self.vector_static_cycles) / self.vector_ghz
        if op.engine == "gpsimd":
            return 0.0 if op.op == "core_barrier" else (n + self.gpsimd_static_cycles) / self.gpsimd_ghz
        return 0.0

    def dma_ns(self, accounting: Accounting) -> float:
        """Bytes over the core's bandwidth (HBM share, or the DMA engines for SBUF-to-SBUF), plus a fixed cost per
        transfer spread over the 16 DMA engines."""
        hbm = min(self.hbm_bytes_per_ns, self.dma_bytes_per_ns)
        total = 0.0
        for (_, direction), traffic in accounting.dma.items():
            total += traffic.bytes / (self.dma_bytes_per_ns if direction == "sbuf->sbuf" else hbm)
            total += traffic.transfers * self.dma_fixed_ns / self.dma_engines
        return total

    def estimate(self, accounting: Accounting) -> "CoreEstimate":
        engines = dict.fromkeys(ENGINES, 0.0)
        for op, count in accounting.engine_ops.items():
            engines[op.engine] += count * self.instruction_ns(op)
        engines["dma"] = self.dma_ns(accounting)
        return CoreEstimate(engines, accounting.barriers * self.barrier_ns)

    def estimate_run(self, run: KernelRun) -> "RunEstimate":
        return RunEstimate([self.estimate(core) for core in run.cores])

    def assumptions(self) -> list[str]:
        hbm = min(self.hbm_bytes_per_ns, self.dma_bytes_per_ns)
        return [
            "a model, not a measurement: counts from the simulator, costs from the Neuron docs (reference section 4)",
            f"TensorE {self.tensor_ghz} GHz: a matmul takes max(moving free size, {self.tensor_min_cycles}) cycles "
            f"(x{self.tensor_fp32_slowdown} for fp32): {self.peak_bf16_flops_per_ns / 1e3:.1f} bf16 TFLOPS per core",
            f"ScalarE {self.scalar_ghz} GHz: activation max(N, {self.scalar_min_ii}) + {self.scalar_min_ii} cycles",
            f"VectorE {self.vector_ghz} GHz: N / {self.vector_elements_per_cycle_narrow} (2-byte) or "
            f"N / {self.vector_elements_per_cycle_wide} (4-byte) cycles per input + {self.vector_static_cycles} "
            "static; GpSimd 1 element/cycle + static",
            f"DMA: bytes at {hbm:.1f} GB/s per core (HBM {self.hbm_bytes_per_ns_per_chip / 1e3:.1f} TB/s shared by "
            f"{self.cores_per_chip} cores; {self.dma_engines} engines x {self.dma_bytes_per_ns_per_engine} GB/s) + "
            f"{self.dma_fixed_ns:.0f} ns fixed per transfer over {self.dma_engines} engines; fully skipped transfers "
            "are free",
            "engines overlap perfectly: total = busiest engine + barrier waits "
            f"({self.barrier_ns:.0f} ns each); register loads, branches, queueing and dependencies are not modelled",
            "LNC2: the two cores run in parallel; the launch takes as long as the slower core",
        ]


@dataclass
class CoreEstimate:
    """Estimated nanoseconds per engine of one core, and the barrier waits."""

    engines_ns: dict[str, float]
    barrier_ns: float

    @property
    def total_ns(self) -> float:
        return max(self.engines_ns.values()) + self.barrier_ns

    @property
    def serial_ns(self) -> float:
        """No overlap at all: an upper bound."""
        return sum(self.engines_ns.values()) + self.barrier_ns

    @property
    def bound(self) -> str:
        """The busiest engine."""
        return max(self.engines_ns, key=self.engines_ns.get)


@dataclass
class RunEstimate:
    cores: list[CoreEstimate]

    @property
    def total_ns(self) -> float:
        return max(core.total_ns for core in self.cores)

    @property
    def bound(self) -> str:
        return max(self.cores, key=lambda core: core.total_ns).bound

    def summary(self) -> dict:
        return {
            "total_us": self.total_ns / 1e3,
            "bound": self.bound,
            "cores": [{"engines_us": {k: v / 1e3 for k, v in core.engines_ns.items()},
                       "barrier_us": core.barrier_ns / 1e3, "total_us": core.total_ns / 1e3} for core in self.cores],
        }


TRN2 = Trn2()
