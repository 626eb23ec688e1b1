"""The token -> block mapping of the dropless blockwise matmul, and the block count N."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from nxd_moe.experts.routing_inputs import expert_mask as make_expert_mask
from nxd_moe.experts.token_mapping import block_conditions, num_blocks, num_static_blocks, token_to_block_mapping


def naive_mapping(expert_index, num_experts, block_size, n_blocks, token_is_real=None):
    """The layout built the obvious way, in Python: each expert in order gets ceil(tokens / B) blocks holding
    its tokens in token order; blocks left over go to the last expert and hold only padding."""
    index = expert_index.tolist()
    num_tokens = len(index)
    real = [True] * num_tokens if token_is_real is None else [bool(r) for r in token_is_real]
    block_to_expert, positions, token_slot = [], [], {}
    per_expert = []
    for e in range(num_experts):
        tokens = [t for t in range(num_tokens) if real[t] and e in index[t]]
        per_expert.append(len(tokens))
        blocks = -(-len(tokens) // block_size)
        for b in range(blocks):
            chunk = tokens[b * block_size:(b + 1) * block_size]
            for i, t in enumerate(chunk):
                token_slot[(t, e)] = len(positions) + i
            positions += chunk + [-1] * (block_size - len(chunk))
            block_to_expert.append(e)
    used = len(block_to_expert)
    assert used <= n_blocks, "N is too small for this routing"
    block_to_expert += [num_experts - 1] * (n_blocks - used)
    positions += [-1] * ((n_blocks - used) * block_size)
    conditions = [1] * used + [0] * (n_blocks - used)
    slots = [[token_slot.get((t, e), n_blocks * block_size) for e in row] for t, row in enumerate(index)]
    return block_to_expert, positions, conditions, slots, per_expert


def mapping_for(expert_index, num_experts, block_size, n_blocks=None, optimized=True, token_is_real=None):
    num_tokens, top_k = expert_index.shape
    if n_blocks is None:
        n_blocks = num_blocks(num_tokens, top_k, num_experts, block_size)
    mask = make_expert_mask(expert_index, num_experts)
    if token_is_real is not None:
        mask = mask & token_is_real.reshape(-1, 1)
    return token_to_block_mapping(mask, expert_index, block_size, n_blocks, optimized=optimized)


def random_index(num_tokens, num_experts, top_k, rng, hot=None):
    rows = []
    for _ in range(num_tokens):
        if hot is not None and rng.random() < 0.8:
            experts = list(hot[:top_k])
            rng.shuffle(experts)
            rows.append(experts)
        else:
            rows.append(rng.sample(range(num_experts), top_k))
    return torch.tensor(rows, dtype=torch.long).view(num_tokens, top_k)


# ----------------------------------------------------------------------------------------------------------
# worked examples


@pytest.mark.parametrize("optimized", [True, False])
def test_nxd_worked_example(optimized):
    """Tokens 0,2,4 -> E0; 1,5 -> E1; 3 -> E2; B=2, N=4 (NxD's docstring and unit test)."""
    expert_index = torch.tensor([[0], [1], [0], [2], [0], [1]])
    assert num_blocks(6, 1, 3, 2) == 4
    mapping = mapping_for(expert_index, 3, 2, 4, optimized=optimized)
    assert mapping.block_to_expert.tolist() == [0, 0, 1, 2]
    assert mapping.token_position_to_id.tolist() == [0, 2, 4, -1, 1, 5, 3, -1]
    assert mapping.conditions.tolist() == [1, 1, 1, 1]
    assert mapping.conditions.dtype == torch.int32
    assert mapping.token_slot.tolist() == [[0], [4], [1], [6], [2], [5]]
    assert mapping.tokens_per_expert.tolist() == [3, 2, 1]
    assert mapping.num_blocks == 4 and mapping.block_size == 2


@pytest.mark.parametrize("optimized", [True, False])
def test_deep_dive_example(optimized):
    """Assignments [E0, E1, E0, E2, E1, E0], block size 4 -> [T0 T2 T5 -] [T1 T4 - -] [T3 - - -]."""
    expert_index = torch.tensor([[0], [1], [0], [2], [1], [0]])
    mapping = mapping_for(expert_index, 3, 4, optimized=optimized)
    assert mapping.num_blocks == 3
    assert mapping.block_to_expert.tolist() == [0, 1, 2]
    assert mapping.token_position_to_id.tolist() == [0, 2, 5, -1, 1, 4, -1, -1, 3, -1, -1, -1]
    assert mapping.conditions.tolist() == [1, 1, 1]


@pytest.mark.parametrize("optimized", [True, False])
def test_empty_experts_and_tail_blocks(optimized):
    # E1 and E3 get nothing; E4 (the last) gets nothing but owns the unused tail blocks
    expert_index = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]])
    mapping = mapping_for(expert_index, 5, 2, optimized=optimized)
    n = num_blocks(5, 2, 5, 2)
    assert n == math.ceil((10 - 4) / 2) + 4 == 7
    assert mapping.block_to_expert.tolist() == [0, 0, 0, 2, 2, 2, 4]
    assert mapping.token_position_to_id.tolist() == [0, 1, 2, 3, 4, -1, 0, 1, 2, 3, 4, -1, -1, -1]
    assert mapping.conditions.tolist() == [1, 1, 1, 1, 1, 1, 0]


