"""The experts' settings and small pieces: capacity, mode selection, pair runs, the activation, routing inputs.

References are written from the definitions (NxD's capacity formula, first come first served, the mode rules of
``select_mode``'s docstring) in float64 Python loops, never with the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import ExpertsBackend, TorchBackend
from nxd_moe.experts.capacity import admit, capacity_factor_forward, expert_capacity
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import NXD_POLICY, ExpertsMode, ModePolicy, select_mode
from nxd_moe.experts.pairs import ExpertsRun, experts_forward_pairs, run_experts
from nxd_moe.experts.routing_inputs import Routing, build_routing, expert_mask
from nxd_moe.moe_configs import BlockwiseMatmulConfig, GLUType, RoutedExpertsMLPOpsConfig

T, H, INTER, E = 7, 3, 4, 3


# ---------------------------------------------------------------- capacity

@pytest.mark.parametrize("tokens, top_k, experts, factor, expected", [
    (10, 2, 8, 1.0, 3),    # ceil(20 / 8) = ceil(2.5)
    (10, 2, 8, 1.3, 4),    # ceil(26 / 8) = ceil(3.25): rounds up, not to nearest
    (12, 2, 8, 2.0, 6),    # 48 / 8 exactly
    (5, 4, 2, 3.0, 5),     # ceil(30) capped at T = 5
    (1, 1, 16, 0.5, 1),    # ceil(1/32) = 1, the smallest T
    (9, 3, 27, 1.0, 1),    # exactly 1
])
def test_expert_capacity_is_nxds_formula(tokens, top_k, experts, factor, expected):
    assert expert_capacity(tokens, top_k, experts, factor) == expected


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_tokens=0), ValueError, "num_tokens must be in [1, inf], got 0"),
    (dict(num_tokens=True), TypeError, "num_tokens must be an int"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be > 0"),
    (dict(capacity_factor=-1.5), ValueError, "capacity_factor must be > 0"),
    (dict(capacity_factor="2"), TypeError, "capacity_factor must be a number"),
])
def test_expert_capacity_checks_its_arguments(kwargs, error, words):
    args = dict(num_tokens=4, top_k=2, num_experts=4, capacity_factor=1.0) | kwargs
    with pytest.raises(error) as info:
        expert_capacity(**args)
    assert words in str(info.value)


def admitted_by_hand(mask: list[list[bool]], capacity: int):
    seen = [0] * len(mask[0])
    kept, rank = [], []
    for row in mask:
        kept.append([]), rank.append([])
        for e, chosen in enumerate(row):
            seen[e] += chosen
            rank[-1].append(seen[e] - 1)
            kept[-1].append(chosen and seen[e] <= capacity)
    dropped = sum(c and not k for r, kr in zip(mask, kept) for c, k in zip(r, kr))
    return kept, rank, dropped


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_admit_is_first_come_first_served(capacity):
    mask = [[True, False, True], [True, True, False], [False, True, True], [True, False, True],
            [False, False, False], [True, True, False]]
    kept, rank, dropped = admit(torch.tensor(mask), capacity)
    want_kept, want_rank, want_dropped = admitted_by_hand(mask, capacity)
    assert kept.dtype == torch.bool and kept.tolist() == want_kept
    assert rank.dtype == torch.int64 and rank.tolist() == want_rank
    assert dropped.dtype == torch.int64 and dropped.shape == () and dropped.item() == want_dropped
    assert want_dropped > 0 or capacity == 3


def expert_weights(seed: int, dtype=torch.float64, act: ExpertActivation | None = None) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    act = act or ExpertActivation("silu", glu_mlp=True, glu_type=GLUType.GLU)
    return ExpertWeights(torch.randn(E, H, 2 * INTER, generator=g, dtype=dtype),
                         torch.randn(E, INTER, H, generator=g, dtype=dtype),
                         torch.randn(E, 2 * INTER, generator=g, dtype=dtype),
                         torch.randn(E, H, generator=g, dtype=dtype), act)


def mlp_by_hand(x: torch.Tensor, w: ExpertWeights, e: int) -> torch.Tensor:
    """One row through expert e, float64: silu GLU from the definition."""
    h = x.double() @ w.gate_up_proj[e].double() + w.gate_up_bias[e].double()
    gate, up = h[:INTER], h[INTER:]
    return (gate * torch.sigmoid(gate) * up) @ w.down_proj[e].double() + w.down_bias[e].double()


def routing_of(index: list[list[int]], affinity: torch.Tensor, prescale: bool, padded=()) -> Routing:
    mask = torch.zeros(len(index), E, dtype=torch.bool)
    for t, row in enumerate(index):
        if t not in padded:
            mask[t, row] = True
    return Routing(torch.tensor(index), mask, torch.where(mask, affinity, 0.0), prescale, bool(padded))


INDEX = [[0, 1], [1, 0], [0, 2], [2, 0], [0, 1], [1, 2], [0, 2]]


@pytest.mark.parametrize("prescale", [False, True])
@pytest.mark.parametrize("capacity", [1, 2, 3, 5])
def test_capacity_factor_forward_keeps_the_first_tokens_of_each_expert(capacity, prescale):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    affinity = torch.rand(T, E, generator=g, dtype=torch.float64) + 0.25
    padded = (1,)  # a padded token takes no capacity
    routing = routing_of(INDEX, affinity, prescale, padded)
    w = expert_weights(4)
    out, dropped = capacity_factor_forward(x, routing, capacity, w)

    want = torch.zeros(T, H, dtype=torch.float64)
    seen, want_dropped = [0] * E, 0
    for t, row in enumerate(INDEX):
        for e in row:
            if t in padded:
                continue
            seen[e] += 1
            if seen[e] > capacity:
                want_dropped += 1
                continue
            a = affinity[t, e].item()
            want[t] += mlp_by_hand(a * x[t], w, e) if prescale else a * mlp_by_hand(x[t], w, e)
    assert out.dtype == torch.float64 and out.shape == (T, H)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert dropped.dtype == torch.int64 and dropped.item() == want_dropped
    assert (want_dropped > 0) == (capacity < 5)


def test_capacity_factor_forward_in_bfloat16_reads_zero_rows_for_empty_slots():
    """Empty slots and dropped pairs read the zero row: a NaN/inf in no admitted row cannot leak in."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    affinity = torch.rand(T, E, generator=g) + 0.25
    routing = routing_of(INDEX, affinity, False, padded=(6,))
    x[6] = float("nan")  # padded: read by nothing
    w = expert_weights(6, torch.bfloat16)
    out, dropped = capacity_factor_forward(x, routing, 2, w)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert out[6].abs().max().item() == 0.0
    want_first = affinity[0, 0] * mlp_by_hand(x[0], w, 0) + affinity[0, 1] * mlp_by_hand(x[0], w, 1)
    torch.testing.assert_close(out[0].double(), want_first, rtol=0.05, atol=0.05)


