"""Settings of the SPMD tracing modules seen without ``torch_xla`` (issue 41): a layout's sizes, rank lists, token
groups and blocks (:mod:`nxd_moe.tracing.spmd_layout`), the report's verdicts and how a parameter is sharded
(:mod:`nxd_moe.tracing.spmd`), ``nxd-moe trace --tp/--ep``'s layout, report and compile command
(:mod:`nxd_moe.tracing.spmd_command`), and the orchestration of :func:`check_spmd` / :func:`export_spmd` /
:func:`trace_layout` with the XLA steps (trace, compile, run) replaced by recording fakes on the CPU -- what each
step is given and what the report makes of what it returns. tests/xla/test_spmd_settings_xla.py runs the XLA steps
themselves.

Every layout here has distinct, non-default sizes (TP != EP != copies), so a swapped or dropped size is seen.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.tracing import spmd, spmd_command
from nxd_moe.tracing.hlo import ProgramParameter
from nxd_moe.tracing.spmd import SPMDReport, check_spmd, export_spmd, shared_values_equal, trace_world
from nxd_moe.tracing.spmd_command import (
    format_layout_report,
    neuronx_cc_command,
    spmd_layout_from_args,
    trace_layout,
)
from nxd_moe.tracing.spmd_layout import SPMDLayout, build_rank_layers
from nxd_moe.tracing.spmd_program import RankProgram


@pytest.fixture(autouse=True)
def no_layout_left():
    parallel_state.destroy_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


# ----------------------------------------------------------------------------------------------------------
# SPMDLayout


def test_layout_defaults_sizes_and_dict():
    assert SPMDLayout() == SPMDLayout(1, 1, False, None, None, 1)
    layout = SPMDLayout(2, 3, True, 3, 2, 5)
    assert (layout.block_size, layout.world_size) == (6, 30)
    assert layout.moe_expert_parallel_size("decode") == 2
    assert layout.moe_expert_parallel_size("prefill") == 3
    assert SPMDLayout(2, 3).moe_expert_parallel_size("decode") == 3  # no decode split: the prefill one
    assert list(layout.to_dict().items()) == [
        ("world_size", 30), ("tensor_model_parallel_size", 2), ("expert_model_parallel_size", 3),
        ("moe_decode_tensor_model_parallel_size", 3), ("moe_decode_expert_model_parallel_size", 2),
        ("sequence_parallel", True), ("expert_data_parallel_size", 5)]


def test_check_returns_the_rank_lists_with_the_decode_split():
    ranks = SPMDLayout(2, 2, False, 4, 1, 2).check(8, 1, "decode")
    assert ranks.world_size == 8 and ranks.moe_decode == (4, 1) and ranks.moe_prefill == (2, 2)
    assert ranks.tensor_model_parallel_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert ranks.expert_model_parallel_groups == ((0, 2), (1, 3), (4, 6), (5, 7))


@pytest.mark.parametrize("layout, experts, tokens, mode, message", [
    (SPMDLayout(1, 3), 8, 16, "prefill", "expert_model_parallel_size (3) must divide num_experts (8) for the "
     "contiguous expert placement; use an expert_distribution to place experts unevenly"),
    (SPMDLayout(4, 1, False, 1, 4), 6, 1, "decode", "moe_decode_expert_model_parallel_size (4) must divide "
     "num_experts (6)"),
    (SPMDLayout(3, 1, True), 6, 16, "prefill", "sequence parallelism splits the prefill tokens (16) over the "
     "tensor-parallel size (3): tokens must be divisible by it"),
])
def test_check_names_what_does_not_divide(layout, experts, tokens, mode, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        layout.check(experts, tokens, mode)


@pytest.mark.parametrize("layout, tokens, mode", [
    (SPMDLayout(3, 1, False), 16, "prefill"),  # not sequence parallel: any tokens
    (SPMDLayout(3, 1, True), 16, "decode"),  # decode is not split over TP
    (SPMDLayout(3, 1, True), 18, "prefill"),
])
def test_check_passes_tokens_that_split_or_need_not(layout, tokens, mode):
    assert layout.check(6, tokens, mode).tensor_model_parallel_groups == ((0, 1, 2),)


def test_initialized_builds_the_given_ranks_shard_and_cleans_up():
    layout = SPMDLayout(2, 2, False, 4, 1, 2)
    with layout.initialized(5):
        assert parallel_state.is_spmd()
        state = parallel_state.get_parallel_layout()
        assert (state.world_size, state.tensor_model_parallel_size, state.expert_model_parallel_size) == (8, 2, 2)
        assert state.moe_decode == (4, 1)
        assert parallel_state.spmd_rank().rank.tolist() == [5]
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(KeyError, match="inside"), layout.initialized():
        assert parallel_state.spmd_rank().rank.tolist() == [0]  # the default: rank 0's shard
        raise KeyError("inside")
    assert not parallel_state.model_parallel_is_initialized()


# TP 2 x EP 3, 2 copies: 12 ranks, the TP pairs (0, 1), (2, 3), ... take token groups 0, 1, ..., 5 in turn (the EP
# index within a block, then the block); position = the rank's index in its TP pair.
GROUP_AND_POSITION = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (4, 0), (4, 1), (5, 0), (5, 1)]


@pytest.mark.parametrize("rank", range(12))
def test_local_takes_the_ranks_token_group_and_positions(rank):
    layout = SPMDLayout(2, 3, True, None, None, 2)
    world = torch.arange(6 * 2 * 4 * 3).view(12, 4, 3)  # 6 token groups of 2 rows, 4 positions, 3 features
    group, position = GROUP_AND_POSITION[rank]
    rows = world[2 * group:2 * group + 2]
    assert torch.equal(layout.local(world, rank, sharded=False), rows)
    assert torch.equal(layout.local(world, rank, sharded=True), rows[:, 2 * position:2 * position + 2])


def test_per_block_applies_the_layer_to_each_copy_on_its_own():
    calls = []

    def layer(x, mask):
        calls.append((x.tolist(), mask.tolist(), torch.is_grad_enabled()))
        return x - x.mean(0, keepdim=True) + mask, "stats"

    x = torch.tensor([[1.0], [2.0], [3.0], [5.0], [6.0], [10.0]], requires_grad=True)
    mask = torch.tensor([[0.0], [1.0], [0.0], [0.0], [1.0], [1.0]])
    out = SPMDLayout(1, 1, expert_data_parallel_size=3).per_block(layer, (x, mask))
    assert out.tolist() == [[-0.5], [1.5], [-1.0], [1.0], [-1.0], [3.0]]
    assert calls == [([[1.0], [2.0]], [[0.0], [1.0]], False), ([[3.0], [5.0]], [[0.0], [0.0]], False),
                     ([[6.0], [10.0]], [[1.0], [1.0]], False)]


class Sharded(nn.Module):
    """A layer whose SPMD builds hold the rank tensor (as the parallel MoE's do)."""

    def __init__(self, seen: list):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.spmd_rank = parallel_state.spmd_rank()
        layout = parallel_state.get_parallel_layout() if parallel_state.model_parallel_is_initialized() else None
        seen.append(None if layout is None else (layout.world_size, layout.tensor_model_parallel_size,
                                                 layout.expert_model_parallel_size, layout.moe_decode))


def test_build_rank_layers_builds_every_ranks_shard_under_its_layout():
    seen, kwargs = [], []

    def build(**given):
        kwargs.append(given)
        module = Sharded(seen)
        if given.get("model_parallel") is False:
            module.weight.data = torch.tensor([1.5, -2.0, 4.0])
            del module.spmd_rank
        return module

    full, ranks = build_rank_layers(build, SPMDLayout(1, 2, False, 2, 1, 2))
    assert kwargs == [{"model_parallel": False}] + [{}] * 4
    assert seen == [None] + [(4, 1, 2, (2, 1))] * 4
    assert full.weight.tolist() == [1.5, -2.0, 4.0] and len(ranks) == 4
    for r, module in enumerate(ranks):
        assert module.weight.tolist() == [1.5, -2.0, 4.0] and module.spmd_rank.rank.tolist() == [r]
    assert not parallel_state.model_parallel_is_initialized()


# ----------------------------------------------------------------------------------------------------------
# SPMDReport


def report(**changes) -> SPMDReport:
    fields = dict(routings=3, world_size=4, graphs=1, identical_across_ranks=True, compilations=1,
                  transfers_during_trace=0, host_sync=None, fallback_ops=[], max_abs_diff=1.0, max_abs_ref=4.0,
                  atol=0.25, routing_ranks=[[0], [0, 1]], parameters=[], hlo_text="")
    return SPMDReport(**{**fields, **changes})


@pytest.mark.parametrize("changes, static", [
    ({}, True), (dict(compilations=0), True), (dict(graphs=2), False), (dict(identical_across_ranks=False), False),
    (dict(compilations=2), False), (dict(transfers_during_trace=1), False), (dict(host_sync="read"), False),
    (dict(fallback_ops=["aten::nonzero"]), False)])
def test_static_needs_every_check(changes, static):
    assert report(**changes).static is static
    assert report(**changes).ok is static


@pytest.mark.parametrize("diff, ref, matches", [
    (1.0, 4.0, True), (1.0000001, 4.0, False),  # atol 0.25 relative to |output| 4
    (0.25, 0.5, True), (0.2500001, 0.5, False), (0.3, 0.5, False)])  # below 1: absolute
def test_matches_single_device_is_atol_relative_above_one(diff, ref, matches):
    assert report(max_abs_diff=diff, max_abs_ref=ref).matches_single_device is matches
    assert report(max_abs_diff=diff, max_abs_ref=ref).ok is matches


HLO = """HloModule SyncTensorsGraph.9, entry_computation_layout={(f32[2,4]{1,0})->(f32[2,4]{1,0})}

ENTRY %SyncTensorsGraph.9 (p0.1: f32[2,4]) -> (f32[2,4]) {
  %p0.1 = f32[2,4]{1,0} parameter(0)
  %all-reduce.5 = f32[2,4]{1,0} all-reduce(f32[2,4]{1,0} %p0.1), replica_groups={{0,1},{2,3}}, to_apply=%add
  %multiply.7 = f32[2,4]{1,0} multiply(f32[2,4]{1,0} %all-reduce.5, f32[2,4]{1,0} %p0.1)
  ROOT %tuple.8 = (f32[2,4]{1,0}) tuple(f32[2,4]{1,0} %multiply.7)
}
"""


def test_report_dict_and_collectives():
    r = report(host_sync="read", fallback_ops=["aten::sort"], hlo_text=HLO, compilations=0, transfers_during_trace=2,
               parameters=[ProgramParameter(0, "input", "x", (2, 4), "float32")])
    # all-reduce over pairs: 2 (G - 1) / G of its 32-byte operand
    collectives = {"all-reduce": {"count": 1, "replica_groups": [[[0, 1], [2, 3]]], "bytes_per_rank": 32}}
    assert r.collectives == collectives
    assert r.to_dict() == {
        "routings": 3, "world_size": 4, "graphs": 1, "identical_across_ranks": True, "compilations": 0,
        "transfers_during_trace": 2, "host_sync": "read", "fallback_ops": ["aten::sort"], "max_abs_diff": 1.0,
        "max_abs_ref": 4.0, "atol": 0.25, "routing_ranks": [[0], [0, 1]], "static": False,
        "matches_single_device": True, "ok": False, "collectives": collectives}
    assert "hlo_text" not in repr(r) and "parameters" not in repr(r)


# ----------------------------------------------------------------------------------------------------------
# spmd.py's helpers


class Router(nn.Module):
    """Sends token t to experts (a[t], b[t]) given as its first two features."""

    num_experts = 8

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((tuple(x.shape), torch.is_grad_enabled()))
        return None, None, x[:, :2].long()


class Full(nn.Module):
    """The single-device layer of the fakes: output 3 x, the router above."""

    def __init__(self):
        super().__init__()
        self.router = Router()

    def forward(self, x):
        return (3 * x,)


def test_ep_ranks_are_the_ranks_of_the_chosen_experts():
    full = Full()
    x = torch.tensor([[[7.0, 0.0, 9.0], [3.0, 0.0, 9.0]]], requires_grad=True)  # experts 7, 0, 3
    ranks = spmd._ep_ranks(full, x, 4)
    assert ranks == [0, 1, 3] and {type(r) for r in ranks} == {int}  # 2 experts per rank; the report prints them
    assert spmd._ep_ranks(full, x, 2) == [0, 1]
    assert full.router.seen == [((2, 3), False)] * 2


def param(number, kind, name="p", shape=(2,)):
    return ProgramParameter(number, kind, name, shape, "float32")


def programs_with(*arguments):
    parameters = [param(0, "input"), param(1, "weight"), param(2, "rank"), param(3, "shared")]
    return [SimpleNamespace(parameters=parameters, arguments=[torch.tensor([float(v)]) for v in args])
            for args in arguments]


def test_shared_values_equal_compares_only_the_shared_values_of_every_rank():
    assert shared_values_equal(programs_with([1, 2, 0, 7], [3, 4, 1, 7], [5, 6, 2, 7]))
    assert not shared_values_equal(programs_with([1, 2, 0, 7], [1, 2, 0, 7], [1, 2, 0, 8]))
    assert not shared_values_equal(programs_with([1, 2, 0, 7], [1, 2, 0, 8], [1, 2, 0, 7]))
    with pytest.raises(ValueError):  # a program with another parameter list is not the same program
        shared_values_equal(programs_with([1, 2, 0, 7], [1, 2, 0]))


@pytest.mark.parametrize("kind, name, shape, sharding", [
    ("input", "hidden_states", (1, 8, 16), "per rank"),
    ("rank", "expert_mlps.spmd_rank.rank", (1,), "per rank"),
    ("shared", "router.table", (3,), "replicated"),  # not the whole layer's shape, still the same on every rank
    ("weight", "not.in.whole", (5,), "replicated"),
    ("weight", "router.weight", (8, 16), "replicated"),
    ("weight", "experts.down", (4, 6, 8), "split dim 0: 4 of 8, dim 2: 8 of 16"),
    ("weight", "experts.up", (8, 3, 16), "split dim 1: 3 of 6"),
])
def test_sharding_of_each_parameter_kind(kind, name, shape, sharding):
    whole = {"router.table": torch.Size([6]), "router.weight": torch.Size([8, 16]),
             "experts.down": torch.Size([8, 6, 16]), "experts.up": torch.Size([8, 6, 16]),
             "hidden_states": torch.Size([4, 8, 16]), "expert_mlps.spmd_rank.rank": torch.Size([1])}
    assert spmd._sharding(param(0, kind, name, shape), whole) == sharding


def test_program_text_leaves_out_the_module_name_line_only():
    def text(hlo):
        return RankProgram(hlo, b"", [], [], [], 0).program_text

    assert text("HloModule SyncTensorsGraph.12\nENTRY %e {\n  ROOT %c = f32[] constant(1)\n}") == \
        "ENTRY %e {\n  ROOT %c = f32[] constant(1)\n}"
    assert text("ENTRY %e {\nHloModule x\n}") == "ENTRY %e {\nHloModule x\n}"  # no module line: all of it
    assert text("HloModule one\ntwo\nthree") == "two\nthree"


# ----------------------------------------------------------------------------------------------------------
# check_spmd / trace_world / export_spmd around fake XLA steps


class Rank(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((2,), 10.0 + rank))


class Metrics:
    def __init__(self):
        self.counters = {"aten::sort": 2, "UncachedCompile": 0}

    def counter_names(self):
        return list(self.counters)

    def counter_value(self, name):
        return self.counters.get(name)


class FakeXLA:
    """trace_rank / compile_program / run_replicated / session / materialize, recording what they are given.
    The metrics count ``aten::sort`` before the check and, with ``fallback``, an ``aten::nonzero`` per trace.
    Program of routing i, rank r: its hash ``hashes[i]``, text ``texts[i][r]``, shared value ``shared[i][r]``,
    host sync ``syncs[i][r]``; rank r outputs ``3 x + offsets[i][r]`` of its input x (the layer's 3 x is exact)."""

    def __init__(self, monkeypatch, world_size, routings, **given):
        self.met = Metrics()
        self.hashes = given.get("hashes", [b"one"] * routings)
        self.texts = given.get("texts", [["text"] * world_size] * routings)
        self.shared = given.get("shared", [[1.0] * world_size] * routings)
        self.syncs = given.get("syncs", [[None] * world_size] * routings)
        self.offsets = given.get("offsets", [[0.0] * world_size] * routings)
        self.transfers = given.get("transfers", [0] * world_size)
        self.fallback = given.get("fallback", False)  # each trace runs an operator on the CPU
        self.traced, self.compiled, self.ran, self.sessions, self.materialized = [], [], [], [], []
        self.routing = -1
        self.compiled_hashes = set()
        for module in (spmd, spmd_command):
            monkeypatch.setattr(module, "import_torch_xla", lambda: SimpleNamespace(
                debug=SimpleNamespace(metrics=self.met)), raising=False)
        monkeypatch.setattr(spmd, "trace_rank", self.trace_rank)
        monkeypatch.setattr(spmd, "compile_program", self.compile_program)
        monkeypatch.setattr(spmd, "run_replicated", self.run_replicated)
        monkeypatch.setattr(spmd, "session", self.session)
        monkeypatch.setattr(spmd, "materialize", lambda tensors, device: self.materialized.append(
            ([None if t.is_meta else t.tolist() for t in tensors], device)))

    @contextlib.contextmanager
    def session(self, layout, devices):
        self.sessions.append((layout, list(devices)))
        self.routing = -1
        yield
        self.sessions.append("closed")

    def trace_rank(self, module, inputs):
        rank = int(module.weight[0]) - 10
        if rank == 0:
            self.routing += 1
        i = self.routing
        self.traced.append((i, rank, [t.tolist() for t in inputs]))
        if self.fallback:
            self.met.counters["aten::nonzero"] = self.met.counters.get("aten::nonzero", 0) + 1
        return RankProgram(
            hlo_text=f"HloModule m{i}.{rank}\n{self.texts[i][rank]}", graph_hash=self.hashes[i],
            arguments=[inputs[0], module.weight, torch.tensor([float(rank)]), torch.tensor([self.shared[i][rank]])],
            parameters=[param(0, "input", "hidden_states", tuple(inputs[0].shape)),
                        param(1, "weight", "weight", (2,)), param(2, "rank", "spmd_rank.rank", (1,)),
                        param(3, "shared", f"shared.{i}", (1,))],
            outputs=[], transfers_during_trace=self.transfers[rank], host_sync=self.syncs[i][rank])

    def compile_program(self, program):
        self.compiled.append(program.hlo_text.split("\n")[0])
        new = program.graph_hash not in self.compiled_hashes
        self.compiled_hashes.add(program.graph_hash)
        return int(new)

    def run_replicated(self, graph_hash, arguments, devices):
        self.ran.append((graph_hash, list(devices)))
        return [[3 * args[0] + self.offsets[self.routing][rank]] for rank, args in enumerate(arguments)]


def world_inputs(i: int) -> tuple[torch.Tensor]:
    """(2 token groups, 4 positions, 3 features): features 0, 1 are the experts (of 8) each token goes to."""
    experts = [[[0, 1], [1, 0], [0, 1], [1, 1]], [[0, 1], [1, 0], [0, 1], [1, 1]]] if i == 0 else \
        [[[0, 7], [2, 2], [3, 0], [1, 1]], [[6, 6], [0, 1], [5, 1], [0, 0]]]
    x = torch.tensor(experts, dtype=torch.float32)
    return (torch.cat([x, (x[..., :1] + 0.5 * i)], dim=-1),)


SP = SPMDLayout(2, 2, True)  # 4 ranks; prefill: rank r holds group r // 2's positions 2 (r % 2) .. 2 (r % 2) + 1


def test_check_spmd_traces_compiles_runs_and_compares_every_routing(monkeypatch):
    xla = FakeXLA(monkeypatch, 4, 3, offsets=[[0.0] * 4, [0.0, 0.0, -0.375, 0.0], [0.0, 0.125, 0.0, 0.0]],
                  transfers=[0, 0, 0, 1], fallback=True)
    ranks = [Rank(r) for r in range(4)]
    r = check_spmd(Full(), ranks, SP, world_inputs, "prefill", atol=0.5)
    assert (r.routings, r.world_size, r.graphs, r.identical_across_ranks, r.compilations) == (3, 4, 1, True, 1)
    assert (r.transfers_during_trace, r.host_sync, r.fallback_ops) == (3, None, ["aten::nonzero"])
    assert (r.max_abs_diff, r.max_abs_ref, r.atol) == (0.375, 3 * 7.0, 0.5)
    # routing 0: experts 0, 1 only (EP rank 0 of 2); routing 1: experts of every rank
    assert r.routing_ranks == [[0], [0, 1], [0, 1]]
    assert r.hlo_text == "HloModule m0.0\ntext" and [p.name for p in r.parameters] == [
        "hidden_states", "weight", "spmd_rank.rank", "shared.0"]
    assert xla.sessions == [(SP, ["cpu"] * 4), "closed"]
    assert xla.compiled == ["HloModule m0.0", "HloModule m1.0", "HloModule m2.0"]
    assert xla.ran == [(b"one", ["cpu"] * 4)] * 3
    # each rank traced on its part: token group r // 2, positions 2 (r % 2), 2 (r % 2) + 1
    world = world_inputs(2)[0]
    assert [(i, rank) for i, rank, _ in xla.traced] == [(i, rank) for i in range(3) for rank in range(4)]
    for rank in range(4):
        part = world[rank // 2:rank // 2 + 1, 2 * (rank % 2):2 * (rank % 2) + 2]
        assert xla.traced[8 + rank][2] == [part.tolist()]
        assert xla.materialized[8 + rank] == ([part.tolist()], "cpu")
    assert r.matches_single_device and not r.static  # rank 3's host transfers


def test_check_spmd_defaults_and_decode_uses_the_decode_split_unsharded(monkeypatch):
    xla = FakeXLA(monkeypatch, 4, 3, hashes=[b"a", b"b", b"a"], offsets=[[0.0] * 4] * 2 + [[0.0, 0.0, 0.0, 1e-3]])
    layout = SPMDLayout(2, 2, True, 1, 4)  # decode: EP 4 (2 experts per rank), and not sequence parallel

    def decode_inputs(i):  # (4 groups of 2 sequences, 1 token, 3)
        return (world_inputs(i)[0].reshape(8, 1, 3),)

    r = check_spmd(Full(), [Rank(r) for r in range(4)], layout, decode_inputs, "decode")
    assert (r.routings, r.graphs, r.compilations, r.atol) == (3, 2, 2, 1e-5)
    assert r.routing_ranks == [[0], [0, 1, 2, 3], [0, 1, 2, 3]]
    # float32 outputs up to 21: 3 x + 1e-3 rounds by half an ulp of 16..32 (2**-20)
    assert r.max_abs_diff == pytest.approx(1e-3, abs=2**-20) and not r.matches_single_device
    world = decode_inputs(0)[0]
    assert [t for i, rank, t in xla.traced if i == 0] == [[world[4 * g:4 * g + 4].tolist()] for g in (0, 0, 1, 1)]


@pytest.mark.parametrize("n", [1, 0, True, 2.0, "3"])
def test_check_spmd_needs_several_routings(n):
    with pytest.raises(ValueError) as e:
        check_spmd(Full(), [], SP, world_inputs, "prefill", n=n)
    assert str(e.value) == f"n must be an int >= 2 (several routings, to see whether they share a graph), got {n!r}"


def test_check_spmd_takes_two_routings(monkeypatch):
    FakeXLA(monkeypatch, 4, 2)
    assert check_spmd(Full(), [Rank(r) for r in range(4)], SP, world_inputs, "prefill", n=2).ok


def test_check_spmd_of_a_one_rank_layout(monkeypatch):
    """``--sp`` alone: a layout of one rank (its program is the world's)."""
    xla = FakeXLA(monkeypatch, 1, 2, hashes=[b"x", b"x"])
    r = check_spmd(Full(), [Rank(0)], SPMDLayout(1, 1, True), world_inputs, "prefill", n=2)
    assert r.ok and (r.world_size, r.graphs, r.compilations) == (1, 1, 1)
    assert xla.ran == [(b"x", ["cpu"])] * 2
    assert shared_values_equal(programs_with([1, 2, 0, 7]))


def test_check_spmd_stops_at_a_host_sync(monkeypatch):
    xla = FakeXLA(monkeypatch, 4, 3, syncs=[[None] * 4, [None, "first read", "second read", None], [None] * 4])
    r = check_spmd(Full(), [Rank(r) for r in range(4)], SP, world_inputs, "prefill")
    assert r.host_sync == "first read" and r.graphs == 1 and r.compilations == 1 and not r.static
    assert len(r.routing_ranks) == 2 and len(xla.ran) == 1 and xla.sessions[-1] == "closed"
    assert r.max_abs_diff == 0.0 and r.hlo_text == "HloModule m0.0\ntext"


def test_check_spmd_with_no_routing_run(monkeypatch):
    FakeXLA(monkeypatch, 4, 3, syncs=[["read"] * 4] * 3)
    r = check_spmd(Full(), [Rank(r) for r in range(4)], SP, world_inputs, "prefill")
    assert (r.graphs, r.compilations, r.max_abs_diff, r.max_abs_ref) == (0, 0, float("inf"), 0.0)
    assert r.parameters == [] and r.hlo_text == "" and r.routing_ranks == [[0]]


@pytest.mark.parametrize("given", [dict(texts=[["text"] * 4, ["text"] * 3 + ["other"], ["text"] * 4]),
                                   dict(shared=[[1.0] * 4, [1.0] * 3 + [2.0], [1.0] * 4])])
def test_check_spmd_stops_when_a_rank_has_another_program(monkeypatch, given):
    xla = FakeXLA(monkeypatch, 4, 3, **given)
    r = check_spmd(Full(), [Rank(r) for r in range(4)], SP, world_inputs, "prefill")
    assert not r.identical_across_ranks and (r.graphs, r.compilations) == (1, 1) and len(xla.ran) == 1
    assert len(r.routing_ranks) == 2 and r.host_sync is None


def test_trace_world_moves_each_ranks_part_to_its_device(monkeypatch):
    xla = FakeXLA(monkeypatch, 4, 1)
    layout = SPMDLayout(2, 2, False)
    world = torch.arange(24.0).view(2, 4, 3).to(torch.float64)
    mask = torch.tensor([[True, True, False, False], [True, False, True, False]])
    seen = []
    monkeypatch.setattr(spmd, "trace_rank", lambda module, inputs: seen.append(
        (module, [(t.device.type, t.is_contiguous(), t.tolist()) for t in inputs])) or module)
    ranks = [Rank(r) for r in range(4)]
    assert trace_world(ranks, layout, [world, mask], "prefill") == ranks
    assert [m for m, _ in seen] == ranks
    assert [inputs for _, inputs in seen] == [[("cpu", True, world[g].unsqueeze(0).tolist()),
                                               ("cpu", True, mask[g].unsqueeze(0).tolist())] for g in (0, 0, 1, 1)]
    assert [device for _, device in xla.materialized] == ["cpu"] * 4


def test_trace_world_puts_the_inputs_on_each_ranks_device(monkeypatch):
    xla = FakeXLA(monkeypatch, 2, 1)
    monkeypatch.setattr(spmd, "device_of", lambda module: "meta")  # where the rank's layer is
    seen = []
    monkeypatch.setattr(spmd, "trace_rank", lambda module, inputs: seen.append([t.device.type for t in inputs]))
    trace_world([Rank(0), Rank(1)], SPMDLayout(1, 2), world_inputs(1), "prefill")
    assert seen == [["meta"], ["meta"]] and [device for _, device in xla.materialized] == ["meta", "meta"]


def test_export_spmd_writes_rank_zeros_program_and_every_shard(monkeypatch, tmp_path):
    xla = FakeXLA(monkeypatch, 2, 1)
    ranks = [Rank(0), Rank(1)]
    ranks[1].register_buffer("scale", torch.tensor([0.5, 0.25]))
    ranks[0].register_buffer("scale", torch.tensor([1.0, 2.0]))
    monkeypatch.setattr(RankProgram, "hlo_proto", lambda self: b"proto of " + self.hlo_text.encode())
    monkeypatch.setattr(spmd, "trace_rank", lambda module, inputs: RankProgram(
        HLO, b"h", [inputs[0], module.weight, torch.tensor([7.0])],
        [param(0, "input", "hidden_states", tuple(inputs[0].shape)), param(1, "weight", "weight", (2,)),
         param(2, "shared", "shared.2", (1,))], [], 0) if module is ranks[0] else pytest.fail("rank 1 traced"))
    example = (torch.arange(12.0).view(1, 4, 3),)  # one token group of 4 positions: rank 0 traces the first 2
    out = tmp_path / "new" / "dir"
    layout = SPMDLayout(2, 1, True)
    export_spmd(ranks, layout, example, "prefill", out, {"weight": torch.Size([4])})
    result = export_spmd(ranks, layout, example, "prefill", out, {"weight": torch.Size([4])})  # over the last one
    assert xla.sessions == [(layout, ["cpu", "cpu"]), "closed"] * 2
    assert (out / "model.hlo.txt").read_text() == HLO
    assert (out / "model.hlo_module.pb").read_bytes() == b"proto of " + HLO.encode()
    for r in range(2):
        shard = torch.load(out / "shards" / f"rank{r}.pt")
        assert list(shard) == ["weight", "scale"] and shard["weight"].tolist() == [10.0 + r] * 2
    assert torch.load(out / "shards" / "rank1.pt")["scale"].tolist() == [0.5, 0.25]
    assert torch.load(out / "shared.pt") == {2: torch.tensor([7.0])}
    parameters = [
        {"number": 0, "kind": "input", "name": "hidden_states", "shape": [1, 2, 3], "dtype": "float32",
         "sharding": "per rank"},
        {"number": 1, "kind": "weight", "name": "weight", "shape": [2], "dtype": "float32",
         "sharding": "split dim 0: 2 of 4"},
        {"number": 2, "kind": "shared", "name": "shared.2", "shape": [1], "dtype": "float32",
         "sharding": "replicated"}]
    assert json.loads((out / "parameters.json").read_text()) == parameters
    assert result == {
        "files": {"hlo_text": "model.hlo.txt", "hlo_proto": "model.hlo_module.pb", "parameters": "parameters.json",
                  "shared": "shared.pt", "shards": ["shards/rank0.pt", "shards/rank1.pt"]},
        "hlo_instructions": 4, "op_histogram": {"all-reduce": 1, "multiply": 1, "parameter": 1, "tuple": 1},
        "inputs": [{"shape": [1, 2, 3], "dtype": "float32"}], "parameters": parameters}


def test_export_spmd_refuses_a_host_read(monkeypatch, tmp_path):
    FakeXLA(monkeypatch, 2, 1, syncs=[[None, "x"]])
    monkeypatch.setattr(spmd, "trace_rank", lambda module, inputs: RankProgram("", b"", [], [], [], 0, "the read"))
    with pytest.raises(RuntimeError) as e:
        export_spmd([Rank(0), Rank(1)], SPMDLayout(1, 2), world_inputs(1), "prefill", tmp_path, {})
    assert str(e.value) == "rank 0's forward reads a device value on the host: the read"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


# ----------------------------------------------------------------------------------------------------------
# spmd_command


def flags(**given) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(tp=1, ep=1, sp=False, decode_tp=None, decode_ep=None), **given})


