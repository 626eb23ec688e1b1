"""Fidelity to Trn2 as nki-library's kernels rely on it: which engine an instruction runs on and where it may write,
access patterns read as the hardware reads them, and on-chip memory allocated and reused as the NKI compiler does.
Each test is a small kernel with the rule stated in NumPy or as the documented error."""

from __future__ import annotations

import numpy as np
import pytest
from test_compat_ops import _load, _store  # the same test helpers (pytest puts this folder on sys.path)

from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.machine import HardwareLimitError

rng = np.random.default_rng(7)


@pytest.fixture
def k(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl

    return nl, nisa


# ------------------------------------------------------------------------------------------------ engines


def test_transpose_into_sbuf_runs_on_the_vector_engine(k):
    """NKI: without ``engine`` the compiler picks; only the Vector Engine writes SBUF, 32 x 32 at most."""
    nl, nisa = k
    x = rng.standard_normal((32, 24)).astype(np.float32)
    tall = rng.standard_normal((64, 16)).astype(np.float32)

    def body(a, b):
        t = _load(nl, nisa, a)
        out = nl.ndarray((24, 32), nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=out, data=t)
        with pytest.raises(HardwareLimitError, match="is in sbuf; it must be in psum"):
            nisa.nc_transpose(dst=out, data=t, engine=nisa.tensor_engine)
        with pytest.raises(HardwareLimitError, match="vector engine transpose limit 32 x 32"):
            nisa.nc_transpose(dst=nl.ndarray((16, 64), nl.float32, buffer=nl.sbuf), data=_load(nl, nisa, b))
        return _store(nl, nisa, out)

    run = compat.run(body, x, tall)
    np.testing.assert_array_equal(run.outputs, x.T)
    assert run.accounting.transposes == 0  # not a Tensor Engine transpose
    assert any(key[0] == "vector" and key[1] == "transpose" for key in run.accounting.engine_ops)


# ------------------------------------------------------------------------------------------------ access patterns


def test_access_pattern_outside_its_tensor_is_checked_when_accessed_not_when_built(k):
    """nki-library's shard-on-block sizes an SBUF tensor by ``block_to_expert.ap([[4, 128], [2, 2]], offset).shape``
    -- a pattern reaching past the tensor that no instruction ever reads. Building it is legal; reading it is not."""
    nl, nisa = k
    block_to_expert = np.arange(6, dtype=np.int32).reshape(6, 1)

    def read_outside(b2e):
        t = nl.ndarray((128, 2), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=b2e.ap(pattern=[[4, 128], [2, 2]], offset=1))

    with pytest.raises(HardwareLimitError, match=r"\[\[4, 128\], \[2, 2\]\] \+ offset 1 reaches outside tensor"):
        compat.run(read_outside, block_to_expert)

    def in_bounds(b2e):
        t = nl.ndarray(b2e.ap(pattern=[[4, 128], [2, 2]], offset=0).shape, nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:2, 0:2], src=b2e.ap(pattern=[[3, 2], [2, 2]], offset=0))  # 0, 2 / 3, 5
        return _store(nl, nisa, t[0:2, 0:2])

    np.testing.assert_array_equal(compat.run(in_bounds, block_to_expert).outputs, [[0, 2], [3, 5]])


# ------------------------------------------------------------------------------------------------ on-chip memory


def _psum_tiles_then_evacuate(nl, nisa, a, b, tiles: int, normalise_by_all: bool):
    """``tiles`` PSUM banks filled first and evacuated afterwards (the shape of nki-library's moe_cte gate/up
    projection). With ``normalise_by_all`` each evacuation subtracts a maximum over *all* banks (softmax-style), so
    every bank must stay live until all are written -- no schedule can avoid it."""
    sa, sb = _load(nl, nisa, a), _load(nl, nisa, b)
    banks = []
    for _ in range(tiles):
        ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=sa, moving=sb)
        banks.append(ps)
    if normalise_by_all:
        stat = nl.ndarray((128, tiles), nl.float32, buffer=nl.sbuf)
        for j, ps in enumerate(banks):
            nisa.tensor_reduce(dst=stat[:, j:j + 1], op=nl.maximum, data=ps, axis=1)
        top = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=top, op=nl.maximum, data=stat, axis=1)
    out = nl.ndarray((128, tiles, 512), nl.float32, buffer=nl.shared_hbm)
    for j, ps in enumerate(banks):
        o = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        if normalise_by_all:
            nisa.tensor_scalar(dst=o, data=ps, op0=nl.subtract, operand0=top)
        else:
            nisa.tensor_copy(dst=o, src=ps)
        nisa.dma_copy(dst=out[:, j, :], src=o)
    return out


