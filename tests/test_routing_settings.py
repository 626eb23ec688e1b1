"""RouterBase's settings and RouterSinkhorn's Sinkhorn iterations, each against a float64 reference written here."""

from __future__ import annotations

import pytest
import torch

from nxd_moe import RouterSinkhorn, RouterTopK
from nxd_moe.routing.sinkhorn import DEFAULT_SINKHORN_ITERATIONS, sinkhorn


def sinkhorn64(cost: torch.Tensor, iterations: int, eps: float = 1e-8) -> torch.Tensor:
    """Sinkhorn's row/column scaling written out in float64: rows towards 1/T, then columns towards 1/E."""
    cost = cost.double()
    num_tokens, num_experts = cost.shape
    col = torch.ones(num_experts, dtype=torch.float64)
    row = torch.ones(num_tokens, dtype=torch.float64)
    for _ in range(iterations):
        row = (1.0 / num_tokens) / ((cost * col).sum(dim=1) + eps)
        col = (1.0 / num_experts) / ((cost * row[:, None]).sum(dim=0) + eps)
    return cost * row[:, None] * col


def identity_router(cls, num_experts, **kwargs):
    router = cls(num_experts, 1, num_experts, **kwargs)
    with torch.no_grad():
        router.linear_router.weight.copy_(torch.eye(num_experts))
    return router


