"""The triton backend against the float64 reference and the torch backend.

On a GPU the kernels run compiled at realistic sizes; without one they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set by the suite's conftest) on CPU tensors at small sizes, so CI exercises the same
kernel code.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ACTIVATIONS,
    MODES,
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

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, MoE, RouterTopK, SharedExperts
from nxd_moe.experts import ExpertsMode
from nxd_moe.reference import first_come_first_served, reference_for_experts, reference_for_moe

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (T, E, k, H, I): odd sizes on purpose (H, I not multiples of the tiles).
SHAPES = [(33, 8, 2, 40, 24), (1, 16, 4, 24, 40)] + ([(511, 64, 6, 200, 136), (4097, 128, 8, 136, 72),
                                                      (257, 256, 8, 72, 40)] if CUDA else [])
# The longest sum here: H or I <= 256 terms (k <= 8). Tolerances: conftest.rounding_tolerance.
DEPTH = 256


def _pair(config, *, block_size=16, dtype=torch.float32, seed=0):
    """A triton-backed layer and a torch-backed one with the same weights."""
    kwargs = dict(dtype=dtype, device=DEVICE)
    reference = randomize_(ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=block_size), backend="torch",
                                        **kwargs), seed=seed)
    tested = ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=block_size), backend="triton", **kwargs)
    tested.load_state_dict(reference.state_dict())
    return tested, reference


def _check(out, ref64, dtype, what="", torch_too=False):
    """``out`` against the float64 reference; ``torch_too``: against the torch backend's result, or a reference
    that includes torch modules' outputs (shared experts), which round too."""
    assert out.dtype == dtype and out.device.type == DEVICE
    tolerance = rounding_tolerance(dtype, DEPTH, triton_roundings=TRITON_ROUNDINGS,
                                   torch_roundings=TORCH_ROUNDINGS if torch_too else 0)
    assert_rounding_close(out, ref64, tolerance, what)


def _routing(num_tokens, num_experts, top_k, seed, skew=0.0):
    affinities, index = random_routing(num_tokens, num_experts, top_k, seed=seed, skew=skew)
    return affinities.to(DEVICE), index.to(DEVICE)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_mode_and_activation_matches_reference(mode, activation):
    num_tokens, num_experts, top_k, hidden, inter = SHAPES[0]
    config = make_config(num_experts, hidden, inter, top_k, activation, bias=True, capacity_factor=1.0,
                         normalize_top_k_affinities=True)
    tested, reference = _pair(config)
    x = randn(num_tokens, hidden, seed=1).to(DEVICE)
    affinities, index = _routing(num_tokens, num_experts, top_k, seed=2)
    with torch.no_grad():
        out, stats = tested(x, affinities, index, mode=mode, return_stats=True)
        torch_out = reference(x, affinities, index, mode=mode)
    keep = first_come_first_served(index.cpu(), num_experts, stats.capacity) if mode == "capacity_factor" else None
    _check(out, reference_for_experts(tested, x, affinities, index, keep=keep), torch.float32, f"{mode}/{activation}")
    _check(out, torch_out.double().cpu(), torch.float32, "vs torch backend", torch_too=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] + ([torch.float16] if CUDA else []))
@pytest.mark.parametrize("mode", ("blockwise", "selective_loading"))
def test_odd_sizes_and_dtypes(shape, dtype, mode):
    num_tokens, num_experts, top_k, hidden, inter = shape
    config = make_config(num_experts, hidden, inter, top_k, "glu_silu", normalize_top_k_affinities=True)
    tested, _ = _pair(config, dtype=dtype, block_size=64)
    x = randn(num_tokens, hidden, seed=3).to(DEVICE, dtype)
    affinities, index = _routing(num_tokens, num_experts, top_k, seed=4, skew=0.05)
    with torch.no_grad():
        out = tested(x, affinities, index, mode=mode)
    _check(out, reference_for_experts(tested, x, affinities, index), dtype, f"{shape} {dtype} {mode}")


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("prescale", [False, True])
def test_top_k_and_early_affinity_modulation(top_k, prescale):
    config = make_config(8, 32, 16, top_k, "glu_silu", early_expert_affinity_modulation=prescale)
    tested, reference = _pair(config)
    x = randn(21, 32, seed=5).to(DEVICE)
    affinities, index = _routing(21, 8, top_k, seed=6)
    with torch.no_grad():
        for mode in ("blockwise", "selective_loading", "all_experts"):
            out = tested(x, affinities, index, mode=mode)
            _check(out, reference_for_experts(tested, x, affinities, index), torch.float32, mode)
            _check(out, reference(x, affinities, index, mode=mode).double().cpu(), torch.float32, "torch backend",
                   torch_too=True)


