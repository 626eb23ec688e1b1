"""This rank's place in a parallel MoE (:mod:`nxd_moe.parallel.layout`) under an SPMD layout built on the CPU (no
``torch.distributed``): world 8 = TP 2 x EP 4 for the dense layers, the MoE split (TP 4, EP 2) at prefill and
(TP 1, EP 8) at decode, 16 experts -- every size and rank distinct, so a swapped phase, group or index shows.

The expected values come from the layout's stated conventions, not from its tables: block rank ``r = p * TP + q`` is
MoE EP rank ``p``, MoE TP rank ``q``; the dense layers' TP groups are consecutive ranks (token group ``r // 2``,
rank ``r % 2`` in it); expert-parallel ranks hold consecutive runs of ``E / EP`` experts."""

from __future__ import annotations

import pytest
import torch

from nxd_moe import parallel_state
from nxd_moe.experts.shard import WeightShard
from nxd_moe.moe_configs import ExpertParallelConfig
from nxd_moe.parallel.layout import ExpertShard, ExpertsParallelism, MoEGroups, held_weight_shard
from nxd_moe.parallel.placement import ExpertPlacement
from nxd_moe.parallel.token_layout import TokenLayout

WORLD, TP, EP, E = 8, 2, 4, 16
PREFILL, DECODE = (4, 2), (1, 8)  # MoE (TP, EP) per phase
BUILT = 5  # the rank whose shard is built


@pytest.fixture
def spmd():
    parallel_state.initialize_spmd_model_parallel(
        WORLD, TP, EP, rank=BUILT, moe_prefill_tensor_model_parallel_size=PREFILL[0],
        moe_prefill_expert_model_parallel_size=PREFILL[1], moe_decode_tensor_model_parallel_size=DECODE[0],
        moe_decode_expert_model_parallel_size=DECODE[1], num_experts=E)
    yield
    parallel_state.destroy_model_parallel()


def rank_tensor(r: int) -> parallel_state.SPMDRank:
    return parallel_state.SPMDRank(WORLD, TP, r)


def experts_of(ep_rank: int, ep: int) -> tuple[int, ...]:
    per = E // ep
    return tuple(range(ep_rank * per, (ep_rank + 1) * per))


def test_groups_built_for_one_program_have_sizes_and_no_rank(spmd):
    groups = MoEGroups.from_parallel_state()
    assert (groups.block_size, groups.token_group_size, groups.num_token_groups) == (WORLD, TP, EP)
    assert (groups.block_rank, groups.token_group_rank, groups.token_group_index) == (None, None, None)
    assert groups.block_group.kind == "moe_model_parallel_groups"
    assert groups.token_group.kind == "tensor_model_parallel_groups"
    assert groups.token_dp_group.kind == "expert_model_parallel_groups"
    for prefill in (True, False):
        shard = ExpertShard.from_parallel_state(prefill, E, None)
        assert (shard.tensor_parallel_rank, shard.expert_parallel_rank) == (None, None)


