"""W8A8 (``activation_quantization="fp8"``): the settings and their refusals, the FP8 activation quantizer, the torch
backend (the reference implementation) against the float64 reference, storage, the CLI.

The quantizer is checked against a brute-force E4M3 rounding written here (nearest of the 253 finite E4M3 values,
ties to the even code); the layer against ``nxd_moe.reference``, whose float64 FP8 rounding shares no code with
``nxd_moe.quantization.activations``. The triton kernels: ``tests/gpu/test_triton_w8a8.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MODES, make_config, make_experts, randn, random_routing

from nxd_moe.build import build_moe
from nxd_moe.cli import main, resolve_dtype
from nxd_moe.config import RoutedExpertsMLPOpsConfig
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts.backends import get_backend
from nxd_moe.quantization.activations import ActivationQuantization, activation_quantization_spec
from nxd_moe.quantization.quantizer import quantize_experts
from nxd_moe.reference import first_come_first_served, reference_for_experts

H = I = 128  # noqa: E741 (the issue's names: hidden and intermediate size)
# |W8A8 layer - float64 W8A8 reference| / max(1, max |reference|) in fp32: rounding, plus the rare activation whose
# fp32 and float64 values land on different sides of an E4M3 rounding boundary (one FP8 step of one term).
FP32_TOL = 3e-3


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite E4M3 value (float64) and its code."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).to(torch.float64)
    finite = ~torch.isnan(values)
    return values[finite], codes[finite].long()


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Brute force: the nearest E4M3 value of each float64 ``v`` (|v| <= 448), ties to the even code."""
    values, codes = e4m3_grid()
    distance = (v.reshape(-1, 1) - values.reshape(1, -1)).abs()
    best = distance.min(dim=1, keepdim=True).values
    tied = distance == best
    # among the tied candidates prefer an even code (E4M3's ties-to-even), then the smaller magnitude
    score = torch.where(tied, (codes % 2).to(torch.float64) * 2 + values.abs().reshape(1, -1) / 1e4, float("inf"))
    return values[score.argmin(dim=1)].reshape(v.shape)


def expected_quantization(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, step by step: fp32 scale = amax * fp32(1/448) (1 if 0), fp32 product with the fp32
    reciprocal of the scale, nearest E4M3."""
    rows, width = x.shape
    groups = x.to(torch.float32).reshape(rows, width // group, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    inverse = (1.0 / scale.to(torch.float64)).to(torch.float32)  # the correctly rounded fp32 reciprocal
    quotient = (groups.to(torch.float64) * inverse.to(torch.float64)).to(torch.float32)  # one fp32 rounding
    quotient = quotient.clamp(-448.0, 448.0).to(torch.float64)
    return nearest_e4m3(quotient).reshape(rows, width), scale.squeeze(-1)


def awkward_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows spanning many binades, with exact E4M3 ties, subnormal quotients, zero groups and a huge value."""
    x = randn(rows, width, seed=seed) * torch.pow(2.0, randn(rows, 1, seed=seed + 1) * 4)
    x[0, :4] = torch.tensor([448.0, 17.0, 19.0, -1.0625])  # the row max, then ties at 16 | 18, 18 | 20, 1 | 1.125
    x[1, : width // 2] = 0.0  # an all-zero group
    x[2, 1] = x[2].abs().max() * 2.0 ** -12  # a subnormal quotient
    x[3, 5] = 3e4
    return x


@pytest.mark.parametrize("group", [None, 32])
def test_quantizer_equals_the_e4m3_definition(group):
    x = awkward_rows(6, 64, seed=1)
    spec = ActivationQuantization(group)
    q, scale = spec.quantize(x)
    expected_q, expected_scale = expected_quantization(x, 64 if group is None else group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.to(torch.float64), expected_q)
    # dequantized: within half an E4M3 step of the value (2**-4 relative, 2**-10 * scale near zero)
    back = spec.dequantize(q, scale, torch.float64)
    per_column = scale.repeat_interleave(64 if group is None else group, dim=1).double()
    assert bool(((back - x.double()).abs() <= x.double().abs() * 2.0 ** -4 + per_column * 2.0 ** -10).all())
    assert torch.equal(back[1, :32], torch.zeros(32, dtype=torch.float64))


def test_quantizer_keeps_rows_apart():
    """A NaN or Inf row poisons only itself."""
    x = randn(4, 32, seed=2)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    fake = ActivationQuantization(None).fake_quantize(x)
    assert torch.isnan(fake[1]).any() and not torch.isfinite(fake[2]).all()
    clean = ActivationQuantization(None).fake_quantize(x[[0, 3]])
    assert torch.equal(fake[[0, 3]], clean)


# ----------------------------------------------------------------------------------------------------------
# settings


def test_group_follows_the_weight_format():
    def spec(quantization, group=None):
        return activation_quantization_spec(make_config(4, 256, 256, 2, quantization=quantization,
                                                        activation_quantization="fp8",
                                                        activation_quantization_group_size=group))

    assert spec("fp8") == ActivationQuantization(None)  # per token
    assert spec("fp8_block") == ActivationQuantization(128)  # DeepSeek-V3: per token and 128 columns
    assert spec("fp8", 64) == ActivationQuantization(64)
    assert activation_quantization_spec(make_config(4, 256, 256, 2, quantization="fp8")) is None
    assert make_config(quantization="fp8", activation_quantization="FP8").activation_quantization == "fp8"
    assert make_config(activation_quantization=None).activation_quantization == "none"


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="bf16", activation_quantization="fp8"), r"needs quantization in \['fp8', 'fp8_block'\]"),
    (dict(quantization="mxfp4", activation_quantization="fp8"), "got quantization='mxfp4'"),
    (dict(quantization="fp8", activation_quantization="int8"), r"activation_quantization must be one of \['none'"),
    (dict(quantization="fp8", activation_quantization="fp8", activation_quantization_group_size=48),
     "activation_quantization_group_size=48 must divide the K of both expert GEMMs: hidden_size=128"),
    (dict(quantization="fp8", activation_quantization="fp8", activation_quantization_group_size=0),
     r"activation_quantization_group_size must be in \[1, inf\]"),
    (dict(quantization="fp8", activation_quantization_group_size=32), "needs activation_quantization='fp8'"),
])
def test_bad_settings_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_config(4, H, 96, 2, **kwargs)


