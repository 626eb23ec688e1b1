"""The pure parts of the parallel MoE, in one process: group layout, sharding, placement and the replica split,
local routing, token order, payload packing, the EPLB planner, config validation, and world-size-1 behaviour."""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import FP64_ATOL, assert_close, make_config, make_experts, randn, random_routing
from hypothesis import given
from hypothesis import strategies as st

from nxd_moe import ExpertMLPsV2, ExpertsMode, parallel_state
from nxd_moe.config import ExpertParallelConfig
from nxd_moe.experts.backends import TorchBackend
from nxd_moe.experts.local_routing import local_routing
from nxd_moe.experts.pairs import run_experts
from nxd_moe.parallel import ExpertParallel
from nxd_moe.parallel.collectives import CommLedger, all_gather, all_reduce, reduce_scatter
from nxd_moe.parallel.eplb import plan_expert_distribution, rank_loads, replica_counts
from nxd_moe.parallel.payload import pack, unpack
from nxd_moe.parallel.placement import ExpertPlacement, pair_positions
from nxd_moe.parallel.sharding import ShardSpec, shard_state_dict, shard_tensor, tensor_parallel_slice
from nxd_moe.parallel.token_layout import TokenLayout
from nxd_moe.parallel_state import get_experts_for_expert_parallel_rank, model_parallel_layout
from nxd_moe.reference import dense_moe_reference

# ----------------------------------------------------------------------------------------------------------
# group layout (NxD's): TP contiguous, EP strided by TP


def test_layout_matches_nxd_example():
    layout = model_parallel_layout(32, 8, 2)
    assert layout.tensor_model_parallel_groups[:2] == (tuple(range(8)), tuple(range(8, 16)))
    assert layout.expert_model_parallel_groups[:3] == ((0, 8), (1, 9), (2, 10))
    assert layout.expert_model_parallel_groups[8] == (16, 24)
    assert layout.expert_data_parallel_groups[:2] == ((0, 16), (1, 17))
    assert layout.data_parallel_groups[0] == (0, 8, 16, 24)
    assert layout.moe_model_parallel_groups == (tuple(range(16)), tuple(range(16, 32)))
    assert layout.expert_data_parallel_size == 2 and layout.moe_model_parallel_size == 16


def test_hybrid_phase_groups_live_inside_the_moe_block():
    layout = model_parallel_layout(16, 2, 4, moe_prefill_tensor_model_parallel_size=1,
                                   moe_decode_expert_model_parallel_size=1)
    assert layout.moe_prefill == (1, 8) and layout.moe_decode == (8, 1)
    assert layout.moe_prefill_expert_groups == (tuple(range(8)), tuple(range(8, 16)))
    assert layout.moe_decode_tensor_groups == (tuple(range(8)), tuple(range(8, 16)))
    mixed = model_parallel_layout(8, 2, 4, moe_prefill_tensor_model_parallel_size=4)
    assert mixed.moe_prefill_tensor_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mixed.moe_prefill_expert_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize("world,tp,ep", [(8, 2, 2), (8, 4, 1), (12, 3, 2), (4, 1, 4)])
def test_every_group_kind_partitions_the_world(world, tp, ep):
    layout = model_parallel_layout(world, tp, ep)
    for kind in ("tensor_model_parallel_groups", "data_parallel_groups", "expert_model_parallel_groups",
                 "expert_data_parallel_groups", "moe_model_parallel_groups", "moe_prefill_tensor_groups",
                 "moe_decode_expert_groups"):
        ranks = sorted(r for g in getattr(layout, kind) for r in g)
        assert ranks == list(range(world)), kind


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=4, tensor_model_parallel_size=3),
     r"tensor_model_parallel_size \(3\) must divide the world size \(4\)"),
    (dict(world_size=4, tensor_model_parallel_size=2, expert_model_parallel_size=3), r"2 \* 3 = 6\) must divide"),
    (dict(world_size=4, tensor_model_parallel_size=2, expert_model_parallel_size=2,
          moe_decode_tensor_model_parallel_size=3), r"moe_decode_tensor_model_parallel_size \(3\) must divide"),
    (dict(world_size=4, tensor_model_parallel_size=2, expert_model_parallel_size=2,
          moe_prefill_tensor_model_parallel_size=2, moe_prefill_expert_model_parallel_size=1), r"must equal"),
    (dict(world_size=4, expert_model_parallel_size=4, num_experts=6), r"must divide num_experts \(6\)"),
])
def test_layout_rejects_sizes_that_do_not_divide(kwargs, message):
    with pytest.raises(ValueError, match=message):
        model_parallel_layout(**kwargs)


