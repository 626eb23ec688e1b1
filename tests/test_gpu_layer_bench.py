"""``benchmarks/gpu_layer.py`` on the CPU: the harness, its stand-in for vLLM's align op, its float64 reference and
its derived numbers. (The GPU run itself is a benchmark, not a test: see benchmarks/README.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpu_peers  # noqa: E402
import _vllm_stubs  # noqa: E402
import gpu_layer  # noqa: E402

from nxd_moe.reference import reference_for_moe  # noqa: E402


def test_align_to_blocks_groups_pairs_by_expert_in_padded_blocks():
    # pairs (t*k + j): 0->e0 1->e2 | 2->e2 3->e1 | 4->e2 5->e0; block 2; pad id = 6
    topk_ids = torch.tensor([[0, 2], [2, 1], [2, 0]])
    sorted_ids, expert_ids, padded = _vllm_stubs._moe_align_block_size(topk_ids, block_size=2, num_experts=4)
    assert sorted_ids.tolist() == [0, 5, 3, 6, 1, 2, 4, 6, 6, 6]
    assert expert_ids.tolist() == [0, 1, 2, 2, -1]
    assert padded.tolist() == [8]


def test_align_to_blocks_with_fewer_pairs_than_experts_clamps_the_buffer():
    sorted_ids, expert_ids, padded = _vllm_stubs._moe_align_block_size(torch.tensor([[5, 1]]), block_size=4,
                                                                        num_experts=8)
    assert sorted_ids.numel() == 2 * 4  # min(pairs + E (block - 1), pairs * block)
    assert sorted_ids.tolist() == [1, 2, 2, 2, 0, 2, 2, 2] and expert_ids.tolist() == [1, 5]
    assert padded.tolist() == [8]


def test_align_stand_in_is_one_kernel_with_vllms_contract():
    """Random routings, many experts: every expert's segment holds exactly its pairs in pair order, padded to the
    block; the rest is the padding id; each block names its expert (-1 past the used ones)."""
    for num_tokens, top_k, num_experts, block in ((300, 8, 64, 16), (37, 2, 8, 64), (5, 8, 256, 16)):
        gen = torch.Generator().manual_seed(num_tokens)
        topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        sorted_ids, expert_ids, padded = _vllm_stubs._moe_align_block_size(topk_ids, block, num_experts)
        pairs = topk_ids.reshape(-1)
        counts = torch.bincount(pairs, minlength=num_experts)
        blocks = (counts + block - 1) // block
        assert padded.item() == int(blocks.sum()) * block
        start = 0
        for e in range(num_experts):
            segment = sorted_ids[start:start + int(blocks[e]) * block]
            assert segment[:int(counts[e])].tolist() == torch.nonzero(pairs == e).flatten().tolist()
            assert (segment[int(counts[e]):] == pairs.numel()).all()
            assert (expert_ids[start // block:(start // block) + int(blocks[e])] == e).all()
            start += int(blocks[e]) * block
        assert (sorted_ids[start:] == pairs.numel()).all() and (expert_ids[start // block:] == -1).all()


def test_silu_and_mul_stand_in_is_one_kernel():
    gate_up = torch.randn(5, 2 * 300, dtype=torch.float32)
    out = torch.empty(5, 300)
    _vllm_stubs._silu_and_mul(_vllm_stubs._Activation.SILU, out, gate_up)
    expected = torch.nn.functional.silu(gate_up[:, :300].double()) * gate_up[:, 300:].double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_reused_alignment_computes_the_alignment_once():
    calls = []
    module = type("Module", (), {})()
    module.moe_align_block_size = lambda ids, block, experts: calls.append(ids) or ("aligned", ids)
    reuse = _vllm_stubs.ReusedAlignment(module)
    first = reuse(lambda ids: module.moe_align_block_size(ids, 16, 8), "first routing")
    again = reuse(lambda ids: module.moe_align_block_size(ids, 16, 8), "second routing")
    assert first == again == ("aligned", "first routing") and calls == ["first routing"]
    assert module.moe_align_block_size("x", 16, 8) == ("aligned", "x")  # restored after each call


@pytest.mark.parametrize("name", ["smoke-decode-m3", "smoke-llama4-shared-decode-m4", "smoke-balanced-prefill-m16"])
def test_peer_reference_is_the_function_our_layer_computes(name):
    """The benchmark's float64 reference (written for the peers' weight layout) and nxd_moe's own reference
    (from our layer's weights after the benchmark loaded them) agree: same weights, same function (up to the
    fp32 rounding of the routing weights, which each computes its own way)."""
    case = gpu_layer.ALL_CASES[name]
    problem, inputs = gpu_layer.make_problem(case, torch.float32, torch.device("cpu"), rotations=2, seed=0)
    moe = _gpu_peers.build_ours(problem, "torch", None, torch.float32, "cpu")
    for x in inputs:
        ours = reference_for_moe(moe, x.view(1, *x.shape)).view(x.shape)
        theirs = _gpu_peers.reference(problem, x)
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_balanced_routing_gives_every_expert_the_same_rows():
    case = gpu_layer.ALL_CASES["smoke-balanced-prefill-m16"]
    problem, inputs = gpu_layer.make_problem(case, torch.float32, torch.device("cpu"), rotations=3, seed=0)
    for r, x in enumerate(inputs):
        _, ids = problem.route(x)
        assert ids[:, 0].tolist() == [(t + r) % case.num_experts for t in range(case.tokens)]


def test_derived_ratios_from_hand_numbers():
    case = {"touched_weight_bytes": 3e9, "useful_flop": 1e12, "contenders": {
        "fast_peer": {"kind": "peer", "correct": True, "eager": {"us": 3000.0}, "graph": {"us": 2000.0}},
        "wrong_peer": {"kind": "peer", "correct": False, "graph": {"us": 10.0}},
        "eager_peer": {"kind": "peer", "correct": True, "eager": {"us": 2500.0}},
        "nxd_torch": {"kind": "ours", "correct": True, "eager": {"us": 1200.0}, "graph": {"us": 1000.0}},
    }}
    gpu_layer.derive(case, {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 500.0})
    assert case["roofline_us"] == pytest.approx(2000.0)  # max(3e9 B / 3 TB/s, 1e12 / 500 TFLOP/s) = max(1000, 2000)
    assert case["best_peer"] == "fast_peer" and case["best_peer_us"] == 2000.0  # the wrong one cannot win
    ours = case["contenders"]["nxd_torch"]
    assert ours["timing"] == "graph" and ours["vs_best_peer"] == pytest.approx(2.0)
    assert ours["vs_roofline"] == pytest.approx(2.0) and ours["TBps_touched"] == pytest.approx(3.0)
    assert ours["TFLOPs"] == pytest.approx(1000.0)
    assert case["contenders"]["eager_peer"]["timing"] == "eager"
    assert "1000g x2.00 200%rf" in gpu_layer.table({"cases": {"c": case}})


def _run_harness(tmp_path, *args, env=None) -> dict:
    out = tmp_path / "gpu_layer.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_layer.py"), "--device", "cpu", "--min-samples", "2",
           "--target-s", "0.001", "--warmup", "1", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.rstrip().endswith("/ ours")  # the table is printed last
    return json.loads(out.read_text())


def test_harness_end_to_end_on_cpu(tmp_path):
    result = _run_harness(tmp_path, "--cases", "smoke-llama4", "--impls", "torch_grouped_mm,hf_batched_mm,nxd_torch")
    assert result["schema_version"] == gpu_layer.SCHEMA_VERSION and result["environment"]["torch"]
    case = result["cases"]["smoke-llama4-shared-decode-m4"]
    assert case["case"]["function"] == "llama4" and case["touched_weight_bytes"] > 0 and case["useful_flop"] > 0
    assert set(case["contenders"]) == {"torch_grouped_mm", "hf_batched_mm", "nxd_torch"}
    for name, row in case["contenders"].items():
        assert row["correct"] and row["rel_err"] < 1e-5, name
        assert row["eager"]["us"] > 0 and row["timing"] == "eager" and "graph" not in row
    assert case["best_peer"] in ("torch_grouped_mm", "hf_batched_mm")
    assert case["contenders"]["nxd_torch"]["mode"] in ("selective_loading", "all_experts")
    assert {row["contender"] for row in result["headline"]} == set(case["contenders"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's float8 cast rounds differently")
@pytest.mark.parametrize("group", [128, 14336])
def test_fp8_activation_stand_in_is_dynamic_fp8_per_group(group):
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(7, 14336, device="cuda", generator=gen, dtype=torch.bfloat16) * 5
    a[3] = 0.0  # an all-zero row keeps a finite scale
    q, scale = _vllm_stubs.quantize_activations_fp8(a, group)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 14336 // group)
    groups = a.double().view(7, -1, group)
    expected_scale = groups.abs().amax(-1).clamp_min(1e-12) / 448.0
    torch.testing.assert_close(scale.double(), expected_scale, rtol=1e-6, atol=0)
    expected = (groups / scale.double()[..., None]).float().to(torch.float8_e4m3fn).view(7, -1)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(not (ROOT / ".peers" / "vllm_src").is_dir(), reason="no unpacked vLLM in .peers/vllm_src")
def test_vllm_kernel_through_the_stubs_under_the_triton_interpreter(tmp_path):
    result = _run_harness(tmp_path, "--cases", "smoke-prefill-m33", "--impls", "vllm_triton",
                          "--vllm-src", str(ROOT / ".peers" / "vllm_src"), env={"TRITON_INTERPRET": "1"})
    row = result["cases"]["smoke-prefill-m33"]["contenders"]["vllm_triton"]
    assert row["correct"] and row["rel_err"] < 1e-5, row
    assert row["vllm_config"]["tuned_file_found"] is False  # no tuned file for a CPU "device"


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".peers" / "liger_kernel").is_dir(), reason="no unpacked Liger in .peers/liger_kernel")
def test_liger_through_the_harness_under_the_triton_interpreter(tmp_path):
    result = _run_harness(tmp_path, "--cases", "smoke-llama4", "--impls", "liger", "--liger-src", str(ROOT / ".peers"),
                          env={"TRITON_INTERPRET": "1"})
    row = result["cases"]["smoke-llama4-shared-decode-m4"]["contenders"]["liger"]
    assert row["correct"] and row["rel_err"] < 1e-5 and "pinned config" in row["what"], row


def test_markdown_reports_the_targets_from_the_json():
    def case(group, tokens, decode, contenders):
        c = {"case": {"group": group, "tokens": tokens, "decode": decode}, "touched_weight_bytes": 3e8,
             "useful_flop": 1e11, "contenders": contenders}
        gpu_layer.derive(c, {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 800.0})
        return c

    peer = {"kind": "peer", "correct": True, "graph": {"us": 300.0}}
    result = {"date": "d", "environment": {"gpu": "G"}, "roofline": {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 800.0},
              "cases": {
                  "llama4-scout-tp8-shared-decode-m64": case("llama4", 64, True, {
                      "vllm_triton": {**peer, "eager": {"us": 500.0}},
                      "nxd_triton": {"kind": "ours", "correct": True, "graph": {"us": 120.0},
                                     "eager": {"us": 231.0}}}),
                  "qwen3-30b-a3b-prefill-m4096": case("issue", 4096, False, {
                      "vllm_triton": dict(peer), "nxd_triton": {"kind": "ours", "correct": True,
                                                                "graph": {"us": 250.0}}}),
              }}
    text = gpu_layer.markdown(result)
    # 3e8 B in 120 us = 2.5 TB/s = 83% of 3 TB/s: below the 85% decode target
    assert "| decode M <= 64: >= 85% of copy bandwidth on touched weights | worst 83% " in text
    assert "| Llama 4 Scout TP8 decode layer with shared expert <= 185 us | 120 us | yes |" in text
    assert "| qwen3-30b-a3b-prefill-m4096: >= 1.5x the best peer (vllm_triton) | 1.20x | no |" in text
    assert "| never slower than the best peer | slowest 1.20x (qwen3-30b-a3b-prefill-m4096) | yes |" in text
    # 231 us eager > 1.5 * 120 + 50 = 230 us; 231 / 500 = 0.46 of vLLM's eager time
    assert ("| eager decode <= 1.5x the graphed time + 50 us | worst 231 us eager vs 120 us graphed "
            "(llama4-scout-tp8-shared-decode-m64) | no |") in text
    assert "| eager decode faster than vLLM's eager call | worst 0.46x its time " in text