@pytest.mark.parametrize("routing", ["all_to_one", "ties", "empty_experts"])
def test_adversarial_routings_drop_nothing(routing):
    num_tokens, num_experts, top_k = 40, 16, 2
    config = make_config(num_experts, 24, 16, top_k, "glu_silu")
    tested, _ = _pair(config, block_size=8)
    x = randn(num_tokens, 24, seed=7).to(DEVICE)
    affinities, index = _routing(num_tokens, num_experts, top_k, seed=8)
    if routing == "all_to_one":
        index = torch.tensor([[3, 5]], device=DEVICE).expand(num_tokens, 2).contiguous()
    elif routing == "ties":
        affinities = torch.full_like(affinities, 1.0 / num_experts)
    else:
        index = index % 3  # experts 3..15 get nothing
        index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % 3, index[:, 1])
    with torch.no_grad():
        for mode in ("blockwise", "selective_loading"):
            out, stats = tested(x, affinities, index, mode=mode, return_stats=True)
            assert int(stats.tokens_per_expert.sum()) == num_tokens * top_k
            _check(out, reference_for_experts(tested, x, affinities, index), torch.float32, f"{routing} {mode}")


def test_block_mapping_equals_the_torch_implementation():
    """The routing-metadata kernels write NxD's BlockMapping exactly (and a consistent tiling)."""
    from nxd_moe.experts.routing_inputs import build_routing
    from nxd_moe.experts.token_mapping import num_blocks, token_to_block_mapping
    from nxd_moe.triton_kernels.routing_metadata import routing_layout

    cases = [(50, 8, 2, 4, 0.0, False, 1024), (37, 16, 4, 16, 0.3, True, 16), (5, 32, 8, 64, 0.0, True, 8),
             (61, 4, 3, 8, 1.0, True, 32)]
    for num_tokens, num_experts, top_k, block_size, skew, pad, chunk in cases:
        affinities, index = _routing(num_tokens, num_experts, top_k, seed=num_tokens, skew=skew)
        padding = (torch.arange(num_tokens, device=DEVICE) % 5 != 2) if pad else None
        routing = build_routing(affinities, index, num_experts, True, False, padding)
        n = num_blocks(num_tokens, top_k, num_experts, block_size)
        ours, tiles = routing_layout(routing.expert_mask, routing.expert_index, block_size, n, 16, chunk)
        theirs = token_to_block_mapping(routing.expert_mask, routing.expert_index, block_size, n)
        for name in ("block_to_expert", "token_position_to_id", "conditions", "token_slot", "tokens_per_expert"):
            assert torch.equal(getattr(ours, name).cpu(), getattr(theirs, name).cpu()), name
        # Every real pair has a row holding its token, in a tile of its expert; padded pairs have none.
        valid = routing.pair_valid().cpu()
        rows = tiles.pair_row.cpu()
        assert (rows[~valid] == tiles.num_rows).all()
        tokens = torch.arange(num_tokens).unsqueeze(1).expand_as(rows)
        assert torch.equal(tiles.row_token.cpu()[rows[valid]], tokens[valid])
        assert torch.equal(tiles.tile_expert.cpu().long()[rows[valid] // 16], index.cpu()[valid])
        used = int(tiles.num_tiles)
        assert used == int(((theirs.tokens_per_expert.cpu() + 15) // 16).sum())


def test_padding_mask_and_nan_token_stay_isolated():
    config = make_config(8, 32, 16, 2, "swiglu_gptoss", bias=True)
    tested, _ = _pair(config)
    x = randn(30, 32, seed=9).to(DEVICE)
    affinities, index = _routing(30, 8, 2, seed=10)
    padding = torch.ones(30, dtype=torch.bool, device=DEVICE)
    padding[[0, 7, 29]] = False
    poisoned = x.clone()
    poisoned[11] = float("nan")
    with torch.no_grad():
        for mode in ("blockwise", "selective_loading", "all_experts"):
            out = tested(x, affinities, index, padding_mask=padding, mode=mode)
            assert (out[~padding] == 0).all(), mode
            ref = reference_for_experts(tested, x, affinities, index)
            _check(out[padding], ref[padding.cpu()], torch.float32, mode)
            bad = tested(poisoned, affinities, index, mode=mode)
            others = torch.arange(30, device=DEVICE) != 11
            assert torch.isnan(bad[11]).any(), mode
            assert torch.equal(bad[others], tested(x, affinities, index, mode=mode)[others]), mode


def test_layer_picks_gpu_modes():
    """Decode is selective loading on a GPU even when T*k >= E (NxD would pick all-experts there); so is a prefill of
    decode size (64 x top-4 pairs), while a larger one (300 x 4 > 1024 pairs) is blockwise."""
    config = make_config(8, 16, 8, 4, "glu_silu")
    tested, reference = _pair(config)
    assert tested.resolve_mode(None, 16, 1) is ExpertsMode.SELECTIVE_LOADING
    assert reference.resolve_mode(None, 16, 1) is ExpertsMode.ALL_EXPERTS
    assert tested.resolve_mode(None, 64, None) is ExpertsMode.SELECTIVE_LOADING
    assert reference.resolve_mode(None, 64, None) is ExpertsMode.BLOCKWISE
    assert tested.resolve_mode(None, 300, None) is ExpertsMode.BLOCKWISE
    assert tested.resolve_mode("all_experts", 16, 1) is ExpertsMode.ALL_EXPERTS


def test_moe_with_shared_expert_matches_reference():
    num_experts, top_k, hidden, inter = 8, 2, 32, 24
    config = make_config(num_experts, hidden, inter, top_k, "glu_silu", normalize_top_k_affinities=True)
    experts = ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=16), backend="triton", device=DEVICE)
    moe = randomize_(MoE(RouterTopK(num_experts, top_k, hidden, device=DEVICE), experts,
                         SharedExperts(hidden, inter, 1, "silu", device=DEVICE)).eval(), seed=11)
    for shape in ((2, 9, hidden), (6, 1, hidden)):
        x = randn(*shape, seed=12).to(DEVICE)
        with torch.no_grad():
            out = moe(x)[0]
        ref = reference_for_moe(moe, x)
        _check(out, ref, torch.float32, str(shape), torch_too=True)


def test_errors_name_the_problem():
    config = make_config(4, 16, 8, 2, "glu_silu")
    tested = ExpertMLPsV2(config, backend="triton", dtype=torch.float64, device=DEVICE)
    x = torch.randn(3, 16, dtype=torch.float64, device=DEVICE)
    affinities, index = _routing(3, 4, 2, seed=0)
    with pytest.raises(TypeError, match="float64"):
        tested(x, affinities.double(), index)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_replays_new_routings():
    num_experts, top_k, hidden, inter = 64, 8, 256, 192
    config = make_config(num_experts, hidden, inter, top_k, "glu_silu", normalize_top_k_affinities=True)
    experts = ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=128), backend="triton", dtype=torch.bfloat16,
                           device="cuda")
    moe = randomize_(MoE(RouterTopK(num_experts, top_k, hidden, device="cuda"), experts,
                         SharedExperts(hidden, inter, 1, "silu", dtype=torch.bfloat16, device="cuda")).eval(), seed=13)
    for shape in ((1, 300, hidden), (16, 1, hidden)):
        static_x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            graph, static_out = capture_cuda_graph(lambda x=static_x: moe(x)[0])
            for seed in range(3):
                static_x.copy_(randn(*shape, seed=100 + seed).to("cuda", torch.bfloat16))
                if seed == 2:  # every token to one expert
                    moe.router.linear_router.weight.data.zero_()
                    moe.router.linear_router.weight.data[5] = 1.0
                graph.replay()
                _check(static_out, reference_for_moe(moe, static_x), torch.bfloat16, f"{shape} replay {seed}",
                       torch_too=True)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_routing_equals_build_routing(normalize, padded):
    from nxd_moe.experts.routing_inputs import build_routing
    from nxd_moe.triton_kernels.routing import fused_routing

    affinities, index = _routing(37, 12, 3, seed=20)
    affinities[5] = 0.0  # a row whose chosen affinities sum to 0 stays 0 (no division by zero)
    padding = (torch.arange(37, device=DEVICE) % 4 != 1) if padded else None
    ours = fused_routing(affinities, index, 12, normalize, False, padding)
    theirs = build_routing(affinities, index, 12, normalize, False, padding)
    assert torch.equal(ours.expert_mask, theirs.expert_mask)
    assert torch.equal(ours.expert_index, theirs.expert_index)
    # The same k-term fp32 sum and division, maybe in another order: each side rounds twice.
    torch.testing.assert_close(ours.affinities, theirs.affinities, atol=0,
                               rtol=rounding_tolerance(torch.float32, 3, torch_roundings=4))
    assert ours.has_padding == theirs.has_padding


