"""Every parallel layout as ONE SPMD program under ``torch_xla`` (CPU client, 4 devices in this process): each rank's
traced HLO is the same, every routing (all pairs on one EP rank included) is one graph compiled once, the
collectives are XLA ops over the layout's replica groups, and the compiled program run on the 4 devices -- each
with its rank's shard and rank tensor -- gives the single-device layer's output, and the gloo ranks' outputs.
Negative controls show each check can fail. Runs in the XLA environment; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
# Read when the XLA runtime starts (the first test that uses a device): this module's programs need 4 devices.
os.environ.setdefault("CPU_NUM_DEVICES", "4")
torch_xla = pytest.importorskip("torch_xla")

import torch  # noqa: E402
from gloo_reference import layer  # noqa: E402
from parallel_worker import quantized_pair  # noqa: E402

from nxd_moe import trace_spmd as ts  # noqa: E402
from nxd_moe.parallel_state import model_parallel_layout  # noqa: E402
from nxd_moe.trace import hlo_entry_parameters  # noqa: E402

WORLD = 4
# float32: the parallel layer sums the same products as one device in another order (intermediate slices and EP
# ranks' partial outputs added after their own sums, top-k pairs in another grouping). Each re-association moves a
# sum by at most (terms) * 2**-24 * sum|terms|; with <= 16 terms of size <= ~4 here that is ~4e-6: 1e-5 is float32
# rounding, while a wrong shard, slice or rank shows up at the outputs' own size (~0.1-10, checked below).
ATOL = 1e-5


def world_layout(tp: int, ep: int, sp: bool = False, decode: tuple[int, int] | None = None) -> ts.SPMDLayout:
    """The layout on the 4 devices: copies of a smaller block fill the world (expert-data-parallel replicas)."""
    return ts.SPMDLayout(tp, ep, sp, *(decode or (None, None)), expert_data_parallel_size=WORLD // (tp * ep))


# name: (layout, mode, tokens per token group, expected experts mode, layer kwargs)
CASES = {
    "tp2_ep2-all_gather-prefill": (world_layout(2, 2), "prefill", 16, "blockwise",
                                   dict(variant="qwen", shared="tp")),
    "tp2_ep2-all_to_all-prefill": (world_layout(2, 2), "prefill", 16, "blockwise",
                                   dict(variant="deepseek", shared="tp", dispatch="all_to_all_v")),
    "tp2_ep2_sp-all_gather-prefill": (world_layout(2, 2, sp=True), "prefill", 16, "blockwise",
                                      dict(variant="gptoss", shared="sp")),
    "tp2_ep2_sp-all_to_all-prefill": (world_layout(2, 2, sp=True), "prefill", 16, "blockwise",
                                      dict(variant="llama4", shared="tp", dispatch="all_to_all_v")),
    "tp2-all_gather-prefill": (world_layout(2, 1), "prefill", 16, "blockwise", dict(variant="gptoss", shared="tp")),
    "ep2-all_to_all-prefill": (world_layout(1, 2), "prefill", 16, "blockwise",
                               dict(variant="qwen", dispatch="all_to_all_v")),
    "tp2_ep2_sp-all_gather-selective": (world_layout(2, 2, sp=True), "decode", 1, "selective_loading",
                                        dict(variant="qwen", shared="sp")),
    "hybrid_tp4-all_to_all-selective": (world_layout(2, 2, decode=(4, 1)), "decode", 1, "selective_loading",
                                        dict(variant="gptoss", shared="tp", dispatch="all_to_all_v")),
    "hybrid_ep4-all_gather-all_experts": (world_layout(2, 2, decode=(1, 4)), "decode", 4, "all_experts",
                                          dict(variant="deepseek", shared="tp")),
    "tp2_ep2-all_to_all-all_experts": (world_layout(2, 2), "decode", 4, "all_experts",
                                       dict(variant="mixtral", dispatch="all_to_all_v")),
    # Pairs' positions among their expert's pairs in the block: capacity drops and EPLB replicas split by them.
    "tp2_ep2-all_to_all-capacity": (world_layout(2, 2), "prefill", 16, "capacity_factor",
                                    dict(variant="qwen", dispatch="all_to_all_v", capacity_factor=1.0)),
    "tp2_ep2_sp-all_to_all-eplb": (world_layout(2, 2, sp=True), "prefill", 16, "blockwise",
                                   dict(variant="qwen", dispatch="all_to_all_v",
                                        distribution=[[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]])),
}


def groups(layout: ts.SPMDLayout, kind: str) -> list[list[int]]:
    return [list(g) for g in getattr(model_parallel_layout(layout.world_size, layout.tensor_model_parallel_size,
                                                           layout.expert_model_parallel_size), kind)]


def expected_collectives(layout: ts.SPMDLayout, mode: str, dispatch: str, shared: str | None,
                         positions: bool = False) -> dict:
    """``{op: (count, [replica groups])}`` from the dispatch's description (docs/parallel.md, "Dispatch"): what the
    program must contain, written down independently of the code that emits it."""
    ops: dict[str, list] = {}

    def add(op: str, count: int, kind: str) -> None:
        entry = ops.setdefault(op, [0, []])
        entry[0] += count
        if groups(layout, kind) not in entry[1]:
            entry[1].append(groups(layout, kind))

    tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
    sharded = layout.sequence_parallel and mode == "prefill"
    block = "moe_model_parallel_groups"
    if dispatch == "all_to_all_v":
        if positions:
            add("all-gather", 1, block)  # per-expert pair counts of every rank's tokens
        add("all-to-all", 4, block)  # hidden, ids, weights out; partial outputs back
        if not sharded and tp > 1:
            add("all-gather", 1, "tensor_model_parallel_groups")  # the token group's chunks
    elif sharded:
        add("all-gather", 3, block)
        add("reduce-scatter", 1, block)
    else:
        if ep > 1:
            add("all-gather", 3, "expert_model_parallel_groups")
            add("reduce-scatter", 1, "expert_model_parallel_groups")
        if tp > 1:
            add("all-reduce", 1, "tensor_model_parallel_groups")
    if shared is not None and tp > 1:
        if not sharded:
            add("all-reduce", 1, "tensor_model_parallel_groups")
        elif shared == "tp":  # a sequence shard through sliced weights
            add("all-gather", 1, "tensor_model_parallel_groups")
            add("reduce-scatter", 1, "tensor_model_parallel_groups")
    return {op: tuple(v) for op, v in sorted(ops.items())}


def spmd_setup(layout: ts.SPMDLayout, build) -> tuple[torch.nn.Module, list[torch.nn.Module], list[str]]:
    full, ranks = ts.build_rank_layers(build, layout)
    devices = ts.xla_devices(layout.world_size)
    return full, ts.to_devices(ranks, devices), devices


def case_setup(name: str):
    layout, mode, tokens, experts_mode, kwargs = CASES[name]
    full, ranks, devices = spmd_setup(layout, lambda model_parallel=None: layer(layout, model_parallel, **kwargs))
    make = ts.block_inputs(full, layout, tokens, mode)
    return layout, mode, experts_mode, kwargs, full, ranks, devices, make


def assert_one_program(report: ts.SPMDReport) -> None:
    assert report.graphs == 1 and report.compilations == 1, report
    assert report.identical_across_ranks, report
    assert report.transfers_during_trace == 0 and report.host_sync is None and report.fallback_ops == [], report
    assert report.max_abs_diff <= ATOL * max(1.0, report.max_abs_ref) and report.ok, report
    assert report.max_abs_ref > 0.05  # not vacuous
    assert len(report.routing_ranks[0]) == 1, report  # routing 0: every pair of a block on one EP rank


@pytest.mark.parametrize("name", list(CASES))
def test_layout_is_one_program_matching_one_device(name):
    layout, mode, experts_mode, kwargs, full, ranks, devices, make = case_setup(name)
    with torch.no_grad():
        assert full(*make(1), return_stats=True)[-1].mode.value == experts_mode
    report = ts.check_spmd(full, ranks, layout, make, mode, n=3, atol=ATOL)
    assert_one_program(report)
    found = {op: (c["count"], c["replica_groups"]) for op, c in report.collectives.items()}
    assert found == expected_collectives(layout, mode, kwargs.get("dispatch", "all_gather"), kwargs.get("shared"),
                                         positions="capacity_factor" in kwargs or "distribution" in kwargs)
    # Per rank: the hidden states, the shard's weights and the (1,) rank tensors; nothing else differs by rank.
    ranks_in = {p.name: p.shape for p in report.parameters if p.kind == "rank"}
    assert "expert_mlps.spmd_rank.rank" in ranks_in and set(ranks_in.values()) == {(1,)}, ranks_in
    assert set(ranks_in) <= {"expert_mlps.spmd_rank.rank", "shared_experts.spmd_rank.rank"}
    assert [p.name for p in report.parameters if p.kind == "input"] == ["hidden_states"]


@pytest.mark.parametrize("fmt, layout, dispatch", [("fp8", world_layout(2, 2), "all_to_all_v"),
                                                   ("mxfp4", world_layout(2, 2, sp=True), "all_gather")])
def test_quantized_experts_are_one_program(fmt, layout, dispatch):
    """The stored FP8 / MxFP4 bytes and scales are each rank's inputs, sliced as on torch.distributed."""
    def build(model_parallel=None):
        pair = quantized_pair(fmt, dispatch, layout.sequence_parallel, "tp")
        return pair[0] if model_parallel is False else pair[1]

    full, ranks, devices = spmd_setup(layout, build)
    report = ts.check_spmd(full, ranks, layout, ts.block_inputs(full, layout, 16, "prefill"), "prefill", n=2,
                           atol=ATOL)
    assert_one_program(report)
    stored = {"fp8": "float8_e4m3fn", "mxfp4": "uint8"}[fmt]
    assert {p.dtype for p in report.parameters if p.kind == "weight" and "gate_up_proj.weight" in p.name} == {stored}


