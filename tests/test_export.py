"""``torch.export`` (strict) of every expert mode, both routers, shared experts and the padding mask: the program
exports, has no data-dependent op or symbolic size (loop subgraphs included) and reproduces eager. Also the
library's compile check, the routing-varying inputs, and ``nxd-moe trace`` without ``torch_xla``.
"""

from __future__ import annotations

import importlib.util
import json
import re
from operator import itemgetter
from typing import Any, Callable

import pytest
import torch
from conftest import (
    FP32_ATOL,
    ItemExperts,
    NonzeroExperts,
    assert_close,
    make_config,
    make_experts,
    make_router,
    make_shared,
    randn,
    random_routing,
)

from nxd_moe import MoE
from nxd_moe.cli import main as cli_main
from nxd_moe.trace import ExportReport, compile_check, export_program, moe_inputs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")

# (forced ExpertMLPsV2 mode, BlockwiseMatmulConfig overrides)
EXPERT_MODES = {
    "blockwise": ("blockwise", {}),
    "blockwise_dynamic_while_intermediate": ("blockwise", dict(use_shard_on_intermediate_dynamic_while=True)),
    "blockwise_dynamic_while_block": ("blockwise", dict(use_shard_on_block_dynamic_while=True)),
    "capacity_factor": ("capacity_factor", {}),
    "selective_loading": ("selective_loading", {}),
    "all_experts": ("all_experts", {}),
}


class Forced(torch.nn.Module):
    """``ExpertMLPsV2`` with its mode as a constant (torch.export takes tensors, not strings)."""

    def __init__(self, experts, mode):
        super().__init__()
        self.experts, self.mode = experts, mode

    def forward(self, x, affinities, expert_index, padding_mask):
        return self.experts(x, affinities, expert_index, padding_mask=padding_mask, mode=self.mode)


def forced_experts(name: str) -> tuple[Forced, tuple]:
    mode, blockwise = EXPERT_MODES[name]
    cfg = make_config(num_experts=4, top_k=2, capacity_factor=1.0, bias=True, normalize_top_k_affinities=True)
    experts = make_experts(cfg, block_size=4, seed=1, blockwise=dict(blockwise, num_static_blocks=1) if blockwise
                           else None)
    affinities, expert_index = random_routing(12, 4, 2, seed=2)
    mask = torch.ones(12, dtype=torch.bool)
    mask[3] = False
    return Forced(experts, mode).eval(), (randn(12, 16, seed=3), affinities, expert_index, mask)


def assert_program_matches(report: ExportReport, module: torch.nn.Module, inputs: tuple,
                           output: Callable[[Any], torch.Tensor] = lambda out: out) -> None:
    """The exported program computes what ``module`` computes on ``inputs`` (``output`` picks the tensor to
    compare from what they return)."""
    with torch.no_grad():
        assert_close(output(report.program.module()(*inputs)), output(module(*inputs)), FP32_ATOL)


def exported_static(module: torch.nn.Module, inputs: tuple,
                    output: Callable[[Any], torch.Tensor] = lambda out: out) -> ExportReport:
    """``module``'s strict export on ``inputs``: static (no data-dependent op), and matching eager there."""
    report = export_program(module, inputs)
    assert report.static, report.data_dependent
    assert_program_matches(report, module, inputs, output)
    return report


@pytest.mark.parametrize("name", list(EXPERT_MODES))
def test_every_expert_mode_exports_static(name):
    module, inputs = forced_experts(name)
    report = exported_static(module, inputs)
    # a different routing through the same program: it is not specialised to the example's values
    affinities, expert_index = random_routing(12, 4, 2, seed=4, skew=3.0)
    assert_program_matches(report, module, (inputs[0], affinities, expert_index, inputs[3]))
    has_loop = "while_loop" in report.op_histogram
    assert has_loop == ("dynamic_while" in name)


MOE_CASES = {
    # name: (router, shape (B, S), capacity_factor, dynamic while flags); S == 1 is decode
    "prefill_blockwise": ("topk_softmax", (2, 8), None, {}),
    "prefill_dynamic_while": ("group_limited", (2, 8), None, dict(use_shard_on_block_dynamic_while=True)),
    "prefill_capacity": ("group_limited", (2, 8), 1.0, {}),
    "decode_selective": ("topk_softmax", (2, 1), None, {}),
    "decode_all_experts": ("group_limited", (8, 1), None, {}),
}


def moe_case(name: str):
    router_kind, shape, capacity_factor, blockwise = MOE_CASES[name]
    experts = make_experts(make_config(num_experts=8, top_k=2, capacity_factor=capacity_factor), block_size=4,
                           seed=5, blockwise=blockwise)
    moe = MoE(make_router(router_kind, 8, 2, 16, seed=6), experts, make_shared(16, shared_expert_gate=True)).eval()
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, -1] = False
    return moe, (randn(*shape, 16, seed=7), mask)


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_exports_static_with_shared_experts_and_padding(name):
    moe, inputs = moe_case(name)
    report = exported_static(moe, inputs, output=itemgetter(0))  # MoE returns (output, ...)
    assert report.to_dict()["static"] is True


