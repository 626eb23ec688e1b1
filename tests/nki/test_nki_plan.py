"""``nxd-moe plan``: the deep dive's block-size rule, every section present, counts equal to a full numeric
simulation of the same kernel, the chart, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import numpy as np
import pytest
from nki_helpers import make_case

from nxd_moe import BlockwiseMatmulConfig
from nxd_moe.cli import main
from nxd_moe.config import load_model_config
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.token_mapping import num_static_blocks
from nxd_moe.nki_kernels.plan import (
    aif_table,
    balanced_expert_index,
    choose_block_size,
    decode_candidate,
    format_plan,
    plan,
    plot_plan,
    prefill_candidate,
    rank_problem,
)

SMALL_MODEL = {
    "name": "small", "num_experts": 4, "top_k": 2, "hidden_size": 256, "intermediate_size": 256,
    "experts": {"hidden_act": "silu", "glu_mlp": True},
}


def test_block_size_rule_reproduces_the_deep_dive_example():
    """1000 tokens, 8 experts, top-2: N = 15 at B=256, AIF = 256 * 15 / 8 = 480 >= 400, while B=128 gives
    128 * 23 / 8 = 368."""
    problem = rank_problem(load_model_config("mixtral-8x7b"), 1000)
    table = {row["block_size"]: row for row in aif_table(problem, 400.0)}
    assert table[256]["num_blocks"] == 15 and table[256]["aif"] == 480.0
    assert table[128]["num_blocks"] == 23 and table[128]["aif"] == 368.0
    assert choose_block_size(list(table.values())) == 256
    assert choose_block_size(aif_table(problem, 1e9)) == 1024  # unreachable target: the largest


@pytest.fixture(scope="module")
def qwen_report():
    return plan(load_model_config("qwen3-30b-a3b"), tokens=512)


def test_plan_report_has_every_section(qwen_report):
    text = format_plan(qwen_report)
    for heading in ("a model, not a measurement", "Block size by arithmetic intensity", "prefill block size:",
                    "prefill LNC2 strategy:", "fastest LNC2 strategy", "prefill DMA skipping:", "decode:",
                    "NxD's rule", "TP x EP", "TP vs EP", "prefer EP"):
        assert heading in text, heading


def test_plan_picks_the_block_size_by_hand(qwen_report):
    report = json.loads(json.dumps(qwen_report))  # what --json prints
    # T*k = 4096 assignments over 128 experts: N(B) = ceil((4096 - 127) / B) + 127; AIF = B * N / 128
    aif = {b: b * (math.ceil((4096 - 127) / b) + 127) / 128 for b in (128, 256, 512, 1024)}
    assert aif[256] < 400 <= aif[512]
    assert report["block_size"] == 512
    sizes = {c["label"]: c["estimated_us"] for c in report["candidates"] if c["section"] == "prefill block size"}
    assert report["fastest_block_size"] == int(min(sizes, key=sizes.get).removeprefix("B="))
    ran = [c for c in report["candidates"] if c["error"] is None]
    assert ran and all(c["estimated_us"] > 0 and c["dma_bytes"] > 0 for c in ran)
    decode = {c["label"]: c for c in report["candidates"] if c["section"] == "decode"}
    # 8 sequences x top-8 = 64 loads of an expert vs all 128 experts: selective reads about half the weight bytes
    assert decode["selective_loading"]["dma_bytes"] < 0.55 * decode["all_experts"]["dma_bytes"]
    assert report["decode_rule"]["mode"] == "selective_loading"


def test_plot_draws_every_section(qwen_report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    plot_plan(qwen_report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_counts_equal_a_full_numeric_simulation():
    """The plan's counting run (shape-only float inputs, repeated blocks replayed) counts exactly what a full
    numeric run of the same kernel on the same mapping counts."""
    model = load_model_config(SMALL_MODEL)
    problem = rank_problem(model, tokens=300)
    config = BlockwiseMatmulConfig(block_size=256, logical_nc_config=2, skip_dma_token=True, skip_dma_weight=True,
                                   use_shard_on_block_dynamic_while=True, block_sharding_strategy="PING_PONG")
    planned = prefill_candidate(problem, config, "s", "c")
    case = make_case(balanced_expert_index(300, 2, 4), num_experts=4, block_size=256)
    run = case.call(dataclasses.replace(config, num_static_blocks=num_static_blocks(300, 2, 256))).run()
    assert planned.error is None
    assert (planned.dma_bytes, planned.matmul_flops) == (run.accounting.dma_bytes(), run.accounting.matmul_flops)

    decode = decode_candidate(problem, 4, ExpertsMode.ALL_EXPERTS, 2, "decode")
    assert decode.matmul_flops == 4 * 6 * 256 * 256 * 4  # 4 experts x 4 tokens x (gate, up, down)


def test_cli_json_plot_and_tp_ep_splits(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main(["plan", "--config", "qwen3-30b-a3b", "--tokens", "256", "--tp", "2", "--ep", "2", "--json",
                 "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[:out.rindex("}") + 1])
    assert f"chart written to {path}" in out and path.read_bytes()[:4] == b"\x89PNG"
    splits = [c["label"] for c in report["candidates"] if c["section"].startswith("TP x EP")]
    assert splits == ["TP=1 EP=4", "TP=2 EP=2", "TP=4 EP=1"]
    assert report["per_rank"] == {"experts": 64, "hidden_size": 2048, "intermediate_size": 384, "top_k": 8}
    # Under EP selective loading still runs (NxD raises here): 8 sequences x ceil(8 / 2) local experts each read
    # 32 of the rank's 64 experts' weights, about half of what all-experts reads.
    selective = next(c for c in report["candidates"] if c["label"] == "selective_loading")
    all_experts = next(c for c in report["candidates"] if c["label"] == "all_experts")
    assert selective["error"] is None
    assert selective["dma_bytes"] < 0.55 * all_experts["dma_bytes"]


def test_plot_without_matplotlib_fails_before_simulating(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr("nxd_moe.nki_kernels.plan.plan", lambda *a, **k: pytest.fail("simulated anyway"))
    assert main(["plan", "--config", "qwen3-30b-a3b", "--tokens", "256", "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == ("nxd-moe plan: error: --plot needs matplotlib, which is not installed: pip "
                                       "install 'nxd-moe[plot]'\n")


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3"], "--ep must divide the number of experts (128)"),
    (["--tp", "5"], "--tp must divide the intermediate size (768)"),
    (["--tokens", "0"], "tokens must be in [1, inf]"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    args = ["plan", "--config", "qwen3-30b-a3b", "--tokens", "64", *argv]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_full_size_counts_without_materialising_weights():
    """DeepSeek-V3 at TP=8 x EP=8: 32 local experts of 3 x 7168 x 256 bf16 weights (352 MB) are counted, never
    allocated, and all-experts decode reads each of them once."""
    problem = rank_problem(load_model_config("deepseek-v3"), tokens=64, tp=8, ep=8)
    assert balanced_expert_index(4, 2, 4).tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]
    decode = decode_candidate(problem, 2, ExpertsMode.ALL_EXPERTS, 1, "decode")
    weights = 32 * 3 * 7168 * 256 * 2
    assert decode.error is None and weights <= decode.dma_bytes < 1.01 * weights
    assert np.isfinite(decode.estimated_us) and decode.bound == "dma"
