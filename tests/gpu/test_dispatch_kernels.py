"""The static all-to-all's Triton kernels (:mod:`nxd_moe.triton_kernels.dispatch`) against the torch versions in
:mod:`nxd_moe.parallel.all_to_all` -- slots, send buffers byte for byte, combine bit for bit -- and both against a
plain-Python reading of the contract. On a CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import randn, triton_rounding_unit  # noqa: E402

from nxd_moe.parallel import all_to_all as torch_side  # noqa: E402
from nxd_moe.parallel.payload import FieldSpec, unpack  # noqa: E402
from nxd_moe.triton_kernels import dispatch as triton_side  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def owners(num_rows: int, top_k: int, num_ep: int, seed: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, num_ep, (num_rows, top_k), generator=gen)
    if kind == "one_rank":
        owner[:] = num_ep - 1
    owner[torch.rand(num_rows, top_k, generator=gen) < 0.2] = -1  # dropped / padded pairs
    if kind == "padding_rows":
        owner[::3] = -1
    return owner


CASES = [(1, 1, 1, 1, "random"), (5, 2, 2, 1, "random"), (33, 8, 4, 1, "random"), (17, 4, 2, 2, "random"),
         (9, 2, 4, 1, "one_rank"), (12, 3, 2, 1, "padding_rows"), (70, 6, 8, 1, "random")]


@pytest.mark.parametrize("num_rows,top_k,num_ep,tp,kind", CASES)
def test_slots_pack_combine_match_torch(num_rows, top_k, num_ep, tp, kind):
    ranks, hidden = num_ep * tp, 24
    owner = owners(num_rows, top_k, num_ep, seed=num_rows, kind=kind).to(DEVICE)
    experts = torch.where(owner >= 0, owner * 10 + torch.arange(top_k, device=DEVICE), -1)
    weights = torch.rand(num_rows, top_k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = randn(num_rows, hidden, seed=2, dtype=torch.bfloat16).to(DEVICE)

    slot, source = triton_side.destination_slots(owner, ranks, tp)
    ref_slot, ref_source = torch_side.destination_slots(owner, ranks, tp)
    assert torch.equal(slot.long(), ref_slot) and torch.equal(source.long(), ref_source)
    # The contract, read plainly: rows going to rank r keep their order, padding after.
    for r in range(ranks):
        going = [u for u in range(num_rows) if (owner[u] == r // tp).any()]
        assert source[r * num_rows:(r + 1) * num_rows].tolist() == going + [-1] * (num_rows - len(going))
        assert [int(slot[u, r]) for u in going] == list(range(len(going)))

    send = triton_side.pack_for_destinations(rows, experts, weights, owner, source, tp)
    assert torch.equal(send, torch_side.pack_for_destinations(rows, experts, weights, owner, ref_source, tp))
    got_rows, got_ids, got_weights = unpack(send, (FieldSpec((hidden,), rows.dtype), FieldSpec((top_k,), torch.int32),
                                                   FieldSpec((top_k,), torch.float32)))
    for s, u in enumerate(source.tolist()):
        ep = s // num_rows // tp
        if u < 0:
            assert not got_rows[s].any() and (got_ids[s] == -1).all() and not got_weights[s].any()
        else:
            assert torch.equal(got_rows[s], rows[u])
            assert got_ids[s].tolist() == [int(e) if o == ep else -1 for e, o in zip(experts[u], owner[u])]
            assert torch.equal(got_weights[s], weights[u])

    returned = randn(ranks * num_rows, hidden, seed=3, dtype=torch.bfloat16).to(DEVICE)
    # fp32 out: the same sums in the same order, bit for bit (bf16 out: Triton's interpreter truncates its final
    # conversion where the GPU rounds to nearest, so that is compared to one conversion's error).
    out = triton_side.combine_from_destinations(returned, slot, torch.float32)
    assert torch.equal(out, torch_side.combine_from_destinations(returned, ref_slot, torch.float32))
    expected = torch.zeros(num_rows, hidden, dtype=torch.float32)
    for u in range(num_rows):
        for r in range(ranks):
            if slot[u, r] >= 0:
                expected[u] += returned[r * num_rows + int(slot[u, r])].float().cpu()
    assert torch.equal(out.cpu(), expected)
    bf16 = triton_side.combine_from_destinations(returned, slot, torch.bfloat16).float().cpu()
    assert ((bf16 - expected).abs() <= expected.abs() * triton_rounding_unit(torch.bfloat16)).all()


def test_pack_refuses_unaligned_rows():
    owner = torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)
    slot, source = triton_side.destination_slots(owner, 1, 1)
    rows = torch.zeros(2, 3, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        triton_side.pack_for_destinations(rows, owner, torch.ones(2, 1, device=DEVICE), owner, source, 1)


@pytest.mark.parametrize("num_rows,top_k,num_local,num_experts", [(1, 1, 1, 2), (7, 2, 4, 8), (33, 8, 16, 64),
                                                                  (5, 4, 2, 8), (12, 8, 128, 256)])
def test_local_routing_kernel_matches_torch(num_rows, top_k, num_local, num_experts):
    from nxd_moe.experts.local_routing import local_routing
    from nxd_moe.triton_kernels.local_routing import fused_local_routing

    gen = torch.Generator().manual_seed(num_rows)
    held = torch.randperm(num_experts, generator=gen)[:num_local]
    slot = torch.full((num_experts,), -1, dtype=torch.int64)
    slot[held] = torch.arange(num_local)
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_rows)])
    # Pairs not computed here, and a padding row, are -1.
    pair_expert = torch.where((slot[index] >= 0) & (torch.rand(num_rows, top_k, generator=gen) < 0.9), index, -1)
    pair_expert[num_rows // 2] = -1
    weight = torch.rand(num_rows, top_k, generator=gen)
    args = (pair_expert.to(DEVICE), weight.to(DEVICE), slot.to(DEVICE), num_local)
    for prescale in (False, True):
        got, ref = fused_local_routing(*args, prescale), local_routing(*args, prescale)
        assert torch.equal(got.expert_index, ref.expert_index) and torch.equal(got.expert_mask, ref.expert_mask)
        assert torch.equal(got.affinities, ref.affinities) and got.prescale == ref.prescale and got.has_padding


def test_checks_reject_a_dropped_row():
    """Negative control: the pack with one row's send slot lost differs from the torch pack (compared exactly), and
    the combine with one (row, destination) slot lost fails the bf16 bound of test_slots_pack_combine_match_torch
    (the fp32 one is exact)."""
    num_rows, top_k, ranks = 17, 4, 2
    owner = owners(num_rows, top_k, ranks, seed=17, kind="random").to(DEVICE)
    experts = torch.where(owner >= 0, owner * 10 + torch.arange(top_k, device=DEVICE), -1)
    weights = torch.rand(num_rows, top_k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = randn(num_rows, 24, seed=2, dtype=torch.bfloat16).to(DEVICE)
    slot, source = triton_side.destination_slots(owner, ranks, 1)
    u, r = (int(i) for i in torch.nonzero(slot >= 0)[0])
    lost = source.clone()
    lost[r * num_rows + int(slot[u, r])] = -1
    assert not torch.equal(triton_side.pack_for_destinations(rows, experts, weights, owner, lost, 1),
                           torch_side.pack_for_destinations(rows, experts, weights, owner, source.long(), 1))
    returned = randn(ranks * num_rows, 24, seed=3, dtype=torch.bfloat16).to(DEVICE)
    expected = triton_side.combine_from_destinations(returned, slot, torch.float32).cpu()
    broken = slot.clone()
    broken[u, r] = -1
    bf16 = triton_side.combine_from_destinations(returned, broken, torch.bfloat16).float().cpu()
    assert not ((bf16 - expected).abs() <= expected.abs() * triton_rounding_unit(torch.bfloat16)).all()