def test_psum_banks_filled_then_evacuated_fit_as_the_compiler_schedules_them(k):
    """Twelve banks written in program order and read afterwards: each evacuation depends only on its own bank, so
    the compiler moves it up behind that bank's matmul -- the kernel fits the 8 banks (nki-library moe_cte, I=3072
    at LNC2), and the high-water mark is what any schedule needs."""
    nl, nisa = k
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    run = compat.run(lambda x, y: _psum_tiles_then_evacuate(nl, nisa, x, y, 12, False), a, b)
    np.testing.assert_allclose(run.outputs, np.repeat((a.T @ b)[:, None, :], 12, axis=1), rtol=1e-5, atol=1e-4)
    assert run.accounting.psum_high_water_banks <= 8


def test_psum_over_capacity_under_every_schedule_is_rejected(k):
    nl, nisa = k
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    run = compat.run(lambda x, y: _psum_tiles_then_evacuate(nl, nisa, x, y, 8, True), a, b)  # 8 banks: fits
    assert run.accounting.psum_high_water_banks == 8
    with pytest.raises(HardwareLimitError, match=r"PSUM over capacity: 9 banks .* live at once under any instruction "
                                                 r"schedule .* exceeds 8"):
        compat.run(lambda x, y: _psum_tiles_then_evacuate(nl, nisa, x, y, 9, True), a, b)


def test_a_loop_reuses_psum_banks_and_sbuf_across_iterations(k):
    """A tile allocated per iteration of a plain Python loop is dead once the iteration's last instruction read it:
    48 iterations of a 2-bank accumulation and a 96 KiB SBUF staging tile reuse the same memory."""
    nl, nisa = k
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 1024)).astype(np.float32)

    def body(x, y):
        sa, sb = _load(nl, nisa, x), _load(nl, nisa, y)
        out = nl.ndarray((48, 128, 1024), nl.float32, buffer=nl.shared_hbm)
        for i in range(48):
            ps = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)  # 2 banks
            for half in range(2):
                nisa.nc_matmul(dst=ps[:, half * 512:(half + 1) * 512], stationary=sa,
                               moving=sb[:, half * 512:(half + 1) * 512])
            staging = nl.ndarray((128, 24 * 1024), nl.float32, buffer=nl.sbuf)  # 96 KiB per partition
            nisa.tensor_copy(dst=staging[:, 0:1024], src=ps)
            nisa.dma_copy(dst=out[i], src=staging[:, 0:1024])
        return out

    run = compat.run(body, a, b)
    np.testing.assert_allclose(run.outputs[47], a.T @ b, rtol=1e-5, atol=1e-4)
    assert run.accounting.psum_high_water_banks == 2
    assert run.accounting.sbuf_high_water == 96 * 1024 + (128 + 1024) * 4  # one staging tile + the two operands


def test_tiles_a_kernel_dropped_are_freed_though_a_resident_operand_fed_them(k):
    """Host memory: a weight tile read by many matmuls into per-iteration PSUM tiles does not keep those tiles alive
    once their products are stored (nki-library's moe_tkg at T=1024 held 1.4 GB of dead PSUM tiles that way)."""
    import gc
    import weakref

    nl, nisa = k
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    psum_tiles = []

    def body(x, y):
        sa, sb = _load(nl, nisa, x), _load(nl, nisa, y)
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        for _ in range(20):
            ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=sa, moving=sb)
            staging = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=staging, src=ps)
            nisa.dma_copy(dst=out, src=staging)
            psum_tiles.append(weakref.ref(ps.alloc))
        gc.collect()
        assert sum(ref() is not None for ref in psum_tiles) <= 1  # only the last iteration's, still named ``ps``
        return out

    np.testing.assert_allclose(compat.run(body, a, b).outputs, a.T @ b, rtol=1e-5, atol=1e-4)


def test_sbuf_over_capacity_under_every_schedule_is_rejected(k):
    """Tiles that each need a statistic over all of them must all be resident at once: 3 x 64 KiB fit, 4 do not."""
    nl, nisa = k
    x = rng.standard_normal((128, 16 * 1024)).astype(np.float32)  # 64 KiB per partition

    def body(a, count):
        tiles = [_load(nl, nisa, a) for _ in range(count)]
        stat = nl.ndarray((128, count), nl.float32, buffer=nl.sbuf)
        for j, t in enumerate(tiles):
            nisa.tensor_reduce(dst=stat[:, j:j + 1], op=nl.maximum, data=t, axis=1)
        top = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=top, op=nl.maximum, data=stat, axis=1)
        out = nl.ndarray((count, 128, 16 * 1024), nl.float32, buffer=nl.shared_hbm)
        for j, t in enumerate(tiles):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.subtract, operand0=top)
            nisa.dma_copy(dst=out[j], src=t)
        return out

    run = compat.run(body, x, 3)
    np.testing.assert_allclose(run.outputs[2], x - x.max(axis=1, keepdims=True), rtol=1e-6)
    assert 3 * 64 * 1024 <= run.accounting.sbuf_high_water <= 224 * 1024
    with pytest.raises(HardwareLimitError, match=r"SBUF over capacity: \d+ bytes per partition live at once"):
        compat.run(body, x, 4)