@pytest.mark.parametrize("given, layout", [
    ({}, None),
    (dict(tp=2), SPMDLayout(2, 1)),
    (dict(ep=4), SPMDLayout(1, 4)),
    (dict(sp=True), SPMDLayout(1, 1, True)),
    (dict(decode_tp=1), SPMDLayout(1, 1, False, 1, None)),
    (dict(decode_ep=1), SPMDLayout(1, 1, False, None, 1)),
    (dict(tp=2, ep=3, sp=True, decode_tp=6, decode_ep=1), SPMDLayout(2, 3, True, 6, 1)),
])
def test_layout_from_the_flags(given, layout):
    assert spmd_layout_from_args(flags(**given)) == layout


def test_neuronx_cc_command():
    assert neuronx_cc_command("/runs/x", SPMDLayout(2, 3, expert_data_parallel_size=2), 1) == {
        "command": "neuronx-cc compile /runs/x/model.hlo_module.pb --framework XLA --target trn2 --lnc 1 "
                   "--model-type transformer --auto-cast none --output /runs/x/model.neff",
        "lnc": 1, "world_size": 12, "physical_neuron_cores": 12}
    assert neuronx_cc_command("o", SPMDLayout(2, 3), 2)["physical_neuron_cores"] == 12


def layout_report(ok: bool) -> dict:
    static = report(max_abs_diff=1.5e-6, max_abs_ref=3.25, atol=1e-5, routing_ranks=[[0], [0, 1], [1]]).to_dict()
    par = {**SPMDLayout(2, 2, True, 4, 1).to_dict(), "dispatch": "all_to_all_v", "token_groups": 2}
    hlo = {"files": {"hlo_proto": "model.hlo_module.pb", "parameters": "parameters.json"}, "hlo_instructions": 321}
    if not ok:
        static.update(static=False, matches_single_device=False, graphs=2, host_sync="Unexpected execution",
                      fallback_ops=["aten::nonzero"])
        par.update(moe_decode_tensor_model_parallel_size=None, moe_decode_expert_model_parallel_size=None,
                   sequence_parallel=False, dispatch="all_gather")
        hlo = {}
    return {
        "config": "qwen3-30b-a3b", "scale": 16, "hidden_size": 128, "num_experts": 128, "top_k": 8,
        "router": "RouterTopK", "dtype": "bfloat16", "mode": "prefill", "tokens": 64, "padding": ok,
        "experts_mode": "blockwise", "quantization": "fp8" if ok else "none", "parallel": par,
        "xla": {"hlo": hlo, "check_static": static},
        "collectives": {"all-gather": {"count": 3, "replica_groups": [[[0, 2], [1, 3]]], "bytes_per_rank": 102400},
                        "all-reduce": {"count": 1, "replica_groups": [[[0, 1], [2, 3]]], "bytes_per_rank": 512}},
        "neuronx_cc": neuronx_cc_command("/o", SPMDLayout(2, 2), 1), "ok": ok}


