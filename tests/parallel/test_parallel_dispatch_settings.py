"""The token dispatchers and the collectives under them, in one process (issue 41: mutation testing of
nxd_moe/parallel/{dispatch,dispatches,all_to_all,collectives}.py).

The ranks of a world run as threads of this process, and ``torch.distributed``'s collectives among them are
written from their definitions (:class:`FakeWorld`): a world of 4 costs milliseconds, where gloo processes cost
seconds. Every dispatch is checked against references written from the contract: values that are exact in their
dtype (small integers, dyadic weights), so outputs compare with ``torch.equal``; which pairs each rank computes, in
which row order; the bytes each step records.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.parallel import all_to_all as a2a
from nxd_moe.parallel import collectives
from nxd_moe.parallel.all_gather import AllGatherDispatcher
from nxd_moe.parallel.all_to_all import AllToAllDispatcher, OwnedPairs
from nxd_moe.parallel.collectives import CommLedger
from nxd_moe.parallel.dispatch import (
    LOCAL,
    ONE_DEVICE,
    Dispatched,
    DispatchInputs,
    DispatchResult,
    LocalDispatcher,
    Route,
)
from nxd_moe.parallel.dispatches import DISPATCHERS, get_dispatcher
from nxd_moe.parallel.layout import ExpertShard, MoEGroups
from nxd_moe.parallel.placement import ExpertPlacement
from nxd_moe.parallel.token_layout import TokenLayout
from nxd_moe.parallel_state import ReplicaGroups

# ----------------------------------------------------------------------------------------------------------
# a world of threads


class FakeGroup:
    """The ranks ``members`` (global ids) of a :class:`FakeWorld`; a collective deposits each rank's input, waits
    for all, and each rank reads what it needs."""

    def __init__(self, world: "FakeWorld", members):
        self.world, self.members = world, tuple(members)
        self.barrier = threading.Barrier(len(self.members), timeout=20)
        self.deposits: list = [None] * len(self.members)
        world.groups.append(self)

    def exchange(self, item) -> tuple[int, list]:
        me = self.members.index(self.world.local.rank)
        self.deposits[me] = item
        self.barrier.wait()
        everything = list(self.deposits)
        self.barrier.wait()  # nobody deposits the next collective's input before every rank has read this one's
        return me, everything


class FakeWorld:
    """Ranks as threads; :meth:`dist` is the ``torch.distributed`` subset the collectives call, by definition."""

    def __init__(self, size: int):
        self.size, self.local, self.groups = size, threading.local(), []
        self.calls: list[tuple[str, int]] = []
        self.log: list[tuple[int, str, str]] = []  # async all-to-alls: (rank, "start" | "wait", "rows" | "partials")

    def group(self, members) -> FakeGroup:
        return FakeGroup(self, members)

    @staticmethod
    def _contiguous(*tensors):
        for t in tensors:
            assert t.is_contiguous(), "gloo takes contiguous tensors only"

    def all_gather_into(self, out, x, group):
        self._contiguous(out, x)
        _, xs = group.exchange(x.clone())
        out.copy_(torch.cat(xs))

    def reduce_scatter_into(self, out, flat, group):
        self._contiguous(out, flat)
        me, flats = group.exchange(flat.clone())
        total = torch.zeros_like(out)
        for f in flats:  # in rank order
            total += f.chunk(len(flats))[me]
        out.copy_(total)

    def all_reduce(self, t, group):
        self._contiguous(t)
        _, ts = group.exchange(t.clone())
        total = torch.zeros_like(t)
        for x in ts:
            total += x
        t.copy_(total)

    def all_to_all_single(self, out, x, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        self._contiguous(out, x)
        me, sent = group.exchange((x.clone(), input_split_sizes))
        size = len(sent)
        pieces = [s.split(list(splits) if splits is not None else s.shape[0] // size)[me] for s, splits in sent]
        expected = list(output_split_sizes) if output_split_sizes is not None else [out.shape[0] // size] * size
        assert [p.shape[0] for p in pieces] == expected, "the receive splits do not match what the ranks send"
        received = torch.cat(pieces)
        if not async_op:
            out.copy_(received)
            return None
        # Started, not done: until wait() the buffer holds bytes no exchange sent (all ones: ids -1, NaN floats),
        # so a reader that does not wait computes something else.
        out.copy_(torch.full_like(out, -1) if not out.is_floating_point() else torch.full_like(out, float("nan")))
        what = "partials" if out.is_floating_point() else "rows"  # the combine's floats, the dispatch's bytes
        self.log.append((me, "start", what))
        return SimpleNamespace(wait=lambda: self.log.append((me, "wait", what)) or out.copy_(received))

    def install(self, monkeypatch) -> None:
        fake = SimpleNamespace(get_world_size=lambda group: len(group.members), all_reduce=self.all_reduce,
                               all_to_all_single=self.all_to_all_single)
        monkeypatch.setattr(collectives, "dist", fake)
        monkeypatch.setattr(collectives, "_all_gather_into", self.all_gather_into)
        monkeypatch.setattr(collectives, "_reduce_scatter_into", self.reduce_scatter_into)

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank, each in its thread; the first exception of any rank is raised."""
        results: list = [None] * self.size
        errors: list = []

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
                for g in self.groups:
                    g.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        assert not any(t.is_alive() for t in threads), "a rank hung"
        return results


# ----------------------------------------------------------------------------------------------------------
# collectives: what each rank receives, and the bytes it records