def seeded_logits(seed=3, shape=(8, 4), scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def test_sinkhorn_matches_the_written_out_iterations_for_each_count():
    cost = torch.exp(seeded_logits(seed=5, shape=(5, 3)))
    for iterations in (1, 2, 7):
        torch.testing.assert_close(sinkhorn(cost, iterations), sinkhorn64(cost, iterations), rtol=1e-12, atol=0)
    # after enough iterations: rows sum to 1/T and columns to 1/E (not to 2/T or 1/(E+1))
    balanced = sinkhorn(cost, 300)
    torch.testing.assert_close(balanced.sum(dim=1), torch.full((5,), 1 / 5, dtype=torch.float64))
    torch.testing.assert_close(balanced.sum(dim=0), torch.full((3,), 1 / 3, dtype=torch.float64))
    # float32 stays float32
    assert sinkhorn(cost.float(), 3).dtype == torch.float32


def test_sinkhorn_eps_default_and_given():
    """Tiny costs (1e-9): the eps of the denominators dominates, so its value shows."""
    cost = torch.exp(seeded_logits(seed=6, shape=(4, 3), scale=0.5)) * 1e-9
    for iterations in (1, 3):
        torch.testing.assert_close(sinkhorn(cost, iterations), sinkhorn64(cost, iterations, 1e-8),
                                   rtol=1e-12, atol=0)
        torch.testing.assert_close(sinkhorn(cost, iterations, eps=3e-9), sinkhorn64(cost, iterations, 3e-9),
                                   rtol=1e-12, atol=0)
    assert not torch.allclose(sinkhorn64(cost, 1, 1e-8), sinkhorn64(cost, 1, 0.0))


def test_sinkhorn_router_training_index_is_argmax_of_its_iteration_count():
    logits = seeded_logits()
    cost = torch.exp(logits - logits.max())
    want = {n: sinkhorn64(cost, n).argmax(dim=-1) for n in (2, 3, DEFAULT_SINKHORN_ITERATIONS)}
    assert not torch.equal(want[2], want[3]) and not torch.equal(want[3], want[DEFAULT_SINKHORN_ITERATIONS])
    assert DEFAULT_SINKHORN_ITERATIONS == 30
    for iterations, key in ((None, DEFAULT_SINKHORN_ITERATIONS), (2, 2), (3, 3)):
        router = identity_router(RouterSinkhorn, 4, sinkhorn_iterations=iterations, dtype=torch.float64)
        assert router.sinkhorn_iterations == key
        router.train()
        out_logits, affinities, index = router(logits)
        assert index.shape == (8, 1) and index.dtype == torch.int64
        assert index.squeeze(1).tolist() == want[key].tolist()
        torch.testing.assert_close(out_logits, logits, rtol=0, atol=0)
        torch.testing.assert_close(affinities, 1 / (1 + torch.exp(-logits)), rtol=1e-12, atol=1e-15)
    router.eval()
    index = router(logits)[2]
    assert index.squeeze(1).tolist() == logits.argmax(dim=-1).tolist()
    assert want[3].tolist() != logits.argmax(dim=-1).tolist()


def test_sinkhorn_router_large_logits_do_not_overflow_and_index_has_no_grad():
    """Logits near 100 in float32: exp(logits + max) would overflow; the shift by the max keeps them finite."""
    logits = seeded_logits(seed=3) + 100.0
    want = sinkhorn64(torch.exp(logits - logits.max()), DEFAULT_SINKHORN_ITERATIONS).argmax(dim=-1)
    router = identity_router(RouterSinkhorn, 4)
    router.train()
    x = logits.float().requires_grad_(True)
    out_logits, affinities, index = router(x)
    assert index.squeeze(1).tolist() == want.tolist()
    assert not index.requires_grad and out_logits.requires_grad and affinities.requires_grad


def test_sinkhorn_router_arguments_reach_the_base():
    group = object()
    router = RouterSinkhorn(6, 1, 5, act_fn="softmax", sequence_parallel_enabled=True, sequence_dimension=2,
                            dtype=torch.float64, device="cpu", sinkhorn_iterations=4,
                            tensor_model_parallel_group=group, jitter_eps=0.25)
    assert (router.num_experts, router.top_k, router.hidden_size) == (6, 1, 5)
    assert router.act_fn == "softmax" and router.sequence_parallel_enabled is True
    assert router.sequence_dimension == 2 and router.dtype == torch.float64
    assert router.linear_router.weight.dtype == torch.float64 and router.linear_router.weight.shape == (6, 5)
    assert router.tensor_model_parallel_group is group and router.jitter_eps == 0.25
    assert router.sinkhorn_iterations == 4 and router.linear_router.bias is None
    default = RouterSinkhorn(3, 1, 2)
    assert default.act_fn == "sigmoid" and default.sequence_parallel_enabled is False
    assert default.sequence_dimension is None and default.dtype == torch.float32 and default.jitter_eps == 0.0
    assert default.tensor_model_parallel_group is None
    with pytest.raises(ValueError, match=r"^RouterSinkhorn supports top_k=1 only, got top_k=2$"):
        RouterSinkhorn(4, 2, 3)
    with pytest.raises(ValueError, match=r"^RouterSinkhorn\.sinkhorn_iterations must be in \[1, inf\], got 0$"):
        RouterSinkhorn(4, 1, 3, sinkhorn_iterations=0)
    assert RouterSinkhorn(4, 1, 3, sinkhorn_iterations=1).sinkhorn_iterations == 1


def test_router_base_settings_are_checked_and_named():
    with pytest.raises(ValueError, match=r"^RouterTopK\.num_experts must be in \[1, inf\], got 0$"):
        RouterTopK(0, 1, 4)
    with pytest.raises(ValueError, match=r"^RouterTopK\.top_k must be in \[1, 3\], got 4$"):
        RouterTopK(3, 4, 4)
    with pytest.raises(ValueError, match=r"^RouterTopK\.top_k must be in \[1, 3\], got 0$"):
        RouterTopK(3, 0, 4)
    with pytest.raises(ValueError, match=r"^RouterTopK\.hidden_size must be in \[1, inf\], got 0$"):
        RouterTopK(3, 1, 0)
    assert RouterTopK(1, 1, 1).num_experts == 1 and RouterTopK(3, 3, 1).top_k == 3
    with pytest.raises(ValueError, match=r"^RouterTopK\.act_fn must be one of \['softmax', 'sigmoid'\], got 'relu'$"):
        RouterTopK(3, 1, 4, act_fn="relu")
    with pytest.raises(TypeError, match=r"^RouterTopK\.sequence_parallel_enabled must be a bool, got int 1$"):
        RouterTopK(3, 1, 4, sequence_parallel_enabled=1)
    with pytest.raises(TypeError, match=r"^RouterTopK\.apply_act_fn_over_topk must be a bool, got int 1$"):
        RouterTopK(3, 1, 4, apply_act_fn_over_topk=1)
    with pytest.raises(TypeError, match=r"^RouterTopK\.bias must be a bool, got int 1$"):
        RouterTopK(3, 1, 4, bias=1)
    with pytest.raises(TypeError, match=r"^RouterTopK\.jitter_eps must be a number, got str 'x'$"):
        RouterTopK(3, 1, 4, jitter_eps="x")
    for bad in (1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=rf"^RouterTopK\.jitter_eps must be in \[0, 1\), got {bad}$"):
            RouterTopK(3, 1, 4, jitter_eps=bad)
    assert RouterTopK(3, 1, 4, jitter_eps=0).jitter_eps == 0.0
    assert RouterTopK(3, 1, 4, jitter_eps=0.999).jitter_eps == 0.999
    with pytest.raises((TypeError, ValueError), match="RouterTopK.dtype"):
        RouterTopK(3, 1, 4, dtype="float77")


def test_router_base_stores_each_setting():
    group = object()
    router = RouterTopK(5, 2, 3, sequence_parallel_enabled=True, dtype="float64", device="cpu", bias=True,
                        tensor_model_parallel_group=group, act_fn="sigmoid", apply_act_fn_over_topk=True,
                        jitter_eps=0.125)
    assert router.sequence_parallel_enabled is True and router.sequence_dimension == 0  # sequence parallel: dim 0
    assert router.dtype == torch.float64 and router.linear_router.weight.dtype == torch.float64
    assert router.linear_router.bias is not None and router.linear_router.bias.dtype == torch.float64
    assert router.linear_router.weight.device.type == "cpu" and router.linear_router.weight.shape == (5, 3)
    assert router.tensor_model_parallel_group is group and router.act_fn == "sigmoid"
    assert router.apply_act_fn_over_topk is True and router.jitter_eps == 0.125
    assert RouterTopK(5, 2, 3, sequence_parallel_enabled=True, sequence_dimension=1).sequence_dimension == 1
    plain = RouterTopK(5, 2, 3)
    assert plain.sequence_dimension is None and plain.sequence_parallel_enabled is False
    assert plain.apply_act_fn_over_topk is False and plain.act_fn == "softmax" and plain.dtype == torch.float32
    assert plain.linear_router.bias is None and plain.jitter_eps == 0.0 and plain.tensor_model_parallel_group is None
    assert RouterTopK(5, 2, 3, sequence_dimension=2).sequence_dimension == 2
    assert RouterSinkhorn(3, 1, 2).fused_parts() is None


def test_router_base_logits_activation_and_dtypes():
    router = RouterSinkhorn(4, 1, 3, act_fn="softmax", dtype=torch.float32)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    logits = router.get_router_logits(x)  # float64 input: cast to the weight's dtype first
    w = router.linear_router.weight.detach().double()
    ref = x.reshape(-1, 3) @ w.t()
    assert logits.shape == (10, 4) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-6)
    z = torch.tensor([[0.5, -1.0, 2.0, 0.25], [3.0, 1.0, -2.0, 0.0]], dtype=torch.float64)
    e = torch.exp(z - z.max(dim=1, keepdim=True).values)
    torch.testing.assert_close(router.apply_activation_fn(z), e / e.sum(dim=1, keepdim=True), rtol=1e-12, atol=0)
    sig = RouterSinkhorn(4, 1, 3, act_fn="sigmoid")
    torch.testing.assert_close(sig.apply_activation_fn(z), 1 / (1 + torch.exp(-z)), rtol=1e-12, atol=0)
    assert router.routing_dtype == torch.float32
    assert RouterSinkhorn(4, 1, 3, dtype=torch.bfloat16).routing_dtype == torch.float32
    assert RouterSinkhorn(4, 1, 3, dtype=torch.float64).routing_dtype == torch.float64
    with pytest.raises(ValueError, match=r"^RouterSinkhorn: hidden_states must have last dimension 3"):
        router.get_router_logits(torch.zeros(2, 4))


