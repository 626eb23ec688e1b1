"""Property tests: random small shapes and configs against the float64 dense reference.

Hypothesis draws T, E, k, H, I, the block size, the activation (GLU / GPT-OSS SwiGLU / plain MLP), biases,
normalisation, early affinity modulation, size padding and a padding mask; routing comes from seeded random
logits, sometimes skewed so a few experts take most tokens. Runs derandomized without a database (conftest).
"""

from __future__ import annotations

import torch
from conftest import (
    ACTIVATIONS,
    FP32_ATOL,
    assert_close,
    expert_count_dropped,
    expert_scales,
    make_config,
    make_experts,
    make_scaling_experts,
    randn,
    scaling_expected,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_moe.experts.routing_inputs import expert_mask as make_expert_mask
from nxd_moe.experts.token_mapping import num_blocks, token_to_block_mapping
from nxd_moe.reference import first_come_first_served, reference_for_experts


@st.composite
def cases(draw, modes=("blockwise", "selective_loading", "all_experts", "capacity_factor")):
    num_experts = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(1, 24))
    hidden = draw(st.integers(1, 12))
    inter = draw(st.integers(1, 10))
    mode = draw(st.sampled_from(modes))
    if mode == "capacity_factor" and top_k == num_experts:
        mode = "blockwise"  # every capacity factor is dropless when k == E
    activation = draw(st.sampled_from(sorted(ACTIVATIONS)))
    glu = ACTIVATIONS[activation]["glu_mlp"]
    options = dict(
        bias=draw(st.booleans()),
        normalize_top_k_affinities=draw(st.booleans()),
        early_expert_affinity_modulation=draw(st.booleans()),
        hidden_act_bias=draw(st.sampled_from([0.0, 0.5])) if glu else 0.0,
    )
    pad_hidden = draw(st.integers(0, 3))
    pad_inter = draw(st.integers(0, 3))
    if pad_hidden:
        options["hidden_size_actual"] = hidden
    if pad_inter:
        options["intermediate_size_actual"] = inter
    if mode == "capacity_factor":
        options["capacity_factor"] = draw(st.sampled_from([0.3, 0.75, 1.0])) * num_experts / top_k * 0.9
    return dict(
        mode=mode,
        num_tokens=num_tokens,
        config=make_config(num_experts=num_experts, top_k=top_k, hidden_size=hidden + pad_hidden,
                           intermediate_size=inter + pad_inter, activation=activation, **options),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64])),
        skew=draw(st.sampled_from([0.0, 0.0, 1.0, 3.0])),
        padding=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        wide_input=bool(pad_hidden) and draw(st.booleans()),
    )


def routing_for(case, dtype):
    cfg = case["config"]
    t, e, k = case["num_tokens"], cfg.num_experts, cfg.top_k
    gen = torch.Generator().manual_seed(case["seed"])
    logits = torch.randn(t, e, generator=gen, dtype=torch.float64) - case["skew"] * torch.arange(e)
    expert_index = logits.topk(k, dim=-1).indices
    affinities = torch.softmax(logits, dim=-1).to(dtype)
    mask = None
    if case["padding"]:
        mask = torch.rand(t, generator=gen) < 0.75
    return affinities, expert_index, mask


def check_case(case, dtype, matmul, atol):
    cfg = case["config"]
    experts = make_experts(cfg, block_size=case["block_size"], dtype=dtype, matmul=matmul, seed=case["seed"])
    width = cfg.hidden_size if case["wide_input"] else (cfg.hidden_size_actual or cfg.hidden_size)
    x = randn(case["num_tokens"], width, seed=case["seed"] + 1, dtype=dtype)
    if width != (cfg.hidden_size_actual or cfg.hidden_size):
        x[:, cfg.hidden_size_actual:] = 0  # a padded-width input carries zeros in the padding
    affinities, expert_index, mask = routing_for(case, dtype)
    out, stats = experts(x, affinities, expert_index, padding_mask=mask, mode=case["mode"], return_stats=True)
    assert out.shape == x.shape and out.dtype == dtype
    keep = torch.ones(expert_index.shape, dtype=torch.bool)
    if mask is not None:
        keep &= mask.unsqueeze(1)
        assert bool((out[~mask] == 0).all()), "padded tokens must output zeros"
    if case["mode"] == "capacity_factor":
        keep &= first_come_first_served(expert_index, cfg.num_experts, stats.capacity, mask)
        assert int(stats.dropped_tokens) == expert_count_dropped(expert_index, cfg.num_experts, stats.capacity, mask)
    else:
        assert int(stats.dropped_tokens) == 0
    ref = reference_for_experts(experts, x, affinities, expert_index, keep=keep)
    assert_close(out, ref, atol * max(1.0, ref.abs().max().item()), msg=str(case))