# ----------------------------------------------------------------------------------------------------------
# N


def test_num_blocks_deep_dive_example():
    # 1000 tokens, 8 experts, top-2, block 256: 15 blocks, by NxD's formula and the docs' looser one
    assert num_blocks(1000, 2, 8, 256) == 15
    assert math.ceil((1000 * 2 - 7) / 256) + 7 == 15
    assert math.ceil(1000 * 2 / 256) + 8 - 1 == 15


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_size, expected",
    [
        (1, 1, 1, 1, 1),
        (1, 2, 8, 4, 2),  # T*k < E-1: every assignment its own block, capped at T*k
        (3, 2, 8, 4, 6),  # T*k = 6 < 7 = E-1
        (7, 1, 8, 4, 7),  # T*k = E-1
        (8, 1, 8, 4, 8),  # T*k = E: one block each
        (9, 1, 8, 4, 8),  # 7 experts x 1 token + 2 tokens in one block
        (12, 1, 8, 4, 9),  # 7 x 1 + 5 tokens in two blocks
        (6, 1, 3, 2, 4),
        (100, 4, 16, 512, 16),  # ceil((400-15)/512) + 15
        (4096, 8, 128, 512, 191),  # ceil((32768-127)/512) + 127 = 64 + 127
        (5, 3, 3, 100, 3),
    ],
)
def test_num_blocks_formula(num_tokens, top_k, num_experts, block_size, expected):
    a = num_tokens * top_k
    formula = min(math.ceil((a - (num_experts - 1)) / block_size) + (num_experts - 1), a)
    assert formula == expected
    assert num_blocks(num_tokens, top_k, num_experts, block_size) == formula


def test_num_blocks_pad_to_even():
    assert num_blocks(6, 1, 3, 2) == 4
    assert num_blocks(6, 1, 3, 2, pad_to_even=True) == 4
    assert num_blocks(6, 1, 3, 4) == 3
    assert num_blocks(6, 1, 3, 4, pad_to_even=True) == 4
    assert num_blocks(1, 1, 1, 1, pad_to_even=True) == 2


