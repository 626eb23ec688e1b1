"""The expert algorithms' building blocks, each setting against a reference written out here (float64 loops,
hand-built tensors, whole error messages): the weights and stats (``experts/expert_mlps.py``), the expert MLP and
the top-k combine (``experts/mlp.py``), the grouped matmul (``experts/grouped_matmul.py``), the device while loop
(``experts/while_loop.py``, its traced and XLA paths through fakes that record what they are given), the
dynamic-while schedule (``experts/dynamic_while.py``) and the backend seam (``experts/backends.py``). Torch only,
nothing compiled."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

import nxd_moe.experts.backends as backends_module
import nxd_moe.experts.while_loop as while_loop_module
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import BACKENDS, ExpertsBackend, TorchBackend, check_backend_supports, get_backend
from nxd_moe.experts.dynamic_while import (
    DynamicWhileResult,
    blocks_per_iteration,
    dynamic_while_blockwise_forward,
    static_block_count,
)
from nxd_moe.experts.expert_mlps import ExpertLinear, ExpertsMLPOp, ExpertsStats, check_expert_index
from nxd_moe.experts.grouped_matmul import grouped_matmul, grouped_mm_applies, plan_groups, resolve_matmul_impl
from nxd_moe.experts.mlp import ExpertWeights, combine, dense_expert_mlp, grouped_expert_mlp
from nxd_moe.experts.mode import NXD_POLICY, ExpertsMode, ModePolicy
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import BlockMapping
from nxd_moe.experts.while_loop import while_loop, while_loop_into
from nxd_moe.moe_configs import BlockwiseMatmulConfig, GLUType, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization import QUANTIZATION_CHOICES, QuantizedWeight
from nxd_moe.quantization.activations import ActivationQuantization
from nxd_moe.quantization.formats import Shape

F64 = torch.float64
F32 = torch.float32
BF16 = torch.bfloat16


def relu_mlp(intermediate_size=None):
    return ExpertActivation("relu", glu_mlp=False, glu_type=GLUType.GLU, intermediate_size=intermediate_size)


# ---------------------------------------------------------------- expert_mlps.py: ExpertLinear


def test_expert_linear_default_init_is_kaiming_over_in_features_and_bias_uniform():
    torch.manual_seed(0)
    num_experts, in_f, out_f = 4, 25, 64
    lin = ExpertLinear(num_experts, in_f, out_f, bias=True, dtype=F64)
    assert tuple(lin.weight.shape) == (num_experts, in_f, out_f)
    assert lin.weight.dtype == F64 and lin.weight.requires_grad
    # nn.Linear's default on the (out, in) view: kaiming_uniform(a=sqrt 5) -> U(-1/sqrt(in), 1/sqrt(in))
    bound = 1.0 / math.sqrt(in_f)
    for e in range(num_experts):  # every expert initialised, each to the full bound
        assert 0.97 * bound < lin.weight[e].abs().max() <= bound
    assert tuple(lin.bias.shape) == (num_experts, out_f) and lin.bias.dtype == F64
    assert 0.97 * bound < lin.bias.abs().max() <= bound
    assert lin.bias.min() < -0.97 * bound and lin.bias.max() > 0.97 * bound  # U(-b, b): both signs
    assert lin.dtype == F64
    assert lin.shape == Shape(num_experts, in_f, out_f)
    assert lin.stored_weight() is lin.weight
    assert not hasattr(lin, "scale")
    assert lin.extra_repr() == f"num_experts={num_experts}, in_features={in_f}, out_features={out_f}, bias=True"
    plain = ExpertLinear(2, 3, 5, bias=False, dtype=F32)
    assert plain.bias is None
    assert plain.extra_repr() == "num_experts=2, in_features=3, out_features=5, bias=False"
    # an unquantized weight's dtype is its own: module.to(dtype) changes it
    assert plain.to(F64).dtype == F64


def test_expert_linear_init_method_is_called_once_per_expert_on_its_in_out_matrix():
    seen = []

    def init(w):
        seen.append(tuple(w.shape))
        w.fill_(len(seen))

    lin = ExpertLinear(3, 4, 6, bias=False, dtype=F64, init_method=init)
    assert seen == [(4, 6)] * 3
    assert lin.weight[:, 0, 0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("k_major", [False, True])
def test_expert_linear_quantized_stores_the_format_and_computes_in_its_dtype(k_major):
    torch.manual_seed(1)
    num_experts, in_f, out_f = 2, 32, 16
    lin = ExpertLinear(num_experts, in_f, out_f, bias=True, dtype=BF16, quantization="fp8", k_major=k_major)
    assert lin.weight.dtype == torch.float8_e4m3fn and tuple(lin.weight.shape) == (num_experts, in_f, out_f)
    assert lin.weight.stride() == ((in_f * out_f, 1, in_f) if k_major else (in_f * out_f, out_f, 1))
    assert lin.scale.dtype == F32 and tuple(lin.scale.shape) == (num_experts, 1, out_f)
    assert not lin.weight.requires_grad and not lin.scale.requires_grad
    assert lin.bias.dtype == BF16 and lin.bias.requires_grad
    assert lin.dtype == BF16  # the compute dtype, not the stored fp8
    assert lin.shape == Shape(num_experts, in_f, out_f)
    w = lin.stored_weight()
    assert isinstance(w, QuantizedWeight)
    assert w.format.name == "fp8" and w.dtype == BF16 and w.weight is lin.weight and w.scale is lin.scale
    # the default init, quantized: per column amax / 448 of a U(-1/sqrt(in), 1/sqrt(in)) matrix
    values = lin.weight.to(F64) * lin.scale.to(F64)
    assert 0.8 / math.sqrt(in_f) < values.abs().max() <= 1.0 / math.sqrt(in_f) * (1 + 2 ** -4)
    assert lin.extra_repr() == "num_experts=2, in_features=32, out_features=16, bias=True, quantization='fp8'"
    default = ExpertLinear(num_experts, in_f, out_f, bias=False, dtype=BF16, quantization="fp8")
    assert default.weight.stride() == (in_f * out_f, out_f, 1)  # not K-major unless asked


@pytest.mark.parametrize("k_major", [False, True])
def test_expert_linear_quantized_on_meta_has_the_formats_storage(k_major):
    lin = ExpertLinear(3, 32, 8, bias=False, dtype=BF16, device="meta", quantization="fp8", k_major=k_major)
    assert lin.weight.is_meta and lin.scale.is_meta
    assert tuple(lin.weight.shape) == (3, 32, 8) and lin.weight.dtype == torch.float8_e4m3fn
    assert lin.weight.stride() == ((256, 1, 32) if k_major else (256, 8, 1))
    assert tuple(lin.scale.shape) == (3, 1, 8)
    mx = ExpertLinear(2, 64, 4, bias=False, dtype=BF16, device="meta", quantization="mxfp4")
    assert tuple(mx.weight.shape) == (2, 32, 4) and mx.weight.stride() == (128, 1, 32)
    assert mx.shape == Shape(2, 64, 4)


def test_expert_linear_checks_the_formats_shape_by_name():
    with pytest.raises(ValueError) as err:
        ExpertLinear(2, 48, 16, bias=False, dtype=BF16, quantization="mxfp4")
    assert str(err.value) == ("ExpertLinear (2, 48, 16): format 'mxfp4' needs the in (K) dimension divisible by its "
                              "block size 32, got 48 (shape (E, K, N) = (2, 48, 16))")


def test_expert_linear_checks_loaded_quantized_tensors_under_its_name():
    lin = ExpertLinear(2, 32, 16, bias=False, dtype=F32, quantization="fp8")
    good = {k: v.clone() for k, v in lin.state_dict().items()}
    lin.load_state_dict(good)
    with pytest.raises(ValueError) as err:
        lin.load_state_dict({"weight": good["weight"], "scale": good["scale"][:, :, :8]})
    assert str(err.value) == ("ExpertLinear.scale: format 'fp8' stores scale as torch.float32 of shape (2, 1, 16), "
                              "got torch.float32 of shape (2, 1, 8)")
    outer = torch.nn.Module()
    outer.projX = ExpertLinear(2, 32, 16, bias=False, dtype=F32, quantization="fp8")
    bad_scale = good["scale"].clone()
    bad_scale[1, 0, 3] = 0.0
    with pytest.raises(ValueError) as err:
        outer.load_state_dict({"projX.weight": good["weight"], "projX.scale": bad_scale})
    assert str(err.value).startswith("projX.scale: 1 scale(s) are NaN, Inf, zero or negative")
    # only one of the two tensors: left to load_state_dict's own key checks
    assert lin.load_state_dict({"weight": good["weight"]}, strict=False).missing_keys == ["scale"]
    assert lin.load_state_dict({"scale": good["scale"]}, strict=False).missing_keys == ["weight"]


# ---------------------------------------------------------------- expert_mlps.py: ExpertsMLPOp


def _config(**kwargs):
    base = dict(num_experts=5, hidden_size=32, intermediate_size=16, top_k=2, hidden_act="silu", glu_mlp=True)
    base.update(kwargs)
    return RoutedExpertsMLPOpsConfig(**base)


def test_experts_mlp_op_glu_projections_and_shard_sizes():
    op = ExpertsMLPOp(_config(bias=True), F64)
    assert tuple(op.gate_up_proj.weight.shape) == (5, 32, 32) and tuple(op.down_proj.weight.shape) == (5, 16, 32)
    assert op.gate_up_proj.weight.dtype == F64 and op.down_proj.weight.dtype == F64
    assert tuple(op.gate_up_proj.bias.shape) == (5, 32) and tuple(op.down_proj.bias.shape) == (5, 32)
    assert op.first_proj is op.gate_up_proj and not hasattr(op, "up_proj")
    shard = ExpertsMLPOp(_config(), F32, num_experts=2, intermediate_size=8)
    assert tuple(shard.gate_up_proj.weight.shape) == (2, 32, 16) and tuple(shard.down_proj.weight.shape) == (2, 8, 32)
    assert shard.gate_up_proj.bias is None and shard.down_proj.bias is None
    only_experts = ExpertsMLPOp(_config(), F32, num_experts=3)
    assert tuple(only_experts.down_proj.weight.shape) == (3, 16, 32)
    only_inter = ExpertsMLPOp(_config(), F32, intermediate_size=4)
    assert tuple(only_inter.gate_up_proj.weight.shape) == (5, 32, 8)
    on_meta = ExpertsMLPOp(_config(bias=True), BF16, device="meta")
    for proj in (on_meta.gate_up_proj, on_meta.down_proj):
        assert proj.weight.is_meta and proj.bias.is_meta and proj.weight.dtype == BF16 and proj.bias.dtype == BF16


def test_experts_mlp_op_non_glu_up_projection_and_init_methods():
    calls = []
    cfg = _config(glu_mlp=False, hidden_act="relu", input_layer_init_method=lambda w: calls.append(("in", w.shape)),
                  output_layer_init_method=lambda w: calls.append(("out", w.shape)))
    op = ExpertsMLPOp(cfg, F32)
    assert tuple(op.up_proj.weight.shape) == (5, 32, 16) and tuple(op.down_proj.weight.shape) == (5, 16, 32)
    assert op.first_proj is op.up_proj and not hasattr(op, "gate_up_proj")
    assert calls == [("in", (32, 16))] * 5 + [("out", (16, 32))] * 5


@pytest.mark.parametrize("activations", ["none", "fp8"])
def test_experts_mlp_op_quantized_stores_k_major_only_for_fp8_activations(activations):
    op = ExpertsMLPOp(_config(quantization="fp8", activation_quantization=activations), BF16)
    for proj, (k, n) in ((op.gate_up_proj, (32, 32)), (op.down_proj, (16, 32))):
        assert proj.format.name == "fp8" and proj.weight.dtype == torch.float8_e4m3fn and proj.dtype == BF16
        assert proj.weight.stride() == ((k * n, 1, k) if activations == "fp8" else (k * n, n, 1))


# ---------------------------------------------------------------- expert_mlps.py: ExpertsStats, check_expert_index


def _mapping(conditions, block_size):
    n = len(conditions)
    return BlockMapping(torch.zeros(n, dtype=torch.long), torch.zeros(n * block_size, dtype=torch.long),
                        torch.tensor(conditions, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.long),
                        torch.zeros(1, dtype=torch.long), block_size)


def test_stats_summary_of_a_plain_forward():
    stats = ExpertsStats(ExpertsMode.CAPACITY_FACTOR, num_tokens=7, top_k=3, num_experts=6,
                         tokens_per_expert=torch.tensor([4, 0, 5, 2, 3, 1]), dropped_tokens=torch.tensor(2),
                         capacity=5)
    assert stats.summary() == {"mode": "capacity_factor", "num_tokens": 7, "top_k": 3, "num_experts": 6,
                               "assignments": 15, "dropped_tokens": 2, "block_size": None, "num_blocks": None,
                               "capacity": 5}
    defaults = ExpertsStats(ExpertsMode.ALL_EXPERTS, 1, 1, 2, torch.tensor([1, 0]), torch.tensor(0))
    assert (defaults.block_size, defaults.num_blocks, defaults.capacity, defaults.mapping, defaults.dispatch,
            defaults.local_experts, defaults.local_tokens_per_expert, defaults.communication) == (None,) * 8


def test_stats_summary_with_blocks_and_expert_parallelism_uses_this_ranks_pairs():
    # 5 blocks of 4 slots, 3 active (12 slots); this rank computed 9 pairs of the block's 20
    stats = ExpertsStats(ExpertsMode.BLOCKWISE, num_tokens=10, top_k=2, num_experts=4,
                         tokens_per_expert=torch.tensor([6, 5, 5, 4]), dropped_tokens=torch.tensor(0), block_size=4,
                         num_blocks=5, mapping=_mapping([1, 1, 1, 0, 0], 4), dispatch="all_to_all",
                         local_experts=(2, 3), local_tokens_per_expert=torch.tensor([5, 4]),
                         communication={"tokens": 300, "combine": 120})
    assert stats.summary() == {
        "mode": "blockwise", "num_tokens": 10, "top_k": 2, "num_experts": 4, "assignments": 20, "dropped_tokens": 0,
        "block_size": 4, "num_blocks": 5, "capacity": None, "dispatch": "all_to_all", "local_experts": [2, 3],
        "rank_load": 9, "bytes_moved": 420, "bytes_by_step": {"tokens": 300, "combine": 120}, "active_blocks": 3,
        "padding_overhead_provisioned": (20 - 12) / 12, "padding_overhead_algorithmic": (12 - 9) / 9}


def test_stats_summary_single_device_blocks_and_nothing_routed():
    stats = ExpertsStats(ExpertsMode.BLOCKWISE, 3, 2, 3, torch.tensor([3, 2, 1]), torch.tensor(0), block_size=2,
                         num_blocks=7, mapping=_mapping([1, 1, 1, 1, 0, 0, 0], 2))
    summary = stats.summary()
    assert "dispatch" not in summary and "rank_load" not in summary
    assert summary["active_blocks"] == 4
    assert summary["padding_overhead_provisioned"] == (14 - 8) / 8
    assert summary["padding_overhead_algorithmic"] == (8 - 6) / 6
    empty = ExpertsStats(ExpertsMode.BLOCKWISE, 2, 1, 2, torch.tensor([0, 0]), torch.tensor(0), block_size=2,
                         num_blocks=2, mapping=_mapping([0, 0], 2)).summary()
    assert empty["active_blocks"] == 0
    assert empty["padding_overhead_provisioned"] is None and empty["padding_overhead_algorithmic"] is None
    # blocks used but no pair of this rank's: the algorithmic overhead has no denominator
    idle = ExpertsStats(ExpertsMode.BLOCKWISE, 2, 1, 2, torch.tensor([1, 1]), torch.tensor(0), block_size=2,
                        num_blocks=2, mapping=_mapping([1, 0], 2), dispatch="all_gather", local_experts=(1,),
                        local_tokens_per_expert=torch.tensor([0]), communication={}).summary()
    assert idle["padding_overhead_provisioned"] == 1.0 and idle["padding_overhead_algorithmic"] is None
    assert idle["rank_load"] == 0 and idle["bytes_moved"] == 0 and idle["bytes_by_step"] == {}


def test_check_expert_index_range_and_duplicates():
    check_expert_index(torch.zeros(0, 2, dtype=torch.long), 0, "anything")  # nothing to read
    check_expert_index(torch.tensor([[0, 4], [4, 0], [1, 2]]), 5, "X")  # both ends of [0, E)
    check_expert_index(torch.tensor([[3, 1], [3, 1]]), 4, "X")  # the same pair on two tokens is fine
    with pytest.raises(ValueError) as err:
        check_expert_index(torch.tensor([[0, 2], [-1, 1]]), 4, "MoE: idx")
    assert str(err.value) == "MoE: idx values must be in [0, 3], got range [-1, 2]"
    with pytest.raises(ValueError) as err:
        check_expert_index(torch.tensor([[0, 2], [4, 1]]), 4, "Y")
    assert str(err.value) == "Y values must be in [0, 3], got range [0, 4]"
    with pytest.raises(ValueError) as err:
        check_expert_index(torch.tensor([[0, 1, 2], [2, 0, 2]]), 3, "Z")
    assert str(err.value) == "Z: a token lists the same expert twice; each row must hold k distinct experts"
    for twice in ([[0, 1], [2, 2]], [[1, 1, 2]], [[0, 2, 2]]):  # k = 2, and k = 3 with either pair the same
        with pytest.raises(ValueError, match="^Z: a token lists the same expert twice"):
            check_expert_index(torch.tensor(twice), 3, "Z")


# ---------------------------------------------------------------- mlp.py


def _mlp_weights(num_experts, hidden, inter, seed, biases=(True, True), dtype=F64):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, hidden, inter, generator=g, dtype=F64).to(dtype)
    w2 = torch.randn(num_experts, inter, hidden, generator=g, dtype=F64).to(dtype)
    b1 = torch.randn(num_experts, inter, generator=g, dtype=F64).to(dtype) if biases[0] else None
    b2 = torch.randn(num_experts, hidden, generator=g, dtype=F64).to(dtype) if biases[1] else None
    return ExpertWeights(w1, w2, b1, b2, relu_mlp())


def _expert_row(x_row, weights, e):
    """One row through expert ``e`` of a relu MLP, in float64 loops: ``relu(x W1 + b1) W2 + b2``."""
    w1, w2 = weights.gate_up_proj.to(F64), weights.down_proj.to(F64)
    b1, b2 = weights.gate_up_bias, weights.down_bias
    hidden, inter = w1.shape[1], w1.shape[2]
    h = []
    for j in range(inter):
        v = sum(float(x_row[i]) * float(w1[e, i, j]) for i in range(hidden)) + (0.0 if b1 is None else float(b1[e, j]))
        h.append(max(v, 0.0))
    return [sum(h[j] * float(w2[e, j, o]) for j in range(inter)) + (0.0 if b2 is None else float(b2[e, o]))
            for o in range(hidden)]


def test_expert_weights_num_experts_format_and_quantized_input():
    w = _mlp_weights(3, 4, 5, seed=0)
    assert w.num_experts == 3 and w.format == "bf16" and w.activation_quantization is None
    x = torch.randn(2, 4, dtype=F64)
    assert w.quantized_input(x) is x
    q = ExpertLinear(3, 32, 16, bias=False, dtype=F32, quantization="fp8").stored_weight()
    qw = ExpertWeights(q, q, None, None, relu_mlp(), ActivationQuantization(None))
    assert qw.num_experts == 3 and qw.format == "fp8"
    # per-row FP8 E4M3 with scale amax / 448 = 1: 1.0625 is halfway between 1 and 1.125 (ties to even: 1),
    # 3.3 -> 3.25 (step 0.25 in [2, 4)), 5.9 -> 6 (step 0.5 in [4, 8)), -2.1 -> -2
    row = torch.tensor([[448.0, 1.0625, 3.3, 5.9, -2.1]])
    assert qw.quantized_input(row).tolist() == [[448.0, 1.0, 3.25, 6.0, -2.0]]


@pytest.mark.parametrize("biases", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("quantized", [False, True])
def test_expert_weights_flatten_and_rebuild_every_bias_combination(biases, quantized):
    if quantized:
        gate_up = ExpertLinear(3, 32, 16, bias=False, dtype=F32, quantization="fp8").stored_weight()
        down = ExpertLinear(3, 16, 32, bias=False, dtype=F32, quantization="fp8").stored_weight()
    else:
        gate_up, down = torch.randn(3, 32, 16), torch.randn(3, 16, 32)
    b1 = torch.randn(3, 16) if biases[0] else None
    b2 = torch.randn(3, 32) if biases[1] else None
    spec = ActivationQuantization(16) if quantized else None
    w = ExpertWeights(gate_up, down, b1, b2, relu_mlp(16), spec)
    tensors, layout = w.flatten()
    stored = [gate_up.weight, gate_up.scale, down.weight, down.scale] if quantized else [gate_up, down]
    expected = stored + [b for b in (b1, b2) if b is not None]
    assert len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected))
    assert (layout.has_gate_up_bias, layout.has_down_bias) == biases
    assert layout.activation == relu_mlp(16) and layout.activation_quantization == spec
    assert layout.gate_up_proj.num_tensors == (2 if quantized else 1)
    back = layout.rebuild(iter(tensors))  # any iterable of the tensors
    assert back.gate_up_bias is b1 and back.down_bias is b2
    assert back.activation == relu_mlp(16) and back.activation_quantization == spec
    if quantized:
        assert back.gate_up_proj == gate_up and back.down_proj == down
    else:
        assert back.gate_up_proj is gate_up and back.down_proj is down


@pytest.mark.parametrize("biases", [(True, False), (False, True)])
def test_dense_expert_mlp_every_expert_on_its_rows_and_shared_rows(biases):
    num_experts, hidden, inter, rows = 3, 4, 5, 2
    w = _mlp_weights(num_experts, hidden, inter, seed=1, biases=biases)
    x = torch.randn(num_experts, rows, hidden, generator=torch.Generator().manual_seed(2), dtype=F64)
    ref = torch.tensor([[_expert_row(x[e, m], w, e) for m in range(rows)] for e in range(num_experts)], dtype=F64)
    assert_close(dense_expert_mlp(x, w), ref, atol=1e-12, rtol=1e-12)
    shared = x[1:2]  # (1, M, H): every expert on the same rows
    ref = torch.tensor([[_expert_row(shared[0, m], w, e) for m in range(rows)] for e in range(num_experts)], dtype=F64)
    assert_close(dense_expert_mlp(shared, w), ref, atol=1e-12, rtol=1e-12)


def _fp8_chain_weights():
    """One expert, H = I = 2, identity-like weights chosen so that both GEMM inputs round visibly in FP8 E4M3:
    x = [448, 1.0625] -> [448, 1] (scale 1); h = x W1 = [448, 1.0625 * q] -> its own rounding; y = h W2 = h."""
    w1 = torch.tensor([[[1.0, 0.0], [0.0, 1.0625]]])
    w2 = torch.eye(2).unsqueeze(0)
    return ExpertWeights(w1, w2, None, None, relu_mlp(), ActivationQuantization(None))


def test_both_gemm_inputs_go_through_the_fp8_activations():
    # x quantized: [448, 1] -> h = [448, 1.0625] -> quantized [448, 1] (unquantized chain: [448, 1.12890625];
    # only x quantized: [448, 1.0625]; only h quantized: h = [448, 1.12890625] -> [448, 1.125])
    w = _fp8_chain_weights()
    x = torch.tensor([[[448.0, 1.0625]]])
    assert dense_expert_mlp(x, w).tolist() == [[[448.0, 1.0]]]
    assert grouped_expert_mlp(x, w, torch.tensor([0]), impl="gather").tolist() == [[[448.0, 1.0]]]
    assert grouped_expert_mlp(x, w, torch.tensor([0])).tolist() == [[[448.0, 1.0]]]  # "auto": 8-byte rows gather


@pytest.mark.parametrize("impl", ["gather", "grouped_mm"])
def test_grouped_expert_mlp_each_group_through_its_expert_with_its_biases(impl):
    num_experts, hidden, inter, rows = 4, 8, 4, 3
    dtype = F64 if impl == "gather" else F32
    w = _mlp_weights(num_experts, hidden, inter, seed=3, dtype=dtype)
    w = w._replace(gate_up_bias=w.gate_up_bias.to(dtype), down_bias=w.down_bias.to(dtype))
    group_expert = torch.tensor([0, 0, 2, 3, 3])  # expert 1 has no group
    active = torch.tensor([True, True, True, True, False])
    x = torch.randn(5, rows, hidden, generator=torch.Generator().manual_seed(4), dtype=F64).to(dtype)
    out = grouped_expert_mlp(x, w, group_expert, active, impl)
    ref = torch.tensor([[_expert_row(x[g, m], w, int(group_expert[g])) for m in range(rows)] for g in range(4)],
                       dtype=F64)
    # fp32: H = 8 and I = 4 terms of O(1) values, two GEMMs: within 1e-5 (FP32_ATOL's rule)
    tol = 1e-12 if dtype == F64 else 1e-5
    assert_close(out[:4].to(F64), ref, atol=tol, rtol=tol)
    if impl == "gather":  # gather computes every group; the inactive one is expert 3's too
        assert_close(out[4], torch.tensor([_expert_row(x[4, m], w, 3) for m in range(rows)], dtype=F64),
                                   rtol=tol, atol=tol)


def test_grouped_expert_mlp_passes_its_matmul_impl_on():
    w = _mlp_weights(2, 8, 4, seed=5)
    with pytest.raises(ValueError, match=r"^matmul impl 'grouped_mm' does not apply to dtype torch\.float64"):
        grouped_expert_mlp(torch.zeros(2, 1, 8, dtype=F64), w, torch.tensor([0, 1]), impl="grouped_mm")


def test_combine_weighted_sum_of_each_tokens_rows_and_missing_pairs_read_zero():
    rows = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 4.0]], dtype=F64)
    slot = torch.tensor([[0, 2], [1, 3], [3, 3], [2, 0]])  # 3 = S: no row
    w = torch.tensor([[0.25, 0.5], [2.0, 0.7], [0.3, 0.4], [1.0, -1.0]], dtype=F64)
    expected = torch.tensor([[0.25 * 1 + 0.5 * 0.5, 0.25 * 2 + 0.5 * 4], [6.0, -2.0], [0.0, 0.0],
                             [0.5 - 1.0, 4.0 - 2.0]], dtype=F64)
    assert torch.equal(combine(rows, slot, w), expected)
    assert torch.equal(combine(rows, slot, w, may_miss=True), expected)
    full = slot[[0, 3]]
    assert torch.equal(combine(rows, full, w[[0, 3]], may_miss=False), expected[[0, 3]])
    with pytest.raises(IndexError):  # may_miss=False appends no zero row: slot S is out of range
        combine(rows, slot, w, may_miss=False)
    poisoned = torch.cat([rows, torch.full((1, 2), float("nan"), dtype=F64)])  # a row no token reads
    assert torch.equal(combine(poisoned, torch.tensor([[0, 4]]), torch.tensor([[1.0, 0.0]], dtype=F64)),
                       torch.tensor([[1.0, 2.0]], dtype=F64))


def test_combine_accumulates_bfloat16_rows_in_float32_and_float64_in_float64():
    # 1 + 2^-8 + 2^-8: in bf16 each partial sum would round back to 1 (ties to even); in fp32 it is 1 + 2^-7, a
    # bf16 value
    rows = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8]], dtype=BF16)
    out = combine(rows, torch.tensor([[0, 1, 2]]), torch.ones(1, 3))
    assert out.dtype == BF16 and out.item() == 1.0 + 2.0 ** -7
    rows64 = torch.tensor([[1.0], [1e-12]], dtype=F64)
    out64 = combine(rows64, torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=F32))
    assert out64.dtype == F64 and out64.item() == 1.0 + 1e-12


# ---------------------------------------------------------------- grouped_matmul.py


@pytest.mark.parametrize("dtype, dims, expected", [
    (F32, (4, 8), True), (BF16, (8, 16), True), (torch.float16, (8, 24), True), (F64, (16, 16), False),
    (F32, (6, 8), False), (F32, (8, 6), False), (BF16, (4, 8), False), (BF16, (8, 12), False),
    (torch.float16, (20, 8), False)])
def test_grouped_mm_applies_on_cpu_by_dtype_and_16_byte_rows(dtype, dims, expected):
    assert grouped_mm_applies(torch.device("cpu"), dtype, dtype, dims) is expected


def test_grouped_mm_applies_needs_matching_weights_a_known_device_and_the_op(monkeypatch):
    cpu = torch.device("cpu")
    assert not grouped_mm_applies(cpu, F32, BF16, (8, 8))
    assert not grouped_mm_applies(cpu, BF16, F32, (8, 8))
    assert not grouped_mm_applies(torch.device("meta"), F32, F32, (8, 8))
    capability = {"value": (8, 0)}
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or capability["value"])
    cuda = torch.device("cuda", 1)
    assert grouped_mm_applies(cuda, BF16, BF16, (8, 8))
    assert asked == [cuda]  # that device's capability
    assert not grouped_mm_applies(cuda, F32, F32, (8, 8))  # bf16 only on CUDA
    assert not grouped_mm_applies(cuda, BF16, BF16, (8, 4))
    capability["value"] = (9, 0)
    assert grouped_mm_applies(cuda, BF16, BF16, (8, 8))
    capability["value"] = (7, 5)
    assert not grouped_mm_applies(cuda, BF16, BF16, (8, 8))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # inside torch.compile: bf16 only
    assert grouped_mm_applies(cpu, BF16, BF16, (8, 8))
    assert not grouped_mm_applies(cpu, F32, F32, (8, 8))
    assert not grouped_mm_applies(cpu, torch.float16, torch.float16, (8, 8))
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")
    assert not grouped_mm_applies(cpu, BF16, BF16, (8, 8))


def test_resolve_matmul_impl_names_and_errors():
    x = torch.zeros(4, 2, 16)
    w1, w2 = torch.zeros(4, 16, 8), torch.zeros(4, 8, 16)
    assert resolve_matmul_impl("auto", x, (w1, w2)) == "grouped_mm"
    assert resolve_matmul_impl("gather", x, (w1, w2)) == "gather"
    assert resolve_matmul_impl("grouped_mm", x, (w1, w2)) == "grouped_mm"
    odd = torch.zeros(4, 8, 6)  # 24-byte rows: one weight that does not apply is enough
    assert resolve_matmul_impl("auto", x, (w1, odd)) == "gather"
    assert resolve_matmul_impl("auto", x, (odd, w2)) == "gather"
    with pytest.raises(ValueError) as err:
        resolve_matmul_impl("grouped_mm", x, (w1, odd))
    assert str(err.value) == ("matmul impl 'grouped_mm' does not apply to dtype torch.float32 on cpu with weight "
                              "shapes [(4, 16, 8), (4, 8, 6)]; use 'gather' or 'auto'")
    with pytest.raises(ValueError) as err:
        resolve_matmul_impl("cublas", x, (w1, w2))
    assert str(err.value) == "matmul impl must be one of ['auto', 'gather', 'grouped_mm'], got 'cublas'"
    x64 = x.to(F64)
    assert resolve_matmul_impl("auto", x64, (w1.to(F64), w2.to(F64))) == "gather"


def test_auto_gathers_quantized_weights_for_fewer_groups_than_experts():
    q = ExpertLinear(4, 32, 16, bias=False, dtype=F32, quantization="fp8").stored_weight()
    plain = torch.zeros(4, 16, 32)
    rows = 2
    for groups, expected in ((3, "gather"), (4, "grouped_mm"), (5, "grouped_mm")):
        x = torch.zeros(groups, rows, 32)
        assert resolve_matmul_impl("auto", x, (q,)) == expected, groups
        assert resolve_matmul_impl("auto", x, (q, plain)) == expected, groups
        assert resolve_matmul_impl("auto", x, (plain, q)) == expected, groups
    assert resolve_matmul_impl("auto", torch.zeros(1, rows, 16), (plain,)) == "grouped_mm"  # tensors: any count


def test_plan_groups_row_ends_count_the_active_groups_rows_per_expert():
    x = torch.zeros(6, 3, 16)
    weights = (torch.zeros(5, 16, 8), torch.zeros(5, 8, 16))
    group_expert = torch.tensor([0, 0, 1, 3, 3, 3])
    active = torch.tensor([True, True, True, True, False, False])
    plan = plan_groups(x, weights, group_expert, active, "grouped_mm")
    assert plan.impl == "grouped_mm" and plan.group_expert is group_expert
    assert plan.row_ends.dtype == torch.int32 and plan.row_ends.tolist() == [6, 9, 9, 12, 12]
    every = plan_groups(x, weights, group_expert)  # all groups active, impl "auto"
    assert every.impl == "grouped_mm" and every.row_ends.tolist() == [6, 9, 9, 18, 18]
    gather = plan_groups(x, weights, group_expert, active, "gather")
    assert gather == ("gather", group_expert, None) and gather.group_expert is group_expert


@pytest.mark.parametrize("impl", ["gather", "grouped_mm"])
def test_grouped_matmul_each_group_times_its_experts_matrix(impl):
    g = torch.Generator().manual_seed(6)
    dtype = F64 if impl == "gather" else F32
    x = torch.randn(4, 2, 8, generator=g, dtype=F64).to(dtype)
    weight = torch.randn(3, 8, 4, generator=g, dtype=F64).to(dtype)
    group_expert = torch.tensor([0, 2, 2, 2])
    out = grouped_matmul(x, weight, plan_groups(x, (weight,), group_expert, None, impl))
    ref = torch.tensor([[[sum(float(x[gr, m, k]) * float(weight[int(group_expert[gr]), k, n]) for k in range(8))
                          for n in range(4)] for m in range(2)] for gr in range(4)], dtype=F64)
    assert out.shape == (4, 2, 4) and out.dtype == dtype
    tol = 1e-12 if dtype == F64 else 1e-5  # 8 fp32 products of O(1) values
    assert_close(out.to(F64), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_gather_dequantizes_each_expert_once_when_groups_cover_the_experts(groups, monkeypatch):
    q = ExpertLinear(3, 32, 16, bias=False, dtype=F32, quantization="fp8").stored_weight()
    seen = []
    original = type(q.format).dequantize

    def spy(self, weight, scale, dtype):
        seen.append(weight)
        return original(self, weight, scale, dtype)

    monkeypatch.setattr(type(q.format), "dequantize", spy)
    group_expert = torch.tensor([0, 0, 1, 1])[:groups]
    x = torch.randn(groups, 2, 32)
    out = grouped_matmul(x, q, plan_groups(x, (q,), group_expert, None, "gather"))
    assert len(seen) == 1
    if groups >= 3:  # as many groups as experts: the whole weight, once
        assert seen[0] is q.weight
    else:  # fewer: only the chosen experts' rows
        assert torch.equal(seen[0].view(torch.uint8), q.weight[group_expert].view(torch.uint8))
    full = q.weight.to(F64) * q.scale.to(F64)
    ref = torch.bmm(x.to(F64), full[group_expert])
    assert_close(out.to(F64), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- while_loop.py


def _count_cond(i, acc, limit, step):
    return i < limit


def _count_body(i, acc, limit, step):
    return [i + step, acc + i * step]  # a list: the loop hands on a tuple


@pytest.fixture
def torch_while_loop_calls(monkeypatch):
    """torch's while_loop higher-order op replaced by its semantics in Python, recording each call: what
    ``torch.compile`` / ``torch.export`` would capture as one node."""
    import importlib

    hop = importlib.import_module("torch._higher_order_ops.while_loop")  # the module (its package exports the op)
    calls = []

    def fake(cond_fn, body_fn, carried):
        assert isinstance(carried, tuple)
        calls.append(carried)
        while bool(cond_fn(*carried)):
            carried = body_fn(*carried)
            assert isinstance(carried, tuple)
        return list(carried)

    monkeypatch.setattr(hop, "while_loop", fake)
    return calls


def test_while_loop_eager_passes_carried_then_invariants_and_returns_a_tuple():
    out = while_loop(_count_cond, _count_body, [torch.tensor(1), torch.tensor(0)], [torch.tensor(8), torch.tensor(3)])
    assert isinstance(out, tuple) and [int(v) for v in out] == [10, 1 * 3 + 4 * 3 + 7 * 3]
    none = while_loop(_count_cond, _count_body, [torch.tensor(9), torch.tensor(5)], [torch.tensor(8), torch.tensor(3)])
    assert isinstance(none, tuple) and [int(v) for v in none] == [9, 5]
    alone = while_loop(lambda i, limit: i < limit, lambda i, limit: (i * 2,), [torch.tensor(3)], [torch.tensor(20)])
    assert [int(v) for v in alone] == [24]


@pytest.mark.parametrize("tracer", ["is_compiling", "is_exporting"])
def test_while_loop_under_a_tracer_is_torchs_higher_order_op(tracer, monkeypatch, torch_while_loop_calls):
    monkeypatch.setattr(torch.compiler, tracer, lambda: True)
    carried = [torch.tensor(1), torch.tensor(0)]
    out = while_loop(_count_cond, _count_body, carried, [torch.tensor(8), torch.tensor(3)])
    assert len(torch_while_loop_calls) == 1 and torch_while_loop_calls[0] == tuple(carried)
    assert isinstance(out, tuple) and [int(v) for v in out] == [10, 1 * 3 + 4 * 3 + 7 * 3]


def test_while_loop_on_xla_tensors_takes_the_xla_lowering(monkeypatch):
    seen = []
    monkeypatch.setattr(while_loop_module, "_xla_while_loop", lambda *args: seen.append(args) or ("lowered",))
    xla = _XlaBuffer(torch.zeros(2))
    invariant = torch.tensor(1)
    assert while_loop(_count_cond, _count_body, [xla], [invariant]) == ("lowered",)
    assert seen == [(_count_cond, _count_body, (xla,), (invariant,))]


class _XlaBuffer:
    """Stands in for an XLA tensor where only its device and ``index_copy`` are read."""

    device = torch.device("xla")

    def __init__(self, data):
        self.data = data

    def index_copy(self, dim, index, rows):
        return _XlaBuffer(self.data.index_copy(dim, index, rows))


def _rows_cond(i, total, stop, scale):
    return i < stop


def _rows_body(i, total, stop, scale):
    return i + 1, total + i, i.view(1), torch.full((1, 2), float(i)) * scale


@pytest.mark.parametrize("traced", ["eager", "compiling", "xla"])
def test_while_loop_into_writes_each_iterations_rows(traced, monkeypatch, torch_while_loop_calls):
    buffer = torch.full((6, 2), -1.0)
    if traced == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out_buffer = _XlaBuffer(buffer) if traced == "xla" else buffer
    result = while_loop_into(out_buffer, _rows_cond, _rows_body, (torch.tensor(2), torch.tensor(100)),
                             (torch.tensor(5), torch.tensor(10.0)))
    assert isinstance(result, tuple) and len(result) == 3
    i, total, out = result
    assert (int(i), int(total)) == (5, 100 + 2 + 3 + 4)
    written = out.data if traced == "xla" else out
    assert written[:, 0].tolist() == [-1.0, -1.0, 20.0, 30.0, 40.0, -1.0]
    assert torch.equal(buffer, torch.full((6, 2), -1.0))  # the caller's buffer is not written
    assert len(torch_while_loop_calls) == (1 if traced == "compiling" else 0)


class _FakeXla:
    """The part of torch_xla's builder API that ``_xla_while_loop`` uses, executing on CPU tensors.

    Placeholders are zero tensors; a lowered computation is the test's own function of the loop operands, called
    with the HLO parameters its lowering was fed. ``uses[name]``: the operand indices in the order that computation
    first reads them (XLA numbers its parameters so); ``constants[name]``: device data the function created itself,
    as extra parameters after those. ``_xla_user_computation`` runs the XLA While it is given.
    """

    FLOAT8 = {"f8e4m3fn": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2}

    def __init__(self, functions, uses, constants, num_operands):
        self.functions, self.uses, self.constants, self.num_operands = functions, uses, constants, num_operands
        self.placeholders, self.placeholder_kinds, self.built, self.params, self.ran = [], [], {}, None, None
        self.moved_to = []
        fake = self

        class Shape:
            def __init__(self, name, shape):
                self.shape = (name, tuple(shape))

        class Context:
            def __init__(self, name):
                self.name = name

            def build(self, outputs):
                fake.built[self.name] = outputs

            def tensor_parameter_id(self, placeholder):
                index = next(i for i, p in enumerate(fake.placeholders) if p is placeholder)
                uses = fake.uses[self.name]
                return uses.index(index) if index in uses else -1

            def device_parameter_id_tensor_mapping(self):
                uses = fake.uses[self.name]
                mapping = {p: fake.placeholders[i] for p, i in enumerate(uses)}  # placeholders are listed too
                mapping.update({len(uses) + j: DeviceData(c) for j, c in enumerate(fake.constants[self.name])})
                return mapping

            def hlo(self):
                return ("hlo", self.name)

        class DeviceData:
            """A constant as the lowering hands it over: moved to the loop's device before it is an input."""

            def __init__(self, tensor):
                self.tensor = tensor

            def to(self, device):
                fake.moved_to.append(device)
                return self.tensor

        class Computation:
            def __init__(self, name):
                self.name = name

            def __call__(self, values):
                uses, constants = fake.uses[self.name], fake.constants[self.name]
                assert len(values) == len(uses) + len(constants)
                operands = [None] * fake.num_operands
                for p, value in enumerate(values[:len(uses)]):
                    operands[uses[p]] = value
                for value, constant in zip(values[len(uses):], constants):
                    assert torch.equal(value, constant)
                return tuple(fake.functions[self.name](*operands))

        class Result:
            def __init__(self, values):
                self.values = values

            def get_tuple_element(self, i):
                return self.values[i]

        class Op:
            @staticmethod
            def call(computation, args):
                return Result(computation(list(args)))

            @staticmethod
            def mkwhile(params, cond, body):
                fake.params = params

                class While:
                    def build(self, name):
                        return ("while", name, cond, body)
                return While()

        def user_computation(op_name, inputs, computation):
            kind, name, cond, body = computation
            assert (op_name, kind, name) == ("xla::nxd_moe_while", "while", "nxd_moe_while")
            fake.ran = list(inputs)
            state = list(inputs)
            while bool(cond(*state)):
                state = body(*state)
                assert len(state) == len(inputs)
            return state

        def placeholder(shape, dtype):
            fake.placeholder_kinds.append(dtype)
            fake.placeholders.append(torch.zeros(shape, dtype=dtype))
            return fake.placeholders[-1]

        def float8_placeholder(shape):
            name, dims = shape
            fake.placeholder_kinds.append(name)
            fake.placeholders.append(torch.zeros(dims, dtype=self.FLOAT8[name]))
            return fake.placeholders[-1]

        def computation_from_module_proto(name, proto):
            assert proto == ("hlo", name)
            return Computation(name)

        import types

        self.xb = types.SimpleNamespace(
            create_placeholder_tensor=placeholder, mkshape=Shape,
            computation_from_module_proto=computation_from_module_proto, Op=Op,
            create_builder=lambda name: ("builder", name),
            mkparam=lambda builder, i, shape: ("param", builder, i, shape),
            tensor_shape=lambda t: (tuple(t.shape), t.dtype))
        self.torch_xla = types.SimpleNamespace(
            _XLAC=types.SimpleNamespace(_xla_create_placeholder_tensor=float8_placeholder,
                                        lowering=types.SimpleNamespace(LoweringContext=Context),
                                        _xla_user_computation=user_computation),
            core=types.SimpleNamespace(xla_builder=self.xb))

    def install(self, monkeypatch):
        import sys

        monkeypatch.setitem(sys.modules, "torch_xla", self.torch_xla)
        monkeypatch.setitem(sys.modules, "torch_xla.core", self.torch_xla.core)
        monkeypatch.setitem(sys.modules, "torch_xla.core.xla_builder", self.xb)
        return self


