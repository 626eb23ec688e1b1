"""Quantized expert weights: formats, the quantized layer in every mode and backend, checkpoints, bad input.

The layer tests compare a quantized layer with a bf16 layer holding its dequantized weights (same function, tight
tolerance) and report the quantization error against the original weights with a bound per format.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
from conftest import FP32_ATOL, MODES, assert_close, make_config, make_experts, randn, random_routing

from nxd_moe.build import build_moe
from nxd_moe.config import load_model_config
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts.backends import ExpertsBackend, TorchBackend, get_backend
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.quantization import FORMATS, QuantizedWeight, Shape, dequantized, get_format
from nxd_moe.quantization.formats import k_fastest
from nxd_moe.quantization.quantizer import expert_weight_bytes, quantize_experts, quantize_shared_experts
from nxd_moe.reference import reference_for_experts

QUANTIZED = ("fp8", "fp8_block", "mxfp4")
H = I = 128  # fp8_block's 128x128 tiles must divide both
# Max |quantized layer - original layer| relative to max |original output|: E4M3 keeps 3 mantissa bits, E2M1 one.
LAYER_ERROR_BOUND = {"fp8": 0.06, "fp8_block": 0.06, "mxfp4": 0.3}


def weights(shape=(3, 128, 256), seed=0, scale=1.0):
    return randn(*shape, seed=seed, scale=scale)


# ----------------------------------------------------------------------------------------------------------
# formats


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_within_the_format_bound(name):
    fmt = get_format(name)
    w = weights()
    w[0, :, 0] = 0.0  # an all-zero channel / block keeps a valid scale and dequantizes to exact zeros
    w[1, 5, 7] = 1e-4  # tiny next to its block: FP8 subnormals, MxFP4 flush
    data, scale = fmt.quantize(w)
    fmt.check(data, scale, Shape(*w.shape), "w")
    back = fmt.dequantize(data, scale, torch.float64)
    err = (back - w).abs()
    assert torch.equal(back[0, :, 0], torch.zeros(128, dtype=torch.float64))
    if name == "mxfp4":
        # Per element at most half the spacing of E2M1 at the top of the block's range (1 * 2**e), and no
        # value saturates: the block's max becomes at most 6 * 2**e.
        step = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)
        assert bool((err <= step).all())
        block_max = w.abs().reshape(3, 4, 32, 256).amax(2).repeat_interleave(32, dim=1)
        assert bool((err <= block_max / 3 + 1e-12).all())
    else:
        # E4M3: relative 2**-4 for normals, 2**-10 * scale absolute for subnormals.
        full_scale = scale.double()
        if name == "fp8_block":
            full_scale = full_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
        assert bool((err <= 2 ** -4 * w.abs() + 2 ** -10 * full_scale).all())
    print(f"{name}: round-trip max |err| {err.max():.3e}, mean |err| / mean |w| {err.mean() / w.abs().mean():.3e}")


@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantizing_one_expert_at_a_time_stores_the_same_bytes(name, k_major):
    fmt = get_format(name)
    w = weights()
    data, scale = fmt.quantize_by_expert(w, k_major)
    whole, whole_scale = fmt.quantize(w)
    assert torch.equal(data.view(torch.uint8), whole.view(torch.uint8)) and torch.equal(scale, whole_scale)
    assert data.stride() == (k_fastest(whole) if k_major else whole).stride()


def test_mxfp4_rounds_to_nearest_even_and_packs_low_nibble_first():
    # Block max 6 -> scale 2**0. Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    values = torch.tensor([6.0, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -5.0, 0.4, -1.1] + [0.0] * 22)
    expected = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, -4.0, 0.5, -1.0] + [0.0] * 22)
    fmt = get_format("mxfp4")
    data, scale = fmt.quantize(values.view(1, 32, 1))
    assert scale.item() == 127
    assert data[0, 0, 0].item() == 0x07  # 6.0 = code 7 (low), -0.25 -> +0 (high nibble 0)
    assert data[0, 3, 0].item() == (0x0E << 4) | 0x06  # elements 6, 7: 3.5 -> 4.0 (code 6), -5 -> -4.0 (8 | 6)
    assert torch.equal(fmt.dequantize(data, scale, torch.float32).view(-1), expected)


def test_fp8_scales_are_per_channel_and_per_tile():
    w = weights((2, 256, 256))
    w[1, :128, 128:] *= 100  # one tile much larger
    _, per_channel = get_format("fp8").quantize(w)
    _, per_tile = get_format("fp8_block").quantize(w)
    assert per_channel.shape == (2, 1, 256) and per_tile.shape == (2, 2, 2)
    assert torch.allclose(per_channel[0, 0], w[0].abs().amax(0) / 448)
    assert torch.allclose(per_tile[1, 0, 1], w[1, :128, 128:].abs().max() / 448)
    assert per_tile[1, 0, 1] > 50 * per_tile[1, 1, 1]


def test_quantized_weight_selects_and_dequantizes_only_the_chosen_experts():
    w = weights()
    for name in QUANTIZED:
        fmt = get_format(name)
        qw = QuantizedWeight.create(fmt, *fmt.quantize(w), torch.float32)
        assert qw.shape == (3, 128, 256)
        full = dequantized(qw)
        idx = torch.tensor([2, 0, 2])
        assert torch.equal(qw.index_select(0, idx), full.index_select(0, idx))
        assert qw.stored_bytes == fmt.stored_bytes(qw.shape)
    # bytes relative to bf16 (2 bytes a value): fp8 ~1/2, mxfp4 ~1/4, scales included
    bf16 = 2 * w.numel()
    assert FORMATS["fp8"].stored_bytes(Shape(3, 128, 256)) == w.numel() + 3 * 256 * 4
    assert FORMATS["mxfp4"].stored_bytes(Shape(3, 128, 256)) == w.numel() // 2 + w.numel() // 32
    assert FORMATS["mxfp4"].stored_bytes(Shape(3, 128, 256)) / bf16 == pytest.approx(0.25 + 1 / 64)


# ----------------------------------------------------------------------------------------------------------
# the layer


def layer_pair(name, dtype=torch.float32, blockwise=None, backend=None, **overrides):
    """(original bf16 layer, quantized copy, bf16 layer holding the dequantized weights)."""
    kwargs = dict(num_experts=4, hidden_size=H, intermediate_size=I, top_k=2, capacity_factor=1.0,
                  activation="swiglu_gptoss", bias=True)
    kwargs.update(overrides)
    original = make_experts(make_config(**kwargs), block_size=4, dtype=dtype, seed=1, blockwise=blockwise)
    quantized = make_experts(make_config(**kwargs), block_size=4, dtype=dtype, seed=1, blockwise=blockwise)
    quantize_experts(quantized, name)
    if backend is not None:
        quantized.backend = backend
    holding = make_experts(make_config(**kwargs), block_size=4, dtype=dtype, seed=1, blockwise=blockwise)
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            getattr(holding.mlp_op, proj).weight.copy_(dequantized(getattr(quantized.mlp_op, proj).stored_weight()))
    return original, quantized, holding


def inputs(num_tokens=12):
    x = randn(num_tokens, H, seed=2)
    affinities, expert_index = random_routing(num_tokens, 4, 2, seed=3)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[1] = False
    return x, affinities, expert_index, mask


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("matmul", ["gather", "grouped_mm"])
def test_quantized_layer_equals_layer_holding_dequantized_weights_in_every_mode(name, matmul):
    original, quantized, holding = layer_pair(name)
    quantized.backend = TorchBackend(matmul=matmul)
    holding.backend = TorchBackend(matmul=matmul)
    x, affinities, expert_index, mask = inputs()
    with torch.no_grad():
        for mode in MODES:
            out = quantized(x, affinities, expert_index, padding_mask=mask, mode=mode)
            assert_close(out, holding(x, affinities, expert_index, padding_mask=mask, mode=mode), FP32_ATOL,
                         msg=f"{name} {mode}")
            ref = reference_for_experts(quantized, x, affinities, expert_index, keep=None)
            if mode != "capacity_factor":
                assert_close(out * mask[:, None], ref * mask[:, None], FP32_ATOL, msg=f"{name} {mode} vs float64")
            # reported, not hidden: the error against the unquantized weights, within the format's bound
            base = original(x, affinities, expert_index, padding_mask=mask, mode=mode)
            rel = float((out - base).abs().max() / base.abs().max())
            print(f"{name} {mode}: max |quantized - original| / max |original| = {rel:.3e}")
            assert 0 < rel < LAYER_ERROR_BOUND[name]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("loop", ["use_shard_on_intermediate_dynamic_while", "use_shard_on_block_dynamic_while"])
def test_quantized_dynamic_while(name, loop):
    _, quantized, holding = layer_pair(name, blockwise={loop: True, "num_static_blocks": 1})
    x, affinities, expert_index, mask = inputs()
    with torch.no_grad():
        assert_close(quantized(x, affinities, expert_index, padding_mask=mask, mode="blockwise"),
                     holding(x, affinities, expert_index, padding_mask=mask, mode="blockwise"), FP32_ATOL, msg=name)


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_layer_in_bfloat16(name):
    _, quantized, holding = layer_pair(name, dtype=torch.bfloat16)
    x, affinities, expert_index, _ = inputs()
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        for mode in ("blockwise", "selective_loading"):
            out = quantized(x, affinities.to(torch.bfloat16), expert_index, mode=mode)
            assert out.dtype == torch.bfloat16
            assert torch.equal(out, holding(x, affinities.to(torch.bfloat16), expert_index, mode=mode))


def test_state_dict_names_dtypes_and_reload():
    for name, (wdtype, sdtype, gu_shape, gu_scale) in {
        "fp8": (torch.float8_e4m3fn, torch.float32, (4, H, 2 * I), (4, 1, 2 * I)),
        "fp8_block": (torch.float8_e4m3fn, torch.float32, (4, H, 2 * I), (4, 1, 2)),
        "mxfp4": (torch.uint8, torch.uint8, (4, H // 2, 2 * I), (4, H // 32, 2 * I)),
    }.items():
        _, quantized, _ = layer_pair(name)
        sd = quantized.state_dict()
        assert list(sd) == ["mlp_op.gate_up_proj.weight", "mlp_op.gate_up_proj.scale", "mlp_op.gate_up_proj.bias",
                            "mlp_op.down_proj.weight", "mlp_op.down_proj.scale", "mlp_op.down_proj.bias"]
        assert (sd["mlp_op.gate_up_proj.weight"].dtype, sd["mlp_op.gate_up_proj.scale"].dtype) == (wdtype, sdtype)
        assert tuple(sd["mlp_op.gate_up_proj.weight"].shape) == gu_shape
        assert tuple(sd["mlp_op.gate_up_proj.scale"].shape) == gu_scale
        assert sd["mlp_op.gate_up_proj.bias"].dtype == torch.float32
        buffer = io.BytesIO()
        torch.save(sd, buffer)
        buffer.seek(0)
        fresh = ExpertMLPsV2(quantized.routed_experts_mlp_config, quantized.blockwise_matmul_config)
        fresh.load_state_dict(torch.load(buffer))
        if name == "mxfp4":  # stored K-fastest (GPT-OSS's byte order), by the quantizer and by a fresh layer
            for layer in (quantized, fresh):
                assert all(p.weight.stride(1) == 1 for p in (layer.mlp_op.gate_up_proj, layer.mlp_op.down_proj))
        x, affinities, expert_index, _ = inputs()
        with torch.no_grad():
            assert torch.equal(fresh(x, affinities, expert_index), quantized(x, affinities, expert_index))
    assert expert_weight_bytes(layer_pair("mxfp4")[1]) < expert_weight_bytes(layer_pair("mxfp4")[0]) / 7


def test_build_moe_quantizes_only_the_routed_experts():
    moe = build_moe("deepseek-v3", scale=32, quantization="fp8_block", seed=0)
    bf16 = build_moe("deepseek-v3", scale=32, seed=0, quantization="bf16")
    cfg = moe.expert_mlps.routed_experts_mlp_config
    assert cfg.quantization == "fp8_block" and cfg.hidden_size % 128 == 0 and cfg.intermediate_size % 128 == 0
    assert moe.router.linear_router.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in moe.shared_experts.parameters())
    assert moe.expert_mlps.mlp_op.down_proj.weight.dtype == torch.float8_e4m3fn
    assert bf16.expert_mlps.mlp_op.down_proj.weight.dtype == torch.float32
    assert get_format("EXPERT_WISE_PER_CHANNEL_SYMMETRIC").name == "fp8"
    mx = build_moe("gpt-oss-20b", scale=16, quantization="mxfp4", seed=0)
    x = randn(1, 5, mx.expert_mlps.routed_experts_mlp_config.hidden_size, seed=1)
    assert torch.isfinite(mx(x)[0]).all()


# ----------------------------------------------------------------------------------------------------------
# shared experts: bf16 unless asked


def shared_pair(name, transposed, fused):
    """(bf16 SharedExperts, the same quantized, a bf16 one holding the quantized weights' dequantized values)."""
    from nxd_moe.shared_experts import SharedExperts

    def make(quantization="bf16"):
        torch.manual_seed(4)
        return SharedExperts(H, I, 1, "silu", transpose_weights=transposed, fused_gate_up_projection=fused,
                             shared_expert_gate=True, model_parallel=False, quantization=quantization)

    original, holding = make(), make()
    torch.manual_seed(4)
    quantized = make(name)
    names = ["gate_up_proj"] if fused else ["gate_proj", "up_proj"]
    with torch.no_grad():
        for proj in names + ["down_proj"]:
            getattr(holding, proj).weight.copy_(getattr(quantized, proj).matrix())
        holding.shared_expert_gate.weight.copy_(quantized.shared_expert_gate.weight)
    return original, quantized, holding, names + ["down_proj"]


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_shared_experts_store_the_format_and_compute_its_values(name, transposed, fused):
    original, quantized, holding, projs = shared_pair(name, transposed, fused)
    fmt = get_format(name)
    for proj in projs:
        q, o = getattr(quantized, proj), getattr(original, proj)
        in_out = o.weight if transposed else o.weight.t()
        assert q.weight.dtype == fmt.weight_dtype and q.scale.dtype == fmt.scale_dtype
        assert q.weight.shape == fmt.weight_shape(Shape(1, *in_out.shape))[1:]  # stored (in, out), whatever the flag
        # quantization error against the original weights within the format's round-trip bound (an orientation
        # mix-up would break it by orders of magnitude)
        err = (q.matrix() - o.weight).abs()
        tolerance = (2.0 ** -4 * o.weight.abs() + 1e-6) if name != "mxfp4" else 0.26 * o.weight.abs().max()
        assert (err <= tolerance).all(), (proj, err.max())
    assert quantized.shared_expert_gate.weight.dtype == torch.float32  # the gate stays unquantized
    x = randn(2, 5, H, seed=6)
    with torch.no_grad():
        assert_close(quantized(x), holding(x), FP32_ATOL)
        reference = original(x)
        rel = ((quantized(x) - reference).abs().max() / reference.abs().max()).item()
    print(f"{name}: shared-experts error vs the original weights {rel:.3g}")
    assert 0 < rel < LAYER_ERROR_BOUND[name]


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_shared_experts_in_the_moe_every_backend(name):
    moe = build_moe("deepseek-v3", scale=32, quantization=name, shared_quantization=name, seed=0, block_size=4)
    assert moe.router.linear_router.weight.dtype == torch.float32
    sd = moe.state_dict()
    assert sd["shared_experts.down_proj.weight"].dtype == get_format(name).weight_dtype
    assert "shared_experts.down_proj.scale" in sd
    fresh = build_moe("deepseek-v3", scale=32, quantization=name, shared_quantization=name, seed=1, block_size=4)
    fresh.load_state_dict(sd)
    x = randn(1, 6, moe.expert_mlps.routed_experts_mlp_config.hidden_size, seed=7)
    from nxd_moe.reference import reference_for_moe

    with torch.no_grad():
        expected = reference_for_moe(moe, x)
        for layer in (moe, fresh):
            assert_close(layer(x)[0].double(), expected.reshape(x.shape), 1e-4)
        moe.expert_mlps.backend = get_backend("nki_sim")
        assert_close(moe(x)[0].double(), expected.reshape(x.shape), 1e-4)

    # asked through the quantizer as well: the same bytes as built quantized (same seed, same shapes)
    from nxd_moe.build import scaled_model

    bf16 = build_moe(scaled_model("deepseek-v3", 32, name), seed=0, block_size=4)
    assert all(p.dtype == torch.float32 for p in bf16.shared_experts.parameters())
    quantize_experts(bf16, name, shared_experts=True)
    got = bf16.state_dict()
    assert sorted(got) == sorted(sd)
    for key in sd:
        assert torch.equal(got[key].view(torch.uint8) if got[key].element_size() == 1 else got[key],
                           sd[key].view(torch.uint8) if sd[key].element_size() == 1 else sd[key]), key


def test_quantize_shared_experts_alone():
    """Routed and shared experts in different formats from one bf16 layer: the bytes build_moe gives."""
    from nxd_moe.build import scaled_model

    config = dataclasses.replace(scaled_model("deepseek-v3", 32, "fp8_block"), num_experts=8, top_k=2)  # small
    built = build_moe(config, quantization="fp8", shared_quantization="fp8_block", seed=0).state_dict()
    layer = build_moe(config, seed=0)
    quantize_shared_experts(quantize_experts(layer, "fp8"), "fp8_block")
    got = layer.state_dict()
    assert sorted(got) == sorted(built)
    assert all(torch.equal(got[k].view(torch.uint8) if got[k].element_size() == 1 else got[k],
                           built[k].view(torch.uint8) if built[k].element_size() == 1 else built[k]) for k in built)
    with pytest.raises(ValueError, match="already stored as 'fp8_block'"):
        quantize_shared_experts(layer, "fp8")
    with pytest.raises(ValueError, match="layer must be an MoE with shared experts, got MoE without shared experts"):
        quantize_shared_experts(build_moe("mixtral-8x7b", scale=32, seed=0), "fp8")
    with pytest.raises(ValueError, match="shared_quantization must be one of"):
        quantize_shared_experts(build_moe(config, seed=0), "int4")


def test_shared_quantization_bad_input_is_named(monkeypatch):
    from nxd_moe.shared_experts import SharedExperts

    moe = build_moe("deepseek-v3", scale=32, quantization="fp8", shared_quantization="fp8_block", seed=0)
    sd = moe.state_dict()
    key = "shared_experts.up_proj.scale"
    with pytest.raises(ValueError, match=r"shared_experts.up_proj.scale: format 'fp8_block' stores scale as "
                                         r"torch.float32 of shape"):
        moe.load_state_dict({**sd, key: sd[key][:-1]})
    with pytest.raises(ValueError, match=r"shared_experts.up_proj.scale must be 2-D"):
        moe.load_state_dict({**sd, key: sd[key][None]})
    bad = sd[key].clone()
    bad[0, 0] = 0.0
    with pytest.raises(ValueError, match=r"shared_experts.up_proj.scale: 1 scale\(s\) are NaN, Inf, zero"):
        moe.load_state_dict({**sd, key: bad})
    with pytest.raises(ValueError, match=r"shared_experts.quantization must be one of"):
        build_moe("deepseek-v3", scale=32, shared_quantization="int4")
    with pytest.raises(ValueError, match=r"shared_quantization: config 'mixtral-8x7b.*' has no shared experts"):
        build_moe("mixtral-8x7b", scale=32, shared_quantization="fp8")
    with pytest.raises(ValueError, match=r"shared-expert projection \(in=128, out=96\): format 'fp8_block' needs "
                                         r"the out \(N\) dimension divisible by its block size 128"):
        SharedExperts(H, 96, 1, "silu", model_parallel=False, quantization="fp8_block")
    with pytest.raises(TypeError, match=r"shared_experts must be a bool"):
        quantize_experts(build_moe("deepseek-v3", scale=32, seed=0), "fp8", shared_experts="yes")
    with pytest.raises(ValueError, match=r"k_fastest: packed must be \(E, K/2, N\), got shape \(4, 8\)"):
        k_fastest(torch.zeros(4, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"shared_experts=True, but the layer has no shared experts"):
        quantize_experts(build_moe("mixtral-8x7b", scale=32, seed=0), "fp8", shared_experts=True)
    # Under TP (rank 0 of 2) each slice of the intermediate dimension must hold whole scale blocks.
    monkeypatch.setattr(SharedExperts, "_intermediate_shard", staticmethod(lambda model_parallel: (2, 0)))
    with pytest.raises(ValueError, match=r"format 'fp8_block' cannot split its out \(N\) dimension of 128 into 2 "
                                         r"slices of whole 128-wide blocks"):
        SharedExperts(H, I, 1, "silu", quantization="fp8_block")
    SharedExperts(H, I, 1, "silu", quantization="mxfp4")  # 64-wide slices of 32-row MX blocks


def test_cli_run_reports_the_quantization_error(capsys):
    from nxd_moe.cli import main

    main(["run", "--config", "gpt-oss-20b", "--scale", "16", "--tokens", "16", "--decode-batch", "2",
          "--repeats", "1", "--quantization", "mxfp4", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "mxfp4"
    assert report["prefill"]["max_abs_err"] < 1e-5  # vs the float64 reference of the dequantized weights
    assert 0 < report["prefill"]["max_abs_err_vs_unquantized"] < 0.3 * report["prefill"]["max_abs_ref"]


# ----------------------------------------------------------------------------------------------------------
# bad input


def test_bad_stored_tensors_are_named():
    _, quantized, _ = layer_pair("fp8")
    sd = quantized.state_dict()

    def load(**changes):
        fresh = ExpertMLPsV2(quantized.routed_experts_mlp_config, quantized.blockwise_matmul_config)
        fresh.load_state_dict({**sd, **changes})

    key = "mlp_op.down_proj.scale"
    with pytest.raises(ValueError, match=r"mlp_op.down_proj.scale: format 'fp8' stores scale as torch.float32 of "
                                         r"shape \(4, 1, 128\), got torch.float16"):
        load(**{key: sd[key].half()})
    with pytest.raises(ValueError, match=r"mlp_op.down_proj.scale.*shape \(4, 1, 128\), got .*\(4, 128\)"):
        load(**{key: sd[key][:, 0]})
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        scale = sd[key].clone()
        scale[2, 0, 5] = bad
        with pytest.raises(ValueError, match=r"mlp_op.down_proj.scale('? being loaded contains 1 NaN/Inf|: 1 "
                                             r"scale\(s\) are NaN, Inf, zero or negative)"):
            load(**{key: scale})
    with pytest.raises(ValueError, match=r"mlp_op.gate_up_proj.weight: format 'fp8' stores weight as "
                                         r"torch.float8_e4m3fn"):
        load(**{"mlp_op.gate_up_proj.weight": sd["mlp_op.gate_up_proj.weight"].float()})

    _, mx, _ = layer_pair("mxfp4")
    sd_mx = mx.state_dict()
    scale = sd_mx["mlp_op.gate_up_proj.scale"].clone()
    scale[0, 0, 0] = 255
    with pytest.raises(ValueError, match=r"mlp_op.gate_up_proj.scale: 1 E8M0 scale\(s\) are 0xFF \(NaN\)"):
        ExpertMLPsV2(mx.routed_experts_mlp_config, mx.blockwise_matmul_config).load_state_dict(
            {**sd_mx, "mlp_op.gate_up_proj.scale": scale})


def test_block_size_must_divide_and_format_names_are_checked():
    with pytest.raises(ValueError, match=r"format 'fp8_block' needs the in \(K\) dimension divisible by its block "
                                         r"size 128, got 64"):
        ExpertMLPsV2(make_config(hidden_size=64, intermediate_size=128, quantization="fp8_block"))
    with pytest.raises(ValueError, match=r"format 'mxfp4' needs the in \(K\) dimension divisible by its block size "
                                         r"32, got 48"):
        ExpertMLPsV2(make_config(hidden_size=64, intermediate_size=48, quantization="mxfp4"))
    with pytest.raises(ValueError, match=r"RoutedExpertsMLPOpsConfig.quantization must be one of \['bf16', 'fp8', "
                                         r"'fp8_block', 'mxfp4'\]"):
        make_config(quantization="int4")


def test_backend_without_the_format_is_refused():
    class Bf16Only(ExpertsBackend):
        name = "bf16_only"
        blockwise = capacity_factor = selective_loading = all_experts = None

    cfg = make_config(hidden_size=64, intermediate_size=64, quantization="mxfp4")
    with pytest.raises(ValueError, match=r"backend 'bf16_only' does not support quantization='mxfp4'; it supports "
                                         r"\['bf16'\]"):
        ExpertMLPsV2(cfg, backend=Bf16Only())
    layer = make_experts(make_config(hidden_size=64, intermediate_size=64))
    layer.backend = Bf16Only()
    with pytest.raises(ValueError, match="does not support quantization='fp8'"):
        quantize_experts(layer, "fp8")


# ----------------------------------------------------------------------------------------------------------
# nki_sim: stored bytes over DMA, dequantized on chip


@pytest.mark.parametrize("name", QUANTIZED)
def test_nki_sim_computes_with_every_format(name):
    from nxd_moe.nki_kernels.backend import NkiSimBackend

    _, quantized, holding = layer_pair(name, backend=NkiSimBackend(decode_lnc=1),
                                       blockwise=dict(logical_nc_config=1))
    x, affinities, expert_index, mask = inputs()
    with torch.no_grad():
        for mode in MODES:
            assert_close(quantized(x, affinities, expert_index, padding_mask=mask, mode=mode),
                         holding(x, affinities, expert_index, padding_mask=mask, mode=mode), FP32_ATOL,
                         msg=f"nki_sim {name} {mode}")


@pytest.mark.parametrize("name", QUANTIZED)
def test_nki_sim_reads_exactly_the_packed_bytes(name):
    from nxd_moe.nki_kernels.backend import NkiSimBackend

    backend = NkiSimBackend(decode_lnc=1)
    _, quantized, _ = layer_pair(name, dtype=torch.bfloat16, backend=backend, bias=False)
    x, affinities, expert_index, _ = inputs(4)
    with torch.no_grad():
        quantized(x.to(torch.bfloat16), affinities.to(torch.bfloat16), expert_index, mode="all_experts")
    traffic = backend.last_run.accounting.traffic
    read = {t: traffic(t, "hbm->sbuf").bytes for t in ("gate_up_proj_weight", "gate_up_proj_scale",
                                                       "down_proj_weight", "down_proj_scale")}
    e, values = 4, 4 * H * 2 * I + 4 * I * H  # every expert read once, both projections
    analytic = {  # values + scales, from the formats' definitions
        "fp8": values + 4 * (e * 2 * I + e * H),
        "fp8_block": values + 4 * (e * (H // 128) * (2 * I // 128) + e * (I // 128) * (H // 128)),
        "mxfp4": values // 2 + (e * (H // 32) * 2 * I + e * (I // 32) * H),
    }[name]
    assert sum(read.values()) == analytic
    bf16_bytes = 2 * values
    print(f"nki_sim {name}: expert weight bytes {sum(read.values())} = {sum(read.values()) / bf16_bytes:.3f} of bf16")


def test_plan_reports_quantized_decode():
    from nxd_moe.nki_kernels.plan import decode_candidate, rank_problem

    model = load_model_config("mixtral-8x7b").scaled(16, multiple=32)
    read = {}
    for name in ("bf16", "fp8", "mxfp4"):
        problem = rank_problem(dataclasses.replace(model, experts={**model.experts, "quantization": name}), 64)
        candidate = decode_candidate(problem, 4, ExpertsMode.ALL_EXPERTS, 1, "decode")
        assert candidate.error is None
        read[name] = candidate.dma_bytes
    # whole-kernel traffic (hidden states, biases and output included): weights dominate
    print({k: v / read["bf16"] for k, v in read.items()})
    assert 0.5 < read["fp8"] / read["bf16"] < 0.52
    assert 0.25 < read["mxfp4"] / read["bf16"] < 0.28


# ----------------------------------------------------------------------------------------------------------
# checkpoints: GPT-OSS MXFP4 and DeepSeek-V3 FP8, key by key


def gpt_oss_mxfp4_checkpoint(e=4, h=64, i=64, seed=0):
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=2,
                          num_hidden_layers=1, head_dim=16)
    gen = torch.Generator().manual_seed(seed)

    def nibbles(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    def exponents(*shape):
        return torch.randint(120, 130, shape, generator=gen).to(torch.uint8)

    prefix = "model.layers.0.mlp."
    sd = {
        prefix + "router.weight": randn(e, h, seed=1, scale=0.1),
        prefix + "router.bias": randn(e, seed=2, scale=0.1),
        prefix + "experts.gate_up_proj_blocks": nibbles(e, 2 * i, h // 32, 16),
        prefix + "experts.gate_up_proj_scales": exponents(e, 2 * i, h // 32),
        prefix + "experts.gate_up_proj_bias": randn(e, 2 * i, seed=3, scale=0.1),
        prefix + "experts.down_proj_blocks": nibbles(e, h, i // 32, 16),
        prefix + "experts.down_proj_scales": exponents(e, h, i // 32),
        prefix + "experts.down_proj_bias": randn(e, h, seed=4, scale=0.1),
        "model.norm.weight": torch.ones(h),
    }
    return config, sd


def test_gpt_oss_mxfp4_checkpoint_matches_transformers_dequantization_and_exports_back():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from nxd_moe.hf import from_hf_config, hf_to_nxd_state_dict, load_hf_layer, nxd_to_hf_state_dict
    from nxd_moe.hf.families import _interleave

    config, sd = gpt_oss_mxfp4_checkpoint()
    nxd = hf_to_nxd_state_dict(sd, config)
    p = "model.layers.0.mlp.expert_mlps.mlp_op."
    assert nxd[p + "gate_up_proj.weight"].shape == (4, 32, 128) and nxd[p + "gate_up_proj.weight"].dtype == torch.uint8
    assert nxd[p + "gate_up_proj.scale"].shape == (4, 2, 128) and nxd[p + "down_proj.scale"].shape == (4, 2, 64)
    assert torch.equal(nxd["model.norm.weight"], sd["model.norm.weight"])
    back = nxd_to_hf_state_dict(nxd, config)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)

    nxd_config = from_hf_config(config)
    moe = build_moe(nxd_config, quantization="mxfp4", seed=0)
    load_hf_layer(moe, sd, config, 0)
    op = moe.expert_mlps.mlp_op
    assert op.gate_up_proj.weight.stride(1) == 1 and op.down_proj.weight.stride(1) == 1  # still K-fastest
    # transformers' own dequantization of the same tensors: (E, H, 2I) with gate/up interleaved, (E, I, H)
    hf = "model.layers.0.mlp.experts."
    gate_up_ref = convert_moe_packed_tensors(sd[hf + "gate_up_proj_blocks"], sd[hf + "gate_up_proj_scales"],
                                             dtype=torch.float32)
    down_ref = convert_moe_packed_tensors(sd[hf + "down_proj_blocks"], sd[hf + "down_proj_scales"],
                                          dtype=torch.float32)
    assert torch.equal(_interleave(dequantized(op.gate_up_proj.stored_weight())), gate_up_ref)
    assert torch.equal(dequantized(op.down_proj.stored_weight()), down_ref)

    # the quantized layer == the bf16 checkpoint of transformers' dequantized weights, loaded the ordinary way
    dense_sd = {k: v for k, v in sd.items() if "_blocks" not in k and "_scales" not in k}
    dense_sd[hf + "gate_up_proj"], dense_sd[hf + "down_proj"] = gate_up_ref, down_ref
    dense = load_hf_layer(build_moe(nxd_config, seed=0), dense_sd, config, 0)
    x = randn(1, 6, 64, seed=5)
    with torch.no_grad():
        assert_close(moe(x)[0], dense(x)[0], FP32_ATOL)


def tiles_of(scale_inv: torch.Tensor) -> torch.Tensor:
    """A ``(out/128, in/128)`` ``weight_scale_inv`` spread over its ``(out, in)`` weight: tile ``[r, c]`` covers
    rows ``128r ..`` and columns ``128c ..`` (DeepSeek-V3's checkpoint format)."""
    return scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)


def fp8_block_by_definition(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (out, in)`` as DeepSeek-V3's checkpoints store it, written from the format's definition (not the
    package's quantizer): per 128x128 tile, ``scale_inv = amax / 448`` and ``weight = fp8(w / scale_inv)``."""
    out_f, in_f = w.shape
    amax = w.abs().reshape(out_f // 128, 128, in_f // 128, 128).amax(dim=(1, 3))
    scale_inv = amax / 448.0
    return (w / tiles_of(scale_inv)).to(torch.float8_e4m3fn), scale_inv


def deepseek_v3_fp8_checkpoint(e: int = 4, h: int = 128, i: int = 128, shared: str = "fp8_block"):
    """A DeepSeek-V3 layer-0 checkpoint as the Hub stores it: per-expert FP8 weights with 128x128
    ``weight_scale_inv`` tiles; shared experts bf16 or FP8. Returns ``(config, state dict, originals)``."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=h, moe_intermediate_size=i, intermediate_size=256, n_routed_experts=e,
                              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                              first_k_dense_replace=0, num_hidden_layers=1, q_lora_rank=8, kv_lora_rank=8,
                              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    prefix = "model.layers.0.mlp."
    sd = {prefix + "gate.weight": randn(e, h, seed=1, scale=0.1),
          prefix + "gate.e_score_correction_bias": torch.zeros(e)}
    originals = {}
    for k in range(e):
        for proj, (out_f, in_f) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = randn(out_f, in_f, seed=10 * k + len(proj), scale=0.1)
            w[:128, :128] *= 8  # one tile far larger than the others: a transposed scale grid is far off
            key = f"{prefix}experts.{k}.{proj}.weight"
            sd[key], sd[key + "_scale_inv"] = fp8_block_by_definition(w)
            originals[(k, proj)] = w
    for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        w = randn(*shape, seed=99, scale=0.1)
        w[-128:, :128] *= 8
        key = f"{prefix}shared_experts.{proj}.weight"
        if shared == "bf16":
            sd[key] = w
        else:
            sd[key], sd[key + "_scale_inv"] = fp8_block_by_definition(w)
            originals[("shared", proj)] = w
    return config, sd, originals


@pytest.mark.parametrize("shared", ["bf16", "fp8_block"])
@pytest.mark.parametrize("h,i", [(128, 128), (256, 384)])
def test_deepseek_v3_fp8_block_checkpoint_key_by_key(shared, h, i):
    """Routed experts in FP8 128x128 blocks; the shared experts bf16 or, as in DeepSeek-V3's own checkpoint,
    FP8 as well (loaded as stored into shared experts asked to be ``fp8_block``). 256 x 384: a grid of 2 x 3 tiles,
    not square, with one tile 8x the others, so the scale grid's orientation is seen (one tile would not show it)."""
    from nxd_moe.hf import from_hf_config, hf_to_nxd_state_dict, load_hf_layer, nxd_to_hf_state_dict

    e = 4
    config, sd, originals = deepseek_v3_fp8_checkpoint(e, h, i, shared)
    prefix = "model.layers.0.mlp."
    assert sd[prefix + "experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert sd[prefix + "experts.0.down_proj.weight_scale_inv"].shape == (h // 128, i // 128)

    nxd = hf_to_nxd_state_dict(sd, config)
    back = nxd_to_hf_state_dict(nxd, config, layout="hub")
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k].view(torch.uint8) if back[k].element_size() == 1 else back[k],
                           sd[k].view(torch.uint8) if sd[k].element_size() == 1 else sd[k]) for k in sd)
    moe = load_hf_layer(build_moe(from_hf_config(config), quantization="fp8_block", shared_quantization=shared,
                                  seed=0), sd, config, 0)
    gate_up = dequantized(moe.expert_mlps.mlp_op.gate_up_proj.stored_weight())
    down = dequantized(moe.expert_mlps.mlp_op.down_proj.stored_weight())
    for k in range(e):  # each weight_scale_inv multiplies its own 128x128 tile
        for proj, got in (("gate_proj", gate_up[k, :, :i].t()), ("up_proj", gate_up[k, :, i:].t()),
                          ("down_proj", down[k].t())):
            key = f"{prefix}experts.{k}.{proj}.weight"
            stored = sd[key].float() * tiles_of(sd[key + "_scale_inv"])
            assert torch.equal(got, stored)
            assert (got - originals[(k, proj)]).abs().max() <= 2 ** -4 * originals[(k, proj)].abs().max()
    if shared == "bf16":
        assert moe.shared_experts.down_proj.weight.dtype == torch.float32
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"{prefix}shared_experts.{proj}.weight"
            got = getattr(moe.shared_experts, proj).matrix()  # (out, in), as the checkpoint's
            assert torch.equal(got, sd[key].float() * tiles_of(sd[key + "_scale_inv"]))
            original = originals[("shared", proj)]
            assert (got - original).abs().max() <= 2 ** -4 * original.abs().max()
        with pytest.raises(ValueError, match=r"layer 0's shared experts are stored as 'fp8_block' in the checkpoint, "
                                             r"the layer's as 'bf16': build the layer with "
                                             r"shared_quantization='fp8_block'"):
            load_hf_layer(build_moe(from_hf_config(config), quantization="fp8_block", seed=0), sd, config, 0)
    with pytest.raises(ValueError, match="layout='hub'"):
        nxd_to_hf_state_dict(nxd, config)


# ----------------------------------------------------------------------------------------------------------
# one static graph


@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_quantized_layer_compiles_to_one_static_graph(name):
    from nxd_moe.trace import static_backend

    torch._dynamo.reset()
    _, quantized, _ = layer_pair(name, blockwise={"use_shard_on_block_dynamic_while": True, "num_static_blocks": 1})
    x, affinities, expert_index, mask = inputs()

    def all_modes(x, affinities, expert_index, mask):
        return tuple(quantized(x, affinities, expert_index, padding_mask=mask, mode=m) for m in MODES)

    with torch.no_grad():
        eager = all_modes(x, affinities, expert_index, mask)
        compiled = torch.compile(all_modes, fullgraph=True, dynamic=False,
                                 backend=static_backend("aot_eager"))(x, affinities, expert_index, mask)
    for mode, e, c in zip(MODES, eager, compiled):
        assert_close(c, e, FP32_ATOL, msg=f"{name} {mode}")
    torch._dynamo.reset()


def test_cli_trace_exports_the_packed_layer(tmp_path, capsys):
    from nxd_moe.cli import main

    assert main(["trace", "--config", "qwen3-30b-a3b", "--mode", "decode", "--scale", "64", "--skip-xla",
                 "--quantization", "mxfp4", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["quantization"] == "mxfp4"
    assert report["expert_weight_dtypes"] == {"gate_up_proj.weight": "uint8", "gate_up_proj.scale": "uint8",
                                              "down_proj.weight": "uint8", "down_proj.scale": "uint8"}
    # the exported program takes the packed bytes as its weight inputs
    program = torch.export.load(tmp_path / "program.pt2")
    stored = {k: v.dtype for k, v in program.state_dict.items() if "expert_mlps" in k}
    assert stored["expert_mlps.mlp_op.gate_up_proj.weight"] == torch.uint8


@pytest.mark.parametrize("blockwise", [
    dict(logical_nc_config=2),  # shard-on-H: each core loads and dequantizes half of H
    dict(logical_nc_config=2, use_shard_on_block_dynamic_while=True),
    dict(logical_nc_config=1, use_shard_on_intermediate_dynamic_while=True),
], ids=["shard_on_H_lnc2", "shard_on_block_dynamic_lnc2", "shard_on_I_dynamic_lnc1"])
def test_nki_sim_blockwise_kernels_with_mxfp4(blockwise):
    from nxd_moe.nki_kernels.backend import NkiSimBackend

    _, quantized, holding = layer_pair("mxfp4", backend=NkiSimBackend(decode_lnc=2), blockwise=blockwise)
    x, affinities, expert_index, mask = inputs()
    with torch.no_grad():
        for mode in ("blockwise", "selective_loading", "all_experts"):
            assert_close(quantized(x, affinities, expert_index, padding_mask=mask, mode=mode),
                         holding(x, affinities, expert_index, padding_mask=mask, mode=mode), FP32_ATOL, msg=mode)


def test_nki_sim_refuses_tiles_that_split_a_scale_block():
    from nxd_moe.nki_kernels.backend import NkiSimBackend
    from nxd_moe.nki_kernels.machine import HardwareLimitError

    # shard-on-H on two cores: each core's 64 rows of H cut fp8_block's 128-row tiles in half
    _, quantized, _ = layer_pair("fp8_block", backend=NkiSimBackend(), blockwise=dict(logical_nc_config=2))
    x, affinities, expert_index, _ = inputs()
    with pytest.raises(HardwareLimitError, match=r"gate_up_proj_weight: a tile's rows \[0, 64\) must align with "
                                                 r"format 'fp8_block''s blocks of 128"):
        quantized(x, affinities, expert_index, mode="blockwise")