@settings(max_examples=40)
@given(cases())
def test_float64_gather_matches_reference(case):
    check_case(case, torch.float64, "gather", 1e-10)


@settings(max_examples=40)
@given(cases())
def test_fp32_auto_matches_reference(case):
    check_case(case, torch.float32, "auto", 2 * FP32_ATOL)


@settings(max_examples=25)
@given(cases(modes=("blockwise", "selective_loading")))
def test_fp32_grouped_mm_when_aligned(case):
    cfg = case["config"]
    # grouped_mm needs 16-byte rows: round H and I up to multiples of 4 (padding handles the rest)
    h = -(-cfg.hidden_size // 4) * 4
    i = -(-cfg.intermediate_size // 4) * 4
    case = dict(case, config=cfg.replace(hidden_size=h, intermediate_size=i,
                                         hidden_size_actual=cfg.hidden_size_actual or cfg.hidden_size,
                                         intermediate_size_actual=cfg.intermediate_size_actual
                                         or cfg.intermediate_size), wide_input=False)
    check_case(case, torch.float32, "grouped_mm", 2 * FP32_ATOL)


@given(
    num_experts=st.integers(1, 7),
    data=st.data(),
)
def test_dropless_scaling_experts_reconstruct_every_token(num_experts, data):
    """Expert e multiplies by (k+1)^e: each token's output names the multiset of experts it went through."""
    top_k = data.draw(st.integers(1, num_experts))
    num_tokens = data.draw(st.integers(1, 20))
    block_size = data.draw(st.sampled_from([1, 2, 5, 32]))
    mode = data.draw(st.sampled_from(["blockwise", "selective_loading", "all_experts"]))
    rows = data.draw(st.lists(st.permutations(range(num_experts)), min_size=num_tokens, max_size=num_tokens))
    expert_index = torch.tensor([r[:top_k] for r in rows], dtype=torch.long).view(num_tokens, top_k)
    weights = torch.tensor(data.draw(st.lists(st.floats(0.125, 2.0), min_size=num_tokens * top_k,
                                              max_size=num_tokens * top_k)), dtype=torch.float64)
    weights = weights.view(num_tokens, top_k)
    experts = make_scaling_experts(num_experts, 4, top_k, block_size=block_size)
    x = randn(num_tokens, 4, seed=num_tokens)
    affinities = torch.zeros(num_tokens, num_experts, dtype=torch.float64).scatter(1, expert_index, weights)
    out = experts(x.double(), affinities, expert_index, mode=mode)
    expected = scaling_expected(x, weights, expert_index, expert_scales(num_experts, top_k))
    assert_close(out, expected, 1e-12, rtol=1e-12)


@given(
    num_tokens=st.integers(1, 30),
    num_experts=st.integers(1, 9),
    block_size=st.integers(1, 9),
    data=st.data(),
)
def test_block_mapping_places_every_pair_once(num_tokens, num_experts, block_size, data):
    top_k = data.draw(st.integers(1, num_experts))
    rows = data.draw(st.lists(st.permutations(range(num_experts)), min_size=num_tokens, max_size=num_tokens))
    real = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens)))
    expert_index = torch.tensor([r[:top_k] for r in rows], dtype=torch.long).view(num_tokens, top_k)
    n = num_blocks(num_tokens, top_k, num_experts, block_size, pad_to_even=data.draw(st.booleans()))
    mask = make_expert_mask(expert_index, num_experts) & real.unsqueeze(1)
    mapping = token_to_block_mapping(mask, expert_index, block_size, n, optimized=data.draw(st.booleans()))
    positions = mapping.token_position_to_id.tolist()
    b2e = mapping.block_to_expert.tolist()
    placed = sorted((t, b2e[s // block_size]) for s, t in enumerate(positions) if t != -1)
    expected = sorted((t, e) for t in range(num_tokens) if real[t] for e in expert_index[t].tolist())
    assert placed == expected
    assert b2e == sorted(b2e)
    active = int(mapping.conditions.sum())
    assert mapping.conditions.tolist() == [1] * active + [0] * (n - active)


def test_profile_is_derandomized():
    """The CI profile is reproducible: derandomized, no example database."""
    current = settings()
    assert current.derandomize and current.database is None
