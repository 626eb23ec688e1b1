"""The instruction families of nxd_moe.nki_kernels.instructions (top-8, selections, scans, gathers, PRNG, Trn3-only),
each against a NumPy statement of the NKI API reference's semantics, with the documented errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_compat_ops import _load, k  # noqa: F401 -- the same fixture and helper (this folder is on sys.path)
from test_compat_ops import _store as _out

from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.machine import HardwareLimitError, OutOfBoundsError

rng = np.random.default_rng(7)





# ------------------------------------------------------------------------------------------------ top-8


def test_max8_find_index8_match_replace8_topk(k):
    nl, nisa, run = k
    x = rng.permutation(np.arange(4 * 40, dtype=np.float32)).reshape(4, 40)
    x[1, :10] = 7.0  # ties in one partition
    x[1, 10:] = -1.0

    def body(a):
        t = _load(nl, nisa, a)
        top, idx = nl.ndarray((4, 8), nl.float32), nl.ndarray((4, 8), nl.uint32)
        nisa.max8(dst=top, src=t)
        nisa.nc_find_index8(dst=idx, data=t, vals=top)
        replaced, ridx = nl.ndarray((4, 40), nl.float32), nl.ndarray((4, 8), nl.uint32)
        nisa.nc_match_replace8(dst=replaced, data=t, vals=top, imm=-np.inf, dst_idx=ridx)
        with pytest.raises(HardwareLimitError, match="8 elements per partition"):
            nisa.max8(dst=nl.ndarray((4, 4), nl.float32), src=t)
        with pytest.raises(HardwareLimitError, match="8 to 16384"):
            nisa.max8(dst=top, src=t[:, 0:4])
        return [_out(nl, nisa, v) for v in (top, idx, replaced, ridx)]

    top, idx, replaced, ridx = run(body, x)
    expected_top = -np.sort(-x, axis=1)[:, :8]
    np.testing.assert_array_equal(top, expected_top)
    for p in range(4):
        used: list[int] = []
        for j in range(8):  # find_index8: duplicated values take successive occurrences, ascending
            pos = next(i for i in range(40) if x[p, i] == top[p, j] and i not in used)
            used.append(pos)
            assert idx[p, j] == pos
        assert sorted(ridx[p]) == sorted(used)
        expected = x[p].copy()
        expected[used] = -np.inf
        np.testing.assert_array_equal(replaced[p], expected)
    assert list(ridx[1]) == list(range(7, -1, -1))  # match_replace8's tie-break: last column first


def test_max8_ranks_nan_below_numbers_like_a_descending_sort(k):
    nl, nisa, run = k
    x = rng.standard_normal((4, 24)).astype(np.float32)
    x[0, ::2] = np.nan  # 12 numbers left: NaN never in the top 8
    x[1, 3:] = np.nan  # 3 numbers: then the NaNs fill up, as a descending sort puts them last

    def body(a):
        t = _load(nl, nisa, a)
        top = nl.ndarray((4, 8), nl.float32)
        nisa.max8(dst=top, src=t)
        return _out(nl, nisa, top)

    np.testing.assert_array_equal(run(body, x), -np.sort(-x, axis=1)[:, :8])


def test_match_replace8_documented_example_and_missing_values(k):
    nl, nisa, run = k
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)

    def body(d, v):
        t, vv = _load(nl, nisa, d), _load(nl, nisa, v)
        out, ridx, fidx = nl.ndarray(d.shape, nl.float32), nl.ndarray((1, 8), nl.uint32), nl.ndarray((1, 8), nl.uint16)
        nisa.nc_match_replace8(dst=out, data=t, vals=vv, imm=0.0, dst_idx=ridx)
        missing = nl.ndarray((1, 8), nl.float32)
        nisa.memset(dst=missing, value=99.0)
        nisa.nc_find_index8(dst=fidx, data=t, vals=missing)
        return _out(nl, nisa, out), _out(nl, nisa, ridx), _out(nl, nisa, fidx)

    out, ridx, fidx = run(body, data, vals)
    assert ridx.tolist() == [[2, 10, 9, 8, 7, 6, 5, 4]]  # the NKI reference's example
    assert out.tolist() == [[1, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0]]
    assert fidx.tolist() == [[0xFFFF] * 8]  # not present: the all-ones sentinel


def test_topk_reads_a_16_partition_snake(k):
    nl, nisa, run = k
    n, k_ = 42, 8
    values = rng.permutation(np.arange(32 * 3, dtype=np.float32)).reshape(32, 3).astype(ml_dtypes.bfloat16)

    def body(a):
        src = _load(nl, nisa, a)
        val, idx = nl.ndarray((32, k_), nl.bfloat16), nl.ndarray((32, k_), nl.uint32)
        nisa.topk(val_dst=val, idx_dst=idx, src=src, n=n)
        with pytest.raises(HardwareLimitError, match="multiple of 16"):
            nisa.topk(val_dst=val[0:8], idx_dst=idx[0:8], src=src[0:8], n=n)
        return _out(nl, nisa, val), _out(nl, nisa, idx)

    val, idx = run(body, values)
    v = values.astype(np.float32)
    for g in (0, 16):
        snake = v[g:g + 16].T.reshape(-1)[:n]
        best = np.argsort(-snake)[:k_][::-1]  # ascending
        for p in range(g, g + 16):
            assert idx[p].tolist() == best.tolist()
            np.testing.assert_array_equal(val[p].astype(np.float32), snake[best])


def test_topk_outputs_are_writes_that_a_pending_matmul_reads_before(k):
    """``val_dst`` / ``idx_dst`` are written: a matmul issued before reads the tile's old values (the simulator
    accumulates matmuls lazily, so a write it did not see as one would let the product read the new values)."""
    nl, nisa, run = k
    values = rng.permutation(np.arange(32 * 3, dtype=np.float32)).reshape(32, 3).astype(ml_dtypes.bfloat16)
    weight = rng.standard_normal((32, 4)).astype(ml_dtypes.bfloat16)
    moving = rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16)

    def body(a, w, m):
        src, stationary, tile = _load(nl, nisa, a), _load(nl, nisa, w), _load(nl, nisa, m)
        product = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(product, stationary, tile)
        idx = nl.ndarray((32, 8), nl.uint32)
        nisa.topk(val_dst=tile, idx_dst=idx, src=src, n=42)
        result = nl.ndarray((4, 8), nl.float32)
        nisa.tensor_copy(result, product)
        return _out(nl, nisa, result)

    expected = weight.astype(np.float64).T @ moving.astype(np.float64)
    np.testing.assert_allclose(run(body, values, weight, moving), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ selections


def test_affine_select_is_a_causal_mask(k):
    nl, nisa, run = k
    x = rng.standard_normal((16, 16)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        out = nl.ndarray((16, 16), nl.float32)
        # keep where partition - column >= 0 (lower triangle)
        nisa.affine_select(dst=out, pattern=[[-1, 16]], channel_multiplier=1, on_true_tile=t,
                           on_false_value=-1e9, cmp_op=nl.greater_equal)
        with pytest.raises(HardwareLimitError, match="generates 8"):
            nisa.affine_select(dst=out, pattern=[[-1, 8]], channel_multiplier=1, on_true_tile=t, on_false_value=0.0)
        return _out(nl, nisa, out)

    np.testing.assert_array_equal(run(body, x), np.where(np.tril(np.ones((16, 16), bool)), x, np.float32(-1e9)))


def test_range_select_and_select_reduce_with_the_max_accumulator(k):
    nl, nisa, run = k
    x = rng.standard_normal((8, 32)).astype(np.float32)
    lo = rng.integers(0, 10, (8, 1)).astype(np.float32)
    hi = lo + rng.integers(1, 20, (8, 1)).astype(np.float32)
    pred = (rng.random((8, 32)) < 0.5).astype(np.uint8)

    def body(a, b0, b1, pr):
        t, l_, h = _load(nl, nisa, a), _load(nl, nisa, b0), _load(nl, nisa, b1)
        out, mx = nl.ndarray((8, 32), nl.float32), nl.ndarray((8, 1), nl.float32)
        nisa.range_select(dst=out, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=l_, bound1=h,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=mx, range_start=2)
        sel, smx = nl.ndarray((8, 32), nl.float32), nl.ndarray((8, 1), nl.float32)
        nisa.select_reduce(dst=sel, predicate=_load(nl, nisa, pr), on_true=t, on_false=-5.0, reduce_res=smx,
                           reduce_cmd=nisa.reduce_cmd.reset_reduce)
        with pytest.raises(ValueError, match="comp_op0"):
            nisa.range_select(dst=out, on_true_tile=t, comp_op0=nl.add, comp_op1=nl.less, bound0=l_, bound1=h)
        return [_out(nl, nisa, v) for v in (out, mx, sel, smx)]

    out, mx, sel, smx = run(body, x, lo, hi, pred)
    i = 2 + np.arange(32, dtype=np.float32)[None, :]
    expected = np.where((i >= lo) & (i < hi), x, np.finfo(np.float32).min)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(mx[:, 0], expected.max(axis=1))
    expected_sel = np.where(pred != 0, x, np.float32(-5.0))
    np.testing.assert_array_equal(sel, expected_sel)
    np.testing.assert_array_equal(smx[:, 0], expected_sel.max(axis=1))


def test_sequence_bounds_documented_example(k):
    nl, nisa, run = k
    ids = np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], np.int32)

    def body(a):
        out = nl.ndarray((1, 2, 9), nl.int32)
        nisa.sequence_bounds(dst=out, segment_ids=_load(nl, nisa, a))
        return _out(nl, nisa, out)

    assert run(body, ids).tolist() == [[[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]]]


# ------------------------------------------------------------------------------------------------ scans, gathers


def test_tensor_tensor_scan_general_and_running_sum(k):
    nl, nisa, run = k
    a = rng.uniform(0.5, 1.0, (4, 24)).astype(np.float32)
    b = rng.standard_normal((4, 24)).astype(np.float32)
    init = rng.standard_normal((4, 1)).astype(np.float32)

    def body(x, y, i0):
        tx, ty, ti = _load(nl, nisa, x), _load(nl, nisa, y), _load(nl, nisa, i0)
        decay, cumsum = nl.ndarray((4, 24), nl.float32), nl.ndarray((4, 24), nl.bfloat16)
        nisa.tensor_tensor_scan(dst=decay, data0=tx, data1=ty, initial=ti, op0=nl.multiply, op1=nl.add)
        ones = nl.ndarray((4, 24), nl.float32)
        nisa.memset(dst=ones, value=1.0)
        nisa.tensor_tensor_scan(dst=cumsum, data0=ones, data1=ty, initial=0.0, op0=nl.multiply, op1=nl.add)
        rev = nl.ndarray((4, 24), nl.float32)
        nisa.tensor_tensor_scan(dst=rev, data0=tx, data1=ty, initial=1.0, op0=nl.subtract, op1=nl.subtract,
                                reverse0=True, reverse1=True)
        return [_out(nl, nisa, v) for v in (decay, cumsum, rev)]

    decay, cumsum, rev = run(body, a, b, init)
    r = init[:, 0].astype(np.float32)
    s = np.full(4, 1.0, np.float32)
    for i in range(24):
        r = (a[:, i] * r + b[:, i]).astype(np.float32)
        s = (b[:, i] - (s - a[:, i])).astype(np.float32)  # reverse0: state - data0; reverse1: data1 - t
        np.testing.assert_allclose(decay[:, i], r, rtol=1e-6)
        np.testing.assert_allclose(rev[:, i], s, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cumsum, np.cumsum(b, axis=1, dtype=np.float32).astype(ml_dtypes.bfloat16))


def test_tensor_scalar_cumulative_and_partition_reduce(k):
    nl, nisa, run = k
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        csum, cmax, cont = (nl.ndarray((8, 16), nl.float32) for _ in range(3))
        nisa.tensor_scalar_cumulative(dst=csum, src=t, op0=nl.multiply, op1=nl.add, imm0=2.0)
        nisa.tensor_scalar_cumulative(dst=cmax, src=t, op0=nl.add, op1=nl.maximum, imm0=0.0, imm1=0.5,
                                      reduce_cmd=nisa.reduce_cmd.load_reduce)
        nisa.tensor_scalar_cumulative(dst=cont, src=t, op0=nl.add, op1=nl.maximum, imm0=0.0,
                                      reduce_cmd=nisa.reduce_cmd.reduce)  # continues from cmax's last value
        with pytest.raises(TypeError, match="int32"):
            nisa.tensor_scalar_cumulative(dst=nl.ndarray((8, 16), nl.int32), src=t, op0=nl.add, op1=nl.add, imm0=0.0)
        total, top = nl.ndarray((1, 16), nl.float32), nl.ndarray((1, 16), nl.float32)
        nisa.tensor_partition_reduce(dst=total, op=nl.add, data=t)
        nisa.tensor_partition_reduce(dst=top, op=nl.maximum, data=t)
        return [_out(nl, nisa, v) for v in (csum, cmax, cont, total, top)]

    csum, cmax, cont, total, top = run(body, x)
    np.testing.assert_allclose(csum, np.cumsum(2 * x, axis=1), rtol=1e-5, atol=1e-5)
    expected_max = np.maximum.accumulate(np.concatenate([np.full((8, 1), 0.5, np.float32), x], axis=1), axis=1)[:, 1:]
    np.testing.assert_array_equal(cmax, expected_max)
    np.testing.assert_array_equal(cont, np.maximum.accumulate(np.maximum(x, expected_max[:, -1:]), axis=1))
    np.testing.assert_allclose(total[0], x.sum(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(top[0], x.max(axis=0))


def test_nc_n_gather_per_partition(k):
    nl, nisa, run = k
    x = rng.standard_normal((4, 6, 5)).astype(np.float32)
    idx = rng.integers(0, 30, (4, 7)).astype(np.uint32)

    def body(a, i):
        t, ti = _load(nl, nisa, a), _load(nl, nisa, i)
        out = nl.ndarray((4, 7), nl.float32)
        nisa.nc_n_gather(dst=out, data=t, indices=ti)
        bad = nl.ndarray((4, 7), nl.uint32)
        nisa.memset(dst=bad, value=30)
        with pytest.raises(OutOfBoundsError, match="outside \\[0, 30\\)"):
            nisa.nc_n_gather(dst=out, data=t, indices=bad)
        return _out(nl, nisa, out)

    np.testing.assert_array_equal(run(body, x, idx), np.take_along_axis(x.reshape(4, 30), idx.astype(np.int64), 1))


# ------------------------------------------------------------------------------------------------ PRNG, Trn3


def test_prng_is_reproducible_seedable_and_dropout_drops_at_the_rate(k):
    nl, nisa, run = k
    x = np.ones((128, 256), np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        bits1, bits2 = nl.ndarray((4, 8), nl.uint32), nl.ndarray((4, 8), nl.uint32)
        seed = nl.ndarray((1, 1), nl.uint32)
        nisa.memset(dst=seed, value=1234)
        nisa.set_rng_seed(src_seeds=seed)
        nisa.rng(dst=bits1)
        nisa.set_rng_seed(src_seeds=seed)
        nisa.rng(dst=bits2)
        dropped = nl.ndarray((128, 256), nl.float32)
        nisa.dropout(dst=dropped, data=t, prob=0.25)
        state, state2, g1, g2 = (nl.ndarray((2, 6), nl.uint32), nl.ndarray((2, 6), nl.uint32),
                                 nl.ndarray((2, 3), nl.uint16), nl.ndarray((2, 3), nl.uint16))
        nisa.rand_get_state(dst=state)
        nisa.rng(dst=g1, engine=nisa.engine.gpsimd)
        nisa.rand_set_state(src_seeds=state)  # rewind
        nisa.rng(dst=g2, engine=nisa.engine.gpsimd)
        nisa.rand_get_state(dst=state2)
        with pytest.raises(HardwareLimitError, match="NeuronCore-v4"):
            nisa.rand_set_state(src_seeds=state, engine=nisa.engine.vector)
        return [_out(nl, nisa, v) for v in (bits1, bits2, dropped, g1, g2, state, state2)]

    bits1, bits2, dropped, g1, g2, state, state2 = run(body, x)
    np.testing.assert_array_equal(bits1, bits2)
    assert len(np.unique(bits1)) == bits1.size  # 32 random bits each
    assert set(np.unique(dropped)) == {0.0, 1.0} and abs((dropped == 0).mean() - 0.25) < 0.01
    np.testing.assert_array_equal(g1, g2)
    assert not np.array_equal(state, state2)


def test_trn3_only_instructions_raise_a_named_error(k):
    nl, nisa, run = k

    def body():
        t = nl.ndarray((4, 4), nl.float32)
        for op in (nisa.activate2, nisa.exponential, nisa.rand2, nisa.quantize_mx, nisa.nc_matmul_mx):
            with pytest.raises(nisa.Trn3OnlyError, match=f"nisa.{op.__name__} .*NeuronCore-v4"):
                op(t, t, t)

    run(body)
