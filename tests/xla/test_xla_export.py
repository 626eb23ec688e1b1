"""``export_hlo`` and ``nxd-moe trace`` under ``torch_xla``: the HLO module (text and ``HloModuleProto``) of one
forward, its report (one graph, no CPU fallback, no mid-layer transfer, op histogram, shapes), the ``while`` of
dynamic-while block skipping with its on-device block count, and the command line's artifacts.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")

import torch_xla.core.xla_builder as xb  # noqa: E402

from conftest import make_config, make_experts, make_router, make_shared  # noqa: E402
from nxd_moe import MoE  # noqa: E402
from nxd_moe.cli import main as cli_main  # noqa: E402
from nxd_moe.trace import export_hlo, hlo_op_histogram, moe_inputs  # noqa: E402

FLAGS = {
    "off": {},
    "intermediate": dict(use_shard_on_intermediate_dynamic_while=True, num_static_blocks=0),
    "block": dict(use_shard_on_block_dynamic_while=True),
}


def build(flag: str) -> MoE:
    experts = make_experts(make_config(num_experts=8, top_k=2, hidden_size=16), block_size=2, seed=1,
                           blockwise=FLAGS[flag])
    return MoE(make_router("group_limited", 8, 2, 16, seed=2), experts, make_shared(16)).eval()


@pytest.mark.parametrize("flag", list(FLAGS))
def test_export_hlo_writes_the_module_and_its_report(flag, tmp_path):
    moe = build(flag)
    x, mask = moe_inputs(moe, 20, "prefill", padding=True)(0)  # every token on the same 2 experts
    report = export_hlo(moe, (x, mask), tmp_path, atol=1e-5)
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    text = (tmp_path / "model.hlo.txt").read_text()
    assert text.startswith("HloModule") and "ENTRY" in text
    proto = (tmp_path / "model.hlo_module.pb").read_bytes()
    # the proto is a well-formed HloModuleProto of the same module
    assert "ENTRY" in xb.get_computation_hlo(xb.computation_from_module_proto("reloaded", proto))
    assert report["compiled_graphs"] == 1 and report["fallback_ops"] == []
    assert report["executions_during_trace"] == 0 and report["transfers_during_trace"] == 0
    assert report["output_fetch_transfers"] >= 1
    assert report["static"] and report["matches_eager"]
    assert report["inputs"] == [{"shape": [1, 20, 16], "dtype": "float32"}, {"shape": [1, 20], "dtype": "bool"}]
    assert report["outputs"] == [{"shape": [1, 20, 16], "dtype": "float32"}]
    assert report["op_histogram"] == hlo_op_histogram(text) and report["op_histogram"]["dot"] >= 3
    if flag == "off":
        assert report["while_ops"] == 0 and report["blocks"] == []  # the detector is not vacuous
        return
    assert report["while_ops"] >= 1
    (blocks,) = report["blocks"]
    assert blocks["computed"] == blocks["expected"]
    # 15 real tokens on 2 experts, blocks of 2: 8 active blocks each
    assert blocks["active"] == 16 and blocks["num_blocks"] > blocks["computed"]
    if flag == "intermediate":
        assert blocks["computed"] == blocks["active"] and blocks["skipped"] == blocks["num_blocks"] - 16


def test_hlo_op_histogram_reads_tuple_shaped_instructions():
    text = """HloModule m
ENTRY %main (p0: f32[2]) -> (f32[2], s64[]) {
  %p0 = f32[2]{0} parameter(0)
  %add.1 = f32[2]{0} add(f32[2]{0} %p0, f32[2]{0} %p0)
  %w = (s64[], f32[2]{0}) while((s64[], f32[2]{0}) %t), condition=%c, body=%b
  ROOT %tuple.2 = (f32[2]{0}, s64[]) tuple(f32[2]{0} %add.1, s64[] %x)
}"""
    assert hlo_op_histogram(text) == {"add": 1, "parameter": 1, "tuple": 1, "while": 1}


def test_cli_trace_writes_everything_and_passes(tmp_path, capsys):
    out = tmp_path / "trace"
    code = cli_main(["trace", "--config", "deepseek-v3", "--tokens", "40", "--scale", "112", "--block-size", "4",
                     "--dynamic-while", "block", "--padding", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    for name in ("model.hlo.txt", "model.hlo_module.pb", "report.json", "trace.json", "program.pt2"):
        assert (out / name).is_file(), name
    report = json.loads((out / "trace.json").read_text())
    assert report["ok"] and report["router"] == "GroupLimitedRouter" and report["experts_mode"] == "blockwise"
    static = report["xla"]["check_static"]
    assert static["graphs"] == 1 and static["compilations"] == 1 and static["static"]
    assert report["xla"]["hlo"]["while_ops"] >= 1
    assert "neuronx-cc compile" in text and "--framework XLA --target trn2" in text and "all checks passed" in text
