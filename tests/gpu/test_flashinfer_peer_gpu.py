"""The FlashInfer peer (``benchmarks/_gpu_peers.flashinfer_contender``, ``_quantized_peers.flashinfer_fp8_block``) on
a GPU: FlashInfer's CUTLASS fused MoE, given our weights in its layout, computes the layer every peer computes.
Skipped without CUDA or without flashinfer (carried by ``benchmarks/flashinfer_carry.sh``, folder
``.peers/flashinfer/site`` or ``FLASHINFER_SITE``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import UNIT_ROUNDOFF, assert_rounding_close, capture_cuda_graph, rounding_tolerance

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpu_peers  # noqa: E402
import gpu_layer  # noqa: E402

SITE = os.environ.get("FLASHINFER_SITE", str(ROOT / ".peers" / "flashinfer" / "site"))
if not torch.cuda.is_available():
    pytest.skip("FlashInfer's CUTLASS MoE needs CUDA", allow_module_level=True)
WHY_NOT = _gpu_peers.flashinfer_unavailable(SITE)
if WHY_NOT:
    pytest.skip(WHY_NOT, allow_module_level=True)

# (name, T, E, k, H, I, decode): decode and prefill row counts, FlashInfer's alignment (H, I multiples of 128)
CASES = [("decode", 3, 8, 2, 256, 512, True), ("prefill", 300, 16, 4, 512, 256, False)]
# Its bf16 path stores in bf16: the GEMM1 result, the SwiGLU output, each expert's GEMM2 row, the combined output
# (the fused finalize adds the k rows into it): 4 roundings of u(bf16), the longest sum max(H, I) terms in fp32.
BF16_ROUNDINGS = 4
# FP8 block path: both GEMM inputs quantized to e4m3 (u = 2**-4) per 128 columns inside the call, on top of the bf16
# roundings; ours (W8A16) quantizes none. Each rounding moves its GEMM's output by <= u of its scale.
E4M3_UNIT_ROUNDOFF = 2.0 ** -4


def _case(name, tokens, experts, top_k, hidden, inter, decode):
    return gpu_layer.Case(name, "test", tokens, decode=decode, num_experts=experts, top_k=top_k, hidden=hidden,
                          intermediate=inter)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bf16_layer_matches_the_float64_reference(case):
    case = _case(*case)
    problem, inputs = gpu_layer.make_problem(case, torch.bfloat16, torch.device("cuda"), rotations=2, seed=0)
    contender = _gpu_peers.flashinfer_contender(problem, autotune=False)
    tolerance = rounding_tolerance(torch.bfloat16, max(case.hidden, case.intermediate),
                                   torch_roundings=BF16_ROUNDINGS)
    from flashinfer.fused_moe import cutlass_fused_moe

    for x in inputs:
        ref = _gpu_peers.reference(problem, x).float()
        with torch.no_grad():
            out = contender.layer(x)
        assert_rounding_close(out.float(), ref, tolerance, "flashinfer bf16")
        # negative control: FlashInfer on our [gate; up] rows unconverted reads gate as linear and up as gate
        weights, ids = problem.route(x)
        wrong = _gpu_peers.flashinfer_output(cutlass_fused_moe(x, ids.to(torch.int32), weights, problem.gate_up,
                                                               problem.down, x.dtype, quant_scales=[]))
        assert ((wrong.float() - ref).norm() / ref.norm()).item() > 10 * tolerance
    # in a CUDA graph, on the captured input (its finalize adds with atomics: equal to rounding, not bitwise)
    x = inputs[0]
    with torch.no_grad():
        eager = contender.layer(x)
        graph, replayed = capture_cuda_graph(lambda: contender.layer(x))
        graph.replay()
    assert_rounding_close(replayed.float(), eager.float(), 2 * tolerance, "flashinfer bf16 graph replay")


def test_fp8_block_path_matches_our_fp8_block_layer(monkeypatch):
    import _quantized_peers

    from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, RoutedExpertsMLPOpsConfig
    from nxd_moe.quantization.quantizer import quantize_experts

    tokens, experts, top_k, hidden, inter = 64, 16, 4, 512, 256
    config = RoutedExpertsMLPOpsConfig(num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                                       hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = ExpertMLPsV2(config, BlockwiseMatmulConfig(), dtype=torch.bfloat16, device="cuda", backend="torch")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    quantize_experts(layer, "fp8_block")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    affinities = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen), dim=-1)
    index = affinities.topk(top_k, dim=-1).indices
    forward, _ = _quantized_peers.flashinfer_fp8_block(layer)
    with torch.no_grad():
        ours = layer(x, affinities, index).float()
        theirs = forward(x, affinities, index).float()
    # both sides' bf16 roundings (ours: at most as many), FlashInfer's two e4m3 activation quantizations
    tolerance = 2 * E4M3_UNIT_ROUNDOFF + 2 * BF16_ROUNDINGS * UNIT_ROUNDOFF[torch.bfloat16]
    assert_rounding_close(theirs, ours, tolerance, "flashinfer fp8 block vs ours fp8_block")
    # negative control: the blocks handed over in our [gate; up] order
    monkeypatch.setattr(_quantized_peers, "up_first", lambda values, scales: (values.contiguous(), scales.contiguous()))
    wrong_forward, _ = _quantized_peers.flashinfer_fp8_block(layer)
    with torch.no_grad():
        wrong = wrong_forward(x, affinities, index).float()
    assert ((wrong - ours).norm() / ours.norm()).item() > 2 * tolerance
