"""The Trn2 cost model against cases computed by hand from the stated numbers (reference section 4)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nxd_moe.nki_kernels import Accounting, DmaTraffic, EngineOp, simulate
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.cost_model import TRN2, Trn2


def one(engine: str, op: str, free: int, wide: bool = False, count: int = 1) -> Accounting:
    acc = Accounting()
    acc.engine_ops[EngineOp(engine, op, free, wide)] += count
    return acc


def test_peak_is_79_bf16_tflops_and_the_ridge_point():
    assert TRN2.peak_bf16_flops_per_ns == pytest.approx(78643.2)  # 128 * 128 * 2 * 2.4 GHz, per ns
    assert TRN2.hbm_bytes_per_ns == pytest.approx(362.5)  # 2.9 TB/s over 8 cores
    assert TRN2.ridge_flops_per_byte == pytest.approx(78643.2 / 362.5)


def test_one_full_matmul_takes_512_cycles_at_2_4_ghz():
    est = TRN2.estimate(one("tensor", "matmul", 512))
    assert est.engines_ns["tensor"] == pytest.approx(512 / 2.4)  # 213.3 ns
    flops = 2 * 128 * 128 * 512
    assert flops / est.total_ns == pytest.approx(TRN2.peak_bf16_flops_per_ns)


def test_fp32_matmul_is_four_times_slower_and_short_ones_cost_64_cycles():
    assert TRN2.estimate(one("tensor", "matmul", 512, wide=True)).total_ns == pytest.approx(4 * 512 / 2.4)
    assert TRN2.estimate(one("tensor", "matmul", 8)).total_ns == pytest.approx(64 / 2.4)


def test_activation_cost():
    assert TRN2.estimate(one("scalar", "activation", 1024)).total_ns == pytest.approx((1024 + 64) / 1.2)
    assert TRN2.estimate(one("scalar", "activation", 10)).total_ns == pytest.approx((64 + 64) / 1.2)


def test_vector_costs_by_inputs_and_width():
    assert TRN2.estimate(one("vector", "tensor_tensor", 512)).total_ns == pytest.approx((2 * 512 / 4 + 100) / 0.96)
    assert TRN2.estimate(one("vector", "tensor_tensor", 512, wide=True)).total_ns == pytest.approx(
        (2 * 512 / 2 + 100) / 0.96)
    assert TRN2.estimate(one("vector", "tensor_scalar", 512)).total_ns == pytest.approx((512 / 4 + 100) / 0.96)


def test_dma_cost_is_bandwidth_plus_fixed_cost_per_transfer():
    acc = Accounting()
    acc.record_dma("w", "hbm->sbuf", DmaTraffic(bytes=1 << 20, transfers=1, rows=128))
    est = TRN2.estimate(acc)
    assert est.engines_ns["dma"] == pytest.approx((1 << 20) / 362.5 + 1300 / 16)
    skipped = Accounting()
    skipped.record_dma("w", "hbm->sbuf", DmaTraffic(skipped_transfers=1, skipped_rows=128))
    assert TRN2.estimate(skipped).engines_ns["dma"] == 0.0
    peer = Accounting()
    peer.record_dma("p", "sbuf->sbuf", DmaTraffic(bytes=368 * 1000, transfers=1, rows=128))
    assert TRN2.estimate(peer).engines_ns["dma"] == pytest.approx(1000 + 1300 / 16)


def test_engines_overlap_and_barriers_add():
    acc = one("tensor", "matmul", 512, count=10)
    acc.add(one("scalar", "activation", 1024))
    acc.barriers = 2
    est = TRN2.estimate(acc)
    assert est.bound == "tensor"
    assert est.total_ns == pytest.approx(10 * 512 / 2.4 + 2 * 1300)
    assert est.serial_ns == pytest.approx(10 * 512 / 2.4 + (1024 + 64) / 1.2 + 2 * 1300)


def test_a_launch_takes_as_long_as_its_slower_core():
    def kernel(x):
        t = nl.ndarray((128, 512), nl.bfloat16)
        nisa.memset(t, 1.0)
        ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        for _ in nl.affine_range(1 + 3 * nl.program_id(0)):  # core 1 does 4 matmuls, core 0 one
            nisa.nc_matmul(ps, t[:, :128], t, accumulate=False)
        return x

    run = simulate(kernel, lnc=2)(np.zeros(1, dtype=ml_dtypes.bfloat16))
    est = TRN2.estimate_run(run)
    memset_ns = (512 / 4 + 100) / 0.96
    assert est.cores[0].total_ns == pytest.approx(max(512 / 2.4, memset_ns))
    assert est.total_ns == pytest.approx(4 * 512 / 2.4)
    assert est.summary()["total_us"] == pytest.approx(4 * 512 / 2.4 / 1e3)


def test_assumptions_state_it_is_a_model_and_follow_the_numbers():
    text = "\n".join(Trn2(tensor_ghz=1.0).assumptions())
    assert "a model, not a measurement" in text
    assert "TensorE 1.0 GHz" in text and "32.8 bf16 TFLOPS" in text