@pytest.mark.parametrize("off", [0, 1])
def test_the_output_check_sees_one_routing_off(off, monkeypatch):
    """Negative control of check_spmd's comparison: the single-device reference of one routing of two is shifted
    by 0.5; whichever it is, the report is not ok (a check of only the last -- or the first -- routing passes one)."""
    layout = world_layout(2, 2)
    full, ranks, devices = spmd_setup(layout, lambda model_parallel=None: layer(layout, model_parallel))
    real, calls = ts.SPMDLayout.per_block, []

    def shifted(self, layer_, world):
        calls.append(None)
        return real(self, layer_, world) + (0.5 if len(calls) - 1 == off else 0.0)

    monkeypatch.setattr(ts.SPMDLayout, "per_block", shifted)
    report = ts.check_spmd(full, ranks, layout, ts.block_inputs(full, layout, 16, "prefill"), "prefill", n=2,
                           atol=ATOL)
    assert len(calls) == 2 and report.graphs == 1 and report.identical_across_ranks
    assert not report.ok and 0.5 - 1e-3 <= report.max_abs_diff <= 0.5 + 1e-3, report

def test_bytes_per_rank_follow_the_dispatch_formula():
    """TP2 x EP2, all-gather dispatch, T tokens per token group, no shared experts: all-gather (EP-1) * T rows of
    H floats + k ids + k weights, reduce-scatter (EP-1) * T * H floats, all-reduce 2 (TP-1)/TP * T * H floats."""
    layout = world_layout(2, 2)
    full, ranks, devices = spmd_setup(layout, lambda model_parallel=None: layer(layout, model_parallel))
    report = ts.check_spmd(full, ranks, layout, ts.block_inputs(full, layout, 16, "prefill"), "prefill", n=2)
    tokens, hidden, k = 16, 16, 2
    moved = {op: c["bytes_per_rank"] for op, c in report.collectives.items()}
    assert moved == {"all-gather": tokens * (hidden * 4 + k * 4 + k * 4), "reduce-scatter": tokens * hidden * 4,
                     "all-reduce": tokens * hidden * 4}


