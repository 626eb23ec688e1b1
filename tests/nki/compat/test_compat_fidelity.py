"""Fidelity to Trn2 as nki-library's kernels rely on it: which engine an instruction runs on and where it may write,
access patterns read as the hardware reads them, and on-chip memory allocated and reused as the NKI compiler does.
Each test is a small kernel with the rule stated in NumPy or as the documented error."""

from __future__ import annotations

import numpy as np
import pytest

from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.machine import HardwareLimitError

rng = np.random.default_rng(7)


@pytest.fixture
def k(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl

    return nl, nisa


def _load(nl, nisa, a):
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    return t


def _store(nl, nisa, t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# ------------------------------------------------------------------------------------------------ engines


def test_transpose_into_sbuf_runs_on_the_vector_engine(k):
    """NKI: without ``engine`` the compiler picks; only the Vector Engine writes SBUF (32 x 32 at most)."""
    nl, nisa = k
    x = rng.standard_normal((32, 24)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        out = nl.ndarray((24, 32), nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=out, data=t)
        with pytest.raises(HardwareLimitError, match="is in sbuf; it must be in psum"):
            nisa.nc_transpose(dst=out, data=t, engine=nisa.tensor_engine)
        return _store(nl, nisa, out)

    run = compat.run(body, x)
    np.testing.assert_array_equal(run.outputs, x.T)
    assert run.accounting.transposes == 0  # not a Tensor Engine transpose
    assert any(key[0] == "vector" and key[1] == "transpose" for key in run.accounting.engine_ops)


def test_transpose_into_sbuf_larger_than_32_is_rejected(k):
    nl, nisa = k
    x = rng.standard_normal((64, 16)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        out = nl.ndarray((16, 64), nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=out, data=t)

    with pytest.raises(HardwareLimitError, match="vector engine transpose limit 32 x 32"):
        compat.run(body, x)


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
