"""Expert-parallel dispatch by all-to-all-v: each token goes only to the ranks that compute one of its experts.

Steps, over the MoE model-parallel block:

1. **Ownership.** With sequence parallelism a rank dispatches its own shard; otherwise the ranks of a token
   group split the group's (shared) tokens into equal chunks, so every token is dispatched once.
2. **Positions.** Ranks all-gather their per-expert pair counts (per run of consecutive token ids), which gives
   every pair its position among its expert's pairs in the block's token order: the input of the replica split
   (EPLB) and of capacity-factor dropping, identical to what one device or the all-gather dispatch computes.
3. **Counts exchange**, then the **dispatch**: a token is sent once to each rank of every EP rank that computes
   one of its pairs (all TP ranks of that EP rank: each computes its slice of the intermediate dimension), with
   its top-k expert ids (``-1`` for pairs the destination does not compute), weights and token id, packed in
   one row.
4. The destination computes its pairs on the received tokens in token order, and the **combine** sends each
   token's partial output back; the owner sums them (in at least fp32). Without sequence parallelism the token
   group then all-gathers its chunks.

Bytes moved scale with the tokens each rank needs, not with all tokens: fewer than the all-gather dispatch
whenever a token's k experts do not cover every EP rank (E > k). Sizes depend on the routing, so this dispatch
syncs with the host once per forward (the counts), like every all-to-all-v on ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nxd_moe.experts.routing_inputs import expert_mask
from nxd_moe.parallel.collectives import CommLedger, all_gather, all_to_all_v, exchange_counts
from nxd_moe.parallel.dispatch import DispatchInputs, DispatchResult
from nxd_moe.parallel.layout import MoEGroups
from nxd_moe.parallel.payload import pack, unpack
from nxd_moe.parallel.placement import assign_pairs
from nxd_moe.parallel.token_layout import TokenLayout


def _block_positions(experts: torch.Tensor, layout: TokenLayout, groups: MoEGroups, num_experts: int,
                     ledger: CommLedger) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, k)`` position of each owned pair among its expert's pairs in the block's token order, and ``(E,)``
    pairs per expert in the block. Owned rows are ``num_segments`` runs of ``segment_len`` consecutive ids."""
    hits = expert_mask(experts, num_experts).to(torch.int64).view(layout.num_segments, layout.segment_len, -1)
    counts = all_gather(hits.sum(dim=1), groups.block_group, ledger, "expert_counts")  # (M, segments, E)
    starts = torch.tensor([layout.segment_starts(r) for r in range(groups.block_size)], device=experts.device)
    # A segment's pairs come after those of every segment that starts before it (segments never overlap).
    before = starts.reshape(1, -1) < starts[groups.block_rank].reshape(-1, 1)  # (segments, M * segments)
    offsets = torch.where(before.unsqueeze(-1), counts.reshape(1, -1, num_experts), 0).sum(dim=1)
    earlier = torch.cumsum(hits, dim=1) - hits + offsets.unsqueeze(1)
    position = earlier.reshape(-1, num_experts).gather(1, experts.clamp(min=0))
    return torch.where(experts >= 0, position, 0), counts.sum(dim=(0, 1))


def all_to_all_dispatch(inputs: DispatchInputs) -> DispatchResult:
    """See :mod:`nxd_moe.parallel.dispatch` for the contract."""
    hidden, pair_expert, pair_weight, layout, groups, shard, capacity, compute, ledger = inputs
    num_experts = shard.placement.num_experts
    block, me = groups.block_group, groups.block_rank
    start, stop, _ = layout.chunk()
    pad = layout.num_segments * layout.segment_len - (stop - start)
    rows = F.pad(hidden[start:stop], (0, 0, 0, pad))
    experts = F.pad(pair_expert[start:stop].long(), (0, 0, 0, pad), value=-1)
    weights = F.pad(pair_weight[start:stop], (0, 0, 0, pad))
    token_ids = F.pad(layout.token_ids(device=hidden.device)[start:stop], (0, pad), value=-1)

    position, pairs_per_expert = _block_positions(experts, layout, groups, num_experts, ledger)
    owner = assign_pairs(shard.placement, experts, position, pairs_per_expert, capacity)
    ep_ranks = torch.arange(shard.expert_parallel_size, device=owner.device)
    hit = (owner.unsqueeze(-1) == ep_ranks).any(dim=1)  # (U, EP): the token has a pair on that EP rank
    ep_rank_and_row = hit.t().nonzero()  # sorted by EP rank, then row: one host sync for all destinations
    per_ep_rank = ep_rank_and_row[:, 1].split(hit.sum(dim=0).tolist())
    # Block rank r is EP rank r // TP: every TP rank of an EP rank gets the same tokens.
    send_index = [per_ep_rank[r // shard.tensor_parallel_size] for r in range(groups.block_size)]
    send_counts = [int(index.numel()) for index in send_index]
    index = torch.cat(send_index)
    destination = torch.cat([torch.full_like(i, r // shard.tensor_parallel_size) for r, i in enumerate(send_index)])
    # Each copy carries only the pairs its destination computes.
    sent_experts = torch.where(owner[index] == destination.unsqueeze(1), experts[index], -1)
    payload, specs = pack([rows[index], sent_experts.to(torch.int32), weights[index], token_ids[index]])
    recv_counts = exchange_counts(torch.tensor(send_counts, device=hidden.device), block, me, ledger, "send_counts")
    received = all_to_all_v(payload, send_counts, recv_counts, block, me, ledger, "dispatch")
    recv_rows, recv_experts, recv_weights, recv_ids = unpack(received, specs)

    if recv_rows.shape[0]:
        # Token order, as on one device: capacity and block layouts then match it exactly.
        order = torch.argsort(recv_ids, stable=True)
        computed = compute(recv_rows[order], recv_experts[order].long(), recv_weights[order])
        partial = torch.empty_like(computed).index_copy_(0, order, computed)
    else:
        partial = recv_rows.new_zeros((0, hidden.shape[-1]))
    returned = all_to_all_v(partial, recv_counts, send_counts, block, me, ledger, "combine")

    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.zeros(rows.shape, dtype=acc_dtype, device=hidden.device)
    offset = 0
    for sent_rows, count in zip(send_index, send_counts):
        # One index_add per destination, each over distinct rows: deterministic on every device.
        out.index_add_(0, sent_rows, returned[offset:offset + count].to(acc_dtype))
        offset += count
    out = out.to(hidden.dtype)
    if layout.sequence_parallel:
        return DispatchResult(out, pairs_per_expert)
    chunks = all_gather(out, groups.token_group, ledger, "gather_outputs")
    return DispatchResult(chunks.reshape(-1, out.shape[-1])[: layout.num_local_tokens], pairs_per_expert)
