"""The one routed pipeline (``ExpertMLPsV2.routed_forward``): prepare -> dispatch -> compute -> combine -> finalize,
with the dispatcher as the only thing that differs between one device and expert parallelism.

One device's dispatcher hands the router's routing through; the expert-parallel ones move rows and hand the experts
pairs. Here a dispatcher that moves rows on one process (it reverses their order, and hands pairs) must give what
one device gives, and both the float64 dense reference; one that loses a pair must not (negative control).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DROPLESS_MODES, FP64_ATOL, assert_close, make_experts, randn, random_routing

from nxd_moe.experts.mode import NXD_POLICY, ExpertsMode, ModePolicy, select_mode
from nxd_moe.parallel.dispatch import LOCAL, Dispatched, DispatchResult, Route
from nxd_moe.reference import reference_for_experts


class MovingDispatcher:
    """Moves every row, as an expert-parallel dispatcher does: the rows (reversed when ``reverse``) with their pairs,
    no routing; ``combine`` puts them back. ``lose_pair``: the first row's first pair goes nowhere (a broken
    dispatcher)."""

    def __init__(self, reverse: bool = True, lose_pair: bool = False):
        self.reverse, self.lose_pair, self.calls = reverse, lose_pair, []

    def dispatch(self, inputs):
        self.calls.append("dispatch")
        pair_expert, pair_weight = inputs.pairs()
        if self.lose_pair:
            pair_expert = pair_expert.clone()
            pair_expert[0, 0] = -1
        n = inputs.hidden.shape[0]
        order = torch.arange(n - 1, -1, -1) if self.reverse else torch.arange(n)
        return Dispatched(inputs.hidden[order], pair_expert[order], pair_weight[order], order)

    def combine(self, partial, order):
        self.calls.append("combine")
        return DispatchResult(torch.empty_like(partial).index_copy_(0, order, partial), None)


def run(experts, x, affinities, index, route, mode, mask=None):
    return experts.routed_forward(x, affinities, index, None, mask, route, mode=mode, return_stats=True)


@pytest.mark.parametrize("mode", DROPLESS_MODES)
@pytest.mark.parametrize("padded", [False, True])
def test_a_dispatcher_that_moves_rows_gives_what_one_device_gives(mode, padded):
    experts = make_experts(num_experts=6, hidden_size=24, intermediate_size=10, top_k=3, dtype=torch.float64,
                           normalize_top_k_affinities=True, block_size=3, seed=3)
    x = randn(11, 24, seed=4, dtype=torch.float64)
    affinities, index = random_routing(11, 6, 3, seed=5, dtype=torch.float64)
    mask = (torch.arange(11) % 4 != 1) if padded else None
    local, local_stats = experts(x, affinities, index, padding_mask=mask, mode=mode, return_stats=True)
    dispatcher = MovingDispatcher()
    moved, stats = run(experts, x, affinities, index, Route(dispatcher), mode, mask)
    assert dispatcher.calls == ["dispatch", "combine"]
    keep = None if mask is None else mask.unsqueeze(1).expand(-1, 3)
    expected = reference_for_experts(experts, x, affinities, index, keep)
    if mask is not None:
        expected = torch.where(mask.unsqueeze(1), expected, 0.0)
        moved = torch.where(mask.unsqueeze(1), moved, 0.0)
        local = torch.where(mask.unsqueeze(1), local, 0.0)
    assert_close(local, expected, FP64_ATOL, msg="one device vs reference")
    assert_close(moved, expected, FP64_ATOL, msg="moved rows vs reference")
    assert stats.mode is local_stats.mode is ExpertsMode(mode)
    assert torch.equal(stats.tokens_per_expert.long(), local_stats.tokens_per_expert.long())
    assert int(stats.tokens_per_expert.sum()) == (3 * 11 if mask is None else 3 * int(mask.sum()))


def test_a_dispatcher_that_loses_a_pair_is_caught():
    """Negative control: the comparison above fails for a dispatcher that drops one pair."""
    experts = make_experts(num_experts=6, hidden_size=24, intermediate_size=10, top_k=3, dtype=torch.float64,
                           seed=3)
    x = randn(11, 24, seed=4, dtype=torch.float64)
    affinities, index = random_routing(11, 6, 3, seed=5, dtype=torch.float64)
    expected = reference_for_experts(experts, x, affinities, index)
    broken, _ = run(experts, x, affinities, index, Route(MovingDispatcher(lose_pair=True)), "selective_loading")
    with pytest.raises(AssertionError):
        assert_close(broken, expected, FP64_ATOL)


def test_capacity_drops_are_the_experts_own_count_when_the_dispatcher_counts_nothing():
    """Capacity factor keeps each expert's first ``C`` pairs in token order, so the moved rows keep it; with no
    block counts from the dispatcher, the statistics report what the experts dropped, as one device does."""
    experts = make_experts(num_experts=4, hidden_size=16, intermediate_size=8, top_k=2, dtype=torch.float64,
                           capacity_factor=0.5, seed=7)
    x = randn(12, 16, seed=8, dtype=torch.float64)
    affinities, index = random_routing(12, 4, 2, seed=9, dtype=torch.float64, skew=2.0)
    local, local_stats = experts(x, affinities, index, mode="capacity_factor", return_stats=True)
    moved, stats = run(experts, x, affinities, index, Route(MovingDispatcher(reverse=False)), "capacity_factor")
    assert_close(moved, local, FP64_ATOL)
    assert int(stats.dropped_tokens) == int(local_stats.dropped_tokens) > 0
    assert stats.capacity == local_stats.capacity


def test_one_device_hands_the_router_routing_through():
    experts = make_experts(dtype=torch.float64)
    x = randn(5, 16, seed=1, dtype=torch.float64)
    affinities, index = random_routing(5, 4, 2, seed=2, dtype=torch.float64)
    routing = experts.routing(affinities, index)
    from nxd_moe.parallel.dispatch import DispatchInputs

    dispatched = LOCAL.dispatch(DispatchInputs(x, routing))
    assert dispatched.rows is x and dispatched.routing is routing and dispatched.pair_expert is None
    partial = torch.ones(5, 16, dtype=torch.float64)
    assert LOCAL.combine(partial, dispatched.handle).output is partial


@pytest.mark.parametrize("tokens,seq_len", [(1, 1), (3, 1), (40, 1), (3, None), (40, None), (300, None), (2000, None)])
def test_each_policy_field_changes_only_its_case(tokens, seq_len):
    """The one mode rule: NxD's by default; each policy field departs from it in its own case only."""
    args = (tokens, seq_len, 8, 64, 512, None, 1.0)
    nxd = select_mode(*args)
    assert select_mode(*args, NXD_POLICY) is nxd
    no_all_experts = select_mode(*args, ModePolicy(all_experts=False))
    assert no_all_experts is (ExpertsMode.SELECTIVE_LOADING if nxd is ExpertsMode.ALL_EXPERTS and seq_len == 1 else
                              ExpertsMode.BLOCKWISE if nxd is ExpertsMode.ALL_EXPERTS else nxd)
    pairs_up_to = select_mode(*args, ModePolicy(pairs_up_to=1024))
    assert pairs_up_to is (ExpertsMode.SELECTIVE_LOADING if seq_len is None and tokens * 8 <= 1024 else nxd)
    assert select_mode(*args, ModePolicy(pairs_always=True)) is ExpertsMode.SELECTIVE_LOADING
    # a capacity factor is never overridden
    assert select_mode(tokens, None, 8, 64, 512, 1.0, 1.0, ModePolicy(pairs_always=True)) is \
        ExpertsMode.CAPACITY_FACTOR


