"""Expert-parallel dispatch by all-to-all: each token goes only to the ranks that compute one of its experts.

Steps, over the MoE model-parallel block (``M = TP * EP`` ranks):

1. **Ownership.** With sequence parallelism a rank dispatches its own shard; otherwise the ranks of a token
   group split the group's (shared) tokens into equal chunks, so every token is dispatched once.
2. **Positions** (only with replicated experts, a capacity, or statistics asked for). Ranks all-gather their
   per-expert pair counts (per run of consecutive token ids), which gives every pair its position among its
   expert's pairs in the block's token order: the input of the replica split (EPLB) and of capacity-factor
   dropping, identical to what one device or the all-gather dispatch computes. A pair beyond the capacity is
   assigned to no rank, so it is never sent. Otherwise a pair's rank is a table lookup.
3. **Dispatch.** A token is sent once to each rank of every EP rank that computes one of its pairs (all TP ranks
   of that EP rank: each computes its slice of the intermediate dimension), with its top-k expert ids (``-1`` for
   pairs the destination does not compute) and weights, packed in one row. Two ways
   (``ExpertParallelConfig.all_to_all_splits``):

   - ``static``: every destination gets a buffer of ``U`` rows (``U``: the tokens this rank owns), the rows
     it needs first and padding rows (no pair) after; the layout is computed on the device and the exchange has
     equal splits, so nothing is read on the host and a CUDA graph captures the step. A token goes to a rank at
     most once, so ``U`` rows always suffice: no token is ever dropped, whatever the routing.
   - ``exact``: the ranks first exchange how many rows they send each other (read on the host: one sync per
     forward), then send only those rows, in token order.
4. The destination computes its pairs on the rows it received (the caller, between ``dispatch`` and
   ``combine``), and the **combine** sends each row's partial
   output back to where it came from; the owner sums a token's partials (in at least fp32, destinations in rank
   order: deterministic). Without sequence parallelism the token group then all-gathers its chunks.

Padding rows cost the static exchange bytes on the wire, but no compute in a backend that skips rows without
pairs (the triton backend counts pairs on the device).

The static exchange may run in micro-batches of the owned rows (:class:`StaticMicroBatches`: each part's exchange
beside another part's experts) and over NCCL or straight into the peers' buffers
(``DispatchInputs.transport``, :mod:`nxd_moe.parallel.nvlink`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from nxd_moe.experts.routing_inputs import expert_mask
from nxd_moe.parallel.collectives import (
    CommLedger,
    all_gather,
    all_to_all,
    all_to_all_v,
    exchange_counts,
    start_all_to_all,
)
from nxd_moe.parallel.dispatch import Dispatched, DispatchInputs, DispatchResult
from nxd_moe.parallel.layout import MoEGroups
from nxd_moe.parallel.nvlink import start_nvlink_all_to_all
from nxd_moe.parallel.payload import FieldSpec, exchange_rows, pack, packs_bytes, unpack
from nxd_moe.parallel.placement import assign_pairs, needs_positions
from nxd_moe.parallel.token_layout import TokenLayout


class OwnedPairs(NamedTuple):
    """The ``U`` rows this rank dispatches (its chunk or shard, padded to the same ``U`` on every rank):
    ``rows (U, H)``, ``experts (U, k)`` global ids (``-1``: no pair), ``weights (U, k)``, ``token_ids (U,)``
    (``-1`` for padding; only the exact exchange needs them), ``owner (U, k)`` EP rank computing each pair (``-1``:
    none), ``pairs_per_expert (E,)`` in the whole block (None when nothing needed the counts)."""

    rows: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    token_ids: torch.Tensor | None
    owner: torch.Tensor
    pairs_per_expert: torch.Tensor | None


@functools.lru_cache(maxsize=64)
def _cached_segment_starts(layout: TokenLayout, block_size: int, device: str) -> torch.Tensor:
    return torch.tensor([layout.segment_starts(r) for r in range(block_size)], device=device)


def _segment_starts(layout: TokenLayout, block_size: int, device: str) -> torch.Tensor:
    """``(M, segments)`` first token id of every segment of every block rank (cached per device: a captured CUDA
    graph must not copy from the host). The same for every rank of the block: keyed without this rank's place."""
    return _cached_segment_starts(layout.without_rank(), block_size, device)