def _xla_cond(i, acc, limit, scale, fp8):
    return i < limit


def _xla_body(i, acc, limit, scale, fp8):
    # reads acc first, then i and scale, never limit or the fp8 operand; creates one constant (the 2)
    return i + 1, acc + i * scale * torch.tensor(2, dtype=acc.dtype)


def test_xla_while_loop_feeds_each_computation_its_parameters_and_runs_on_the_device(monkeypatch):
    carried = (torch.tensor(1), torch.tensor(0))
    invariants = (torch.tensor(4), torch.tensor(3), torch.zeros(2, 2, dtype=torch.float8_e5m2))
    constant = torch.tensor(2)
    fake = _FakeXla({"nxd_moe_while_body": _xla_body, "nxd_moe_while_cond": lambda *ops: (_xla_cond(*ops),)},
                    {"nxd_moe_while_body": [1, 0, 3], "nxd_moe_while_cond": [2, 0]},
                    {"nxd_moe_while_body": [constant], "nxd_moe_while_cond": []}, 5).install(monkeypatch)
    out = while_loop_module._xla_while_loop(_xla_cond, _xla_body, carried, invariants)
    assert isinstance(out, tuple) and [int(v) for v in out] == [4, 2 * 3 * (1 + 2 + 3)]
    # one placeholder per operand, float8 ones under XLA's type names
    assert fake.placeholder_kinds == [torch.int64, torch.int64, torch.int64, torch.int64, "f8e5m2"]
    assert [tuple(p.shape) for p in fake.placeholders] == [(), (), (), (), (2, 2)]
    assert len(fake.built["nxd_moe_while_body"]) == 2 and len(fake.built["nxd_moe_while_cond"]) == 1
    # the loop's inputs: carried, invariants, then the body's constant, each an HLO parameter of its own shape
    assert len(fake.ran) == 6 and all(a is b for a, b in zip(fake.ran, carried + invariants))
    assert torch.equal(fake.ran[5], constant) and fake.moved_to == [torch.device("cpu")]
    assert fake.params == [("param", ("builder", "nxd_moe_while"), i, (tuple(t.shape), t.dtype))
                           for i, t in enumerate(fake.ran)]