def test_format_layout_report_passing():
    assert format_layout_report(layout_report(True), "/o") == "\n".join([
        "nxd-moe trace: qwen3-30b-a3b  (scale 1/16: H=128, E=128, k=8, router=RouterTopK; bfloat16)",
        "SPMD program for 4 ranks: TP 2 x EP 2, decode TP 4 EP 1, sequence parallel on, dispatch all_to_all_v; "
        "rank = an s32[1] input (SPMDRank)",
        "prefill 64 tokens per token group (2 groups) with padding -> blockwise, expert weights fp8",
        "one program                ok: 3 routings x 4 ranks -> 1 graph, identical on every rank True, "
        "1 compilation, 0 host transfers, fallbacks none",
        "routings                   EP ranks receiving pairs: [[0], [0, 1], [1]]",
        "run on 4 XLA devices       ok: max |rank output - single-device layer| 1.50e-06 (max |output| 3.25e+00, "
        "atol 1e-05 relative above 1)",
        "    all-gather      x3   replica_groups [[[0, 2], [1, 3]]], 100.0 KiB received per rank",
        "    all-reduce      x1   replica_groups [[[0, 1], [2, 3]]], 0.5 KiB received per rank",
        "files                      /o/model.hlo_module.pb (321 instructions), /o/parameters.json, /o/shards/rank*.pt",
        "compile for Trainium2 (4 ranks, 4 NeuronCores at LNC 1): neuronx-cc compile /o/model.hlo_module.pb "
        "--framework XLA --target trn2 --lnc 1 --model-type transformer --auto-cast none --output /o/model.neff",
        "all checks passed"])


