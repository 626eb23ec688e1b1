"""Details of the expert-parallel layer that the gloo worlds leave open, in one process (issue 41: mutation testing
of nxd_moe/parallel/{expert_parallel,token_layout,all_gather,shared_experts}.py): where each rank's tokens sit in
the block's token order, the all-gather dispatch and its combine, ``ExpertParallel``'s checks, routes and input
agreement, and the shared experts' reductions over the TP group.

The worlds here are *simulated*: every rank of a layout is a thread of this process, and the collectives the
parallel MoE issues over :class:`~nxd_moe.parallel_state.ReplicaGroups` (an SPMD layout's groups; their XLA ops in
:mod:`nxd_moe.parallel.xla_collectives`) are replaced by exchanges between the threads -- concatenation in group
order, sums in group-rank order -- so :mod:`nxd_moe.parallel.collectives` runs as it is, byte counts included. The
expected values are written from the conventions the modules state (token order, rank numbering, placement), as
loops in float64, never from the modules' own tables."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import FP64_ATOL, assert_close, make_config, randn, random_routing, randomize_

from nxd_moe import ExpertMLPsV2, parallel_state
from nxd_moe.config import BlockwiseMatmulConfig, ExpertParallelConfig
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.parallel import ExpertParallel, xla_collectives
from nxd_moe.parallel.all_gather import AllGatherDispatcher
from nxd_moe.parallel.all_to_all import AllToAllDispatcher
from nxd_moe.parallel.collectives import CommLedger
from nxd_moe.parallel.dispatch import DispatchInputs
from nxd_moe.parallel.layout import ExpertShard, MoEGroups
from nxd_moe.parallel.placement import ExpertPlacement
from nxd_moe.parallel.sharding import load_full_state_dict
from nxd_moe.parallel.shared_experts import shared_experts_forward
from nxd_moe.parallel.token_layout import TokenLayout
from nxd_moe.parallel_state import ReplicaGroups
from nxd_moe.reference import _shared_reference, reference_for_experts
from nxd_moe.shared_experts import SharedExperts

# ----------------------------------------------------------------------------------------------------------
# a simulated world: one thread per rank, the XLA collectives replaced by exchanges between the threads


class SimWorld:
    """Runs ``fn(rank)`` on every rank of a world of ``size`` threads; while installed (:meth:`install`), the
    collectives over a ``ReplicaGroups`` meet the other members of this rank's group. A rank that fails breaks
    every meeting, so the others fail at once instead of waiting."""

    def __init__(self, size: int):
        self.size = size
        self.local = threading.local()
        self.lock = threading.Lock()
        self.meetings: dict[tuple, tuple[threading.Barrier, list]] = {}
        self.calls: list[tuple[int, str, str]] = []  # (rank, op, group kind), in the order each rank issued them

    def install(self, monkeypatch) -> "SimWorld":
        for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
            monkeypatch.setattr(xla_collectives, op, getattr(self, op))
        return self

    def _meet(self, op: str, group: ReplicaGroups, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        rank = self.local.rank
        members = next(g for g in group.groups if rank in g)
        with self.lock:
            self.calls.append((rank, op, group.kind))
            barrier, slots = self.meetings.setdefault(
                (group.kind, members), (threading.Barrier(len(members), timeout=10), [None] * len(members)))
        place = members.index(rank)
        slots[place] = (op, x)
        barrier.wait()
        got = list(slots)
        barrier.wait()
        assert all(o == op for o, _ in got), f"ranks {members} issued different collectives: {got}"
        return [t for _, t in got], place

    @staticmethod
    def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = tensors[0].clone()
        for t in tensors[1:]:
            out += t
        return out

    def all_gather(self, x, group):
        return torch.cat(self._meet("all_gather", group, x)[0])

    def reduce_scatter(self, x, group):
        got, place = self._meet("reduce_scatter", group, x)
        n = x.shape[0] // len(got)
        return self._sum([t[place * n:(place + 1) * n] for t in got])

    def all_reduce(self, x, group):
        return self._sum(self._meet("all_reduce", group, x)[0])

    def all_to_all(self, x, group):
        got, place = self._meet("all_to_all", group, x)
        n = x.shape[0] // len(got)
        return torch.cat([t[place * n:(place + 1) * n] for t in got])

    def run(self, fn) -> list:
        results, errors = [None] * self.size, []

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 -- re-raised below, in the test's thread
                errors.append((rank, e))
                with self.lock:
                    for barrier, _ in self.meetings.values():
                        barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if errors:
            errors.sort(key=lambda item: isinstance(item[1], threading.BrokenBarrierError))
            raise errors[0][1]
        return results


def block_groups(tp: int, num_groups: int) -> dict[str, ReplicaGroups]:
    """The groups of one MoE block of ``tp * num_groups`` ranks by the layout's conventions: token groups of
    consecutive ranks, the token-DP group of the ranks with the same index in their token group."""
    m = tp * num_groups
    return dict(block=ReplicaGroups("block", (tuple(range(m)),)),
                token=ReplicaGroups("token", tuple(tuple(range(d * tp, (d + 1) * tp)) for d in range(num_groups))),
                token_dp=ReplicaGroups("token_dp", tuple(tuple(range(j, m, tp)) for j in range(tp))))


# ----------------------------------------------------------------------------------------------------------
# token layout


def ids_by_definition(batch: int, local_seq: int, sp: bool, tp: int, d: int, j: int) -> list[int]:
    """Token ids of the local ``(batch, local_seq)`` tokens of TP rank ``j`` of token group ``d``, row-major."""
    seq = local_seq * tp if sp else local_seq
    return [d * batch * seq + b * seq + (j * local_seq if sp else 0) + s
            for b in range(batch) for s in range(local_seq)]


def test_token_layout_fields_and_sizes():
    lay = TokenLayout(3, 2, True, 4, 2, 5, 1)
    assert (lay.seq_len, lay.num_local_tokens, lay.tokens_per_group, lay.num_tokens) == (8, 6, 24, 120)
    assert (lay.num_segments, lay.segment_len) == (3, 2)
    plain = TokenLayout(3, 2, False, 4, 2, 5, 1)
    assert (plain.seq_len, plain.num_local_tokens, plain.tokens_per_group, plain.num_tokens) == (2, 6, 6, 30)
    assert (plain.num_segments, plain.segment_len, plain.chunk_len) == (1, 2, 2)
    assert lay.without_rank() == TokenLayout(3, 2, True, 4, 0, 5, 0)
    assert lay == TokenLayout(3, 2, True, 4, 2, 5, 1)  # without_rank made a new one


@pytest.mark.parametrize("sp", [False, True])
def test_token_ids_of_every_rank_by_definition(sp):
    batch, local_seq, tp, groups = 3, 2, 4, 2
    lay = TokenLayout(batch, local_seq, sp, tp, 2, groups, 1)
    assert lay.token_ids().tolist() == ids_by_definition(batch, local_seq, sp, tp, 1, 2)
    for rank in range(tp * groups):  # any rank of the block, asked from this one
        assert lay.token_ids(rank).tolist() == ids_by_definition(batch, local_seq, sp, tp, rank // tp, rank % tp)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp,groups,batch,local_seq", [(2, 2, 3, 2), (3, 2, 2, 1), (1, 3, 2, 2)])
def test_rank_order_to_token_order_and_back(sp, tp, groups, batch, local_seq):
    """Rows gathered over the block in rank order (token group by token group, TP rank by TP rank) -> token order,
    with two trailing dims; without SP (gathered over the token-DP group) the order is already the token order."""
    lay = TokenLayout(batch, local_seq, sp, tp, 0, groups, 0)
    values = randn(lay.num_tokens, 2, 3, seed=3, dtype=torch.float64)
    if sp:
        gathered = torch.cat([values[ids_by_definition(batch, local_seq, sp, tp, r // tp, r % tp)]
                              for r in range(tp * groups)])
    else:
        gathered = torch.cat([values[ids_by_definition(batch, local_seq, sp, tp, d, 0)] for d in range(groups)])
    assert torch.equal(lay.to_token_order(gathered), values)
    assert torch.equal(lay.from_token_order(values), gathered)
    if not sp or tp == 1:  # nothing to permute: the same tensor, no copy
        assert lay.to_token_order(gathered) is gathered and lay.from_token_order(values) is values


@pytest.mark.parametrize("rows,tp,expected", [
    (7, 3, [(0, 3), (3, 6), (6, 7)]),
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
])
def test_chunks_split_the_shared_tokens_between_the_ranks(rows, tp, expected):
    chunk_len = -(-rows // tp)
    for j, (start, stop) in enumerate(expected):
        lay = TokenLayout(1, rows, False, tp, j, 2, 1)
        assert lay.chunk() == (start, stop, chunk_len)
        assert lay.chunk_len == lay.segment_len == chunk_len
        assert lay.segment_starts(tp + j) == [rows + min(j * chunk_len, rows)]
        assert lay.segment_starts(j) == [min(j * chunk_len, rows)]
    assert TokenLayout(2, 3, True, 4, 3, 2, 1).chunk() == (0, 6, 6)


def test_sequence_shards_own_one_segment_per_batch_row():
    lay = TokenLayout(3, 2, True, 4, 0, 2, 0)
    # block rank 6: token group 1, TP rank 2 -> each row's positions [4, 6) of 8, after group 0's 24 tokens
    assert lay.segment_starts(6) == [24 + 4, 24 + 12, 24 + 20]
    assert lay.segment_starts(1) == [2, 10, 18]
    rows = randn(6, 2, seed=1)
    assert lay.owned_rows(rows, fill=-7.0) is rows


@pytest.mark.parametrize("shape", [(5,), (5, 2), (5, 2, 3)])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_owned_rows_are_the_ranks_chunk_padded_with_fill(shape, as_tensor):
    """5 shared rows over 4 ranks: chunks of 2 -- ranks 0 and 1 full (their rows themselves, not a copy), rank 2
    one row and one fill, rank 3 only fill; the same with the rank as a 0-d tensor (selected on the device, as an
    SPMD program does)."""
    rows = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    fill = torch.full((1, *shape[1:]), -3.0, dtype=torch.float64)
    padded = torch.cat([rows, fill, fill, fill])
    for j in range(4):
        rank = torch.tensor(j) if as_tensor else j
        lay = TokenLayout(1, 5, False, 4, rank, 3, 2)
        owned = lay.owned_rows(rows, fill=-3.0)
        assert torch.equal(owned, padded[2 * j:2 * j + 2]), j
        if j < 2 and not as_tensor:
            assert owned.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    assert torch.equal(TokenLayout(1, 5, False, 4, 2, 3, 2).owned_rows(rows)[1], torch.zeros(shape[1:],
                                                                                               dtype=torch.float64))


@pytest.mark.parametrize("args,error,message", [
    ((0, 2, True, 2, 0, 1, 0), ValueError, "TokenLayout.batch must be in [1, inf], got 0"),
    ((1, 0, True, 2, 0, 1, 0), ValueError, "TokenLayout.local_seq_len must be in [1, inf], got 0"),
    ((1, 2, 1, 2, 0, 1, 0), TypeError, "TokenLayout.sequence_parallel must be a bool, got int 1"),
    ((1, 2, True, 0, 0, 1, 0), ValueError, "TokenLayout.group_size must be in [1, inf], got 0"),
    ((1, 2, True, 2, 0, 0, 0), ValueError, "TokenLayout.num_groups must be in [1, inf], got 0"),
    ((1, 2, True, 3, 3, 2, 0), ValueError, "TokenLayout.group_rank must be in [0, 2], got 3"),
    ((1, 2, True, 3, -1, 2, 0), ValueError, "TokenLayout.group_rank must be in [0, 2], got -1"),
    ((1, 2, True, 3, 0, 2, 2), ValueError, "TokenLayout.group_index must be in [0, 1], got 2"),
    ((1, 2, True, 3, 0, 2, -1), ValueError, "TokenLayout.group_index must be in [0, 1], got -1"),
])
def test_token_layout_names_each_bad_field(args, error, message):
    with pytest.raises(error) as info:
        TokenLayout(*args)
    assert str(info.value) == message


def test_tensor_ranks_are_not_range_checked_on_the_host():
    lay = TokenLayout(1, 2, False, 2, torch.tensor(1), 3, torch.tensor(2))
    assert int(lay.group_rank) == 1 and int(lay.group_index) == 2


# ----------------------------------------------------------------------------------------------------------
# the all-gather dispatch and its combine


def owners_by_definition(pair_expert: list[list[int]], distribution, capacity: int | None) -> list[list[int]]:
    """EP rank computing each pair of the block (token order), by the placement's rule: copy ``floor(pos * R / n)``
    of an expert's ``R`` serves its pair at position ``pos`` of ``n`` in token order; with a capacity, positions at
    or past it are dropped (``-1``) and ``n`` is capped at it."""
    copies = {e: [p for p, ids in enumerate(distribution) if e in ids] for row in pair_expert for e in row if e >= 0}
    total = {e: sum(row.count(e) for row in pair_expert) for e in copies}
    seen = dict.fromkeys(copies, 0)
    owners = []
    for row in pair_expert:
        owners.append([])
        for e in row:
            if e < 0:
                owners[-1].append(-1)
                continue
            pos, seen[e] = seen[e], seen[e] + 1
            n = total[e] if capacity is None else min(total[e], capacity)
            if capacity is not None and pos >= capacity:
                owners[-1].append(-1)
            else:
                owners[-1].append(copies[e][pos * len(copies[e]) // n])
    return owners


CONTIGUOUS = ((0, 1), (2, 3), (4, 5))
REPLICATED = ((0, 1, 2), (3, 4, 5), (5, 0, 3))


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("distribution,capacity,count_pairs", [
    (CONTIGUOUS, None, False), (CONTIGUOUS, None, True), (REPLICATED, None, False), (CONTIGUOUS, 3, False)])
def test_all_gather_dispatch_and_combine_by_definition(monkeypatch, sp, distribution, capacity, count_pairs):
    """A block of 3 token groups x TP 2 (block rank ``d * 2 + j``), the experts split EP 3 x TP 2 (block rank
    ``p * 2 + q``), 6 experts, top-2, bf16 tokens with float32 weights, two padded tokens. Every rank receives the
    gather group's tokens in token order -- bytes as sent -- with the pairs of its EP rank's experts (by the
    placement's rule, capacity drops included) and ``-1`` elsewhere; the combine returns each rank the sum of every
    rank's partial output over its own tokens; the ledger counts the bytes each collective brought."""
    tp, groups, batch, local_seq, num_experts, k, h = 2, 3, 2, 2, 6, 2, 4
    world = SimWorld(tp * groups).install(monkeypatch)
    g = block_groups(tp, groups)
    seq = local_seq * tp if sp else local_seq
    tokens = groups * batch * seq
    hidden = randn(tokens, h, seed=11).to(torch.bfloat16)
    affinities, index = random_routing(tokens, num_experts, k, seed=12)
    real = torch.ones(tokens, dtype=torch.bool)
    real[[1, tokens - 2]] = False
    mask = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter_(1, index, True) & real[:, None]
    affinities = torch.where(mask, affinities, 0.0)
    pair_expert = torch.where(real[:, None], index, -1)
    owners = owners_by_definition(pair_expert.tolist(), distribution, capacity)
    counts = torch.bincount(pair_expert[pair_expert >= 0], minlength=num_experts)
    placement = ExpertPlacement(num_experts, 3, distribution)
    partials = [randn(tokens, h, seed=20 + r, dtype=torch.float64) for r in range(tp * groups)]
    ledgers = [CommLedger() for _ in range(tp * groups)]

    def rank_fn(r):
        d, j = divmod(r, tp)
        ids = ids_by_definition(batch, local_seq, sp, tp, d, j)
        layout = TokenLayout(batch, local_seq, sp, tp, j, groups, d)
        moe_groups = MoEGroups(g["block"], tp * groups, r, g["token"], tp, j, g["token_dp"], groups, d)
        shard = ExpertShard(2, r % 2, 3, r // 2, placement)
        routing = Routing(index[ids], mask[ids], affinities[ids], False, True)
        dispatcher = AllGatherDispatcher()
        sent = dispatcher.dispatch(DispatchInputs(hidden[ids], routing, layout, moe_groups, shard, capacity,
                                                  ledgers[r], "static", count_pairs))
        after_dispatch = dict(ledgers[r].steps)
        return sent, after_dispatch, dispatcher.combine(partials[r], sent.handle), ids

    n_local = batch * local_seq
    gather_size = tp * groups if sp else groups
    for r, (sent, after_dispatch, result, ids) in enumerate(world.run(rank_fn)):
        assert sent.rows.dtype == torch.bfloat16 and torch.equal(sent.rows, hidden)
        assert sent.pair_expert.dtype == torch.int64
        expected = [[e if o == r // 2 else -1 for e, o in zip(row, own)] for row, own in
                    zip(pair_expert.tolist(), owners)]
        assert sent.pair_expert.tolist() == expected, r
        assert sent.pair_weight.dtype == torch.float32
        assert torch.equal(sent.pair_weight, affinities.gather(1, index))
        assert sent.routing is None
        if count_pairs or capacity is not None or distribution is REPLICATED:
            assert torch.equal(result.pairs_per_expert, counts)
        else:
            assert result.pairs_per_expert is None
        assert_sum_of_partials(result.output, [p[ids] for p in partials])
        assert after_dispatch == {"dispatch": (gather_size - 1) * n_local * (h * 2 + k * 4 + k * 4)}
        row_bytes = n_local * h * 8
        combined = ({"combine": (tp * groups - 1) * row_bytes} if sp else
                    {"combine": (groups - 1) * row_bytes, "tensor_parallel_reduce": 2 * (tp - 1) * row_bytes // tp})
        assert ledgers[r].steps == {**after_dispatch, **combined}
        ops = [(op, kind) for rank, op, kind in world.calls if rank == r]
        assert ops == ([("all_gather", "block"), ("reduce_scatter", "block")] if sp else
                       [("all_gather", "token_dp"), ("reduce_scatter", "token_dp"), ("all_reduce", "token")])


def assert_sum_of_partials(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``out`` is the float64 sum of ``parts``: each addition rounds by at most one float64 unit of the running
    sum, so the bound is the number of additions times eps times the largest partial sum."""
    expected = torch.zeros_like(parts[0])
    for p in parts:
        expected += p
    bound = len(parts) * torch.finfo(torch.float64).eps * sum(p.abs() for p in parts).max()
    assert out.dtype == torch.float64 and out.shape == expected.shape
    assert (out - expected).abs().max() <= bound


# ----------------------------------------------------------------------------------------------------------
# ExpertParallel over a simulated world of 8 ranks: dense TP 2 x EP 4 (4 token groups), the MoE split TP 4 x EP 2
# at prefill and TP 1 x EP 8 at decode, each phase with its own expert distribution -- every size, rank and
# placement distinct, so a swapped phase, group or distribution shows.

WORLD, TP, EP, E, H, K = 8, 2, 4, 16, 8, 3
PREFILL, DECODE = (4, 2), (1, 8)  # MoE (TP, EP) per phase
PREFILL_DIST = (tuple(range(15, 7, -1)), tuple(range(7, -1, -1)))
DECODE_DIST = tuple((2 * p + 1, 2 * p) for p in range(8))
CFG = make_config(num_experts=E, hidden_size=H, intermediate_size=8, top_k=K, capacity_factor=0.75)
BUILT = 5  # the rank an SPMD program is built for, and the single-rank tests' rank: token group 2, TP rank 1;
# prefill EP 1 / TP 1, decode EP 5 / TP 0


def init_layout(rank: int = 0, prefill=PREFILL) -> None:
    parallel_state.initialize_spmd_model_parallel(
        WORLD, TP, EP, rank=rank, moe_prefill_tensor_model_parallel_size=prefill[0],
        moe_prefill_expert_model_parallel_size=prefill[1], moe_decode_tensor_model_parallel_size=DECODE[0],
        moe_decode_expert_model_parallel_size=DECODE[1], num_experts=E)


@pytest.fixture
def layout():
    """Leaves no layout behind (the tests initialise one per rank they build)."""
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def full():
    """The single-device experts (float64) whose weights every rank's shard is cut from."""
    return randomize_(ExpertMLPsV2(CFG, BlockwiseMatmulConfig(block_size=4), dtype=torch.float64,
                                   model_parallel=False), seed=3)


def shard_of(full: ExpertMLPsV2, rank: int, config: ExpertParallelConfig) -> ExpertMLPsV2:
    """Rank ``rank``'s shard of ``full`` (built while the layout names it)."""
    init_layout(rank)
    try:
        experts = ExpertMLPsV2(CFG, BlockwiseMatmulConfig(block_size=4), dtype=torch.float64,
                               expert_parallel_config=config)
        return load_full_state_dict(experts, full.state_dict())
    finally:
        parallel_state.destroy_model_parallel()


def as_one_program(make, rank: int):
    """What one SPMD program runs on rank ``rank``: the module built for rank ``BUILT`` (the Python values traced
    into the program) holding ``rank``'s weights and rank tensor (the program's inputs on that rank) -- so only
    what is computed from the rank tensor can tell the ranks apart."""
    program = make(BUILT)
    program.load_state_dict(make(rank).state_dict())
    assert int(program.spmd_rank.rank) == rank
    return program


def every_rank(full: ExpertMLPsV2, config: ExpertParallelConfig, spmd: bool) -> list:
    """Each rank's ``ExpertParallel``, then the layout the calls read: each built under its own rank in a process
    layout; in an SPMD one, every rank's runs the program built for ``BUILT`` (:func:`as_one_program`)."""
    layers = []
    for r in range(WORLD):
        experts = as_one_program(lambda q: shard_of(full, q, config), r) if spmd else shard_of(full, r, config)
        init_layout(BUILT if spmd else r)
        try:
            layers.append(ExpertParallel(experts))
        finally:
            parallel_state.destroy_model_parallel()
    init_layout(0)
    return layers


def block_inputs(tokens: int, seed: int):
    hidden = randn(tokens, H, seed=seed, dtype=torch.float64)
    affinities, index = random_routing(tokens, E, K, seed=seed + 1, dtype=torch.float64, skew=0.4)
    return hidden, affinities, index


def first_come_first_served(index: torch.Tensor, capacity: int, real: torch.Tensor) -> torch.Tensor:
    """``(T, k)``: the pairs an expert admits, its first ``capacity`` real pairs in token order."""
    taken, keep = [0] * E, torch.zeros(index.shape, dtype=torch.bool)
    for t, row in enumerate(index.tolist()):
        for j, e in enumerate(row):
            if real[t] and taken[e] < capacity:
                taken[e], keep[t, j] = taken[e] + 1, True
    return keep


# name: (batch, local_seq, sequence_parallel, seq_len, extras); the config's capacity factor makes capacity_factor
# the default mode of a prefill, so the other prefills force dropless modes
CASES = {
    "prefill_sp_capacity": (2, 3, True, None, {"capacity": True}),
    "prefill_shared_tokens": (2, 3, False, 3, {"mode": "blockwise", "padding": True, "addend": True}),
    "prefill_sp_selective": (2, 3, True, 6, {"mode": "selective_loading", "padding": True}),
    "decode": (3, 1, False, 1, {"addend": True}),
}


@pytest.mark.parametrize("spmd", [False, True])
@pytest.mark.parametrize("dispatch,micro_batches", [("all_gather", None), ("all_to_all_v", None),
                                                    ("all_to_all_v", 3)])
def test_expert_parallel_matches_the_float64_reference_in_every_phase(monkeypatch, layout, full, spmd, dispatch,
                                                                      micro_batches):
    """Every rank's output for its own tokens is the single-device float64 reference over the block's tokens in
    token order (padded tokens: only the addend; capacity: each expert's first pairs of the block) -- with the
    static all-to-all in three micro-batches too (two where a rank owns two rows: the decode)."""
    world = SimWorld(WORLD).install(monkeypatch)
    if not spmd:  # the same layout, every rank's indices Python ints: a torch.distributed layout's code path
        monkeypatch.setattr(parallel_state, "is_spmd", lambda: False)
    config = ExpertParallelConfig(dispatch, PREFILL_DIST, decode_expert_distribution=DECODE_DIST,
                                  micro_batches=micro_batches)
    runs = []  # the experts' runs of each call, per rank (a part each under micro-batches)
    compute = ExpertMLPsV2.compute
    monkeypatch.setattr(ExpertMLPsV2, "compute", lambda self, *a, **k: runs.append(1) or compute(self, *a, **k))
    layers = every_rank(full, config, spmd)
    for name, (batch, local_seq, sp, seq_len, extras) in CASES.items():
        seq = local_seq * TP if sp else local_seq
        tokens = EP * batch * seq
        hidden, affinities, index = block_inputs(tokens, seed=40 + len(name))
        real = torch.ones(tokens, dtype=torch.bool)
        if extras.get("padding"):
            real[[0, 5, tokens - 1]] = False
        keep = real[:, None].expand(-1, K)
        if extras.get("capacity"):
            keep = first_come_first_served(index, -(-tokens * K * 3 // (4 * E)), real)
        expected = reference_for_experts(full, hidden, affinities, index, keep=keep)
        addend = randn(tokens, H, seed=7, dtype=torch.float64) if extras.get("addend") else None
        if addend is not None:
            expected = expected + addend

        def rank_fn(r, batch=batch, local_seq=local_seq, sp=sp, seq_len=seq_len, extras=extras, addend=addend,
                    real=real, hidden=hidden, affinities=affinities, index=index):
            ids = ids_by_definition(batch, local_seq, sp, TP, r // TP, r % TP)
            kwargs = dict(mode=extras.get("mode"))
            if sp or r % 2:  # the other shared-token ranks take the default layout (one row of all their tokens)
                kwargs["token_layout"] = layers[r].token_layout(batch, local_seq, sp)
            if extras.get("padding"):
                kwargs["padding_mask"] = real[ids]
            if addend is not None:
                kwargs["addend"] = addend[ids]
            return layers[r](hidden[ids], affinities[ids], index[ids], seq_len, **kwargs)

        runs.clear()
        for r, out in enumerate(world.run(rank_fn)):
            ids = ids_by_definition(batch, local_seq, sp, TP, r // TP, r % TP)
            assert_close(out, expected[ids], FP64_ATOL, msg=f"{name}, rank {r}")
        owned = batch * local_seq if sp else -(-batch * local_seq // TP)
        assert len(runs) == WORLD * (min(micro_batches, owned) if micro_batches else 1), (name, len(runs))


def one_rank(full, config, monkeypatch, spmd: bool):
    """Rank ``BUILT``'s ``ExpertParallel``, the layout left naming it; its experts' ``routed_forward`` and
    ``check_inputs`` replaced by spies (``calls``): nothing is computed or exchanged."""
    if not spmd:
        monkeypatch.setattr(parallel_state, "is_spmd", lambda: False)
    experts = shard_of(full, BUILT, config)
    init_layout(BUILT)
    layer = ExpertParallel(experts)
    calls = {"routed_forward": [], "check_inputs": []}
    check_inputs = experts.check_inputs

    def spy_check(*args):
        calls["check_inputs"].append(args)
        return check_inputs(*args)

    monkeypatch.setattr(experts, "check_inputs", spy_check)
    monkeypatch.setattr(experts, "routed_forward", lambda *args, **kwargs: calls["routed_forward"].append(
        (args, kwargs)) or "out")
    return layer, calls


class Agreements:
    """Stands in for ``parallel_state.start_agreement``: records each call, returns a token for the route."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(parallel_state, "start_agreement", self)

    def __call__(self, values, what, digest=None):
        self.calls.append((values, what, digest))
        return ("agreement", len(self.calls))


def slots_by_definition(experts: tuple[int, ...]) -> list[int]:
    return [experts.index(e) if e in experts else -1 for e in range(E)]


def test_each_call_routes_its_tokens_with_the_phases_shard_and_the_configs_settings(monkeypatch, layout, full):
    config = ExpertParallelConfig("all_to_all_v", PREFILL_DIST, all_to_all_splits="exact",
                                  decode_expert_distribution=DECODE_DIST)
    layer, calls = one_rank(full, config, monkeypatch, spmd=False)
    agreements = Agreements(monkeypatch)
    hidden, affinities, index = block_inputs(12, seed=60)
    mask, addend = torch.arange(12) % 5 != 2, randn(12, H, seed=61, dtype=torch.float64)
    token_layout = layer.token_layout(2, 6, True)
    assert layer(hidden, affinities, index, 6, mask, mode="blockwise", return_stats=True, token_layout=token_layout,
                 addend=addend, check_index=False) == "out"
    (args, kwargs), = calls["routed_forward"]
    assert args[:5] == (hidden, affinities, index, 6, mask) and kwargs == dict(
        mode="blockwise", return_stats=True, addend=addend, check_index=False, checked=True)
    route = args[5]
    assert type(route.dispatcher) is AllToAllDispatcher
    assert route.layout is token_layout and route.groups is layer.groups
    assert route.shard is layer.parallelism.prefill
    assert route.shard.local_experts == PREFILL_DIST[1] and route.shard.tensor_parallel_rank == 1
    assert type(route.ledger) is CommLedger and route.ledger.steps == {}
    assert (route.all_to_all_splits, route.name, route.local_slot, route.intermediate_part) == (
        "exact", "all_to_all_v", None, None)
    assert (route.micro_batches, route.transport) == (1, "nccl")
    assert route.agreement == ("agreement", 1) and len(agreements.calls) == 1
    assert calls["check_inputs"] == [(hidden, affinities, index, 6, mask, False)]

    # decode, the default token layout: one row of this rank's tokens, shared with its token group
    layer(hidden[:3], affinities[:3], index[:3], 1)
    (args, kwargs) = calls["routed_forward"][1]
    assert kwargs == dict(mode=None, return_stats=False, addend=None, check_index=True, checked=True)
    route = args[5]
    assert route.layout == TokenLayout(1, 3, False, TP, 1, EP, 2)
    assert route.shard is layer.parallelism.decode and route.shard.local_experts == DECODE_DIST[5]
    assert route.ledger is not calls["routed_forward"][0][0][5].ledger  # a new ledger per call
    assert calls["check_inputs"][1][5] is True

    # the static exchange over NVLink, and forced micro-batches: the route carries them
    for settings, expected in ((dict(transport="nvlink"), (1, "nvlink")), (dict(micro_batches=2), (2, "nccl"))):
        static = ExpertParallelConfig("all_to_all_v", PREFILL_DIST, decode_expert_distribution=DECODE_DIST,
                                      **settings)
        parallel_state.destroy_model_parallel()
        other, other_calls = one_rank(full, static, monkeypatch, spmd=False)
        other(hidden, affinities, index, 6, token_layout=other.token_layout(2, 6, True))
        route = other_calls["routed_forward"][0][0][5]
        assert (route.micro_batches, route.transport) == expected, settings


def test_ranks_agree_on_every_input_that_shapes_the_exchange(monkeypatch, layout, full):
    """The description each call sends for the ranks to compare, written out; a steady call sends the description
    made for its first call, and changing any one input (shape, each token-layout field, seq_len, mode, padding,
    addend, statistics) makes a new one. While compiling, nothing is sent."""
    layer, _ = one_rank(full, ExpertParallelConfig("all_gather", PREFILL_DIST), monkeypatch, spmd=False)
    agreements = Agreements(monkeypatch)
    hidden, affinities, index = block_inputs(6, seed=62)
    base = dict(hidden_states="((6, 8), torch.float64)", token_layout="(2, 3, False)", seq_len="None",
                mode="None", padding_mask="False", addend="False", return_stats="False")
    steps = [  # (call arguments, what differs from the base description)
        (dict(token_layout=(2, 3, False)), {}),
        (dict(token_layout=(2, 3, False)), {}),
        (dict(token_layout=(3, 2, False)), dict(token_layout="(3, 2, False)")),
        (dict(token_layout=(2, 3, True)), dict(token_layout="(2, 3, True)")),
        (dict(token_layout=(2, 3, False), seq_len=3), dict(seq_len="3")),
        (dict(token_layout=(2, 3, False), mode="all_experts"), dict(mode="'all_experts'")),
        # the same mode as an enum member: the same description (ranks naming it differently agree)
        (dict(token_layout=(2, 3, False), mode=ExpertsMode.ALL_EXPERTS), dict(mode="'all_experts'")),
        (dict(token_layout=(2, 3, False), padding_mask=torch.ones(6, dtype=torch.bool)), dict(padding_mask="True")),
        (dict(token_layout=(2, 3, False), addend=hidden), dict(addend="True")),
        (dict(token_layout=(2, 3, False), return_stats=True), dict(return_stats="True")),
        (dict(token_layout=(1, 4, False), rows=4), dict(hidden_states="((4, 8), torch.float64)",
                                                       token_layout="(1, 4, False)")),
    ]
    for call, differs in steps:
        call = dict(call)
        rows = call.pop("rows", 6)
        call["token_layout"] = layer.token_layout(*call["token_layout"])
        layer(hidden[:rows], affinities[:rows], index[:rows], call.pop("seq_len", None), call.pop("padding_mask", None),
              **call)
        values, what, digest = agreements.calls[-1]
        assert values == {**base, **differs} and what == "MoE inputs"
        assert digest == parallel_state.fingerprint(values)
    assert agreements.calls[1][0] is agreements.calls[0][0]  # the steady call reused the first call's description
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    before = len(agreements.calls)
    layer(hidden, affinities, index)
    assert len(agreements.calls) == before


def test_token_layouts_are_kept_per_shape_except_in_an_spmd_program(monkeypatch, layout, full):
    layer, _ = one_rank(full, ExpertParallelConfig("all_gather"), monkeypatch, spmd=False)
    first = layer.token_layout(2, 3, True)
    assert first == TokenLayout(2, 3, True, TP, 1, EP, 2)
    assert layer.token_layout(2, 3, True) is first
    assert layer.token_layout(2, 3, False) == TokenLayout(2, 3, False, TP, 1, EP, 2)
    assert layer.token_layout(3, 2, True) == TokenLayout(3, 2, True, TP, 1, EP, 2)
    parallel_state.destroy_model_parallel()
    monkeypatch.undo()
    spmd_layer, _ = one_rank(full, ExpertParallelConfig("all_gather"), monkeypatch, spmd=True)
    traced = spmd_layer.token_layout(2, 3, True)
    assert (traced.batch, traced.local_seq_len, traced.sequence_parallel) == (2, 3, True)
    assert (int(traced.group_rank), int(traced.group_index)) == (1, 2)
    assert spmd_layer.token_layout(2, 3, True) is not traced


def test_an_spmd_route_holds_the_ranks_slots_and_slice_as_tensors(monkeypatch, layout, full):
    config = ExpertParallelConfig("all_gather", PREFILL_DIST, decode_expert_distribution=DECODE_DIST)
    layer, calls = one_rank(full, config, monkeypatch, spmd=True)
    agreements = Agreements(monkeypatch)
    hidden, affinities, index = block_inputs(6, seed=63)
    layer(hidden, affinities, index, 3, token_layout=layer.token_layout(2, 3, True))
    layer(hidden, affinities, index, 1)
    prefill, decode = (args[5] for args, _ in calls["routed_forward"])
    assert prefill.local_slot.tolist() == slots_by_definition(PREFILL_DIST[1])
    assert int(prefill.intermediate_part) == 1
    assert int(prefill.shard.expert_parallel_rank) == 1 and int(prefill.groups.block_rank) == BUILT
    assert decode.local_slot.tolist() == slots_by_definition(DECODE_DIST[5])
    assert int(decode.intermediate_part) == 0 and int(decode.shard.expert_parallel_rank) == 5
    assert decode.layout.sequence_parallel is False and int(decode.layout.group_index) == 2
    assert len(agreements.calls) == 2  # asked (the layout answers None in an SPMD program)
    with pytest.raises(ValueError) as info:
        layer(hidden, affinities, index, return_stats=True)
    assert str(info.value) == ("ExpertParallel: return_stats=True is not available in an SPMD program (the "
                               "statistics name this rank's experts as Python values); trace without it")
    assert len(calls["routed_forward"]) == 2 and len(agreements.calls) == 2


def test_a_token_layout_of_other_tokens_is_refused(monkeypatch, layout, full):
    layer, calls = one_rank(full, ExpertParallelConfig("all_gather"), monkeypatch, spmd=False)
    hidden, affinities, index = block_inputs(6, seed=64)
    for bad in (layer.token_layout(2, 2, False), (1, 6, False)):
        with pytest.raises(ValueError) as info:
            layer(hidden, affinities, index, token_layout=bad)
        assert str(info.value) == f"ExpertParallel: token_layout must be a TokenLayout of 6 local tokens, got {bad!r}"
    with pytest.raises(RuntimeError, match=r"^ExpertMLPsV2: expert_index values must be in \[0, 15\]$"):
        layer(hidden, affinities, torch.where(torch.arange(6)[:, None] == 4, E, index))
    with pytest.raises(ValueError, match="^ExpertMLPsV2: addend must be a tensor shaped"):
        layer(hidden, affinities, index, addend=hidden[:3])
    assert calls["routed_forward"] == []


def test_experts_the_layer_cannot_serve_are_refused(monkeypatch, layout, full):
    needs = ("ExpertParallel needs an ExpertMLPsV2 that holds a shard (built while nxd_moe.parallel_state was "
             "initialised, model_parallel not False)")
    init_layout(BUILT)
    for experts in (ExpertMLPsV2(CFG, model_parallel=False), SimpleNamespace(is_sharded=True),
                    SimpleNamespace(routed_forward=None)):
        with pytest.raises(ValueError) as info:
            ExpertParallel(experts)
        assert str(info.value) == needs
    spmd_experts = ExpertMLPsV2(CFG, expert_parallel_config=ExpertParallelConfig("all_to_all_v",
                                                                                 all_to_all_splits="exact"))
    with pytest.raises(ValueError) as info:
        ExpertParallel(spmd_experts)
    assert str(info.value) == ("ExpertParallelConfig.all_to_all_splits='exact' reads the split sizes on the host, "
                               "which an SPMD program cannot do; use all_to_all_splits='static'")
    built_for = "ExpertParallel: the experts were built for {}, not for the layout nxd_moe.parallel_state holds " \
                "now; build them again"
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "is_spmd", lambda: False)
        with pytest.raises(RuntimeError) as info:
            ExpertParallel(spmd_experts)
        assert str(info.value) == built_for.format("an SPMD program")
        plain = ExpertMLPsV2(CFG)
    with pytest.raises(RuntimeError) as info:
        ExpertParallel(plain)
    assert str(info.value) == built_for.format("torch.distributed")
    # another rank's shard: an SPMD program compares only what every rank shares; a process, its own shard
    other = ExpertMLPsV2(CFG)
    parallel_state.destroy_model_parallel()
    init_layout(2)
    assert ExpertParallel(other).experts is other
    another = "ExpertParallel: the experts were built under another parallel layout than the one " \
              "nxd_moe.parallel_state holds now; build them again"
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "is_spmd", lambda: False)
        with pytest.raises(RuntimeError) as info:
            ExpertParallel(plain)
        assert str(info.value) == another
    parallel_state.destroy_model_parallel()
    init_layout(BUILT, prefill=(2, 4))
    with pytest.raises(RuntimeError) as info:
        ExpertParallel(other)
    assert str(info.value) == another


# ----------------------------------------------------------------------------------------------------------
# shared experts over the TP group (token groups of 2 consecutive ranks in the same world of 8)


@pytest.fixture(scope="module")
def full_shared():
    return randomize_(SharedExperts(H, 6, 2, "silu", dtype=torch.float64, fused_gate_up_projection=True,
                                    shared_expert_gate=True, model_parallel=False), seed=8)


def shared_of(full_shared, rank: int, replicated: bool):
    """Rank ``rank``'s shared experts (whole, replicated weights or its slice), built while the layout names it."""
    init_layout(rank)
    try:
        shared = SharedExperts(H, 6, 2, "silu", dtype=torch.float64, fused_gate_up_projection=True,
                               shared_expert_gate=True, sequence_parallel_enabled=replicated)
        return load_full_state_dict(shared, full_shared.state_dict())
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("spmd", [False, True])
@pytest.mark.parametrize("replicated", [False, True])
def test_shared_experts_reduce_their_slices_over_the_tp_group(monkeypatch, layout, full_shared, spmd, replicated):
    """Each rank's output for its rows is the whole shared expert's (float64 reference): a shared ``(B, S, H)``
    input through each rank's slice and an all-reduce; a sequence shard ``(B, S_r, H)`` through the slices of the
    group's gathered tokens and a reduce-scatter -- or, with replicated weights, locally. The ledger names each
    step with the bytes it brought."""
    world = SimWorld(WORLD).install(monkeypatch)
    if not spmd:
        monkeypatch.setattr(parallel_state, "is_spmd", lambda: False)
    if spmd:  # one program for every rank
        ranks = [as_one_program(lambda q: shared_of(full_shared, q, replicated), r) for r in range(WORLD)]
    else:
        ranks = [shared_of(full_shared, r, replicated) for r in range(WORLD)]
    assert all(s.intermediate_shard[0] == TP and (s.spmd_rank is not None) == spmd for s in ranks)
    init_layout(0)
    batch, local_seq = 2, 3
    tokens = randn(EP, batch, local_seq * TP, H, seed=9, dtype=torch.float64)
    expected = _shared_reference(full_shared, tokens.reshape(-1, H)).reshape(tokens.shape)
    ledgers = [CommLedger() for _ in range(WORLD)]

    def rank_fn(r):
        d, j = divmod(r, TP)
        shard = tokens[d, :, j * local_seq:(j + 1) * local_seq]
        sharded = shared_experts_forward(ranks[r], shard, True, ledgers[r] if r % 3 else None)
        whole = shared_experts_forward(ranks[r], tokens[d], False, ledgers[r] if r % 3 else None)
        return sharded, whole

    for r, (sharded, whole) in enumerate(world.run(rank_fn)):
        d, j = divmod(r, TP)
        for out, ref in ((sharded, expected[d, :, j * local_seq:(j + 1) * local_seq]), (whole, expected[d])):
            assert_close(out, ref, FP64_ATOL, msg=f"rank {r}")
        shard_bytes, whole_bytes = batch * local_seq * H * 8, batch * local_seq * TP * H * 8
        ops = [(op, kind) for rank, op, kind in world.calls if rank == r]
        if replicated:  # the shard computed here, the shared input sliced then summed
            assert ops == [("all_reduce", "tensor_model_parallel_groups")]
            assert ledgers[r].steps == ({"shared_reduce": whole_bytes} if r % 3 else {})
        else:
            assert ops == [("all_gather", "tensor_model_parallel_groups"),
                           ("reduce_scatter", "tensor_model_parallel_groups"),
                           ("all_reduce", "tensor_model_parallel_groups")]
            assert ledgers[r].steps == ({"shared_gather": shard_bytes, "shared_reduce": shard_bytes + whole_bytes}
                                        if r % 3 else {})


def test_shared_experts_on_one_device_and_a_flat_sequence_shard(monkeypatch, layout, full_shared):
    x = randn(5, H, seed=10, dtype=torch.float64)
    ledger = CommLedger()
    for sp in (False, True):  # no slice: the whole shared expert, nothing exchanged
        out = shared_experts_forward(full_shared, x, sp, ledger)
        assert_close(out, _shared_reference(full_shared, x), FP64_ATOL)
    assert ledger.steps == {}
    monkeypatch.setattr(parallel_state, "is_spmd", lambda: False)
    sliced = shared_of(full_shared, 3, False)
    init_layout(3)
    with pytest.raises(ValueError) as info:
        shared_experts_forward(sliced, x, True)
    assert str(info.value) == "SharedExperts: a sequence-parallel input must be (B, S_r, H), got (5, 8)"


def test_a_name_that_is_no_mode_is_described_as_given(monkeypatch, layout, full):
    """A mode name that names no mode reaches the ranks' comparison as given -- not as "no mode", and not as an
    error of the comparison itself (the routed pipeline is the one that refuses it, by name)."""
    layer, _ = one_rank(full, ExpertParallelConfig("all_gather", PREFILL_DIST), monkeypatch, spmd=False)
    agreements = Agreements(monkeypatch)
    hidden, affinities, index = block_inputs(6, seed=63)
    layer(hidden, affinities, index, None, None, token_layout=layer.token_layout(2, 3, False), mode="sparse")
    assert agreements.calls[-1][0]["mode"] == "'sparse'"
