"""Top-k building blocks on the Vector Engine (``max8``, ``nc_find_index8``, ``nc_match_replace8``) and GpSimd
(``topk``), per partition, comparing in fp32 as the engines do."""

from __future__ import annotations

import numpy as np
import torch

from nxd_moe.nki_kernels.dtypes import bfloat16, uint16, uint32
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import account, as_f32, computes, store_result, tile_operand
from nxd_moe.nki_kernels.machine import instruction

TOP8_MIN_ELEMENTS, TOP8_MAX_ELEMENTS = 8, 16384
_INDEX_DTYPES = (uint16, uint32)


def _eight(label: str, dst, src, role: str = "data") -> None:
    if dst.partitions != src.partitions:
        raise HardwareLimitError(f"{label}: dst has {dst.partitions} partitions, {role} {src.partitions}")
    if dst.free_size != 8:
        raise HardwareLimitError(f"{label}: dst must hold 8 elements per partition, got shape {dst.shape}")
    if not TOP8_MIN_ELEMENTS <= src.free_size <= TOP8_MAX_ELEMENTS:
        raise HardwareLimitError(f"{label}: {role} must have {TOP8_MIN_ELEMENTS} to {TOP8_MAX_ELEMENTS} elements per "
                                 f"partition, got {src.free_size}")


@instruction
def max8(dst, src, name=None) -> None:
    """``dst (P, 8)``: the 8 largest values of each partition of ``src``, in descending order."""
    label = "max8"
    dst, src = tile_operand(dst, "dst", label), tile_operand(src, "src", label)
    _eight(label, dst, src, "src")
    if computes(dst, src):
        store_result(dst, _largest8(as_f32(src)))
    account("vector", label, src, dst)


def _largest8(x: np.ndarray) -> np.ndarray:
    """``(P, 8)``: each row's 8 largest values, descending; NaN ranks below every number (a descending sort's
    order). torch's top-k is ~8x faster than NumPy's sort; it would rank NaN first, so rows with NaN take the sort."""
    if np.isnan(x).any():
        return -np.sort(np.partition(-x, 7, axis=1)[:, :8], axis=1)
    return torch.topk(torch.from_numpy(np.ascontiguousarray(x)), 8, dim=1).values.numpy()


def _match(x: np.ndarray, vals: np.ndarray, order) -> tuple[np.ndarray, np.ndarray]:
    """For the columns of ``vals`` in ``order``: the first position of ``x`` equal to that value and not taken by an
    earlier column (so duplicated values pair with distinct positions). Returns ``(positions, found)``, (P, 8)."""
    p, n = x.shape
    positions = np.zeros((p, vals.shape[1]), np.int64)
    found = np.zeros((p, vals.shape[1]), bool)
    rows = np.arange(p)
    for j in order:  # first occurrences; right unless a row repeats a value among its vals
        hits = x == vals[:, j:j + 1]
        positions[:, j] = hits.argmax(axis=1)
        found[:, j] = hits[rows, positions[:, j]]
    repeated = (vals[:, :, None] == vals[:, None, :]).sum(axis=(1, 2)) > vals.shape[1]
    for r in np.flatnonzero(repeated):  # such rows again, each column skipping positions earlier columns took
        taken = np.zeros(n, bool)
        for j in order:
            hits = (x[r] == vals[r, j]) & ~taken
            first = int(hits.argmax())
            found[r, j] = hits[first]
            positions[r, j] = first
            if hits[first]:
                taken[first] = True
    return positions, found


def _sentinel(dtype) -> int:
    return int(np.iinfo(dtype).max)


@instruction
def nc_find_index8(dst, data, vals, name=None) -> None:
    """``dst (P, 8)`` uint16/uint32: the index of the first occurrence of each of the 8 ``vals`` in each partition
    of ``data`` (duplicated vals pair with successive occurrences, ascending); a value not present gets the all-ones
    sentinel."""
    label = "nc_find_index8"
    dst, data, vals = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (data, "data"), (vals, "vals")))
    _eight(label, dst, data)
    if vals.partitions != data.partitions or vals.free_size != 8:
        raise HardwareLimitError(f"{label}: vals must be ({data.partitions}, 8), got {vals.shape}")
    if dst.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{label}: dst must be uint16 or uint32, got {dst.dtype}")
    if computes(dst, data, vals):
        positions, found = _match(as_f32(data), as_f32(vals), range(8))
        store_result(dst, np.where(found, positions, _sentinel(dst.dtype)))
    account("vector", label, data, dst)