def test_collectives_deliver_by_their_definitions_and_count_received_bytes(monkeypatch):
    world = FakeWorld(3)
    world.install(monkeypatch)
    group = world.group(range(3))
    send = [[1, 0, 2], [3, 1, 0], [0, 2, 2]]  # send[src][dst]: rows of the all-to-all-v

    def rank(r):
        ledger = CommLedger()
        chunk = (torch.arange(10, dtype=torch.float32).view(2, 5) + 100 * r).t()  # (5, 2), not contiguous
        gathered = collectives.all_gather(chunk, group, ledger, "gathered")
        to_scatter = torch.arange(24, dtype=torch.float64).view(3, 4, 2) * (r + 1)
        scattered = collectives.reduce_scatter(to_scatter, group, ledger, "scattered")
        to_reduce = torch.arange(5, dtype=torch.float32) + 10 * r
        reduced = collectives.all_reduce(to_reduce, group, ledger, "reduced")
        rows = torch.arange(18, dtype=torch.int64).view(6, 3) + 1000 * r
        exchanged = collectives.all_to_all(rows, group, ledger, "exchanged")
        counts = collectives.exchange_counts(torch.tensor(send[r]), group, r, ledger, "counts")
        varied = torch.arange(sum(send[r]) * 6, dtype=torch.float32).view(-1, 2, 3) + 1000 * r
        received = collectives.all_to_all_v(varied, send[r], counts, group, r, ledger, "varied")
        return SimpleNamespace(gathered=gathered, scattered=scattered, reduced=reduced, to_reduce=to_reduce,
                               exchanged=exchanged, counts=counts, received=received, ledger=ledger)

    out = world.run(rank)
    for r, got in enumerate(out):
        chunks = [(torch.arange(10, dtype=torch.float32).view(2, 5) + 100 * s).t() for s in range(3)]
        assert torch.equal(got.gathered, torch.stack(chunks)) and got.gathered.shape == (3, 5, 2)
        assert torch.equal(got.scattered, torch.arange(24, dtype=torch.float64).view(3, 4, 2)[r] * 6)
        assert torch.equal(got.reduced, torch.arange(5, dtype=torch.float32) * 3 + 30)
        assert torch.equal(got.to_reduce, torch.arange(5, dtype=torch.float32) + 10 * r)  # out of place
        assert torch.equal(got.exchanged, torch.cat([torch.arange(18).view(6, 3)[2 * r:2 * r + 2] + 1000 * s
                                                     for s in range(3)]))
        assert got.counts == [send[s][r] for s in range(3)]
        expected_rows = []
        for s in range(3):
            start = sum(send[s][:r])
            expected_rows.append((torch.arange(sum(send[s]) * 6, dtype=torch.float32).view(-1, 2, 3)
                                  + 1000 * s)[start:start + send[s][r]])
        assert torch.equal(got.received, torch.cat(expected_rows))
        others = sum(send[s][r] for s in range(3) if s != r)
        # received bytes: (G - 1) chunks; ring reduce-scatter; ring all-reduce 2 (G - 1) / G n, rounded down;
        # (G - 1) / G of an equal all-to-all; the others' counts and rows of the all-to-all-v
        assert list(got.ledger.steps.items()) == [
            ("gathered", 2 * 40), ("scattered", 2 * 64), ("reduced", 2 * 2 * 20 // 3), ("exchanged", 2 * 144 // 3),
            ("counts", 2 * 8), ("varied", others * 24)]
        assert got.ledger.total == sum(got.ledger.steps.values())


def test_comm_ledger_adds_per_step_in_first_seen_order():
    ledger = CommLedger()
    assert ledger.total == 0 and ledger.steps == {}
    ledger.add("combine", 7)
    ledger.add("dispatch", torch.tensor(5))
    ledger.add("combine", 3.0)
    assert list(ledger.steps.items()) == [("combine", 10), ("dispatch", 5)]
    assert all(type(v) is int for v in ledger.steps.values()) and ledger.total == 15


def test_collectives_check_their_shapes_with_whole_messages(monkeypatch):
    world = FakeWorld(3)
    world.install(monkeypatch)
    group = world.group(range(3))
    ledger = CommLedger()
    with pytest.raises(ValueError, match=r"^reduce_scatter: leading dimension 2 must equal the group size 3$"):
        collectives.reduce_scatter(torch.zeros(2, 4), group, ledger, "s")
    with pytest.raises(ValueError, match=r"^all_to_all_v: need 3 send and receive counts, got 2 and 3$"):
        collectives.all_to_all_v(torch.zeros(3, 2), [1, 2], [1, 1, 1], group, 0, ledger, "v")
    with pytest.raises(ValueError, match=r"^all_to_all_v: need 3 send and receive counts, got 3 and 4$"):
        collectives.all_to_all_v(torch.zeros(3, 2), [1, 1, 1], [1, 1, 1, 0], group, 0, ledger, "v")
    with pytest.raises(ValueError, match=r"^all_to_all_v: send counts sum to 4 but x has 5 rows$"):
        collectives.all_to_all_v(torch.zeros(5, 2), [1, 1, 2], [1, 1, 1], group, 0, ledger, "v")
    with pytest.raises(ValueError, match=r"^all_to_all: 5 rows do not split into 3 equal parts$"):
        collectives.all_to_all(torch.zeros(5, 2), group, ledger, "a")
    assert ledger.steps == {}


@pytest.mark.parametrize("one", [None, "group of one"])
def test_a_group_of_one_moves_nothing_and_records_nothing(monkeypatch, one):
    world = FakeWorld(1)
    world.install(monkeypatch)
    group = None if one is None else world.group([0])
    world.local.rank = 0
    ledger = CommLedger()
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    assert collectives.group_size(group) == 1
    assert torch.equal(collectives.all_gather(x, group, ledger, "g"), x.view(1, 4, 3))
    assert torch.equal(collectives.reduce_scatter(x.view(1, 4, 3), group, ledger, "s"), x)
    assert collectives.all_reduce(x, group, ledger, "r") is x
    assert collectives.all_to_all(x, group, ledger, "a") is x
    copied = collectives.all_to_all_v(x, [4], [4], group, 0, ledger, "v")
    assert torch.equal(copied, x) and copied.data_ptr() != x.data_ptr()
    assert collectives.exchange_counts(torch.tensor([4]), group, 0, ledger, "c") == [4]
    assert ledger.steps == {}
    with pytest.raises(ValueError, match=r"^all_to_all_v: send counts sum to 4 but x has 3 rows$"):
        collectives.all_to_all_v(x[:3], [4], [4], group, 0, ledger, "v")
    with pytest.raises(ValueError, match=r"^reduce_scatter: leading dimension 4 must equal the group size 1$"):
        collectives.reduce_scatter(x, group, ledger, "s")


def test_replica_groups_issue_xla_collectives_counted_the_same(monkeypatch):
    """An SPMD group (``ReplicaGroups``) calls :mod:`~nxd_moe.parallel.xla_collectives` with a contiguous input
    and the group; the bytes are counted as for a process group. Host-sized exchanges are refused."""
    group = ReplicaGroups("moe_model_parallel_groups", ((0, 1, 2, 3), (4, 5, 6, 7)))
    calls = []

    def record(name, result):
        def op(x, g):
            calls.append((name, tuple(x.shape), x.is_contiguous(), g))
            return result(x)
        return op

    fake = SimpleNamespace(all_gather=record("all_gather", lambda x: torch.cat([x, x + 1, x + 2, x + 3])),
                           reduce_scatter=record("reduce_scatter", lambda x: x[:2] * 10),
                           all_reduce=record("all_reduce", lambda x: x * 4),
                           all_to_all=record("all_to_all", lambda x: x.flip(0)))
    monkeypatch.setattr(collectives, "xla_collectives", fake)
    assert collectives.group_size(group) == 4
    ledger = CommLedger()
    x = torch.arange(6, dtype=torch.float32).view(3, 2).t()  # (2, 3) not contiguous: 24 bytes
    gathered = collectives.all_gather(x, group, ledger, "g")
    assert torch.equal(gathered, torch.stack([x, x + 1, x + 2, x + 3])) and gathered.shape == (4, 2, 3)
    stacked = torch.arange(24, dtype=torch.float64).view(4, 2, 3)
    assert torch.equal(collectives.reduce_scatter(stacked, group, ledger, "s"), stacked.reshape(8, 3)[:2] * 10)
    assert torch.equal(collectives.all_reduce(x, group, ledger, "r"), x * 4)
    rows = torch.arange(16, dtype=torch.int32).view(4, 4).t()
    assert torch.equal(collectives.all_to_all(rows, group, ledger, "a"), rows.flip(0))
    assert [c[:3] for c in calls] == [("all_gather", (2, 3), True), ("reduce_scatter", (8, 3), True),
                                      ("all_reduce", (2, 3), True), ("all_to_all", (4, 4), True)]
    assert all(c[3] is group for c in calls)
    assert list(ledger.steps.items()) == [("g", 3 * 24), ("s", 3 * 48), ("r", 2 * 3 * 24 // 4), ("a", 3 * 64 // 4)]
    for name, call in (
            ("all_to_all_v", lambda: collectives.all_to_all_v(rows, [1] * 4, [1] * 4, group, 0, ledger, "v")),
            ("exchange_counts", lambda: collectives.exchange_counts(torch.ones(4, dtype=torch.int64), group, 0,
                                                                    ledger, "c"))):
        with pytest.raises(ValueError) as caught:
            call()
        assert str(caught.value) == (f"{name} reads split sizes on the host, which an SPMD program cannot do; use "
                                     "ExpertParallelConfig(all_to_all_splits='static')")
    assert len(calls) == 4 and len(ledger.steps) == 4  # refused before anything moved


def test_the_tensor_collectives_take_torchs_current_names():
    """torch 2.13 renamed the tensor all-gather and reduce-scatter: the new names where torch has them."""
    new = hasattr(dist, "all_gather_single")
    assert collectives._all_gather_into is (dist.all_gather_single if new else dist.all_gather_into_tensor)
    assert collectives._reduce_scatter_into is (dist.reduce_scatter_single if new else dist.reduce_scatter_tensor)


# ----------------------------------------------------------------------------------------------------------
# the all-to-all dispatch on a world of threads, against the contract


def _owned_token_ids(rank: int, token_tp: int, batch: int, local_seq: int, sp: bool) -> list[int]:
    """The block's token ids block rank ``rank`` dispatches, from the token order's definition (``-1``: a padding
    row of a short chunk)."""
    d, j = divmod(rank, token_tp)
    seq = local_seq * token_tp if sp else local_seq
    base = d * batch * seq
    if sp:  # its sequence shard of every batch row
        return [base + b * seq + j * local_seq + t for b in range(batch) for t in range(local_seq)]
    chunk = -(-batch * local_seq // token_tp)  # the group's tokens in equal chunks
    ids = [base + t for t in range(j * chunk, min((j + 1) * chunk, batch * local_seq))]
    return ids + [-1] * (chunk - len(ids))


def _local_token_ids(rank: int, token_tp: int, batch: int, local_seq: int, sp: bool) -> list[int]:
    d, j = divmod(rank, token_tp)
    seq = local_seq * token_tp if sp else local_seq
    base = d * batch * seq
    return [base + b * seq + (j * local_seq if sp else 0) + t for b in range(batch) for t in range(local_seq)]


class Scenario(SimpleNamespace):
    """One all-to-all dispatch over a block of ``block`` ranks: token groups of ``token_tp`` ranks, the experts'
    shard ``shard_tp`` x ``block // shard_tp``."""


def _scenario(block=4, token_tp=2, shard_tp=2, batch=2, local_seq=3, sp=False, splits="static", num_experts=6,
              top_k=2, distribution=None, capacity=None, count_pairs=True, padded=(), hidden=5, seed=0,
              dtype=torch.float64, weight_dtype=torch.float64) -> Scenario:
    groups = block // token_tp
    tokens = groups * batch * local_seq * (token_tp if sp else 1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (tokens, hidden), generator=gen).to(torch.float64)
    if dtype == torch.float64:  # bits a float32 sum would lose (products and sums stay exact in float64)
        x += torch.randint(0, 1024, (tokens, hidden), generator=gen) * 2.0 ** -30
    x[:, 0] = torch.arange(tokens)  # every row carries its token id
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    affinities = (torch.randint(1, 9, (tokens, num_experts), generator=gen) / 8).to(weight_dtype)
    real = torch.ones(tokens, dtype=torch.bool)
    real[list(padded)] = False
    mask = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter(1, index, True) & real.unsqueeze(1)
    return Scenario(block=block, token_tp=token_tp, shard_tp=shard_tp, batch=batch, local_seq=local_seq, sp=sp,
                    splits=splits, num_experts=num_experts, top_k=top_k, distribution=distribution,
                    capacity=capacity, count_pairs=count_pairs, padded=tuple(padded), x=x, index=index,
                    affinities=affinities, mask=mask, dtype=dtype, tokens=tokens)


def _assignment(s: Scenario) -> dict[tuple[int, int], int]:
    """``(token, expert) -> EP rank`` of every pair computed (capacity: an expert keeps its first pairs in token
    order; replicas: copy ``floor(position * copies / kept pairs)``)."""
    ep = s.block // s.shard_tp
    distribution = s.distribution or [list(range(p * s.num_experts // ep, (p + 1) * s.num_experts // ep))
                                      for p in range(ep)]
    seen = {e: 0 for e in range(s.num_experts)}
    position = {}
    for t in range(s.tokens):
        for e in s.index[t].tolist():
            if s.mask[t, e]:
                position[t, e] = seen[e]
                seen[e] += 1
    out = {}
    for (t, e), pos in position.items():
        kept = seen[e] if s.capacity is None else min(seen[e], s.capacity)
        if pos < kept:
            copies = [p for p, held in enumerate(distribution) if e in held]
            out[t, e] = copies[pos * len(copies) // kept]
    return out


def _expected_output(s: Scenario, assignment) -> torch.Tensor:
    """Each token's row times the sum over its computed pairs of weight * (expert + 1)."""
    out = torch.zeros(s.tokens, s.x.shape[1], dtype=torch.float64)
    for (t, e) in assignment:
        out[t] += s.x[t] * float(s.affinities[t, e]) * (e + 1)
    return out


def _experts(dispatched: Dispatched, tp_rank: int, tp: int) -> torch.Tensor:
    """The test's experts: row times the sum over its pairs here of weight * (expert + 1), this TP rank's share
    (unequal dyadic shares)."""
    share = {1: [1.0], 2: [0.25, 0.75], 4: [0.125, 0.125, 0.25, 0.5]}[tp]
    ids = dispatched.pair_expert
    scale = torch.where(ids >= 0, dispatched.pair_weight.to(torch.float64) * (ids + 1), 0).sum(dim=1)
    return (dispatched.rows.to(torch.float64) * scale.unsqueeze(1) * share[tp_rank]).to(dispatched.rows.dtype)


class RankTensor(torch.Tensor):
    """An SPMD rank (0-d tensor) that records every read of its value on the host: ``item()``, ``int()``, use as
    an index (``x[rank]``). Ops on it give plain tensors."""

    reads: list[str] = []
    HOST_READS = (torch.Tensor.__getitem__, torch.Tensor.__index__, torch.Tensor.__int__, torch.Tensor.item,
                  torch.Tensor.tolist)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.HOST_READS:
            cls.reads.append(func.__name__)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


def _run(s: Scenario, monkeypatch, tensor_rank=False, dispatcher=None, micro_batches: int | None = None,
         world: FakeWorld | None = None, transport: str = "nccl") -> list:
    """Every rank's dispatch, the test's experts and the combine (with ``micro_batches``: driven part by part as the
    pipeline does -- each part received, computed and its combine started before the next is received)."""
    world = world or FakeWorld(s.block)
    world.install(monkeypatch)
    num_groups = s.block // s.token_tp
    block_group = world.group(range(s.block))
    token_groups = [world.group(range(d * s.token_tp, (d + 1) * s.token_tp)) for d in range(num_groups)]
    dp_groups = [world.group(range(j, s.block, s.token_tp)) for j in range(s.token_tp)]
    placement = ExpertPlacement(s.num_experts, s.block // s.shard_tp, s.distribution)
    dispatcher = dispatcher or AllToAllDispatcher()

    def rank(r):
        d, j = divmod(r, s.token_tp)
        layout = TokenLayout(s.batch, s.local_seq, s.sp, s.token_tp, j, num_groups, d)
        block_rank = torch.tensor(r).as_subclass(RankTensor) if tensor_rank else r
        groups = MoEGroups(block_group, s.block, block_rank, token_groups[d], s.token_tp,
                           j, dp_groups[j], num_groups, d)
        shard = ExpertShard(s.shard_tp, r % s.shard_tp, s.block // s.shard_tp, r // s.shard_tp, placement)
        ids = torch.tensor(_local_token_ids(r, s.token_tp, s.batch, s.local_seq, s.sp))
        routing = Routing(s.index[ids], s.mask[ids], s.affinities[ids], False, bool(s.padded))
        ledger = CommLedger()
        inputs = DispatchInputs(s.x[ids].to(s.dtype), routing, layout, groups, shard, s.capacity, ledger, s.splits,
                                s.count_pairs, transport)
        if micro_batches is not None:
            batches, received = dispatcher.micro_batches(inputs, micro_batches), []
            for i in range(len(batches)):
                dispatched = batches.received(i)
                received.append(dispatched.rows.shape[0])
                batches.start_combine(i, _experts(dispatched, r % s.shard_tp, s.shard_tp), dispatched.handle)
            return SimpleNamespace(ids=ids, result=batches.result(), ledger=ledger, received=received)
        dispatched = dispatcher.dispatch(inputs)
        result = dispatcher.combine(_experts(dispatched, r % s.shard_tp, s.shard_tp), dispatched.handle)
        return SimpleNamespace(ids=ids, dispatched=dispatched, result=result, ledger=ledger)

    return world.run(rank)


def _check(s: Scenario, results: list) -> None:
    """Outputs, counts, the rows each rank receives in the contract's order, and the bytes of every step."""
    assignment = _assignment(s)
    expected = _expected_output(s, assignment)
    counted = s.count_pairs or s.capacity is not None or s.distribution is not None
    per_expert = [int(s.mask[:, e].sum()) for e in range(s.num_experts)]
    owned = [_owned_token_ids(r, s.token_tp, s.batch, s.local_seq, s.sp) for r in range(s.block)]
    rows_per_rank = len(owned[0])
    ep_of = [r // s.shard_tp for r in range(s.block)]
    k, width = s.top_k, s.x.shape[1]
    element = torch.empty((), dtype=s.dtype).element_size()
    weight = s.affinities.element_size()

    def goes(t, p):  # token t has a pair computed on EP rank p
        return t >= 0 and any(assignment.get((t, e)) == p for e in s.index[t].tolist())

    for r, got in enumerate(results):
        out = got.result.output
        assert out.dtype == s.dtype and out.shape == (len(got.ids), width)
        assert torch.equal(out.to(torch.float64), expected[got.ids].to(s.dtype).to(torch.float64)), r
        if counted:
            assert got.result.pairs_per_expert.tolist() == per_expert
        else:
            assert got.result.pairs_per_expert is None
        # The rows received: exact -- the tokens with a pair here, in token order; static -- each source's U rows,
        # its rows with a pair here first (in its row order), then padding (zeros, no pair, weight 0).
        p = ep_of[r]
        if s.splits == "exact":
            tokens = sorted(t for src in owned for t in src if goes(t, p))
        else:
            tokens = []
            for src in owned:
                going = [t for t in src if goes(t, p)]
                tokens += going + [-1] * (rows_per_rank - len(going))
        d = got.dispatched
        assert d.routing is None and d.rows.dtype == s.dtype and d.pair_expert.dtype == torch.int64
        assert d.rows.shape == (len(tokens), width) and d.pair_weight.dtype == s.affinities.dtype
        for n, t in enumerate(tokens):
            if t < 0:
                assert not d.rows[n].any() and d.pair_expert[n].tolist() == [-1] * k
                assert not d.pair_weight[n].any()
                continue
            assert torch.equal(d.rows[n].to(torch.float64), s.x[t].to(s.dtype).to(torch.float64)), (r, n)
            assert d.pair_expert[n].tolist() == [e if assignment.get((t, e)) == p else -1
                                                 for e in s.index[t].tolist()], (r, n)
            assert torch.equal(d.pair_weight[n], s.affinities[t, s.index[t]])
        # Bytes received per step.
        steps = []
        if counted:
            steps.append(("expert_counts", (s.block - 1) * (s.batch if s.sp else 1) * s.num_experts * 8))
        if s.splits == "exact":
            received = sum(1 for src, ids in enumerate(owned) if src != r for t in ids if goes(t, p))
            sent = sum(1 for t in owned[r] for dst in range(s.block) if dst != r and goes(t, ep_of[dst]))
            steps += [("send_counts", (s.block - 1) * 8),
                      ("dispatch", received * (width * element + k * 4 + k * weight + 8)),
                      ("combine", sent * width * element)]
        else:
            steps += [("dispatch", (s.block - 1) * rows_per_rank * (width * element + k * 4 + k * weight)),
                      ("combine", (s.block - 1) * rows_per_rank * width * element)]
        if not s.sp and s.token_tp > 1:
            steps.append(("gather_outputs", (s.token_tp - 1) * rows_per_rank * width * element))
        assert list(got.ledger.steps.items()) == steps, r


@pytest.mark.parametrize("splits", ["static", "exact"])
@pytest.mark.parametrize("case", [
    dict(),  # TP 2 x EP 2, token groups of 2 sharing their tokens: chunks of 3
    dict(sp=True, batch=3, local_seq=2),  # sequence shards: 3 segments per rank
    dict(token_tp=2, shard_tp=1, batch=1, local_seq=5, num_experts=8),  # hybrid: EP 4, token groups of 2; a short
    # chunk, with a padding row
    dict(batch=1, local_seq=5, count_pairs=False, seed=6),  # a padding row where pairs are a table lookup
    dict(token_tp=1, shard_tp=4, num_experts=5, top_k=3),  # every rank holds every expert, a slice of each
    dict(count_pairs=False, padded=(1, 6, 7)),  # no statistics (no count exchange), padded tokens go nowhere
    dict(capacity=2, sp=True, batch=2, local_seq=2),  # a capacity drops pairs beyond an expert's first 2
    dict(capacity=1, count_pairs=False, token_tp=1, shard_tp=2, seed=4),  # a capacity asks for the counts
    dict(num_experts=1, top_k=1, block=2, shard_tp=2, padded=(0, 3)),  # one expert, on every rank
    dict(distribution=[[0, 1, 2], [2, 3, 4], [5, 0, 2]], shard_tp=1, token_tp=3, block=3, batch=3,
         local_seq=3, count_pairs=False),  # replicas split their expert's pairs by position
    dict(distribution=[[0, 5, 1], [1, 2, 3], [4, 5, 0]], capacity=3, shard_tp=1, token_tp=1, block=3, batch=3,
         local_seq=2, seed=3),  # replicas and a capacity
])
def test_all_to_all_dispatch_follows_the_contract(monkeypatch, splits, case):
    s = _scenario(splits=splits, **case)
    assignment = _assignment(s)
    if s.capacity is not None:  # the case drops pairs
        assert len(assignment) < int(s.mask.sum())
    if s.distribution is not None:  # a replicated expert's pairs are split between its copies
        assert any(len({p for (t, e), p in assignment.items() if e == x}) > 1 for x in range(s.num_experts))
    _check(s, _run(s, monkeypatch))


def test_all_to_all_dispatch_in_bfloat16_with_float32_weights(monkeypatch):
    """A bf16 model's rows travel with float32 weights and int32 ids in one buffer; the output is bf16 (values
    exact in bf16: small integers times dyadic weights)."""
    for splits in ("static", "exact"):
        s = _scenario(splits=splits, dtype=torch.bfloat16, weight_dtype=torch.float32, shard_tp=1, hidden=6, seed=5,
                      num_experts=8)
        s.x[:, 0] = 1  # keep every row exact in bf16
        _check(s, _run(s, monkeypatch))


def test_a_rank_given_as_a_tensor_reads_its_segments_on_the_device(monkeypatch):
    """An SPMD rank is a 0-d tensor: the block positions gather its row of the segment starts -- the static
    exchange never reads the rank on the host (an SPMD program could not) -- and give what an int rank gives."""
    s = _scenario(capacity=2, sp=True, batch=2, local_seq=2, seed=7)
    monkeypatch.setattr(RankTensor, "reads", [])
    _check(s, _run(s, monkeypatch, tensor_rank=True))
    assert RankTensor.reads == []
    torch.arange(4)[torch.tensor(2).as_subclass(RankTensor)]  # negative control: indexing with the rank reads it
    assert RankTensor.reads == ["__getitem__"]


def test_the_static_buffer_packed_by_a_kernel_unpacks_to_the_same_rows(monkeypatch):
    """Where the Triton kernels apply, one kernel packs the send buffer and the receiver unpacks its fields: here
    the torch functions stand in for the kernels (any namespace other than the torch one takes that branch)."""
    calls = []

    def counted(name):
        def call(*args):
            calls.append(name)
            return getattr(a2a.TORCH_KERNELS, name)(*args)
        return call

    kernels = SimpleNamespace(**{n: counted(n) for n in ("destination_slots", "pack_for_destinations",
                                                         "combine_from_destinations")})
    chosen = []

    def choose(rows, weights):
        chosen.append((rows.dtype, weights.dtype))
        return kernels

    monkeypatch.setattr(a2a, "_kernels", choose)
    for dtype, weight_dtype in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32)):
        calls.clear()
        chosen.clear()
        s = _scenario(dtype=dtype, weight_dtype=weight_dtype, shard_tp=1, num_experts=8, seed=11)
        if dtype == torch.bfloat16:
            s.x[:, 0] = 1
        _check(s, _run(s, monkeypatch))
        assert chosen == [(dtype, weight_dtype)] * s.block  # chosen for the rows and weights sent
        assert sorted(set(calls)) == ["combine_from_destinations", "destination_slots", "pack_for_destinations"]
        assert len(calls) == 3 * s.block


def test_the_kernels_are_chosen_only_for_cuda_rows_of_whole_words_and_float32_weights(monkeypatch):
    from nxd_moe.triton_kernels import dispatch as triton_dispatch

    def rows(is_cuda, width, dtype):
        t = torch.zeros(2, width, dtype=dtype)
        return SimpleNamespace(is_cuda=is_cuda, shape=t.shape, element_size=t.element_size)

    f32, bf16 = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bfloat16)
    assert a2a._kernels(rows(True, 6, torch.bfloat16), f32) is triton_dispatch  # 12 bytes a row
    assert a2a._kernels(rows(True, 3, torch.float32), f32) is triton_dispatch
    assert a2a._kernels(rows(False, 6, torch.bfloat16), f32) is a2a.TORCH_KERNELS
    assert a2a._kernels(rows(True, 5, torch.bfloat16), f32) is a2a.TORCH_KERNELS  # 10 bytes a row
    assert a2a._kernels(rows(True, 6, torch.bfloat16), bf16) is a2a.TORCH_KERNELS
    assert a2a._kernels(torch.zeros(2, 6), f32) is a2a.TORCH_KERNELS
    # Triton missing: the import fails
    monkeypatch.delattr(sys.modules["nxd_moe.triton_kernels"], "dispatch")
    monkeypatch.setitem(sys.modules, "nxd_moe.triton_kernels.dispatch", None)
    assert a2a._kernels(rows(True, 6, torch.bfloat16), f32) is a2a.TORCH_KERNELS


def test_exact_splits_refuse_a_cuda_graph_capture_before_reading_the_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda_rows = SimpleNamespace(is_cuda=True)
    owned = OwnedPairs(cuda_rows, None, None, None, None, None)
    with pytest.raises(RuntimeError) as caught:
        a2a._exact_dispatch(owned, None)
    assert str(caught.value) == ("all_to_all_splits='exact' reads the split sizes on the host and cannot be "
                                 "captured in a CUDA graph; use ExpertParallelConfig(all_to_all_splits='static')")
    s = _scenario(splits="exact", seed=2)  # rows on the CPU are never captured: the check does not apply
    _check(s, _run(s, monkeypatch))


# ----------------------------------------------------------------------------------------------------------
# the contract's types, one device's dispatcher, the dispatchers by name


def test_one_device_hands_tokens_and_routing_through_unchanged():
    hidden = torch.arange(12, dtype=torch.float32).view(4, 3)
    index = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 2]])
    mask = torch.zeros(4, 3, dtype=torch.bool).scatter(1, index, True)
    routing = Routing(index, mask, torch.rand(4, 3), True, False)
    inputs = DispatchInputs(hidden, routing)
    assert (inputs.layout, inputs.groups, inputs.shard, inputs.capacity, inputs.ledger) == (None,) * 5
    assert inputs.all_to_all_splits == "static" and inputs.count_pairs is True
    assert isinstance(LOCAL, LocalDispatcher)
    dispatched = LOCAL.dispatch(inputs)
    assert isinstance(dispatched, Dispatched)
    assert dispatched.rows is hidden and dispatched.routing is routing
    assert (dispatched.pair_expert, dispatched.pair_weight, dispatched.handle) == (None, None, None)
    partial = hidden * 2
    result = LOCAL.combine(partial, dispatched.handle)
    assert isinstance(result, DispatchResult) and result.output is partial and result.pairs_per_expert is None
    assert Dispatched(hidden, None, None, None).routing is None
    assert ONE_DEVICE.dispatcher is LOCAL
    assert ONE_DEVICE == Route(LOCAL, None, None, None, None, "static", None, None, None, None)


def test_pairs_are_the_routing_with_padded_tokens_going_nowhere():
    index = torch.tensor([[2, 0], [1, 3], [3, 2]])
    affinities = torch.tensor([[0.5, 0.0, 0.25, 0.0], [0.0, 0.75, 0.0, 0.125], [0.0, 0.0, 0.375, 0.625]],
                              dtype=torch.float64)
    mask = torch.tensor([[True, False, True, False], [False, False, False, False], [False, False, True, True]])
    padded = DispatchInputs(torch.zeros(3, 2), Routing(index, mask, affinities, False, True))
    experts, weights = padded.pairs()
    assert experts.tolist() == [[2, 0], [-1, -1], [3, 2]]
    assert weights.dtype == torch.float64 and weights.tolist() == [[0.25, 0.5], [0.75, 0.125], [0.625, 0.375]]
    mask[1, 3] = True  # one pair of the token is real
    assert padded._replace(routing=Routing(index, mask, affinities, False, True)).pairs()[0].tolist() == [
        [2, 0], [-1, 3], [3, 2]]


def test_dispatchers_by_name():
    assert list(DISPATCHERS) == ["local", "all_gather", "all_to_all_v"]
    assert get_dispatcher("local") is LOCAL
    assert isinstance(get_dispatcher("all_gather"), AllGatherDispatcher)
    assert isinstance(get_dispatcher("all_to_all_v"), AllToAllDispatcher)
    assert get_dispatcher("all_to_all_v") is get_dispatcher("all_to_all_v")
    for name in ("ring", "ALL_GATHER", ""):
        with pytest.raises(ValueError) as caught:
            get_dispatcher(name)
        assert str(caught.value) == ("expert-parallel dispatch must be one of ['all_gather', 'all_to_all_v'], "
                                     f"got {name!r}")


# ----------------------------------------------------------------------------------------------------------
# micro-batches: the static dispatch in parts whose exchanges run beside the experts (issue 38)


@pytest.mark.parametrize("count", [2, 3, 50])
@pytest.mark.parametrize("case", [
    dict(),  # TP 2 x EP 2, token groups sharing their tokens: 3 owned rows per rank
    dict(sp=True, batch=3, local_seq=3, padded=(2, 9)),  # sequence shards: 9 owned rows, padded tokens
    dict(capacity=2, sp=True, batch=2, local_seq=3),  # a capacity counted over the whole block, not per part
    dict(distribution=[[0, 5, 1], [1, 2, 3], [4, 5, 0]], capacity=3, shard_tp=1, token_tp=1, block=3, batch=3,
         local_seq=2, seed=3),  # replicas split by the whole block's positions, and a capacity
])
def test_micro_batches_compute_what_one_batch_does(monkeypatch, case, count):
    """Every rank's output is the contract's (the pairs its experts own, each expert's first pairs of the whole
    block under a capacity, replicas by block position: the same assignment as one batch), exactly; the parts
    split the owned rows as evenly as the ranks agree on (``count`` larger than the rows: one row each); the wire
    carries the same bytes as one batch; and the async exchange's rows are read only after their wait (the fake
    hands out ids ``-1`` and NaN until then, so a read before it would lose or poison pairs)."""
    s = _scenario(**case)
    world = FakeWorld(s.block)
    results = _run(s, monkeypatch, micro_batches=count, world=world)
    expected = _expected_output(s, _assignment(s))
    owned = len(_owned_token_ids(0, s.token_tp, s.batch, s.local_seq, s.sp))
    parts = min(count, owned)
    size = -(-owned // parts)
    sizes = [min(size, owned - start) for start in range(0, owned, size)]
    ep_rows = [s.block * n for n in sizes]  # each part: its U_i rows from every rank of the block
    per_expert = [int(s.mask[:, e].sum()) for e in range(s.num_experts)]
    one_batch = _run(s, monkeypatch)
    for r, got in enumerate(results):
        assert torch.equal(got.result.output, expected[got.ids].to(s.dtype)), r
        assert got.result.pairs_per_expert.tolist() == per_expert
        assert got.received == ep_rows, (r, got.received)
        assert got.ledger.steps == one_batch[r].ledger.steps, r
    # Each rank: part i + 1's dispatch starts before part i's rows are waited for, and part i's combine starts
    # before part i + 1's rows are waited for; the combines are waited for last.
    n = len(sizes)
    expected_log = [("start", "rows")]
    for i in range(n):
        if i + 1 < n:
            expected_log.append(("start", "rows"))
        expected_log += [("wait", "rows"), ("start", "partials")]
    expected_log += [("wait", "partials")] * n
    for r in range(s.block):
        assert [(op, what) for me, op, what in world.log if me == r] == expected_log, r


def test_micro_batches_refuse_the_exact_exchange_and_uncombined_parts(monkeypatch):
    """The exact exchange reads its sizes on the host per call: no micro-batches (a named error); a result asked
    for before every part was combined names the parts missing."""
    s = _scenario(splits="exact")
    with pytest.raises(ValueError, match=r"^micro-batches need all_to_all_splits='static' \(the exact exchange "
                                         r"reads its sizes on the host\), got 'exact'$"):
        AllToAllDispatcher().micro_batches(SimpleNamespace(all_to_all_splits="exact"), 2)
    s = _scenario(sp=True, batch=2, local_seq=2, block=2, token_tp=1, shard_tp=1)
    world = FakeWorld(s.block)
    world.install(monkeypatch)
    block_group = world.group(range(2))
    placement = ExpertPlacement(s.num_experts, 2, None)

    def rank(r):
        layout = TokenLayout(s.batch, s.local_seq, True, 1, 0, 2, r)
        groups = MoEGroups(block_group, 2, r, world.group([r]), 1, 0, block_group, 2, r)
        ids = torch.tensor(_local_token_ids(r, 1, s.batch, s.local_seq, True))
        routing = Routing(s.index[ids], s.mask[ids], s.affinities[ids], False, False)
        batches = AllToAllDispatcher().micro_batches(DispatchInputs(
            s.x[ids], routing, layout, groups, ExpertShard(1, 0, 2, r, placement), None, CommLedger(), "static",
            False), 2)
        dispatched = batches.received(0)
        batches.start_combine(0, dispatched.rows, dispatched.handle)
        batches.received(1)
        with pytest.raises(RuntimeError, match=r"micro-batches \[1\] were never combined"):
            batches.result()
        return len(batches)

    assert world.run(rank) == [2, 2]


def test_where_bytes_cannot_travel_packed_each_field_is_its_own_exchange(monkeypatch):
    """Under XLA (no dtype view: ``packs_bytes`` False) the static dispatch exchanges the rows, the ids and the
    weights one collective each -- the same bytes, the same result as one packed buffer."""
    from nxd_moe.parallel import payload

    for module in (a2a, payload):
        monkeypatch.setattr(module, "packs_bytes", lambda device: False)
    exchanged = []
    all_to_all = a2a.all_to_all

    def counted(x, group, ledger, step):
        exchanged.append((str(x.dtype), step))
        return all_to_all(x, group, ledger, step)

    monkeypatch.setattr(a2a, "all_to_all", counted)
    s = _scenario(shard_tp=1, num_experts=8, seed=12)
    _check(s, _run(s, monkeypatch))
    # per rank: rows (float64), int32 ids, float64 weights -- each its own dispatch exchange
    assert sorted(exchanged) == sorted([("torch.float64", "dispatch"), ("torch.int32", "dispatch"),
                                        ("torch.float64", "dispatch")] * s.block)


@pytest.mark.parametrize("transport", ["nccl", "nvlink"])
def test_the_transport_picks_the_exchange(monkeypatch, transport):
    """``transport="nvlink"``: the dispatch and the combine go through the NVLink exchange (which hands over to NCCL's
    off CUDA: the result is the contract's either way); ``"nccl"``: never through it."""
    through = []
    nvlink_exchange = a2a.start_nvlink_all_to_all

    def recorded(x, group, ledger, step):
        through.append(step)
        return nvlink_exchange(x, group, ledger, step)

    monkeypatch.setattr(a2a, "start_nvlink_all_to_all", recorded)
    s = _scenario(shard_tp=1, num_experts=8, seed=13)
    _check(s, _run(s, monkeypatch, transport=transport))
    assert sorted(through) == (sorted(["dispatch", "combine"] * s.block) if transport == "nvlink" else [])