def test_format_layout_report_failing():
    text = format_layout_report(layout_report(False), "/o")
    assert text.splitlines()[1] == ("SPMD program for 4 ranks: TP 2 x EP 2, sequence parallel off, dispatch "
                                    "all_gather; rank = an s32[1] input (SPMDRank)")
    assert text.splitlines()[2] == ("prefill 64 tokens per token group (2 groups) -> blockwise, expert weights "
                                    "bfloat16 (unquantized)")
    assert text.splitlines()[3] == ("one program                FAILED: 3 routings x 4 ranks -> 2 graph, identical "
                                    "on every rank True, 1 compilation, 0 host transfers, fallbacks "
                                    "['aten::nonzero']; Unexpected execution")
    assert text.splitlines()[5].startswith("run on 4 XLA devices       FAILED: ")
    assert "files" not in text and "compile for" not in text and text.endswith("\nSOME CHECKS FAILED")


def test_format_layout_report_with_one_decode_size():
    r = layout_report(True)
    r["parallel"].update(moe_decode_tensor_model_parallel_size=None, moe_decode_expert_model_parallel_size=4)
    assert ", decode TP None EP 4, sequence" in format_layout_report(r, "/o").splitlines()[1]
    r["parallel"].update(moe_decode_tensor_model_parallel_size=1, moe_decode_expert_model_parallel_size=None)
    assert ", decode TP 1 EP None, sequence" in format_layout_report(r, "/o").splitlines()[1]


