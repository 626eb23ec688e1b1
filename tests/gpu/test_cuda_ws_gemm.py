"""The warp-specialised CUDA C++ prefill GEMMs (``nxd_moe/cuda_kernels``) against float64 and the Triton backend.

Needs an sm_90 GPU (the library is sm_90a) and nvcc; skipped elsewhere. The tiles come from the Triton routing
metadata (``routing_layout``, 128-row tiles) of hand-made routings: random, all rows to one expert, most experts
empty, an odd tile count, and more work items than multiprocessors (each CTA loops, the stage ring wraps).

Tolerances (conftest.rounding_tolerance): the operands are bf16 values the float64 reference reads exactly; the
kernels accumulate in fp32 (the ``sqrt(depth) u(fp32)`` term, ``depth`` = the longest sum: H for gate/up, I for
down) and round each stored result to bf16 once, round-to-nearest (u = 2**-8 of its size): one rounding per GEMM's
output, two for the chain (the activated rows, then the output rows). SiLU in fp32 with ``__expf`` adds a few
u(fp32), nothing next to u(bf16).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TRITON_ROUNDINGS,
    assert_rounding_close,
    capture_cuda_graph,
    make_config,
    randn,
    random_routing,
    randomize_,
    rounding_tolerance,
)

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs an sm_90 GPU (the kernels are built for sm_90a)")
triton = pytest.importorskip("triton")

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2  # noqa: E402
from nxd_moe.cuda_kernels import build, ws_gemm  # noqa: E402
from nxd_moe.reference import reference_for_experts  # noqa: E402
from nxd_moe.triton_kernels.routing_metadata import max_tiles, routing_layout  # noqa: E402

BF16 = torch.bfloat16
# case: (tokens, experts, top_k, hidden, intermediate). I = 192 and H = 192 leave a half-used last column block
# (gate/up: 128 columns per item; down: 256); H = 576 gives 9 K steps (the 4-stage ring wraps inside an item).
CASES = {
    "random": (300, 8, 2, 256, 192),
    "one_expert": (515, 8, 1, 192, 256),
    "empty_experts": (400, 16, 2, 256, 192),
    "odd_tiles": (257, 4, 1, 128, 128),
    "many_items": (4096, 8, 2, 576, 512),
}


@pytest.fixture(scope="module", autouse=True)
def library():
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found: the CUDA kernels cannot be built here")
    assert build.load() is not None, "nvcc is here but the build or load failed (see the warning)"


def _problem(case: str, seed: int = 0):
    tokens, experts, top_k, hidden, inter = CASES[case]
    x = randn(tokens, hidden, seed=seed).to("cuda", BF16)
    gate_up = randn(experts, hidden, 2 * inter, seed=seed + 1, scale=hidden ** -0.5).to("cuda", BF16)
    down = randn(experts, inter, hidden, seed=seed + 2, scale=inter ** -0.5).to("cuda", BF16)
    if case in ("one_expert", "odd_tiles"):
        index = torch.full((tokens, 1), experts - 1, dtype=torch.int64)
    elif case == "empty_experts":  # only experts 0, 5 and 15 get rows
        allowed = torch.tensor([0, 5, 15])
        index = allowed[torch.stack([torch.randperm(3, generator=torch.Generator().manual_seed(t))[:top_k]
                                     for t in range(tokens)])]
    else:
        index = random_routing(tokens, experts, top_k, seed=seed + 3)[1]
    index = index.to("cuda")
    mask = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter(1, index, True)
    layout = routing_layout(mask, index, 128, max_tiles(tokens * top_k, experts, 128), 128)[1]
    return x, gate_up, down, layout


def _real_rows(layout):
    used = torch.arange(layout.num_rows, device="cuda") < layout.num_tiles * layout.block_m
    rows = torch.nonzero((layout.row_token >= 0) & used)[:, 0]
    return rows, layout.row_token[rows], layout.tile_expert[rows // layout.block_m].long()


def _float64_activated(x, gate_up, layout):
    """``silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])`` in float64 for the layout's real rows, per expert."""
    rows, token, expert = _real_rows(layout)
    inter = gate_up.shape[2] // 2
    out = torch.empty(rows.numel(), inter, dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        mine = expert == e
        h = x[token[mine]].double() @ gate_up[e].double()
        out[mine] = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    return rows, out


def _float64_down(activated_rows, rows, down, layout):
    expert = layout.tile_expert[rows // layout.block_m].long()
    out = torch.empty(rows.numel(), down.shape[2], dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        mine = expert == e
        out[mine] = activated_rows[mine].double() @ down[e].double()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_gate_up_matches_float64(case):
    x, gate_up, _, layout = _problem(case)
    rows, expected = _float64_activated(x, gate_up, layout)
    if case == "odd_tiles":
        assert int(layout.num_tiles) % 2 == 1
    if case == "many_items":
        items = int(layout.num_tiles) * (gate_up.shape[2] // 2 // 128)
        assert items > torch.cuda.get_device_properties(0).multi_processor_count
    out = ws_gemm.gate_up_rows(x, layout, gate_up)
    assert_rounding_close(out[rows], expected, rounding_tolerance(BF16, x.shape[1], triton_roundings=1), case)


@pytest.mark.parametrize("case", list(CASES))
def test_down_matches_float64_and_padding_rows_stay_out(case):
    """Padding rows of the activated input hold NaN: a real row that read one would not be finite."""
    _, _, down, layout = _problem(case)
    activated = randn(layout.num_rows, down.shape[1], seed=7).to("cuda", BF16)
    activated[layout.row_token < 0] = float("nan")
    rows, _, _ = _real_rows(layout)
    expected = _float64_down(activated[rows], rows, down, layout)
    out = ws_gemm.down_rows(activated, layout, down)
    assert out.shape == (1, layout.num_rows, down.shape[2])
    assert_rounding_close(out[0, rows], expected, rounding_tolerance(BF16, down.shape[1], triton_roundings=1), case)


def test_chain_matches_float64_and_is_deterministic():
    x, gate_up, down, layout = _problem("many_items")
    rows, activated = _float64_activated(x, gate_up, layout)
    expected = _float64_down(activated, rows, down, layout)
    weights = ExpertMLPsV2(make_config(8, 576, 512, 2, "glu_silu"), dtype=BF16, device="cuda",
                           backend="triton").expert_weights()._replace(gate_up_proj=gate_up, down_proj=down)
    out = ws_gemm.expert_rows(x, layout, weights)
    tolerance = rounding_tolerance(BF16, max(x.shape[1], down.shape[1]), triton_roundings=2)
    assert_rounding_close(out[0, rows], expected, tolerance, "chain")
    assert torch.equal(out[0, rows], ws_gemm.expert_rows(x, layout, weights)[0, rows])


@pytest.mark.parametrize("broken", ["swapped_gate_up", "down_4_percent"])
def test_bound_rejects_broken_variants(broken):
    """Negative control: the kernels fed a swapped gate/up (what a wrong box coordinate gives) or a down weight 4 %
    too large must fail the bounds above."""
    x, gate_up, down, layout = _problem("random")
    rows, activated = _float64_activated(x, gate_up, layout)
    with pytest.raises(AssertionError):
        if broken == "swapped_gate_up":
            inter = gate_up.shape[2] // 2
            swapped = torch.cat([gate_up[..., inter:], gate_up[..., :inter]], dim=-1).contiguous()
            out = ws_gemm.gate_up_rows(x, layout, swapped)
            assert_rounding_close(out[rows], activated, rounding_tolerance(BF16, x.shape[1], triton_roundings=1),
                                  broken)
        else:
            bf16_rows = torch.zeros(layout.num_rows, down.shape[1], dtype=BF16, device="cuda")
            bf16_rows[rows] = activated.to(BF16)
            expected = _float64_down(bf16_rows[rows], rows, down, layout)
            out = ws_gemm.down_rows(bf16_rows, layout, (down.float() * 1.04).to(BF16))
            assert_rounding_close(out[0, rows], expected,
                                  rounding_tolerance(BF16, down.shape[1], triton_roundings=1), broken)


def test_nan_token_stays_in_its_rows():
    x, gate_up, _, layout = _problem("random")
    rows, token, _ = _real_rows(layout)
    clean = ws_gemm.gate_up_rows(x, layout, gate_up)[rows]
    poisoned = x.clone()
    poisoned[5] = float("nan")
    bad = ws_gemm.gate_up_rows(poisoned, layout, gate_up)[rows]
    assert torch.isnan(bad[token == 5]).all()
    assert torch.equal(bad[token != 5], clean[token != 5])


def test_cuda_graph_replays_new_inputs():
    x, gate_up, down, layout = _problem("random")
    weights = ExpertMLPsV2(make_config(8, 256, 192, 2, "glu_silu"), dtype=BF16, device="cuda",
                           backend="triton").expert_weights()._replace(gate_up_proj=gate_up, down_proj=down)
    graph, out = capture_cuda_graph(lambda: ws_gemm.expert_rows(x, layout, weights))
    x.copy_(randn(*x.shape, seed=11).to("cuda", BF16))
    graph.replay()
    rows, _, _ = _real_rows(layout)
    assert torch.equal(out[0, rows], ws_gemm.expert_rows(x, layout, weights)[0, rows])


def test_layer_opt_in_runs_the_cuda_kernels_and_matches_float64(monkeypatch):
    """``TritonBackend(prefill_kernel="cuda_ws")`` (set on a built layer) takes the CUDA path for a prefill and
    agrees with the float64 layer reference within the Triton prefill's own bound; the default never calls it."""
    config = make_config(16, 256, 192, 2, "glu_silu", normalize_top_k_affinities=True)
    layer = randomize_(ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=128), backend="triton", dtype=BF16,
                                    device="cuda"), seed=0)
    calls = {"n": 0}
    original = ws_gemm.expert_rows

    def counted(*args):
        calls["n"] += 1
        return original(*args)
    monkeypatch.setattr(ws_gemm, "expert_rows", counted)
    x = randn(2051, 256, seed=1).to("cuda", BF16)
    affinities, index = (t.to("cuda") for t in random_routing(2051, 16, 2, seed=2))
    with torch.no_grad():
        default = layer(x, affinities, index, mode="blockwise")
        assert calls["n"] == 0
        layer.backend.prefill_kernel = "cuda_ws"
        out = layer(x, affinities, index, mode="blockwise")
    assert calls["n"] == 1
    expected = reference_for_experts(layer, x, affinities, index)
    tolerance = rounding_tolerance(BF16, 256, triton_roundings=TRITON_ROUNDINGS)
    assert_rounding_close(out, expected, tolerance, "cuda_ws layer")
    assert_rounding_close(default, expected, tolerance, "triton layer")
