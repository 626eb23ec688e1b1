"""Details of the parallel MoE's pure parts that test_parallel_units.py leaves open: tensor-parallel slices and
shard specs, the EPLB planner's checks and tie-breaks, the placement's tables, and payload packing (issue 41:
mutation testing of nxd_moe/parallel/{sharding,eplb,placement,payload}.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nxd_moe.experts.shard import ShardSpec
from nxd_moe.parallel.eplb import plan_expert_distribution, rank_loads, replica_counts
from nxd_moe.parallel.payload import FieldSpec, exchange_rows, pack, packs_bytes, unpack
from nxd_moe.parallel.placement import ExpertPlacement, assign_pairs, needs_positions, pair_positions
from nxd_moe.parallel.sharding import (
    load_full_state_dict,
    shard_specs,
    shard_state_dict,
    shard_tensor,
    tensor_parallel_slice,
)
from nxd_moe.parallel_state import SPMDRank

# ----------------------------------------------------------------------------------------------------------
# sharding


def _pieces_by_definition(size: int, stride: int, tp: int, rank: int) -> list[int]:
    """Indices rank ``rank`` keeps of a dim of ``size``: ``stride`` equal parts, each cut into ``tp`` pieces."""
    part = size // stride
    piece = part // tp
    return [s * part + rank * piece + j for s in range(stride) for j in range(piece)]


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("stride,tp,rank", [(1, 3, 2), (2, 3, 1), (3, 2, 1), (3, 2, 0), (2, 1, 0)])
def test_tensor_parallel_slice_keeps_the_ranks_piece_of_every_part(dim, stride, tp, rank):
    shape = [5, 7, 11]
    shape[dim] = 12
    full = torch.arange(shape[0] * shape[1] * shape[2], dtype=torch.float64).view(*shape)
    got = tensor_parallel_slice(full, dim, tp, rank, stride)
    keep = torch.tensor(_pieces_by_definition(12, stride, tp, rank))
    assert torch.equal(got, full.index_select(dim, keep))


def test_an_unstrided_slice_is_a_view_of_the_full_tensor():
    full = torch.arange(4 * 12, dtype=torch.float32).view(4, 12)
    piece = tensor_parallel_slice(full, 1, 4, 3)
    assert piece.data_ptr() == full[:, 9:].data_ptr() and piece.shape == (4, 3)
    full[0, 10] = -5.0
    assert piece[0, 1] == -5.0  # shares storage


@pytest.mark.parametrize("args,error,message", [
    ((0, 0, 1), ValueError, r"tp_size must be in \[1, inf\], got 0"),
    ((3, 3, 1), ValueError, r"tp_rank must be in \[0, 2\], got 3"),
    ((3, -1, 1), ValueError, r"tp_rank must be in \[0, 2\], got -1"),
    ((3, 2, 0), ValueError, r"stride must be in \[1, inf\], got 0"),
    ((3.0, 0, 1), TypeError, "tp_size must be an int"),
    ((2, 1, 4), ValueError, r"^dimension 1 of size 12 must be divisible by stride \* tensor-parallel size "
                            r"\(4 \* 2\)$"),
    ((5, 1, 1), ValueError, r"^dimension 1 of size 12 must be divisible by stride \* tensor-parallel size "
                            r"\(1 \* 5\)$"),
])
def test_tensor_parallel_slice_checks_its_arguments(args, error, message):
    full = torch.zeros(2, 12)
    with pytest.raises(error, match=message):
        tensor_parallel_slice(full, 1, *args)
    tensor_parallel_slice(full, 1, 3, 2, 2)  # the last rank and a stride are fine


def test_shard_tensor_follows_every_field_of_the_spec():
    full = torch.arange(5 * 3 * 12, dtype=torch.float64).view(5, 3, 12)
    spec = ShardSpec("w", experts=(4, 0, 2), dim=2, tp_size=3, tp_rank=1, stride=2)
    keep = torch.tensor(_pieces_by_definition(12, 2, 3, 1))
    got = shard_tensor(full, spec)
    assert torch.equal(got, full[[4, 0, 2]].index_select(2, keep)) and got.is_contiguous()
    # experts only (no dim): rows in the spec's order
    assert torch.equal(shard_tensor(full, ShardSpec("w", experts=(3, 1))), full[[3, 1]])
    # dim only: every expert, a contiguous copy of the strided slice
    only = shard_tensor(full, ShardSpec("w", dim=1, tp_size=3, tp_rank=2))
    assert torch.equal(only, full[:, 2:3]) and only.is_contiguous()
    assert shard_tensor(full, ShardSpec("w")) is full  # nothing to shard: the tensor itself


class _Sharded(nn.Module):
    """Holds ``w`` (experts 2, 0 of 3; TP slice 1 of 2 on dim 1) and a replicated ``b``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 3))
        self.b = nn.Parameter(torch.zeros(4))

    def shard_specs(self):
        return {"w": ShardSpec("full_w", experts=(2, 0), dim=1, tp_size=2, tp_rank=1)}


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Module()
        self.inner.deep = _Sharded()
        self.rank = SPMDRank(4, 2, rank=3)
        self.head = nn.Linear(2, 1, bias=False)


