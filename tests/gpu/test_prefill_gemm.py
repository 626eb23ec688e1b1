"""The persistent TMA prefill GEMMs (``triton_kernels/prefill_gemm.py``) against float64 and the torch backend.

The kernels themselves (every A-tile source and output path) run everywhere: compiled on a GPU, and under
Triton's interpreter on CPU tensors at small sizes (its TMA descriptors are emulated). The backend's rule picks
them only on a GPU with TMA, so the layer-level tests (mode choice, torch backend, NaN isolation, padding rows,
CUDA-graph replays) need CUDA.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TORCH_ROUNDINGS,
    TRITON_ROUNDINGS,
    assert_rounding_close,
    capture_cuda_graph,
    make_config,
    randn,
    random_routing,
    randomize_,
    rounding_tolerance,
)

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, MoE, RouterTopK
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.reference import reference_for_experts, reference_for_moe

triton = pytest.importorskip("triton")

from nxd_moe.triton_kernels import prefill_gemm  # noqa: E402
from nxd_moe.triton_kernels.routing_metadata import max_tiles, routing_layout  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The longest sum here: H <= 264 terms. Tolerances: conftest.rounding_tolerance.
DEPTH = 264
# The kernels' rows before the combine: the activated intermediate and the output row are stored in the dtype.
ROWS_TOLERANCE = {dtype: rounding_tolerance(dtype, DEPTH, triton_roundings=2) for dtype in (torch.float32,
                                                                                          torch.bfloat16)}
# Kernel variants: (gate/up overrides, down overrides) of the rule. Small tiles where the interpreter runs them.
SMALL = {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
VARIANTS = {
    "gather": ({}, {}),
    "tma_rows": ({"A_TMA": True}, {}),
    "tma_out": ({"A_TMA": True, "OUT_TMA": True, "num_stages": 3}, {"OUT_TMA": True, "num_stages": 3}),
    "gather_tma_out": ({"OUT_TMA": True, "num_stages": 3}, {"OUT_TMA": True, "num_stages": 3}),
    "not_flattened": ({"FLATTEN": False}, {"FLATTEN": False}),
}


def _config(block_m: int, variant: str) -> dict:
    rule = prefill_gemm.default_prefill_config(block_m, 128)
    gate_up, down = VARIANTS[variant]
    small = {"persistent": True} if CUDA else {"persistent": True, **SMALL}
    return {"gate_up": {**rule["gate_up"], **small, **gate_up}, "down": {**rule["down"], **small, **down}}


def _float64_rows(x, layout, gate_up, gate_up_bias, down, down_bias, activation):
    """Per real row of ``layout``: ``act(x[token] @ W_gu[e] + b) @ W_d[e] + b_d`` in float64 (row order kept)."""
    used = torch.arange(layout.num_rows, device=x.device) < layout.num_tiles * layout.block_m
    rows = torch.nonzero((layout.row_token >= 0) & used)[:, 0]
    token = layout.row_token[rows]
    expert = layout.tile_expert[rows // layout.block_m].long()
    h = torch.einsum("rh,rhn->rn", x[token].double(), gate_up[expert].double()) + gate_up_bias[expert].double()
    out = torch.einsum("ri,rih->rh", activation(h), down[expert].double()) + down_bias[expert].double()
    return rows, out


def _kernel_inputs(routing: str, dtype: torch.dtype):
    """``(x, layout, weights, block_m, real pairs)`` of a routing layout with odd token counts and widths, a
    padding token (5), GPT-OSS's clamped SwiGLU with biases."""
    num_tokens, num_experts, top_k, hidden, inter, block_m = (1003, 16, 4, 264, 136, 128) if CUDA else \
        (37, 4, 2, 40, 24, 64)
    config = make_config(num_experts, hidden, inter, top_k, "swiglu_gptoss", bias=True)
    activation = ExpertActivation.from_config(config)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    gate_up = (torch.randn(num_experts, hidden, 2 * inter, generator=gen) / hidden ** 0.5).to(DEVICE, dtype)
    down = (torch.randn(num_experts, inter, hidden, generator=gen) / inter ** 0.5).to(DEVICE, dtype)
    gate_up_bias = (0.3 * torch.randn(num_experts, 2 * inter, generator=gen)).to(DEVICE, dtype)
    down_bias = (0.3 * torch.randn(num_experts, hidden, generator=gen)).to(DEVICE, dtype)
    _, index = random_routing(num_tokens, num_experts, top_k, seed=1)
    if routing == "all_to_one":
        index = torch.arange(top_k).expand(num_tokens, top_k) + 1
    elif routing == "empty_experts":
        # only experts 0 .. 2k-1 are hit
        index = torch.stack([torch.randperm(2 * top_k, generator=gen)[:top_k] for _ in range(num_tokens)])
    index = index.to(DEVICE)
    mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=DEVICE).scatter(1, index, True)
    mask[5] = False  # a padding token: no rows
    n_blocks = max_tiles(num_tokens * top_k, num_experts, block_m)
    _, layout = routing_layout(mask, index, block_m, n_blocks, block_m)
    weights = type("Weights", (), dict(gate_up_proj=gate_up, down_proj=down, gate_up_bias=gate_up_bias,
                                       down_bias=down_bias, activation=activation))
    return x, layout, weights, block_m, int(mask.sum())