@pytest.mark.parametrize("mode", MODES)
def test_addend_is_added_in_the_combine(mode):
    """``addend`` (the shared experts' output) lands in the same sum, in every mode; a wrong one is refused."""
    config = make_config(8, 24, 16, 2, "glu_silu", capacity_factor=1.0)
    tested, reference = _pair(config)
    x = randn(19, 24, seed=30).to(DEVICE)
    addend = randn(19, 24, seed=31).to(DEVICE)
    affinities, index = _routing(19, 8, 2, seed=32)
    with torch.no_grad():
        out = tested(x, affinities, index, mode=mode, addend=addend)
        expected = reference(x, affinities, index, mode=mode).double().cpu() + addend.double().cpu()
    _check(out, expected, torch.float32, mode, torch_too=True)
    with pytest.raises(ValueError, match="addend must be"):
        tested(x, affinities, index, mode=mode, addend=addend[:3])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "mxfp4"])
def test_one_launch_rule_follows_the_weight_format(fmt):
    """By default the one-launch decode takes 16-bit weights only (quantized decode measured faster through the
    separate kernels); ``one_launch=True`` forces it where it applies, False never; W8A8 and large T*k never."""
    from nxd_moe.quantization.quantizer import quantize_experts
    from nxd_moe.triton_kernels.backend import TritonBackend

    layer = ExpertMLPsV2(make_config(4, 128, 128, 2, "glu_silu"), backend="torch", dtype=torch.bfloat16)
    if fmt != "bf16":
        quantize_experts(layer, fmt)
    weights = layer.expert_weights()
    assert TritonBackend()._one_launch(1, 2, weights) is (fmt == "bf16")
    assert TritonBackend(one_launch=True)._one_launch(1, 2, weights) is True
    assert TritonBackend(one_launch=False)._one_launch(1, 2, weights) is False
    assert TritonBackend(one_launch=True)._one_launch(4096, 8, weights) is False
    assert repr(TritonBackend(one_launch=False)) == "TritonBackend(one_launch=False)"
    if fmt in ("fp8", "fp8_block"):
        w8a8 = ExpertMLPsV2(make_config(4, 128, 128, 2, "glu_silu"), backend="torch", dtype=torch.bfloat16)
        quantize_experts(w8a8, fmt, activation_quantization="fp8")
        assert TritonBackend(one_launch=True)._one_launch(1, 2, w8a8.expert_weights()) is False


