"""Kernels in real NKI style (nki_style_kernels.py) against NumPy statements of what they compute."""

from __future__ import annotations

import importlib
import sys

import ml_dtypes
import numpy as np
import pytest

from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.machine import OutOfBoundsError

STYLE_MODULE = "nki_style_kernels"


@pytest.fixture
def nki_style(nki_compat):  # noqa: F811 -- the fixture imported above
    """The kernels of nki_style_kernels.py, imported (``import nki.language as nl``) while the API is installed."""
    sys.modules.pop(STYLE_MODULE, None)
    yield importlib.import_module(STYLE_MODULE)
    sys.modules.pop(STYLE_MODULE, None)

rng = np.random.default_rng(0)


def test_tiled_matmul_accumulates_k_tiles_in_psum(nki_style, nki_compat):
    a_t = rng.standard_normal((384, 128)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((384, 512)).astype(ml_dtypes.bfloat16)
    out = nki_compat.simulate(nki_style.tiled_matmul)(a_t, b)
    expected = a_t.astype(np.float64).T @ b.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-3)
    acc = compat.last_run().accounting
    assert acc.matmuls == 3 and acc.matmul_flops == 2 * 384 * 128 * 512
    assert acc.dma_bytes("a_t", "hbm->sbuf") == a_t.nbytes and acc.dma_bytes("b", "hbm->sbuf") == b.nbytes


def test_indirect_gather_skips_out_of_bounds_rows(nki_style, nki_compat):
    table = rng.standard_normal((10, 16)).astype(np.float32)
    ids = np.array([3, -1, 9, 10, 0, 3], np.int32)
    out = nki_compat.simulate(nki_style.gather_rows)(table, ids)
    valid = (ids >= 0) & (ids < 10)
    np.testing.assert_array_equal(out, np.where(valid[:, None], table[np.clip(ids, 0, 9)], 0))
    traffic = compat.last_run().accounting.traffic("table", "hbm->sbuf")
    assert traffic.rows == 4 and traffic.skipped_rows == 2 and traffic.bytes == 4 * 16 * 4


def test_iota_built_index_vector_drives_a_gather(nki_style, nki_compat):
    table = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    np.testing.assert_array_equal(nki_compat.simulate(nki_style.strided_rows)(table, 3, 2), table[2::3])


def test_sequential_range_carries_a_tile_across_iterations(nki_style, nki_compat):
    x = rng.standard_normal((64, 512)).astype(np.float32)
    out = nki_compat.simulate(nki_style.running_column_sums)(x)
    expected = np.cumsum(x.reshape(64, 4, 128).sum(axis=2, dtype=np.float64), axis=1)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_dynamic_range_with_a_device_trip_count_and_scalar_offsets(nki_style, nki_compat):
    x = rng.standard_normal((5, 128, 8)).astype(np.float32)
    for count in (0, 2, 5):
        out = nki_compat.simulate(nki_style.dynamic_block_sum)(x, np.array([count], np.int32))
        np.testing.assert_allclose(out, x[:count].sum(axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)
        assert compat.last_run().accounting.dynamic_iterations == count
    with pytest.raises(OutOfBoundsError, match="out of bounds"):
        nki_compat.simulate(nki_style.dynamic_block_sum)(x, np.array([6], np.int32))


def test_sendrecv_exchanges_partials_between_the_two_cores(nki_style, nki_compat):
    x = rng.standard_normal((32, 64)).astype(np.float32)
    out = nki_compat.simulate(nki_style.lnc2_sum_of_halves[2])(x)
    np.testing.assert_allclose(out, np.stack([x.sum(axis=1)] * 2), rtol=1e-5, atol=1e-5)
    run = compat.last_run()
    assert [core.barriers for core in run.cores] == [1, 1]
    with pytest.raises(ValueError, match="two cores"):
        nki_compat.simulate(nki_style.lnc2_sum_of_halves[1])(x)


def test_transposes_by_strided_view_and_by_the_tensor_engine(nki_style, nki_compat):
    x = rng.standard_normal((128, 64)).astype(ml_dtypes.bfloat16)
    x[5, 7] = np.nan  # the PE transpose is bit-accurate
    by_dma, by_pe = nki_compat.simulate(nki_style.transpose_through_views)(x)
    np.testing.assert_array_equal(by_dma.view(np.uint16), x.T.view(np.uint16))
    np.testing.assert_array_equal(by_pe.view(np.uint16), x.T.view(np.uint16))
    assert compat.last_run().accounting.transposes == 1


def test_on_chip_capacity_follows_tensor_lifetimes(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl

    def psum_tiles(a, keep: bool):
        sb = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=sb, src=a)
        kept = []
        for _ in range(12):  # a plain Python loop, as in nki-library: no loop scope frees anything
            ps = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=sb, moving=sb)
            kept.append(ps)
        if keep:  # a last use of every bank at the end keeps all twelve live at once
            for ps in kept:
                nisa.tensor_copy(dst=sb, src=ps)

    a = np.ones((128, 128), ml_dtypes.bfloat16)
    run = compat.run(psum_tiles, a, False)
    assert run.accounting.psum_high_water_banks == 1  # each bank is dead after its matmul
    with pytest.raises(ValueError, match="PSUM over capacity: 12 banks .* live at once"):
        compat.run(psum_tiles, a, True)


def test_counting_runs_count_what_numeric_runs_do(nki_style, nki_compat):  # noqa: F811
    a_t = rng.standard_normal((256, 128)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((256, 512)).astype(ml_dtypes.bfloat16)
    table = rng.standard_normal((10, 16)).astype(np.float32)
    ids = np.array([3, -1, 9, 10], np.int32)
    for kernel, args in ((nki_style.tiled_matmul, (a_t, b)), (nki_style.gather_rows, (table, ids))):
        numeric = compat.run(kernel, *args).accounting.summary()
        counting = compat.run(kernel, *args, numerics=False)
        assert counting.outputs is None and counting.accounting.summary() == numeric


def test_counting_runs_keep_index_arithmetic_through_float_tiles_exact(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl

    def ids_through_the_pe(ids, weights):
        """Token ids transposed on the Tensor Engine via fp32 (as nki-library's shard-on-I loads them), then used to
        gather weight rows; and an id computed from float weights, which a counting run cannot know."""
        row = nl.ndarray((1, 128), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=ids.reshape((1, 128)))
        ps = nl.ndarray((128, 1), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=row)
        col = nl.ndarray((128, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=col, src=ps)
        rows = nl.ndarray((128, 4), weights.dtype, buffer=nl.sbuf)
        nisa.memset(dst=rows, value=0.0)
        nisa.dma_copy(dst=rows, src=weights.ap([[4, 128], [1, 4]], vector_offset=col), oob_mode=nisa.oob_mode.skip)
        w = nl.ndarray((128, 4), weights.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w, src=weights[0:128])
        bad = nl.ndarray((128, 4), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=bad, src=w)

    ids = np.where(np.arange(128) % 3 == 0, -1, np.arange(128) % 50).astype(np.int32)
    weights = rng.standard_normal((200, 4)).astype(np.float32)
    with pytest.raises(RuntimeError, match="integer tensor .* would be computed from float tensors"):
        compat.run(ids_through_the_pe, ids, weights, numerics=False)
    numeric = compat.run(ids_through_the_pe, ids, weights)
    traffic = numeric.accounting.traffic("weights", "hbm->sbuf")
    assert traffic.skipped_rows == int((ids < 0).sum())