def test_shard_specs_prefix_keys_and_sources_with_the_module_path():
    assert shard_specs(_Sharded()) == {"w": ShardSpec("full_w", experts=(2, 0), dim=1, tp_size=2, tp_rank=1)}
    assert shard_specs(_Outer()) == {
        "inner.deep.w": ShardSpec("inner.deep.full_w", experts=(2, 0), dim=1, tp_size=2, tp_rank=1)}
    assert shard_specs(nn.Linear(2, 2)) == {}


def _full_outer_state_dict():
    return {"inner.deep.full_w": torch.arange(3 * 6, dtype=torch.float32).view(3, 6),
            "inner.deep.b": torch.tensor([1.0, 2.0, 3.0, 4.0]), "head.weight": torch.tensor([[5.0, 6.0]])}


def test_shard_state_dict_shards_copies_and_keeps_the_modules_rank():
    module = _Outer()
    full = _full_outer_state_dict()
    got = shard_state_dict(module, full)
    assert list(got) == list(module.state_dict())  # every local key, in the module's order
    assert torch.equal(got["inner.deep.w"], full["inner.deep.full_w"][[2, 0]][:, 3:])
    assert got["inner.deep.b"] is full["inner.deep.b"] and got["head.weight"] is full["head.weight"]
    # the module's own rank, not the checkpoint's
    assert got["rank.rank"].data_ptr() == module.rank.rank.data_ptr() and got["rank.rank"].tolist() == [3]
    loaded = _Outer()
    assert load_full_state_dict(loaded, full) is loaded
    assert torch.equal(loaded.inner.deep.w, full["inner.deep.full_w"][[2, 0]][:, 3:])
    assert torch.equal(loaded.head.weight, full["head.weight"]) and loaded.rank.rank.tolist() == [3]
    # a checkpoint holding a rank is refused: the rank is not the checkpoint's
    with pytest.raises(ValueError, match=r"does not use: \['rank.rank'\]$"):
        shard_state_dict(module, {**full, "rank.rank": torch.zeros(1, dtype=torch.int32)})
    # an SPMDRank at the top level keeps its own key unprefixed
    lone = SPMDRank(3, 1, rank=2)
    assert shard_state_dict(lone, {})["rank"].data_ptr() == lone.rank.data_ptr()