@pytest.mark.parametrize("num_experts", [128, 129])
def test_replayed_steps_decode_larger_batches_in_separate_kernels(num_experts):
    """Inside ``graphs.replayed_steps`` (the application's CUDA-graph steps) the rule decodes from 128 pairs on in
    separate kernels, in layers of at most 128 experts; below that, beyond it, outside it, or with ``one_launch``
    given, as before -- and the flag is restored on the way out, also after an error."""
    from nxd_moe import graphs
    from nxd_moe.triton_kernels.backend import REPLAYED_SEPARATE_EXPERTS, REPLAYED_SEPARATE_PAIRS, TritonBackend

    assert (REPLAYED_SEPARATE_PAIRS, REPLAYED_SEPARATE_EXPERTS) == (128, 128)
    weights = ExpertMLPsV2(make_config(num_experts, 16, 16, 8, "glu_silu"), backend="torch",
                           dtype=torch.bfloat16).expert_weights()
    rule, forced = TritonBackend(), TritonBackend(one_launch=True)
    assert not graphs.in_replayed_steps()
    assert rule._one_launch(16, 8, weights) and rule._one_launch(32, 8, weights)
    with graphs.replayed_steps():
        assert graphs.in_replayed_steps()
        with graphs.replayed_steps():
            pass
        assert graphs.in_replayed_steps()  # a nested exit keeps the outer one
        small = num_experts > 128
        assert rule._one_launch(16, 8, weights) is small  # 128 pairs
        assert rule._one_launch(64, 2, weights) is small  # 128 pairs, another k
        assert rule._one_launch(15, 8, weights) is True  # 120 pairs
        assert rule._one_launch(1, 8, weights) is True
        assert forced._one_launch(16, 8, weights) is True
    assert not graphs.in_replayed_steps() and rule._one_launch(16, 8, weights)
    with pytest.raises(RuntimeError, match="inside"), graphs.replayed_steps():
        raise RuntimeError("inside")
    assert not graphs.in_replayed_steps()