# ------------------------------------------------------------------------------------------------ accumulation groups


def test_matmul_accumulation_groups_equal_the_step_by_step_sum(k):
    """Accumulation groups are computed lazily as one product (a speed-up): the result must equal the hardware's
    step-by-step sum even when an operand tile is overwritten before PSUM is read, the group switches region, or a
    matmul with ``accumulate=False`` restarts it."""
    nl, nisa = k
    a = rng.standard_normal((4, 128, 64)).astype(np.float32)
    b = rng.standard_normal((4, 128, 256)).astype(np.float32)

    def body(x, y):
        st = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        mv = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)
        ps = nl.ndarray((64, 512), nl.float32, buffer=nl.psum)
        for kt in range(4):  # left half: sum over 4 K-tiles, the operand tiles reloaded in place each time
            nisa.dma_copy(dst=st, src=x[kt])
            nisa.dma_copy(dst=mv, src=y[kt])
            nisa.nc_matmul(dst=ps[:, 0:256], stationary=st, moving=mv)
        nisa.nc_matmul(dst=ps[:, 256:512], stationary=st, moving=mv)  # right half: K-tile 3 ...
        nisa.nc_matmul(dst=ps[:, 256:512], stationary=st, moving=mv, accumulate=False)  # ... overwritten
        nisa.dma_copy(dst=mv, src=y[0])
        nisa.nc_matmul(dst=ps[:, 256:512], stationary=st, moving=mv)  # + x3.T @ y0
        out = nl.ndarray((64, 512), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ps)
        return _store(nl, nisa, out)

    got = compat.run(body, a, b).outputs
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    left = sum(a64[kt].T @ b64[kt] for kt in range(4))
    right = a64[3].T @ b64[3] + a64[3].T @ b64[0]
    np.testing.assert_allclose(got[:, :256], left, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[:, 256:], right, rtol=1e-5, atol=1e-4)


def test_array_arguments_are_not_copied(k):
    """A writeable C-contiguous argument is the HBM tensor itself (a large weight costs no second copy); an argument
    overlapping an earlier one, or a read-only one, is copied."""
    nl, nisa = k
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)

    def body(a, b, c):
        t = _load(nl, nisa, b)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=a, src=t)  # writes the first argument
        return _store(nl, nisa, t)

    frozen = x.copy()
    frozen.flags.writeable = False
    run = compat.run(body, x, x, frozen)
    assert np.shares_memory(run.arguments["a"], x)
    assert not np.shares_memory(run.arguments["b"], x) and not np.shares_memory(run.arguments["c"], frozen)
    np.testing.assert_array_equal(x, frozen + 1)  # the kernel's write landed in the caller's array


def test_gpsimd_cannot_access_psum_in_any_instruction(k):
    nl, nisa = k

    def body():
        ps = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        sb = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=sb, value=1.0, engine=nisa.gpsimd_engine)
        nisa.memset(dst=ps, value=0.0)  # the Vector Engine may
        for call in (lambda: nisa.memset(dst=ps, value=0.0, engine=nisa.gpsimd_engine),
                     lambda: nisa.tensor_tensor(dst=sb, data1=ps, data2=sb, op=nl.add, engine=nisa.gpsimd_engine),
                     lambda: nisa.tensor_scalar(dst=ps, data=sb, op0=nl.add, operand0=1.0, engine=nisa.gpsimd_engine),
                     lambda: nisa.tensor_copy(dst=sb, src=ps, engine=nisa.gpsimd_engine)):
            with pytest.raises(HardwareLimitError, match="GpSimd Engine cannot access PSUM"):
                call()

    compat.run(body)


def test_tensor_copy_converts_through_fp32_fp8_by_table_ints_to_nearest(k):
    nl, nisa = k
    import ml_dtypes

    every_fp8 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3).reshape(2, 128)
    floats = np.array([[0.4, 0.6, 1.5, -2.6]], np.float32)

    def body(a, f):
        t, tf = _load(nl, nisa, a), _load(nl, nisa, f)
        wide = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wide, src=t)
        ints = nl.ndarray(f.shape, nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ints, src=tf)
        return _store(nl, nisa, wide), _store(nl, nisa, ints)

    wide, ints = compat.run(body, every_fp8, floats).outputs
    np.testing.assert_array_equal(wide.view(np.uint16), every_fp8.astype(np.float32).astype(ml_dtypes.bfloat16)
                                  .view(np.uint16))  # all 256 codes, NaN and Inf included, bit for bit
    np.testing.assert_array_equal(ints, [[0, 1, 2, -3]])
