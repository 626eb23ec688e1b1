"""NKI's tile-level ``nl`` functions (``nl.add(x, y)``, ``nl.sum``, ``nl.softmax``, ``nl.rms_norm``, ``nl.where``,
``nl.matmul``, ``nl.transpose``, ``nl.broadcast_to``, ``nl.gather_flattened``, loops, ...) against NumPy statements
of their documented semantics, written as kernels (``import nki.language as nl``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

# the same fixture and helper as the instruction tests (pytest puts this folder on sys.path)
from test_compat_instructions import _out, k  # noqa: F401

from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.machine import HardwareLimitError

rng = np.random.default_rng(11)


def test_math_functions_on_tiles_return_tiles(k):
    nl, nisa, run = k
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((64, 32)).astype(np.float32)
    col = rng.standard_normal((64, 1)).astype(np.float32)

    def body(x, y, c):
        tx, ty, tc = nl.load(x), nl.load(y), nl.load(c)
        outs = [nl.add(tx, ty), nl.subtract(tx, 2.0), nl.multiply(3.0, tx), nl.maximum(tx, tc),
                nl.subtract(tc, tx), nl.exp(tx), nl.abs(tx, dtype=nl.bfloat16), nl.greater(tx, ty), nl.floor(tx),
                nl.logical_not(nl.greater(tx, 0.0))]
        return tuple(_out(nl, nisa, o) for o in outs)

    got = run(body, a, b, col)
    want = [a + b, a - 2, 3 * a, np.maximum(a, col), col - a, np.exp(a), np.abs(a), (a > b), np.floor(a), ~(a > 0)]
    assert got[6].dtype == ml_dtypes.bfloat16
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-6)
    assert np.asarray(np.add(np.float32(1), np.float32(2))) == 3  # opcodes still compute on NumPy values


def test_operand_shapes_must_combine(k):
    nl, nisa, run = k

    def body():
        a = nl.zeros((8, 4), nl.float32)
        b = nl.zeros((8, 3), nl.float32)
        with pytest.raises(HardwareLimitError, match="do not combine"):
            nl.add(a, b)
        with pytest.raises(TypeError, match="tiles or numbers"):
            nl.add(a, "x")
        return _out(nl, nisa, a)

    run(body)


def test_reductions_mean_var_all(k):
    nl, nisa, run = k
    x = rng.standard_normal((16, 4, 8)).astype(np.float32)

    def body(a):
        t = nl.load(a)
        outs = [nl.sum(t, axis=[1, 2]), nl.max(t, axis=2, keepdims=True), nl.min(t, axis=2), nl.prod(t, axis=2),
                nl.mean(t, axis=(1, 2), keepdims=True), nl.var(t, axis=[1, 2]), nl.all(nl.greater(t, -10.0), axis=2),
                nl.all(nl.greater(t, 0.0), axis=2)]
        with pytest.raises(HardwareLimitError, match="last free dims"):
            nl.sum(t, axis=1)
        return tuple(_out(nl, nisa, o) for o in outs)

    got = run(body, x)
    want = [x.sum((1, 2)), x.max(2, keepdims=True), x.min(2), x.prod(2), x.mean((1, 2), keepdims=True),
            x.var((1, 2), keepdims=True), np.ones((16, 4, 1)), (x > 0).all(2, keepdims=True)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w, np.float32).reshape(g.shape), rtol=1e-4, atol=1e-5)


def test_softmax_and_rms_norm(k):
    nl, nisa, run = k
    x = (4 * rng.standard_normal((32, 64))).astype(np.float32)
    w = rng.standard_normal((32, 64)).astype(np.float32)

    def body(a, b):
        t, tw = nl.load(a), nl.load(b)
        return _out(nl, nisa, nl.softmax(t, axis=1)), _out(nl, nisa, nl.rms_norm(t, tw, axis=1, n=64, epsilon=1e-6))

    sm, rms = run(body, x, w)
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rms, ref, rtol=1e-5, atol=1e-5)


def test_where_broadcast_expand_dims(k):
    nl, nisa, run = k
    c = (rng.random((8, 16)) > 0.5).astype(np.float32)
    a = rng.standard_normal((8, 16)).astype(np.float32)
    row = rng.standard_normal((1, 16)).astype(np.float32)
    col = rng.standard_normal((8, 1)).astype(np.float32)

    def body(cond, x, r, cl):
        tc, tx, tr, tcl = nl.load(cond), nl.load(x), nl.load(r), nl.load(cl)
        e = nl.expand_dims(tx, 1)
        assert e.shape == (8, 1, 16)
        return (_out(nl, nisa, nl.where(tc, tx, 5.0)), _out(nl, nisa, nl.broadcast_to(tr, (8, 16))),
                _out(nl, nisa, nl.broadcast_to(tcl, (8, 16))))

    w, br, bc = run(body, c, a, row, col)
    np.testing.assert_array_equal(w, np.where(c != 0, a, 5.0))
    np.testing.assert_allclose(br, np.broadcast_to(row, (8, 16)), rtol=1e-6)
    np.testing.assert_array_equal(bc, np.broadcast_to(col, (8, 16)))


def test_matmul_transpose_and_load_transpose2d(k):
    nl, nisa, run = k
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((32, 48)).astype(np.float32)
    at = np.ascontiguousarray(a.T)

    def body(x, y, xt):
        tx, ty = nl.load(x), nl.load(y)
        prod_ps = nl.matmul(tx, ty)  # x @ y: the transpose of x is inserted
        prod2_ps = nl.matmul(nl.load(xt), ty, transpose_x=True)
        t_ps = nl.transpose(tx)
        outs = []
        for ps in (prod_ps, prod2_ps, t_ps):
            sb = nl.ndarray(ps.shape, nl.float32)
            nisa.tensor_copy(dst=sb, src=ps)
            outs.append(_out(nl, nisa, sb))
        outs.append(_out(nl, nisa, nl.load_transpose2d(x)))
        return tuple(outs)

    p1, p2, t, lt = run(body, a, b, at)
    np.testing.assert_allclose(p1, a @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(p2, a @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(t, a.T)
    np.testing.assert_array_equal(lt, a.T)


def test_gather_flattened_rand_dropout_and_creation(k):
    nl, nisa, run = k
    data = rng.standard_normal((16, 4, 8)).astype(np.float32)
    idx = rng.integers(0, 32, size=(16, 5)).astype(np.int32)

    def body(d, i):
        g = nl.gather_flattened(nl.load(d), nl.load(i))
        seed = nl.full((1, 1), 42, nl.int32)
        nl.random_seed(seed)
        r1 = nl.rand((16, 64), nl.float32)
        nl.random_seed(seed)
        r2 = nl.rand((16, 64), nl.float32)
        z = nl.zeros_like(g)
        e = nl.empty_like(g, dtype=nl.bfloat16)
        assert e.dtype == nl.bfloat16 and e.shape == g.shape
        kept = nl.dropout(nl.full((16, 64), 1.0, nl.float32), 0.25)
        in_hbm = nl.rand((4, 8), nl.float32, buffer=nl.shared_hbm)
        return tuple(_out(nl, nisa, t) for t in (g, r1, r2, z, kept)) + (in_hbm,)

    g, r1, r2, z, kept, in_hbm = run(body, data, idx)
    assert ((0 <= in_hbm) & (in_hbm < 1)).all()
    np.testing.assert_array_equal(g, np.take_along_axis(data.reshape(16, 32), idx, axis=1))
    np.testing.assert_array_equal(r1, r2)
    assert 0.0 <= r1.min() and r1.max() < 1.0 and 0.4 < r1.mean() < 0.6
    assert not z.any()
    assert set(np.unique(kept)) <= {0.0, 1.0} and 0.6 < kept.mean() < 0.9


def test_fori_loop_while_loop_and_no_reorder(k):
    nl, nisa, run = k
    n = np.array([[3]], np.int32)

    def body(count):
        acc = nl.zeros((1, 1), nl.float32)
        one = nl.full((1, 1), 1.0, nl.float32)
        ub = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=ub, src=count)
        reg = nisa.register_alloc()
        nisa.register_load(reg, ub)
        nl.fori_loop(0, reg, lambda i: nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add))  # +3

        left = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=left, src=count)
        ones = nl.full((1, 1), 1, nl.int32)

        def step(r):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
            nisa.tensor_tensor(dst=left, data1=left, data2=ones, op=nl.subtract)
            nisa.register_load(r, left)
            return r

        cond = nisa.register_alloc()
        nisa.register_load(cond, left)
        nl.while_loop(cond, step)  # +3
        zero = nisa.register_alloc(0)
        nl.while_loop(zero, step)  # a true while: never runs
        with nl.no_reorder():
            acc2 = nl.add(acc, 1.0)
        return _out(nl, nisa, acc2)

    assert run(body, n)[0, 0] == 7.0


def test_rearrange_splits_permutes_and_merges_views_and_indirect_is_trn3_only(k):
    nl, nisa, run = k
    from nxd_moe.nki_kernels.instructions.trn3 import Trn3OnlyError

    a = np.arange(8 * 24, dtype=np.float32).reshape(8, 24)

    def body(x):
        t = nl.load(x)
        r = t.rearrange(("b", ("h", "w")), ("b", "w", "h"), {"h": 4})  # NKI's documented example
        assert r.shape == (8, 6, 4)
        c = nl.ndarray(r.shape, nl.float32)
        nisa.tensor_copy(dst=c, src=r)
        assert c.rearrange(("b", "w", "h"), ("b", ("w", "h"))).shape == (8, 24)
        with pytest.raises(ValueError, match="same dims"):
            t.rearrange(("b", "x"), ("b", "y"))
        with pytest.raises(HardwareLimitError, match="dims.0. must stay 0"):
            t.rearrange(("b", "x"), ("x", "b"))
        with pytest.raises(Trn3OnlyError, match="NeuronCore-v4"):
            t.indirect(t)
        return _out(nl, nisa, c)

    np.testing.assert_array_equal(run(body, a), a.reshape(8, 4, 6).transpose(0, 2, 1))
