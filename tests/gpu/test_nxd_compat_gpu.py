"""The NxD front door on a GPU: NxD Inference's GPT-OSS and Llama 4 layers (``initialize_moe_module``, built as
NxDI's model code builds them) computing with the triton backend against the transformers blocks, both in fp32 (in
bf16 the layer rounds the router's input, so near-tied experts -- Llama 4 routes top-1 -- may be chosen differently
from an fp32 reference: on an H100 that moved single outputs by up to 64 % of the largest, a routing difference, not
a kernel error);
the MoE deep dive's layer, written against NxD's names, on the GPU against its float64 reference.

On a GPU at realistic sizes; without one the triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set by the suite's conftest) on CPU tensors at small sizes, so CI runs the same code.

Tolerance: fp32 sums of at most a few hundred terms (2^-24 each; the triton kernels' fp32 products are tf32x3 or
exact), 2e-5 of the largest output (or of 1) -- for the triton layers as for the deep dive's torch one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nxd_compat"))

import deep_dive_examples as dd  # noqa: E402
import nxdi_models as nm  # noqa: E402
from conftest import randn, randomize_  # noqa: E402

from nxd_moe.nxd_compat.pytest_plugin import nxd_compat  # noqa: E402,F401 -- the fixture
from nxd_moe.reference import reference_for_moe  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (hidden, intermediate, experts, prefill (B, S), decode batch)
SIZES = (256, 128, 32, (2, 256), 8) if CUDA else (32, 24, 8, (2, 6), 3)
FP32_TOL = 2e-5
# bf16 against the float64 reference of the same layer (same routing): 8 significant bits, 2^-8 ~ 4e-3 per rounding;
# inputs, weights, both GEMM outputs and the combine are rounded, ~1e-2 of the largest output, so 3e-2 has a margin.
BF16_TOL = 3e-2


def _within(out: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert out.device.type == DEVICE and torch.isfinite(out).all(), what
    scale = max(1.0, expected.abs().max().item())
    err = (out.double().cpu() - expected.double().cpu()).abs().max().item()
    assert expected.abs().mean() > 0.05, f"{what}: reference near zero, the comparison would be vacuous"
    assert err < tol * scale, f"{what}: max error {err:.3g} > {tol * scale:.3g}"


@pytest.mark.parametrize("model", ["gpt_oss", "llama4"])
def test_nxdi_layers_on_the_triton_backend_match_transformers(nxd_compat, model):  # noqa: F811
    hidden, inter, experts, (batch, seq), decode_batch = SIZES
    sizes = dict(hidden_size=hidden, intermediate_size=inter, num_experts=experts)
    if model == "gpt_oss":
        hf_config, block = nm.gpt_oss_block(**sizes)
        config = nm.inference_config("sigmoid", nm.K, torch_dtype=torch.float32, **sizes)
        build, x_scale = nm.gpt_oss_moe, 6.0  # inputs large enough that GPT-OSS's +-7 clamps act
    else:
        hf_config, block = nm.llama4_block(1, **sizes)
        config = nm.inference_config("silu", 1, torch_dtype=torch.float32, **sizes)
        build, x_scale = nm.llama4_moe, 1.0
    norm = nm.rmsnorm(seed=1, hidden_size=hidden)
    moe = build(config, rmsnorm=nm.rmsnorm(seed=1, hidden_size=hidden), backend="triton")
    nm.load_from_hf(moe, block, hf_config)
    moe.to(DEVICE)
    assert type(moe.expert_mlps.backend).__name__ == "TritonBackend" and moe.expert_mlps.dtype == torch.float32
    for shape in ((batch, seq, hidden), (decode_batch, 1, hidden)):
        x = randn(*shape, seed=2, scale=x_scale)
        expected = nm.hf_output(block, norm(x))
        with torch.no_grad():
            out = moe(x.to(DEVICE), is_speculative_decoding=False)[0]
        _within(out, expected, FP32_TOL, f"{model} {shape}")


def test_the_deep_dive_layer_on_the_gpu(nxd_compat):  # noqa: F811
    """Line 113's layer as the page writes it (torch backend, fp32), moved to the GPU: blockwise prefill (64 tokens
    x top 8 fill a 512-token block) and a decode, against the float64 reference."""
    moe = randomize_(dd.moe_layer(), seed=3).eval().to(DEVICE)
    for shape, mode in (((1, 64, dd.H_7168), "blockwise"), ((4, 1, dd.H_7168), "selective_loading")):
        x = randn(*shape, seed=4).to(DEVICE)
        with torch.no_grad():
            out, stats = moe(x, return_stats=True)
        assert stats.mode.value == mode
        _within(out, reference_for_moe(moe, x), FP32_TOL, f"deep dive {shape}")


def test_nxd_expert_mlps_with_the_triton_backend(nxd_compat):  # noqa: F811
    """NxD's ``ExpertMLPsV2`` signature with nxd_moe's ``backend=`` keyword: the triton layer equals the torch one."""
    from neuronx_distributed.modules.moe import MoE, routing
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig

    hidden, inter, experts, (batch, seq), _ = SIZES
    config = RoutedExpertsMLPOpsConfig(num_experts=experts, top_k=2, hidden_size=hidden, intermediate_size=inter,
                                       hidden_act="silu", glu_mlp=True, normalize_top_k_affinities=True)
    blockwise = BlockwiseMatmulConfig.from_kwargs(block_size=16)
    layers = {}
    for backend in ("torch", "triton"):
        router = routing.RouterTopK(num_experts=experts, top_k=2, hidden_size=hidden)
        layers[backend] = MoE(router, ExpertMLPsV2(config, blockwise, dtype=torch.bfloat16, backend=backend))
    randomize_(layers["torch"], seed=5)
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    x = randn(batch, seq, hidden, seed=6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        expected = reference_for_moe(layers["torch"].eval().to(DEVICE), x)
        out = layers["triton"].eval().to(DEVICE)(x)[0]
    _within(out, expected, BF16_TOL, "triton vs float64")
