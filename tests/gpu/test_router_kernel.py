"""The fused top-k router (``triton_kernels/router.py``) against a float64 router computed here, and the layer that
takes it (``TritonBackend.fused_router``, called by ``MoE`` wherever the decode is not one launch) against the torch
router and backend. Under Triton's interpreter (CI) on small sizes; on a GPU at prefill sizes and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TF32X3_ROUNDINGS,
    UNIT_ROUNDOFF,
    assert_rounding_close,
    capture_cuda_graph,
    make_config,
    make_router,
    randn,
    randomize_,
    rounding_tolerance,
)

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, MoE, RouterTopK

triton = pytest.importorskip("triton")
from nxd_moe.triton_kernels import router as router_kernel  # noqa: E402
from nxd_moe.triton_kernels.backend import TritonBackend  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# (T, E, k, H): Mixtral's 8 experts, GPT-OSS's 32, Qwen3's 128, the 256 the kernel holds; odd T and H.
SHAPES = [(37, 8, 2, 64), (5, 32, 4, 48), (300, 128, 8, 96), (17, 256, 8, 40)]
if CUDA:
    SHAPES.append((4096, 128, 8, 2048))
VARIANTS = [("softmax", False, False), ("softmax", True, True), ("sigmoid", False, True), ("sigmoid", True, False)]


def _logit_tolerance(hidden: int) -> float:
    """The kernel's fp32 logits against float64 or the torch router's fp32 ones: H-term sums (tf32x3 products on a
    GPU), the bias added (conftest.rounding_tolerance)."""
    return rounding_tolerance(torch.float32, hidden, triton_roundings=2 + TF32X3_ROUNDINGS)


def _logit_error(logits, reference) -> float:
    return (logits.double().cpu() - reference.double().cpu()).abs().max().item()


def _affinity_tolerance(logit_error: float, num_experts: int) -> float:
    """Affinities from logits off by at most ``logit_error``: a softmax moves by <= 2 * s_i * max |d logit| <=
    2 * logit_error, a sigmoid by <= logit_error / 4; plus their own fp32 roundings (exp, a sum over the
    experts, a division)."""
    return 2 * logit_error + rounding_tolerance(torch.float32, num_experts, triton_roundings=3)


def _reference(x, weight, bias, top_k, act, over_topk, chosen):
    """float64 logits, and the affinities for the chosen experts ``chosen (T, k)``."""
    logits = x.double().cpu() @ weight.double().cpu().T
    if bias is not None:
        logits = logits + bias.double().cpu()
    if not over_topk:
        return logits, torch.sigmoid(logits) if act == "sigmoid" else torch.softmax(logits, dim=-1)
    top = logits.gather(1, chosen)
    values = torch.sigmoid(top) if act == "sigmoid" else torch.softmax(top, dim=-1)
    return logits, torch.zeros_like(logits).scatter(1, chosen, values)


def _check_top_k(index, logits64, tol):
    """``index`` holds each row's k largest reference logits, largest first, up to ``tol`` (the kernel's logits
    carry fp32 rounding, so two experts closer than that may swap)."""
    index = index.cpu()
    assert index.dtype == torch.int64 and (index >= 0).all() and (index < logits64.shape[1]).all()
    assert (index.sort(dim=1).values.diff(dim=1) != 0).all(), "an expert chosen twice"
    picked = logits64.gather(1, index)
    others = logits64.scatter(1, index, float("-inf"))
    assert (picked.min(dim=1).values >= others.max(dim=1).values - tol).all(), "a larger logit was left out"
    assert (picked.diff(dim=1) <= tol).all(), "not largest first"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act, over_topk, bias", VARIANTS)
def test_router_matches_float64(shape, dtype, act, over_topk, bias):
    num_tokens, num_experts, top_k, hidden = shape
    x = randn(num_tokens, hidden, seed=1, dtype=dtype).to(DEVICE)
    weight = randn(num_experts, hidden, seed=2, scale=hidden ** -0.5).to(DEVICE)
    b = randn(num_experts, seed=3, scale=0.3).to(DEVICE) if bias else None
    assert router_kernel.applies(x, weight, top_k)
    logits, affinities, index = router_kernel.router_top_k(x, weight, b, top_k, act == "sigmoid", over_topk)
    assert logits.shape == affinities.shape == (num_tokens, num_experts) and index.shape == (num_tokens, top_k)
    assert logits.dtype == affinities.dtype == torch.float32
    ref_logits, ref_affinities = _reference(x, weight, b, top_k, act, over_topk, index.cpu())
    assert_rounding_close(logits, ref_logits, _logit_tolerance(hidden), "logits")
    error = _logit_error(logits, ref_logits)
    # Two experts may trade places only where the kernel's logits (its choice) err by more than their gap.
    _check_top_k(index, ref_logits, 2 * error)
    bound = _affinity_tolerance(error, num_experts)
    assert _logit_error(affinities, ref_affinities) <= bound, bound


def test_ties_go_to_the_lower_expert_and_a_nan_token_keeps_to_its_row():
    num_tokens, num_experts, top_k, hidden = 9, 16, 4, 32
    x = randn(num_tokens, hidden, seed=1).to(DEVICE)
    tied = router_kernel.router_top_k(x, torch.zeros(num_experts, hidden, device=DEVICE), None, top_k, False, False)
    assert (tied[2].cpu() == torch.arange(top_k)).all()
    uniform = torch.full((num_tokens, num_experts), 1 / num_experts)
    assert_rounding_close(tied[1], uniform, rounding_tolerance(torch.float32, num_experts, triton_roundings=3), "ties")
    weight = randn(num_experts, hidden, seed=2, scale=hidden ** -0.5).to(DEVICE)
    clean = router_kernel.router_top_k(x, weight, None, top_k, False, True)
    x[4] = float("nan")
    dirty = router_kernel.router_top_k(x, weight, None, top_k, False, True)
    rows = torch.arange(num_tokens) != 4
    for a, b in zip(clean, dirty):
        assert torch.equal(a.cpu()[rows], b.cpu()[rows])
    assert torch.isnan(dirty[0][4]).all()


def test_applies_names_what_it_takes():
    x, weight = torch.zeros(4, 32), torch.zeros(8, 32)
    assert router_kernel.applies(x, weight, 2) and router_kernel.applies(x.bfloat16(), weight, 8)
    assert not router_kernel.applies(x, weight.bfloat16(), 2)  # the torch router casts to a 16-bit weight
    assert not router_kernel.applies(x, torch.zeros(257, 32), 2)  # more experts than one program holds
    assert not router_kernel.applies(x, weight, 9) and not router_kernel.applies(x.t(), weight.t(), 2)
    assert not router_kernel.applies(x[:0], weight, 2)
    with pytest.raises(ValueError, match=r"weight \(8, 32\) torch.bfloat16"):
        router_kernel.router_top_k(x, weight.bfloat16(), None, 2, False, False)
    with pytest.raises(ValueError, match="top_k 9"):
        router_kernel.router_top_k(x, weight, None, 9, False, False)
    with pytest.raises(ValueError, match=r"bias must be \(8,\) fp32, got \(7,\)"):
        router_kernel.router_top_k(x, weight, torch.zeros(7), 2, False, False)


def _layer(router, backend, dtype, num_experts, top_k, hidden):
    experts = ExpertMLPsV2(make_config(num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=48,
                                       normalize_top_k_affinities=True),
                           BlockwiseMatmulConfig.from_kwargs(block_size=16), dtype=dtype, device=DEVICE,
                           backend=backend)
    return MoE(router, randomize_(experts, seed=5), return_router_logits=True, return_expert_index=True).eval()


@pytest.mark.parametrize("kind", ["topk_softmax", "topk_act_over_topk", "topk_sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_prefill_takes_the_fused_router_and_equals_the_torch_router(kind, dtype, monkeypatch):
    num_experts, top_k, hidden, tokens = 16, 4, 64, 96
    router = make_router(kind, num_experts, top_k, hidden, seed=3).to(DEVICE)
    fused = _layer(router, TritonBackend(fuse_router=True), dtype, num_experts, top_k, hidden)
    plain = _layer(router, TritonBackend(fuse_router=False), dtype, num_experts, top_k, hidden)
    plain.load_state_dict(fused.state_dict())
    calls = []
    original = router_kernel.router_top_k
    monkeypatch.setattr(router_kernel, "router_top_k", lambda *a: calls.append(1) or original(*a))
    x = randn(2, tokens // 2, hidden, seed=4, dtype=dtype).to(DEVICE)
    with torch.no_grad():
        out, logits, index = fused(x)
        assert len(calls) == 1, "the layer did not take the fused router"
        want_out, want_logits, want_index = plain(x)
    assert len(calls) == 1, "fuse_router=False took it"
    assert_rounding_close(logits, want_logits, _logit_tolerance(hidden), "logits vs the torch router")
    error = _logit_error(logits, want_logits)
    _check_top_k(index, want_logits.double().cpu(), 2 * error)
    if torch.equal(index, want_index):  # the same experts (no near tie): the same layer output
        # The same expert rows, combined with affinities that differ as above; each output rounded once.
        tolerance = _affinity_tolerance(error, num_experts) + 2 * UNIT_ROUNDOFF[dtype]
        assert_rounding_close(out, want_out, tolerance, "layer output")


def test_by_default_the_fused_router_takes_prefills_of_min_tokens_and_more(monkeypatch):
    num_experts, top_k, hidden = 16, 2, 64
    router = make_router("topk_softmax", num_experts, top_k, hidden, seed=3).to(DEVICE)
    layer = _layer(router, TritonBackend(), torch.float32, num_experts, top_k, hidden)
    calls = []
    original = router_kernel.router_top_k
    monkeypatch.setattr(router_kernel, "router_top_k", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    with torch.no_grad():
        layer(randn(1, router_kernel.MIN_TOKENS - 1, hidden, seed=4).to(DEVICE))
        assert calls == []
        out, logits, index = layer(randn(1, router_kernel.MIN_TOKENS, hidden, seed=4).to(DEVICE))
    assert calls == [router_kernel.MIN_TOKENS]
    want = router(randn(1, router_kernel.MIN_TOKENS, hidden, seed=4).to(DEVICE).view(-1, hidden))[0]
    assert_rounding_close(logits, want, _logit_tolerance(hidden), "logits vs the torch router")


def test_other_routers_and_training_jitter_run_the_torch_router():
    backend = TritonBackend(fuse_router=True)
    x = randn(8, 32, seed=1).to(DEVICE)
    assert backend.fused_router(x, make_router("group_limited", 8, 2, 32).to(DEVICE).fused_parts()) is None
    jittery = RouterTopK(8, 2, 32, jitter_eps=0.1, device=DEVICE).train()
    assert backend.fused_router(x, jittery.fused_parts()) is None
    assert TritonBackend(fuse_router=False).fused_router(
        x, make_router("topk_softmax", 8, 2, 32).to(DEVICE).fused_parts()) is None
    with pytest.raises(TypeError, match="fuse_router"):
        TritonBackend(fuse_router=1)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_new_tokens():
    num_experts, top_k, hidden = 128, 8, 256
    router = make_router("topk_softmax", num_experts, top_k, hidden, seed=3).to(DEVICE)
    layer = _layer(router, TritonBackend(fuse_router=True), torch.bfloat16, num_experts, top_k, hidden)
    x = randn(1, 512, hidden, seed=4, dtype=torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        graph, captured = capture_cuda_graph(lambda: layer(x))
        for seed in (5, 6):
            x.copy_(randn(1, 512, hidden, seed=seed, dtype=torch.bfloat16))
            graph.replay()
            eager = layer(x)
            for a, b in zip(captured, eager):
                assert torch.equal(a, b)


def test_bounds_reject_a_broken_router():
    """Negative control: logits from a weight 4 % too large fail the logit bound; a top-k that swapped its last
    choice for the best expert it left out fails the top-k check."""
    num_tokens, num_experts, top_k, hidden = SHAPES[0]
    x = randn(num_tokens, hidden, seed=1).to(DEVICE)
    weight = randn(num_experts, hidden, seed=2, scale=hidden ** -0.5).to(DEVICE)
    logits, _, index = router_kernel.router_top_k(x, weight * 1.04, None, top_k, False, False)
    ref_logits, _ = _reference(x, weight, None, top_k, "softmax", False, index.cpu())
    with pytest.raises(AssertionError):
        assert_rounding_close(logits, ref_logits, _logit_tolerance(hidden), "logits")
    logits, _, index = router_kernel.router_top_k(x, weight, None, top_k, False, False)
    error = _logit_error(logits, ref_logits)
    left_out = ref_logits.scatter(1, index.cpu(), float("-inf")).argmax(dim=1)
    swapped = index.cpu().clone()
    swapped[:, -1] = left_out
    with pytest.raises(AssertionError):
        _check_top_k(swapped, ref_logits, 2 * error)
