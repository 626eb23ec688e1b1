"""``ExpertMLPsV2(..., backend="nki_sim")`` runs the kernel its configuration selects and computes what the torch
backend and the float64 dense reference compute: every mode, every activation family, biases, early affinity
modulation, padded tokens, top-1."""

from __future__ import annotations

import pytest
import torch
from conftest import ACTIVATIONS, FP32_ATOL, assert_close, make_experts, random_routing
from nki_helpers import max_all_close

from nxd_moe import TorchBackend, build_moe
from nxd_moe.experts.backends import get_backend
from nxd_moe.nki_kernels.backend import NkiSimBackend
from nxd_moe.nki_kernels.kernels import expert_mlp
from nxd_moe.reference import reference_for_experts, reference_for_moe

TOKENS = {"blockwise": 160, "selective_loading": 3, "all_experts": 6}


def experts_on(backend, dtype=torch.float32, activation="glu_silu", top_k=2, blockwise=None, **overrides):
    experts = make_experts(num_experts=4, hidden_size=256, intermediate_size=256, top_k=top_k, block_size=256,
                           dtype=dtype, activation=activation, blockwise=blockwise, **overrides)
    experts.backend = backend
    return experts


def inputs(tokens: int, dtype, top_k: int = 2, padded: bool = True, seed: int = 1):
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed)).to(dtype)
    affinities, index = random_routing(tokens, 4, top_k, seed=seed + 1)
    mask = None
    if padded:
        mask = torch.ones(tokens, dtype=torch.bool)
        mask[1] = False
    return x, affinities, index, mask


def reference(experts, x, affinities, index, mask):
    keep = None if mask is None else mask.unsqueeze(1).expand_as(index)
    return reference_for_experts(experts, x, affinities, index, keep=keep)


def test_nki_sim_is_a_registered_backend():
    backend = get_backend("nki_sim")
    assert isinstance(backend, NkiSimBackend) and backend.name == "nki_sim"
    with pytest.raises(ValueError, match=r"decode_lnc must be in \[1, 2\]"):
        NkiSimBackend(decode_lnc=3)


@pytest.mark.parametrize("mode", list(TOKENS))
@pytest.mark.parametrize("variant", [*ACTIVATIONS, "prescale"])
def test_matches_torch_backend_and_reference_in_fp32(mode, variant):
    overrides = {"bias": True}
    activation = variant
    if variant == "prescale":
        activation, overrides = "glu_silu", {"bias": True, "early_expert_affinity_modulation": True}
    backend = NkiSimBackend()
    experts = experts_on(backend, activation=activation, blockwise={"skip_dma_token": True, "skip_dma_weight": True},
                         **overrides)
    x, affinities, index, mask = inputs(TOKENS[mode], torch.float32)
    out = experts(x, affinities, index, padding_mask=mask, mode=mode)
    assert backend.last_kernel.startswith({"blockwise": "bwmm", "selective_loading": "moe_tkg_selective",
                                "all_experts": "moe_tkg_all"}[mode])
    assert_close(out, reference(experts, x, affinities, index, mask), atol=FP32_ATOL, msg=f"{mode} {variant}")
    experts.backend = TorchBackend()
    assert_close(out, experts(x, affinities, index, padding_mask=mask, mode=mode), atol=FP32_ATOL)
    assert (out[1] == 0).all(), "a padded token's row is zero"


@pytest.mark.parametrize("mode", list(TOKENS))
@pytest.mark.parametrize("lnc", [1, 2])
def test_bf16_within_upstream_tolerance(mode, lnc):
    backend = NkiSimBackend(decode_lnc=lnc)
    experts = experts_on(backend, dtype=torch.bfloat16, activation="swiglu_gptoss", bias=True,
                         blockwise={"logical_nc_config": lnc, "skip_dma_token": True, "skip_dma_weight": True})
    x, affinities, index, mask = inputs(TOKENS[mode], torch.bfloat16)
    out = experts(x, affinities, index, padding_mask=mask, mode=mode)
    max_all_close(out.float().numpy(), reference(experts, x, affinities, index, mask).numpy())
    assert backend.last_run.lnc == lnc


