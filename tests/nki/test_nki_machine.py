"""The tile machine itself: every Trn2 limit violated on purpose raises an error naming it; fresh memory is NaN;
stores round to the storage dtype; DMA offsets, out-of-bounds modes, registers, dynamic loops, LNC2 cores, barriers
and sendrecv behave as NKI documents; the accounting counts what happened."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nxd_moe.nki_kernels import CoreDivergenceError, HardwareLimitError, OutOfBoundsError, simulate
from nxd_moe.nki_kernels import isa as nisa
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.machine import cast, counted_once_per_signature


def run(kernel, *args, lnc: int = 1, **kwargs):
    return simulate(kernel, lnc=lnc)(*args, **kwargs)


def bf16(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------------------------------ limits


@pytest.mark.parametrize("buffer", [nl.sbuf, nl.psum])
def test_partition_dimension_129_raises(buffer):
    def kernel():
        nl.ndarray((129, 4), nl.float32, buffer=buffer)

    with pytest.raises(HardwareLimitError, match=r"partition dimension 129 exceeds nl.tile_size.pmax = 128"):
        run(kernel)


def _matmul_kernel(k: int, m: int, n: int):
    def kernel():
        stationary = nl.ndarray((k, m), nl.bfloat16)
        moving = nl.ndarray((k, n), nl.bfloat16)
        nisa.memset(stationary, 1.0)
        nisa.memset(moving, 1.0)
        out = nl.ndarray((min(m, 128), n), nl.float32, buffer=nl.psum)  # a legal tile: the operand must fail
        nisa.nc_matmul(out, stationary, moving)

    return kernel


def test_matmul_at_the_limits_runs():
    run(_matmul_kernel(128, 128, 512))


def test_moving_free_513_raises():
    with pytest.raises(HardwareLimitError, match=r"moving free size 513 exceeds nl.tile_size.gemm_moving_fmax = 512"):
        run(_matmul_kernel(128, 128, 513))


def test_stationary_free_129_raises():
    with pytest.raises(HardwareLimitError,
                       match=r"stationary free size 129 exceeds nl.tile_size.gemm_stationary_fmax = 128"):
        run(_matmul_kernel(128, 129, 512))


def test_psum_over_capacity_raises():
    def kernel():
        for i in range(9):  # 9 banks of 2 KiB per partition; PSUM has 8
            nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"bank{i}")

    with pytest.raises(HardwareLimitError, match=r"PSUM over capacity: tensor 'bank8'.*8 of 8 banks"):
        run(kernel)


def test_sbuf_over_capacity_raises():
    def kernel():
        nl.ndarray((128, 100 * 1024), nl.bfloat16, name="a")  # 200 KiB per partition of 224
        nl.ndarray((128, 13 * 1024), nl.bfloat16, name="b")  # 26 KiB more

    with pytest.raises(HardwareLimitError, match=r"SBUF over capacity: tensor 'b'.*229376 bytes per partition"):
        run(kernel)


def test_out_of_bounds_index_with_error_mode_raises():
    def gather(index_table, values):
        ids = nl.ndarray((4, 1), nl.int32)
        nisa.dma_copy(ids, index_table[0:4, 0:1])
        rows = nl.ndarray((4, 8), nl.float32)
        nisa.dma_copy(rows, values.ap([[8, 4], [1, 8]], vector_offset=ids), oob_mode=nisa.oob_mode.error)

    index = np.zeros((6, 8), dtype=np.int32)
    index[:4, 0] = [0, 5, 6, 2]
    with pytest.raises(OutOfBoundsError,
                       match=r"dynamic index 6 is out of bounds for dim 0 of size 6 \(oob_mode=error\)"):
        run(gather, index, np.zeros((6, 8), dtype=np.float32))


def test_matmul_operand_rules_raise():
    def fp32_with_bf16():
        a = nl.ndarray((8, 8), nl.float32)
        b = nl.ndarray((8, 8), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((8, 8), nl.float32, buffer=nl.psum), a, b)

    with pytest.raises(TypeError, match="float32 operands must be paired"):
        run(fp32_with_bf16)

    def bf16_dst():
        a = nl.ndarray((8, 8), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((8, 8), nl.bfloat16, buffer=nl.psum), a, a)

    with pytest.raises(HardwareLimitError, match="dst must be float32"):
        run(bf16_dst)

    def dst_in_sbuf():
        a = nl.ndarray((8, 8), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((8, 8), nl.float32), a, a)

    with pytest.raises(HardwareLimitError, match="it must be in psum"):
        run(dst_in_sbuf)

    def accumulate_onto_fresh_psum():
        a = nl.ndarray((8, 8), nl.bfloat16)
        nisa.memset(a, 1.0)
        nisa.nc_matmul(nl.ndarray((8, 8), nl.float32, buffer=nl.psum), a, a, accumulate=True)

    with pytest.raises(HardwareLimitError, match="accumulate=True onto PSUM tile .* that no nc_matmul initialised"):
        run(accumulate_onto_fresh_psum)


def test_dma_cannot_reach_psum():
    def kernel(out):
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.dma_copy(out, ps)

    with pytest.raises(HardwareLimitError, match="PSUM, which DMA cannot reach"):
        run(kernel, np.zeros((4, 4), dtype=np.float32))


def test_using_a_tensor_after_its_iteration_raises():
    def kernel():
        kept = []
        for _ in nl.affine_range(2):
            kept.append(nl.ndarray((4, 4), nl.float32))
        nisa.memset(kept[0], 0.0)

    with pytest.raises(RuntimeError, match="used after the loop iteration that allocated it ended"):
        run(kernel)


# ----------------------------------------------------------------------------------------------- memory, numerics


def test_fresh_memory_is_nan_and_integers_are_four():
    def kernel():
        floats = nl.ndarray((4, 3), nl.bfloat16)
        ints = nl.ndarray((4, 3), nl.int32)
        out_f = nl.ndarray((4, 3), nl.bfloat16, buffer=nl.shared_hbm)
        out_i = nl.ndarray((4, 3), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(out_f, floats)
        nisa.dma_copy(out_i, ints)
        return out_f, out_i

    out_f, out_i = run(kernel).outputs
    assert np.isnan(out_f.astype(np.float32)).all()
    assert (out_i == 4).all()


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16, nl.float16, nl.float8_e4m3, nl.float8_e4m3fn,
                                   nl.float8_e5m2, nl.int8, nl.uint8, nl.int16, nl.int32, nl.uint32])
def test_fresh_memory_of_every_dtype_holds_the_simulators_fill_bits(dtype):
    """Fresh tiles are filled through raw words (fast for ml_dtypes types); the bits are NumPy's NaN (4 for ints)."""
    def kernel():
        tile = nl.ndarray((3, 5), dtype)
        out = nl.ndarray((3, 5), dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        return out

    expected = np.full((3, 5), 4 if np.issubdtype(dtype, np.integer) else np.nan, dtype=dtype)
    out = run(kernel).outputs
    assert out.dtype == dtype
    assert out.view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()


def test_half_precision_conversions_equal_numpys_bit_for_bit():
    """float16 converts through torch (fast); every half value widens, and random fp32 bits narrow, exactly as
    NumPy does -- NaN stays NaN (its payload is not specified)."""
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    singles = np.random.default_rng(3).integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    singles = np.concatenate([singles.view(np.float32), np.float32([65504, 65520, 65519.99, 6e-8, 3e-8, -0.0])])
    for values, dtype in ((halves, np.float32), (singles, np.float16)):
        ours, numpys = cast(values, dtype), values.astype(dtype)
        nan = np.isnan(numpys)
        assert np.isnan(ours[nan]).all()
        assert ours[~nan].tobytes() == numpys[~nan].tobytes()


@pytest.mark.parametrize("dtype", [nl.bfloat16, nl.float8_e4m3])
def test_stores_round_to_the_storage_dtype(dtype):
    values = np.array([[1.0 + 2.0 ** -10, 3.14159265, -100.3, 1e-3]], dtype=np.float32)

    def kernel(x):
        src = nl.ndarray((1, 4), nl.float32)
        nisa.dma_copy(src, x)
        low = nl.ndarray((1, 4), dtype)
        nisa.tensor_copy(low, src)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        back = nl.ndarray((1, 4), nl.float32)
        nisa.tensor_copy(back, low)
        nisa.dma_copy(out, back)
        return out

    out = run(kernel, values).outputs
    np.testing.assert_array_equal(out, values.astype(dtype).astype(np.float32))
    assert not np.array_equal(out, values)  # rounding happened


def test_engine_ops_match_numpy():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal((8, 16)).astype(np.float32)
    col = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(a, b, col):
        ta, tb, tc = (nl.ndarray(t.shape, nl.float32) for t in (a, b, col))
        for dst, src in ((ta, a), (tb, b), (tc, col)):
            nisa.dma_copy(dst, src)
        outs = []
        results = [nl.ndarray((8, 16), nl.float32) for _ in range(4)]
        nisa.activation(results[0], nl.silu, ta, bias=tc, scale=2.0)
        nisa.tensor_tensor(results[1], ta, tb, nl.multiply)
        nisa.tensor_scalar(results[2], ta, nl.multiply, tc, op1=nl.minimum, operand1=0.5)
        nisa.scalar_tensor_tensor(results[3], ta, nl.add, tc, nl.maximum, tb)
        reduced = nl.ndarray((8, 1), nl.float32)
        nisa.tensor_reduce(reduced, nl.add, ta, axis=1, keepdims=True)
        transposed = nl.ndarray((16, 8), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(transposed, ta)
        for r in [*results, reduced, transposed]:
            out = nl.ndarray(r.shape, nl.float32, buffer=nl.shared_hbm)
            if r.buffer is nl.psum:
                staged = nl.ndarray(r.shape, nl.float32)
                nisa.tensor_copy(staged, r)
                r = staged
            nisa.dma_copy(out, r)
            outs.append(out)
        return tuple(outs)

    got = run(kernel, a, b, col).outputs
    z = a * 2.0 + col
    expected = [z / (1 + np.exp(-z)), a * b, np.minimum(a * col, 0.5), np.maximum(a + col, b),
                a.sum(axis=1, keepdims=True), a.T]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_matmul_accumulates_in_fp32_over_the_contraction():
    x = bf16((256, 64), 1)
    w = bf16((256, 32), 2)

    def kernel(x, w):
        out = nl.ndarray((32, 64), nl.float32, buffer=nl.shared_hbm)
        ps = nl.ndarray((32, 64), nl.float32, buffer=nl.psum)
        for k in nl.affine_range(2):  # contraction 256 = two partition tiles accumulated in one PSUM bank
            xs, ws = nl.ndarray((128, 64), nl.bfloat16), nl.ndarray((128, 32), nl.bfloat16)
            nisa.dma_copy(xs, x[k * 128:(k + 1) * 128, :])
            nisa.dma_copy(ws, w[k * 128:(k + 1) * 128, :])
            nisa.nc_matmul(ps, ws, xs)
        sb = nl.ndarray((32, 64), nl.float32)
        nisa.tensor_copy(sb, ps)
        nisa.dma_copy(out, sb)
        return out

    result = run(kernel, x, w)
    expected = w.astype(np.float64).T @ x.astype(np.float64)
    np.testing.assert_allclose(result.outputs, expected, rtol=1e-5, atol=1e-5)
    assert result.accounting.matmuls == 2
    assert result.accounting.matmul_flops == 2 * 256 * 32 * 64


# ----------------------------------------------------------------------------------------------------------- DMA


def _gather(oob_mode):
    def kernel(index, values):
        ids = nl.ndarray((4, 1), nl.int32)
        nisa.dma_copy(ids, index)
        rows = nl.ndarray((4, 8), nl.float32)
        nisa.memset(rows, -1.0)
        nisa.dma_copy(rows, values.ap([[8, 4], [1, 8]], vector_offset=ids), oob_mode=oob_mode)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, rows)
        return out

    return kernel


def test_vector_offset_gather_and_skip_mode():
    values = np.arange(48, dtype=np.float32).reshape(6, 8)
    index = np.array([[5], [-1], [2], [6]], dtype=np.int32)
    result = simulate(_gather(nisa.oob_mode.skip))(index, values)
    np.testing.assert_array_equal(result.outputs[[0, 2]], values[[5, 2]])
    np.testing.assert_array_equal(result.outputs[[1, 3]], -1.0)  # skipped rows keep what the tile held
    traffic = result.accounting.traffic("values", "hbm->sbuf")
    assert (traffic.rows, traffic.skipped_rows, traffic.bytes) == (2, 2, 2 * 8 * 4)
    with pytest.raises(OutOfBoundsError, match="dynamic index -1"):
        simulate(_gather(nisa.oob_mode.error))(index, values)


def test_vector_offset_rows_move_whole_with_a_strided_reversed_inner_pattern():
    """Gather and scatter by ``vector_offset`` with inner pattern ``[-2, 3]`` from offset 6: row ``r`` is elements
    ``(r, 6), (r, 4), (r, 2)`` -- the NumPy statement below; a scatter's repeated row keeps the last write, a skipped
    row (-1) is not written."""
    table = np.arange(48, dtype=np.float32).reshape(6, 8)
    gather_ids = np.array([[5], [0], [3], [3]], dtype=np.int32)
    scatter_ids = np.array([[1], [4], [1], [-1]], dtype=np.int32)
    updates = -np.arange(1, 13, dtype=np.float32).reshape(4, 3)

    def kernel(table, gather_ids, scatter_ids, updates):
        ids = nl.ndarray((4, 1), nl.int32)
        nisa.dma_copy(ids, gather_ids)
        rows = nl.ndarray((4, 3), nl.float32)
        nisa.dma_copy(rows, table.ap([[8, 4], [-2, 3]], offset=6, vector_offset=ids))
        gathered = nl.ndarray((4, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(gathered, rows)
        targets = nl.ndarray((4, 1), nl.int32)
        nisa.dma_copy(targets, scatter_ids)
        tile = nl.ndarray((4, 3), nl.float32)
        nisa.dma_copy(tile, updates)
        nisa.dma_copy(table.ap([[8, 4], [-2, 3]], offset=6, vector_offset=targets), tile,
                      oob_mode=nisa.oob_mode.skip)
        return gathered

    run = simulate(kernel)(table, gather_ids, scatter_ids, updates)
    columns = [6, 4, 2]
    np.testing.assert_array_equal(run.outputs, table[gather_ids[:, 0]][:, columns])
    expected = table.copy()
    for row, update in zip(scatter_ids[:, 0], updates):
        if row >= 0:
            expected[row, columns] = update
    np.testing.assert_array_equal(run.arguments["table"], expected)


def test_scalar_offset_selects_a_row_and_skips_out_of_bounds_whole():
    def kernel(table, which):
        reg_src = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(reg_src, which)
        row = nl.ndarray((1, 8), nl.float32)
        nisa.memset(row, 7.0)
        nisa.dma_copy(row, table.ap([[8, 1], [1, 8]], scalar_offset=reg_src, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
        out = nl.ndarray((1, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, row)
        return out

    table = np.arange(24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_array_equal(simulate(kernel)(table, np.array([[2]], dtype=np.int32)).outputs, table[2:3])
    skipped = simulate(kernel)(table, np.array([[3]], dtype=np.int32))
    np.testing.assert_array_equal(skipped.outputs, 7.0)
    assert skipped.accounting.traffic("table").skipped_transfers == 1


# --------------------------------------------------------------------------------------- registers and loops


def test_dynamic_range_trip_count_comes_from_a_device_tensor():
    def kernel(flags):
        sb = nl.ndarray((1, 8), nl.int32)
        nisa.dma_copy(sb, flags)
        total = nl.ndarray((1, 1), nl.int32)
        nisa.tensor_reduce(total, nl.add, sb, axis=1, keepdims=True)
        reg = nisa.register_alloc()
        nisa.register_load(reg, total)
        counter = nl.ndarray((1, 1), nl.int32)
        nisa.memset(counter, 0)
        for _ in nl.dynamic_range(1, reg):
            nisa.tensor_scalar(counter, counter, nl.add, 1)
        out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, counter)
        return out

    flags = np.array([1, 1, 1, 1, 1, 0, 0, 0], dtype=np.int32)
    result = simulate(kernel)(flags)
    assert int(result.outputs[0, 0]) == 4  # from 1 up to sum(flags) = 5
    assert result.accounting.dynamic_iterations == 4


def test_while_register_loop_reads_its_condition_on_the_device():
    def kernel(conditions):
        cond = nl.ndarray((1, 1), nl.int32)
        position = nl.ndarray((1, 1), nl.int32)
        nisa.memset(position, 0)
        nisa.dma_copy(cond, conditions.ap([[1, 1], [1, 1]], scalar_offset=position))
        reg = nisa.register_alloc(7)
        nisa.register_move(reg, 0)
        assert not reg  # a register read in Python control flow is a device branch
        nisa.register_load(reg, cond)
        while reg:
            nisa.tensor_scalar(position, position, nl.add, 1)
            nisa.dma_copy(cond, conditions.ap([[1, 1], [1, 1]], scalar_offset=position))
            nisa.register_load(reg, cond)
        out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, position)
        return out

    result = simulate(kernel)(np.array([1, 1, 1, 0, 1], dtype=np.int32))
    assert int(result.outputs[0, 0]) == 3
    assert result.accounting.branches == 5


# ------------------------------------------------------------------------------------------------------- LNC2


def test_lnc2_program_ids_shared_hbm_and_barrier():
    def kernel(x):
        core = nl.program_id(0)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm, name="out")
        mine = nl.ndarray((1, 4), nl.float32)
        nisa.memset(mine, float(core + 1))
        nisa.dma_copy(out[core:core + 1, :], mine)
        nisa.core_barrier(out, (0, 1))
        # After the barrier each core sees the other's row in the shared tensor.
        theirs = nl.ndarray((1, 4), nl.float32)
        nisa.dma_copy(theirs, out[1 - core:2 - core, :])
        total = nl.ndarray((1, 4), nl.float32)
        nisa.tensor_tensor(total, mine, theirs, nl.add)
        result = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm, name="result")
        nisa.dma_copy(result[core:core + 1, :], total)
        return result

    result = simulate(kernel, lnc=2)(np.zeros(1, dtype=np.float32))
    np.testing.assert_array_equal(result.outputs, 3.0)
    assert [core.barriers for core in result.cores] == [1, 1]
    assert nl.tile_size.pmax == 128


def test_sendrecv_exchanges_tiles():
    def kernel(x):
        core = nl.program_id(0)
        src = nl.ndarray((4, 4), nl.float32)
        nisa.memset(src, float(10 * (core + 1)))
        dst = nl.ndarray((4, 4), nl.float32)
        nisa.sendrecv(src=src, dst=dst, send_to_rank=1 - core, recv_from_rank=1 - core, pipe_id=0)
        out = nl.ndarray((2, 4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out[core], dst)
        return out

    result = simulate(kernel, lnc=2)(np.zeros(1, dtype=np.float32))
    np.testing.assert_array_equal(result.outputs[0], 20.0)
    np.testing.assert_array_equal(result.outputs[1], 10.0)
    assert result.accounting.dma_bytes(direction="sbuf->sbuf") == 2 * 4 * 4 * 4


def test_sendrecv_needs_two_cores():
    def kernel():
        t = nl.ndarray((1, 1), nl.float32)
        nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=0)

    with pytest.raises(HardwareLimitError, match="two cores"):
        run(kernel)


def test_divergent_cores_fail_instead_of_hanging():
    def kernel(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 0:
            nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(CoreDivergenceError, match="different control paths"):
        simulate(kernel, lnc=2)(np.zeros(1, dtype=np.float32))


def test_an_error_on_one_core_is_raised():
    def kernel(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 1:
            nl.ndarray((129, 1), nl.float32)
        nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(HardwareLimitError, match="pmax"):
        simulate(kernel, lnc=2)(np.zeros(1, dtype=np.float32))


# ------------------------------------------------------------------------------------------------- accounting


def test_accounting_counts_bytes_flops_engines_and_high_water():
    def kernel(a, b):
        sa, sb = nl.ndarray((128, 128), nl.bfloat16), nl.ndarray((128, 512), nl.bfloat16)
        nisa.dma_copy(sa, a)
        nisa.dma_copy(sb, b)
        for _ in nl.affine_range(3):
            ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(ps, sa, sb)
            o = nl.ndarray((128, 512), nl.bfloat16)
            nisa.activation(o, nl.relu, ps)
        return a

    acc = simulate(kernel)(bf16((128, 128)), bf16((128, 512))).accounting
    assert acc.dma_bytes("a", "hbm->sbuf") == 128 * 128 * 2
    assert acc.dma_bytes("b", "hbm->sbuf") == 128 * 512 * 2
    assert acc.traffic("b").transfers == 1 and acc.traffic("b").rows == 128
    assert acc.matmul_flops == 3 * 2 * 128 * 128 * 512
    assert acc.instructions_by_engine() == {"tensor": 3, "vector": 0, "scalar": 3, "gpsimd": 0, "dma": 2}
    # a (256 B) + b (1 KiB) stay; each iteration's bf16 output (1 KiB) is freed before the next is allocated
    assert acc.sbuf_high_water == 128 * 2 + 512 * 2 + 512 * 2
    assert acc.psum_high_water_banks == 1
    summary = acc.summary()
    assert summary["dma_bytes"] == (128 * 128 + 128 * 512) * 2 and summary["matmuls"] == 3
    assert summary["dma_bytes_by_tensor"] == {"a hbm->sbuf": 128 * 128 * 2, "b hbm->sbuf": 128 * 512 * 2}


def test_counted_once_per_signature_replays_exact_counts():
    @counted_once_per_signature(lambda n: n % 2)
    def step(n):
        t = nl.ndarray((128, 64 * (1 + n % 2)), nl.float32)
        nisa.memset(t, 0.0)
        nisa.tensor_scalar(t, t, nl.add, float(n))

    def kernel(x):
        for n in nl.sequential_range(5):
            step(n)
        return x

    numeric = simulate(kernel)(np.zeros(1, dtype=np.float32)).accounting
    counting = simulate(kernel, numerics=False)(np.zeros(1, dtype=np.float32)).accounting
    assert counting == numeric
    assert numeric.instructions("vector") == 10
