"""The XLA steps of an SPMD program (issue 41), on tiny modules: :func:`trace_rank` (what each HLO parameter is,
the device state it leaves as it found it, host reads, buffers updated in place), :func:`compile_program`,
:func:`run_replicated` (one executable on every device, a failing rank named), :func:`to_devices`, :func:`session`,
and each collective of :mod:`nxd_moe.parallel.xla_collectives` run on 4 devices over two groups, compared with
hand-written results. Runs in the XLA environment; skipped elsewhere. tests/test_spmd_settings.py covers the rest
of the SPMD modules without torch_xla.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")  # as test_spmd_trace.py: read when the XLA runtime starts
torch_xla = pytest.importorskip("torch_xla")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from nxd_moe import parallel_state  # noqa: E402
from nxd_moe.parallel import xla_collectives  # noqa: E402
from nxd_moe.parallel_state import ReplicaGroups, SPMDRank  # noqa: E402
from nxd_moe.tracing import spmd_program  # noqa: E402
from nxd_moe.tracing.collectives import collective_summary  # noqa: E402
from nxd_moe.tracing.spmd_layout import SPMDLayout  # noqa: E402
from nxd_moe.tracing.spmd_program import compile_program, run_replicated, session, to_devices, trace_rank  # noqa: E402
from nxd_moe.tracing.xla import replicated, xla_devices  # noqa: E402

XLAC = torch_xla._XLAC


@pytest.fixture(scope="module")
def devices() -> list[str]:
    return xla_devices(4)


class _Barrier(threading.Barrier):
    """A barrier that times out instead of waiting forever (for a rank that never comes)."""

    def __init__(self, parties):
        super().__init__(parties, timeout=20.0)


@pytest.fixture(autouse=True)
def barrier_with_a_timeout(monkeypatch):
    monkeypatch.setattr(threading, "Barrier", _Barrier)


class Scaled(nn.Module):
    """``x * weight + table + rank``: a weight, a non-persistent buffer (a value the code put on the device) and the
    rank tensor. Records the default device its forward runs under."""

    def __init__(self, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.register_buffer("table", torch.tensor([0.5, 0.25, 0.125, 0.0]), persistent=False)
        self.spmd_rank = SPMDRank(4, 1, rank)
        self.defaults: list[str] = []

    def forward(self, x):
        self.defaults.append(XLAC._xla_get_default_device())
        return (x * self.weight + self.table + self.spmd_rank.rank.float(),)


def test_trace_rank_names_the_parameters_and_restores_the_device_state(devices):
    default = XLAC._xla_get_default_device()
    module = Scaled(2).to(torch.device(devices[2]))
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0]]).to(torch.device(devices[2]))
    program = trace_rank(module, [x])
    assert module.defaults == [devices[2]] and XLAC._xla_get_default_device() == default
    assert program.host_sync is None and program.transfers_during_trace == 0
    assert program.hlo_text.startswith("HloModule ") and program.graph_hash and isinstance(program.graph_hash, bytes)
    assert sorted((p.kind, p.name, p.shape) for p in program.parameters) == [
        ("input", "x", (1, 4)), ("rank", "spmd_rank.rank", (1,)), ("shared", "table", (4,)),
        ("weight", "weight", (4,))]
    values = {p.name: v.cpu().tolist() for p, v in zip(program.parameters, program.arguments)}
    assert values == {"x": [[1.0, -1.0, 2.0, 0.0]], "spmd_rank.rank": [2], "table": [0.5, 0.25, 0.125, 0.0],
                      "weight": [1.0, 2.0, 3.0, 4.0]}
    name = program.hlo_text.split(",")[0].removeprefix("HloModule ")  # the module's proto carries its name
    assert program.hlo_proto().startswith(b"\n" + bytes([len(name)]) + name.encode())
    # traced without autograd (the weight requires grad); execution is allowed again: the output runs
    assert [(t.requires_grad, t.cpu().tolist()) for t in program.outputs] == [(False, [[3.5, 0.25, 8.125, 2.0]])]


class ReadsWeight(Scaled):
    """Copies its (device data) weight to the host inside the forward: a transfer, not an execution."""

    def forward(self, x):
        return (x * float(self.weight.cpu()[1]),)


def test_a_transfer_inside_the_trace_is_counted(devices):
    module = ReadsWeight(0).to(torch.device(devices[1]))
    program = trace_rank(module, [torch.ones(2).to(torch.device(devices[1]))])
    assert program.transfers_during_trace == 1 and program.host_sync is None


class HostRead(Scaled):
    def forward(self, x):
        return (x * float((x * self.weight).sum()),)


def test_a_host_read_ends_the_trace_and_execution_is_allowed_again(devices):
    default = XLAC._xla_get_default_device()
    module = HostRead(1).to(torch.device(devices[3]))
    x = torch.ones(4).to(torch.device(devices[3]))
    program = trace_rank(module, [x])
    assert program.host_sync is not None and program.host_sync.startswith("Unexpected execution")
    assert "\n" not in program.host_sync and program.transfers_during_trace == 0  # counted: check_spmd sums them
    assert (program.hlo_text, program.graph_hash, program.arguments, program.parameters, program.outputs) == (
        "", b"", [], [], [])
    assert XLAC._xla_get_default_device() == default
    assert (x * 2).cpu().tolist() == [2.0] * 4


class Raises(Scaled):
    def forward(self, x):
        raise RuntimeError("not a host read")


def test_another_error_is_raised_and_the_state_restored(devices):
    default = XLAC._xla_get_default_device()
    x = torch.ones(4).to(torch.device(devices[1]))
    with pytest.raises(RuntimeError, match="^not a host read$"):
        trace_rank(Raises(0).to(torch.device(devices[1])), [x])
    assert XLAC._xla_get_default_device() == default and (x + 1).cpu().tolist() == [2.0] * 4


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.tensor([1.0, 2.0]))
        self.register_buffer("steps", torch.tensor([5.0]), persistent=False)
        self.register_buffer("other", torch.tensor([7.0]))


class Cached(nn.Module):
    """Updates its buffers (two modules down) in place, as an application's KV cache, or overwrites one without
    reading it."""

    def __init__(self, overwrite: bool = False):
        super().__init__()
        self.outer = nn.Module()
        self.outer.inner = Inner()
        self.overwrite = overwrite

    def forward(self, x):
        inner = self.outer.inner
        if self.overwrite:
            inner.cache = x * 3
            return (x,)
        inner.cache.add_(x)
        inner.steps.add_(1.0)
        return (inner.cache * 2 + inner.steps,)


def test_buffers_updated_in_place_get_their_old_values_back(devices):
    module = Cached().to(torch.device(devices[0]))
    inner = module.outer.inner
    other = inner.other
    program = trace_rank(module, [torch.tensor([0.5, -1.0]).to(torch.device(devices[0]))])
    values = {p.name: v for p, v in zip(program.parameters, program.arguments)}
    assert inner.cache is values["outer.inner.cache"] and inner.steps is values["outer.inner.steps"]
    assert inner.other is other  # not updated: untouched
    assert inner.cache.cpu().tolist() == [1.0, 2.0] and inner.steps.cpu().tolist() == [5.0]
    assert list(module.state_dict()) == ["outer.inner.cache", "outer.inner.other"]  # steps stays non-persistent
    assert program.outputs[0].cpu().tolist() == [9.0, 8.0]  # the program computes the update: (c + x) * 2 + s + 1


def test_a_buffer_overwritten_without_reading_it_is_refused(devices):
    module = Cached(overwrite=True).to(torch.device(devices[0]))
    with pytest.raises(RuntimeError) as e:
        trace_rank(module, [torch.tensor([0.5, -1.0]).to(torch.device(devices[0]))])
    assert str(e.value) == ("outer.inner.cache: the forward overwrote this buffer without reading it; the trace cannot "
                            "give it its old value back")


def test_compile_program_counts_new_compilations_only(devices):
    def program(scale):
        module = Scaled(0).to(torch.device(devices[1]))
        return trace_rank(module, [torch.full((4,), scale).to(torch.device(devices[1]))])

    first = program(7.0)  # a shape no other test compiles: (4,) inputs times 7 ... its graph is new
    first.outputs = [first.outputs[0] * 7.0 - 1.0]
    assert compile_program(first) == 1
    again = program(7.0)
    again.outputs = [again.outputs[0] * 7.0 - 1.0]
    assert compile_program(again) == 0


def test_to_devices_and_session(devices):
    ranks = [Scaled(0), Scaled(1)]
    assert to_devices(ranks, devices[2:]) == ranks
    assert [{str(t.device) for t in m.state_dict().values()} for m in ranks] == [{devices[2]}, {devices[3]}]
    with pytest.raises(ValueError):
        to_devices([Scaled(0), Scaled(1)], devices[:1])
    layout = SPMDLayout(1, 2)
    with session(layout, devices[:2]):
        assert parallel_state.is_spmd() and parallel_state.get_parallel_layout().expert_model_parallel_size == 2
        assert XLAC._xla_get_replication_devices_count() == 2
    assert not parallel_state.model_parallel_is_initialized() and XLAC._xla_get_replication_devices_count() == 0


# ----------------------------------------------------------------------------------------------------------
# collectives over replica groups. Run on the 4 devices only with each rank in its own group: the XLA CPU client runs
# as many executions at once as its thread pool holds (one thread with OMP_NUM_THREADS=1, as mutation runs set it;
# 2 on a 2-core host), and a collective over several ranks needs every one of them running at once -- they then wait
# for each other until XLA aborts. Over pairs, the traced program is checked instead: its shapes and groups.

PAIRS = ReplicaGroups("expert_model_parallel_groups", ((0, 2), (1, 3)))
ALONE = ReplicaGroups("tensor_model_parallel_groups", ((0,), (1,), (2,), (3,)))


def rank_input(rank: int) -> torch.Tensor:
    return torch.tensor([[10.0 * rank + 1, 10.0 * rank + 2], [10.0 * rank + 3, 10.0 * rank + 4]])


class Collective(nn.Module):
    def __init__(self, op: str, rank: int, group: ReplicaGroups):
        super().__init__()
        self.op, self.group = op, group
        self.spmd_rank = SPMDRank(4, 1, rank)

    def forward(self, x):
        return (getattr(xla_collectives, self.op)(x, self.group),)


def trace_ranks(op: str, group: ReplicaGroups, devices: list[str]):
    return [trace_rank(Collective(op, r, group).to(torch.device(d)), [rank_input(r).to(torch.device(d))])
            for r, d in enumerate(devices)]


# the collective's HLO instruction for a (2, 2) input over pairs (values' names left out; the reduction by its
# computation's name)
PAIR_HLO = {
    "all_gather": "f32[4,2]{1,0} all-gather(f32[2,2]{1,0} %), replica_groups={{0,2},{1,3}}, dimensions={0}",
    "reduce_scatter": "f32[1,2]{1,0} reduce-scatter(f32[2,2]{1,0} %), replica_groups={{0,2},{1,3}}, "
                      "dimensions={0}, to_apply=Add",
    "all_reduce": "(f32[2,2]{1,0}, f32[]) all-reduce(f32[2,2]{1,0} %, f32[] %), replica_groups={{0,2},{1,3}}, "
                  "to_apply=Add",
    "all_to_all": "f32[2,2]{1,0} all-to-all(f32[2,2]{1,0} %), replica_groups={{0,2},{1,3}}, dimensions={0}",
}


@pytest.mark.parametrize("op", list(PAIR_HLO))
def test_each_collective_is_one_hlo_op_over_its_groups(op, devices):
    with replicated(devices):
        programs = trace_ranks(op, PAIRS, devices)
    assert all(p.program_text == programs[0].program_text for p in programs)
    # the documented shapes: (n, ...) -> (G n, ...), (G n, ...) -> (n, ...), (n, ...), (G n, ...) -> (G n, ...)
    assert tuple(programs[0].outputs[0].shape) == {"all_gather": (4, 2), "reduce_scatter": (1, 2),
                                                   "all_reduce": (2, 2), "all_to_all": (2, 2)}[op]
    name = op.replace("_", "-")
    [line] = [line for line in programs[0].hlo_text.splitlines() if f" {name}(" in line]
    reduction = re.sub(r"to_apply=%([A-Za-z]+?)Computation[\w.]*", r"to_apply=\1", line.split(" = ", 1)[1])
    assert re.sub(r"%[\w.-]+", "%", reduction) == PAIR_HLO[op]


@pytest.mark.parametrize("op", list(PAIR_HLO))
def test_each_collective_of_one_rank_groups_returns_its_input(op, devices, monkeypatch):
    """Each rank alone in its group: all-gather, reduce-scatter, all-reduce and all-to-all of one rank are that
    rank's input (a scale, a sum over more ranks, another split would change it). Each rank's thread puts its
    arguments on its device, waits for every rank (rank 3 is late), then runs the program with its device as the
    default one."""
    events = []
    materialize, run = spmd_program.materialize, XLAC._run_cached_graph

    def late_materialize(tensors, device):
        if device == devices[3]:
            time.sleep(0.3)
        materialize(tensors, device)
        events.append(("materialize", device, [str(t.device) for t in tensors]))

    def recorded_run(graph_hash, arguments):
        events.append(("run", XLAC._xla_get_default_device(), [str(t.device) for t in arguments]))
        return run(graph_hash, arguments)

    with replicated(devices):
        programs = trace_ranks(op, ALONE, devices)
        compile_program(programs[0])
        monkeypatch.setattr(spmd_program, "materialize", late_materialize)
        monkeypatch.setattr(XLAC, "_run_cached_graph", recorded_run)
        outputs = run_replicated(programs[0].graph_hash, [p.arguments for p in programs], devices)
    assert [out[0].tolist() for out in outputs] == [[[1, 2], [3, 4]], [[11, 12], [13, 14]], [[21, 22], [23, 24]],
                                                    [[31, 32], [33, 34]]]
    assert all(str(out[0].device) == "cpu" for out in outputs)
    assert [kind for kind, _, _ in events] == ["materialize"] * 4 + ["run"] * 4
    for kind in ("materialize", "run"):
        assert sorted((device, args) for k, device, args in events if k == kind) == [
            (d, [d] * len(programs[0].arguments)) for d in devices]


@pytest.mark.parametrize("op", list(PAIR_HLO))
def test_a_collective_outside_its_replication_is_refused(op, devices):
    x = torch.ones(2, 2).to(torch.device(devices[0]))
    with replicated(devices[:2]), pytest.raises(RuntimeError) as e:
        getattr(xla_collectives, op)(x, PAIRS)
    assert str(e.value) == ("expert_model_parallel_groups: the SPMD program has 4 ranks but torch_xla replicates "
                            "over 2 device(s); run it inside nxd_moe.trace_spmd.replicated(devices) with 4 devices")


def test_the_all_reduce_chain_starts_afresh_for_each_trace(devices):
    """Two traces of the same collective on one device, no sync between: each program holds its own all-reduce only
    (the token chain is reset before and after the trace)."""
    with replicated(devices):
        before = xla_collectives.all_reduce(rank_input(2).to(torch.device(devices[0])), PAIRS)
        first = trace_ranks("all_reduce", PAIRS, devices[:1])[0]
        second = trace_ranks("all_reduce", PAIRS, devices[:1])[0]
        after = xla_collectives.all_reduce(rank_input(1).to(torch.device(devices[0])), PAIRS)
        later = XLAC._get_xla_tensors_hlo([after])
    assert first.program_text == second.program_text and before is not None
    assert collective_summary(first.hlo_text)["all-reduce"]["count"] == 1
    assert collective_summary(later)["all-reduce"]["count"] == 1


def test_a_failing_rank_is_named_and_the_others_released(devices):
    """Rank 2's arguments cannot be put on its device: it fails before the barrier, which it breaks so that the
    other ranks do not wait for it (a barrier that would time out shows how long they waited)."""
    with replicated(devices):
        programs = trace_ranks("all_reduce", ALONE, devices)
        compile_program(programs[0])
        arguments = [p.arguments for p in programs]
        arguments[2] = ["not a tensor"]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=re.escape("rank 2 failed running the SPMD program: ")) as e:
            run_replicated(programs[0].graph_hash, arguments, devices)
    assert time.monotonic() - start < 10.0
    assert e.value.__cause__ is not None and not isinstance(e.value.__cause__, threading.BrokenBarrierError)


class WeightThenCache(nn.Module):
    """A weight the forward only reads, registered before a buffer it updates in place: the weight comes first among
    the module's tensors."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0, 3.0]))
        self.register_buffer("cache", torch.tensor([1.0, 1.0]))

    def forward(self, x):
        self.cache.add_(x)
        return (self.cache * self.weight,)


