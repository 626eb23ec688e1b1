"""Several per-token tensors of different dtypes sent as one byte matrix: one collective instead of one per field.

A token's row is its fields' bytes side by side (hidden state, top-k weights, top-k expert ids, ...). Both
dispatch strategies ship the same rows, so their byte counts compare like for like.

:func:`exchange_rows` is how the dispatches use it: one collective on the packed rows, or -- under XLA, where
``torch_xla`` 2.9 has no lowering for a dtype view (``view(torch.uint8)`` runs on the CPU, a host round trip
inside the graph) -- one collective per field, moving the same bytes.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch


class FieldSpec(NamedTuple):
    """One field of a row: its trailing shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def pack(fields: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple[FieldSpec, ...]]:
    """``[(N, *s_i)]`` -> ``(N, row_bytes)`` uint8, and the specs :func:`unpack` needs."""
    if not fields:
        raise ValueError("pack needs at least one field")
    rows = fields[0].shape[0]
    if any(f.shape[0] != rows for f in fields):
        raise ValueError(f"pack: every field needs the same number of rows, got {[f.shape[0] for f in fields]}")
    specs = tuple(FieldSpec(tuple(f.shape[1:]), f.dtype) for f in fields)
    columns = [f.contiguous().view(rows, -1).view(torch.uint8) if f.numel() else
               torch.empty((rows, spec.nbytes), dtype=torch.uint8, device=f.device) for f, spec in zip(fields, specs)]
    return torch.cat(columns, dim=1), specs


def unpack(rows: torch.Tensor, specs: Sequence[FieldSpec]) -> list[torch.Tensor]:
    """The inverse of :func:`pack`: each field a view of ``rows`` where its bytes are aligned for its dtype (no
    copy), else copied out."""
    out, start = [], 0
    for spec in specs:
        chunk = rows[:, start:start + spec.nbytes]
        item = spec.dtype.itemsize
        # Traced by torch.compile, a tensor's storage offset is not known: copy (the compiler fuses the copy).
        if torch.compiler.is_compiling() or start % item or rows.stride(0) % item or rows.storage_offset() % item:
            chunk = rows.new_empty((rows.shape[0], spec.nbytes)).copy_(chunk)
        out.append(chunk.view(spec.dtype).view(rows.shape[0], *spec.shape))
        start += spec.nbytes
    if start != rows.shape[1]:
        raise ValueError(f"unpack: fields take {start} bytes per row, rows have {rows.shape[1]}")
    return out


def packs_bytes(device: torch.device) -> bool:
    """Whether fields can travel packed as bytes on ``device`` (not under XLA: see the module docstring)."""
    return device.type != "xla"


def exchange_rows(fields: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], torch.Tensor]
                  ) -> list[torch.Tensor]:
    """``collective`` (any function that moves and reorders whole rows) applied to the per-row ``fields``: packed
    into one byte row and unpacked after, or field by field where bytes cannot be packed."""
    if not packs_bytes(fields[0].device):
        return [collective(f) for f in fields]
    payload, specs = pack(fields)
    return unpack(collective(payload), specs)