def test_shard_state_dict_names_at_most_six_missing_or_unused_keys():
    class Many(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.p = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(n)])

    full7 = {f"p.{i}": torch.zeros(1) for i in range(7)}
    with pytest.raises(KeyError, match=r"missing \['p.0', 'p.1', 'p.2', 'p.3', 'p.4', 'p.5'\] \.\.\. \(7 in all\)"):
        shard_state_dict(Many(7), {})
    with pytest.raises(KeyError) as info:
        shard_state_dict(Many(6), {})
    assert str(info.value) == "\"full state dict is missing ['p.0', 'p.1', 'p.2', 'p.3', 'p.4', 'p.5']\""
    extra = {f"x{i}": torch.zeros(1) for i in range(7)}
    with pytest.raises(ValueError, match=r"\['x0', 'x1', 'x2', 'x3', 'x4', 'x5'\] \.\.\. \(7 in all\)$"):
        shard_state_dict(Many(7), {**full7, **extra})
    del extra["x6"]
    with pytest.raises(ValueError, match=r"does not use: \['x0', 'x1', 'x2', 'x3', 'x4', 'x5'\]$"):
        shard_state_dict(Many(7), {**full7, **extra})


# ----------------------------------------------------------------------------------------------------------
# EPLB planner


@pytest.mark.parametrize("counts,message", [
    ([], "^tokens_per_expert must list at least one expert$"),
    ([3, True], r"^tokens_per_expert\[1\] must be a finite number >= 0, got True$"),
    ([3, 2, "7"], r"^tokens_per_expert\[2\] must be a finite number >= 0, got '7'$"),
    ([-0.5, 1], r"^tokens_per_expert\[0\] must be a finite number >= 0, got -0.5$"),
    ([1, float("nan")], r"tokens_per_expert\[1\] .* got nan$"),
    ([1, 2, float("inf")], r"tokens_per_expert\[2\] .* got inf$"),
    ([1, None], r"tokens_per_expert\[1\] .* got None$"),
])
def test_token_counts_are_checked(counts, message):
    with pytest.raises(ValueError, match=message):
        replica_counts(counts, 4, 4)


def test_token_counts_may_be_a_tensor_or_zero():
    assert replica_counts(torch.tensor([10, 40, 0]), 5, 3) == [1, 3, 1]  # 40/3 > 10 > 40/4... and 0 never
    assert replica_counts(torch.tensor([10.5, 40.0, 0.0], dtype=torch.float64), 4, 3) == [1, 2, 1]
    assert replica_counts((0, 0.0), 2, 1) == [1, 1]


def test_replica_counts_divide_by_copies_cap_copies_and_break_ties_to_the_lowest_id():
    # per-copy load: after one extra copy expert 0 carries 45 < 50, so the next copy goes to expert 1
    assert replica_counts([90, 50], 4, 3) == [2, 2]
    # tie at 10 per copy: the lower id first, then expert 1 (10 > 5 = 10 / 2)
    assert replica_counts([10, 10, 4], 4, 3) == [2, 1, 1]
    assert replica_counts([10, 10, 4], 5, 3) == [2, 2, 1]
    # the cap: at most max_copies copies of the heavy expert, so the light one takes the rest
    assert replica_counts([100, 1], 4, 2) == [2, 2]
    assert replica_counts([100, 1], 4, 3) == [3, 1]
    # the slot limits: exactly E and exactly E * max_copies are allowed
    assert replica_counts([5, 7, 1], 3, 1) == [1, 1, 1]
    assert replica_counts([5, 7, 1], 6, 2) == [2, 2, 2]
    with pytest.raises(ValueError, match=r"^2 slots cannot hold 3 experts$"):
        replica_counts([5, 7, 1], 2, 2)
    with pytest.raises(ValueError, match=r"^7 slots need more than 2 copies of some expert; at most one copy "
                                         "per rank$"):
        replica_counts([5, 7, 1], 7, 2)


def test_plan_by_hand_with_the_default_slots():
    """E=5 on EP=2: ceil(5/2) = 3 slots per rank, one spare slot -> a second copy of the heavy expert 4.
    Copies heaviest first, each to the least loaded rank with room that lacks it (ties to the lower rank):
    4 (25) -> r0; 4 (25) -> r1; 3 (4) -> r0 (29); 2 (3) -> r1 (28); 1 (2) -> r1 (30); 0 (1) -> r0 (30)."""
    counts = [1, 2, 3, 4, 50]
    plan = plan_expert_distribution(counts, 2)
    assert plan == ((0, 3, 4), (1, 2, 4))
    assert rank_loads(counts, plan) == [30.0, 30.0]
    assert plan_expert_distribution(torch.tensor(counts), 2, None) == plan