def test_layout_rejects_non_integer_sizes():
    with pytest.raises(TypeError, match="tensor_model_parallel_size"):
        model_parallel_layout(4, 2.0)


def test_experts_for_expert_parallel_rank():
    assert get_experts_for_expert_parallel_rank(1, 8, 4) == (2, 3)
    assert get_experts_for_expert_parallel_rank(0, 4, 2, [[3, 0], [1, 2]]) == (3, 0)
    with pytest.raises(ValueError, match="must divide num_experts"):
        get_experts_for_expert_parallel_rank(0, 6, 4)
    with pytest.raises(ValueError, match="ep_rank"):
        get_experts_for_expert_parallel_rank(4, 8, 4)


def test_getters_need_initialisation():
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.get_tensor_model_parallel_size()
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel_state.initialize_model_parallel(1, 1)
    with pytest.raises(RuntimeError, match="initialize_model_parallel first"):
        ExpertMLPsV2(make_config(), model_parallel=True)


# ----------------------------------------------------------------------------------------------------------
# sharding


def test_gate_up_shards_keep_gate_and_up_paired():
    e, h, i, tp = 3, 5, 8, 4
    gate = torch.arange(e * h * i, dtype=torch.float64).view(e, h, i)
    up = -gate - 1
    full = torch.cat([gate, up], dim=-1)
    pieces = [tensor_parallel_slice(full, 2, tp, r, stride=2) for r in range(tp)]
    width = i // tp
    for r, piece in enumerate(pieces):
        assert torch.equal(piece[..., :width], gate[..., r * width:(r + 1) * width])
        assert torch.equal(piece[..., width:], up[..., r * width:(r + 1) * width])
    assert torch.equal(torch.cat([p[..., :width] for p in pieces], -1), gate)


def test_shard_tensor_selects_experts_then_slices():
    full = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)
    spec = ShardSpec("w", experts=(3, 1), dim=1, tp_size=3, tp_rank=2)
    assert torch.equal(shard_tensor(full, spec), full[[3, 1]][:, 4:6])
    with pytest.raises(ValueError, match="divisible by stride"):
        tensor_parallel_slice(full, 1, 4, 0, stride=1)


def test_shard_state_dict_rejects_missing_and_foreign_keys():
    experts = make_experts()
    full = experts.state_dict()
    assert shard_state_dict(experts, full).keys() == full.keys()
    with pytest.raises(KeyError, match="missing"):
        shard_state_dict(experts, {k: v for k, v in full.items() if "down" not in k})
    with pytest.raises(ValueError, match="does not use"):
        shard_state_dict(experts, {**full, "extra.weight": torch.zeros(1)})


# ----------------------------------------------------------------------------------------------------------
# placement and the replica split


@pytest.mark.parametrize("distribution,message", [
    ([[0, 0], [1, 2]], "twice"),
    ([[0, 1], [2]], "same number"),
    ([[0, 1], [2, 9]], "outside"),
    ([[0, 1], [1, 2]], r"missing \[3\]"),
    ([[0, 1, 2, 3]], "lists 1 ranks"),
    ([[], []], "non-empty"),
])
def test_bad_distributions(distribution, message):
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(4, 2, distribution)