def _expected_rows(x, layout, weights):
    return _float64_rows(x, layout, weights.gate_up_proj, weights.gate_up_bias, weights.down_proj, weights.down_bias,
                         weights.activation)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("routing", ["random", "all_to_one", "empty_experts"])
def test_kernels_match_float64(variant, routing):
    """gate/up + down over a routing layout, every A-tile source and output path, against float64."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, layout, weights, block_m, pairs = _kernel_inputs(routing, dtype)
    out = prefill_gemm.expert_rows(x, layout, weights, None, _config(block_m, variant), launch={})
    rows, expected = _expected_rows(x, layout, weights)
    assert rows.numel() == pairs
    assert not (layout.row_token[rows] == 5).any()
    assert_rounding_close(out[0][rows], expected, ROWS_TOLERANCE[dtype], f"{variant} {routing}")


@pytest.mark.parametrize("broken", ["gate_up_weights_4_percent", "down_dropped_row"])
def test_bound_rejects_broken_kernels(broken):
    """Negative control: the persistent GEMMs given gate/up weights 4 % too large, or one output row lost, must
    fail the bound of test_kernels_match_float64."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, layout, weights, block_m, _ = _kernel_inputs("random", dtype)
    rows, expected = _expected_rows(x, layout, weights)
    if broken == "gate_up_weights_4_percent":
        weights.gate_up_proj = weights.gate_up_proj * 1.04
    out = prefill_gemm.expert_rows(x, layout, weights, None, _config(block_m, "gather"), launch={})[0][rows]
    if broken == "down_dropped_row":
        out[0] = 0
    with pytest.raises(AssertionError):
        assert_rounding_close(out, expected, ROWS_TOLERANCE[dtype], broken)


def test_rule_picks_the_path_only_where_it_runs():
    """TMA needs sm_90+, 16-bit unquantized weights, 16-byte rows and prefill tiles; not the interpreter."""
    config = make_config(8, 64, 32, 2, "glu_silu")
    layer = ExpertMLPsV2(config, dtype=torch.bfloat16, device=DEVICE, backend="triton")
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    weights = layer.expert_weights()
    tma = CUDA and torch.cuda.get_device_capability()[0] >= 9
    assert prefill_gemm.applies(x, weights, 128) == tma
    assert not prefill_gemm.applies(x, weights, 32)  # decode-sized tiles
    fp32 = ExpertMLPsV2(config, dtype=torch.float32, device=DEVICE, backend="triton")
    assert not prefill_gemm.applies(x.float(), fp32.expert_weights(), 128)  # fp32 keeps IEEE products
    odd = ExpertMLPsV2(make_config(8, 60, 32, 2, "glu_silu"), dtype=torch.bfloat16, device=DEVICE, backend="triton")
    assert not prefill_gemm.applies(torch.zeros(4, 60, dtype=torch.bfloat16, device=DEVICE), odd.expert_weights(),
                                    128)  # 120-byte rows: no descriptor


needs_tma = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] >= 9),
                               reason="needs a CUDA device with TMA (sm_90+)")


def _layer(dtype, activation="glu_silu", bias=False, seed=0, num_experts=32, hidden=256, inter=192, top_k=4):
    config = make_config(num_experts, hidden, inter, top_k, activation, bias=bias, normalize_top_k_affinities=True)
    tested = ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=128), backend="triton", dtype=dtype,
                          device="cuda")
    reference = randomize_(ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=128), backend="torch", dtype=dtype,
                                        device="cuda"), seed=seed)
    tested.load_state_dict(reference.state_dict())
    return tested, reference


