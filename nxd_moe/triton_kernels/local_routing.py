"""A rank's pairs as a routing over its local experts, in one kernel: the GPU twin of
:func:`nxd_moe.experts.local_routing.local_routing` (about a dozen small launches in torch, which at decode sizes
cost more than the work).

One program per row: each pair's global expert becomes its local slot (a table lookup; ``-1``: not computed
here), the row's ``expert_mask`` and ``affinities`` over the ``E_l`` local experts are the pairs' sums, and the
``k'`` expert ids list the chosen local experts in ascending order, then the lowest unchosen ones as fillers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.experts.routing_inputs import Routing


@triton.jit
def _local_routing_kernel(expert_ptr, weight_ptr, slot_ptr, mask_ptr, affinity_ptr, index_ptr, num_local,
                          top_k, local_k, stride_e, stride_w, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < top_k
    expert = tl.load(expert_ptr + row * stride_e + ks, mask=k_ok, other=-1)
    weight = tl.load(weight_ptr + row * stride_w + ks, mask=k_ok, other=0.0)
    slot = tl.load(slot_ptr + tl.where(expert >= 0, expert, 0), mask=expert >= 0, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hits = experts[:, None] == slot[None, :]  # (E_l, k)
    chosen = (tl.sum(hits.to(tl.int32), axis=1) > 0) & (experts < num_local)
    affinity = tl.sum(tl.where(hits, weight[None, :], 0.0), axis=1)
    tl.store(mask_ptr + row * num_local + experts, chosen.to(tl.uint8), mask=experts < num_local)
    tl.store(affinity_ptr + row * num_local + experts, affinity.to(affinity_ptr.dtype.element_ty),
             mask=experts < num_local)
    picked = chosen.to(tl.int32)
    others = ((experts < num_local) & ~chosen).to(tl.int32)
    place = tl.where(chosen, tl.cumsum(picked, axis=0) - 1, tl.sum(picked, axis=0) + tl.cumsum(others, axis=0) - 1)
    tl.store(index_ptr + row * local_k + place, experts.to(tl.int64),
             mask=(experts < num_local) & (place < local_k))


def fused_local_routing(pair_expert: torch.Tensor, pair_weight: torch.Tensor, local_slot: torch.Tensor,
                        num_local: int, prescale: bool) -> Routing:
    """Same contract and result as :func:`~nxd_moe.experts.local_routing.local_routing`."""
    num_rows, top_k = pair_expert.shape
    local_k = min(top_k, num_local)
    pair_expert = pair_expert if pair_expert.stride(1) == 1 else pair_expert.contiguous()
    pair_weight = pair_weight if pair_weight.stride(1) == 1 else pair_weight.contiguous()
    device = pair_expert.device
    mask = torch.empty(num_rows, num_local, dtype=torch.bool, device=device)
    affinities = torch.empty(num_rows, num_local, dtype=pair_weight.dtype, device=device)
    index = torch.empty(num_rows, local_k, dtype=torch.int64, device=device)
    if num_rows:
        _local_routing_kernel[(num_rows,)](
            pair_expert, pair_weight, local_slot.contiguous(), mask, affinities, index, num_local,
            top_k, local_k, pair_expert.stride(0), pair_weight.stride(0),
            BLOCK_E=triton.next_power_of_2(num_local), BLOCK_K=triton.next_power_of_2(top_k))
    return Routing(index, mask, affinities, prescale, has_padding=True)