def test_bad_expert_parallel_config():
    with pytest.raises(ValueError, match="dispatch must be one of"):
        ExpertParallelConfig(dispatch="ring")
    with pytest.raises(ValueError, match="lists an expert twice"):
        ExpertParallelConfig(expert_distribution=[[1, 1]])
    with pytest.raises(TypeError, match="ExpertParallelConfig"):
        ExpertMLPsV2(make_config(), expert_parallel_config={"dispatch": "all_gather"})
    config = ExpertParallelConfig(expert_distribution=[[0, 1], [2, 3]])
    assert config.distribution_for(False, 2, 2) == ((0, 1), (2, 3))
    assert config.distribution_for(False, 2, 4) is None


def brute_positions(pair_expert: list[list[int]]) -> list[list[int]]:
    seen: dict[int, int] = {}
    out = []
    for row in pair_expert:
        out_row = []
        for e in row:
            out_row.append(seen.get(e, 0) if e >= 0 else 0)
        for e in row:
            if e >= 0:
                seen[e] = seen.get(e, 0) + 1
        out.append(out_row)
    return out


def test_pair_positions_match_a_loop():
    index = random_routing(40, 6, 3, seed=3)[1]
    index[::7, 1] = -1  # invalid pairs count nowhere
    position, counts = pair_positions(index, 6)
    assert position.tolist() == brute_positions(index.tolist())
    assert counts.tolist() == [int((index == e).sum()) for e in range(6)]


@given(st.integers(1, 4), st.integers(0, 60), st.integers(0, 1000))
def test_replica_split_is_even_and_counts_each_pair_once(copies, pairs, seed):
    distribution = [[0, 1 + r] for r in range(copies)]  # expert 0 on every rank
    placement = ExpertPlacement(copies + 1, copies, distribution)
    gen = torch.Generator().manual_seed(seed)
    experts = torch.where(torch.rand(pairs, 1, generator=gen) < 0.8, 0, -1)
    position, counts = pair_positions(experts, copies + 1)
    ranks = placement.pair_ranks(experts, position, counts)
    assert bool(((ranks >= 0) == (experts >= 0)).all())
    per_copy = [int((ranks == r).sum()) for r in range(copies)]
    assert sum(per_copy) == int(counts[0])
    assert max(per_copy) - min(per_copy) <= 1


# ----------------------------------------------------------------------------------------------------------
# local routing: the backends compute exactly this rank's pairs


@pytest.mark.parametrize("mode", ["blockwise", "selective_loading", "all_experts", "capacity_factor"])
@pytest.mark.parametrize("local", [(1, 4), (5,), (0, 2, 3, 5)])
@pytest.mark.parametrize("prescale", [False, True])
def test_local_routing_computes_exactly_the_assigned_pairs(mode, local, prescale):
    num_experts, top_k = 6, 3
    experts = make_experts(make_config(num_experts=num_experts, top_k=top_k, bias=True,
                                       early_expert_affinity_modulation=prescale), dtype=torch.float64)
    hidden = randn(20, 16, seed=1, dtype=torch.float64)
    affinities, index = random_routing(20, num_experts, top_k, seed=2, dtype=torch.float64)
    weights = affinities.gather(1, index)
    # A pair is this rank's when its expert is local and a coin says so (another copy may hold it elsewhere).
    coin = randn(20, top_k, seed=3) > -0.5
    mine = torch.isin(index, torch.tensor(local)) & coin
    slot = torch.full((num_experts,), -1, dtype=torch.int64)
    slot[list(local)] = torch.arange(len(local))
    routing = local_routing(torch.where(mine, index, -1), weights, slot, len(local), prescale)
    assert routing.expert_index.shape == (20, min(top_k, len(local)))
    assert torch.equal(routing.expert_mask.sum(dim=1), mine.sum(dim=1))
    op = experts.mlp_op
    keep = list(local)
    local_weights = experts.expert_weights()._replace(
        gate_up_proj=op.gate_up_proj.weight[keep], down_proj=op.down_proj.weight[keep],
        gate_up_bias=op.gate_up_proj.bias[keep], down_bias=op.down_proj.bias[keep])
    out = run_experts(experts.backend, hidden, routing, local_weights, ExpertsMode(mode),
                      experts.blockwise_matmul_config, capacity=20).output
    cfg = experts.routed_experts_mlp_config
    expected = dense_moe_reference(hidden, index, weights, cfg, op.gate_up_proj.weight, op.down_proj.weight,
                                   op.gate_up_proj.bias, op.down_proj.bias, keep=mine)
    assert_close(out, expected, FP64_ATOL)


