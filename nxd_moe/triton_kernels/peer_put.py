"""One kernel that writes a rank's static all-to-all send buffer straight into every peer's receive buffer over
NVLink (the buffers are torch symmetric memory: every rank maps every peer's allocation; see
:mod:`nxd_moe.parallel.nvlink`).

``send (M * n, row)`` viewed as int32 words: rows ``[p * n, (p + 1) * n)`` go to rank ``p``, at rows
``[me * n, (me + 1) * n)`` of its buffer -- the layout of ``all_to_all_single`` with equal splits. One program per
``(block of words, destination)``: plain loads from local HBM, stores through the peer's address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _put_kernel(src_ptr, peer_ptrs, me, words_per_destination, BLOCK: tl.constexpr):
    destination = tl.program_id(1)
    peer = tl.load(peer_ptrs + destination).to(tl.pointer_type(tl.int32))
    words = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = words < words_per_destination
    values = tl.load(src_ptr + destination * words_per_destination + words, mask=inside)
    tl.store(peer + me * words_per_destination + words, values, mask=inside)


def put_to_peers(send_words: torch.Tensor, peer_ptrs: torch.Tensor, me: int) -> None:
    """``send_words (M * n * row_words,)`` int32, contiguous; ``peer_ptrs (M,)`` int64 addresses of every rank's
    receive buffer (this rank's own included); ``me`` this rank's index among them."""
    num_ranks = peer_ptrs.numel()
    per_destination = send_words.numel() // num_ranks
    grid = (triton.cdiv(per_destination, _BLOCK), num_ranks)
    _put_kernel[grid](send_words, peer_ptrs, me, per_destination, BLOCK=_BLOCK)