def test_xla_while_loop_float8_e4m3_placeholder(monkeypatch):
    def cond(i, w):
        return i < 2

    def body(i, w):
        return (i + 1,)

    fake = _FakeXla({"nxd_moe_while_body": body, "nxd_moe_while_cond": lambda *ops: (cond(*ops),)},
                    {"nxd_moe_while_body": [0], "nxd_moe_while_cond": [0]},
                    {"nxd_moe_while_body": [torch.tensor(1)], "nxd_moe_while_cond": []}, 2).install(monkeypatch)
    weight = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    assert [int(v) for v in while_loop_module._xla_while_loop(cond, body, (torch.tensor(0),), (weight,))] == [2]
    assert fake.placeholder_kinds == [torch.int64, "f8e4m3fn"]
    assert fake.placeholders[1].dtype == torch.float8_e4m3fn and tuple(fake.placeholders[1].shape) == (3, 4)
    assert len(fake.ran) == 3 and fake.moved_to == [torch.device("cpu")]  # one carried: its device


@pytest.mark.parametrize("body, error", [
    (lambda i, acc, limit: (i,), "[((), torch.int64), ((2,), torch.float32)], got [((), torch.int64)]"),
    (lambda i, acc, limit: (i, acc, acc), "[((), torch.int64), ((2,), torch.float32)], got [((), torch.int64), "
                                          "((2,), torch.float32), ((2,), torch.float32)]"),
    (lambda i, acc, limit: (i, acc.double()), "[((), torch.int64), ((2,), torch.float32)], got [((), torch.int64), "
                                              "((2,), torch.float64)]"),
    (lambda i, acc, limit: (i, acc[:1]), "[((), torch.int64), ((2,), torch.float32)], got [((), torch.int64), "
                                         "((1,), torch.float32)]"),
])
def test_xla_while_loop_refuses_a_body_that_changes_the_carried_shapes(body, error, monkeypatch):
    _FakeXla({}, {}, {}, 3).install(monkeypatch)
    with pytest.raises(ValueError) as err:
        while_loop_module._xla_while_loop(lambda i, acc, limit: i < limit, body, (torch.tensor(0), torch.zeros(2)),
                                          (torch.tensor(3),))
    assert str(err.value) == ("while_loop: body_fn must return tensors with the shapes and dtypes of carried: "
                              + error)