def test_capacity_factor_prescale_multiplies_bfloat16_rows_by_float32_affinities_in_bfloat16():
    """The affinity is cast to the rows' dtype: bf16 rows times fp32 affinities stay bf16 for the bf16 weights."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    affinity = torch.rand(T, E, generator=g) + 0.25
    routing = routing_of(INDEX, affinity, True)
    w = expert_weights(8, torch.bfloat16)
    out, _ = capacity_factor_forward(x, routing, 5, w)
    assert out.dtype == torch.bfloat16
    want = sum(mlp_by_hand(affinity[2, e].item() * x[2].double(), w, e) for e in INDEX[2])
    torch.testing.assert_close(out[2].double(), want, rtol=0.05, atol=0.1)


@pytest.mark.parametrize("prescale", [False, True])
def test_capacity_factor_forward_makes_every_tensor_on_the_inputs_device(prescale):
    """On the meta device (shapes only, no CPU/GPU needed): a tensor made on the default device would not mix."""
    meta = torch.device("meta")
    routing = routing_of(INDEX, torch.rand(T, E, dtype=torch.float64), prescale)
    routing = Routing(*(t.to(meta) for t in routing[:3]), prescale)
    w = ExpertWeights(*(t.to(meta) for t in expert_weights(9)[:4]), expert_weights(9).activation)
    out, dropped = capacity_factor_forward(torch.zeros(T, H, dtype=torch.float64, device=meta), routing, 2, w)
    assert out.device == meta and out.shape == (T, H) and out.dtype == torch.float64
    assert dropped.device == meta and dropped.dtype == torch.int64


# ---------------------------------------------------------------- mode

def test_experts_mode_values_and_policy_defaults():
    assert [m.value for m in ExpertsMode] == ["blockwise", "capacity_factor", "selective_loading", "all_experts"]
    assert ExpertsMode("capacity_factor") is ExpertsMode.CAPACITY_FACTOR
    assert NXD_POLICY == ModePolicy(all_experts=True, pairs_up_to=0, pairs_always=False)
    assert (NXD_POLICY.all_experts, NXD_POLICY.pairs_up_to, NXD_POLICY.pairs_always) == (True, 0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NXD_POLICY.pairs_up_to = 3
    assert ModePolicy(pairs_up_to=0).pairs_up_to == 0  # the minimum is allowed


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(all_experts=0), TypeError, "ModePolicy.all_experts must be a bool"),
    (dict(pairs_always=1), TypeError, "ModePolicy.pairs_always must be a bool"),
    (dict(pairs_up_to=-1), ValueError, "ModePolicy.pairs_up_to must be in [0, inf], got -1"),
    (dict(pairs_up_to=True), TypeError, "ModePolicy.pairs_up_to must be an int"),
])
def test_mode_policy_checks_each_field_by_name(kwargs, error, words):
    with pytest.raises(error) as info:
        ModePolicy(**kwargs)
    assert words in str(info.value)


A, B, C, S = ExpertsMode.ALL_EXPERTS, ExpertsMode.BLOCKWISE, ExpertsMode.CAPACITY_FACTOR, ExpertsMode.SELECTIVE_LOADING


@pytest.mark.parametrize("tokens, seq_len, top_k, experts, block, cf, alpha, policy, expected", [
    # decode: all experts once T*k >= alpha*E (boundary included), else selective loading
    (8, 1, 2, 16, 512, None, 1.0, NXD_POLICY, A),               # 16 == 16
    (5, 1, 3, 16, 512, None, 1.0, NXD_POLICY, S),               # 15 < 16
    (8, 1, 2, 16, 512, None, 0.5, NXD_POLICY, A),               # 16 >= 8
    (8, 1, 2, 16, 512, None, 1.5, NXD_POLICY, S),               # 16 < 24
    (12, 1, 2, 16, 512, None, 1.5, NXD_POLICY, A),              # 24 == 24
    (8, 1, 2, 16, 512, None, 1.0, ModePolicy(all_experts=False), S),
    (8, 1, 2, 16, 512, 2.0, 1.0, NXD_POLICY, A),                # a decode ignores the capacity factor
    (5, 1, 3, 16, 512, 2.0, 1.0, NXD_POLICY, S),
    (8, 1, 2, 16, 512, 2.0, 1.0, ModePolicy(pairs_always=True), A),  # pairs_always: dropless only
    (8, 1, 2, 16, 512, None, 1.0, ModePolicy(pairs_always=True), S),
    # prefill with a capacity factor
    (2, 2, 2, 16, 512, 1.5, 1.0, NXD_POLICY, C),                # few pairs still drop
    (300, None, 2, 16, 512, 0.5, 1.0, NXD_POLICY, C),
    (300, 4, 2, 16, 512, 1.0, 1.0, ModePolicy(pairs_always=True), C),
    # dropless prefill
    (5, 7, 3, 16, 512, None, 1.0, NXD_POLICY, S),               # 15 < 16
    (8, 7, 2, 16, 512, None, 1.0, NXD_POLICY, A),               # 16 < 512
    (255, None, 2, 16, 512, None, 1.0, NXD_POLICY, A),          # 510 < 512
    (256, None, 2, 16, 512, None, 1.0, NXD_POLICY, B),          # 512 == block
    (8, 7, 2, 16, 512, None, 1.0, ModePolicy(all_experts=False), B),
    (8, 7, 2, 16, 16, None, 1.0, NXD_POLICY, B),                # 16 == block
    (100, 7, 2, 16, 64, None, 1.0, ModePolicy(pairs_up_to=200), S),   # 200 <= 200
    (101, 7, 2, 16, 64, None, 1.0, ModePolicy(pairs_up_to=200), B),   # 202 > 200
    (101, 7, 2, 16, 512, None, 1.0, ModePolicy(pairs_up_to=200), A),
    (900, 7, 2, 16, 64, None, 1.0, ModePolicy(pairs_always=True), S),
    (20, 7, 2, 16, 512, None, 2.5, NXD_POLICY, A),              # 40 == 2.5 * 16: not few
    (19, 7, 2, 16, 512, None, 2.5, NXD_POLICY, S),              # 38 < 40
])
def test_select_mode_rules_at_their_boundaries(tokens, seq_len, top_k, experts, block, cf, alpha, policy, expected):
    assert select_mode(tokens, seq_len, top_k, experts, block, cf, alpha, policy) is expected
    assert select_mode(tokens, seq_len, top_k, experts, block, cf, selective_loading_threshold=alpha,
                       policy=policy) is expected


def test_select_mode_defaults_are_alpha_one_and_nxds_policy():
    assert select_mode(8, 1, 2, 16, 512, None) is A        # 16 >= 1.0 * 16
    assert select_mode(5, 1, 3, 16, 512, None) is S        # 15 < 16
    assert select_mode(8, 9, 2, 16, 512, None) is A        # NXD_POLICY.all_experts
    assert select_mode(5, 9, 3, 16, 512, None) is S
    assert select_mode(300, 9, 2, 16, 512, None) is B      # pairs_always off


# ---------------------------------------------------------------- activation

def sigmoid64(v):
    return 1.0 / (1.0 + torch.exp(-v.double()))


def test_activation_from_config_takes_every_field():
    config = RoutedExpertsMLPOpsConfig(
        num_experts=4, hidden_size=8, intermediate_size=6, top_k=2, hidden_act="sigmoid", glu_mlp=True,
        glu_type=GLUType.SWIGLU, hidden_act_scaling_factor=1.702, hidden_act_bias=0.75,
        intermediate_size_actual=5, gate_clamp_upper_limit=7.5, gate_clamp_lower_limit=-6.5,
        up_clamp_upper_limit=5.25, up_clamp_lower_limit=-4.25)
    act = ExpertActivation.from_config(config)
    assert act == ExpertActivation(hidden_act="sigmoid", glu_mlp=True, glu_type=GLUType.SWIGLU,
                                   scaling_factor=1.702, act_bias=0.75, gate_lower=-6.5, gate_upper=7.5,
                                   up_lower=-4.25, up_upper=5.25, intermediate_size=6, intermediate_size_actual=5,
                                   gate_up_interleaved=False)
    plain = ExpertActivation.from_config(RoutedExpertsMLPOpsConfig(
        num_experts=4, hidden_size=8, intermediate_size=6, top_k=2, hidden_act="relu", glu_mlp=False))
    assert (plain.hidden_act, plain.glu_mlp, plain.glu_type, plain.scaling_factor, plain.act_bias) == \
        ("relu", False, GLUType.GLU, 1.0, 0.0)


def test_activation_defaults():
    act = ExpertActivation("silu", True, GLUType.GLU)
    assert (act.scaling_factor, act.act_bias, act.gate_lower, act.gate_upper, act.up_lower, act.up_upper,
            act.intermediate_size, act.intermediate_size_actual, act.gate_up_interleaved) == \
        (1.0, 0.0, None, None, None, None, None, None, False)


PROJECTED = torch.tensor([[-9.0, -1.5, 0.5, 3.0, 8.0, -7.0, 2.0, -0.25],
                          [6.0, -0.5, -3.0, 9.5, -8.5, 1.0, 0.75, 4.5]], dtype=torch.float64)


def glu_by_hand(gate, up, swiglu, s=1.0, b=0.0, clamp_gate=(None, None), clamp_up=(None, None)):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    for idx in range(gate.numel()):
        g, u = gate.view(-1)[idx].item(), up.view(-1)[idx].item()
        if clamp_gate[0] is not None:
            g = max(g, clamp_gate[0])
        if clamp_gate[1] is not None:
            g = min(g, clamp_gate[1])
        if clamp_up[0] is not None:
            u = max(u, clamp_up[0])
        if clamp_up[1] is not None:
            u = min(u, clamp_up[1])
        a = 1.0 / (1.0 + math.exp(-s * g))
        out.view(-1)[idx] = (g * a if swiglu else a) * (u + b)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_glu_from_the_definition(swiglu, interleaved):
    kind = GLUType.SWIGLU if swiglu else GLUType.GLU
    gate, up = (PROJECTED[:, 0::2], PROJECTED[:, 1::2]) if interleaved else (PROJECTED[:, :4], PROJECTED[:, 4:])
    act = ExpertActivation("sigmoid", True, kind, gate_up_interleaved=interleaved)
    torch.testing.assert_close(act(PROJECTED), glu_by_hand(gate, up, swiglu), rtol=1e-12, atol=1e-12)
    knobs = ExpertActivation("sigmoid", True, kind, scaling_factor=1.702, act_bias=0.75,
                             gate_up_interleaved=interleaved)
    torch.testing.assert_close(knobs(PROJECTED), glu_by_hand(gate, up, swiglu, 1.702, 0.75), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("clamp_gate, clamp_up", [
    ((-2.0, None), (None, None)), ((None, 2.5), (None, None)), ((None, None), (-1.0, None)),
    ((None, None), (None, 3.5)), ((-2.0, 2.5), (-1.0, 3.5)), ((0.0, 0.0), (None, None)),
])
def test_glu_clamps_each_limit_alone(clamp_gate, clamp_up):
    gate, up = PROJECTED[:, :4], PROJECTED[:, 4:]
    act = ExpertActivation("sigmoid", True, GLUType.SWIGLU, gate_lower=clamp_gate[0], gate_upper=clamp_gate[1],
                           up_lower=clamp_up[0], up_upper=clamp_up[1])
    want = glu_by_hand(gate, up, True, clamp_gate=clamp_gate, clamp_up=clamp_up)
    torch.testing.assert_close(act(PROJECTED), want, rtol=1e-12, atol=1e-12)


def test_non_glu_and_padding_columns():
    relu = ExpertActivation("relu", False, GLUType.GLU)
    torch.testing.assert_close(relu(PROJECTED), PROJECTED.clamp(min=0.0), rtol=0, atol=0)
    padded = ExpertActivation("sigmoid", False, GLUType.GLU, intermediate_size_actual=5)
    want = sigmoid64(PROJECTED)
    want[:, 5:] = 0.0
    torch.testing.assert_close(padded(PROJECTED), want, rtol=1e-12, atol=1e-12)
    full = ExpertActivation("sigmoid", False, GLUType.GLU, intermediate_size_actual=8)
    torch.testing.assert_close(full(PROJECTED), sigmoid64(PROJECTED), rtol=1e-12, atol=1e-12)
    rank_dependent = ExpertActivation("sigmoid", False, GLUType.GLU, intermediate_size_actual=torch.tensor(3))
    want = sigmoid64(PROJECTED)
    want[:, 3:] = 0.0
    out = rank_dependent(PROJECTED)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # GLU padding: act(0) * (0 + b) is not zero, the padded columns are
    glu = ExpertActivation("sigmoid", True, GLUType.GLU, act_bias=1.0, intermediate_size_actual=2)
    want = glu_by_hand(PROJECTED[:, :4], PROJECTED[:, 4:], False, b=1.0)
    want[:, 2:] = 0.0
    torch.testing.assert_close(glu(PROJECTED), want, rtol=1e-12, atol=1e-12)
    bf16 = padded(PROJECTED.to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16 and bf16[:, 5:].abs().max().item() == 0.0


# ---------------------------------------------------------------- routing inputs

def test_expert_mask_is_k_hot():
    index = torch.tensor([[2, 0], [1, 3], [3, 2]])
    mask = expert_mask(index, 5)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, False, True, False, False], [False, True, False, True, False],
                             [False, False, True, True, False]]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_build_routing_masks_normalises_and_pads(normalize, padding):
    affinities = torch.tensor([[0.5, 0.25, 0.125, 2.0], [1.0, 3.0, 0.5, 0.75], [0.25, 0.5, 4.0, 1.5]],
                              dtype=torch.float64)
    index = torch.tensor([[3, 1], [1, 2], [2, 0]])
    pad = torch.tensor([True, False, True]) if padding else None
    prescale = normalize  # a distinct value in each run
    routing = build_routing(affinities, index, 4, normalize, prescale, pad)
    want_mask = [[False, True, False, True], [False, True, True, False], [True, False, True, False]]
    if padding:
        want_mask[1] = [False] * 4
    want = [[affinities[t, e].item() if want_mask[t][e] else 0.0 for e in range(4)] for t in range(3)]
    if normalize:
        want = [[v / sum(row) if sum(row) else 0.0 for v in row] for row in want]
    assert routing.expert_mask.tolist() == want_mask
    assert routing.expert_index is index and routing.prescale is prescale and routing.has_padding is padding
    assert routing.affinities.dtype == torch.float64
    torch.testing.assert_close(routing.affinities, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def test_routing_pair_weights_and_validity():
    affinities = torch.tensor([[0.0, 0.75, 0.0, 0.25], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False, True], [False, False, False, False]])
    index = torch.tensor([[3, 1], [0, 2]])
    routing = Routing(index, mask, affinities, False)
    assert routing.has_padding is False
    assert routing.pair_valid().tolist() == [[True, True], [False, False]]
    assert routing.pair_weights().tolist() == [[0.25, 0.75], [0.0, 0.0]]
    pre = routing._replace(prescale=True).pair_weights()
    assert pre.dtype == torch.float64 and pre.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    half = Routing(index, mask, affinities.half(), True).pair_weights()
    assert half.dtype == torch.float16


# ---------------------------------------------------------------- pairs

class Recording(ExpertsBackend):
    """A backend that is not TorchBackend: records which method ran (and its addend), computes with TorchBackend
    and marks its blockwise output so a test can tell whose blockwise ran."""

    name = "recording"

    def __init__(self, fuses_addend: bool = False):
        self.fuses_addend = fuses_addend
        self.torch = TorchBackend()
        self.calls: list[tuple[str, object]] = []

    def _ran(self, name, out, addend):
        self.calls.append((name, addend))
        return out if addend is None else out + addend

    def block_mapping(self, routing, weights, block_size, num_blocks, optimized):
        self.calls.append(("block_mapping", (weights, block_size, num_blocks, optimized)))
        return super().block_mapping(routing, weights, block_size, num_blocks, optimized)

    def blockwise(self, hidden_states, routing, mapping, weights, config, addend=None):
        return self._ran("blockwise", self.torch.blockwise(hidden_states, routing, mapping, weights, config) + 1000,
                         addend)

    def capacity_factor(self, hidden_states, routing, capacity, weights, addend=None):
        out, dropped = self.torch.capacity_factor(hidden_states, routing, capacity, weights)
        return self._ran("capacity_factor", out, addend), dropped

    def selective_loading(self, hidden_states, routing, weights, addend=None):
        return self._ran("selective_loading", self.torch.selective_loading(hidden_states, routing, weights), addend)

    def all_experts(self, hidden_states, routing, weights, addend=None):
        return self._ran("all_experts", self.torch.all_experts(hidden_states, routing, weights), addend)


PAIR_EXPERT = [[2, 0], [1, -1], [0, 2], [2, 1], [-1, 0], [1, 2], [0, 1]]


def pairs_by_hand(x, pair_weight, w, slot, prescale, drop_after=None):
    want = torch.zeros(x.shape, dtype=torch.float64)
    seen = [0] * E
    for t, row in enumerate(PAIR_EXPERT):
        for j, e in enumerate(row):
            if e < 0:
                continue
            local = slot[e]
            seen[local] += 1
            if drop_after is not None and seen[local] > drop_after:
                continue
            a = pair_weight[t, j].item()
            want[t] += mlp_by_hand(a * x[t], w, local) if prescale else a * mlp_by_hand(x[t], w, local)
    return want


@pytest.mark.parametrize("prescale", [False, True])
@pytest.mark.parametrize("mode", list(ExpertsMode))
def test_experts_forward_pairs_every_mode_from_the_definition(mode, prescale):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    pair_weight = torch.rand(T, 2, generator=g, dtype=torch.float64) + 0.25
    w = expert_weights(12)
    slot = [1, 2, 0]  # global expert e is local expert slot[e]
    config = BlockwiseMatmulConfig(block_size=4)
    run = experts_forward_pairs(TorchBackend(), x, torch.tensor(PAIR_EXPERT), pair_weight, w, torch.tensor(slot),
                                mode, config, capacity=3 if mode is ExpertsMode.CAPACITY_FACTOR else None,
                                prescale=prescale)
    assert isinstance(run, ExpertsRun) and run.routing.prescale is prescale
    capacity_drops = 3 if mode is ExpertsMode.CAPACITY_FACTOR else None
    torch.testing.assert_close(run.output, pairs_by_hand(x, pair_weight, w, slot, prescale, capacity_drops),
                               rtol=1e-12, atol=1e-12)
    assert run.dropped.dtype == torch.int64 and run.dropped.shape == ()
    assert run.dropped.item() == (3 if mode is ExpertsMode.CAPACITY_FACTOR else 0)  # each expert: 4 pairs, 1 past 3
    if mode is ExpertsMode.BLOCKWISE:
        # 12 pairs, 3 experts, B = 4: min(ceil((12 - 2) / 4) + 2, 12) = 5
        assert (run.block_size, run.num_blocks, run.mapping.num_blocks) == (4, 5, 5)
    else:
        assert (run.mapping, run.block_size, run.num_blocks) == (None, None, None)


def test_run_experts_pads_blocks_to_even_when_asked():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    run = experts_forward_pairs(TorchBackend(), x, torch.tensor(PAIR_EXPERT), torch.ones(T, 2, dtype=torch.float64),
                                expert_weights(14), torch.arange(E), ExpertsMode.BLOCKWISE,
                                BlockwiseMatmulConfig(block_size=4, pad_num_blocks_to_even=True,
                                                      optimized_block_to_token_mapping=False))
    assert (run.num_blocks, run.mapping.num_blocks) == (6, 6)
    torch.testing.assert_close(run.output, pairs_by_hand(x, torch.ones(T, 2, dtype=torch.float64),
                                                         expert_weights(14), [0, 1, 2], False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("use_torch_block_wise", [False, True])
def test_use_torch_block_wise_swaps_only_the_blockwise_backend(use_torch_block_wise):
    g = torch.Generator().manual_seed(15)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = expert_weights(16)
    routing = Routing(torch.tensor([[0, 1]] * T), torch.tensor([[True, True, False]] * T),
                      torch.tensor([[0.5, 0.5, 0.0]] * T, dtype=torch.float64), False)
    config = BlockwiseMatmulConfig(block_size=8, use_torch_block_wise=use_torch_block_wise)
    backend = Recording()
    run = run_experts(backend, x, routing, w, ExpertsMode.BLOCKWISE, config)
    want = 0.5 * torch.stack([mlp_by_hand(x[t], w, 0) + mlp_by_hand(x[t], w, 1) for t in range(T)])
    torch.testing.assert_close(run.output, want if use_torch_block_wise else want + 1000, rtol=1e-12, atol=1e-9)
    assert backend.calls == ([] if use_torch_block_wise else [("block_mapping", (w, 8, 4, True)),
                                                                    ("blockwise", None)])
    backend = Recording()
    run_experts(backend, x, routing, w, ExpertsMode.ALL_EXPERTS, config)
    assert backend.calls == [("all_experts", None)]


@pytest.mark.parametrize("fuses", [False, True])
@pytest.mark.parametrize("mode", list(ExpertsMode))
def test_addend_is_fused_or_added_once(mode, fuses):
    g = torch.Generator().manual_seed(17)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    addend = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = expert_weights(18)
    routing = Routing(torch.tensor([[2, 1]] * T), torch.tensor([[False, True, True]] * T),
                      torch.tensor([[0.0, 0.25, 0.75]] * T, dtype=torch.float64), False)
    config = BlockwiseMatmulConfig(block_size=8)
    backend = Recording(fuses_addend=fuses)
    run = run_experts(backend, x, routing, w, mode, config, capacity=T, addend=addend)
    want = torch.stack([0.25 * mlp_by_hand(x[t], w, 1) + 0.75 * mlp_by_hand(x[t], w, 2) for t in range(T)]) + addend
    if mode is ExpertsMode.BLOCKWISE:
        want = want + 1000
    torch.testing.assert_close(run.output, want, rtol=1e-12, atol=1e-9)
    if mode is ExpertsMode.BLOCKWISE:  # 14 pairs, 3 experts, B = 8: min(ceil((14 - 2) / 8) + 2, 14) = 4
        assert backend.calls.pop(0) == ("block_mapping", (w, 8, 4, True))
    assert len(backend.calls) == 1 and backend.calls[0][0] == mode.value
    assert (backend.calls[0][1] is addend) == fuses and (backend.calls[0][1] is None) == (not fuses)
    assert run.routing is routing
    without = run_experts(Recording(fuses_addend=fuses), x, routing, w, mode, config, capacity=T)
    torch.testing.assert_close(without.output, want - addend, rtol=1e-12, atol=1e-9)


def test_pieces_make_their_tensors_on_the_inputs_device():
    """On the meta device (shapes only): a helper tensor made on the default device would not mix with the inputs."""
    meta = torch.device("meta")
    padded = ExpertActivation("sigmoid", False, GLUType.GLU, intermediate_size_actual=5)
    out = padded(PROJECTED.to(meta))
    assert out.device == meta and out.shape == PROJECTED.shape
    index = torch.tensor([[2, 0], [1, 3], [3, 2]], device=meta)
    assert expert_mask(index, 5).device == meta
    routing = build_routing(torch.zeros(3, 5, device=meta), index, 5, True, False, torch.ones(3, dtype=torch.bool,
                                                                                          device=meta))
    assert routing.affinities.device == meta and routing.expert_mask.shape == (3, 5)
    w = expert_weights(19)
    w = ExpertWeights(*(t.to(meta) for t in w[:4]), w.activation)
    run = run_experts(TorchBackend(), torch.zeros(3, H, dtype=torch.float64, device=meta),
                      build_routing(torch.zeros(3, E, dtype=torch.float64, device=meta),
                                    torch.tensor([[2, 0], [1, 2], [0, 1]], device=meta), E, False, False),
                      w, ExpertsMode.ALL_EXPERTS, BlockwiseMatmulConfig(block_size=8))
    assert run.output.device == meta and run.dropped.device == meta


@pytest.mark.parametrize("optimized", [False, True])
def test_run_experts_hands_the_backend_its_block_mapping_arguments(optimized):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = expert_weights(22)
    backend = Recording()
    run = run_experts(backend, x, routing_of(INDEX, torch.ones(T, E, dtype=torch.float64), False), w,
                      ExpertsMode.BLOCKWISE, BlockwiseMatmulConfig(block_size=2, pad_num_blocks_to_even=True,
                                                                   optimized_block_to_token_mapping=optimized))
    # 14 pairs, 3 experts, B = 2: min(ceil(12 / 2) + 2, 14) = 8, even already
    assert backend.calls[0] == ("block_mapping", (w, 2, 8, optimized))
    assert backend.calls[0][1][0] is w and backend.calls[0][1][3] is optimized
    assert (run.block_size, run.num_blocks) == (2, 8)


def test_experts_forward_pairs_does_not_prescale_by_default():
    g = torch.Generator().manual_seed(23)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    pair_weight = torch.rand(T, 2, generator=g, dtype=torch.float64) + 0.25
    w = expert_weights(24)
    run = experts_forward_pairs(TorchBackend(), x, torch.tensor(PAIR_EXPERT), pair_weight, w, torch.arange(E),
                                ExpertsMode.SELECTIVE_LOADING, BlockwiseMatmulConfig(block_size=8))
    assert run.routing.prescale is False
    torch.testing.assert_close(run.output, pairs_by_hand(x, pair_weight, w, [0, 1, 2], False), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("scaling", [2.0, 0.5])
def test_glu_scaling_factor_two_and_a_half_are_applied(scaling):
    gate, up = PROJECTED[:, :4], PROJECTED[:, 4:]
    act = ExpertActivation("sigmoid", True, GLUType.GLU, scaling_factor=scaling)
    torch.testing.assert_close(act(PROJECTED), glu_by_hand(gate, up, False, s=scaling), rtol=1e-12, atol=1e-12)