def _worst_case_blocks(num_tokens, top_k, num_experts, block_size):
    """Most blocks any routing can need: max over per-expert counts c_e <= T with sum T*k."""
    best = 0
    for counts in itertools.product(range(num_tokens + 1), repeat=num_experts):
        if sum(counts) == num_tokens * top_k:
            best = max(best, sum(-(-c // block_size) for c in counts))
    return best


@pytest.mark.parametrize("num_experts", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
def test_num_blocks_covers_every_routing(num_experts, block_size):
    """N is never below what some routing needs, and is exact for top-1 (where one expert can take all)."""
    for num_tokens in range(1, 7):
        for top_k in range(1, num_experts + 1):
            worst = _worst_case_blocks(num_tokens, top_k, num_experts, block_size)
            n = num_blocks(num_tokens, top_k, num_experts, block_size)
            assert n >= worst, (num_tokens, top_k, num_experts, block_size)
            if top_k == 1:
                assert n == worst, (num_tokens, num_experts, block_size)


def test_num_static_blocks():
    assert num_static_blocks(1000, 2, 256) == 8
    assert num_static_blocks(1000, 2, 256, expert_parallel_size=4) == 2
    assert num_static_blocks(1, 1, 512) == 1
    # a shape: an int, also where T*k does not divide among the ranks (ceil(9 / 2) = 5 per rank -> 1 block of 5)
    assert type(num_static_blocks(9, 1, 5, expert_parallel_size=2)) is int
    assert num_static_blocks(9, 1, 5, expert_parallel_size=2) == 1


@pytest.mark.parametrize("arguments, name", [((0, 1, 2, 4), "num_tokens"), ((4, 0, 2, 4), "top_k"),
                                             ((4, 1, 0, 4), "num_experts"), ((4, 1, 2, 0), "block_size")])
def test_num_blocks_rejects_bad_arguments(arguments, name):
    """Each size below 1 is refused with its own name first in the message (the other three are valid)."""
    with pytest.raises(ValueError, match=rf"^{name} must be in \[1, inf\], got 0$"):
        num_blocks(*arguments)
    with pytest.raises(TypeError, match=rf"^{name}\b"):
        num_blocks(*[1.0 if a == 0 else a for a in arguments])


def test_mapping_tensors_live_on_the_mask_device():
    """Every tensor of the mapping is made on the mask's device (the meta device here: a CPU tensor among them would
    be an error, as it would on a GPU or under XLA), with the dtypes of the CPU mapping."""
    expert_index = torch.tensor([[0], [1], [0], [2], [0], [1]])
    mask = make_expert_mask(expert_index, 3)
    meta = token_to_block_mapping(mask.to("meta"), expert_index.to("meta"), 2, 4)
    cpu = token_to_block_mapping(mask, expert_index, 2, 4)
    assert [(t.device.type, t.dtype, t.shape) for t in meta[:5]] == [("meta", t.dtype, t.shape) for t in cpu[:5]]


# ----------------------------------------------------------------------------------------------------------
# invariants over random routings, and equality with the naive construction


def check_invariants(mapping, expert_index, num_experts, block_size, token_is_real=None):
    num_tokens, top_k = expert_index.shape
    n = mapping.num_blocks
    b2e = mapping.block_to_expert.tolist()
    positions = mapping.token_position_to_id.tolist()
    conditions = mapping.conditions.tolist()
    assert len(positions) == n * block_size and len(conditions) == n
    real = [True] * num_tokens if token_is_real is None else token_is_real.tolist()
    # every real (token, expert) pair appears exactly once, in a block of that expert; nothing else appears
    seen = {}
    for slot, t in enumerate(positions):
        if t == -1:
            continue
        e = b2e[slot // block_size]
        assert (t, e) not in seen, f"pair {(t, e)} appears twice"
        seen[(t, e)] = slot
    expected_pairs = {(t, int(e)) for t in range(num_tokens) if real[t] for e in expert_index[t].tolist()}
    assert set(seen) == expected_pairs
    # block_to_expert non-decreasing, within range
    assert all(a <= b for a, b in zip(b2e, b2e[1:]))
    assert all(0 <= e < num_experts for e in b2e)
    # conditions marks exactly the blocks with a real token, and those are a prefix (padding blocks last)
    has_token = [int(any(p != -1 for p in positions[i * block_size:(i + 1) * block_size])) for i in range(n)]
    assert conditions == has_token
    active = sum(conditions)
    assert conditions == [1] * active + [0] * (n - active)
    # blocks past the active prefix belong to the last expert
    assert all(e == num_experts - 1 for e in b2e[active:])
    # within a block, real tokens first and in increasing order
    for i in range(n):
        block = positions[i * block_size:(i + 1) * block_size]
        tokens = [p for p in block if p != -1]
        assert block[:len(tokens)] == tokens and tokens == sorted(tokens)
    # token_slot agrees with token_position_to_id
    slots = mapping.token_slot.tolist()
    for t in range(num_tokens):
        for j, e in enumerate(expert_index[t].tolist()):
            if real[t]:
                assert positions[slots[t][j]] == t and b2e[slots[t][j] // block_size] == e
            else:
                assert slots[t][j] == n * block_size


@pytest.mark.parametrize("optimized", [True, False])
@pytest.mark.parametrize("case", range(40))
def test_random_routings_invariants_and_naive_equality(case, optimized):
    rng = random.Random(1000 + case)
    num_experts = rng.randint(1, 9)
    top_k = rng.randint(1, num_experts)
    num_tokens = rng.randint(1, 40)
    block_size = rng.choice([1, 2, 3, 4, 7, 16, 64])
    hot = rng.sample(range(num_experts), num_experts) if case % 3 == 0 else None
    expert_index = random_index(num_tokens, num_experts, top_k, rng, hot)
    token_is_real = None
    if case % 4 == 1:
        token_is_real = torch.tensor([rng.random() < 0.7 for _ in range(num_tokens)])
    pad_even = case % 5 == 2
    n = num_blocks(num_tokens, top_k, num_experts, block_size, pad_to_even=pad_even)
    mapping = mapping_for(expert_index, num_experts, block_size, n, optimized, token_is_real)
    check_invariants(mapping, expert_index, num_experts, block_size, token_is_real)
    b2e, positions, conditions, slots, per_expert = naive_mapping(expert_index, num_experts, block_size, n,
                                                                  token_is_real)
    assert mapping.block_to_expert.tolist() == b2e
    assert mapping.token_position_to_id.tolist() == positions
    assert mapping.conditions.tolist() == conditions
    assert mapping.token_slot.tolist() == slots
    assert mapping.tokens_per_expert.tolist() == per_expert


@pytest.mark.parametrize("optimized", [True, False])
def test_worst_case_routing_fills_every_block(optimized):
    """E-1 experts get one token each and the rest go to one expert: all N blocks are needed."""
    num_experts, block_size, num_tokens = 8, 4, 30
    rows = [[e] for e in range(num_experts - 1)] + [[num_experts - 1]] * (num_tokens - (num_experts - 1))
    expert_index = torch.tensor(rows)
    mapping = mapping_for(expert_index, num_experts, block_size, optimized=optimized)
    assert mapping.num_blocks == math.ceil((30 - 7) / 4) + 7 == 13
    assert mapping.conditions.tolist() == [1] * 13
    check_invariants(mapping, expert_index, num_experts, block_size)


def test_all_tokens_one_expert_and_block_size_one():
    expert_index = torch.full((5, 1), 2)
    mapping = mapping_for(expert_index, 4, 1)
    assert mapping.num_blocks == 5  # min(ceil((5-3)/1)+3, 5)
    assert mapping.block_to_expert.tolist() == [2, 2, 2, 2, 2]
    assert mapping.token_position_to_id.tolist() == [0, 1, 2, 3, 4]
    check_invariants(mapping, expert_index, 4, 1)


def test_block_conditions_helper():
    positions = torch.tensor([3, -1, -1, -1, -1, -1, 0, 5])
    assert block_conditions(positions, 2).tolist() == [1, 0, 0, 1]
    assert block_conditions(positions, 4).tolist() == [1, 1]
