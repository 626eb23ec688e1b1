"""Routers against independent float64 formulas, plus ties, dtypes and the training-only paths."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, make_router, randn, randomize_, zero_router

from nxd_moe import GroupLimitedRouter, RouterConfig, RouterSinkhorn, RouterTopK
from nxd_moe.routing.sinkhorn import sinkhorn


def logits64(router, x):
    w = router.linear_router.weight.detach().double()
    b = router.linear_router.bias
    out = x.reshape(-1, w.shape[1]).double() @ w.t()
    return out if b is None else out + b.detach().double()


def as_sets(index: torch.Tensor):
    return [set(row) for row in index.tolist()]


@pytest.mark.parametrize("act_fn", ["softmax", "sigmoid"])
def test_topk_router_full_activation(act_fn):
    router = RouterTopK(8, 3, 16, act_fn=act_fn)
    randomize_(router, seed=1, scale=2.0)
    x = randn(2, 5, 16, seed=2)
    logits, affinities, index = router(x)
    z = logits64(router, x)
    assert logits.shape == (10, 8) and affinities.shape == (10, 8) and index.shape == (10, 3)
    assert index.dtype == torch.int64 and logits.dtype == torch.float32 and affinities.dtype == torch.float32
    assert_close(logits, z, 1e-5)
    expected = torch.softmax(z, dim=-1) if act_fn == "softmax" else torch.sigmoid(z)
    assert_close(affinities, expected, 1e-6)
    # index = the k largest logits (as a set; order within the k does not matter downstream)
    top = z.topk(3, dim=-1).indices
    assert as_sets(index) == as_sets(top)


@pytest.mark.parametrize("act_fn", ["softmax", "sigmoid"])
def test_topk_router_act_over_topk(act_fn):
    """GPT-OSS: top-k on the raw logits (with router bias), activation over the k chosen only, zeros elsewhere."""
    router = RouterTopK(8, 4, 16, act_fn=act_fn, apply_act_fn_over_topk=True, bias=True)
    randomize_(router, seed=3, scale=2.0, bias_scale=1.0)
    x = randn(9, 16, seed=4)
    _, affinities, index = router(x)
    z = logits64(router, x)
    top_vals, top_idx = z.topk(4, dim=-1)
    act = torch.softmax(top_vals, dim=-1) if act_fn == "softmax" else torch.sigmoid(top_vals)
    expected = torch.zeros(9, 8, dtype=torch.float64).scatter(1, top_idx, act)
    assert_close(affinities, expected, 1e-6)
    assert as_sets(index) == as_sets(top_idx)
    assert bool((affinities.gather(1, index) > 0).all())
    if act_fn == "softmax":
        assert_close(affinities.sum(dim=1), torch.ones(9), 1e-6)


def deepseek_v3_reference(router: GroupLimitedRouter, x):
    """DeepSeek-V3 noaux_tc routing written from the model's definition, in float64."""
    z = logits64(router, x)
    scores = torch.sigmoid(z)
    choice = scores + router.e_score_correction_bias.double()
    t, e = scores.shape
    groups = choice.view(t, router.n_group, e // router.n_group)
    group_scores = groups.topk(2, dim=-1).values.sum(-1)
    keep_groups = group_scores.topk(router.topk_group, dim=-1).indices
    chosen = []
    for row in range(t):
        allowed = [g * (e // router.n_group) + i for g in keep_groups[row].tolist()
                   for i in range(e // router.n_group)]
        ranked = sorted(allowed, key=lambda j: -float(choice[row, j]))
        chosen.append(ranked[: router.top_k])
    index = torch.tensor(chosen)
    weights = scores.gather(1, index)
    if router.normalize:
        weights = weights / weights.sum(dim=1, keepdim=True)
    weights = weights * router.routed_scaling_factor
    return torch.zeros(t, e, dtype=torch.float64).scatter(1, index, weights), index


@pytest.mark.parametrize("normalize", [True, False])
def test_group_limited_router_matches_deepseek_definition(normalize):
    router = GroupLimitedRouter(16, 4, 16, n_group=4, topk_group=2, normalize=normalize, routed_scaling_factor=2.5)
    randomize_(router, seed=5, scale=2.0)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(randn(16, seed=6, scale=0.2))
    x = randn(12, 16, seed=7)
    _, affinities, index = router(x)
    expected, expected_index = deepseek_v3_reference(router, x)
    assert as_sets(index) == as_sets(expected_index)
    assert_close(affinities, expected, 1e-5)
    if normalize:
        assert_close(affinities.sum(dim=1), torch.full((12,), 2.5), 1e-5)
    # the correction bias steers selection but never enters the weights
    with torch.no_grad():
        router.e_score_correction_bias.mul_(1.01)
    _, affinities_again, index_again = router(x)
    if torch.equal(index_again, index):
        assert_close(affinities_again, affinities, 1e-7)


def test_group_limited_router_never_picks_discarded_group_even_with_negative_bias():
    """NxD masks discarded groups with 0; with a large negative correction bias, a discarded expert (0) would
    then beat kept ones (negative). We mask with -inf."""
    router = GroupLimitedRouter(8, 4, 4, n_group=4, topk_group=2)
    with torch.no_grad():
        router.linear_router.weight.zero_()
        # groups {0,1} {2,3} {4,5} {6,7}: favour groups 0 and 1, push every choice score below zero
        router.e_score_correction_bias.copy_(torch.tensor([-1.0, -1.0, -1.1, -1.1, -5.0, -5.0, -5.0, -5.0]))
    _, affinities, index = router(torch.zeros(3, 4))
    assert all(s == {0, 1, 2, 3} for s in as_sets(index))
    assert bool((affinities[:, 4:] == 0).all())


def test_group_limited_router_arguments_reach_their_places_and_bad_ones_are_named():
    """Every argument, each away from its default, lands where RouterBase keeps it; each bound of n_group, topk_group
    and top_k (the largest valid value passes, one past it fails) is refused with its name and range."""
    group = object()
    router = GroupLimitedRouter(16, 8, 8, n_group=4, topk_group=2, sequence_parallel_enabled=True,
                                sequence_dimension=1, dtype=torch.float64, tensor_model_parallel_group=group,
                                jitter_eps=0.25, normalize=True, routed_scaling_factor=2.5)
    assert (router.num_experts, router.top_k, router.hidden_size, router.n_group, router.topk_group) == (16, 8, 8, 4, 2)
    assert (router.normalize, router.routed_scaling_factor, router.act_fn, router.jitter_eps) == (True, 2.5, "sigmoid",
                                                                                                  0.25)
    assert router.sequence_parallel_enabled and router.sequence_dimension == 1
    assert router.tensor_model_parallel_group is group and router.linear_router.weight.dtype == torch.float64
    bias = router.state_dict()["e_score_correction_bias"]  # a buffer: checkpoints load it
    assert bias.dtype == torch.float32 and bias.shape == (16,) and not bias.any()
    default = GroupLimitedRouter(16, 2, 8, n_group=4, topk_group=2)
    assert (default.sequence_parallel_enabled, default.normalize, default.routed_scaling_factor) == (False, False, 1.0)
    meta = GroupLimitedRouter(16, 2, 8, n_group=4, topk_group=2, device="meta")  # every tensor on the device given
    assert meta.linear_router.weight.device.type == meta.e_score_correction_bias.device.type == "meta"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:  # the correction bias is float32 whatever the default dtype (as DeepSeek-V3's checkpoints store it)
        assert GroupLimitedRouter(16, 2, 8, n_group=4, topk_group=2).e_score_correction_bias.dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)
    GroupLimitedRouter(16, 2, 8, n_group=16, topk_group=16)  # the largest valid values
    bad = [(dict(n_group=0, topk_group=1), ValueError, r"^GroupLimitedRouter\.n_group must be in \[1, 16\], got 0$"),
           (dict(n_group=32, topk_group=1), ValueError, r"^GroupLimitedRouter\.n_group must be in \[1, 16\], got 32$"),
           (dict(n_group=3, topk_group=1), ValueError,
            r"^GroupLimitedRouter\.n_group \(3\) must divide num_experts \(16\)$"),
           (dict(n_group=4, topk_group=0), ValueError, r"^GroupLimitedRouter\.topk_group must be in \[1, 4\], got 0$"),
           (dict(n_group=4, topk_group=5), ValueError, r"^GroupLimitedRouter\.topk_group must be in \[1, 4\], got 5$"),
           (dict(n_group=4, topk_group=2, normalize=1), TypeError, r"^GroupLimitedRouter\.normalize must be a bool"),
           (dict(n_group=4, topk_group=2, routed_scaling_factor=0.0), ValueError,
            r"^GroupLimitedRouter\.routed_scaling_factor must be > 0, got 0\.0$")]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            GroupLimitedRouter(16, 2, 8, **kwargs)
    with pytest.raises(ValueError, match=r"^GroupLimitedRouter\.top_k \(9\) must be <= topk_group \* num_experts / "
                                         r"n_group \(2 \* 4\), the number of experts in the kept groups$"):
        GroupLimitedRouter(16, 9, 8, n_group=4, topk_group=2)


def test_group_limited_router_single_expert_groups():
    router = GroupLimitedRouter(4, 2, 8, n_group=4, topk_group=2)
    randomize_(router, seed=8)
    x = randn(5, 8, seed=9)
    _, affinities, index = router(x)
    expected, expected_index = deepseek_v3_reference_single(router, x)
    assert as_sets(index) == as_sets(expected_index)
    assert_close(affinities, expected, 1e-6)


def deepseek_v3_reference_single(router, x):
    # with one expert per group, a group's score is its expert's choice score: plain top-k over choice
    z = logits64(router, x)
    scores = torch.sigmoid(z)
    choice = scores + router.e_score_correction_bias.double()
    index = choice.topk(router.top_k, dim=-1).indices
    return torch.zeros_like(scores).scatter(1, index, scores.gather(1, index)), index


def test_sinkhorn_router_eval_argmax_and_training_balances():
    """Logits = per-expert offset + a permutation: eval picks the offset's favourite for every token, while
    Sinkhorn balancing (which removes row/column offsets) recovers the permutation in training."""
    num_experts = 4
    perm = torch.tensor([2, 0, 3, 1])
    router = RouterSinkhorn(num_experts, 1, num_experts)
    with torch.no_grad():
        router.linear_router.weight.copy_(torch.eye(num_experts))
    x = torch.full((4, 4), 0.0)
    x[torch.arange(4), perm] = 2.0
    x[:, 0] += 6.0  # expert 0 is everyone's favourite
    router.eval()
    logits, affinities, index = router(x)
    assert index.shape == (4, 1) and index.squeeze(1).tolist() == [0, 0, 0, 0]
    assert_close(affinities, torch.sigmoid(logits64(router, x)), 1e-6)
    router.train()
    _, _, index = router(x)
    assert index.squeeze(1).tolist() == perm.tolist()


def test_sinkhorn_balances_marginals():
    cost = torch.exp(randn(6, 3, seed=10, dtype=torch.float64))
    balanced = sinkhorn(cost, 200)
    assert_close(balanced.sum(dim=0), torch.full((3,), 1 / 3), 1e-6)
    assert_close(balanced.sum(dim=1), torch.full((6,), 1 / 6), 1e-6)


@pytest.mark.parametrize("kind", ["topk_softmax", "topk_sigmoid", "topk_act_over_topk", "group_limited"])
def test_all_equal_logits_still_give_k_distinct_experts(kind):
    router = zero_router(make_router(kind, 8, 3, 16))
    _, affinities, index = router(randn(7, 16, seed=11))
    assert all(len(s) == 3 for s in as_sets(index))
    assert bool(((index >= 0) & (index < 8)).all())
    chosen = affinities.gather(1, index)
    assert bool((chosen > 0).all())


def test_router_bias_steers_every_token_to_one_expert():
    router = RouterTopK(6, 2, 8, bias=True)
    with torch.no_grad():
        router.linear_router.weight.zero_()
        router.linear_router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 50.0, 0.0, 25.0]))
    _, affinities, index = router(randn(5, 8, seed=12))
    assert index.tolist() == [[3, 5]] * 5