CONFIGS = {
    "bwmm_shard_on_H": {},
    "bwmm_shard_on_I[dynamic]": {"use_shard_on_intermediate_dynamic_while": True},
    "bwmm_shard_on_block[HI_LO]": {"use_block_parallel": True},
    "bwmm_shard_on_block[PING_PONG,dynamic]": {"use_shard_on_block_dynamic_while": True,
                                                "block_sharding_strategy": "PING_PONG"},
    "bwmm_shard_on_block[HI_LO,dynamic]": {"use_shard_on_block_dynamic_while": True},
}


@pytest.mark.parametrize("kernel", list(CONFIGS))
def test_the_config_selects_the_kernel(kernel):
    backend = NkiSimBackend()
    experts = experts_on(backend, blockwise={"logical_nc_config": 2, **CONFIGS[kernel]})
    x, affinities, index, mask = inputs(TOKENS["blockwise"], torch.float32)
    out = experts(x, affinities, index, padding_mask=mask, mode="blockwise")
    assert backend.last_kernel == kernel
    assert_close(out, reference(experts, x, affinities, index, mask), atol=FP32_ATOL)


def test_top1_writes_every_row_once():
    """top-1 without padding: the output is not zero-initialised (each row written by exactly one block); fresh HBM
    is NaN, so a token the kernel missed would show."""
    backend = NkiSimBackend()
    experts = experts_on(backend, top_k=1)
    x, affinities, index, _ = inputs(300, torch.float32, top_k=1, padded=False)
    out = experts(x, affinities, index, mode="blockwise")
    assert torch.isfinite(out).all()
    assert_close(out, reference(experts, x, affinities, index, None), atol=FP32_ATOL)


def test_capacity_factor_delegates_to_the_torch_backend():
    backend = NkiSimBackend()
    experts = experts_on(backend, capacity_factor=1.0)
    x, affinities, index, _ = inputs(64, torch.float32, padded=False)
    out, stats = experts(x, affinities, index, return_stats=True)
    assert stats.mode.value == "capacity_factor" and backend.last_run is None  # no kernel ran
    experts.backend = TorchBackend()
    expected, expected_stats = experts(x, affinities, index, return_stats=True)
    assert torch.equal(out, expected)
    assert int(stats.dropped_tokens) == int(expected_stats.dropped_tokens) > 0


def test_float64_is_rejected():
    experts = experts_on(NkiSimBackend(), dtype=torch.float64)
    x, affinities, index, _ = inputs(8, torch.float64, padded=False)
    with pytest.raises(TypeError, match="nki_sim backend runs Trainium dtypes"):
        experts(x, affinities, index, mode="all_experts")


def test_a_whole_moe_layer_prefill_and_decode():
    moe = build_moe("mixtral-8x7b", scale=32, seed=0, backend="nki_sim",
                    block_logical_nc_config=2, block_use_shard_on_intermediate_dynamic_while=True,
                    block_skip_dma_token=True)
    backend = moe.expert_mlps.backend
    hidden = moe.expert_mlps.routed_experts_mlp_config.hidden_size
    gen = torch.Generator().manual_seed(3)
    prefill = torch.randn(1, 256, hidden, generator=gen)
    decode = torch.randn(4, 1, hidden, generator=gen)
    with torch.no_grad():
        for x, kernel in ((prefill, "bwmm_shard_on_I[dynamic]"), (decode, "moe_tkg_all_expert")):
            out = moe(x)[0]
            assert backend.last_kernel == kernel
            assert_close(out, reference_for_moe(moe, x), atol=5e-5)


@pytest.mark.parametrize("mode", ["selective_loading", "all_experts"])
@pytest.mark.parametrize("prescale", [False, True])
def test_decode_streams_weights_that_do_not_fit(mode, prescale, monkeypatch):
    """Decode with the expert's weights loaded in 128-column pieces: the pieces' outputs add up, the down bias is
    added once per expert."""
    monkeypatch.setattr(expert_mlp, "WEIGHT_SBUF_BUDGET", 1024)
    backend = NkiSimBackend(decode_lnc=2)
    experts = experts_on(backend, activation="swiglu_gptoss", bias=True, early_expert_affinity_modulation=prescale)
    x, affinities, index, mask = inputs(TOKENS[mode], torch.float32)
    out = experts(x, affinities, index, padding_mask=mask, mode=mode)
    assert_close(out, reference(experts, x, affinities, index, mask), atol=FP32_ATOL)
    loads = TOKENS[mode] * 2 if mode == "selective_loading" else 4
    assert backend.last_run.accounting.dma_bytes("gate_up_proj_weight") == loads * 256 * 2 * 256 * 4