def test_jitter_draws_uniformly_in_one_plus_minus_eps_only_in_training():
    router = identity_router(RouterSinkhorn, 64, jitter_eps=0.25, dtype=torch.float64)
    x = torch.ones(32, 64, dtype=torch.float64)
    router.eval()
    assert torch.equal(router.get_router_logits(x), x)
    router.train()
    torch.manual_seed(1)
    factors = router.get_router_logits(x).detach()
    assert float(factors.min()) >= 0.75 and float(factors.max()) <= 1.25
    assert float(factors.min()) < 0.76 and float(factors.max()) > 1.24
    assert abs(float(factors.mean()) - 1.0) < 0.01
    still = identity_router(RouterSinkhorn, 64, dtype=torch.float64)
    still.train()
    assert torch.equal(still.get_router_logits(x), x)


def test_sinkhorn_keeps_the_cost_dtype_and_device_and_zero_iterations_is_the_identity():
    cost = torch.exp(seeded_logits(seed=8, shape=(4, 3))).to(torch.bfloat16)
    for iterations in (0, 2):
        assert sinkhorn(cost, iterations).dtype == torch.bfloat16  # float32 scales would promote it
    assert torch.equal(sinkhorn(cost, 0), cost)
    meta = torch.ones(4, 3, device="meta")  # scales made on the CPU would not mix with it
    for iterations in (0, 2):
        out = sinkhorn(meta, iterations)
        assert out.device.type == "meta" and out.shape == (4, 3)


def test_sinkhorn_router_builds_on_the_given_device():
    router = RouterSinkhorn(4, 1, 3, device="meta")
    assert router.linear_router.weight.device.type == "meta"


def test_no_jitter_draws_no_random_numbers_in_training():
    router = identity_router(RouterSinkhorn, 4)
    router.train()
    state = torch.get_rng_state()
    router.get_router_logits(torch.ones(2, 4))
    assert torch.equal(torch.get_rng_state(), state)
