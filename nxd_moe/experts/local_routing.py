"""The routing of a rank's own (token, expert) pairs, over its local experts, in the form every backend takes.

The expert backends consume a :class:`~nxd_moe.experts.routing_inputs.Routing` over ``E`` experts with ``k``
distinct experts per token. On an expert-parallel rank the experts are its ``E_l`` local ones and a token keeps
only the pairs this rank computes, so the backends run unchanged on local weights:

- ``expert_mask (T, E_l)``: the token's pairs this rank computes;
- ``affinities (T, E_l)``: their combine weights (already normalised over all k on the sending side);
- ``expert_index (T, k')`` with ``k' = min(k, E_l)``: the token's local experts first (ascending local id),
  then distinct unchosen local experts as fillers. A filler is off the mask, so every algorithm skips it.
"""

from __future__ import annotations

import torch

from nxd_moe.experts.routing_inputs import Routing


def local_routing(pair_expert: torch.Tensor, pair_weight: torch.Tensor, local_slot: torch.Tensor,
                  num_local: int, prescale: bool) -> Routing:
    """``pair_expert (T, k)`` global expert of each pair this rank computes (``-1`` for the others),
    ``pair_weight (T, k)``, ``local_slot (E,)`` local index (``< num_local``) of each global expert held here,
    ``-1`` for the others."""
    mine = pair_expert >= 0
    slot = torch.where(mine, local_slot[pair_expert.clamp(min=0).long()], torch.full_like(pair_expert, -1).long())
    hits = slot.unsqueeze(-1) == torch.arange(num_local, device=slot.device)  # (T, k, E_l)
    mask = hits.any(dim=1)
    zero = torch.zeros((), dtype=pair_weight.dtype, device=pair_weight.device)
    affinities = torch.where(hits, pair_weight.unsqueeze(-1), zero).sum(dim=1)
    # Distinct keys: chosen experts rank above fillers, lower ids first within each kind.
    key = mask.to(torch.int64) * num_local + (num_local - 1 - torch.arange(num_local, device=mask.device))
    expert_index = key.topk(min(pair_expert.shape[1], num_local), dim=1).indices
    return Routing(expert_index, mask, affinities, prescale, has_padding=True)
