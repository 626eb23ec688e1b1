"""The plain parts a backend's fused layer takes (:mod:`nxd_moe.layer_parts`): which modules give them, and the
triton backend's one-launch decode built from them (on a CPU in Triton's interpreter) against the torch backend's
layer on the same weights -- router, routing, experts, shared expert and combine in one launch."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rounding_close, randn, rounding_tolerance

from nxd_moe.build import build_moe
from nxd_moe.routing.topk import RouterTopK
from nxd_moe.triton_kernels.backend import TritonBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layers(name: str, seed: int = 3):
    torch_layer = build_moe(name, scale=64, seed=seed, dtype=torch.float32, device=DEVICE)
    triton_layer = build_moe(name, scale=64, seed=seed, dtype=torch.float32, device=DEVICE,
                             backend=TritonBackend(one_launch=True))
    return torch_layer, triton_layer


def _fused_calls(layer) -> list:
    backend = layer.expert_mlps.backend
    calls, original = [], backend.fused_decode
    backend.fused_decode = lambda *a: calls.append(original(*a)) or calls[-1]
    return calls


@pytest.mark.parametrize("name, fused", [("qwen3-30b-a3b", True), ("gpt-oss-20b", True), ("llama4-scout", True),
                                         ("deepseek-v3", False)])
def test_one_launch_decode_from_parts_equals_the_torch_layer(name, fused):
    """Qwen3 (softmax over all experts, normalised), GPT-OSS (softmax over the chosen, router bias), Llama 4
    (sigmoid, a shared expert fused in) decode in one launch; DeepSeek-V3's group-limited router has no fused
    form, so its layer runs unfused. Each equals the torch backend within fp32 rounding of its depth."""
    torch_layer, triton_layer = _layers(name)
    calls = _fused_calls(triton_layer)
    x = randn(3, 1, torch_layer.router.hidden_size, seed=11).to(DEVICE)
    with torch.no_grad():
        expected, actual = torch_layer(x)[0], triton_layer(x)[0]
    assert len(calls) == 1 and (calls[0] is not None) == fused, name
    depth = max(torch_layer.router.hidden_size, torch_layer.expert_mlps.routed_experts_mlp_config.intermediate_size)
    assert_rounding_close(actual, expected, rounding_tolerance(torch.float32, depth), name)


def test_a_router_that_changes_its_logits_is_run_as_it_is():
    """A RouterTopK subclass that computes other logits has no fused parts, so the layer follows its override (the
    negative control: fused, the override would be skipped and the output would be the plain router's)."""

    class ScaledLogits(RouterTopK):
        def get_router_logits(self, hidden_states):
            return 3.0 * super().get_router_logits(hidden_states)

    plain, layer = _layers("qwen3-30b-a3b")
    scaled = ScaledLogits(layer.router.num_experts, layer.router.top_k, layer.router.hidden_size).to(DEVICE)
    scaled.load_state_dict(layer.router.state_dict())
    layer.router = scaled
    assert scaled.fused_parts() is None and plain.router.fused_parts() is not None
    calls = _fused_calls(layer)
    x = randn(2, 1, plain.router.hidden_size, seed=5).to(DEVICE)
    plain.router = ScaledLogits(scaled.num_experts, scaled.top_k, scaled.hidden_size).to(DEVICE)
    plain.router.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        expected, actual = plain(x)[0], layer(x)[0]
    assert calls == [None]
    assert_rounding_close(actual, expected, rounding_tolerance(torch.float32, plain.router.hidden_size))


def test_fused_parts_are_given_only_where_a_kernel_computes_exactly_the_router():
    router = RouterTopK(8, 2, 16, act_fn="sigmoid", apply_act_fn_over_topk=True, bias=True)
    parts = router.fused_parts()
    assert parts.weight is router.linear_router.weight and parts.bias is router.linear_router.bias
    assert (parts.top_k, parts.sigmoid, parts.act_over_topk, parts.normalize, parts.padding) == (2, True, True,
                                                                                                  False, None)
    assert RouterTopK(8, 2, 16, dtype=torch.bfloat16).fused_parts() is None  # the kernels route in fp32
    jittery = RouterTopK(8, 2, 16, jitter_eps=0.1).train()
    assert jittery.fused_parts() is None and jittery.eval().fused_parts() is not None
    softmax = RouterTopK(8, 3, 16).fused_parts()
    assert (softmax.top_k, softmax.sigmoid, softmax.act_over_topk, softmax.bias) == (3, False, False, None)
    # a subclass that overrides any of the three methods the kernels re-implement is run as it is
    for method in ("forward", "get_router_logits", "apply_activation_fn"):
        base = getattr(RouterTopK, method)
        subclass = type("Overriding", (RouterTopK,), {method: lambda self, *args, base=base: base(self, *args)})
        assert subclass(8, 2, 16).fused_parts() is None, method
    assert type("Plain", (RouterTopK,), {})(8, 2, 16).fused_parts() is not None
