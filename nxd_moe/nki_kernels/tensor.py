"""Tensors as kernels see them: :class:`NkiTensor`, a strided view over an allocation with NKI's indexing
(``nl.ds``: :class:`DynSlice`) and view methods, and :class:`AccessPattern`, a DMA access whose offset is read from
a register or a tensor (:func:`scalar_value`) only when the DMA runs."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from nxd_moe.nki_kernels.allocation import Allocation, stand_in
from nxd_moe.nki_kernels.dtypes import is_integer
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError, Trn3OnlyError
from nxd_moe.nki_kernels.virtual_register import VirtualRegister


class DynSlice:
    """``nl.ds(start, size)``: ``size`` elements from ``start`` -- a slice whose length is fixed at trace time."""

    __slots__ = ("start", "size", "step")

    def __init__(self, start, size, step: int = 1):
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
            raise TypeError(f"nl.ds start must be an int here (a runtime start goes through .ap(scalar_offset=...) or "
                            f".select(dim, index_tensor)), got {type(start).__name__}")
        if int(size) < 1:
            raise ValueError(f"nl.ds size must be >= 1, got {size}")
        self.start, self.size, self.step = int(start), int(size), int(step)

    def __repr__(self) -> str:
        return f"nl.ds({self.start}, {self.size})"


class NkiTensor:
    """A tensor, or a strided view of one: ``shape``, ``strides`` and ``offset`` in elements over the allocation's
    row-major storage (NKI's ``NkiTensor``). Views share storage; nothing is copied.

    On-chip tensors keep the partition dimension first: an integer index on dim 0 keeps it as a size-1 dimension, and
    the view methods refuse to move or merge it.
    """

    __slots__ = ("alloc", "shape", "strides", "offset", "dtype", "_data", "_written", "outside")

    def __init__(self, alloc: Allocation, shape, strides, offset: int = 0, dtype=None):
        # Every index and view makes one of these (hundreds of thousands per nki-library kernel): one pass, no
        # generators.
        self.alloc = alloc
        self.shape = shape = tuple(map(int, shape))
        self.strides = strides = tuple(map(int, strides))
        self.offset = offset = int(offset)
        self.dtype = dtype = alloc.dtype if dtype is None else np.dtype(dtype)
        lo = hi = offset
        for n, s in zip(shape, strides):
            if n < 1:
                raise HardwareLimitError(f"tensor {alloc.name!r}: view of shape {shape} selects an empty region")
            if s > 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        limit = alloc.size if dtype == alloc.dtype else alloc.size * alloc.dtype.itemsize // dtype.itemsize
        # A view reaching outside its tensor is legal until an instruction accesses it, as on hardware: kernels build
        # such patterns only for their shape (nki-library: ``nl.ndarray(t.ap(...).shape, ...)``).
        self.outside = None
        if lo < 0 or hi >= limit:
            self.outside = (f"access pattern {self.get_pattern()} + offset {offset} reaches outside tensor "
                            f"{alloc.name!r} ({alloc.size} elements, shape {alloc.shape})")
        self._data = self._written = None  # NumPy views, made on first use: most views are only passed along

    @property
    def data(self) -> np.ndarray:
        """The elements, a NumPy view of the allocation's storage (a zero-stride stand-in without data)."""
        if self._data is None:
            if self.outside is not None:
                raise HardwareLimitError(self.outside)
            self._data = self._strided(self.alloc.data, self.alloc.has_data)
        return self._data

    @property
    def written(self) -> np.ndarray | None:
        """PSUM only: which elements an ``nc_matmul`` has written."""
        if self._written is None and self.alloc.matmul_written is not None and self.outside is None:
            self._written = self._strided(self.alloc.matmul_written, True)
        return self._written

    def _strided(self, storage: np.ndarray, real: bool) -> np.ndarray:
        """This view over ``storage`` (the allocation's data, in this view's dtype, or a same-shaped mask). Built
        as an ``ndarray`` over the storage's bytes: ~4x cheaper than ``as_strided``, which also cannot represent
        ``ml_dtypes``' float8_e5m2 (its array interface type string ``<f1`` does not parse)."""
        if not real:
            return stand_in(self.shape, self.dtype)
        dtype = self.dtype if storage is self.alloc.data else storage.dtype
        item = dtype.itemsize
        return np.ndarray(self.shape, dtype, buffer=storage.reshape(-1).view(np.uint8), offset=self.offset * item,
                          strides=tuple(s * item for s in self.strides))

    @property
    def buffer(self) -> Buffer:
        return self.alloc.buffer

    @property
    def name(self) -> str:
        return self.alloc.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    def _view(self, shape, strides, offset=None, dtype=None) -> "NkiTensor":
        return NkiTensor(self.alloc, shape, strides, self.offset if offset is None else offset,
                         self.dtype if dtype is None else dtype)

    def _row_elements(self) -> int:
        """Elements of one partition of the allocation, in this view's dtype."""
        return self.alloc.bytes_per_partition // self.dtype.itemsize

    # ------------------------------------------------------------------------------------------------ indexing

    def __getitem__(self, key) -> "NkiTensor":
        key = list(key) if isinstance(key, tuple) else [key]
        ellipses = [i for i, k in enumerate(key) if k is Ellipsis]
        if len(ellipses) > 1:
            raise IndexError(f"tensor {self.name!r}: at most one Ellipsis in an index")
        if ellipses:
            i = ellipses[0]
            key[i:i + 1] = [slice(None)] * (self.ndim - len(key) + 1)
        if len(key) > self.ndim:
            raise IndexError(f"tensor {self.name!r} of shape {self.shape}: {len(key)} indices for {self.ndim} dims")
        key += [slice(None)] * (self.ndim - len(key))
        shape, strides, offset = [], [], self.offset
        on_chip = self.alloc.buffer.on_chip
        for dim, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, DynSlice):
                k = slice(k.start, k.start + k.size * k.step, k.step)
                if k.stop > n:
                    raise IndexError(f"tensor {self.name!r}: nl.ds reaches {k.stop} past dim {dim} of size {n}")
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step < 1:
                    raise IndexError(f"tensor {self.name!r}: slice steps must be positive, got {step}")
                count = len(range(start, stop, step))
                if count == 0:
                    raise HardwareLimitError(f"tensor {self.name!r}: index {tuple(key)} selects an empty region of "
                                             f"shape {self.shape}")
                shape.append(count)
                strides.append(s * step)
                offset += s * start
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                k = int(k) + n if k < 0 else int(k)
                if not 0 <= k < n:
                    raise IndexError(f"tensor {self.name!r}: index {k} is out of bounds for dim {dim} of size {n}")
                offset += s * k
                if dim == 0 and on_chip:  # the partition dimension stays, as size 1
                    shape.append(1)
                    strides.append(s)
            else:
                raise TypeError(f"tensor {self.name!r}: index with ints, slices, Ellipsis or nl.ds (got "
                                f"{type(k).__name__}); dynamic addressing goes through .ap(scalar_offset=..., "
                                "vector_offset=...) or .select(dim, index_tensor)")
        if not shape:
            shape, strides = [1], [1]
        if on_chip and len(shape) == 1:  # on-chip views stay at least 2-D
            shape, strides = shape + [1], strides + [1]
        return NkiTensor(self.alloc, shape, strides, offset, self.dtype)

    def __setitem__(self, key, value):
        raise TypeError(f"tensor {self.name!r}: NKI tensors are written by instructions (nisa.*), not by assignment")

    # ------------------------------------------------------------------------------------------------ views

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        dims = range(1 if self.buffer.on_chip else 0, self.ndim)
        expected = 1
        for d in reversed(dims):
            if self.shape[d] != 1 and self.strides[d] != expected:
                return False
            expected *= self.shape[d]
        return True

    def is_indirect(self) -> bool:
        return False

    def _check_dim(self, dim: int, what: str, allow_partition: bool = False) -> int:
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"{what}: dim {dim} out of range for the {self.ndim}-D tensor {self.name!r}")
        dim %= self.ndim
        if dim == 0 and self.buffer.on_chip and not allow_partition:
            raise HardwareLimitError(f"{what}: tensor {self.name!r} is in {self.buffer.value}; its partition dim "
                                     "(dim 0) cannot be changed")
        return dim

    def permute(self, dims) -> "NkiTensor":
        dims = tuple(int(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of range({self.ndim})")
        if self.buffer.on_chip and dims[0] != 0:
            raise HardwareLimitError(f"permute: tensor {self.name!r} is on chip; dims[0] must stay 0, got {dims}")
        return self._view([self.shape[d] for d in dims], [self.strides[d] for d in dims])

    def broadcast(self, dim: int, size: int) -> "NkiTensor":
        dim = self._check_dim(dim, "broadcast")
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast: dim {dim} of {self.name!r} has size {self.shape[dim]}, not 1")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return self._view(shape, strides)

    def expand_dim(self, dim: int) -> "NkiTensor":
        if not 0 <= dim <= self.ndim or (dim == 0 and self.buffer.on_chip):
            raise HardwareLimitError(f"expand_dim: dim {dim} is not a free position of {self.name!r} {self.shape}")
        return self._view(self.shape[:dim] + (1,) + self.shape[dim:], self.strides[:dim] + (1,) + self.strides[dim:])

    def squeeze_dim(self, dim: int) -> "NkiTensor":
        dim = self._check_dim(dim, "squeeze_dim")
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim: dim {dim} of {self.name!r} has size {self.shape[dim]}, not 1")
        return self._view(self.shape[:dim] + self.shape[dim + 1:], self.strides[:dim] + self.strides[dim + 1:])

    def reshape_dim(self, dim: int, shape) -> "NkiTensor":
        parts = _infer_shape(shape, self.shape[self._check_dim(dim, "reshape_dim", allow_partition=True)])
        dim %= self.ndim
        if dim == 0 and self.buffer.on_chip and len(parts) != 1:
            raise HardwareLimitError(f"reshape_dim: the partition dim of on-chip tensor {self.name!r} cannot be split")
        inner = [self.strides[dim] * math.prod(parts[i + 1:]) for i in range(len(parts))]
        return self._view(self.shape[:dim] + tuple(parts) + self.shape[dim + 1:],
                          self.strides[:dim] + tuple(inner) + self.strides[dim + 1:])

    def flatten_dims(self, start_dim: int, end_dim: int) -> "NkiTensor":
        start_dim, end_dim = start_dim % self.ndim, end_dim % self.ndim
        if start_dim == 0 and self.buffer.on_chip:
            raise HardwareLimitError(f"flatten_dims: the partition dim of on-chip tensor {self.name!r} cannot merge")
        for d in range(start_dim, end_dim):
            if self.shape[d + 1] != 1 and self.shape[d] != 1 \
                    and self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise HardwareLimitError(f"flatten_dims: dims {start_dim}..{end_dim} of {self.name!r} are not "
                                         "contiguous in memory")
        merged = math.prod(self.shape[start_dim:end_dim + 1])
        return self._view(self.shape[:start_dim] + (merged,) + self.shape[end_dim + 1:],
                          self.strides[:start_dim] + (self.strides[end_dim],) + self.strides[end_dim + 1:])

    def reshape(self, shape) -> "NkiTensor":
        """A view of another shape with the same elements; the layout must allow it (contiguous free dims)."""
        shape = _infer_shape(shape, self.size)
        if self.buffer.on_chip:
            if shape[0] != self.shape[0]:
                raise HardwareLimitError(f"reshape: on-chip tensor {self.name!r} keeps its partition dim "
                                         f"{self.shape[0]}, got {tuple(shape)}")
            if not self.is_contiguous():
                raise HardwareLimitError(f"reshape: the free dims of {self.name!r} are not contiguous")
            return self._view(shape, (self.strides[0],) + _row_major(shape[1:]))
        if not self.is_contiguous():
            raise HardwareLimitError(f"reshape: {self.name!r} is not contiguous; reshape needs a contiguous view")
        return self._view(shape, _row_major(shape))

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> "NkiTensor":
        dim = self._check_dim(dim, "slice", allow_partition=True)
        if not 0 <= start < end <= self.shape[dim] or step < 1:
            raise IndexError(f"slice: need 0 <= start < end <= {self.shape[dim]} and step >= 1 on dim {dim} of "
                             f"{self.name!r}, got ({start}, {end}, {step})")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index) -> "NkiTensor | AccessPattern":
        """Pick one index of ``dim`` (dropping it); a one-element integer tensor or register picks it at run time."""
        if isinstance(index, (int, np.integer)):
            dim = self._check_dim(dim, "select", allow_partition=not self.buffer.on_chip)
            n = self.shape[dim]
            index = int(index) + n if index < 0 else int(index)
            if not 0 <= index < n:
                raise IndexError(f"select: index {index} out of bounds for dim {dim} of size {n}")
            shape, strides = self.shape[:dim] + self.shape[dim + 1:], self.strides[:dim] + self.strides[dim + 1:]
            if len(shape) < (2 if self.buffer.on_chip else 1):
                shape, strides = shape + (1,), strides + (1,)
            return self._view(shape, strides, self.offset + self.strides[dim] * index)
        dim = self._check_dim(dim, "select")
        pattern = [list(p) for i, p in enumerate(self.get_pattern()) if i != dim]
        return AccessPattern(self, pattern, 0, index, None, dim, removed_dim=dim)

    def vector_select(self, dim: int, vector_offset) -> "AccessPattern":
        if dim != 0:
            raise HardwareLimitError(f"vector_select: dim must be 0, got {dim}")
        pattern = [[self.strides[0], vector_offset.shape[0]]] + self.get_pattern()[1:]
        return AccessPattern(self, pattern, 0, None, vector_offset, 0)

    def ap(self, pattern: Sequence[Sequence[int]], offset: int | None = None, scalar_offset=None, vector_offset=None,
           indirect_dim: int = 0, dtype=None) -> "NkiTensor | AccessPattern":
        """An explicit access pattern over this tensor's storage (NKI's ``.ap``, like ``torch.as_strided``).

        ``pattern`` lists ``[stride, count]`` pairs (outermost first, in elements of ``dtype``, default the tensor's)
        and gives the accessed shape; ``offset`` (elements) is added to the view's own offset. On chip the first pair
        steps over partitions (a whole partition is the allocation's free size). Without dynamic offsets the result
        is a view; ``scalar_offset`` (an int32 ``(1, 1)`` tensor or a register) moves the access by
        ``value * stride of indirect_dim`` (for a whole tensor: ``prod(shape[indirect_dim+1:])``), and
        ``vector_offset`` (an int32 ``(P, 1)`` SBUF tensor) replaces dim 0's index per partition -- both resolved
        (and bounds-checked) when the DMA runs.
        """
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        ratio = self.dtype.itemsize / dtype.itemsize
        base = int(self.offset * ratio) + (0 if offset is None else int(offset))
        pattern = [(int(stride), int(count)) for stride, count in pattern]
        if not pattern or any(count < 1 for _, count in pattern):
            raise HardwareLimitError(f"access pattern {pattern} on {self.name!r}: every count must be >= 1")
        if scalar_offset is not None or vector_offset is not None:
            if dtype != self.dtype:
                raise NotImplementedError(f".ap on {self.name!r}: a dtype reinterpretation with a dynamic offset is "
                                          "not simulated")
            return AccessPattern(self, pattern, base - self.offset, scalar_offset, vector_offset, indirect_dim)
        if self.buffer.on_chip and len(pattern) > 1:
            row = self.alloc.bytes_per_partition // dtype.itemsize
            if pattern[0][0] % row and pattern[0][1] > 1:
                raise HardwareLimitError(f".ap on on-chip tensor {self.name!r}: the partition step {pattern[0][0]} "
                                         f"must be a multiple of the partition size {row} (elements of {dtype})")
        return NkiTensor(self.alloc, [c for _, c in pattern], [s for s, _ in pattern], base, dtype)

    def view(self, dtype) -> "NkiTensor":
        """The same bytes as another dtype; the last dim scales by the size ratio and must be contiguous."""
        dtype = np.dtype(dtype)
        old, new = self.dtype.itemsize, dtype.itemsize
        if old == new:
            return self._view(self.shape, self.strides, dtype=dtype)
        if self.strides[-1] != 1:
            raise HardwareLimitError(f"view: the last dim of {self.name!r} must be contiguous to reinterpret it")
        if new > old:
            r = new // old
            if self.shape[-1] % r or self.offset % r or any(s % r for s in self.strides[:-1]):
                raise HardwareLimitError(f"view: {self.name!r} {self.shape} {self.dtype} cannot be read as {dtype}")
            return self._view(self.shape[:-1] + (self.shape[-1] // r,), tuple(s // r for s in self.strides[:-1]) + (1,),
                              self.offset // r, dtype)
        r = old // new
        return self._view(self.shape[:-1] + (self.shape[-1] * r,), tuple(s * r for s in self.strides[:-1]) + (1,),
                          self.offset * r, dtype)

    reinterpret_cast = view

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes: dict[str, int] | None = None) -> "NkiTensor":
        """einops-style view: ``t.rearrange(('b', ('h', 'w')), ('b', 'w', 'h'), {'h': 4})`` splits dim 1 into
        ``(h, w)`` and swaps them; groups in ``dst_pattern`` merge (their dims must be contiguous). The same
        ``reshape_dim`` / ``permute`` / ``flatten_dims`` rules apply (the partition dim stays first on chip)."""
        src = [d if isinstance(d, (tuple, list)) else (d,) for d in src_pattern]
        dst = [d if isinstance(d, (tuple, list)) else (d,) for d in dst_pattern]
        if len(src) != self.ndim:
            raise ValueError(f"rearrange: source pattern {src_pattern} names {len(src)} dims; the tensor has "
                             f"{self.ndim}")
        names = [n for group in src for n in group]
        if sorted(names) != sorted(n for group in dst for n in group) or len(set(names)) != len(names):
            raise ValueError(f"rearrange: {src_pattern} and {dst_pattern} must name the same dims, once each")
        sizes = dict(fixed_sizes or {})
        view = self
        for dim in reversed(range(len(src))):
            if len(src[dim]) > 1:
                view = view.reshape_dim(dim, [sizes.get(n, -1) for n in src[dim]])
        view = view.permute([names.index(n) for group in dst for n in group])
        start = len([n for group in dst for n in group])
        for group in reversed(dst):
            start -= len(group)
            if len(group) > 1:
                view = view.flatten_dims(start, start + len(group) - 1)
        return view

    def indirect(self, index: "NkiTensor", num_elem: int | None = None) -> "NkiTensor":
        """Tensor indirection (a gather / scatter view at per-partition offsets): NeuronCore-v4 (Trn3) only."""
        raise Trn3OnlyError("NkiTensor.indirect (tensor indirection) is only available on NeuronCore-v4 (Trn3); this "
                            "simulator models Trn2")

    def __repr__(self) -> str:
        return f"NkiTensor({self.name!r}, {self.buffer.value}, {self.dtype}, {self.shape})"


def _row_major(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _infer_shape(shape, total: int) -> tuple[int, ...]:
    shape = [int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,))]
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: at most one -1 in {tuple(shape)}")
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = total // known if known else 0
    if math.prod(shape) != total:
        raise ValueError(f"reshape: {tuple(shape)} does not hold {total} elements")
    return tuple(shape)


class AccessPattern:
    """A DMA access with a runtime (scalar or per-partition vector) offset, resolved and bounds-checked when the DMA
    runs. ``offset`` is relative to the view ``tensor`` it was made from; the dynamic index steps by that view's
    stride of ``indirect_dim`` and must lie inside that dim."""

    def __init__(self, tensor: NkiTensor, pattern, offset: int, scalar_offset, vector_offset, indirect_dim: int,
                 removed_dim: int | None = None):
        pattern = [(int(stride), int(count)) for stride, count in pattern]
        if not pattern or any(count < 1 for _, count in pattern):
            raise HardwareLimitError(f"access pattern {pattern} on {tensor.name!r}: every count must be >= 1")
        if not 0 <= indirect_dim < len(tensor.shape):
            raise ValueError(f"indirect_dim must be in [0, {len(tensor.shape) - 1}], got {indirect_dim}")
        if vector_offset is not None:
            if scalar_offset is not None:
                raise TypeError("an access pattern takes scalar_offset or vector_offset, not both")
            if indirect_dim != 0:
                raise HardwareLimitError("vector_offset indirection is only supported on indirect_dim=0")
            if tensor.buffer.on_chip:
                raise HardwareLimitError(f"vector_offset indirection reads or writes HBM; {tensor.name!r} is in "
                                         f"{tensor.buffer.value}")
            if (not isinstance(vector_offset, NkiTensor) or vector_offset.buffer is not Buffer.SBUF
                    or not is_integer(vector_offset.dtype) or vector_offset.shape[0] != pattern[0][1]
                    or math.prod(vector_offset.shape[1:]) != 1):  # (P, 1) or (P, 1, 1): one offset per partition
                raise TypeError(f"vector_offset must be an integer SBUF tensor of shape ({pattern[0][1]}, 1), got "
                                f"{vector_offset!r}")
        self.tensor = tensor
        self.pattern = pattern
        self.offset = tensor.offset + int(offset)
        self.scalar_offset = scalar_offset
        self.vector_offset = vector_offset
        self.indirect_dim = indirect_dim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(count for _, count in self.pattern)

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def buffer(self) -> Buffer:
        return self.tensor.buffer

    @property
    def dtype(self) -> np.dtype:
        return self.tensor.dtype

    @property
    def dynamic(self) -> bool:
        return self.scalar_offset is not None or self.vector_offset is not None

    def row_stride(self) -> int:
        return self.tensor.strides[self.indirect_dim]

    def is_indirect(self) -> bool:
        return True

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row_base (P,), row_valid (P,), dynamic_index (P,))``: the element address each first-dimension index
        starts at, whether all of that row's addresses (and its dynamic index) are in bounds, and the index."""
        size = self.tensor.alloc.size
        bound = self.tensor.shape[self.indirect_dim]
        inner_lo = sum(min(0, s * (c - 1)) for s, c in self.pattern[1:])
        inner_hi = sum(max(0, s * (c - 1)) for s, c in self.pattern[1:])
        stride0, count0 = self.pattern[0]
        if self.vector_offset is not None:
            index = self.vector_offset.data.reshape(-1).astype(np.int64)
            base = self.offset + index * self.row_stride()
            index_ok = (index >= 0) & (index < bound)
        else:
            base = self.offset + np.arange(count0, dtype=np.int64) * stride0
            index = np.zeros(count0, dtype=np.int64)
            index_ok = np.ones(count0, dtype=bool)
            if self.scalar_offset is not None:
                value = scalar_value(self.scalar_offset)
                base = base + value * self.row_stride()
                index[:] = value
                index_ok[:] = 0 <= value < bound
        in_range = (base + inner_lo >= 0) & (base + inner_hi < size)
        if not self.dynamic and not in_range.all():
            raise HardwareLimitError(f"access pattern {self.pattern} + offset {self.offset} reaches outside tensor "
                                     f"{self.name!r} ({size} elements, shape {self.tensor.shape})")
        return base, index_ok & in_range, index

    def elements(self, row_base: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(array, index)``: the accessed elements for the given in-bounds row starts are ``array[index]``, shape
        ``(rows, *shape[1:])`` -- read it, or assign to it to write them. Evenly spaced rows (no vector offset) are
        one strided view; gathered rows index the first axis of a window over the storage (``window[j]`` is the
        inner pattern starting at element ``j``), so whole rows move instead of element-by-element addresses."""
        flat = self.tensor.alloc.data.reshape(-1)
        item = flat.dtype.itemsize
        raw = flat.view(np.uint8)
        inner_shape = tuple(count for _, count in self.pattern[1:])
        inner_strides = tuple(stride * item for stride, _ in self.pattern[1:])
        steps = np.diff(row_base)
        if not steps.size or (steps == steps[0]).all():
            step = int(steps[0]) if steps.size else 0
            view = np.ndarray((len(row_base),) + inner_shape, flat.dtype, buffer=raw, offset=int(row_base[0]) * item,
                              strides=(step * item,) + inner_strides)
            return view, Ellipsis
        inner_lo = sum(min(0, s * (c - 1)) for s, c in self.pattern[1:])
        inner_hi = sum(max(0, s * (c - 1)) for s, c in self.pattern[1:])
        window = np.ndarray((flat.size - inner_hi + inner_lo,) + inner_shape, flat.dtype, buffer=raw,
                            offset=-inner_lo * item, strides=(item,) + inner_strides)
        return window, row_base + inner_lo

    def addresses(self, row_base: np.ndarray) -> np.ndarray:
        """Element addresses ``(rows, *shape[1:])`` for the given row starts."""
        addr = row_base.reshape((-1,) + (1,) * (len(self.pattern) - 1))
        for d, (stride, count) in enumerate(self.pattern[1:], start=1):
            shape = [1] * len(self.pattern)
            shape[d] = count
            addr = addr + (np.arange(count, dtype=np.int64) * stride).reshape(shape)
        return np.broadcast_to(addr, (len(row_base),) + self.shape[1:])


def scalar_value(source) -> int:
    """The value of a ``scalar_offset``: a register or a one-element integer tensor (read by the DMA engine)."""
    if isinstance(source, VirtualRegister):
        return source.value
    if isinstance(source, NkiTensor) and is_integer(source.dtype) and source.data.size == 1:
        return int(source.data.reshape(-1)[0])
    raise TypeError(f"scalar_offset must be a VirtualRegister or a one-element integer tensor, got {source!r}")


def whole(alloc: Allocation) -> NkiTensor:
    """The whole of an allocation, row-major."""
    return NkiTensor(alloc, alloc.shape, _row_major(alloc.shape))

