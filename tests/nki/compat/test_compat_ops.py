"""API conformance of the nki.isa / nki.language ops nki-library's MoE kernels use: each against the documented
semantics (a NumPy statement here), with the documented errors."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.machine import HardwareLimitError, OutOfBoundsError

rng = np.random.default_rng(1)


@pytest.fixture
def k(nki_compat):  # noqa: F811
    """``(nl, nisa, run)``: ``run(body, *arrays)`` simulates ``body(*hbm_tensors)`` and returns its outputs."""
    import nki.isa as nisa
    import nki.language as nl

    def run(body, *arrays, lnc=None):
        return compat.run(body, *arrays, lnc=lnc).outputs

    return nl, nisa, run


def _load(nl, nisa, a, dtype=None, shape=None):
    t = nl.ndarray(shape or a.shape, dtype or a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    return t


def _store(nl, nisa, t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# ------------------------------------------------------------------------------------------------ views


def test_views_follow_numpy_and_keep_the_partition_dim(k):
    nl, nisa, run = k
    x = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)

    def body(a):
        t = _load(nl, nisa, a)
        assert t[2].shape == (1, 6, 8)  # on chip: an int on dim 0 keeps it
        assert a[2].shape == (6, 8)  # in HBM: it goes
        assert t[:, 1, 3].shape == (4, 1)  # on-chip views stay 2-D
        assert t[..., nl.ds(2, 3)].shape == (4, 6, 3)
        assert t.reshape((4, 48)).shape == (4, 48) and t.permute((0, 2, 1)).shape == (4, 8, 6)
        with pytest.raises(HardwareLimitError, match="partition"):
            t.reshape((8, 24))
        with pytest.raises(HardwareLimitError, match="dims\\[0\\] must stay 0"):
            t.permute((1, 0, 2))
        with pytest.raises(HardwareLimitError, match="not contiguous"):
            t[:, :, 0:4].reshape((4, 24))
        with pytest.raises(IndexError):
            t[:, nl.ds(4, 3)]
        outs = [_store(nl, nisa, v) for v in (
            t[:, 1:5:2, nl.ds(3, 4)], t.permute((0, 2, 1)), t.select(1, 2), t[:, 0:1].broadcast(1, 3),
            t.reshape_dim(2, (2, 4))[:, :, 1], t.flatten_dims(1, 2), t.view(nl.int32).view(nl.float32))]
        outs.append(_store(nl, nisa, _load(nl, nisa, a.permute((1, 0, 2)))))
        return outs

    got = run(body, x)
    expected = [x[:, 1:5:2, 3:7], x.transpose(0, 2, 1), x[:, 2], np.repeat(x[:, 0:1], 3, axis=1),
                x.reshape(4, 6, 2, 4)[:, :, 1], x.reshape(4, 48), x, x.transpose(1, 0, 2)]
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_ap_on_chip_and_in_hbm_address_row_major_storage(k):
    nl, nisa, run = k
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)

    def body(a):
        t = _load(nl, nisa, a)
        every_other = t.ap([[16, 8], [2, 8]], offset=1)  # partitions step by a whole row
        with pytest.raises(HardwareLimitError, match="partition step"):
            t.ap([[3, 8], [1, 2]])
        outside = a.ap([[16, 8], [1, 16]], offset=1)  # legal to build; an access raises (test_compat_fidelity)
        assert outside.shape == (8, 16)
        as_bf16 = _load(nl, nisa, a.ap([[32, 8], [1, 32]], dtype=nl.bfloat16))
        return _store(nl, nisa, every_other), _store(nl, nisa, as_bf16)

    every_other, as_bf16 = run(body, x)
    np.testing.assert_array_equal(every_other, x[:, 1::2])
    np.testing.assert_array_equal(as_bf16.view(np.float32), x)


# ------------------------------------------------------------------------------------------------ DMA


def test_dma_copy_casts_through_fp32_and_counts_hbm_bytes(k):
    nl, nisa, run = k
    x = rng.standard_normal((16, 32)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a, dtype=nl.bfloat16)
        with pytest.raises(HardwareLimitError, match="same number of elements"):
            nisa.dma_copy(dst=t, src=a[:, 0:16])
        return _store(nl, nisa, t)

    np.testing.assert_array_equal(run(body, x), x.astype(ml_dtypes.bfloat16))
    assert compat.last_run().accounting.dma_bytes("a", "hbm->sbuf") == x.nbytes


def test_dma_copy_oob_error_names_the_index(k):
    nl, nisa, run = k

    def body(table, ids):
        index = _load(nl, nisa, ids)
        rows = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=table.ap([[4, 2], [1, 4]], vector_offset=index))

    with pytest.raises(OutOfBoundsError, match="dynamic index 7 is out of bounds for dim 0 of size 3"):
        run(body, np.zeros((3, 4), np.float32), np.array([[1], [7]], np.int32))


def test_dma_transpose_permutes_2d_and_4d(k):
    nl, nisa, run = k
    x = rng.standard_normal((16, 24)).astype(ml_dtypes.bfloat16)
    y = np.arange(2 * 1 * 3 * 8, dtype=np.int32).reshape(2, 1, 3, 8)

    def body(a, b):
        t = nl.ndarray((24, 16), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a, dge_mode=nisa.dge_mode.hwdge)
        u = nl.ndarray((8, 1, 3, 2), b.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=u, src=b)
        with pytest.raises(HardwareLimitError, match="2-byte dtype"):
            nisa.dma_transpose(dst=u, src=b, dge_mode=nisa.dge_mode.hwdge)
        with pytest.raises(HardwareLimitError, match="permuted"):
            nisa.dma_transpose(dst=t[0:16, 0:16], src=a[:, 0:24])
        with pytest.raises(HardwareLimitError, match="src.shape\\[0\\] == 16"):
            nisa.dma_transpose(dst=t[0:24, 0:8], src=a[0:8, :], dge_mode=nisa.dge_mode.hwdge)
        return _store(nl, nisa, t), _store(nl, nisa, u)

    t, u = run(body, x, y)
    np.testing.assert_array_equal(t, x.T)
    np.testing.assert_array_equal(u, y.transpose(3, 1, 2, 0))


# ------------------------------------------------------------------------------------------------ GpSimd


def test_iota_generates_the_documented_pattern(k):
    nl, nisa, run = k

    def body():
        t = nl.ndarray((5, 2, 3), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=t, pattern=[[10, 2], [1, 3]], offset=7, channel_multiplier=100)
        f = nl.ndarray((5, 6), nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=f, pattern=[[-1, 6]], offset=0)
        with pytest.raises(HardwareLimitError, match="elements per partition"):
            nisa.iota(dst=t, pattern=[[1, 5]])
        return _store(nl, nisa, t), _store(nl, nisa, f)

    t, f = run(body)
    p, w, x = np.meshgrid(np.arange(5), np.arange(2), np.arange(3), indexing="ij")
    np.testing.assert_array_equal(t, 7 + 100 * p + 10 * w + x)
    np.testing.assert_array_equal(f, np.tile(-np.arange(6.0), (5, 1)))


def test_local_gather_matches_the_documented_numpy(k):
    nl, nisa, run = k
    src = rng.standard_normal((32, 64)).astype(np.float32)
    per_core = rng.integers(0, 16, size=(16, 3)).astype(np.uint16)
    index = np.tile(per_core, (2, 1)) * 4  # element offsets of 4-element groups

    def body(s, i):
        dst = nl.ndarray((32, 40), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=-1.0)
        nisa.local_gather(dst=dst, src_buffer=_load(nl, nisa, s), index=_load(nl, nisa, i), num_elem_per_idx=4,
                          num_valid_indices=10)
        with pytest.raises(TypeError, match="uint16"):
            nisa.local_gather(dst=dst, src_buffer=_load(nl, nisa, s), index=_load(nl, nisa, i, dtype=nl.int32))
        with pytest.raises(HardwareLimitError, match="num_elem_per_idx"):
            nisa.local_gather(dst=dst, src_buffer=_load(nl, nisa, s), index=_load(nl, nisa, i), num_elem_per_idx=3)
        return _store(nl, nisa, dst)

    out = run(body, src, index)
    for core in range(2):
        rows = slice(16 * core, 16 * core + 16)
        flat = index[rows].flatten(order="F")[:10].astype(int)
        expected = np.stack([src[rows, i:i + 4] for i in flat], axis=1).reshape(16, 40)
        np.testing.assert_array_equal(out[rows], expected)


def test_nonzero_with_count_touches_partitions_0_16_only(k):
    nl, nisa, run = k
    x = (rng.random((32, 10)) > 0.6).astype(np.float32) * rng.standard_normal((32, 10)).astype(np.float32)

    def body(a):
        dst = nl.ndarray((32, 11), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=9)
        nisa.nonzero_with_count(dst=dst, src=_load(nl, nisa, a), index_offset=100, padding_val=-1)
        return _store(nl, nisa, dst)

    out = run(body, x)
    for p in range(32):
        if p % 16:
            assert (out[p] == 9).all()
        else:
            nz = np.flatnonzero(x[p])
            assert list(out[p]) == list(nz + 100) + [-1] * (10 - len(nz)) + [len(nz)]


# ------------------------------------------------------------------------------------------------ Vector Engine


def test_nc_stream_shuffle_moves_partitions_inside_each_quadrant(k):
    nl, nisa, run = k
    x = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    mask = [(i - 1) % 32 for i in range(32)]
    mask[3] = 255

    def body(a):
        src = _load(nl, nisa, a)
        dst = nl.ndarray((64, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=-5.0)
        nisa.nc_stream_shuffle(dst=dst, src=src, shuffle_mask=mask)
        one = nl.ndarray((32, 4), nl.float32, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=one, src=src[32:33], shuffle_mask=[0] * 32)  # broadcast a partition
        with pytest.raises(HardwareLimitError, match="must start at one of"):
            nisa.nc_stream_shuffle(dst=dst[0:64], src=src[16:48], shuffle_mask=[0] * 32)
        with pytest.raises(HardwareLimitError, match="32 source partitions"):
            nisa.nc_stream_shuffle(dst=dst, src=src, shuffle_mask=[0] * 31)
        return _store(nl, nisa, dst), _store(nl, nisa, one)

    dst, one = run(body, x)
    for q in (0, 32):
        for i in range(32):
            expected = -5.0 if i == 3 else x[q + (i - 1) % 32]
            np.testing.assert_array_equal(dst[q + i], expected)
    np.testing.assert_array_equal(one, np.tile(x[32], (32, 1)))


def test_tensor_copy_predicated_keeps_dst_where_false(k):
    nl, nisa, run = k
    src = rng.standard_normal((8, 6)).astype(np.float32)
    pred = (rng.random((8, 6)) > 0.5).astype(np.uint8)

    def body(s, p):
        dst = nl.ndarray((8, 6), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=2.0)
        nisa.tensor_copy_predicated(dst=dst, src=_load(nl, nisa, s), predicate=_load(nl, nisa, p))
        rev = nl.ndarray((8, 6), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=rev, value=2.0)
        nisa.tensor_copy_predicated(dst=rev, src=7.0, predicate=_load(nl, nisa, p), reverse_pred=True)
        with pytest.raises(TypeError, match="uint8, uint16 or uint32"):
            nisa.tensor_copy_predicated(dst=dst, src=1.0, predicate=_load(nl, nisa, s))
        return _store(nl, nisa, dst), _store(nl, nisa, rev)

    dst, rev = run(body, src, pred)
    np.testing.assert_array_equal(dst, np.where(pred != 0, src, 2.0))
    np.testing.assert_array_equal(rev, np.where(pred != 0, 2.0, 7.0))


def test_tensor_scalar_reduce_and_the_accumulator_commands(k):
    nl, nisa, run = k
    x = rng.standard_normal((4, 16)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        y = nl.ndarray((4, 16), nl.float32, buffer=nl.sbuf)
        res = [nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf) for _ in range(3)]
        nisa.tensor_scalar_reduce(dst=y, data=t, op0=nl.multiply, operand0=2.0, reduce_op=nl.add, reduce_res=res[0])
        nisa.tensor_scalar_reduce(dst=y, data=t, op0=nl.add, operand0=1.0, reduce_op=nl.add, reduce_res=res[1],
                                  reduce_cmd=nisa.reduce_cmd.reduce)  # continues the first reduction
        init = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=init, value=10.0)
        nisa.tensor_scalar_reduce(dst=y, data=t, op0=nl.maximum, operand0=0.0, reduce_op=nl.maximum,
                                  reduce_res=res[2], reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=init)
        with pytest.raises(ValueError, match="reduce_init"):
            nisa.tensor_scalar_reduce(dst=y, data=t, op0=nl.add, operand0=1.0, reduce_op=nl.add, reduce_init=init)
        return [_store(nl, nisa, r) for r in res] + [_store(nl, nisa, y)]

    first, second, third, y = run(body, x)
    np.testing.assert_allclose(first[:, 0], (2 * x).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(second[:, 0], (2 * x).sum(axis=1) + (x + 1).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(third[:, 0], np.maximum(10.0, np.maximum(x, 0).max(axis=1)))
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_activation_reduce_and_the_new_activation_functions(k):
    nl, nisa, run = k
    x = rng.standard_normal((4, 32)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        outs = []
        for op in (nl.gelu_apprx_sigmoid, nl.gelu_apprx_tanh, nl.square, nl.abs, nl.exp):
            y = nl.ndarray((4, 32), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=y, op=op, data=t, scale=0.5, bias=0.25)
            outs.append(_store(nl, nisa, y))
        y = nl.ndarray((4, 32), nl.float32, buffer=nl.sbuf)
        res = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=y, op=nl.square, data=t, reduce_op=nl.add, reduce_res=res)
        r = nl.ndarray((4, 32), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=r, op=nl.rsqrt, data=y)
        with pytest.raises(ValueError, match="op must be one of"):
            nisa.activation(dst=y, op=nl.less, data=t)
        return outs + [_store(nl, nisa, res), _store(nl, nisa, r)]

    *acts, res, r = run(body, x)
    z = x.astype(np.float64) * 0.5 + 0.25
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    tanh_gelu = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    for got, ref in zip(acts, (z * sig(1.702 * z), tanh_gelu,
                               z ** 2, np.abs(z), np.exp(z))):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res[:, 0], (x.astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(r, 1 / np.abs(x), rtol=1e-5)


def test_bn_stats_and_bn_aggr_give_mean_and_variance(k):
    nl, nisa, run = k
    x = rng.standard_normal((8, 1000)).astype(np.float32)

    def body(a):
        t = _load(nl, nisa, a)
        stats = nl.ndarray((8, 2, 6), nl.float32, buffer=nl.sbuf)
        for i in range(2):
            nisa.bn_stats(dst=stats[:, i], data=t[:, nl.ds(i * 500, 500)])
        out = nl.ndarray((8, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=out, data=stats)
        with pytest.raises(HardwareLimitError, match="bn_stats_fmax = 512"):
            nisa.bn_stats(dst=stats[:, 0], data=t[:, 0:513])
        return _store(nl, nisa, out)

    out = run(body, x)
    np.testing.assert_allclose(out[:, 0], x.mean(axis=1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[:, 1], x.var(axis=1), rtol=1e-4)


def test_reciprocal_and_alu_comparisons(k):
    nl, nisa, run = k
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = rng.standard_normal((4, 8)).astype(np.float32)

    def body(a, b):
        ta, tb = _load(nl, nisa, a), _load(nl, nisa, b)
        r = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=ta)
        less = nl.ndarray((4, 8), nl.uint8, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=less, data1=ta, data2=tb, op=nl.less, engine=nisa.gpsimd_engine)
        flat = nl.ndarray((4, 2, 4), nl.float32, buffer=nl.sbuf)  # same elements per partition, other layout
        nisa.tensor_tensor(dst=flat, data1=ta, data2=tb, op=nl.subtract)
        with pytest.raises(ValueError, match="engine must be one of"):
            nisa.tensor_tensor(dst=r, data1=ta, data2=tb, op=nl.add, engine=nisa.scalar_engine)
        with pytest.raises(HardwareLimitError, match="elements per partition"):
            nisa.tensor_tensor(dst=r, data1=ta, data2=tb[:, 0:4], op=nl.add)
        return _store(nl, nisa, r), _store(nl, nisa, less), _store(nl, nisa, flat)

    r, less, flat = run(body, x, y)
    np.testing.assert_allclose(r, 1 / x, rtol=1e-6)
    np.testing.assert_array_equal(less, (x < y).astype(np.uint8))
    np.testing.assert_array_equal(flat.reshape(4, 8), x - y)


# ------------------------------------------------------------------------------------------------ Tensor Engine


def test_nc_matmul_limits_and_modes(k):
    nl, nisa, run = k
    a = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16)

    def body(x, y):
        ta, tb = _load(nl, nisa, x), _load(nl, nisa, y)
        ps = nl.ndarray((32, 16), nl.float32, buffer=nl.psum)
        with pytest.raises(HardwareLimitError, match="accumulate=True onto PSUM"):
            nisa.nc_matmul(dst=ps, stationary=ta, moving=tb, accumulate=True)
        nisa.nc_matmul(dst=ps, stationary=ta, moving=tb, tile_position=(0, 0), tile_size=(64, 32))
        nisa.nc_matmul(dst=ps, stationary=ta, moving=tb)  # accumulate=None: the second adds
        with pytest.raises(HardwareLimitError, match="does not fit the PE tile"):
            nisa.nc_matmul(dst=ps, stationary=ta, moving=tb, tile_position=(0, 0), tile_size=(32, 32))
        with pytest.raises(HardwareLimitError, match="do not tile"):
            nisa.nc_matmul(dst=ps, stationary=ta, moving=tb, tile_position=(32, 0), tile_size=(64, 32))
        with pytest.raises(TypeError, match="double_row needs fp8"):
            nisa.nc_matmul(dst=ps, stationary=ta, moving=tb, perf_mode=nisa.matmul_perf_mode.double_row)
        out = nl.ndarray((32, 16), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ps)
        with pytest.raises(HardwareLimitError, match="GpSimd Engine cannot access PSUM"):
            nisa.tensor_copy(dst=out, src=ps, engine=nisa.gpsimd_engine)
        small = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        with pytest.raises(HardwareLimitError, match="transpose limit 32 x 32"):
            nisa.nc_transpose(dst=small, data=ta[:, 0:32], engine=nisa.vector_engine)
        return _store(nl, nisa, out)

    out = run(body, a, b)
    np.testing.assert_allclose(out, 2 * (a.astype(np.float64).T @ b.astype(np.float64)), rtol=1e-5, atol=1e-4)


def test_trn3_only_ops_and_constants(k):
    nl, nisa, run = k
    assert nisa.get_nc_version() == nisa.nc_version.gen3
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_bank_fmax == 512 and nl.tile_size.bn_stats_fmax == 512
    assert nl.float8_e4m3fn_x4.itemsize == 4 and nl.float8_e4m3fn_x4 != nl.uint32

    def body():
        t = nl.ndarray((4, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0)
        with pytest.raises(ValueError, match="only be set to 0"):
            nisa.memset(dst=t, value=1)
        with pytest.raises(HardwareLimitError, match="NeuronCore-v4"):
            nisa.quantize_mx(dst=t, src=t, dst_scale=t)

    run(body)


def test_nc_matmul_double_row_contracts_over_partitions_and_the_row_pair(k):
    """NKI's example: a [1, 256] @ [256, 3] matmul as stationary (128, 2, 1) and moving (128, 2, 3)."""
    nl, nisa, run = k
    a = rng.standard_normal((128, 2, 4)).astype(ml_dtypes.float8_e4m3)
    b = rng.standard_normal((128, 2, 3)).astype(ml_dtypes.float8_e4m3)

    def body(x, y):
        ta, tb = _load(nl, nisa, x), _load(nl, nisa, y)
        ps = nl.ndarray((4, 3), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ta, moving=tb, perf_mode=nisa.matmul_perf_mode.double_row)
        with pytest.raises(HardwareLimitError, match=r"double_row needs stationary \(K, 2, M\)"):
            nisa.nc_matmul(dst=ps, stationary=ta[:, 0, :], moving=tb[:, 0, :], perf_mode="double_row")
        out = nl.ndarray((4, 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ps)
        return _store(nl, nisa, out)

    out = run(body, a, b)
    expected = a.astype(np.float64).reshape(256, 4).T @ b.astype(np.float64).reshape(256, 3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_nki_object_takes_keywords_for_unannotated_dataclass_attributes(k):
    import dataclasses

    nl = k[0]

    @dataclasses.dataclass
    class Section(nl.NKIObject):  # nki-library's attention_cte SectionParams: attributes without annotations
        index = None
        offset = None

    @dataclasses.dataclass(frozen=True)
    class Tile(nl.NKIObject):
        size: int
        parts: list = dataclasses.field(default_factory=list)

    s = Section(index=3, offset=384)
    assert (s.index, s.offset) == (3, 384)
    assert Tile(128) == Tile(size=128) and Tile(1).parts == [] and Tile(1).parts is not Tile(1).parts
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        Tile(1, [], 3)


def test_nki_object_dataclasses_default_missing_fields_to_none(k):
    import dataclasses

    nl = k[0]

    @dataclasses.dataclass
    class Dims(nl.NKIObject):
        a: int
        b: int

    d = Dims(a=1)
    assert (d.a, d.b) == (1, None)


def test_dma_compute_adds_in_fp32_and_only_adds(k):
    nl, nisa, run = k
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)

    def body(a, b):
        out = nl.ndarray((8, 16), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=out, srcs=[a, b], reduce_op=nl.add)
        with pytest.raises(ValueError, match="only reduce_op=nl.add"):
            nisa.dma_compute(dst=out, srcs=[a, b], reduce_op=nl.maximum)
        with pytest.raises(ValueError, match="scales"):
            nisa.dma_compute(dst=out, srcs=[a, b], reduce_op=nl.add, scales=[1.0, 2.0])
        return out

    np.testing.assert_array_equal(run(body, x, y), (x + y.astype(np.float32)).astype(ml_dtypes.bfloat16))


# The nki / nl / nisa names AWS nki-library's MoE CTE / TKG kernels and the modules they import use (measured on
# nki-library d2ad3a5 with an import-closure scan): all must resolve.
NKI_LIBRARY_MOE_NAMES = """
nisa.activation nisa.core_barrier nisa.dge_mode.hwdge nisa.dge_mode.swdge nisa.dma_compute nisa.dma_copy
nisa.dma_transpose nisa.engine.scalar nisa.get_nc_version nisa.gpsimd_engine nisa.iota nisa.local_gather nisa.memset
nisa.nc_matmul nisa.nc_matmul_mx nisa.nc_stream_shuffle nisa.nc_transpose nisa.nc_version.gen2 nisa.nc_version.gen3
nisa.nc_version.gen4 nisa.nonzero_with_count nisa.oob_mode.skip nisa.quantize_mx nisa.register_alloc
nisa.register_load nisa.scalar_engine nisa.scalar_tensor_tensor nisa.sendrecv nisa.tensor_copy
nisa.tensor_copy_predicated nisa.tensor_reduce nisa.tensor_scalar nisa.tensor_tensor nisa.vector_engine nki.dtype
nki.isa.constants nki.isa.nc_version.gen4 nki.isa.vector_engine nki.jit nl.NKIObject nl.add nl.affine_range
nl.bfloat16 nl.bool nl.copy nl.ds nl.dynamic_range nl.equal nl.float16 nl.float32 nl.float4_e2m1fn_x4 nl.float8_e4m3
nl.float8_e4m3fn nl.float8_e4m3fn_x4 nl.float8_e5m2 nl.float8_e5m2_x4 nl.gelu nl.gelu_apprx_sigmoid nl.gelu_apprx_tanh
nl.hbm nl.int16 nl.int32 nl.int8 nl.less nl.load nl.maximum nl.minimum nl.multiply nl.ndarray nl.num_programs
nl.private_hbm nl.program_id nl.program_ndim nl.psum nl.rsqrt nl.sbuf nl.sequential_range nl.shared_hbm
nl.shared_identity_matrix nl.silu nl.square nl.subtract nl.tensor nl.tile_size.gemm_moving_fmax nl.tile_size.pmax
nl.tile_size.psum_fmax nl.tile_size.total_available_sbuf_size nl.uint16 nl.uint32 nl.uint8
""".split()


def test_every_name_nki_library_moe_kernels_use_resolves(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl
    from nki.isa import constants  # noqa: F401 -- both import forms
    from nki.isa.constants import dge_mode, oob_mode  # noqa: F401

    roots = {"nki": nki_compat, "nl": nl, "nisa": nisa}
    for name in NKI_LIBRARY_MOE_NAMES:
        obj = roots[name.split(".")[0]]
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)


def test_language_helpers_load_store_full(k):
    nl, nisa, run = k
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def body(a):
        t = nl.load(a, dtype=nl.bfloat16)
        out = nl.ndarray((4, 6), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, t)
        f = nl.full((4, 3), 2.5, nl.float32)
        assert nl.bool == nl.bool_ and nl.ones((2, 2), nl.int32).data.sum() == 4
        return out, _store(nl, nisa, f)

    out, f = run(body, x)
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(f, np.full((4, 3), 2.5))