@pytest.mark.parametrize("cond, error", [
    (lambda i, limit: (i < limit).view(1), "torch.bool (1,)"),
    (lambda i, limit: limit - i, "torch.int64 ()"),
])
def test_xla_while_loop_refuses_a_condition_that_is_not_a_0d_bool(cond, error, monkeypatch):
    _FakeXla({}, {}, {}, 2).install(monkeypatch)
    with pytest.raises(ValueError) as err:
        while_loop_module._xla_while_loop(cond, lambda i, limit: (i + 1,), (torch.tensor(0),), (torch.tensor(3),))
    assert str(err.value) == f"while_loop: cond_fn must return a 0-d bool tensor, got {error}"


# ---------------------------------------------------------------- dynamic_while.py


def test_blocks_per_iteration_and_static_block_count():
    assert blocks_per_iteration(BlockwiseMatmulConfig(use_shard_on_block_dynamic_while=True)) == 2
    assert blocks_per_iteration(BlockwiseMatmulConfig(use_shard_on_intermediate_dynamic_while=True)) == 1
    assert blocks_per_iteration(BlockwiseMatmulConfig()) == 1
    # NxD's default ceil(T*k / B) = ceil(21 / 4) = 6, at most N
    assert static_block_count(BlockwiseMatmulConfig(block_size=4), 7, 3, 10) == 6
    assert static_block_count(BlockwiseMatmulConfig(block_size=4), 7, 3, 5) == 5
    assert static_block_count(BlockwiseMatmulConfig(block_size=4), 8, 3, 10) == 6
    assert static_block_count(BlockwiseMatmulConfig(block_size=5, num_static_blocks=3), 7, 3, 10) == 3
    assert static_block_count(BlockwiseMatmulConfig(block_size=5, num_static_blocks=7), 7, 3, 5) == 5
    assert static_block_count(BlockwiseMatmulConfig(block_size=5, num_static_blocks=0), 7, 3, 10) == 0