def _block_positions(experts: torch.Tensor, layout: TokenLayout, groups: MoEGroups, num_experts: int,
                     ledger: CommLedger) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, k)`` position of each owned pair among its expert's pairs in the block's token order, and ``(E,)``
    pairs per expert in the block. Owned rows are ``num_segments`` runs of ``segment_len`` consecutive ids."""
    hits = expert_mask(experts, num_experts).to(torch.int64).view(layout.num_segments, layout.segment_len, -1)
    counts = all_gather(hits.sum(dim=1), groups.block_group, ledger, "expert_counts")  # (M, segments, E)
    starts = _segment_starts(layout, groups.block_size, str(experts.device))
    rank = groups.block_rank
    # An SPMD rank is a 0-d tensor: indexing with it would read it on the host, a row gather does not.
    mine = starts[rank] if isinstance(rank, int) else starts.index_select(0, rank.reshape(1)).squeeze(0)
    # A segment's pairs come after those of every segment that starts before it (segments never overlap).
    before = starts.reshape(1, -1) < mine.reshape(-1, 1)  # (segments, M * segments)
    offsets = torch.where(before.unsqueeze(-1), counts.reshape(1, -1, num_experts), 0).sum(dim=1)
    earlier = torch.cumsum(hits, dim=1) - hits + offsets.unsqueeze(1)
    position = earlier.reshape(-1, num_experts).gather(1, experts.clamp(min=0))
    return torch.where(experts >= 0, position, 0), counts.sum(dim=(0, 1))


def owned_pairs(inputs: DispatchInputs) -> OwnedPairs:
    """Steps 1 and 2 of the module docstring."""
    layout, shard = inputs.layout, inputs.shard
    owned = layout.owned_rows
    pair_expert, pair_weight = inputs.pairs()
    rows = owned(inputs.hidden)
    experts = owned(pair_expert.long(), -1)
    weights = owned(pair_weight)
    token_ids = owned(layout.token_ids(device=rows.device), -1) if inputs.all_to_all_splits == "exact" else None
    position = pairs_per_expert = None
    if inputs.count_pairs or needs_positions(shard.placement, inputs.capacity):
        position, pairs_per_expert = _block_positions(experts, layout, inputs.groups, shard.placement.num_experts,
                                                      inputs.ledger)
    owner = assign_pairs(shard.placement, experts, position, pairs_per_expert, inputs.capacity)
    return OwnedPairs(rows, experts, weights, token_ids, owner, pairs_per_expert)


class _ExchangeTables(NamedTuple):
    """What the static exchange's bookkeeping needs that depends on its sizes only (``U`` rows, ``M`` destinations,
    ``TP``): ``rank_ep (1, M, 1)`` EP rank of each destination, ``buffer_start (1, M)`` first slot of each
    destination's buffer, ``row_of_entry (U * M,)`` the row of each ``(row, destination)`` entry, ``no_rows (M * U
    + 1,)`` all ``-1`` (the empty slot table plus a dump slot), ``slot_ep (M * U, 1)`` EP rank of each slot."""

    rank_ep: torch.Tensor
    buffer_start: torch.Tensor
    row_of_entry: torch.Tensor
    no_rows: torch.Tensor
    slot_ep: torch.Tensor


@functools.lru_cache(maxsize=64)
def _exchange_tables(num_rows: int, num_ranks: int, tensor_parallel: int, device: str) -> _ExchangeTables:
    """Made once per sizes and device, not on every call (an eager step's host time; a captured CUDA graph must not
    copy from the host either)."""
    rank_ep = torch.arange(num_ranks, device=device) // tensor_parallel
    return _ExchangeTables(rank_ep.view(1, num_ranks, 1),
                           (torch.arange(num_ranks, device=device) * num_rows).view(1, num_ranks),
                           torch.arange(num_rows, device=device).repeat_interleave(num_ranks),
                           torch.full((num_ranks * num_rows + 1,), -1, dtype=torch.int64, device=device),
                           rank_ep.repeat_interleave(num_rows).unsqueeze(1))


def destination_slots(owner: torch.Tensor, num_ranks: int, tensor_parallel: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``owner (U, k)`` EP rank of each pair (``-1``: none) -> ``slot (U, M)`` (the row's place in destination
    ``r``'s buffer, ``-1`` if it does not go there) and ``source_row (M * U,)`` (the row in each buffer slot,
    ``-1`` for padding). Block rank ``r`` is EP rank ``r // TP``: every TP rank of an EP rank gets the same rows."""
    num_rows = owner.shape[0]
    tables = _exchange_tables(num_rows, num_ranks, tensor_parallel, str(owner.device))
    sends = (owner.unsqueeze(1) == tables.rank_ep).any(dim=2)  # (U, M)
    counted = sends.to(torch.int64)  # torch_xla's cumsum keeps a bool input's dtype
    place = torch.cumsum(counted, dim=0) - counted
    at = torch.where(sends, tables.buffer_start + place, num_ranks * num_rows)
    # Only the dump slot M * U is written twice.
    source_row = tables.no_rows.scatter(0, at.reshape(-1), tables.row_of_entry)[:-1]
    return torch.where(sends, place, -1), source_row


