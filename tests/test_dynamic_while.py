"""Dynamic-while blockwise prefill (``use_shard_on_intermediate_dynamic_while`` / ``use_shard_on_block_dynamic_while``)
on CPU: the float64 dense reference for every routing shape, the loop's own block counter against a schedule
computed from the routing alone, and one graph under ``torch.compile(fullgraph=True)`` (the XLA proof is in
``tests/xla``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ACTIVATIONS,
    FP32_ATOL,
    TORCH_ROUNDINGS,
    assert_close,
    assert_rounding_close,
    make_config,
    make_experts,
    make_router,
    make_shared,
    randn,
    random_routing,
    rounding_tolerance,
)
from hypothesis import given
from hypothesis import strategies as st

from nxd_moe import MoE
from nxd_moe.experts.blockwise import blockwise_forward
from nxd_moe.experts.dynamic_while import dynamic_while_blockwise_forward
from nxd_moe.experts.routing_inputs import build_routing
from nxd_moe.experts.token_mapping import num_blocks, token_to_block_mapping
from nxd_moe.experts.while_loop import while_loop, while_loop_into
from nxd_moe.reference import reference_for_experts, reference_for_moe
from nxd_moe.trace import static_backend

FLAGS = {
    "intermediate": dict(use_shard_on_intermediate_dynamic_while=True),
    "block": dict(use_shard_on_block_dynamic_while=True),
}


def routing_of(kind: str, num_tokens: int, num_experts: int, top_k: int, seed: int):
    """``(affinities, expert_index)``: random, skewed towards low experts, or every token on experts 0..k-1."""
    affinities, expert_index = random_routing(num_tokens, num_experts, top_k, seed=seed,
                                              skew=3.0 if kind == "skewed" else 0.0)
    if kind == "all_to_one":
        expert_index = torch.arange(top_k).expand(num_tokens, top_k).clone()
    return affinities, expert_index


def expected_schedule(expert_index, token_is_real, num_experts, block_size, n_blocks, static, step):
    """Blocks the loop must compute, from the routing alone (plain Python, not the mapping code): the static
    prefix, then whole iterations of ``step`` blocks while the next block holds a real token."""
    counts = [0] * num_experts
    for t, row in enumerate(expert_index.tolist()):
        if token_is_real is None or bool(token_is_real[t]):
            for e in row:
                counts[e] += 1
    active = sum(-(-c // block_size) for c in counts)
    computed = static
    while computed < n_blocks and computed < active:
        computed = min(computed + step, n_blocks)
    return computed, active


def direct_call(experts, x, affinities, expert_index, padding_mask=None):
    """Run the algorithm itself (not through the module) to read its block counter."""
    cfg, bcfg = experts.routed_experts_mlp_config, experts.blockwise_matmul_config
    routing = build_routing(affinities, expert_index, cfg.num_experts, cfg.normalize_top_k_affinities,
                            cfg.early_expert_affinity_modulation, padding_mask)
    n = num_blocks(x.shape[0], cfg.top_k, cfg.num_experts, bcfg.block_size, bcfg.pad_num_blocks_to_even)
    mapping = token_to_block_mapping(routing.expert_mask, routing.expert_index, bcfg.block_size, n)
    result = dynamic_while_blockwise_forward(x, routing, mapping, experts.expert_weights(), bcfg,
                                             experts.backend.matmul)
    return result, routing, mapping, n


# ----------------------------------------------------------------------------------------------------------
# against the float64 reference


@pytest.mark.parametrize("static", [None, 0, 3, 100])
@pytest.mark.parametrize("routing_kind", ["random", "skewed", "all_to_one"])
@pytest.mark.parametrize("flag", list(FLAGS))
def test_matches_reference_and_counts_its_blocks(flag, routing_kind, static):
    num_tokens, num_experts, top_k, block_size = 13, 6, 2, 3
    experts = make_experts(num_experts=num_experts, top_k=top_k, block_size=block_size, seed=1,
                           blockwise=dict(FLAGS[flag], num_static_blocks=static))
    affinities, expert_index = routing_of(routing_kind, num_tokens, num_experts, top_k, seed=2)
    x = randn(num_tokens, 16, seed=3)
    with torch.no_grad():
        out = experts(x, affinities, expert_index, mode="blockwise")
        result, *_, n = direct_call(experts, x, affinities, expert_index)
    ref = reference_for_experts(experts, x, affinities, expert_index)
    assert_close(out, ref, FP32_ATOL)
    assert torch.equal(result.output, out)
    default_static = -(-num_tokens * top_k // block_size)
    s = min(default_static if static is None else static, n)
    computed, active = expected_schedule(expert_index, None, num_experts, block_size, n, s, 2 if flag == "block" else 1)
    assert int(result.computed_blocks) == computed
    if static == 0 and flag == "intermediate":
        assert computed == active  # pure dynamic, one block per iteration: exactly the active blocks
    if routing_kind == "all_to_one" and static == 0:
        assert int(result.computed_blocks) < n  # the point: padding blocks are skipped


def test_counter_is_measured_not_assumed():
    """Negative control for the counter: a static prefix covering every block computes all N blocks although
    far fewer are active, so ``computed`` is not a restatement of the active count."""
    experts = make_experts(num_experts=6, top_k=2, block_size=3, seed=1,
                           blockwise=dict(use_shard_on_intermediate_dynamic_while=True, num_static_blocks=10 ** 6))
    affinities, expert_index = routing_of("all_to_one", 13, 6, 2, seed=2)
    with torch.no_grad():
        result, routing, mapping, n = direct_call(experts, randn(13, 16, seed=3), affinities, expert_index)
    assert int(result.computed_blocks) == n > int(mapping.conditions.sum())


@pytest.mark.parametrize("flag", list(FLAGS))
def test_padding_mask_and_prescale(flag):
    num_tokens = 11
    cfg = make_config(num_experts=5, top_k=2, early_expert_affinity_modulation=True, bias=True,
                      normalize_top_k_affinities=True)
    experts = make_experts(cfg, block_size=2, seed=4, blockwise=dict(FLAGS[flag], num_static_blocks=0))
    affinities, expert_index = random_routing(num_tokens, 5, 2, seed=5)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[[0, 4, 10]] = False
    x = randn(num_tokens, 16, seed=6)
    with torch.no_grad():
        out = experts(x, affinities, expert_index, padding_mask=mask, mode="blockwise")
        result, *_, n = direct_call(experts, x, affinities, expert_index, mask)
    ref = reference_for_experts(experts, x, affinities, expert_index, keep=mask.unsqueeze(1).expand(-1, 2))
    assert_close(out, ref, FP32_ATOL)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    computed, _ = expected_schedule(expert_index, mask, 5, 2, n, 0, 2 if flag == "block" else 1)
    assert int(result.computed_blocks) == computed


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_every_activation_equals_plain_blockwise(activation):
    experts = make_experts(make_config(num_experts=4, top_k=2, activation=activation, bias=True), block_size=4,
                           seed=7, blockwise=dict(use_shard_on_block_dynamic_while=True))
    affinities, expert_index = random_routing(10, 4, 2, seed=8, skew=1.0)
    x = randn(10, 16, seed=9)
    with torch.no_grad():
        result, routing, mapping, _ = direct_call(experts, x, affinities, expert_index)
        plain = blockwise_forward(x, routing, mapping, experts.expert_weights(), "gather")
    assert_close(result.output, plain, FP32_ATOL)
    assert_close(result.output, reference_for_experts(experts, x, affinities, expert_index), FP32_ATOL)


@pytest.mark.parametrize("matmul", ["gather", pytest.param("grouped_mm", marks=pytest.mark.skipif(
    not hasattr(torch.nn.functional, "grouped_mm"), reason="torch.nn.functional.grouped_mm needs torch >= 2.10"))])
def test_bf16_and_both_static_prefix_matmuls(matmul):
    experts = make_experts(num_experts=4, top_k=2, block_size=4, dtype=torch.bfloat16, matmul=matmul, seed=10,
                           blockwise=dict(use_shard_on_intermediate_dynamic_while=True, num_static_blocks=2))
    affinities, expert_index = random_routing(12, 4, 2, seed=11)
    x = randn(12, 16, seed=12, dtype=torch.bfloat16)
    with torch.no_grad():
        out = experts(x, affinities, expert_index, mode="blockwise")
    assert out.dtype == torch.bfloat16
    assert_rounding_close(out, reference_for_experts(experts, x, affinities, expert_index),
                          rounding_tolerance(torch.bfloat16, 16, torch_roundings=TORCH_ROUNDINGS))


@pytest.mark.parametrize("pad_to_even", [False, True])
def test_odd_block_count_with_two_blocks_per_iteration(pad_to_even):
    """Worst-case routing fills every block; with an odd N the last pair repeats block N-1."""
    num_tokens, num_experts, top_k, block_size = 8, 3, 1, 2
    experts = make_experts(num_experts=num_experts, top_k=top_k, block_size=block_size, seed=13,
                           blockwise=dict(use_shard_on_block_dynamic_while=True, num_static_blocks=0,
                                          pad_num_blocks_to_even=pad_to_even))
    expert_index = torch.tensor([[0]] * 6 + [[1], [2]])  # blocks 3 + 1 + 1: every one of N = 5 active
    affinities = torch.softmax(randn(num_tokens, num_experts, seed=14), dim=-1)
    x = randn(num_tokens, 16, seed=15)
    with torch.no_grad():
        result, *_, n = direct_call(experts, x, affinities, expert_index)
    assert n == (6 if pad_to_even else 5)
    assert_close(result.output, reference_for_experts(experts, x, affinities, expert_index), FP32_ATOL)
    computed, active = expected_schedule(expert_index, None, num_experts, block_size, n, 0, 2)
    assert int(result.computed_blocks) == computed >= active


def test_works_with_autograd_enabled():
    """Parameters require grad by default; the eager loop must not care (inference without no_grad)."""
    experts = make_experts(num_experts=4, top_k=2, block_size=4, seed=16,
                           blockwise=dict(use_shard_on_intermediate_dynamic_while=True))
    affinities, expert_index = random_routing(12, 4, 2, seed=17)
    x = randn(12, 16, seed=18)
    out = experts(x, affinities, expert_index, mode="blockwise")
    assert_close(out, reference_for_experts(experts, x, affinities, expert_index), FP32_ATOL)


@pytest.mark.parametrize("router_kind", ["topk_softmax", "group_limited"])
@pytest.mark.parametrize("flag", list(FLAGS))
def test_moe_with_shared_experts_and_padding(flag, router_kind):
    experts = make_experts(make_config(num_experts=8, top_k=2), block_size=4, seed=19, blockwise=FLAGS[flag])
    moe = MoE(make_router(router_kind, 8, 2, 16, seed=20), experts, make_shared(16)).eval()
    x = randn(2, 8, 16, seed=21)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        (out, stats) = moe(x, padding_mask=mask, return_stats=True)
    assert stats.mode.value == "blockwise"
    assert_close(out, reference_for_moe(moe, x, mask), FP32_ATOL)


@given(num_tokens=st.integers(1, 24), num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
       block_size=st.integers(1, 5), static=st.one_of(st.none(), st.integers(0, 8)), flag=st.sampled_from(list(FLAGS)),
       seed=st.integers(0, 1000))
def test_property_reference_and_schedule(num_tokens, num_experts, top_k, block_size, static, flag, seed):
    top_k = min(top_k, num_experts)
    experts = make_experts(num_experts=num_experts, top_k=top_k, block_size=block_size, seed=seed,
                           blockwise=dict(FLAGS[flag], num_static_blocks=static))
    affinities, expert_index = random_routing(num_tokens, num_experts, top_k, seed=seed + 1, skew=seed % 3)
    x = randn(num_tokens, 16, seed=seed + 2)
    with torch.no_grad():
        result, *_, n = direct_call(experts, x, affinities, expert_index)
    assert_close(result.output, reference_for_experts(experts, x, affinities, expert_index), FP32_ATOL)
    s = min(-(-num_tokens * top_k // block_size) if static is None else static, n)
    computed, _ = expected_schedule(expert_index, None, num_experts, block_size, n, s, 2 if flag == "block" else 1)
    assert int(result.computed_blocks) == computed


# ----------------------------------------------------------------------------------------------------------
# one graph


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("flag", list(FLAGS))
def test_fullgraph_compile_holds_the_loop(flag, backend):
    experts = make_experts(num_experts=4, top_k=2, block_size=4, seed=22,
                           blockwise=dict(FLAGS[flag], num_static_blocks=1))
    affinities, expert_index = random_routing(12, 4, 2, seed=23, skew=2.0)
    x = randn(12, 16, seed=24)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return static_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(lambda x, a, i: experts(x, a, i, mode="blockwise"), fullgraph=True,
                                     dynamic=False, backend=capture)(x, affinities, expert_index)
            eager = experts(x, affinities, expert_index, mode="blockwise")
    finally:
        torch._dynamo.reset()
    assert_close(compiled, eager, FP32_ATOL)
    assert len(graphs) == 1
    assert any("while_loop" in str(node.target) for node in graphs[0].graph.nodes)


def test_while_loop_eager_semantics():
    """The loop helper itself: zero iterations return the inputs; the body sees the invariants."""
    limit = torch.tensor(4)

    def cond(i, acc, lim):
        return i < lim

    def body(i, acc, lim):
        return i + 1, acc + i

    assert [int(v) for v in while_loop(cond, body, (torch.tensor(0), torch.tensor(0)), (limit,))] == [4, 6]
    assert [int(v) for v in while_loop(cond, body, (torch.tensor(5), torch.tensor(7)), (limit,))] == [5, 7]


def test_while_loop_into_writes_rows_without_touching_the_buffer():
    buffer = torch.zeros(5, 2)

    def cond(i, stop):
        return i < stop

    def body(i, stop):
        return i + 1, i.view(1), torch.full((1, 2), float(i) + 1.0)

    i, out = while_loop_into(buffer, cond, body, (torch.tensor(1),), (torch.tensor(4),))
    assert int(i) == 4
    assert out[:, 0].tolist() == [0.0, 2.0, 3.0, 4.0, 0.0]
    assert torch.equal(buffer, torch.zeros(5, 2))
