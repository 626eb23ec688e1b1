"""nki.language / nki.typing names beyond the MoE set: activation derivatives, unary ALU ops, bypass,
shared_constant, the typing annotations -- each against an independent NumPy statement."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_compat_ops import _load, k  # noqa: F401 -- the same fixture and helper (this folder is on sys.path)
from test_compat_ops import _store as _out

from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture

rng = np.random.default_rng(3)





@pytest.mark.parametrize("name, fn", [
    ("silu_dx", lambda x: x / (1 + np.exp(-x))),
    ("gelu_dx", lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))),
    ("gelu_apprx_sigmoid_dx", lambda x: x / (1 + np.exp(-1.702 * x))),
    ("erf_dx", np.vectorize(math.erf)),
])
def test_activation_derivatives_match_finite_differences(k, name, fn):
    nl, nisa, run = k
    x = np.linspace(-4, 4, 64, dtype=np.float32).reshape(4, 16)

    def body(a):
        t = _load(nl, nisa, a)
        nisa.activation(dst=t, op=getattr(nl, name), data=t)
        return _out(nl, nisa, t)

    h = 1e-5
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(run(body, x), (fn(x64 + h) - fn(x64 - h)) / (2 * h), rtol=1e-4, atol=1e-5)


def test_unary_alu_ops_ignore_the_operand_and_bypass_skips_a_stage(k):
    nl, nisa, run = k
    x = rng.standard_normal((8, 32)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        absx, amax = nl.ndarray(t.shape, nl.float32), nl.ndarray((8, 1), nl.float32)
        # rmsnorm_quant's row max of |x|: op0=nl.abs with a dummy operand
        nisa.tensor_scalar_reduce(dst=absx, data=t, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=amax)
        sq, passed = nl.ndarray(t.shape, nl.float32), nl.ndarray(t.shape, nl.float32)
        nisa.tensor_scalar(dst=sq, data=t, op0=nl.square, operand0=123.0, reverse0=True, op1=nl.add, operand1=1.0)
        nisa.tensor_scalar(dst=passed, data=t, op0=nl.multiply, operand0=3.0, op1=nl.bypass, operand1=5.0)
        bits = nl.ndarray((8, 32), nl.int32)
        nisa.iota(bits, [[1, 32]], offset=0, channel_multiplier=32)
        nisa.tensor_scalar(dst=bits, data=bits, op0=nl.invert, operand0=0)
        return [_out(nl, nisa, v) for v in (absx, amax, sq, passed, bits)]

    absx, amax, sq, passed, bits = run(body, x)
    np.testing.assert_array_equal(absx, np.abs(x))
    np.testing.assert_array_equal(amax[:, 0], np.abs(x).max(axis=1))
    np.testing.assert_allclose(sq, x * x + 1, rtol=1e-6)
    np.testing.assert_allclose(passed, 3 * x, rtol=1e-6)
    np.testing.assert_array_equal(bits, ~np.arange(8 * 32, dtype=np.int32).reshape(8, 32))


def test_shared_constant_from_an_array_or_npy_file_is_shared_by_both_cores(k, tmp_path):
    nl, nisa, run = k
    table = rng.standard_normal((4, 8)).astype(np.float32)
    np.save(tmp_path / "table.npy", table)

    def body(a):
        out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
        c = nl.shared_constant(str(tmp_path / "table.npy")) if nl.program_id(0) else nl.shared_constant(table)
        t = nl.ndarray((4, 8), nl.float32)
        nisa.dma_copy(dst=t, src=c)
        nisa.dma_copy(dst=out[nl.program_id(0)], src=t)
        with pytest.raises(TypeError, match="float64"):
            nl.shared_constant(np.zeros(3))
        return out

    out = run(body, np.zeros(1, np.float32), lnc=2)
    np.testing.assert_array_equal(out, np.stack([table, table]))


def test_typing_annotations(nki_compat):  # noqa: F811
    import nki.typing as nt

    @nki_compat.jit
    def kernel(x: nt.tensor[4, 8], out: nt.mutable_tensor):
        assert isinstance(x, nt.tensor) and isinstance(out, nt.mutable_tensor)
        return out

    assert nt.tensor[4, 8].shape == (4, 8) and repr(nt.mutable_tensor) == "nt.mutable_tensor"
    assert not isinstance(np.zeros(2), nt.tensor)
    nki_compat.simulate(kernel)(np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32))