class TraceFakes:
    """``trace_layout``'s XLA steps (devices, moving the ranks, check_spmd, export_spmd) recording what they are
    given; ``build_moe`` is the real one, its keyword arguments recorded."""

    def __init__(self, monkeypatch, host_sync=None):
        self.calls: dict[str, list] = {"build": [], "devices": [], "to_devices": [], "check": [], "export": []}
        self.static = report(host_sync=host_sync, hlo_text=HLO, routing_ranks=[[1], [0, 1]])
        real_build = spmd_command.build_moe

        def build(config, **kwargs):
            self.calls["build"].append((config.name, kwargs))
            return real_build(config, **kwargs)

        def check(full, ranks, layout, make_inputs, mode, n, atol):
            self.calls["check"].append((full, ranks, layout, make_inputs, mode, n, atol))
            return self.static

        def export(ranks, layout, example, mode, out_dir, whole):
            self.calls["export"].append((ranks, layout, example, mode, out_dir, whole))
            return {"files": {"hlo_proto": "model.hlo_module.pb"}}

        monkeypatch.setattr(spmd_command, "build_moe", build)
        monkeypatch.setattr(spmd_command, "xla_devices", lambda n: self.calls["devices"].append(n) or
                            [f"xla:{r}" for r in range(n)])
        monkeypatch.setattr(spmd_command, "to_devices", lambda ranks, devices: self.calls["to_devices"].append(
            (ranks, devices)))
        monkeypatch.setattr(spmd_command, "check_spmd", check)
        monkeypatch.setattr(spmd_command, "export_spmd", export)