def test_plan_without_spare_slots_packs_heaviest_first_onto_the_lightest_rank():
    """E=6, EP=3, 2 slots: 60 -> r0; 50 -> r1; 40 -> r2; 30 -> r2 (70); 20 -> r1 (70); 10 -> r0 (70)."""
    plan = plan_expert_distribution([10, 20, 30, 40, 50, 60], 3, 2)
    assert plan == ((0, 5), (1, 4), (2, 3))
    assert rank_loads([10, 20, 30, 40, 50, 60], plan) == [70.0, 70.0, 70.0]
    # equal loads: ties go to the lower rank, then the lower expert id
    assert plan_expert_distribution([7, 7, 7, 7], 2, 2) == ((0, 2), (1, 3))
    # more slots than needed: every rank holds `slots` experts; copies go to the heavy expert first
    assert plan_expert_distribution([1, 100, 2], 2, 3) == ((0, 1, 2), (0, 1, 2))
    # 100 gets three copies (33.3 each > 9): one per rank, then 9 -> r0, 3 -> r1, 1 -> r2
    assert plan_expert_distribution([9, 1, 100, 3], 3, 2) == ((0, 2), (2, 3), (1, 2))


def test_plan_checks_its_sizes():
    with pytest.raises(ValueError, match=r"^slots_per_rank \(2\) \* expert_parallel_size \(3\) must be >= the number "
                                         r"of experts \(7\)$"):
        plan_expert_distribution([1] * 7, 3, 2)
    plan_expert_distribution([1] * 6, 3, 2)  # exactly enough
    with pytest.raises(ValueError, match=r"expert_parallel_size must be in \[1, inf\], got 0"):
        plan_expert_distribution([1, 2], 0)
    with pytest.raises(ValueError, match=r"slots_per_rank must be in \[1, inf\], got 0"):
        plan_expert_distribution([1, 2], 2, 0)
    with pytest.raises(TypeError, match="slots_per_rank must be an int"):
        plan_expert_distribution([1, 2], 2, 1.0)


def test_rank_loads_split_each_expert_between_its_copies():
    # expert 0 on ranks 0 and 2 (6 each), expert 1 on ranks 0 and 1 (2.5 each), expert 2 on 1 and 2 (1.5 each)
    assert rank_loads([12, 5, 3], [[0, 1], [1, 2], [0, 2]]) == [8.5, 4.0, 7.5]
    assert rank_loads(torch.tensor([4.0, 8.0]), [[1], [0]]) == [8.0, 4.0]


# ----------------------------------------------------------------------------------------------------------
# placement


def test_placement_fields_replicas_and_checks():
    placement = ExpertPlacement(5, 3, [[4, 0], [1, 2], [3, 4]])
    assert (placement.num_experts, placement.expert_parallel_size, placement.num_local_experts) == (5, 3, 2)
    assert placement.distribution == ((4, 0), (1, 2), (3, 4))  # each rank's experts in the order listed
    assert placement.replicas == ((0,), (1,), (1,), (2,), (0, 2))
    assert placement.has_redundancy is True
    assert placement.experts_of(2) == (3, 4) and placement.experts_of(0) == (4, 0)
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, 2\], got 3"):
        placement.experts_of(3)
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, 2\], got -1"):
        placement.experts_of(-1)
    contiguous = ExpertPlacement(6, 3)
    assert contiguous.distribution == ((0, 1), (2, 3), (4, 5)) and contiguous.has_redundancy is False
    assert contiguous.num_local_experts == 2
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, inf\], got 0"):
        ExpertPlacement(0, 1, [[0]])
    with pytest.raises(ValueError, match=r"expert_parallel_size must be in \[1, inf\], got 0"):
        ExpertPlacement(2, 0, [[0, 1]])