# ----------------------------------------------------------------------------------------------------------
# token order


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("groups,size,batch,local_seq", [(1, 2, 1, 4), (2, 2, 3, 2), (3, 4, 2, 1), (2, 1, 2, 3)])
def test_gathered_shards_in_token_order(sp, groups, size, batch, local_seq):
    layouts = [TokenLayout(batch, local_seq, sp, size, r % size, groups, r // size) for r in range(groups * size)]
    tokens = layouts[0].num_tokens
    if sp:
        gathered = torch.cat([lay.token_ids() for lay in layouts])
        ordered = layouts[0].to_token_order(gathered.unsqueeze(1)).squeeze(1)
        assert ordered.tolist() == list(range(tokens))
        assert torch.equal(layouts[0].from_token_order(ordered.unsqueeze(1)).squeeze(1), gathered)
    # Owned rows (chunks without SP) cover every token once; segments start where their rows start.
    owned = []
    for r, lay in enumerate(layouts):
        start, stop, _ = lay.chunk()
        ids = lay.token_ids()[start:stop]
        owned += ids.tolist()
        runs = ids.view(lay.num_segments, -1)[:, 0].tolist() if ids.numel() else []
        assert runs == lay.segment_starts(r)[:len(runs)]
    if sp or size == 1:
        assert sorted(owned) == list(range(tokens))
    else:
        per_group = tokens // groups
        assert sorted(owned) == list(range(tokens)) and len(owned) == groups * per_group


def _exchange_reference(owner: torch.Tensor, num_ranks: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``destination_slots`` written as loops over rows and destinations."""
    rows = owner.shape[0]
    slot = torch.full((rows, num_ranks), -1, dtype=torch.int64)
    source = torch.full((num_ranks * rows,), -1, dtype=torch.int64)
    for r in range(num_ranks):
        going = [u for u in range(rows) if r // tp in owner[u].tolist()]
        for place, u in enumerate(going):
            slot[u, r] = place
            source[r * rows + place] = u
    return slot, source


def test_static_exchange_tables_are_keyed_by_their_sizes(monkeypatch):
    """The static all-to-all's index tables are made once per (rows, destinations, TP, device): calls with other
    sizes in any order -- and back -- give what loops over rows and destinations give, slots, buffer fields and the
    float64 combine alike. Negative control: tables of another row count (a cache keyed wrongly) are caught."""
    from nxd_moe.parallel import all_to_all

    gen = torch.Generator().manual_seed(7)
    for rows, ranks, tp in ((3, 2, 1), (5, 2, 1), (3, 4, 2), (5, 4, 1), (3, 2, 1)):
        owner = torch.randint(-1, ranks // tp, (rows, 3), generator=gen)
        slot, source = all_to_all.destination_slots(owner, ranks, tp)
        ref_slot, ref_source = _exchange_reference(owner, ranks, tp)
        assert torch.equal(slot, ref_slot) and torch.equal(source, ref_source), (rows, ranks, tp)
        experts = torch.where(owner >= 0, torch.randint(0, 8, (rows, 3), generator=gen), -1)
        hidden = torch.randn(rows, 4, generator=gen, dtype=torch.float64)
        sent_rows, sent_ids, _ = all_to_all.destination_fields(hidden, experts, torch.rand(rows, 3, generator=gen),
                                                               owner, source, tp)
        for at, u in enumerate(ref_source.tolist()):
            expected_ids = [e if o == at // rows // tp else -1 for e, o in zip(experts[u].tolist(),
                                                                             owner[u].tolist())] if u >= 0 else [-1] * 3
            assert sent_ids[at].tolist() == expected_ids
            assert torch.equal(sent_rows[at], hidden[u] if u >= 0 else torch.zeros(4, dtype=torch.float64))
        returned = torch.randn(ranks * rows, 4, generator=gen, dtype=torch.float64)
        expected = torch.zeros(rows, 4, dtype=torch.float64)
        for u in range(rows):
            for r in range(ranks):
                if ref_slot[u, r] >= 0:
                    expected[u] += returned[r * rows + ref_slot[u, r]]
        assert torch.equal(all_to_all.combine_from_destinations(returned, slot, torch.float64), expected)
    owner = torch.tensor([[0, -1], [1, 1], [-1, -1], [0, 1], [1, -1]])
    shorter, longer = (all_to_all._exchange_tables(rows, 2, 1, "cpu") for rows in (3, 8))
    monkeypatch.setattr(all_to_all, "_exchange_tables", lambda *key: shorter)
    with pytest.raises(RuntimeError, match="index"):  # too few entries for five rows
        all_to_all.destination_slots(owner, 2, 1)
    monkeypatch.setattr(all_to_all, "_exchange_tables", lambda *key: longer)
    broken = all_to_all.destination_slots(owner, 2, 1)  # runs, but places rows in the wrong buffers
    assert not all(torch.equal(a, b) for a, b in zip(broken, _exchange_reference(owner, 2, 1)))


def test_token_layout_validates():
    with pytest.raises(ValueError, match="group_rank"):
        TokenLayout(1, 4, True, 2, 2, 1, 0)


# ----------------------------------------------------------------------------------------------------------
# payload


def test_pack_unpack_round_trip():
    fields = [randn(5, 3, seed=1).to(torch.bfloat16), torch.arange(10, dtype=torch.int32).view(5, 2),
              randn(5, 2, seed=2, dtype=torch.float64), torch.arange(5, dtype=torch.int64)]
    rows, specs = pack(fields)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3 * 2 + 2 * 4 + 2 * 8 + 8)
    for a, b in zip(unpack(rows, specs), fields):
        assert a.dtype == b.dtype and torch.equal(a, b)
    empty, specs = pack([f[:0] for f in fields])
    assert [u.shape[0] for u in unpack(empty, specs)] == [0] * 4


# ----------------------------------------------------------------------------------------------------------
# EPLB planner


def zipf_counts(num_experts: int, total: int, exponent: float = 1.1) -> list[int]:
    weights = [(e + 1) ** -exponent for e in range(num_experts)]
    return [round(total * w / sum(weights)) for w in weights]


@pytest.mark.parametrize("num_experts,ep,slots", [(16, 4, 4), (16, 4, 5), (64, 8, 9), (12, 4, 3)])
def test_planner_beats_contiguous_on_zipf(num_experts, ep, slots):
    counts = zipf_counts(num_experts, 10_000)
    contiguous = [tuple(range(p * num_experts // ep, (p + 1) * num_experts // ep)) for p in range(ep)]
    plan = plan_expert_distribution(counts, ep, slots)
    assert all(len(experts) == slots and len(set(experts)) == slots for experts in plan)
    assert {e for experts in plan for e in experts} == set(range(num_experts))
    planned = rank_loads(counts, plan)
    assert math.isclose(sum(planned), sum(counts))
    assert max(planned) < max(rank_loads(counts, contiguous))
    if slots * ep > num_experts:  # redundancy: close to perfect balance
        assert max(planned) <= 1.1 * sum(counts) / ep


def test_replica_counts_go_to_the_heaviest_per_copy_load():
    assert replica_counts([90, 30, 10, 10], 6, 4) == [3, 1, 1, 1]
    assert replica_counts([0, 0, 0], 3, 1) == [1, 1, 1]


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=24), st.integers(1, 6), st.integers(0, 3))
def test_planner_is_always_a_valid_distribution(counts, ep, extra):
    slots = -(-len(counts) // ep) + extra
    if slots > len(counts):
        slots = len(counts)
    if slots * ep < len(counts):
        return
    plan = plan_expert_distribution(counts, ep, slots)
    ExpertPlacement(len(counts), ep, plan)  # validates: every expert, equal sizes, no duplicates on a rank
    assert plan == plan_expert_distribution(counts, ep, slots)  # deterministic


def test_planner_rejects_too_few_slots_and_bad_counts():
    with pytest.raises(ValueError, match="must be >= the number of experts"):
        plan_expert_distribution([1, 2, 3], 1, 2)
    with pytest.raises(ValueError, match=r"tokens_per_expert\[1\]"):
        plan_expert_distribution([1, -2], 2)


# ----------------------------------------------------------------------------------------------------------
# world size 1: trivial groups, same layer


def test_collectives_on_one_rank_move_nothing():
    ledger = CommLedger()
    x = randn(3, 2, seed=1)
    assert torch.equal(all_gather(x, None, ledger, "a"), x.unsqueeze(0))
    assert torch.equal(reduce_scatter(x.unsqueeze(0), None, ledger, "b"), x)
    assert torch.equal(all_reduce(x, None, ledger, "c"), x)
    assert ledger.total == 0 and ledger.steps == {}


def test_input_fingerprint_is_the_same_in_every_process():
    """Ranks compare a fingerprint of their inputs' description on every call: it must not depend on the process
    (``hash()`` of a str is salted per process: equal inputs would then always look different and pay the full
    comparison), and must tell descriptions apart."""
    from nxd_moe.parallel_state import fingerprint

    values = {"hidden_states": "((6, 16), torch.float32)", "seq_len": "None", "return_stats": "False"}
    code = f"from nxd_moe.parallel_state import fingerprint; print(fingerprint({values!r}))"
    root = str(Path(__file__).resolve().parents[2])
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": root}).stdout.strip()
    assert other == str(fingerprint(values))
    assert fingerprint({**values, "seq_len": "1"}) != fingerprint(values)
    assert 0 <= fingerprint(values) < 2 ** 62


@pytest.fixture
def single_rank_world():
    from parallel_harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("dispatch,splits", [("all_gather", "static"), ("all_to_all_v", "static"),
                                             ("all_to_all_v", "exact")])
def test_world_of_one(single_rank_world, dispatch, splits):
    assert parallel_state.get_moe_model_parallel_size() == 1
    cfg = make_config(num_experts=4, top_k=2)
    plain = make_experts(cfg)
    assert not ExpertMLPsV2(cfg).is_sharded  # initialised, but nothing to split: the single-device layer
    forced = ExpertMLPsV2(cfg, backend=TorchBackend(), model_parallel=True,
                          expert_parallel_config=ExpertParallelConfig(dispatch, all_to_all_splits=splits))
    forced.load_state_dict(plain.state_dict())
    hidden = randn(9, 16, seed=4)
    affinities, index = random_routing(9, 4, 2, seed=5)
    with pytest.raises(RuntimeError, match="holds one rank's shard"):
        forced(hidden, affinities, index)
    out, stats = ExpertParallel(forced)(hidden, affinities, index, return_stats=True)
    assert_close(out, plain(hidden, affinities, index), 1e-6)
    assert stats.communication == {} and stats.summary()["bytes_moved"] == 0
    assert parallel_state.start_agreement({"a": "1"}, "inputs") is None  # nothing to agree with: no exchange
    with pytest.raises(RuntimeError, match="already initialized"):
        parallel_state.initialize_model_parallel(1, 1)


def test_placement_tables_made_while_compiling_are_not_kept(monkeypatch):
    """A table first asked for inside a graph being compiled is built there and not stored: stored, it would be
    the graph's output, held across CUDA-graph replays that overwrite it (the compiled expert-parallel decode step
    on two GPUs failed that way). Built eagerly, it is kept and reused."""
    placement = ExpertPlacement(4, 2, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    in_graph = placement.local_slot(1)
    assert placement._device_tables == {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    kept = placement.local_slot(1)
    assert kept.tolist() == in_graph.tolist() == [-1, -1, 0, 1]
    assert placement.local_slot(1) is kept
