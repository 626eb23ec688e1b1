"""Under ``torch_xla`` (CPU client): every expert mode, both routers, shared experts and the padding mask trace to
one XLA graph for three routings (one sends every token to the same experts), compile once, match eager, run no
operator on the host and transfer nothing mid-layer. Negative controls show the check fails on data-dependent
code. Runs in the XLA environment (``pip install -e '.[xla]'``); skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")

import torch  # noqa: E402
from conftest import (  # noqa: E402
    ItemExperts,
    NonzeroExperts,
    make_config,
    make_experts,
    make_router,
    make_shared,
    randn,
    random_routing,
)

from nxd_moe import MoE  # noqa: E402
from nxd_moe.experts.while_loop import while_loop  # noqa: E402
from nxd_moe.trace import check_static, export_hlo, moe_inputs  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN, BLOCK = 8, 2, 16, 4
ATOL = 1e-5

# name: (expected mode, tokens, prefill|decode, capacity_factor, BlockwiseMatmulConfig overrides)
MODES = {
    "blockwise": ("blockwise", 16, "prefill", None, {}),
    "dynamic_while_intermediate": ("blockwise", 16, "prefill", None,
                                   dict(use_shard_on_intermediate_dynamic_while=True, num_static_blocks=0)),
    "dynamic_while_block": ("blockwise", 16, "prefill", None, dict(use_shard_on_block_dynamic_while=True)),
    "capacity_factor": ("capacity_factor", 16, "prefill", 1.0, {}),
    "selective_loading": ("selective_loading", 2, "decode", None, {}),
    "all_experts": ("all_experts", 8, "decode", None, {}),
}
ROUTERS = ("topk_softmax", "group_limited")


def build(mode: str, router_kind: str, shared: bool = True) -> MoE:
    _, _, _, capacity_factor, blockwise = MODES[mode]
    experts = make_experts(make_config(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                                       capacity_factor=capacity_factor, bias=True, normalize_top_k_affinities=True),
                           block_size=BLOCK, seed=1, blockwise=blockwise)
    router = make_router(router_kind, NUM_EXPERTS, TOP_K, HIDDEN, seed=2)
    return MoE(router, experts, make_shared(HIDDEN, shared_expert_gate=True) if shared else None).eval()


def assert_static(report):
    assert report.graphs == 1, report
    assert report.compilations == 1, report
    assert report.executions_during_trace == 0 and report.transfers_during_trace == 0, report
    assert report.executions_per_step == [1] * report.routings, report
    assert report.fallback_ops == [], report
    assert report.output_fetch_transfers >= report.routings  # the final fetch is counted, apart
    assert report.matches_eager, report
    assert report.static and report.ok


@pytest.mark.parametrize("router_kind", ROUTERS)
@pytest.mark.parametrize("mode", list(MODES))
def test_one_static_graph_for_every_mode_and_router(mode, router_kind):
    expected_mode, tokens, phase, _, _ = MODES[mode]
    moe = build(mode, router_kind)
    make = moe_inputs(moe, tokens, phase, padding=True)
    with torch.no_grad():
        assert moe(*make(1), return_stats=True)[-1].mode.value == expected_mode
    report = check_static(moe, make, n=3, atol=ATOL)
    assert_static(report)
    if mode.startswith("dynamic_while"):
        assert report.blocks_match_schedule, report.blocks
        counts = [step[0] for step in report.blocks]
        assert all(c.computed == c.expected for c in counts)
        assert counts[0].computed < counts[0].num_blocks  # all tokens on k experts: padding blocks skipped
        if mode == "dynamic_while_intermediate":  # no static prefix, one block per iteration
            assert [c.computed for c in counts] == [c.active for c in counts]
    else:
        assert report.blocks == [[], [], []]


def test_plain_layer_without_shared_experts_or_padding():
    moe = build("blockwise", "topk_softmax", shared=False)
    assert_static(check_static(moe, moe_inputs(moe, 12, "prefill"), n=3, atol=ATOL))


def test_check_static_needs_several_routings():
    with pytest.raises(ValueError, match="n must be an int >= 2"):
        check_static(build("blockwise", "topk_softmax"), moe_inputs(build("blockwise", "topk_softmax"), 4), n=1)


# ----------------------------------------------------------------------------------------------------------
# negative controls: the check can fail


def routed_inputs(i: int):
    return randn(12, HIDDEN, seed=4), random_routing(12, 4, 2, seed=5 + i, skew=float(i))[1]


@pytest.mark.parametrize("module_cls, host_op", [(NonzeroExperts, "aten::nonzero"),
                                                  (ItemExperts, "aten::_local_scalar_dense")])
def test_data_dependent_module_is_not_static(module_cls, host_op):
    report = check_static(module_cls(), routed_inputs, n=3, atol=ATOL)
    assert not report.static and not report.ok
    assert host_op in report.fallback_ops  # the operator torch_xla had to run on the CPU
    assert report.graphs > 1  # every routing count gives another graph
    assert report.executions_during_trace > 0 and report.transfers_during_trace > 0  # host syncs inside the layer
    assert report.matches_eager  # it is still correct: only static-ness fails


def test_validate_inputs_layer_is_not_static():
    """Our own NaN / index checks read data on the host: the check must flag them."""
    experts = make_experts(make_config(num_experts=4, top_k=2), block_size=BLOCK, validate_inputs=True, seed=6)

    def make(i):
        affinities, expert_index = random_routing(12, 4, 2, seed=7 + i)
        return randn(12, HIDDEN, seed=8), affinities, expert_index

    report = check_static(experts, make, n=2, atol=ATOL)
    assert report.transfers_during_trace > 0 and not report.static


# ----------------------------------------------------------------------------------------------------------
# the loop primitive


def test_while_loop_on_pending_inputs_is_an_xla_while():
    """Inputs computed in the same lazy graph (not materialised) -- the case torch_xla's own lowering of the
    while_loop op cannot handle -- give a ``while`` whose trip count is read on the device."""
    device = torch_xla.device()
    raw = torch.tensor([3.0, 1.0, 2.0, -1.0, -5.0, 0.5], device=device)
    torch_xla.sync()
    active = torch.cat([(raw > 0).to(torch.int32), raw.new_zeros(1, dtype=torch.int32)])  # pending
    values = raw * 10  # pending

    def cond(i, acc, active, values):
        return active.index_select(0, i.view(1)).squeeze(0) != 0

    def body(i, acc, active, values):
        return i + 1, acc + values.index_select(0, i.view(1)).squeeze(0)

    zero = torch.zeros((), dtype=torch.int64, device=device)
    i, acc = while_loop(cond, body, (zero, torch.zeros((), device=device)), (active, values))
    assert "while" in torch_xla._XLAC._get_xla_tensors_hlo([i, acc])
    assert int(i.cpu()) == 3 and float(acc.cpu()) == pytest.approx(60.0)


def test_while_loop_body_must_keep_the_carried_shapes():
    device = torch_xla.device()
    x = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="body_fn must return tensors with the shapes and dtypes of carried"):
        while_loop(lambda i, x: i < 2, lambda i, x: (i + 1, x[:2]), (torch.zeros((), device=device), x))


@pytest.mark.parametrize("quantization", ["fp8", "mxfp4"])
@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_experts_are_one_static_graph(mode, quantization):
    """FP8 / MxFP4 expert weights (routed, and shared ones asked to be quantized) enter the graph as stored
    (8-bit / packed 4-bit) and are dequantized inside it."""
    from nxd_moe.quantization.quantizer import quantize_experts
    from nxd_moe.shared_experts import SharedExperts

    _, tokens, phase, capacity_factor, blockwise = MODES[mode]
    experts = make_experts(make_config(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, intermediate_size=64,
                                       capacity_factor=capacity_factor, bias=True), block_size=BLOCK, seed=1,
                           blockwise=blockwise)
    shared = SharedExperts(64, 64, 1, "silu", model_parallel=False, quantization=quantization)
    moe = MoE(make_router("topk_softmax", NUM_EXPERTS, TOP_K, 64, seed=2), quantize_experts(experts, quantization),
              shared)
    assert_static(check_static(moe.eval(), moe_inputs(moe, tokens, phase, padding=True), n=3, atol=ATOL))


@pytest.mark.parametrize("quantization, stored", [("fp8", "f8e4m3fn["), ("mxfp4", "u8[")])
@pytest.mark.parametrize("mode", ["dynamic_while_intermediate", "dynamic_while_block"])
def test_the_dynamic_while_loop_carries_the_stored_quantized_weights(mode, quantization, stored, tmp_path):
    """The loop's state holds the weights as stored (FP8 / packed MxFP4), not a dequantized bf16 copy."""
    from nxd_moe.quantization.quantizer import quantize_experts

    _, tokens, phase, _, blockwise = MODES[mode]
    experts = make_experts(make_config(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, intermediate_size=64,
                                       bias=True), block_size=BLOCK, seed=1, blockwise=blockwise)
    moe = MoE(make_router("topk_softmax", NUM_EXPERTS, TOP_K, 64, seed=2), quantize_experts(experts, quantization))
    report = export_hlo(moe.eval(), moe_inputs(moe, tokens, phase)(1), tmp_path, atol=ATOL)
    assert report["static"] and report["matches_eager"] and report["while_ops"] == 1, report
    loop_lines = [line for line in (tmp_path / "model.hlo.txt").read_text().splitlines() if " while(" in line]
    assert len(loop_lines) == 1 and loop_lines[0].count(stored) >= 2, loop_lines  # gate_up and down


def test_a_router_wrong_on_the_device_fails_though_eager_follows_its_routing():
    """Negative control for the pinned comparison (eager routed as XLA routed): router logits that go wrong only
    under XLA change the routing both sides then use, so the outputs agree -- and the logits' own comparison
    fails."""
    moe = build("blockwise", "topk_softmax")

    class SkewedOnTheDevice(type(moe.router)):
        def get_router_logits(self, hidden_states):
            logits = super().get_router_logits(hidden_states)
            skew = torch.arange(NUM_EXPERTS, dtype=logits.dtype, device=logits.device)
            return logits + skew if hidden_states.device.type == "xla" else logits

    moe.router.__class__ = SkewedOnTheDevice
    report = check_static(moe, moe_inputs(moe, 12, "prefill"), n=2, atol=ATOL)
    assert report.static and report.max_abs_diff <= ATOL, report
    assert report.router_logits_max_abs_diff >= 1.0 and not report.matches_eager and not report.ok, report
    assert sum(report.routing_flips) > 0, report