def destination_fields(rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor,
                       source_row: torch.Tensor, tensor_parallel: int) -> list[torch.Tensor]:
    """The send buffer's fields, ``(M * U, ...)`` each: slot ``s`` holds row ``source_row[s]``, the int32 ids of the
    pairs its destination computes (``-1`` elsewhere) and the pair weights; padding slots are zeros with ids
    ``-1``."""
    num_rows = rows.shape[0]
    slot_ep = _exchange_tables(num_rows, source_row.numel() // num_rows, tensor_parallel, str(rows.device)).slot_ep
    at = torch.where(source_row >= 0, source_row, num_rows)
    sent = torch.where(F.pad(owner, (0, 0, 0, 1), value=-1)[at] == slot_ep, F.pad(experts, (0, 0, 0, 1))[at], -1)
    return [F.pad(rows, (0, 0, 0, 1))[at], sent.to(torch.int32), F.pad(weights, (0, 0, 0, 1))[at]]


def pack_for_destinations(rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor,
                          source_row: torch.Tensor, tensor_parallel: int) -> torch.Tensor:
    """The :func:`destination_fields` packed into the ``(M * U, row_bytes)`` send buffer."""
    return pack(destination_fields(rows, experts, weights, owner, source_row, tensor_parallel))[0]


def combine_from_destinations(returned: torch.Tensor, slot: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``returned (M * U, H)`` partial outputs in the buffers' order -> ``(U, H)``: each row's partials from the
    destinations it went to, summed in rank order in at least fp32."""
    num_rows, num_ranks = slot.shape
    acc_dtype = torch.promote_types(returned.dtype, torch.float32)
    tables = _exchange_tables(num_rows, num_ranks, 1, str(returned.device))
    sent = slot >= 0
    # Every (row, destination) partial in one gather; rows that did not go to a destination read its slot 0 and
    # are zeroed, so the sum below is over the destinations each row went to.
    partials = returned.index_select(0, (tables.buffer_start + slot.clamp(min=0)).reshape(-1)).view(
        num_rows, num_ranks, -1)
    zero = torch.zeros((), dtype=acc_dtype, device=returned.device)
    partials = torch.where(sent.unsqueeze(-1), partials.to(acc_dtype), zero)
    out = torch.zeros(num_rows, returned.shape[1], dtype=acc_dtype, device=returned.device)
    for r in range(num_ranks):  # in rank order, one add at a time: the same sums as the GPU kernel's
        out += partials[:, r]
    return out.to(out_dtype)


TORCH_KERNELS = SimpleNamespace(destination_slots=destination_slots, pack_for_destinations=pack_for_destinations,
                                combine_from_destinations=combine_from_destinations)


def _kernels(rows: torch.Tensor, weights: torch.Tensor):
    """The three functions above as Triton kernels where they apply (CUDA, Triton installed, 4-byte aligned rows,
    fp32 weights: three launches instead of dozens), else as torch ops."""
    if not rows.is_cuda or (rows.shape[1] * rows.element_size()) % 4 or weights.dtype != torch.float32:
        return TORCH_KERNELS
    try:
        from nxd_moe.triton_kernels import dispatch
    except ImportError:
        return TORCH_KERNELS
    return dispatch


class _StaticHandle(NamedTuple):
    owned: OwnedPairs
    inputs: DispatchInputs
    slot: torch.Tensor
    kernels: Any


class _ExactHandle(NamedTuple):
    owned: OwnedPairs
    inputs: DispatchInputs
    order: torch.Tensor
    send_index: list[torch.Tensor]
    send_counts: list[int]
    recv_counts: list[int]


def _exchange_of(inputs: DispatchInputs) -> Callable:
    """The static exchange's collective for ``inputs.transport``: NCCL's all-to-all, or straight over NVLink."""
    return start_nvlink_all_to_all if inputs.transport == "nvlink" else start_all_to_all


def _start_static_dispatch(owned: OwnedPairs, inputs: DispatchInputs, rows: slice) -> Callable[[], Dispatched]:
    """Step 3, ``static``, for the owned rows ``rows``: ``U`` rows (those of the slice) to every destination, the
    rows it needs first. Packs and starts the exchange; the returned call waits for it and hands over what came."""
    groups, tp = inputs.groups, inputs.shard.tensor_parallel_size
    if rows != slice(None):
        owned = owned._replace(rows=owned.rows[rows], experts=owned.experts[rows], weights=owned.weights[rows],
                               owner=owned.owner[rows])
    rows_, experts, weights, owner = owned.rows, owned.experts, owned.weights, owned.owner
    kernels = _kernels(rows_, weights)
    slot, source_row = kernels.destination_slots(owner, groups.block_size, tp)
    handle = _StaticHandle(owned, inputs, slot, kernels)

    def dispatched(recv_rows: torch.Tensor, recv_experts: torch.Tensor, recv_weights: torch.Tensor) -> Dispatched:
        return Dispatched(recv_rows, recv_experts.long(), recv_weights, handle)

    if kernels is TORCH_KERNELS:
        fields = destination_fields(rows_, experts, weights, owner, source_row, tp)
        if not packs_bytes(rows_.device):  # XLA: a collective per field, in the program (payload's docstring)
            got = exchange_rows(fields, lambda f: all_to_all(f, groups.block_group, inputs.ledger, "dispatch"))
            return lambda: dispatched(*got)
        payload, specs = pack(fields)
    else:  # the buffer packed by one kernel
        payload = kernels.pack_for_destinations(rows_, experts, weights, owner, source_row, tp)
        specs = (FieldSpec((rows_.shape[1],), rows_.dtype), FieldSpec((experts.shape[1],), torch.int32),
                 FieldSpec((weights.shape[1],), weights.dtype))
    pending = _exchange_of(inputs)(payload, groups.block_group, inputs.ledger, "dispatch")
    return lambda: dispatched(*unpack(pending.wait(), specs))


def _start_static_combine(partial: torch.Tensor, handle: _StaticHandle) -> Callable[[], torch.Tensor]:
    """Starts sending the partial outputs back to their rows; the returned call waits and sums them: ``(U, H)`` in
    the model dtype."""
    pending = _exchange_of(handle.inputs)(partial, handle.inputs.groups.block_group, handle.inputs.ledger,
                                          "combine")
    return lambda: handle.kernels.combine_from_destinations(pending.wait(), handle.slot, handle.owned.rows.dtype)


def _exact_dispatch(owned: OwnedPairs, inputs: DispatchInputs) -> Dispatched:
    """Step 3, ``exact``: counts exchanged first (one host sync), then only the rows each destination needs, handed
    to the experts in token order (block layouts then match one device's exactly)."""
    if owned.rows.is_cuda and torch.cuda.is_current_stream_capturing():
        # Refuse before the host read: a capture that CUDA invalidates leaves torch's CUDA generator in capture
        # state, and every later random op on the device then fails.
        raise RuntimeError("all_to_all_splits='exact' reads the split sizes on the host and cannot be captured "
                           "in a CUDA graph; use ExpertParallelConfig(all_to_all_splits='static')")
    groups, shard, ledger = inputs.groups, inputs.shard, inputs.ledger
    rows, experts, owner = owned.rows, owned.experts, owned.owner
    block, me = groups.block_group, groups.block_rank
    ep_ranks = torch.arange(shard.expert_parallel_size, device=owner.device)
    hit = (owner.unsqueeze(-1) == ep_ranks).any(dim=1)  # (U, EP): the token has a pair on that EP rank
    ep_rank_and_row = hit.t().nonzero()  # sorted by EP rank, then row: one host sync for all destinations
    per_ep_rank = ep_rank_and_row[:, 1].split(hit.sum(dim=0).tolist())
    send_index = [per_ep_rank[r // shard.tensor_parallel_size] for r in range(groups.block_size)]
    send_counts = [int(index.numel()) for index in send_index]
    index = torch.cat(send_index)
    destination = torch.cat([torch.full_like(i, r // shard.tensor_parallel_size) for r, i in enumerate(send_index)])
    sent_experts = torch.where(owner[index] == destination.unsqueeze(1), experts[index], -1)
    payload, specs = pack([rows[index], sent_experts.to(torch.int32), owned.weights[index],
                           owned.token_ids[index]])
    recv_counts = exchange_counts(torch.tensor(send_counts, device=rows.device), block, me, ledger, "send_counts")
    received = all_to_all_v(payload, send_counts, recv_counts, block, me, ledger, "dispatch")
    recv_rows, recv_experts, recv_weights, recv_ids = unpack(received, specs)
    order = torch.argsort(recv_ids, stable=True)
    return Dispatched(recv_rows[order], recv_experts[order].long(), recv_weights[order],
                      _ExactHandle(owned, inputs, order, send_index, send_counts, recv_counts))


def _exact_combine(partial: torch.Tensor, handle: _ExactHandle) -> torch.Tensor:
    """Each received row's partial output back to its sender (in the order received), summed there in at least
    fp32, one destination at a time."""
    rows, inputs = handle.owned.rows, handle.inputs
    groups = inputs.groups
    partial = torch.empty_like(partial).index_copy_(0, handle.order, partial)
    returned = all_to_all_v(partial, handle.recv_counts, handle.send_counts, groups.block_group, groups.block_rank,
                            inputs.ledger, "combine")
    acc_dtype = torch.promote_types(rows.dtype, torch.float32)
    out = torch.zeros(rows.shape, dtype=acc_dtype, device=rows.device)
    offset = 0
    for sent_rows, count in zip(handle.send_index, handle.send_counts):
        # One index_add per destination, each over distinct rows: deterministic on every device.
        out.index_add_(0, sent_rows, returned[offset:offset + count].to(acc_dtype))
        offset += count
    return out.to(rows.dtype)


class StaticMicroBatches:
    """One static dispatch split into micro-batches of the owned rows (:meth:`AllToAllDispatcher.micro_batches`),
    driven by the pipeline: :meth:`received` ``(i)`` starts micro-batch ``i + 1``'s exchange before it waits for
    ``i``'s, and :meth:`start_combine` sends ``i``'s partial output back without waiting, so that on NCCL (one stream
    per communicator) the dispatch of ``i + 1`` and the combine of ``i - 1`` run under the experts of ``i``.
    :meth:`result` waits for every combine. The pairs' owners were assigned once, over all the owned rows: the same
    ranks compute the same pairs as in one batch."""

    def __init__(self, owned: OwnedPairs, inputs: DispatchInputs, count: int):
        num_rows = owned.rows.shape[0]
        size = -(-num_rows // min(count, num_rows))  # the same on every rank: U is
        self._owned, self._inputs = owned, inputs
        self._slices = [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]
        self._received: list[Callable[[], Dispatched] | None] = [None] * len(self._slices)
        self._combined: list[Callable[[], torch.Tensor] | None] = [None] * len(self._slices)
        self._start(0)

    def __len__(self) -> int:
        return len(self._slices)

    def _start(self, i: int) -> None:
        if i < len(self._slices) and self._received[i] is None:
            self._received[i] = _start_static_dispatch(self._owned, self._inputs, self._slices[i])

    def received(self, i: int) -> Dispatched:
        """Micro-batch ``i``'s rows, as :meth:`AllToAllDispatcher.dispatch` returns them."""
        self._start(i + 1)
        return self._received[i]()

    def start_combine(self, i: int, partial: torch.Tensor, handle: _StaticHandle) -> None:
        self._combined[i] = _start_static_combine(partial, handle)

    def result(self) -> DispatchResult:
        missing = [i for i, combined in enumerate(self._combined) if combined is None]
        if missing:
            raise RuntimeError(f"StaticMicroBatches.result: micro-batches {missing} were never combined")
        out = torch.cat([combined() for combined in self._combined])
        return _finish(out, self._inputs, self._owned)


def _finish(out: torch.Tensor, inputs: DispatchInputs, owned: OwnedPairs) -> DispatchResult:
    """The owned rows' outputs ``(U, H)`` -> this rank's tokens: without sequence parallelism the token group
    all-gathers its chunks."""
    if inputs.layout.sequence_parallel:
        return DispatchResult(out, owned.pairs_per_expert)
    chunks = all_gather(out, inputs.groups.token_group, inputs.ledger, "gather_outputs")
    return DispatchResult(chunks.reshape(-1, out.shape[-1])[: inputs.layout.num_local_tokens], owned.pairs_per_expert)


class AllToAllDispatcher:
    """See :mod:`nxd_moe.parallel.dispatch` for the contract."""

    def dispatch(self, inputs: DispatchInputs) -> Dispatched:
        owned = owned_pairs(inputs)
        if inputs.all_to_all_splits == "static":
            return _start_static_dispatch(owned, inputs, slice(None))()
        return _exact_dispatch(owned, inputs)

    def combine(self, partial: torch.Tensor, handle: _StaticHandle | _ExactHandle) -> DispatchResult:
        if isinstance(handle, _StaticHandle):
            out = _start_static_combine(partial, handle)()
        else:
            out = _exact_combine(partial, handle)
        return _finish(out, handle.inputs, handle.owned)

    def micro_batches(self, inputs: DispatchInputs, count: int) -> StaticMicroBatches:
        """The static dispatch of ``inputs`` as ``count`` micro-batches (fewer when there are fewer owned rows)
        whose exchanges overlap the experts' compute (:class:`StaticMicroBatches`)."""
        if inputs.all_to_all_splits != "static":
            raise ValueError("micro-batches need all_to_all_splits='static' (the exact exchange reads its sizes on "
                             f"the host), got {inputs.all_to_all_splits!r}")
        return StaticMicroBatches(owned_pairs(inputs), inputs, count)
