"""How tokens are mapped to blocks for the dropless blockwise matmul.

Every block holds ``block_size`` slots for one expert; an expert owns ``ceil(tokens / block_size)``
consecutive blocks, experts in order, and blocks nobody needs sit at the end (mapped to the last expert,
marked inactive in ``conditions``). Everything here has static shapes: the number of blocks is the worst
case over all routings, computed from T, k, E and the block size alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from nxd_moe.checks import check_int
from nxd_moe.moe_configs import DEFAULT_PADDING_VALUE


def num_blocks(num_tokens: int, top_k: int, num_experts: int, block_size: int, pad_to_even: bool = False) -> int:
    """NxD's worst-case block count ``N = min(ceil((T*k - (E-1)) / B) + (E-1), T*k)``.

    Worst case: E-1 experts get one token each (one block each) and the rest go to a single expert.
    ``pad_to_even`` rounds N up to even (the LNC2 shard-on-block kernels split blocks between two cores).
    """
    check_int("num_tokens", num_tokens, minimum=1)
    check_int("top_k", top_k, minimum=1)
    check_int("num_experts", num_experts, minimum=1)
    check_int("block_size", block_size, minimum=1)
    assignments = num_tokens * top_k
    n = -(-(assignments - (num_experts - 1)) // block_size) + (num_experts - 1)
    n = min(n, assignments)
    if pad_to_even:
        n += n % 2
    return n


def num_static_blocks(num_tokens: int, top_k: int, block_size: int, expert_parallel_size: int = 1) -> int:
    """Blocks a dynamic-while kernel always computes: ``ceil(ceil(T*k / EP) / B)`` (NxD's default)."""
    per_rank = -(-num_tokens * top_k // expert_parallel_size)
    return -(-per_rank // block_size)


class BlockMapping(NamedTuple):
    """The token->block layout of one forward.

    - ``block_to_expert (N,)``: expert of each block (non-decreasing; unused tail blocks -> last expert).
    - ``token_position_to_id (N*B,)``: token in each block slot, ``-1`` for padding.
    - ``conditions (N,)`` int32: 1 if the block holds at least one real token (active blocks are a prefix).
    - ``token_slot (T, k)``: the slot of each (token, chosen expert) pair; ``N*B`` for a padded token.
    - ``tokens_per_expert (E,)``: real tokens routed to each expert.
    - ``tiles``: a backend's own tiling of the same assignment, computed alongside (the Triton backend's
      :class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout`), or None.
    """

    block_to_expert: torch.Tensor
    token_position_to_id: torch.Tensor
    conditions: torch.Tensor
    token_slot: torch.Tensor
    tokens_per_expert: torch.Tensor
    block_size: int
    tiles: Any = None

    @property
    def num_blocks(self) -> int:
        return self.block_to_expert.shape[0]


def token_to_block_mapping(
    expert_mask: torch.Tensor,
    expert_index: torch.Tensor,
    block_size: int,
    num_blocks: int,
    optimized: bool = True,
) -> BlockMapping:
    """Map each (token, expert) assignment of ``expert_mask (T, E)`` to a slot of a block.

    A token's slot inside its expert's run of blocks is its rank among that expert's tokens (token order),
    so the layout is deterministic. ``optimized`` scatters only the ``T*k`` chosen pairs instead of all
    ``T*E`` (mask, expert) entries; both give the same mapping.

    Example (B=2, N=4; tokens 0,2,4 -> E0, 1,5 -> E1, 3 -> E2): ``block_to_expert = [0, 0, 1, 2]``,
    ``token_position_to_id = [0, 2, 4, -1, 1, 5, 3, -1]``.
    """
    num_tokens, num_experts = expert_mask.shape
    device = expert_mask.device
    mask = expert_mask.to(torch.int64)
    tokens_per_expert = mask.sum(dim=0)
    blocks_per_expert = (tokens_per_expert + block_size - 1) // block_size
    block_end = torch.cumsum(blocks_per_expert, dim=0)
    block_start = block_end - blocks_per_expert
    block_ids = torch.arange(num_blocks, device=device)
    # Count the experts whose blocks end at or before b: tail blocks count E-1 and land on the last expert.
    # A (N, E-1) comparison rather than searchsorted, which torch_xla runs on the host (a CPU fallback).
    block_to_expert = (block_end[:-1].unsqueeze(0) <= block_ids.unsqueeze(1)).sum(dim=1)

    rank_in_expert = torch.cumsum(mask, dim=0) - 1
    slot = block_start * block_size + rank_in_expert  # (T, E), meaningful where mask
    num_slots = num_blocks * block_size
    token_ids = torch.arange(num_tokens, device=device)
    pair_valid = expert_mask.gather(1, expert_index)
    pair_slot = slot.gather(1, expert_index)
    if optimized:
        valid, targets, ids = pair_valid, pair_slot, token_ids.unsqueeze(1).expand_as(expert_index)
    else:
        valid, targets, ids = expert_mask, slot, token_ids.unsqueeze(1).expand_as(slot)
    # Slot 0 of the scratch table absorbs every masked-out entry and is dropped afterwards.
    scatter_at = torch.where(valid, targets + 1, torch.zeros_like(targets)).reshape(-1)
    table = torch.full((num_slots + 1,), DEFAULT_PADDING_VALUE, dtype=torch.int64, device=device)
    table = table.scatter(0, scatter_at, ids.reshape(-1))
    token_position_to_id = table[1:]
    conditions = block_conditions(token_position_to_id, block_size)
    token_slot = torch.where(pair_valid, pair_slot, torch.full_like(pair_slot, num_slots))
    return BlockMapping(block_to_expert, token_position_to_id, conditions, token_slot, tokens_per_expert, block_size)


def block_conditions(token_position_to_id: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(N*B,) -> (N,)`` int32: 1 where the block holds any real token (what a dynamic loop reads)."""
    return (token_position_to_id.view(-1, block_size) != DEFAULT_PADDING_VALUE).any(dim=1).to(torch.int32)
