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
    # Scattered into (T, E_l + 1): the pairs not computed here land in the extra column, dropped after. A token's
    # local slots are distinct (its experts are), so each kept entry is written once: no sum, no write order.
    column = torch.where(slot >= 0, slot, num_local)
    rows = (pair_expert.shape[0], num_local + 1)
    mask = torch.zeros(rows, dtype=torch.bool, device=slot.device).scatter(1, column, True)[:, :num_local]
    affinities = torch.zeros(rows, dtype=pair_weight.dtype, device=slot.device).scatter(
        1, column, pair_weight)[:, :num_local]
    # Distinct keys: chosen experts rank above fillers, lower ids first within each kind.
    key = mask.to(torch.int64) * num_local + (num_local - 1 - torch.arange(num_local, device=mask.device))
    expert_index = key.topk(min(pair_expert.shape[1], num_local), dim=1).indices
    return Routing(expert_index, mask, affinities, prescale, has_padding=True)