@instruction
def nc_match_replace8(dst, data, vals, imm: float, dst_idx=None, name=None) -> None:
    """``dst = data`` with the first occurrence of each of the 8 ``vals`` (per partition) replaced by ``imm``;
    ``dst_idx (P, 8)`` gets the matched positions. Duplicated vals are processed from the last column to the first,
    so the earliest position lands in the highest of their columns (NKI's documented tie-break); an unmatched value
    leaves ``data`` alone and gets the all-ones index sentinel."""
    label = "nc_match_replace8"
    dst, data, vals = (tile_operand(t, r, label) for t, r in ((dst, "dst"), (data, "data"), (vals, "vals")))
    if dst.partitions != data.partitions or dst.free_size != data.free_size:
        raise HardwareLimitError(f"{label}: dst {dst.shape} must match data {data.shape} (partitions and elements)")
    if not TOP8_MIN_ELEMENTS <= data.free_size <= TOP8_MAX_ELEMENTS:
        raise HardwareLimitError(f"{label}: data must have {TOP8_MIN_ELEMENTS} to {TOP8_MAX_ELEMENTS} elements per "
                                 f"partition, got {data.free_size}")
    if vals.partitions != data.partitions or vals.free_size != 8:
        raise HardwareLimitError(f"{label}: vals must be ({data.partitions}, 8), got {vals.shape}")
    if dst_idx is not None:
        dst_idx = tile_operand(dst_idx, "dst_idx", label)
        if dst_idx.partitions != data.partitions or dst_idx.free_size != 8:
            raise HardwareLimitError(f"{label}: dst_idx must be ({data.partitions}, 8), got {dst_idx.shape}")
    if computes(dst, data, vals):
        x = as_f32(data)
        positions, found = _match(x, as_f32(vals), range(7, -1, -1))
        rows = np.repeat(np.arange(x.shape[0])[:, None], 8, axis=1)
        out = data.data.reshape(x.shape).copy()
        out[rows[found], positions[found]] = np.asarray(imm).astype(out.dtype)
        store_result(dst, out)
        if dst_idx is not None and dst_idx.alloc.has_data:
            unmatched = _sentinel(dst_idx.dtype) if dst_idx.dtype.kind == "u" else -1
            store_result(dst_idx, np.where(found, positions, unmatched))
    account("vector", label, data, dst)


TOPK_GROUP = 16


@instruction
def topk(val_dst, idx_dst, src, n: int, name=None) -> None:
    """GpSimd top-K over a 16-partition "snake": in each group of 16 partitions, element ``e`` of the group's ``n``
    BF16 values sits at partition ``e % 16``, column ``e // 16``; every partition of the group gets the group's K
    largest values in ascending order (``val_dst (P, K)`` bf16) and their indices ``e`` (``idx_dst`` uint32)."""
    label = "topk"
    val_dst = tile_operand(val_dst, "val_dst", label, (Buffer.SBUF,))
    idx_dst = tile_operand(idx_dst, "idx_dst", label, (Buffer.SBUF,))
    src = tile_operand(src, "src", label, (Buffer.SBUF,))
    k, p = val_dst.free_size, src.partitions
    if src.dtype != bfloat16 or val_dst.dtype != bfloat16 or idx_dst.dtype != uint32:
        raise TypeError(f"{label}: src and val_dst must be bfloat16 and idx_dst uint32, got {src.dtype}, "
                        f"{val_dst.dtype}, {idx_dst.dtype}")
    if p % TOPK_GROUP or val_dst.partitions != p or idx_dst.partitions != p or idx_dst.free_size != k:
        raise HardwareLimitError(f"{label}: partitions must be a multiple of 16 and equal for src {src.shape}, "
                                 f"val_dst {val_dst.shape}, idx_dst {idx_dst.shape}")
    if not 8 <= n < 65536 or not 1 <= k <= n or src.free_size * TOPK_GROUP < n:
        raise HardwareLimitError(f"{label}: need 8 <= n < 65536, 1 <= K <= n and n <= 16 * src columns; got n={n}, "
                                 f"K={k}, src {src.shape}")
    if computes(val_dst, src):
        x = as_f32(src)
        values = np.zeros((p, k), np.float32)
        indices = np.zeros((p, k), np.int64)
        for g in range(0, p, TOPK_GROUP):
            snake = x[g:g + TOPK_GROUP].T.reshape(-1)[:n]  # element e = column * 16 + partition
            best = np.argsort(-snake, kind="stable")[:k][::-1]
            values[g:g + TOPK_GROUP], indices[g:g + TOPK_GROUP] = snake[best], best
        store_result(val_dst, values)
        if idx_dst.alloc.has_data:
            store_result(idx_dst, indices)
    account("gpsimd", label, src, val_dst)