def trace_flags(*given: str) -> argparse.Namespace:
    from nxd_moe.tracing.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--config", "mixtral-8x7b", *given])


def test_trace_layout_builds_checks_and_exports_every_rank(monkeypatch, tmp_path):
    fakes = TraceFakes(monkeypatch)
    out = tmp_path / "new" / "out"
    args = trace_flags("--out", str(out), "--tp", "2", "--ep", "2", "--sp", "--tokens", "8", "--routings", "4",
                       "--dispatch", "all_to_all", "--lnc", "1", "--seed", "3", "--padding", "--block-size", "16")
    layout = spmd_layout_from_args(args)
    result = trace_layout(args, layout)
    builds = fakes.calls["build"]
    assert [kwargs.get("model_parallel") for _, kwargs in builds] == [False, None, None, None, None]
    scale = result["scale"]
    for name, kwargs in builds:
        assert name == "mixtral-8x7b"
        assert {k: v for k, v in kwargs.items() if k != "model_parallel"} == dict(
            scale=scale, dtype=torch.float32, seed=3, sequence_parallel=True, block_size=16,
            expert_parallel_config=spmd_command.ExpertParallelConfig("all_to_all_v"))
    assert fakes.calls["devices"] == [4]
    [(ranks, devices)] = fakes.calls["to_devices"]
    assert devices == ["xla:0", "xla:1", "xla:2", "xla:3"] and len(ranks) == 4
    assert [int(m.expert_mlps.spmd_rank.rank) for m in ranks] == [0, 1, 2, 3]
    [(full, checked_ranks, checked_layout, make_inputs, mode, n, atol)] = fakes.calls["check"]
    assert checked_ranks is ranks and checked_layout is layout and (mode, n, atol) == ("prefill", 4, 1e-5)
    hidden = full.hidden_size
    x, mask = make_inputs(1)  # 2 token groups of one 8-token sequence: seed 3 + 1, the last 2 tokens masked
    assert torch.equal(x, torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(4),
                                      dtype=torch.float64).float())
    assert mask.tolist() == [[True] * 6 + [False] * 2] * 2
    [(exported_ranks, exported_layout, example, export_mode, out_dir, whole)] = fakes.calls["export"]
    assert exported_ranks is ranks and exported_layout is layout and export_mode == "prefill" and out_dir == out
    assert torch.equal(example[0], x) and torch.equal(example[1], mask)
    assert whole == {"router.linear_router.weight": (8, 256), "expert_mlps.mlp_op.gate_up_proj.weight": (8, 256, 1792),
                     "expert_mlps.mlp_op.down_proj.weight": (8, 896, 256)}  # the single-device layer's, at H / 16
    assert result["parallel"] == {"world_size": 4, "tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                  "moe_decode_tensor_model_parallel_size": None,
                                  "moe_decode_expert_model_parallel_size": None, "sequence_parallel": True,
                                  "expert_data_parallel_size": 1, "dispatch": "all_to_all_v", "token_groups": 2}
    assert result["export"] == {"skipped": "SPMD program: torch.export and torch.compile have no XLA collectives; "
                                           "the XLA checks below are the proof"}
    assert result["compile"] == {"skipped": "SPMD program (see export)"}
    assert result["xla"] == {"hlo": {"files": {"hlo_proto": "model.hlo_module.pb"}},
                             "check_static": fakes.static.to_dict()}
    assert result["collectives"] == {"all-reduce": {"count": 1, "replica_groups": [[[0, 1], [2, 3]]],
                                                    "bytes_per_rank": 32}}
    assert result["neuronx_cc"]["command"].startswith(f"neuronx-cc compile {out}/model.hlo_module.pb ")
    assert result["neuronx_cc"]["lnc"] == 1 and result["neuronx_cc"]["physical_neuron_cores"] == 4
    assert result["ok"] is True and result["mode"] == "prefill" and result["tokens"] == 8 and result["padding"]
    # the layer's own stats: 16 tokens (2 groups of 8, 2 of each masked) in blocks of 16
    assert result["experts_mode"] == "blockwise"
    text = (out / "trace.json").read_text()
    assert text.endswith("}\n") and json.loads(text) == json.loads(json.dumps(result))
    assert text.splitlines()[:2] == ["{", '  "config": "mixtral-8x7b",']  # indented by 2


