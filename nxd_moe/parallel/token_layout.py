"""Where a rank's tokens sit in the MoE's token order.

The MoE of one model-parallel block (``M = TP * EP`` ranks) serves the tokens of ``D`` token groups -- the dense
layers' tensor-parallel groups inside the block (``D = EP`` in NxD's layout: the dense layers run data
parallel across expert-parallel ranks). The block's token order is the single-device order of the batch made by
stacking the groups' batches: group ``d``'s ``(B, S)`` tokens in row-major order, groups one after another.

- Without sequence parallelism every rank of a token group holds the group's whole ``(B, S)`` batch.
- With it, TP rank ``j`` of the group holds sequence positions ``[j * S_r, (j + 1) * S_r)`` of every row:
  a ``(B, S_r)`` shard.

A rank's index in the block is ``d * TP + j`` (TP ranks are consecutive), so gathering shards over the block
in rank order gives ``(D, TP, B, S_r)``; :meth:`TokenLayout.to_token_order` permutes that to ``(D, B, TP, S_r)``,
which is the token order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nxd_moe.checks import check_bool, check_int


@dataclass(frozen=True)
class TokenLayout:
    """This rank's ``(batch, local_seq_len)`` tokens in a block of ``num_groups`` token groups of ``group_size``
    ranks; it is rank ``group_rank`` of group ``group_index``.

    In an SPMD program (:mod:`nxd_moe.parallel_state`) ``group_rank`` and ``group_index`` are 0-d tensors computed
    from the rank tensor, and what depends on them is computed on the device (:meth:`owned_rows`)."""

    batch: int
    local_seq_len: int
    sequence_parallel: bool
    group_size: int
    group_rank: int
    num_groups: int
    group_index: int

    def __post_init__(self):
        check_int("TokenLayout.batch", self.batch, minimum=1)
        check_int("TokenLayout.local_seq_len", self.local_seq_len, minimum=1)
        check_bool("TokenLayout.sequence_parallel", self.sequence_parallel)
        check_int("TokenLayout.group_size", self.group_size, minimum=1)
        check_int("TokenLayout.num_groups", self.num_groups, minimum=1)
        if not isinstance(self.group_rank, torch.Tensor):
            check_int("TokenLayout.group_rank", self.group_rank, minimum=0, maximum=self.group_size - 1)
        if not isinstance(self.group_index, torch.Tensor):
            check_int("TokenLayout.group_index", self.group_index, minimum=0, maximum=self.num_groups - 1)

    def without_rank(self) -> "TokenLayout":
        """The same layout seen from the block's first rank: a key for what every rank shares."""
        return dataclasses.replace(self, group_rank=0, group_index=0)

    @property
    def seq_len(self) -> int:
        return self.local_seq_len * (self.group_size if self.sequence_parallel else 1)

    @property
    def num_local_tokens(self) -> int:
        return self.batch * self.local_seq_len

    @property
    def tokens_per_group(self) -> int:
        return self.batch * self.seq_len

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole block (what a single device would see)."""
        return self.num_groups * self.tokens_per_group

    def token_ids(self, rank: int | None = None, device=None) -> torch.Tensor:
        """``(B * S_r,)`` position in the block's token order of each local token of block rank ``rank``
        (default: this rank), in local row-major order."""
        d, j = divmod(self.group_index * self.group_size + self.group_rank if rank is None else rank,
                      self.group_size)
        b = torch.arange(self.batch, device=device).unsqueeze(1) * self.seq_len
        s = torch.arange(self.local_seq_len, device=device).unsqueeze(0)
        if self.sequence_parallel:
            s = s + j * self.local_seq_len
        return (d * self.tokens_per_group + b + s).reshape(-1)

    def to_token_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """Shards gathered over the block in rank order ``(M * B * S_r, ...)`` -> the block's token order."""
        return self._swap_ranks_and_batch(gathered, self.group_size, self.batch)

    def from_token_order(self, tokens: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_token_order`."""
        return self._swap_ranks_and_batch(tokens, self.batch, self.group_size)

    def _swap_ranks_and_batch(self, rows: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
        """Each token group's rows ``(outer, inner, S_r)`` -> ``(inner, outer, S_r)``, where ``outer`` and ``inner``
        are the group's ranks and the batch, one way or the other. Without sequence parallelism (or with one rank
        per group) the two orders are the same."""
        if not self.sequence_parallel or self.group_size == 1:
            return rows
        rest = rows.shape[1:]
        shaped = rows.reshape(self.num_groups, outer, inner, self.local_seq_len, *rest)
        return shaped.transpose(1, 2).reshape(-1, *rest)

    def chunk(self) -> tuple[int, int, int]:
        """Without sequence parallelism the group's ranks split the group's tokens for an all-to-all dispatch:
        ``(start, stop, chunk_len)`` of this rank's rows; ``chunk_len = ceil(B * S / TP)`` is the same on every
        rank (the last chunks may be short or empty). With sequence parallelism a rank owns all its rows."""
        if self.sequence_parallel:
            return 0, self.num_local_tokens, self.num_local_tokens
        chunk_len = self.chunk_len
        start = min(self.group_rank * chunk_len, self.num_local_tokens)
        return start, min(start + chunk_len, self.num_local_tokens), chunk_len

    @property
    def chunk_len(self) -> int:
        """Rows of a rank's chunk without sequence parallelism (:meth:`chunk`), the same on every rank."""
        return -(-self.num_local_tokens // self.group_size)

    def owned_rows(self, rows: torch.Tensor, fill=0) -> torch.Tensor:
        """``rows (B * S_r, ...)`` of this rank's tokens -> the ``(num_segments * segment_len, ...)`` rows it
        dispatches in an all-to-all (:meth:`chunk`), padded with ``fill``. With a tensor ``group_rank`` the chunk is
        selected on the device: every rank runs the same ops."""
        if self.sequence_parallel:
            return rows
        chunk_len = self.segment_len
        if isinstance(self.group_rank, torch.Tensor):
            padded = F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, chunk_len * self.group_size - rows.shape[0]),
                           value=fill)
            chunks = padded.view(self.group_size, chunk_len, *rows.shape[1:])
            return chunks.index_select(0, self.group_rank.reshape(1)).squeeze(0)
        start, stop, _ = self.chunk()
        pad = chunk_len - (stop - start)
        rows = rows[start:stop]
        return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, pad), value=fill) if pad else rows

    @property
    def num_segments(self) -> int:
        """Runs of consecutive token ids a rank owns for an all-to-all dispatch: one per batch row of a sequence
        shard, one chunk without sequence parallelism."""
        return self.batch if self.sequence_parallel else 1

    @property
    def segment_len(self) -> int:
        return self.local_seq_len if self.sequence_parallel else self.chunk_len

    def segment_starts(self, rank: int) -> list[int]:
        """Token id at which each segment of block rank ``rank`` starts (a segment may be empty near the end)."""
        d, j = divmod(rank, self.group_size)
        base = d * self.tokens_per_group
        if self.sequence_parallel:
            return [base + b * self.seq_len + j * self.local_seq_len for b in range(self.batch)]
        return [base + min(j * self.segment_len, self.tokens_per_group)]