@pytest.mark.parametrize("option, value", [("one_launch", "yes"), ("one_launch", 1), ("repack", None),
                                           ("persistent_prefill", "no")])
def test_backend_options_reject_non_booleans(option, value):
    from nxd_moe.triton_kernels.backend import TritonBackend

    with pytest.raises(TypeError, match=f"TritonBackend: {option} must be"):
        TritonBackend(**{option: value})


# Negative controls: each breaks one kernel's input (or output) the way a kernel bug would, and the bound of
# _check must reject the result -- in bf16 too, where a fixed absolute tolerance once let a 4 % error through.
def _break_gate_up(monkeypatch):
    """The gate/up GEMM reads weights 4 % too large (a wrong scale)."""
    from nxd_moe.triton_kernels import backend

    original = backend.gate_up_projection
    monkeypatch.setattr(backend, "gate_up_projection",
                        lambda x, layout, weight, *args: original(x, layout, weight * 1.04, *args))


def _break_down(monkeypatch):
    """The down GEMM loses one real row of its output."""
    from nxd_moe.triton_kernels import backend

    original = backend.down_projection

    def dropped(activated, layout, *args):
        rows = original(activated, layout, *args)
        rows[:, int(torch.nonzero(layout.row_token >= 0)[0, 0])] = 0
        return rows
    monkeypatch.setattr(backend, "down_projection", dropped)


def _break_combine(monkeypatch):
    """The combine weighs every pair 4 % too much: the whole output 4 % off."""
    from nxd_moe.triton_kernels import backend

    original = backend.combine_rows
    monkeypatch.setattr(backend, "combine_rows", lambda rows, pair_row, pair_expert, affinities, *args: original(
        rows, pair_row, pair_expert, affinities * 1.04, *args))


def _break_routing_metadata(monkeypatch):
    """The routing metadata gives the first tile the next expert."""
    from nxd_moe.triton_kernels import backend

    original = backend.routing_layout

    def shifted(expert_mask, *args):
        mapping, tiles = original(expert_mask, *args)
        tile_expert = tiles.tile_expert.clone()
        tile_expert[0] = (tile_expert[0] + 1) % expert_mask.shape[1]
        return mapping, tiles._replace(tile_expert=tile_expert)
    monkeypatch.setattr(backend, "routing_layout", shifted)


BROKEN = {"gate_up_gemm": _break_gate_up, "down_gemm": _break_down, "combine": _break_combine,
          "routing_metadata": _break_routing_metadata}


@pytest.mark.parametrize("broken", sorted(BROKEN))
# bf16 is where a loose bound hides errors; fp32's is ~1e4 times below these errors (slow: not in the default run).
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_bound_rejects_a_broken_kernel(broken, dtype, monkeypatch):
    config = make_config(8, 32, 16, 2, "glu_silu", normalize_top_k_affinities=True)
    tested, _ = _pair(config, dtype=dtype)
    x = randn(24, 32, seed=40).to(DEVICE, dtype)
    affinities, index = _routing(24, 8, 2, seed=41)
    reference = reference_for_experts(tested, x, affinities, index)
    with torch.no_grad():
        _check(tested(x, affinities, index, mode="blockwise"), reference, dtype, "unbroken")
        BROKEN[broken](monkeypatch)
        out = tested(x, affinities, index, mode="blockwise")
    with pytest.raises(AssertionError):
        _check(out, reference, dtype, broken)
