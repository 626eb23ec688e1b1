"""The static helpers of NxD's ``ExpertMLPsV2`` blockwise path, with NxD's signatures: the token->block mapping and
the masks that split a redundant (EPLB-replicated) expert's tokens between its copies.

NxD code and NxD's unit tests call them on the class (``ExpertMLPs.get_blockwise_expert_and_token_mapping(...)``),
so the adapters (:mod:`~nxd_moe.nxd_compat.adapters`) inherit :class:`ExpertMLPsHelpers`. The mapping is nxd_moe's
own (:func:`nxd_moe.experts.token_mapping.token_to_block_mapping`, what every blockwise forward here runs). The
redundancy masks are NxD's rule for splitting a replicated expert: copy ``r`` of an expert takes a contiguous range
of *token positions* (its share of ``0 .. T-1``). nxd_moe's own expert-parallel dispatch splits a replicated expert
by the position of each pair among that expert's pairs instead (:mod:`nxd_moe.parallel.placement`), which balances
the copies' loads however the tokens are routed; these helpers compute NxD's masks for NxD code that asks for them.
"""

from __future__ import annotations

import torch

from nxd_moe.checks import check_int
from nxd_moe.experts.token_mapping import token_to_block_mapping
from nxd_moe.nxd_compat.not_served import KERNELS, NotServed

__all__ = ["ExpertMLPsHelpers"]