# ----------------------------------------------------------------------------------------------------------
# the rank is a tensor input: the same compiled program gives each gloo rank's output


def gloo_outputs(tmp_path: Path, layout: ts.SPMDLayout, world: list[torch.Tensor], mode: str, **kwargs):
    """Each rank's output of the same layer on torch.distributed (gloo, one process per rank)."""
    torch.save(world, tmp_path / "input.pt")
    spec = json.dumps({"layout": {"tensor_model_parallel_size": layout.tensor_model_parallel_size,
                                  "expert_model_parallel_size": layout.expert_model_parallel_size,
                                  "sequence_parallel": layout.sequence_parallel}, "mode": mode, **kwargs})
    script = Path(__file__).with_name("gloo_reference.py")
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "PJRT_DEVICE")}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(r), str(layout.world_size), spec],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(layout.world_size)]
    logs = [p.communicate(timeout=240)[0].decode()[-2000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(layout.world_size)]


def test_two_ranks_shards_through_one_program_give_the_gloo_ranks_outputs(tmp_path):
    """TP2 with the all-to-all dispatch: rank-dependent are the tokens a rank dispatches, its slice of the
    intermediate dimension (GPT-OSS: a padded one) and the down-projection bias (TP rank 0 only). Ranks 0 and 1 run
    the compiled program with their own shard and rank tensor and give what the two gloo ranks give; with the two
    rank tensors swapped (each shard told it is the other rank) they do not."""
    kwargs = dict(variant="gptoss", shared="tp", dispatch="all_to_all_v")
    layout = world_layout(2, 1)
    full, ranks, devices = spmd_setup(layout, lambda model_parallel=None: layer(layout, model_parallel, **kwargs))
    world = list(ts.block_inputs(full, layout, 16, "prefill")(2))
    with ts.session(layout, devices):
        programs = ts.trace_world(ranks, layout, world, "prefill")
        ts.compile_program(programs[0])
        arguments = [p.arguments for p in programs]
        outputs = ts.run_replicated(programs[0].graph_hash, arguments, devices)
        rank_at = [p.number for p in programs[0].parameters if p.kind == "rank"]
        swapped = [list(a) for a in arguments]
        for number in rank_at:  # ranks 0 and 1 (a block) trade rank tensors; so do ranks 2 and 3
            for r in range(WORLD):
                swapped[r][number] = arguments[r ^ 1][number].cpu().to(torch.device(devices[r]))
        wrong = ts.run_replicated(programs[0].graph_hash, swapped, devices)
    block0 = [t[:t.shape[0] // 2] for t in world]  # the gloo world is one block: ranks 0 and 1
    gloo = gloo_outputs(tmp_path, ts.SPMDLayout(2, 1), block0, "prefill", **kwargs)
    for rank in range(2):
        scale = float(gloo[rank].abs().max())
        assert scale > 0.1  # not vacuous
        assert float((outputs[rank][0] - gloo[rank]).abs().max()) <= ATOL
        assert float((wrong[rank][0] - gloo[rank]).abs().max()) > 100 * ATOL  # the rank tensor is read


# ----------------------------------------------------------------------------------------------------------
# negative controls and bad layouts


class RankSliced(torch.nn.Module):
    """Takes its row by a Python int rank: a different program per rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x[self.rank:self.rank + 1] * self.weight,)


class RankConstant(RankSliced):
    """Adds a Python int rank as a table it copies to the device: the same HLO (a copied tensor is a parameter),
    but a per-rank value outside the inputs."""

    def forward(self, x):
        return (x * self.weight + torch.tensor([float(self.rank)] * 4).to(x.device),)


class HostRead(RankSliced):
    def forward(self, x):
        return (x * float(x.sum()),)


def trace_two(module_cls) -> list[ts.RankProgram]:
    devices = ts.xla_devices(WORLD)[:2]
    programs = []
    for rank, device in enumerate(devices):
        module = module_cls(rank).to(torch.device(device))
        x = torch.arange(8, dtype=torch.float32).view(2, 4).to(torch.device(device))
        programs.append(ts.trace_rank(module, [x]))
    return programs


def test_a_python_rank_in_the_program_is_caught():
    sliced = trace_two(RankSliced)
    assert sliced[0].program_text != sliced[1].program_text
    constant = trace_two(RankConstant)
    assert constant[0].program_text == constant[1].program_text and not ts.shared_values_equal(constant)
    plain = trace_two(lambda rank: RankConstant(0))  # the control's control: same program, same values
    assert plain[0].program_text == plain[1].program_text and ts.shared_values_equal(plain)


def test_a_host_read_inside_the_layer_is_reported_not_run():
    program = trace_two(HostRead)[0]
    assert program.host_sync is not None and "Unexpected execution" in program.host_sync


@pytest.mark.parametrize("layout, tokens, message", [
    (ts.SPMDLayout(1, 3), 16, r"expert_model_parallel_size \(3\) must divide num_experts \(8\)"),
    (ts.SPMDLayout(2, 2, True), 15, r"prefill tokens \(15\) over the tensor-parallel size \(2\)"),
    (ts.SPMDLayout(3, 1), 16, None),
])
def test_bad_layouts_are_named_before_tracing(layout, tokens, message):
    if message is None:  # a good one: the check passes
        layout.check(8, tokens, "prefill")
        return
    with pytest.raises(ValueError, match=message):
        layout.check(8, tokens, "prefill")


def test_cli_names_a_bad_layout_before_building(tmp_path, capsys):
    from nxd_moe.cli import main

    compiles = torch_xla.debug.metrics.counter_value("UncachedCompile") or 0
    assert main(["trace", "--config", "qwen3-30b-a3b", "--tp", "2", "--ep", "3", "--out", str(tmp_path)]) == 2
    assert "expert_model_parallel_size (3) must divide num_experts (128)" in capsys.readouterr().err
    assert main(["trace", "--config", "qwen3-30b-a3b", "--tp", "4", "--sp", "--tokens", "30",
                 "--out", str(tmp_path)]) == 2
    assert "prefill tokens (30)" in capsys.readouterr().err
    assert (torch_xla.debug.metrics.counter_value("UncachedCompile") or 0) == compiles
    assert not (tmp_path / "model.hlo_module.pb").exists()


def test_cli_traces_qwen3_tp2_ep2_prefill(tmp_path, capsys):
    """``nxd-moe trace --tp 2 --ep 2`` (with dynamic-while block skipping: an XLA ``while`` in the SPMD program): the
    files, and trace.json in the single-device schema plus the SPMD keys."""
    from nxd_moe.cli import main

    assert main(["trace", "--config", "qwen3-30b-a3b", "--tp", "2", "--ep", "2", "--tokens", "64", "--routings", "2",
                 "--dynamic-while", "intermediate", "--out", str(tmp_path)]) == 0
    assert "all checks passed" in capsys.readouterr().out
    report = json.loads((tmp_path / "trace.json").read_text())
    assert report["ok"] and report["xla"]["check_static"]["ok"]
    assert {"config", "mode", "experts_mode", "num_blocks", "quantization", "export", "compile", "xla"} <= set(report)
    assert report["collectives"]["all-gather"]["replica_groups"] == [[[0, 2], [1, 3]]]
    assert report["neuronx_cc"]["world_size"] == 4 and "--lnc 2" in report["neuronx_cc"]["command"]
    assert report["dynamic_while"] == "intermediate" and report["xla"]["hlo"]["op_histogram"]["while"] == 1
    files = report["xla"]["hlo"]["files"]
    for name in [files["hlo_text"], files["hlo_proto"], files["parameters"], files["shared"], *files["shards"]]:
        assert (tmp_path / name).stat().st_size > 0
    parameters = json.loads((tmp_path / "parameters.json").read_text())
    shard = torch.load(tmp_path / "shards" / "rank3.pt")
    assert shard["expert_mlps.spmd_rank.rank"].tolist() == [3]
    for p in parameters:
        if p["kind"] in ("weight", "rank"):
            assert list(shard[p["name"]].shape) == p["shape"]
    # the map is the HLO's ENTRY parameter list, with how each value is sharded (TP 2 x EP 2 of Qwen3's 128
    # experts: 64 experts and half the intermediate columns per rank; the router whole on every rank)
    entry = hlo_entry_parameters((tmp_path / "model.hlo.txt").read_text())
    assert [(p["shape"], p["dtype"]) for p in parameters] == [(list(shape), dtype) for shape, dtype in entry]
    sharding = {p["name"]: p["sharding"] for p in parameters}
    assert sharding["router.linear_router.weight"] == "replicated"
    assert sharding["expert_mlps.mlp_op.down_proj.weight"] == "split dim 0: 64 of 128, dim 1: 24 of 48"
    assert sharding["hidden_states"] == sharding["expert_mlps.spmd_rank.rank"] == "per rank"
    assert {p["sharding"] for p in parameters if p["kind"] == "shared"} <= {"replicated"}