@pytest.mark.parametrize("name", ["prefill_dynamic_while", "decode_all_experts"])
def test_compile_check_passes_on_the_layer(name):
    moe, inputs = moe_case(name)
    report = compile_check(moe, inputs)
    assert report.fullgraph, report.error
    assert report.max_abs_diff <= FP32_ATOL


# ----------------------------------------------------------------------------------------------------------
# negative controls: data-dependent implementations are reported


@pytest.mark.parametrize("module_cls", [NonzeroExperts, ItemExperts])
def test_data_dependent_module_is_reported(module_cls):
    module = module_cls()
    x, expert_index = randn(12, 16, seed=8), random_routing(12, 4, 2, seed=9)[1]
    module(x, expert_index)  # fine eagerly
    try:
        report = export_program(module, (x, expert_index))
    except Exception as e:  # strict export may refuse outright; that is a failure to be static too
        assert "data" in str(e).lower() or "guard" in str(e).lower() or "symbol" in str(e).lower(), str(e)[:300]
    else:
        assert not report.static
        assert any("nonzero" in p or "data-dependent" in p or "_local_scalar_dense" in p
                   for p in report.data_dependent), report.data_dependent
    compiled = compile_check(module, (x, expert_index))
    assert not compiled.fullgraph and compiled.error


def test_validate_inputs_is_reported_by_the_compile_check():
    """Our own value checks read data on the host: a real layer the check must reject."""
    experts = make_experts(make_config(), validate_inputs=True)
    affinities, expert_index = random_routing(6, 4, 2, seed=10)
    module = Forced(experts, "blockwise")
    report = compile_check(module, (randn(6, 16, seed=11), affinities, expert_index, None))
    assert not report.fullgraph


# ----------------------------------------------------------------------------------------------------------
# inputs that vary the routing


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_moe_inputs_first_routing_sends_every_token_to_the_same_experts(mode):
    moe, _ = moe_case("prefill_blockwise")
    make = moe_inputs(moe, 12, mode, padding=True)
    routings = []
    for i in range(3):
        x, mask = make(i)
        assert x.shape == ((1, 12, 16) if mode == "prefill" else (12, 1, 16))
        assert mask.shape == x.shape[:2] and int(mask.sum()) == 9
        with torch.no_grad():
            stats = moe(x, padding_mask=mask, return_stats=True)[-1]
        routings.append(stats.tokens_per_expert)
    assert int(routings[0].max()) == 9 and int((routings[0] > 0).sum()) == 2  # all 9 real tokens on k=2 experts
    assert not torch.equal(routings[1], routings[2])  # the others differ
    assert int(routings[1].max()) < 9


def test_moe_inputs_rejects_bad_arguments():
    moe, _ = moe_case("prefill_blockwise")
    with pytest.raises(ValueError, match="mode must be"):
        moe_inputs(moe, 4, "train")
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        moe_inputs(moe, 0)


# ----------------------------------------------------------------------------------------------------------
# nxd-moe trace in an environment without torch_xla


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_cli_trace_without_torch_xla_is_an_error_naming_the_extra(tmp_path, capsys):
    """The HLO is what ``trace`` is for: without torch_xla it stops at once (exit 2, one line naming the xla extra,
    nothing written) instead of reporting the checks it could run as "all checks passed"."""
    out = tmp_path / "trace"
    args = ["trace", "--config", "mixtral-8x7b", "--tokens", "32", "--scale", "64", "--block-size", "8",
            "--dynamic-while", "intermediate", "--out", str(out)]
    assert cli_main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and not captured.out, captured
    assert "tracing under XLA needs torch_xla, which is not installed: pip install " \
           "'nxd-moe[xla]'" in captured.err
    assert not out.exists()
    # --skip-xla asks for the rest, and the last line says what was not done
    assert cli_main([*args, "--skip-xla"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"torch.export \(strict\) +ok", text) and "all checks passed" not in text
    assert text.rstrip().endswith("torch.export and torch.compile checks passed; XLA checks skipped, no HLO written")
    report = json.loads((out / "trace.json").read_text())
    assert report["export"]["static"] and report["compile"]["fullgraph"]
    assert report["experts_mode"] == "blockwise" and report["dynamic_while"] == "intermediate"
    assert report["xla"] == {"skipped": "--skip-xla"} and not list(out.glob("*.hlo*"))
    loaded = torch.export.load(out / "program.pt2")
    assert "while_loop" in {str(getattr(n.target, "__name__", n.target)) for m in loaded.graph_module.modules()
                            if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes}


def test_cli_trace_decode_skip_xla(tmp_path, capsys):
    assert cli_main(["trace", "--config", "qwen3-30b-a3b", "--mode", "decode", "--scale", "64", "--skip-xla",
                     "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["experts_mode"] == "selective_loading" and report["tokens"] == 8  # 8 * 8 < 128 experts
    assert report["xla"] == {"skipped": "--skip-xla"} and report["ok"]


def test_cli_trace_bad_arguments(tmp_path, capsys):
    assert cli_main(["trace", "--config", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err
    assert cli_main(["trace", "--config", "mixtral-8x7b", "--routings", "1", "--out", str(tmp_path)]) == 2
    assert "--routings must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["trace", "--config", "mixtral-8x7b"])  # --out is required
