"""The torch backend on a CUDA device: every mode against the float64 reference, and CUDA-graph capture.

Skipped where there is no GPU (CI); run on the GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, MoE, RoutedExpertsMLPOpsConfig, RouterTopK, SharedExperts
from nxd_moe.experts import TorchBackend
from nxd_moe.reference import first_come_first_served, reference_for_experts, reference_for_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODES = ("blockwise", "capacity_factor", "selective_loading", "all_experts")
NUM_EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 16, 4, 128, 64, 96


def _experts(dtype, matmul, **overrides) -> ExpertMLPsV2:
    cfg = RoutedExpertsMLPOpsConfig(
        num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="sigmoid",
        glu_mlp=True, glu_type="swiglu", hidden_act_scaling_factor=1.702, hidden_act_bias=1.0,
        gate_clamp_upper_limit=7.0, up_clamp_lower_limit=-7.0, up_clamp_upper_limit=7.0, bias=True,
        normalize_top_k_affinities=True, capacity_factor=1.0, **overrides)
    return ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=16), dtype=dtype, device="cuda",
                        backend=TorchBackend(matmul))


@pytest.mark.parametrize("dtype,matmul,tol", [(torch.float32, "gather", 2e-5), (torch.bfloat16, "auto", 3e-2),
                                              (torch.bfloat16, "gather", 3e-2)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prescale", [False, True])
def test_every_mode_matches_reference_on_cuda(mode, dtype, matmul, tol, prescale):
    torch.manual_seed(0)
    experts = _experts(dtype, matmul, early_expert_affinity_modulation=prescale)
    router = RouterTopK(NUM_EXPERTS, TOP_K, HIDDEN, device="cuda")
    x = torch.randn(TOKENS, HIDDEN, device="cuda").to(dtype)
    with torch.no_grad():
        _, affinities, index = router(x)
        out, stats = experts(x, affinities, index, mode=mode, return_stats=True)
    keep = first_come_first_served(index.cpu(), NUM_EXPERTS, stats.capacity) if mode == "capacity_factor" else None
    ref = reference_for_experts(experts, x, affinities, index, keep=keep)
    assert out.is_cuda and out.dtype == dtype
    assert (out.double().cpu() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_moe_captures_in_a_cuda_graph():
    torch.manual_seed(0)
    cfg = RoutedExpertsMLPOpsConfig(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
                                    hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    moe = MoE(RouterTopK(NUM_EXPERTS, TOP_K, HIDDEN, device="cuda"),
              ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=16), dtype=torch.bfloat16, device="cuda"),
              SharedExperts(HIDDEN, INTER, 1, "silu", dtype=torch.bfloat16, device="cuda")).eval()
    for shape in ((2, 48, HIDDEN), (8, 1, HIDDEN)):  # prefill (blockwise) and decode (selective loading)
        static_x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moe(static_x)  # warm-up outside the graph, as CUDA graphs require
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = moe(static_x)[0]
            for _ in range(3):  # new routing each replay: the graph must not have baked it in
                static_x.copy_(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
                graph.replay()
                ref = reference_for_moe(moe, static_x)
                assert (static_out.double().cpu() - ref).abs().max().item() < 3e-2 * max(1.0, ref.abs().max().item())