def test_backends_without_w8a8_refuse_at_construction():
    config = make_config(4, H, I, 2, quantization="fp8", activation_quantization="fp8")
    with pytest.raises(ValueError, match="backend 'nki_sim' does not support activation_quantization='fp8'"):
        ExpertMLPsV2(config, backend="nki_sim")
    layer = make_experts(make_config(4, H, I, 2), dtype=torch.float32)
    layer.backend = get_backend("nki_sim")
    with pytest.raises(ValueError, match="does not support activation_quantization"):
        quantize_experts(layer, "fp8", activation_quantization="fp8")
    assert layer.routed_experts_mlp_config.quantization == "bf16"  # a refusal changes nothing


def test_quantize_experts_makes_a_w8a8_layer_with_k_major_weights():
    layer = make_experts(make_config(4, H, 2 * I, 2), seed=3)
    with pytest.raises(ValueError, match="needs quantization in"):
        quantize_experts(layer, "mxfp4", activation_quantization="fp8")
    assert layer.routed_experts_mlp_config.quantization == "bf16"
    quantize_experts(layer, "fp8_block", activation_quantization="fp8")
    cfg = layer.routed_experts_mlp_config
    assert (cfg.quantization, cfg.activation_quantization) == ("fp8_block", "fp8")
    for proj in (layer.mlp_op.gate_up_proj, layer.mlp_op.down_proj):
        assert proj.weight.stride(1) == 1  # K fastest, what FP8 tensor cores read
    built = ExpertMLPsV2(cfg)  # built W8A8: the same storage order, and a checkpoint loads into it
    assert built.mlp_op.gate_up_proj.weight.stride(1) == 1
    built.load_state_dict(layer.state_dict())
    assert built.mlp_op.gate_up_proj.weight.stride(1) == 1
    assert torch.equal(built.mlp_op.down_proj.weight.view(torch.uint8), layer.mlp_op.down_proj.weight.view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------
# the torch backend: the reference implementation


@pytest.mark.parametrize("quantization, group", [("fp8", None), ("fp8_block", None), ("fp8", 32), ("fp8_block", 64)])
@pytest.mark.parametrize("mode", MODES)
def test_torch_backend_w8a8_matches_the_float64_reference(quantization, group, mode):
    config = make_config(8, H, I, 2, "swiglu_gptoss", bias=True, capacity_factor=1.0,
                         normalize_top_k_affinities=True)
    x = randn(21, H, seed=5)
    routing = random_routing(21, 8, 2, seed=6)
    w8a8 = make_experts(config, block_size=8, seed=4)
    quantize_experts(w8a8, quantization, activation_quantization="fp8", activation_quantization_group_size=group)
    out, stats = w8a8(x, *routing, mode=mode, return_stats=True)
    keep = first_come_first_served(routing[1], 8, stats.capacity) if mode == "capacity_factor" else None
    reference = reference_for_experts(w8a8, x, *routing, keep=keep)
    scale = max(1.0, reference.abs().max().item())
    assert (out.double() - reference).abs().max().item() < FP32_TOL * scale
    # and the activations really were quantized: W8A16 on the same weights is further away than the tolerance
    w8a16 = make_experts(config, block_size=8, seed=4)
    quantize_experts(w8a16, quantization)
    assert (w8a16(x, *routing, mode=mode).double() - out.double()).abs().max().item() > 3 * FP32_TOL * scale


def test_early_affinity_modulation_quantizes_the_scaled_input():
    config = make_config(8, H, I, 1, "glu_silu", early_expert_affinity_modulation=True)
    layer = make_experts(config, seed=7)
    quantize_experts(layer, "fp8", activation_quantization="fp8")
    x = randn(9, H, seed=8)
    affinities, index = random_routing(9, 8, 1, seed=9)
    for mode in ("blockwise", "selective_loading", "all_experts"):
        out = layer(x, affinities, index, mode=mode)
        reference = reference_for_experts(layer, x, affinities, index)
        assert (out.double() - reference).abs().max().item() < FP32_TOL * max(1.0, reference.abs().max().item())


def test_build_moe_rounds_scaled_sizes_to_the_activation_group():
    moe = build_moe("qwen3-30b-a3b", scale=32, quantization="fp8", activation_quantization="fp8",
                    activation_quantization_group_size=96, seed=0)
    cfg = moe.expert_mlps.routed_experts_mlp_config
    assert cfg.hidden_size % 96 == 0 and cfg.intermediate_size % 96 == 0
    x = randn(1, 5, cfg.hidden_size, seed=10)
    assert torch.isfinite(moe(x)[0]).all()


# ----------------------------------------------------------------------------------------------------------
# the CLI


def test_default_dtype_follows_the_device():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_run_reports_w8a8(capsys):
    assert main(["run", "--json", "--no-progress", "--repeats", "1", "--config", "deepseek-v3", "--scale", "56",
                 "--tokens", "32", "--decode-batch", "2", "--quantization", "fp8_block",
                 "--activation-quantization", "fp8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "fp8_block"
    assert report["activation_quantization"] == "fp8, per token and 128 columns"
    assert report["dtype"] == "float32"  # the CPU default
    for step in (report["prefill"], report["decode"]):
        assert step["max_abs_err"] < FP32_TOL * max(1.0, step["max_abs_ref"])  # the reference quantizes too
        assert "graph_ms" not in step  # CUDA graphs only on a GPU
        assert step["max_abs_err_vs_unquantized"] > step["max_abs_err"]
    assert main(["run", "--no-progress", "--repeats", "1", "--config", "deepseek-v3", "--scale", "56", "--tokens",
                 "16", "--quantization", "fp8", "--activation-quantization", "fp8"]) == 0
    assert "activations fp8, per token" in capsys.readouterr().out


def test_run_refuses_w8a8_without_fp8_weights(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--config", "mixtral-8x7b", "--activation-quantization", "fp8"])
    assert exc.value.code == 2
    assert "needs quantization in ['fp8', 'fp8_block']" in capsys.readouterr().err


def test_w8a8_config_keys_load_from_a_model_config():
    config = RoutedExpertsMLPOpsConfig(num_experts=4, hidden_size=256, intermediate_size=256, top_k=2,
                                       hidden_act="silu", glu_mlp=True, quantization="fp8_block",
                                       activation_quantization="fp8", activation_quantization_group_size=256)
    assert activation_quantization_spec(config) == ActivationQuantization(256)
    moe = build_moe({"name": "tiny", "num_experts": 4, "top_k": 2, "hidden_size": 256, "intermediate_size": 256,
                     "experts": {"hidden_act": "silu", "glu_mlp": True, "quantization": "fp8",
                                 "activation_quantization": "fp8"}})
    assert moe.expert_mlps.routed_experts_mlp_config.activation_quantization == "fp8"
