"""``export_hlo`` and ``nxd-moe trace`` under ``torch_xla``: the HLO module (text and ``HloModuleProto``) of one
forward, its report (one graph, no CPU fallback, no mid-layer transfer, op histogram, shapes), the ``while`` of
dynamic-while block skipping with its on-device block count, and the command line's artifacts.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")

import torch_xla.core.xla_builder as xb  # noqa: E402
from conftest import make_config, make_experts, make_router, make_shared  # noqa: E402

from nxd_moe import MoE  # noqa: E402
from nxd_moe.cli import main as cli_main  # noqa: E402
from nxd_moe.trace import export_hlo, hlo_entry_parameters, hlo_op_histogram, moe_inputs, run_exported  # noqa: E402

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


def assert_map_matches_the_hlo(out_dir, module) -> list[dict]:
    """parameters.json lists the HLO's ENTRY parameters in number order with their shapes and dtypes; every weight
    is the module's own tensor (by module path) and weights.pt holds its value."""
    parameters = json.loads((out_dir / "parameters.json").read_text())
    entry = hlo_entry_parameters((out_dir / "model.hlo.txt").read_text())
    assert [p["number"] for p in parameters] == list(range(len(entry)))
    assert [(p["shape"], p["dtype"]) for p in parameters] == [(list(s), d) for s, d in entry]
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    saved = torch.load(out_dir / "weights.pt")
    weights = [p for p in parameters if p["kind"] == "weight"]
    assert weights and sorted(saved) == sorted(p["name"] for p in weights)
    for p in weights:
        assert torch.equal(saved[p["name"]], own[p["name"]].detach()), p
    assert sorted(torch.load(out_dir / "shared.pt")) == [p["number"] for p in parameters if p["kind"] == "shared"]
    return parameters


def test_the_exported_layer_runs_from_its_parameter_map(tmp_path):
    """The map is usable: the HLO proto fed in parameters.json's order from the files alone computes the layer."""
    moe = build("intermediate")
    x, mask = moe_inputs(moe, 20, "prefill", padding=True)(1)
    export_hlo(moe, (x, mask), tmp_path, atol=1e-5)
    parameters = assert_map_matches_the_hlo(tmp_path, moe)
    assert [p["name"] for p in parameters if p["kind"] == "input"] == ["hidden_states", "padding_mask"]
    x2, mask2 = moe_inputs(moe, 20, "prefill", padding=True, seed=5)(1)  # other values, same shapes
    (out,) = run_exported(tmp_path, {"hidden_states": x2, "padding_mask": mask2})
    with torch.no_grad():
        assert (out - moe(x2, mask2)[0]).abs().max() <= 1e-5
    # Negative control: the program reads what it is fed -- a weight fed wrong gives another output.
    weights = torch.load(tmp_path / "weights.pt")
    weights["expert_mlps.mlp_op.down_proj.weight"] = 2 * weights["expert_mlps.mlp_op.down_proj.weight"]
    (wrong,) = run_exported(tmp_path, {"hidden_states": x2, "padding_mask": mask2}, weights)
    assert (wrong - out).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"the program takes \['padding_mask'\] as well"):
        run_exported(tmp_path, {"hidden_states": x2})


def test_the_exported_decoder_step_runs_from_its_parameter_map(tmp_path):
    """A whole decoder step (Qwen3-MoE, its blocks patched): inputs named input_ids, cache_position and
    cache.<layer>.keys/values; weights by module path (the patched blocks' nxd_moe tensors)."""
    from nxd_moe.hf import patch_model
    from nxd_moe.models.decoder_step import StaticCacheStep
    from nxd_moe.models.hf_models import build_hf_model
    from nxd_moe.trace import model_inputs

    pytest.importorskip("transformers")
    step = StaticCacheStep(patch_model(build_hf_model("qwen3-30b-a3b", num_layers=1, scale=64,
                                                      attn_implementation="eager"), backend="torch"), 16).eval()
    make = model_inputs(step, 2, "decode")
    export_hlo(step, make(1), tmp_path, atol=1e-4)
    parameters = assert_map_matches_the_hlo(tmp_path, step)
    names = ["input_ids", "cache_position", "cache.0.keys", "cache.0.values"]
    assert sorted(p["name"] for p in parameters if p["kind"] == "input") == sorted(names)
    assert any(p["name"].endswith("mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight") for p in parameters)
    inputs = make(2)
    outputs = run_exported(tmp_path, dict(zip(names, inputs)))
    with torch.no_grad():
        expected = step(*inputs)
    assert len(outputs) == len(expected)
    assert max((o - e).abs().max().item() for o, e in zip(outputs, expected)) <= 1e-4
