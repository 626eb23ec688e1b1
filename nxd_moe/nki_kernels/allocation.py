"""What an ``nl.ndarray`` is underneath: its storage (:class:`Allocation`) and, in PSUM, the ``nc_matmul``
accumulation group not yet added up (:class:`PendingMatmul`, stored by :func:`settle`).

Fresh memory is filled with NaN (floats) or 4 (integers), as in the NKI CPU simulator, so a read of memory nobody
wrote shows up in the result. With ``numerics=False`` (a *counting* run) floating-point HBM tensors hold no data --
a one-element zero-stride stand-in of their shape -- while integer tensors (token ids, expert ids, conditions,
addresses) always hold real values, because they decide which transfers are skipped and how often dynamic loops run.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable

import numpy as np
import torch

from nxd_moe.nki_kernels.dtypes import cast, is_integer
from nxd_moe.nki_kernels.hardware import Buffer

UNINITIALISED_INT = 4  # what the NKI simulator writes into fresh integer memory


@functools.lru_cache(maxsize=None)
def _fresh_pattern(dtype: np.dtype) -> np.ndarray:
    """One element of fresh memory (NaN, or 4 for integers) as its raw bits."""
    fill = UNINITIALISED_INT if is_integer(dtype) else np.nan
    return np.array(fill, dtype=dtype).view(np.dtype(f"u{dtype.itemsize}"))


def fresh(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Fresh memory: ``np.full(shape, NaN or 4, dtype)``, filled through an unsigned view of the same width (a
    fill loop over raw words; ``np.full`` converts the scalar element by element for ``ml_dtypes`` types -- 10-60x
    slower, and kernels allocate a tile per loop iteration)."""
    pattern = _fresh_pattern(dtype)
    data = np.empty(shape, dtype=dtype)
    data.view(pattern.dtype).fill(pattern)
    return data