def test_local_slot_tables_by_definition_and_built_once():
    placement = ExpertPlacement(5, 3, [[4, 0], [1, 2], [3, 4]])
    # local index = position in experts_of(rank), in the order listed
    assert placement.local_slot(0).tolist() == [1, -1, -1, -1, 0]
    assert placement.local_slot(1).tolist() == [-1, 0, 1, -1, -1]
    assert placement.local_slot(2).tolist() == [-1, -1, -1, 0, 1]
    assert placement.local_slot(2).dtype == torch.int64
    assert placement.local_slot(1) is placement.local_slot(1)  # cached per rank ...
    assert placement.local_slot(1, "cpu") is placement.local_slot(1)  # ... and per device (None is the CPU)
    table = placement.local_slot_table()
    assert table.tolist() == [[1, -1, -1, -1, 0], [-1, 0, 1, -1, -1], [-1, -1, -1, 0, 1]]
    assert table.dtype == torch.int64 and placement.local_slot_table("cpu") is table


def test_replica_and_owner_tables():
    placement = ExpertPlacement(4, 3, [[0, 3], [1, 3], [2, 3]])
    ranks, copies = placement.replica_table()
    assert ranks.tolist() == [[0, -1, -1], [1, -1, -1], [2, -1, -1], [0, 1, 2]]
    assert copies.tolist() == [1, 1, 1, 3]
    assert ranks.dtype == copies.dtype == torch.int64
    assert placement.replica_table("cpu")[0] is ranks
    single = ExpertPlacement(4, 2, [[2, 3], [0, 1]])
    assert single._owner_table(None).tolist() == [-1, 1, 1, 0, 0]
    assert single.replica_table()[0].tolist() == [[1], [1], [0], [0]]


def test_pair_ranks_without_replicas_is_a_lookup():
    placement = ExpertPlacement(4, 2, [[2, 3], [0, 1]])
    experts = torch.tensor([[3, -1], [0, 2], [-1, 1]], dtype=torch.int32)
    assert placement.pair_ranks(experts).tolist() == [[0, -1], [1, 0], [-1, 1]]
    replicated = ExpertPlacement(3, 2, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="^pair_ranks: a placement with replicated experts needs the pairs' "
                                         "positions$"):
        replicated.pair_ranks(torch.tensor([[0]]))