def test_a_buffer_after_an_untouched_weight_gets_its_old_value_back(devices):
    """The restore goes on past tensors the forward left alone (a planted ``break`` at the untouched weight leaves
    the cache holding the traced update, [1.5, 0.0] instead of [1.0, 1.0])."""
    module = WeightThenCache().to(torch.device(devices[0]))
    weight = module.weight
    program = trace_rank(module, [torch.tensor([0.5, -1.0]).to(torch.device(devices[0]))])
    values = {p.name: v for p, v in zip(program.parameters, program.arguments)}
    assert module.cache is values["cache"] and module.weight is weight
    assert module.cache.cpu().tolist() == [1.0, 1.0] and list(module.state_dict()) == ["weight", "cache"]
    assert program.outputs[0].cpu().tolist() == [3.0, 0.0]  # (1 + x) * w = [1.5 * 2, 0 * 3]


class Releases(nn.Module):
    """Releases two buffers in its forward (sets them to None): one it read first, one it never read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("read", torch.tensor([4.0, 5.0]))
        self.register_buffer("unread", torch.tensor([6.0, 7.0]))

    def forward(self, x):
        out = x * self.read
        self.read = None
        self.unread = None
        return (out,)


def test_buffers_the_forward_releases_stay_released(devices):
    """Only buffers updated in place get their old values back: a buffer the forward set to None holds no pending
    graph and stays None, and one released unread is no "overwrote this buffer" error (a planted lookup that takes a
    missing buffer for an updated one restores ``read`` and raises for ``unread``)."""
    module = Releases().to(torch.device(devices[0]))
    program = trace_rank(module, [torch.tensor([1.0, -2.0]).to(torch.device(devices[0]))])
    assert module.read is None and module.unread is None and list(module.state_dict()) == []
    assert program.outputs[0].cpu().tolist() == [4.0, -10.0]


def test_a_world_smaller_than_the_runtime_is_refused_by_name(devices):
    """torch_xla compiles every program for all of the runtime's devices (4 here), so a 2-rank program's all-reduce
    over its pair cannot compile: the error names the cause and the fix instead of XLA's replica-count check. The
    control: the same collective over groups that cover the 4 devices compiles."""
    pair = ReplicaGroups("tensor_model_parallel_groups", [[0, 1]])
    with replicated(devices[:2]):
        programs = trace_ranks("all_reduce", pair, devices[:2])
        with pytest.raises(RuntimeError, match=r"span fewer ranks than the XLA runtime's 4 devices.*"
                                               r"CPU_NUM_DEVICES .* equal to the program's world size"):
            compile_program(programs[0])
    whole = ReplicaGroups("tensor_model_parallel_groups", [[0, 1], [2, 3]])
    with replicated(devices):
        assert compile_program(trace_ranks("all_reduce", whole, devices)[0]) in (0, 1)