def test_the_triton_policy_is_the_gpu_rule():
    """The GPU backend's policy: selective loading at every decode and for prefills of one launch's pairs,
    blockwise above, capacity factor where asked (its documented rule)."""
    from nxd_moe.triton_kernels import persistent_decode
    from nxd_moe.triton_kernels.backend import TritonBackend

    backend = TritonBackend()
    limit = persistent_decode.MAX_PAIRS
    assert backend.select_mode(512, 1, 8, 64, 512, None, 1.0) is ExpertsMode.SELECTIVE_LOADING
    assert backend.select_mode(limit // 8, None, 8, 64, 512, None, 1.0) is ExpertsMode.SELECTIVE_LOADING
    assert backend.select_mode(limit // 8 + 1, None, 8, 64, 512, None, 1.0) is ExpertsMode.BLOCKWISE
    assert backend.select_mode(limit // 8 + 1, None, 8, 64, 4096, None, 1.0) is ExpertsMode.BLOCKWISE
    assert backend.select_mode(4, None, 8, 64, 512, 1.0, 1.0) is ExpertsMode.CAPACITY_FACTOR


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(all_experts=1), TypeError, "ModePolicy.all_experts"),
    (dict(pairs_always="yes"), TypeError, "ModePolicy.pairs_always"),
    (dict(pairs_up_to=-1), ValueError, "ModePolicy.pairs_up_to"),
    (dict(pairs_up_to=1.5), TypeError, "ModePolicy.pairs_up_to"),
])
def test_a_mode_policy_with_a_bad_field_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModePolicy(**kwargs)
