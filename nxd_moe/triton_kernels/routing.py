"""The router's output in the algorithms' form, in one kernel: the GPU twin of
:func:`nxd_moe.experts.routing_inputs.build_routing`.

From ``expert_affinities (T, E)``, ``expert_index (T, k)`` and an optional padding mask it writes the k-hot
``expert_mask (T, E)`` and the affinities zeroed off the mask and L1-normalised over the chosen experts -- what the
torch version does in about eight small launches, which at decode sizes cost more than the work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.experts.routing_inputs import Routing

# F.normalize's default eps: a row whose chosen affinities sum to 0 stays 0.
NORMALIZE_EPS = tl.constexpr(1e-12)


@triton.jit
def _routing_kernel(affinity_ptr, index_ptr, padding_ptr, mask_ptr, out_ptr, num_experts, top_k,
                    stride_at, stride_it, HAS_PADDING: tl.constexpr, NORMALIZE: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    ks = tl.arange(0, BLOCK_K)
    chosen_experts = tl.load(index_ptr + token * stride_it + ks, mask=ks < top_k, other=-1)
    chosen = tl.sum((experts[:, None] == chosen_experts[None, :]).to(tl.int32), axis=1) > 0
    if HAS_PADDING:
        chosen = chosen & (tl.load(padding_ptr + token) != 0)
    affinity = tl.load(affinity_ptr + token * stride_at + experts, mask=expert_ok, other=0.0)
    affinity = tl.where(chosen, affinity, 0.0)
    if NORMALIZE:
        norm = tl.sum(tl.abs(affinity.to(tl.float32)), axis=0)
        affinity = affinity / tl.maximum(norm, NORMALIZE_EPS).to(affinity.dtype)
    tl.store(mask_ptr + token * num_experts + experts, chosen.to(tl.uint8), mask=expert_ok)
    tl.store(out_ptr + token * num_experts + experts, affinity, mask=expert_ok)


def fused_routing(expert_affinities: torch.Tensor, expert_index: torch.Tensor, num_experts: int, normalize: bool,
                  prescale: bool, padding_mask: torch.Tensor | None = None) -> Routing:
    """Same contract and result as :func:`~nxd_moe.experts.routing_inputs.build_routing`."""
    num_tokens, top_k = expert_index.shape
    expert_index = expert_index.contiguous()
    if expert_affinities.stride(1) != 1:
        expert_affinities = expert_affinities.contiguous()
    mask = torch.empty(num_tokens, num_experts, dtype=torch.bool, device=expert_affinities.device)
    affinities = torch.empty(num_tokens, num_experts, dtype=expert_affinities.dtype, device=expert_affinities.device)
    padding = None if padding_mask is None else padding_mask.reshape(-1).contiguous()
    _routing_kernel[(num_tokens,)](
        expert_affinities, expert_index, padding if padding is not None else mask, mask,
        affinities, num_experts, top_k, expert_affinities.stride(0), expert_index.stride(0),
        HAS_PADDING=padding is not None, NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k))
    return Routing(expert_index, mask, affinities, prescale, padding_mask is not None)
