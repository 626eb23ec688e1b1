"""Kernels written the way NKI code for the Neuron compiler is written (``import nki.language as nl``), imported
only while ``nxd_moe.nki_kernels.compat`` is installed (the ``nki_style`` fixture). Each has a NumPy statement of
what it computes in test_compat_kernels.py."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki.isa.constants import oob_mode

P = nl.tile_size.pmax


@nki.jit
def tiled_matmul(a_t, b):
    """``a_t (K, M).T @ b (K, N)`` with K in 128-row tiles accumulated in one PSUM bank (``nl.ds`` slices)."""
    k, m = a_t.shape
    _, n = b.shape
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    for kt in nl.affine_range(k // P):
        lhs = nl.ndarray((P, m), a_t.dtype, buffer=nl.sbuf)
        rhs = nl.ndarray((P, n), b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=lhs, src=a_t[nl.ds(kt * P, P), :])
        nisa.dma_copy(dst=rhs, src=b[nl.ds(kt * P, P), :])
        nisa.nc_matmul(dst=acc, stationary=lhs, moving=rhs, accumulate=kt > 0)
    res = nl.ndarray((m, n), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    nisa.dma_copy(dst=out, src=res)
    return out


@nki.jit
def gather_rows(table, ids):
    """``out[p] = table[ids[p]]`` for in-bounds ids, zeros elsewhere (an indirect DMA with ``oob_mode.skip``)."""
    rows, width = table.shape
    (count,) = ids.shape
    out = nl.ndarray((count, width), table.dtype, buffer=nl.shared_hbm)
    index = nl.ndarray((count, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=index, src=ids.reshape((count, 1)))
    gathered = nl.ndarray((count, width), table.dtype, buffer=nl.sbuf)
    nisa.memset(dst=gathered, value=0.0)
    nisa.dma_copy(dst=gathered, src=table.ap([[width, count], [1, width]], vector_offset=index, indirect_dim=0),
                  oob_mode=oob_mode.skip)
    nisa.dma_copy(dst=out, src=gathered)
    return out


@nki.jit
def strided_rows(table, stride: int, start: int):
    """Rows ``start, start + stride, ...`` of ``table`` gathered through an index vector built by ``nisa.iota``
    (``channel_multiplier`` = stride) -- the kernel's own device-side index arithmetic."""
    rows, width = table.shape
    count = (rows - start + stride - 1) // stride
    index = nl.ndarray((count, 1), nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=index, pattern=[[0, 1]], offset=start, channel_multiplier=stride)
    out = nl.ndarray((count, width), table.dtype, buffer=nl.shared_hbm)
    gathered = nl.ndarray((count, width), table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gathered, src=table.ap([[width, count], [1, width]], vector_offset=index))
    nisa.dma_copy(dst=out, src=gathered)
    return out


@nki.jit
def running_column_sums(x):
    """``out[:, j] = sum(x[:, :(j + 1) * 128], axis=1)``: a ``sequential_range`` loop carrying a tile."""
    rows, cols = x.shape
    tiles = cols // P
    out = nl.ndarray((rows, tiles), nl.float32, buffer=nl.shared_hbm)
    total = nl.ndarray((nl.par_dim(rows), 1), nl.float32, buffer=nl.sbuf)
    sums = nl.ndarray((nl.par_dim(rows), tiles), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=total, value=0.0)
    for j in nl.sequential_range(tiles):
        chunk = nl.ndarray((rows, P), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=chunk, src=x[:, nl.ds(j * P, P)])
        part = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=part, op=nl.add, data=chunk, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=total, data1=total, data2=part, op=nl.add)
        nisa.tensor_copy(dst=sums[:, j], src=total)
    nisa.dma_copy(dst=out, src=sums)
    return out


@nki.jit
def dynamic_block_sum(x, count):
    """``sum(x[:count[0]])`` over 128-row blocks, with the trip count read on the device into a register and the
    block picked by ``.ap(scalar_offset=...)`` (a hardware loop)."""
    blocks, p, width = x.shape
    reg = nisa.register_alloc()
    count_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=count_sb, src=count.reshape((1, 1)))
    nisa.register_load(reg, count_sb)
    acc = nl.ndarray((p, width), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    for i in nl.dynamic_range(reg):
        block = nl.ndarray((p, width), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=block, src=x.ap([[width, p], [1, width]], scalar_offset=i, indirect_dim=0))
        nisa.tensor_tensor(dst=acc, data1=acc, data2=block, op=nl.add)
    out = nl.ndarray((p, width), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


@nki.jit
def lnc2_sum_of_halves(x):
    """LNC2: each core sums its half of ``x``'s columns, the cores swap partials with ``sendrecv``, core 0 writes
    ``x.sum(axis=1)`` -- and core 1 writes the same from its side (a check that both hold the total)."""
    rows, cols = x.shape
    half = cols // 2
    core = nl.program_id(0)
    out = nl.ndarray((2, rows), nl.float32, buffer=nl.shared_hbm)
    mine = nl.ndarray((rows, half), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[:, nl.ds(core * half, half)])
    partial = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=partial, op=nl.add, data=mine, axis=1, keepdims=True)
    theirs = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    peer = 1 - core
    nisa.sendrecv(src=partial, dst=theirs, send_to_rank=peer, recv_from_rank=peer, pipe_id=0)
    total = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=total, data1=partial, data2=theirs, op=nl.add)
    nisa.dma_copy(dst=out[core], src=total)
    nisa.core_barrier(out, (0, 1))
    return out


@nki.jit
def transpose_through_views(x):
    """``x.T`` for a (128, 64) x: a strided HBM view (``permute``) loaded by DMA, then stored; and the Tensor
    Engine transpose (``nc_matmul(is_transpose=True)`` against ``nl.shared_identity_matrix``) of the same data."""
    rows, cols = x.shape
    by_dma = nl.ndarray((cols, rows), x.dtype, buffer=nl.shared_hbm)
    by_pe = nl.ndarray((cols, rows), x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((cols, rows), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.permute((1, 0)))
    nisa.dma_copy(dst=by_dma, src=t)
    s = nl.ndarray((rows, cols), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=x)
    identity = nl.shared_identity_matrix(rows, dtype=x.dtype)
    ps = nl.ndarray((cols, rows), x.dtype, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=s, moving=identity, is_transpose=True)
    back = nl.ndarray((cols, rows), x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=back, src=ps)
    nisa.dma_copy(dst=by_pe, src=back)
    return by_dma, by_pe


@nki.jit
def block_rows_copy(hidden_states, token_position_to_id, block_to_expert, block_size):
    """An external "blockwise" kernel for the planner: copies every block's token rows (gathered by id, 128 per
    DMA) into ``out (N * B, H)`` -- the hidden-state traffic of a blockwise matmul, nothing else."""
    rows, hidden = hidden_states.shape
    (slots,) = token_position_to_id.shape
    out = nl.ndarray((slots, hidden), hidden_states.dtype, buffer=nl.shared_hbm)
    for start in range(0, slots, P):
        ids = nl.ndarray((P, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids, src=token_position_to_id[nl.ds(start, P)].reshape((P, 1)))
        tile = nl.ndarray((P, hidden), hidden_states.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=hidden_states.ap([[hidden, P], [1, hidden]], vector_offset=ids))
        nisa.dma_copy(dst=out[nl.ds(start, P), :], src=tile)
    return out