class ExpertMLPsHelpers:
    """NxD's ``ExpertMLPsV2`` static helpers (a mixin of the adapters)."""

    use_index_calc_kernel = NotServed("ExpertMLPsV2.use_index_calc_kernel", KERNELS)

    @staticmethod
    def get_blockwise_expert_and_token_mapping(total_tokens: int, num_blocks: int, expert_mask: torch.Tensor,
                                               expert_index: torch.Tensor, block_size: int, device,
                                               enable_spmd_rank: bool, spmd_rank, tensor_parallel_group,
                                               optimized_block_to_token_mapping: bool = True,
                                               parallelize_token_to_block_mapping: bool = False,
                                               pad_num_blocks_to_even: bool = False
                                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``expert_mask (T, E)`` (nonzero: token routed to expert), ``expert_index (T, k)`` -> ``block_to_expert
        (N,)`` int64 and ``token_position_to_id (N * block_size,)`` int64 (``-1``: padding slot), N =
        ``num_blocks``. Each expert owns ``ceil(tokens / block_size)`` consecutive blocks, experts in order, its
        tokens in token order; blocks nobody needs map to the last expert.

        NxD's other arguments choose how NxD computes the same mapping -- split across the tensor-parallel ranks
        (``parallelize_token_to_block_mapping``, ``enable_spmd_rank`` / ``spmd_rank``, ``tensor_parallel_group``),
        scattering only the chosen pairs (``optimized_block_to_token_mapping``), padding blocks given to the last
        expert (``pad_num_blocks_to_even``) -- and do not change it; it is computed whole on every rank here."""
        check_int("total_tokens", total_tokens, minimum=1)
        check_int("num_blocks", num_blocks, minimum=1)
        check_int("block_size", block_size, minimum=1)
        if expert_mask.dim() != 2 or expert_mask.shape[0] != total_tokens:
            raise ValueError(f"get_blockwise_expert_and_token_mapping: expert_mask must be (total_tokens, E) = "
                             f"({total_tokens}, E), got {tuple(expert_mask.shape)}")
        if expert_index.dim() != 2 or expert_index.shape[0] != total_tokens:
            raise ValueError(f"get_blockwise_expert_and_token_mapping: expert_index must be (total_tokens, k) = "
                             f"({total_tokens}, k), got {tuple(expert_index.shape)}")
        mapping = token_to_block_mapping(expert_mask.to(device=device, dtype=torch.bool),
                                         expert_index.to(device=device, dtype=torch.int64), block_size, num_blocks,
                                         optimized=bool(optimized_block_to_token_mapping))
        return mapping.block_to_expert, mapping.token_position_to_id

    @staticmethod
    def allocate_token_blocks(local_redudancy_degree: torch.Tensor,
                              tokens_per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``local_redudancy_degree (EP, E)`` (copies of each expert on each EP rank; NxD's spelling) and the number
        of tokens -> ``(start, end) (EP, E)`` int32: the token positions ``start .. end`` (inclusive) that rank
        ``p``'s copies of expert ``e`` serve. An expert's ``R`` copies, in rank order, take consecutive chunks of
        ``tokens // R`` positions; the last copy also takes the remainder. A rank without a copy gets an empty
        range (``end = start - 1``)."""
        check_int("tokens_per_expert", tokens_per_expert, minimum=0)
        degree = local_redudancy_degree.to(torch.int32)
        copies = degree.sum(dim=0)  # (E,), >= 1: an expert distribution places every expert
        earlier = torch.cumsum(degree, dim=0, dtype=torch.int32) - degree  # copies on lower ranks
        chunk = tokens_per_expert // copies
        remainder = tokens_per_expert % copies
        start = earlier * chunk
        holds_last = (earlier + degree == copies).to(torch.int32)
        end = (earlier + degree) * chunk - 1 + holds_last * remainder
        return start.to(torch.int32), end.to(torch.int32)

    @staticmethod
    def generate_local_expert_boolean_mask(local_expert_indices: torch.Tensor, num_experts) -> torch.Tensor:
        """``local_expert_indices (L,)`` (the expert in each local slot) -> ``(E, L)`` bool: ``[e, j]`` where slot
        ``j`` holds expert ``e``."""
        experts = torch.arange(int(num_experts), device=local_expert_indices.device).unsqueeze(1)
        return experts == local_expert_indices.reshape(1, -1)

    @staticmethod
    def generate_mask_with_no_local_redundancy(mask: torch.Tensor) -> torch.Tensor:
        """``(E, L)`` bool -> the same with only each row's first ``True`` kept: a rank that holds an expert in
        two slots computes it in the first."""
        return mask & (torch.cumsum(mask.to(torch.int32), dim=1) == 1)

    @staticmethod
    def generate_local_expert_id_no_local_redundancy(mask: torch.Tensor, device) -> torch.Tensor:
        """``(E, L)`` bool (one ``True`` per slot at most) -> ``(L,)`` int32: each slot's expert, ``-1`` for a slot
        that computes nothing."""
        experts = torch.arange(mask.shape[0], device=device, dtype=torch.int32).unsqueeze(1)
        return torch.where(mask.to(device), experts, torch.full_like(experts, -1)).max(dim=0).values

    def generate_local_expert_mask_with_redundancy(self, local_expert_mask: torch.Tensor,
                                                   local_expert_indices: torch.Tensor,
                                                   expert_start_ids: torch.Tensor, expert_end_ids: torch.Tensor,
                                                   num_experts, rank) -> torch.Tensor:
        """``local_expert_mask (T, L)`` with each pair kept only where this EP ``rank``'s copy serves it: token
        ``t`` in slot ``j`` (expert ``e``) stays if ``expert_start_ids[rank, e] <= t <= expert_end_ids[rank, e]``
        (:meth:`allocate_token_blocks`) and ``j`` is the first local slot holding ``e``. ``local_expert_indices``:
        ``(1, L)``; ``rank``: an int or a ``(1,)`` tensor."""
        indices = local_expert_indices.reshape(-1).long()
        if local_expert_mask.dim() != 2 or local_expert_mask.shape[1] != indices.numel():
            raise ValueError(f"generate_local_expert_mask_with_redundancy: local_expert_mask must be (T, L) with "
                             f"L = {indices.numel()} local experts, got {tuple(local_expert_mask.shape)}")
        start = expert_start_ids[rank, indices].reshape(1, -1)
        end = expert_end_ids[rank, indices].reshape(1, -1)
        tokens = torch.arange(local_expert_mask.shape[0], device=local_expert_mask.device).unsqueeze(1)
        in_range = (tokens >= start) & (tokens <= end)
        holders = self.generate_mask_with_no_local_redundancy(
            self.generate_local_expert_boolean_mask(indices, num_experts))
        computes = self.generate_local_expert_id_no_local_redundancy(holders, local_expert_mask.device) != -1
        return local_expert_mask.masked_fill(~(in_range & computes.unsqueeze(0)), 0)