def test_pair_ranks_split_positions_between_copies_by_definition():
    """Copy floor(position * R / n) of an expert serves a pair: expert 1 has R=3 copies (ranks 0, 1, 2 in rank
    order) and n=7 pairs; expert 0 has one copy on rank 0."""
    placement = ExpertPlacement(3, 3, [[0, 1], [1, 2], [1, 2]])
    position = torch.tensor([[0, 0], [1, 1], [2, 2], [3, 0], [4, 0], [5, 0], [6, 0]])
    experts = torch.tensor([[1, 0], [1, 0], [1, 0], [1, -1], [1, -1], [1, -1], [1, 2]])
    per_expert = torch.tensor([3, 7, 1])
    got = placement.pair_ranks(experts, position, per_expert)
    want = [[[0, 1, 2][p * 3 // 7] for p in range(7)][i] for i in range(7)]
    assert got[:, 0].tolist() == want == [0, 0, 0, 1, 1, 2, 2]
    assert got[:, 1].tolist() == [0, 0, 0, -1, -1, -1, 1]  # expert 2: copies on ranks 1 and 2, position 0
    # an expert nobody routed to (n = 0) and an invalid pair with a large position do not index out of range
    empty = placement.pair_ranks(torch.tensor([[-1, 2]]), torch.tensor([[9, 0]]), torch.tensor([0, 0, 0]))
    assert empty.tolist() == [[-1, 1]]


def test_pair_positions_of_invalid_pairs_are_zero():
    experts = torch.tensor([[2, -1], [-1, 2], [0, 2]], dtype=torch.int32)
    position, counts = pair_positions(experts, 3)
    assert position.tolist() == [[0, 0], [0, 1], [0, 2]]
    assert counts.tolist() == [1, 0, 3]


def test_needs_positions_and_capacity():
    plain = ExpertPlacement(2, 2)
    replicated = ExpertPlacement(2, 2, [[0, 1], [0, 1]])
    assert needs_positions(plain, None) is False
    assert needs_positions(plain, 3) is True
    assert needs_positions(replicated, None) is True
    assert needs_positions(plain, 0) is True  # capacity 0 is a capacity
    # without capacity and replicas: no positions needed
    experts = torch.tensor([[1], [0], [1]])
    assert assign_pairs(plain, experts, None, None, None).tolist() == [[1], [0], [1]]
    # capacity 4 keeps an expert's first 4 pairs; the copies then split those 4 (2 and 2), not 6 (3 and 3)
    experts = torch.tensor([[0], [0], [0], [0], [0], [0], [1]])
    position, counts = pair_positions(experts, 2)
    got = assign_pairs(replicated, experts, position, counts, 4)
    assert got[:, 0].tolist() == [0, 0, 1, 1, -1, -1, 0]
    uncapped = assign_pairs(replicated, experts, position, counts, None)
    assert uncapped[:, 0].tolist() == [0, 0, 0, 1, 1, 1, 0]


# ----------------------------------------------------------------------------------------------------------
# payload


def test_field_spec_bytes():
    assert FieldSpec((3, 5), torch.float16).nbytes == 30
    assert FieldSpec((2, 3, 7), torch.int32).nbytes == 168
    assert FieldSpec((), torch.int64).nbytes == 8
    assert FieldSpec((4, 0), torch.float32).nbytes == 0


def test_pack_lays_fields_side_by_side_in_little_endian_bytes():
    a = torch.tensor([[1, 258], [-1, 0]], dtype=torch.int16)  # 258 = 0x0102
    b = torch.tensor([7, 65536], dtype=torch.int32)
    rows, specs = pack([a, b])
    assert rows.tolist() == [[1, 0, 2, 1, 7, 0, 0, 0], [255, 255, 0, 0, 0, 0, 1, 0]]
    assert specs == (FieldSpec((2,), torch.int16), FieldSpec((), torch.int32))
    # a non-contiguous field packs its logical order
    t = torch.arange(6, dtype=torch.uint8).view(3, 2).t()  # [[0, 2, 4], [1, 3, 5]]
    rows, specs = pack([t])
    assert rows.tolist() == [[0, 2, 4], [1, 3, 5]] and specs == (FieldSpec((3,), torch.uint8),)


def test_pack_without_elements_keeps_the_row_width():
    fields = [torch.zeros(0, 3, dtype=torch.float32), torch.zeros(0, 2, 5, dtype=torch.int16)]
    rows, specs = pack(fields)
    assert rows.shape == (0, 12 + 20) and rows.dtype == torch.uint8
    assert [tuple(u.shape) for u in unpack(rows, specs)] == [(0, 3), (0, 2, 5)]
    # a field of zero bytes per row
    rows, specs = pack([torch.zeros(4, 0, dtype=torch.int8), torch.ones(4, 1, dtype=torch.int8)])
    assert rows.shape == (4, 1) and rows.tolist() == [[1]] * 4
    assert [tuple(u.shape) for u in unpack(rows, specs)] == [(4, 0), (4, 1)]


def test_pack_checks_its_fields():
    with pytest.raises(ValueError, match="^pack needs at least one field$"):
        pack([])
    with pytest.raises(ValueError, match=r"^pack: every field needs the same number of rows, got \[3, 3, 2\]$"):
        pack([torch.zeros(3), torch.zeros(3, 2), torch.zeros(2)])


def test_unpack_views_aligned_fields_and_copies_misaligned_ones():
    a = torch.tensor([[1.5], [-2.0]], dtype=torch.float32)
    b = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]], dtype=torch.int8)
    c = torch.tensor([[5.25], [6.5]], dtype=torch.float64)
    rows, specs = pack([a, b, c])  # bytes 0, 4 and 8 of 16: every field aligned, every field a view
    out = unpack(rows, specs)
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(out, (a, b, c)))
    base = rows.data_ptr()
    assert [x.data_ptr() - base for x in out] == [0, 4, 8]
    rows[0, 0:4] = torch.tensor([0.0], dtype=torch.float32).view(torch.uint8)
    assert out[0][0, 0] == 0.0  # the view sees the change
    # an int16 at byte 1 of a 4-byte row: copied out (a view would be misaligned), values exact
    p, q, r = (torch.tensor([[1], [2]], dtype=torch.int8), torch.tensor([[-300], [700]], dtype=torch.int16),
               torch.tensor([[9], [8]], dtype=torch.int8))
    rows, specs = pack([p, q, r])
    out = unpack(rows, specs)
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(out, (p, q, r)))
    assert out[0].data_ptr() == rows.data_ptr() and out[2].data_ptr() == rows.data_ptr() + 3
    assert not rows.data_ptr() <= out[1].data_ptr() < rows.data_ptr() + rows.numel()  # a copy
    # rows whose own offset or row stride is misaligned: every multi-byte field copied out, values exact
    d = torch.tensor([[10], [20]], dtype=torch.int32)
    wide = torch.cat([torch.zeros(2, 1, dtype=torch.uint8), pack([d])[0]], dim=1)
    shifted = unpack(wide[:, 1:], (FieldSpec((1,), torch.int32),))[0]  # storage offset 1, row stride 5
    assert shifted.tolist() == [[10], [20]]
    padded = torch.cat([pack([d])[0], torch.zeros(2, 2, dtype=torch.uint8)], dim=1)[:, :4]  # stride 6
    assert unpack(padded, (FieldSpec((1,), torch.int32),))[0].tolist() == [[10], [20]]
    offset = torch.cat([torch.zeros(1, 4, dtype=torch.uint8), pack([d])[0]])[1:]  # storage offset 4, stride 4
    assert offset.storage_offset() == 4
    view = unpack(offset, (FieldSpec((1,), torch.int32),))[0]
    assert view.tolist() == [[10], [20]] and view.data_ptr() == offset.data_ptr()
    flat = torch.cat([torch.zeros(2, dtype=torch.uint8), pack([d])[0].view(-1)])
    odd = flat[2:].view(2, 4)  # storage offset 2, row stride 4
    assert odd.storage_offset() == 2 and unpack(odd, (FieldSpec((1,), torch.int32),))[0].tolist() == [[10], [20]]