def test_trace_layout_without_export_after_a_host_read(monkeypatch, tmp_path):
    fakes = TraceFakes(monkeypatch, host_sync="Unexpected execution")
    args = trace_flags("--out", str(tmp_path), "--ep", "2", "--mode", "decode", "--tokens", "2", "--atol", "0.125")
    result = trace_layout(args, spmd_layout_from_args(args))
    assert fakes.calls["export"] == [] and result["xla"]["hlo"] == {} and result["ok"] is False
    [(_, _, _, make_inputs, mode, n, atol)] = fakes.calls["check"]
    assert (mode, n, atol) == ("decode", 3, 0.125) and make_inputs(1)[0].shape[:2] == (4, 1)
    assert result["parallel"]["dispatch"] == "all_gather" and result["parallel"]["sequence_parallel"] is False
    assert result["neuronx_cc"]["lnc"] == 2


@pytest.mark.parametrize("given, message", [
    (("--ep", "3"), "expert_model_parallel_size (3) must divide num_experts (8)"),
    (("--tp", "2", "--sp", "--tokens", "15"), "sequence parallelism splits the prefill tokens (15) over the "
     "tensor-parallel size (2)"),
])
def test_trace_layout_names_a_bad_layout_before_building(monkeypatch, tmp_path, given, message):
    fakes = TraceFakes(monkeypatch)
    args = trace_flags("--out", str(tmp_path / "out"), *given)
    with pytest.raises(ValueError, match=re.escape(message)):
        trace_layout(args, spmd_layout_from_args(args))
    assert fakes.calls["build"] == [] and fakes.calls["devices"] == [] and not (tmp_path / "out").exists()