def _dynamic_case(expert_index, num_experts, block_size, n_blocks, padding=None, seed=7):
    from nxd_moe.experts.routing_inputs import build_routing
    from nxd_moe.experts.token_mapping import token_to_block_mapping

    num_tokens, top_k = expert_index.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 8, generator=g, dtype=F64)
    affinities = torch.rand(num_tokens, num_experts, generator=g, dtype=F64) + 0.5
    routing = build_routing(affinities, expert_index, num_experts, False, False, padding)
    mapping = token_to_block_mapping(routing.expert_mask, routing.expert_index, block_size, n_blocks)
    weights = _mlp_weights(num_experts, 8, 4, seed=seed + 1)
    ref = torch.zeros(num_tokens, 8, dtype=F64)
    for t in range(num_tokens):
        if padding is None or bool(padding[t]):
            for e in expert_index[t].tolist():
                ref[t] += float(affinities[t, e]) * torch.tensor(_expert_row(x[t], weights, e), dtype=F64)
    return x, routing, mapping, weights, ref


# T = 6, k = 2, E = 3, B = 4: every expert gets 4 pairs (one block each); N = 5 provisioned, blocks 0-2 active
BALANCED = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])


@pytest.mark.parametrize("flag, static, computed", [
    ("intermediate", 0, 3), ("intermediate", 2, 3), ("intermediate", 4, 4), ("intermediate", None, 3),
    ("intermediate", 7, 5),
    ("block", 0, 4), ("block", 1, 3), ("block", 2, 4), ("block", 4, 4), ("block", None, 3), ("block", 7, 5)])