def test_unpack_checks_the_row_width():
    rows = torch.zeros(2, 9, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^unpack: fields take 8 bytes per row, rows have 9$"):
        unpack(rows, (FieldSpec((2,), torch.int32),))


def test_exchange_rows_packs_once_or_goes_field_by_field_under_xla():
    assert packs_bytes(torch.device("cpu")) is True and packs_bytes(torch.device("meta")) is True
    assert packs_bytes(torch.device("xla")) is False
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    b = torch.tensor([7, 8, 9], dtype=torch.int16)
    seen = []

    def reverse(t):
        seen.append((t.dtype, tuple(t.shape)))
        return t.flip(0)

    out = exchange_rows([a, b], reverse)
    assert seen == [(torch.uint8, (3, 18))]  # one collective on the packed rows
    assert torch.equal(out[0], a.flip(0)) and torch.equal(out[1], b.flip(0)) and out[1].dtype == torch.int16

    class OnXla:
        device = torch.device("xla")

    fields = [OnXla(), OnXla()]
    assert exchange_rows(fields, lambda f: ("moved", f)) == [("moved", fields[0]), ("moved", fields[1])]


def test_pack_places_empty_fields_on_the_fields_device():
    """A field without elements gets its zero-byte column on its own device (meta here: no CPU tensor can be
    concatenated to it)."""
    fields = [torch.zeros(3, 0, dtype=torch.int8, device="meta"), torch.zeros(3, 2, device="meta")]
    rows, specs = pack(fields)
    assert rows.device.type == "meta" and rows.shape == (3, 8)
    only, _ = pack([torch.zeros(2, 0, 3, device="meta")])
    assert only.device.type == "meta" and only.shape == (2, 0)


def test_exchange_rows_of_a_single_field():
    b = torch.tensor([[7], [8], [9]], dtype=torch.int32)
    out = exchange_rows([b], lambda t: t[[2, 0, 1]])
    assert len(out) == 1 and out[0].tolist() == [[9], [7], [8]] and out[0].dtype == torch.int32


def test_placement_tables_are_kept_per_device():
    """Each table is built once per device and handed out on the device asked for (meta stands in for an
    accelerator: a CPU table must not come back for it, nor a meta table for the CPU)."""
    placement = ExpertPlacement(3, 2, [[0, 1], [1, 2]])
    single = ExpertPlacement(4, 2, [[2, 3], [0, 1]])
    cpu = [placement.local_slot(1), placement.local_slot_table(), *placement.replica_table(),
           single._owner_table(None)]
    meta = [placement.local_slot(1, "meta"), placement.local_slot_table("meta"),
            *placement.replica_table(torch.device("meta")), single._owner_table(torch.device("meta"))]
    assert [t.device.type for t in cpu] == ["cpu"] * 5 and [t.device.type for t in meta] == ["meta"] * 5
    assert [tuple(t.shape) for t in meta] == [(3,), (2, 3), (3, 2), (3,), (5,)]
    assert all(t.dtype == torch.int64 for t in cpu + meta)
    assert placement.local_slot(1).tolist() == [-1, 0, 1] and placement.local_slot_table().tolist() == [
        [0, 1, -1], [-1, 0, 1]]
    assert placement.replica_table()[0].tolist() == [[0, -1], [0, 1], [1, -1]]
    assert single._owner_table("cpu").tolist() == [-1, 1, 1, 0, 0]
    # pair_ranks looks its tables up on the pairs' device, with and without replicas
    on_meta = single.pair_ranks(torch.tensor([[3, -1]], device="meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == (1, 2)
    split = placement.pair_ranks(torch.tensor([[1]], device="meta"), torch.zeros(1, 1, dtype=torch.int64,
                                                                                   device="meta"),
                                 torch.ones(3, dtype=torch.int64, device="meta"))
    assert split.device.type == "meta" and split.shape == (1, 1)
    assert single.pair_ranks(torch.tensor([[3, -1]])).tolist() == [[0, -1]]


def test_plan_moves_an_expert_when_only_ranks_holding_the_copy_have_room():
    """A plan that reaches the planner's swap: a copy of some expert is left when every rank with a free slot
    already holds it, so an expert moves from a full rank lacking it to the free rank. Copies by hand (step 1):
    expert 5 (10) takes 3 (the cap: EP), experts 1 and 6 (2) take 2 then 1 takes a third, 0, 2, 3, 4 take 2,
    6 its third, 7 stays at 1 -- 18 slots. The plan is a valid distribution with those copies; the loads are the
    per-copy shares (the 1/3 and 2/3 shares' float rounding breaks the planner's ties, so the plan is pinned)."""
    counts = [1, 2, 1, 1, 1, 10, 2, 1]
    assert replica_counts(counts, 18, 3) == [2, 3, 2, 2, 2, 3, 3, 1]
    plan = plan_expert_distribution(counts, 3, 6)
    assert all(len(set(experts)) == len(experts) == 6 for experts in plan)
    assert [sum(e in experts for experts in plan) for e in range(8)] == [2, 3, 2, 2, 2, 3, 3, 1]
    assert plan == ((0, 1, 4, 5, 6, 7), (1, 2, 3, 4, 5, 6), (0, 1, 2, 3, 5, 6))
    want = [1 / 2 + 2 / 3 + 1 / 2 + 10 / 3 + 2 / 3 + 1, 2 / 3 + 1 / 2 + 1 / 2 + 1 / 2 + 10 / 3 + 2 / 3,
            1 / 2 + 2 / 3 + 1 / 2 + 1 / 2 + 10 / 3 + 2 / 3]
    assert rank_loads(counts, plan) == pytest.approx(want, rel=1e-12)


def test_one_slot_per_rank_is_allowed():
    assert plan_expert_distribution([5, 30, 3], 3, 1) == ((1,), (0,), (2,))