@pytest.fixture(params=["rule", "all_persistent"])
def calls(request, monkeypatch):
    """How often the backend ran the prefill path (so a test fails if the rule stops picking it); with
    ``all_persistent`` both GEMMs run persistent whatever the rule says."""
    count = {"n": 0}
    if request.param == "all_persistent":
        rule = prefill_gemm.default_prefill_config
        monkeypatch.setattr(prefill_gemm, "default_prefill_config", lambda block_m, inter: {
            part: {**entry, "persistent": True} for part, entry in rule(block_m, inter).items()})
    original = prefill_gemm.expert_rows

    def counted(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(prefill_gemm, "expert_rows", counted)
    return count


def _check(out, expected, dtype, what, torch_too=False):
    """``out`` against the float64 reference; ``torch_too``: against the torch backend's result, which rounds
    too."""
    tolerance = rounding_tolerance(dtype, DEPTH, triton_roundings=TRITON_ROUNDINGS,
                                   torch_roundings=TORCH_ROUNDINGS if torch_too else 0)
    assert_rounding_close(out, expected, tolerance, what)


@needs_tma
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["glu_silu", "swiglu_gptoss"])
def test_layer_matches_torch_backend_and_float64(dtype, activation, calls):
    tested, reference = _layer(dtype, activation, bias=activation != "glu_silu")
    x = randn(2051, 256, seed=1).to("cuda", dtype)
    affinities, index = random_routing(2051, 32, 4, seed=2, skew=0.05)
    affinities, index = affinities.to("cuda"), index.to("cuda")
    with torch.no_grad():
        out = tested(x, affinities, index, mode="blockwise")
        torch_out = reference(x, affinities, index, mode="blockwise")
    assert calls["n"] == 1
    _check(out, reference_for_experts(tested, x, affinities, index), dtype, "vs float64")
    _check(out, torch_out, dtype, "vs torch backend", torch_too=True)


@needs_tma
@pytest.mark.parametrize("routing", ["all_to_one", "empty_experts"])
def test_layer_adversarial_routings(routing, calls):
    tested, _ = _layer(torch.bfloat16)
    x = randn(1500, 256, seed=3).to("cuda", torch.bfloat16)
    affinities, index = random_routing(1500, 32, 4, seed=4)
    if routing == "all_to_one":
        index = torch.tensor([[7, 3, 30, 0]]).expand(1500, 4).contiguous()
    else:
        index = torch.stack([torch.randperm(5, generator=torch.Generator().manual_seed(t))[:4] for t in range(1500)])
    affinities, index = affinities.to("cuda"), index.to("cuda")
    with torch.no_grad():
        out, stats = tested(x, affinities, index, mode="blockwise", return_stats=True)
    assert calls["n"] == 1
    assert int(stats.tokens_per_expert.sum()) == 1500 * 4
    _check(out, reference_for_experts(tested, x, affinities, index), torch.bfloat16, routing)


@needs_tma
def test_layer_padding_rows_are_zero_and_nan_stays_isolated(calls):
    """Expert-parallel padding rows get exact zeros; one NaN token changes no other token's output."""
    tested, _ = _layer(torch.bfloat16, "swiglu_gptoss", bias=True)
    x = randn(1200, 256, seed=5).to("cuda", torch.bfloat16)
    affinities, index = random_routing(1200, 32, 4, seed=6)
    affinities, index = affinities.to("cuda"), index.to("cuda")
    padding = torch.arange(1200, device="cuda") % 3 != 0
    poisoned = x.clone()
    poisoned[11] = float("nan")
    with torch.no_grad():
        out = tested(x, affinities, index, padding_mask=padding, mode="blockwise")
        clean = tested(x, affinities, index, mode="blockwise")
        bad = tested(poisoned, affinities, index, mode="blockwise")
    assert calls["n"] == 3
    assert (out[~padding] == 0).all()
    ref = reference_for_experts(tested, x, affinities, index)
    _check(out[padding], ref[padding.cpu()], torch.bfloat16, "padded")
    others = torch.arange(1200, device="cuda") != 11
    assert torch.isnan(bad[11]).any()
    assert torch.equal(bad[others], clean[others])
    assert torch.equal(clean, tested(x, affinities, index, mode="blockwise"))  # deterministic


@needs_tma
def test_cuda_graph_replays_new_routings(calls):
    num_experts, top_k, hidden, inter = 32, 4, 256, 192
    config = make_config(num_experts, hidden, inter, top_k, "glu_silu", normalize_top_k_affinities=True)
    experts = ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=128), backend="triton", dtype=torch.bfloat16,
                           device="cuda")
    moe = randomize_(MoE(RouterTopK(num_experts, top_k, hidden, device="cuda"), experts).eval(), seed=7)
    static_x = torch.randn(1, 2000, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, static_out = capture_cuda_graph(lambda: moe(static_x)[0])
        assert calls["n"] >= 1
        for seed in range(3):
            static_x.copy_(randn(1, 2000, hidden, seed=200 + seed).to("cuda", torch.bfloat16))
            if seed == 2:  # every token to the same experts
                moe.router.linear_router.weight.data.zero_()
                moe.router.linear_router.weight.data[5] = 1.0
            graph.replay()
            _check(static_out, reference_for_moe(moe, static_x), torch.bfloat16, f"replay {seed}")