@pytest.mark.parametrize("r", [0, 3, 5, 6])
def test_each_rank_of_the_program_finds_its_indices(spmd, r):
    groups = MoEGroups.from_parallel_state().at(rank_tensor(r))
    assert [int(i) for i in (groups.block_rank, groups.token_group_rank, groups.token_group_index)] == \
        [r, r % TP, r // TP]
    assert (groups.block_size, groups.token_group_size, groups.num_token_groups) == (WORLD, TP, EP)
    for prefill, (tp, ep) in ((True, PREFILL), (False, DECODE)):
        shard = ExpertShard.from_parallel_state(prefill, E, None).at(rank_tensor(r), prefill)
        assert (shard.tensor_parallel_size, shard.expert_parallel_size) == (tp, ep)
        assert (int(shard.tensor_parallel_rank), int(shard.expert_parallel_rank)) == (r % tp, r // tp)
        slots = torch.full((E,), -1)
        slots[list(experts_of(r // tp, ep))] = torch.arange(E // ep)
        assert torch.equal(shard.local_slot("cpu"), slots)


def test_built_outside_one_program_the_ranks_are_this_processes(spmd, monkeypatch):
    """Not SPMD: the ranks are read from the layout's accessors (the built rank's, here)."""
    monkeypatch.setattr(parallel_state, "is_spmd", lambda: False)
    groups = MoEGroups.from_parallel_state()
    assert (groups.block_rank, groups.token_group_rank, groups.token_group_index) == (BUILT, BUILT % TP, BUILT // TP)
    for prefill, (tp, ep) in ((True, PREFILL), (False, DECODE)):
        shard = ExpertShard.from_parallel_state(prefill, E, None)
        assert (shard.tensor_parallel_size, shard.tensor_parallel_rank, shard.expert_parallel_size,
                shard.expert_parallel_rank) == (tp, BUILT % tp, ep, BUILT // tp)
        assert shard.local_experts == experts_of(BUILT // tp, ep)


def test_an_expert_distribution_reaches_the_placement(spmd):
    distribution = [[15, 14, 13, 12, 11, 10, 9, 8], [0, 1, 2, 3, 4, 5, 6, 7]]
    shard = ExpertShard.from_parallel_state(True, E, distribution).at(rank_tensor(0), True)
    slots = shard.local_slot("cpu")
    assert slots[[15, 8]].tolist() == [0, 7] and slots[:8].eq(-1).all()


def test_the_phases_and_the_rank_tensor_reach_every_part(spmd):
    parallelism = ExpertsParallelism(MoEGroups.from_parallel_state(), ExpertShard.from_parallel_state(True, E, None),
                                     ExpertShard.from_parallel_state(False, E, None))
    assert parallelism.shard(decode=True) is parallelism.decode
    assert parallelism.shard(decode=False) is parallelism.prefill
    at = parallelism.at(rank_tensor(6))
    assert int(at.groups.block_rank) == 6
    assert (int(at.prefill.tensor_parallel_rank), int(at.prefill.expert_parallel_rank)) == (2, 1)
    assert (int(at.decode.tensor_parallel_rank), int(at.decode.expert_parallel_rank)) == (0, 6)


def test_shards_hold_the_same_weights_only_with_the_same_experts_and_slice():
    placement = ExpertPlacement(E, 2, None)
    shard = ExpertShard(4, 1, 2, 0, placement)
    assert shard.holds_same_weights_as(ExpertShard(4, 1, 2, 0, placement))
    assert not shard.holds_same_weights_as(ExpertShard(4, 2, 2, 0, placement))  # another slice
    assert not shard.holds_same_weights_as(ExpertShard(2, 1, 2, 0, placement))  # slices of another width
    assert not shard.holds_same_weights_as(ExpertShard(4, 1, 2, 1, placement))  # other experts
    # the same experts by another placement object (an explicit distribution equal to the default one)
    same = ExpertPlacement(E, 2, [list(range(8)), list(range(8, 16))])
    assert shard.holds_same_weights_as(ExpertShard(4, 1, 2, 0, same))


def test_the_token_layout_gets_each_field_in_its_place():
    groups = MoEGroups(None, 8, 5, None, 2, 1, None, 4, 2)
    assert groups.token_layout(3, 6, True) == TokenLayout(3, 6, True, 2, 1, 4, 2)


def test_the_held_weight_shard_of_each_phase(spmd):
    config = ExpertParallelConfig()
    assert held_weight_shard(True, E, config) == WeightShard(experts_of(BUILT // PREFILL[0], PREFILL[1]), PREFILL[0],
                                                             BUILT % PREFILL[0])
    assert held_weight_shard(False, E, config) == WeightShard(experts_of(BUILT // DECODE[0], DECODE[1]), DECODE[0],
                                                              BUILT % DECODE[0])
    # each phase's own distribution (the built rank is EP rank 1 at prefill, 5 at decode)
    prefill = (tuple(range(15, 7, -1)), tuple(range(7, -1, -1)))
    decode = tuple((2 * p + 1, 2 * p) for p in range(8))
    config = ExpertParallelConfig(expert_distribution=prefill, decode_expert_distribution=decode)
    assert held_weight_shard(True, E, config).experts == prefill[1]
    assert held_weight_shard(False, E, config).experts == (11, 10)


def test_the_slot_table_is_made_on_the_ranks_device(spmd):
    rank = rank_tensor(3).to("meta")
    shard = ExpertShard.from_parallel_state(False, E, None).at(rank, False)
    assert shard.local_slot("meta").device.type == "meta"