def test_router_dtypes_and_shapes():
    router = RouterTopK(4, 2, 8, dtype=torch.bfloat16)
    assert router.linear_router.weight.dtype == torch.bfloat16
    assert router.routing_dtype == torch.float32  # routing math is at least fp32
    x = randn(3, 2, 8, seed=13, dtype=torch.bfloat16)
    logits, affinities, index = router(x)
    assert logits.dtype == torch.float32 and affinities.dtype == torch.float32 and index.dtype == torch.int64
    assert logits.shape == (6, 4)
    router64 = RouterTopK(4, 2, 8, dtype="float64")
    assert router64.routing_dtype == torch.float64
    _, affinities, _ = router64(randn(3, 8, seed=13))
    assert affinities.dtype == torch.float64  # affinities stay in the routing dtype


def test_jitter_only_in_training():
    router = RouterTopK(4, 2, 8, jitter_eps=0.5)
    x = randn(6, 8, seed=14)
    router.eval()
    a = router(x)[0]
    assert torch.equal(a, router(x)[0])
    router.train()
    torch.manual_seed(0)
    b = router(x)[0]
    assert not torch.allclose(a, b)


def test_router_config_from_kwargs():
    cfg = RouterConfig.from_kwargs(router_act_fn="sigmoid", router_dtype="bfloat16")
    assert cfg.act_fn == "sigmoid" and cfg.dtype == torch.bfloat16
    assert RouterConfig() == RouterConfig(act_fn="softmax", dtype=torch.float32)
    # NxDI passes all its NeuronConfig keywords: unrelated keys are ignored, near-misses of the two are not.
    assert RouterConfig.from_kwargs(tp_degree=8, router_topk_nki_kernel_enabled=True) == RouterConfig()
    with pytest.raises(TypeError, match="'router_act_func'.*did you mean 'router_act_fn'"):
        RouterConfig.from_kwargs(router_act_func="sigmoid")
    with pytest.raises(ValueError, match="act_fn must be one of"):
        RouterConfig(act_fn="softmx")
    # NxD's RouterConfig takes any ACT2FN name; the routers compute softmax and sigmoid only, and say so.
    assert RouterConfig(act_fn="relu").act_fn == "relu"
    with pytest.raises(ValueError, match="act_fn must be one of \\['softmax', 'sigmoid'\\], got 'relu'"):
        RouterTopK(4, 2, 8, act_fn=RouterConfig(act_fn="relu").act_fn)
    # Mutable, as NxDI's model code needs (router_config.act_fn = "sigmoid"), and every assignment is checked.
    cfg.act_fn, cfg.dtype = "softmax", "float16"
    assert cfg == RouterConfig(act_fn="softmax", dtype=torch.float16)
    with pytest.raises(TypeError, match="RouterConfig.dtype"):
        cfg.dtype = "int8"
    with pytest.raises(AttributeError, match="no field 'act'"):
        cfg.act = "sigmoid"