@pytest.mark.parametrize("padded", [False, True])
def test_dynamic_while_computes_the_static_prefix_then_active_blocks(flag, static, computed, padded):
    padding = torch.tensor([True, True, True, True, True, False]) if padded else None
    x, routing, mapping, weights, ref = _dynamic_case(BALANCED, 3, 4, 5, padding)
    assert mapping.conditions.tolist() == [1, 1, 1, 0, 0]
    config = BlockwiseMatmulConfig(block_size=4, num_static_blocks=static,
                                   **{f"use_shard_on_{flag}_dynamic_while": True})
    result = dynamic_while_blockwise_forward(x, routing, mapping, weights, config, "gather")
    assert result.computed_blocks.dtype == torch.int64 and result.computed_blocks.shape == ()
    assert int(result.computed_blocks) == computed
    assert_close(result.output, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("static", [0, 1])
def test_two_blocks_per_iteration_over_an_odd_count_of_active_blocks(static):
    # T = 5, k = 1, E = 2, B = 2: expert 0 fills blocks 0-1, expert 1 block 2: all N = 3 active
    expert_index = torch.tensor([[0], [0], [0], [1], [1]])
    x, routing, mapping, weights, ref = _dynamic_case(expert_index, 2, 2, 3, seed=9)
    assert mapping.conditions.tolist() == [1, 1, 1]
    config = BlockwiseMatmulConfig(block_size=2, num_static_blocks=static, use_shard_on_block_dynamic_while=True)
    result = dynamic_while_blockwise_forward(x, routing, mapping, weights, config, "gather")
    assert int(result.computed_blocks) == 3  # the last pair holds block 2 once
    assert_close(result.output, ref, atol=1e-12, rtol=1e-12)


def test_dynamic_while_static_prefix_uses_the_matmul_impl_and_the_loop_gathers():
    x, routing, mapping, weights, ref = _dynamic_case(BALANCED, 3, 4, 5)
    with pytest.raises(ValueError, match=r"^matmul impl 'grouped_mm' does not apply to dtype torch\.float64"):
        dynamic_while_blockwise_forward(x, routing, mapping, weights,
                                        BlockwiseMatmulConfig(block_size=4, num_static_blocks=1,
                                                              use_shard_on_intermediate_dynamic_while=True),
                                        "grouped_mm")
    # no static prefix: every block goes through the loop, which multiplies by gathered weights (float64 is fine)
    result = dynamic_while_blockwise_forward(x, routing, mapping, weights,
                                             BlockwiseMatmulConfig(block_size=4, num_static_blocks=0,
                                                                   use_shard_on_intermediate_dynamic_while=True),
                                             "grouped_mm")
    assert_close(result.output, ref, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------- backends.py


class _Minimal(ExpertsBackend):
    """A backend with only the four algorithms: every other method is the base class's."""

    name = "minimal"

    def blockwise(self, hidden_states, routing, mapping, weights, config):
        return "blockwise"

    def capacity_factor(self, hidden_states, routing, capacity, weights):
        return "capacity_factor"

    def selective_loading(self, hidden_states, routing, weights):
        return "selective_loading"

    def all_experts(self, hidden_states, routing, weights):
        return "all_experts"


def _recorder(monkeypatch, name, result="result"):
    calls = []
    monkeypatch.setattr(backends_module, name, lambda *args: calls.append(args) or result)
    return calls


def test_backend_base_class_defaults():
    backend = _Minimal()
    assert (backend.fuses_addend, backend.fuses_layers) == (False, False)
    assert backend.supported_formats == frozenset({"bf16"}) and backend.supports_activation_quantization is False
    assert backend.mode_policy is NXD_POLICY
    assert backend.fused_decode(torch.zeros(1, 4), None, None, False, None) is None
    assert backend.fused_router(torch.zeros(1, 4), None) is None
    with pytest.raises(TypeError):
        ExpertsBackend()  # the four algorithms are abstract


def test_backend_select_mode_is_the_one_rule_under_its_policy(monkeypatch):
    backend = _Minimal()
    # NxD's rule: decode of T*k = 6 >= alpha*E = 4 pairs -> all experts; a 3-token prefill with a capacity factor
    # -> capacity factor; 10 dropless pairs over E = 4, B = 16 -> all experts (< one block), B = 8 -> blockwise
    assert backend.select_mode(3, 1, 2, 4, 16, None, 1.0) == ExpertsMode.ALL_EXPERTS
    assert backend.select_mode(3, 1, 2, 4, 16, None, 2.0) == ExpertsMode.SELECTIVE_LOADING  # 6 < 2 * 4
    assert backend.select_mode(3, 5, 2, 4, 16, 1.5, 1.0) == ExpertsMode.CAPACITY_FACTOR
    assert backend.select_mode_from_tokens(5, 2, 4, 16, 1.0) == ExpertsMode.ALL_EXPERTS
    assert backend.select_mode_from_tokens(5, 2, 4, 8, 1.0) == ExpertsMode.BLOCKWISE
    assert backend.select_mode_from_tokens(5, 2, 4, 8, 3.0) == ExpertsMode.SELECTIVE_LOADING  # 10 < 3 * 4
    calls = _recorder(monkeypatch, "select_mode")
    assert backend.select_mode(7, 3, 2, 9, 64, 1.25, 0.5) == "result"
    assert backend.select_mode_from_tokens(11, 4, 6, 32, 2.5) == "result"
    assert calls == [(7, 3, 2, 9, 64, 1.25, 0.5, NXD_POLICY), (11, None, 4, 6, 32, None, 2.5, NXD_POLICY)]

    class Pairs(_Minimal):
        mode_policy = ModePolicy(pairs_always=True)

    Pairs().select_mode_from_tokens(11, 4, 6, 32, 2.5)
    assert calls[-1] == (11, None, 4, 6, 32, None, 2.5, ModePolicy(pairs_always=True))


def test_backend_routing_and_mapping_defaults_are_the_shared_functions(monkeypatch):
    backend = _Minimal()
    routing_calls = _recorder(monkeypatch, "build_routing")
    local_calls = _recorder(monkeypatch, "local_routing")
    mapping_calls = _recorder(monkeypatch, "token_to_block_mapping")
    a, i, mask, pe, pw, slot = (torch.zeros(1) + v for v in range(6))
    assert backend.build_routing(a, i, 7, True, False, mask) == "result"
    assert backend.build_routing(a, i, 5, False, True) == "result"
    assert routing_calls == [(a, i, 7, True, False, mask), (a, i, 5, False, True, None)]
    assert backend.build_local_routing(pe, pw, slot, 3, True) == "result"
    assert local_calls == [(pe, pw, slot, 3, True)]
    routing = Routing(i, mask, a, False)
    assert backend.block_mapping(routing, None, 16, 9, False) == "result"
    assert backend.block_mapping(routing, None, 8, 5, True) == "result"
    assert mapping_calls == [(mask, i, 16, 9, False), (mask, i, 8, 5, True)]


def test_torch_backend_settings_policy_and_repr():
    default = TorchBackend()
    assert (default.matmul, default.pairs, default.name) == ("auto", False, "torch")
    assert repr(default) == "TorchBackend(matmul='auto')"
    assert default.mode_policy is NXD_POLICY
    paired = TorchBackend(matmul="gather", pairs=True)
    assert (paired.matmul, paired.pairs) == ("gather", True)
    assert repr(paired) == "TorchBackend(matmul='gather', pairs=True)"
    assert paired.mode_policy == ModePolicy(pairs_always=True)
    assert paired.select_mode(4096, None, 2, 8, 16, None, 1.0) == ExpertsMode.SELECTIVE_LOADING
    assert repr(TorchBackend("grouped_mm")) == "TorchBackend(matmul='grouped_mm')"
    assert TorchBackend.supported_formats == frozenset(QUANTIZATION_CHOICES)
    assert TorchBackend.supports_activation_quantization is True
    assert (TorchBackend.fuses_addend, TorchBackend.fuses_layers) == (False, False)
    with pytest.raises(ValueError) as err:
        TorchBackend(matmul="cublas")
    assert str(err.value) == "TorchBackend matmul must be one of ['auto', 'gather', 'grouped_mm'], got 'cublas'"
    with pytest.raises(TypeError) as err:
        TorchBackend(pairs=1)
    assert str(err.value) == "TorchBackend pairs must be a bool, got int 1"


@pytest.mark.parametrize("matmul", ["gather", "grouped_mm"])
def test_torch_backend_hands_each_algorithm_its_arguments(matmul, monkeypatch):
    backend = TorchBackend(matmul=matmul)
    h, routing, mapping, weights = object(), object(), object(), object()
    dynamic = _recorder(monkeypatch, "dynamic_while_blockwise_forward", DynamicWhileResult("dynamic out", None))
    plain = _recorder(monkeypatch, "blockwise_forward")
    capacity = _recorder(monkeypatch, "capacity_factor_forward")
    selective = _recorder(monkeypatch, "selective_loading_forward")
    every = _recorder(monkeypatch, "all_experts_forward")
    loop = BlockwiseMatmulConfig(use_shard_on_block_dynamic_while=True)
    assert backend.blockwise(h, routing, mapping, weights, loop) == "dynamic out"
    assert dynamic == [(h, routing, mapping, weights, loop, matmul)] and plain == []
    assert backend.blockwise(h, routing, mapping, weights, BlockwiseMatmulConfig()) == "result"
    assert plain == [(h, routing, mapping, weights, matmul)] and len(dynamic) == 1
    assert backend.capacity_factor(h, routing, 13, weights) == "result"
    assert capacity == [(h, routing, 13, weights)]
    assert backend.selective_loading(h, routing, weights) == "result"
    assert selective == [(h, routing, weights, matmul)]
    assert backend.all_experts(h, routing, weights) == "result"
    assert every == [(h, routing, weights)]


def test_torch_backend_pairs_are_cheapest_where_grouped_mm_multiplies_them():
    cpu = torch.device("cpu")
    dims = (16, 32, 16, 16)  # (H, 2I, I, H)
    assert TorchBackend().pairs_cheapest(cpu, F32, dims)
    assert TorchBackend("grouped_mm").pairs_cheapest(cpu, BF16, dims)
    assert not TorchBackend("gather").pairs_cheapest(cpu, F32, dims)
    assert not TorchBackend().pairs_cheapest(torch.device("xla"), F32, dims)
    assert not TorchBackend().pairs_cheapest(cpu, F64, dims)
    assert not TorchBackend().pairs_cheapest(cpu, F32, (16, 32, 6, 16))  # every projection's rows count


def test_backend_registry_and_lookup():
    assert BACKENDS == {"torch": "nxd_moe.experts.backends:TorchBackend",
                        "nki_sim": "nxd_moe.nki_kernels.backend:NkiSimBackend",
                        "triton": "nxd_moe.triton_kernels.backend:TritonBackend"}
    mine = TorchBackend(matmul="gather")
    assert get_backend(mine) is mine
    fresh = get_backend("torch")
    assert type(fresh) is TorchBackend and (fresh.matmul, fresh.pairs) == ("auto", False)
    assert type(get_backend("nki_sim")).__name__ == "NkiSimBackend"
    with pytest.raises(ValueError) as err:
        get_backend("cuda")
    assert str(err.value) == "backend must be one of ['nki_sim', 'torch', 'triton'] or an ExpertsBackend, got 'cuda'"


def test_check_backend_supports_names_the_format_and_the_backends_that_do():
    check_backend_supports(_Minimal(), "bf16")
    check_backend_supports(_Minimal(), "bf16", "none")
    for fmt in QUANTIZATION_CHOICES:
        check_backend_supports(TorchBackend(), fmt, "fp8")
    with pytest.raises(ValueError) as err:
        check_backend_supports(_Minimal(), "mxfp4")
    assert str(err.value) == ("backend 'minimal' does not support quantization='mxfp4'; it supports ['bf16'] (the "
                              "'torch' backend supports ['bf16', 'fp8', 'fp8_block', 'mxfp4'])")
    with pytest.raises(ValueError) as err:
        check_backend_supports(_Minimal(), "bf16", "fp8")
    assert str(err.value) == ("backend 'minimal' does not support activation_quantization='fp8' (FP8 activations, "
                              "W8A8); the 'torch' and 'triton' backends do")


def test_dynamic_while_default_impl_and_the_matmul_each_part_is_given(monkeypatch):
    import nxd_moe.experts.dynamic_while as dynamic_while_module

    x, routing, mapping, weights, ref = _dynamic_case(BALANCED, 3, 4, 5)
    impls = []
    original = dynamic_while_module.grouped_expert_mlp

    def spy(x, weights, group_expert, group_active=None, impl="auto"):
        impls.append(impl)
        return original(x, weights, group_expert, group_active, impl)

    monkeypatch.setattr(dynamic_while_module, "grouped_expert_mlp", spy)
    config = BlockwiseMatmulConfig(block_size=4, num_static_blocks=1, use_shard_on_intermediate_dynamic_while=True)
    result = dynamic_while_blockwise_forward(x.float(), routing, mapping, weights._replace(
        **{name: getattr(weights, name).float() for name in ("gate_up_proj", "down_proj", "gate_up_bias",
                                                              "down_bias")}), config)
    # the static block through the default "auto", then blocks 1 and 2 one by one through gathered weights
    assert impls == ["auto", "gather", "gather"] and int(result.computed_blocks) == 3
    assert_close(result.output, ref, atol=1e-5, rtol=1e-5)  # fp32: 8 + 4 terms of O(1) values per GEMM