def stand_in(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-stride stand-in of ``shape`` for a tensor without data: slicing it gives the right shapes, and it
    costs one element."""
    dtype = np.dtype(dtype)
    return np.ndarray(shape, dtype, buffer=np.zeros(dtype.itemsize, np.uint8), strides=(0,) * len(shape))


_SERIALS = itertools.count()


class Allocation:
    """One ``nl.ndarray``: its memory, where it lives and whether it is still alive."""

    def __init__(self, name: str, buffer: Buffer, dtype: np.dtype, shape: tuple[int, ...], numerics: bool,
                 owner: int | None, data: np.ndarray | None = None):
        self.name = name
        self.buffer = buffer
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self.owner = owner
        self.serial = next(_SERIALS)
        self.alive = True
        self.release: Callable[[], None] = lambda: None
        # Counting runs keep real storage for integers (they steer control flow) and for on-chip tensors (bounded by
        # SBUF / PSUM), so index arithmetic routed through float tiles (an int -> fp32 -> transpose -> int round
        # trip) stays exact; ``known`` is False once a tensor holds values derived from data-less (HBM float) inputs.
        self.has_data = numerics or is_integer(self.dtype) or buffer in (Buffer.SBUF, Buffer.PSUM)
        self.known = self.has_data
        if self.has_data and data is not None:  # given contents (a kernel argument)
            self.data = data
        elif self.has_data and self.dtype.names is not None:  # packed x4 types: all-ones bytes (NaN for fp8)
            self.data = np.full(shape + (self.dtype.itemsize,), 0xFF, np.uint8).view(self.dtype).reshape(shape)
        elif self.has_data:
            self.data = fresh(shape, self.dtype)
        else:
            self.data = stand_in(shape, self.dtype)
        # PSUM remembers what nc_matmul wrote, for its accumulate rules, and holds the accumulation group being
        # built (see PendingMatmul).
        self.matmul_written = np.zeros(shape, dtype=bool) if buffer is Buffer.PSUM else None
        self.pending: PendingMatmul | None = None
        self.read_by_pending: list[Allocation] = []  # PSUM tensors whose pending group reads this one
        free = math.prod(shape[1:]) if len(shape) > 1 else 1
        self.bytes_per_partition = free * self.dtype.itemsize
        self.size = math.prod(shape)


class PendingMatmul:
    """An accumulation group not yet added up: consecutive ``nc_matmul`` into one PSUM region, each ``(K, M).T @
    (K, N)``, are the single product of their operands stacked along K. It is computed as one BLAS call (fp32, as
    PSUM accumulates) when anything touches the PSUM tensor or writes an operand (:func:`settle`): the slicing into
    128-row matmuls is the hardware's, not the arithmetic's, and one large product is ~20x faster than many small
    ones. The operands are kept as views, not copies, for the same reason.

    ``dst`` and the operands are ``NkiTensor`` views (of the PSUM allocation, and of SBUF ones).
    """

    def __init__(self, dst: Any, adds_to: np.ndarray | None):
        self.dst = dst
        self.key = (dst.offset, dst.shape, dst.strides)
        self.adds_to = adds_to  # (M, N) bool: elements the group adds to (None: it overwrites them all)
        self.stationary: list[np.ndarray] = []
        self.moving: list[np.ndarray] = []
        self.operands: list[Allocation] = []  # whose read_by_pending names this group's PSUM tensor

    def add(self, stationary: Any, moving: Any, rows: int = 1) -> None:
        """``rows=2``: ``perf_mode=double_row`` operands ``(K, 2, M)`` / ``(K, 2, N)``, contracted over ``(K, 2)``."""
        k = stationary.partitions * rows
        self.stationary.append(stationary.data.reshape(k, stationary.free_size // rows))
        self.moving.append(moving.data.reshape(k, moving.free_size // rows))
        for operand in (stationary.alloc, moving.alloc):
            if not operand.read_by_pending or operand.read_by_pending[-1] is not self.dst.alloc:
                operand.read_by_pending.append(self.dst.alloc)
                self.operands.append(operand)

    def total(self) -> np.ndarray:
        product = fp32_matmul(_stacked(self.stationary), _stacked(self.moving))
        if self.adds_to is not None and self.adds_to.any():
            held = self.dst.data.astype(np.float32).reshape(product.shape)
            product = np.where(self.adds_to, held + product, product)
        return product


def _stacked(parts: list[np.ndarray]) -> np.ndarray:
    """The parts stacked along K, converted to fp32 in the same pass (fp8 through :func:`cast`'s table)."""
    if len(parts) == 1 or parts[0].dtype.itemsize == 1 or parts[0].dtype == np.float16:
        whole = [cast(p, np.float32) for p in parts]
        return whole[0] if len(whole) == 1 else np.concatenate(whole)
    return np.concatenate(parts, dtype=np.float32, casting="unsafe")


def fp32_matmul(stationary: np.ndarray, moving: np.ndarray) -> np.ndarray:
    """``stationary (K, M).T @ moving (K, N)`` in fp32, on the calling thread (BLAS's own threads only fight the
    cores of an LNC2 launch: see ``lnc.simulate``)."""
    return (torch.from_numpy(stationary).T @ torch.from_numpy(moving)).numpy()


def settle(alloc: Allocation) -> None:
    """Store a PSUM tensor's pending accumulation group (before anything reads or writes the tensor)."""
    pending, alloc.pending = alloc.pending, None
    if pending is not None:
        np.copyto(pending.dst.data, pending.total().reshape(pending.dst.shape), casting="unsafe")
        # The operands no longer wait on this tensor: without this, a weight tile read by thousands of matmuls would
        # keep every PSUM tile they wrote alive (1.4 GB on nki-library's moe_tkg at T=1024, H=I=3072).
        for operand in pending.operands:
            waiting = operand.read_by_pending
            if alloc in waiting:
                waiting.remove(alloc)
