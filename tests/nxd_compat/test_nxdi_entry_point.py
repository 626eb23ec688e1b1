"""NxD Inference's ``initialize_moe_module`` (``nxd_moe.nxdi``, and through the front door ``neuronx_distributed_
inference.modules.moe_v2``): the config fields NxDI's GPT-OSS and Llama 4 model code pass, each landing where it
should, and the resulting layer against the transformers block with the same weights.

The layers are built as NxDI's model code builds them (tests/nxd_compat/nxdi_models.py); configs are NxDI-shaped
objects (``SimpleNamespace``) or dicts.

Tolerance: ``ATOL_FP32 = 1e-5`` (tests/hf_helpers.py): fp32 outputs O(0.1-1) from sums over H = 32 and I = 24, a
few hundred ulps of 2^-24 at most. Negative controls drop one architecture field and show the bound then fails.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import ATOL_FP32, HIDDEN, assert_parity, inputs, one_intra_op_thread  # noqa: E402,F401
from nxdi_models import (  # noqa: E402
    INTER,
    E,
    K,
    gpt_oss_block,
    gpt_oss_moe,
    hf_output,
    inference_config,
    llama4_block,
    llama4_moe,
    load_from_hf,
    rmsnorm,
)

import nxd_moe  # noqa: E402
from nxd_moe.nxd_compat.pytest_plugin import nxd_compat  # noqa: E402,F401 -- the fixture
from nxd_moe.nxdi import initialize_moe_module, routed_quantization  # noqa: E402


@pytest.mark.parametrize("seq_len", [12, 1])
def test_gpt_oss_path_matches_transformers(nxd_compat, seq_len):  # noqa: F811
    hf_config, block = gpt_oss_block()
    config = inference_config("sigmoid", K)  # NxDI's GPT-OSS config sets hidden_act "sigmoid", no shared experts
    norm = rmsnorm(seed=1)
    moe = gpt_oss_moe(config, rmsnorm=norm)
    assert not moe.training and moe.rmsnorm is norm
    assert moe.router.apply_act_fn_over_topk and moe.router.linear_router.bias is not None
    cfg = moe.expert_mlps.routed_experts_mlp_config
    assert (cfg.glu_type.value, cfg.hidden_act, cfg.hidden_act_scaling_factor, cfg.hidden_act_bias) == (
        "swiglu", "sigmoid", 1.702, 1.0)
    assert (cfg.gate_clamp_upper_limit, cfg.up_clamp_lower_limit, cfg.up_clamp_upper_limit, cfg.bias) == (
        7.0, -7.0, 7.0, True)
    load_from_hf(moe, block, hf_config)
    x = inputs(3, seq_len, seed=2) * 6  # the +-7 clamps act (checked below)
    expected = hf_output(block, norm(x))
    # NxDI's NeuronGptOssMoE.forward calls the layer like this.
    out = moe(x, is_speculative_decoding=False, residual=None)[0]
    # Inputs x6 make outputs larger; fp32 rounding grows with them (n = H + I + k ~ 60 terms: n * 2^-24 ~ 4e-6 of
    # the magnitudes summed, at worst), so the bound is relative to the largest output beyond ATOL_FP32.
    assert expected.abs().mean() > 0.05
    err = (out.double() - expected.double()).abs().max().item()
    assert err <= max(ATOL_FP32, 4e-6 * expected.abs().max().item()), err
    # Negative control: softmax over all experts instead of over the chosen ones (NxDI's apply_act_fn_over_topk).
    other = gpt_oss_moe(inference_config("sigmoid", K), rmsnorm=norm)
    other.router.apply_act_fn_over_topk = False
    load_from_hf(other, block, hf_config)
    assert (other(x)[0].double() - expected.double()).abs().max() > 100 * ATOL_FP32


def test_gpt_oss_clamps_are_load_bearing(nxd_compat):  # noqa: F811
    hf_config, block = gpt_oss_block()
    moe = gpt_oss_moe(inference_config("sigmoid", K))
    load_from_hf(moe, block, hf_config)
    x = inputs(3, 12, seed=2) * 6
    unclamped = copy.deepcopy(block)
    unclamped.experts.limit = 1e9
    # The layer follows the clamped block and is far from the unclamped one: the parity exercises the clamps.
    out = moe(x)[0].double()
    assert (out - hf_output(block, x).double()).abs().max() <= 4e-6 * hf_output(block, x).abs().max() + ATOL_FP32
    assert (out - hf_output(unclamped, x).double()).abs().max() > 1e-2


@pytest.mark.parametrize("top_k,seq_len", [(1, 12), (1, 1), (2, 12)])
def test_llama4_path_matches_transformers(nxd_compat, top_k, seq_len):  # noqa: F811
    hf_config, block = llama4_block(top_k)
    config = inference_config("silu", top_k)
    norm = rmsnorm(seed=3)
    moe = llama4_moe(config, rmsnorm=norm)
    cfg, shared = moe.expert_mlps.routed_experts_mlp_config, moe.shared_experts
    assert moe.router.act_fn == "sigmoid" and cfg.early_expert_affinity_modulation
    assert not cfg.normalize_top_k_affinities and shared.transpose_weights and not shared.fused_gate_up_projection
    load_from_hf(moe, block, hf_config)
    x = inputs(2, seq_len, seed=4)
    expected = hf_output(block, norm(x))
    assert_parity(moe(x)[0], expected)
    # Negative control: affinities scaling the experts' output instead of their input.
    config = inference_config("silu", top_k)
    other = llama4_moe(config, rmsnorm=norm)
    load_from_hf(other, block, hf_config)
    changed = nxd_moe.ExpertMLPsV2(cfg.replace(early_expert_affinity_modulation=False),
                                   moe.expert_mlps.blockwise_matmul_config)
    changed.load_state_dict(moe.expert_mlps.state_dict())
    other.expert_mlps = changed
    assert (other(x)[0].double() - expected.double()).abs().max() > 100 * ATOL_FP32


def test_a_dict_config_with_nxdis_keyword_names():
    """A config as a dict, ``neuron_config`` as the keyword arguments of NxDI's ``MoENeuronConfig``: the flat router
    keys, ``disable_normalize_top_k_affinities``, ``blockwise_matmul_config`` as a dict, defaults elsewhere."""
    config = dict(num_local_experts=E, num_experts_per_tok=K, hidden_size=HIDDEN, intermediate_size=INTER,
                  hidden_act="silu", original_intermediate_size=20,
                  neuron_config=dict(torch_dtype="float32", router_act_fn="sigmoid", router_dtype="float32",
                                     disable_normalize_top_k_affinities=True, tp_degree=1, batch_size=4,
                                     blockwise_matmul_config=dict(block_size=8, skip_dma_token=True),
                                     return_router_logits=True, return_expert_index=True))
    moe = initialize_moe_module(config)
    cfg = moe.expert_mlps.routed_experts_mlp_config
    assert moe.router.act_fn == "sigmoid" and not cfg.normalize_top_k_affinities
    assert cfg.intermediate_size_actual == 20 and cfg.use_index_calc_kernel is False and cfg.enable_spmd_rank
    assert moe.expert_mlps.blockwise_matmul_config.block_size == 8 and moe.expert_mlps.dtype == torch.float32
    assert moe.return_router_logits and moe.return_expert_index and moe.shared_experts is None
    out, logits, index = moe(inputs(2, 3, seed=5))
    assert logits.shape == (6, E) and index.shape == (6, K)
    # MoENeuronConfig's defaults: bf16, normalised top-k affinities, a 512-token block.
    default = initialize_moe_module(dict(config, neuron_config={}))
    assert default.expert_mlps.dtype == torch.bfloat16
    assert default.expert_mlps.routed_experts_mlp_config.normalize_top_k_affinities
    assert default.expert_mlps.blockwise_matmul_config.block_size == 512 and default.router.act_fn == "softmax"



@pytest.mark.parametrize("router_fields", [dict(router_config=dict(act_fn="sigmoid", dtype="float32")),
                                           dict(router_act_fn="sigmoid", router_dtype="float32")])
def test_the_router_keeps_its_own_dtype_under_a_bf16_model(router_fields):
    """The dtypes users run: a bf16 model with a float32 router (NxDI's default router_config). The router's weight
    and logits are float32 -- a router built in the model's dtype fails here -- the experts' weights bf16, and the
    output the model's dtype."""
    config = dict(num_local_experts=E, num_experts_per_tok=K, hidden_size=HIDDEN, intermediate_size=INTER,
                  hidden_act="silu", neuron_config=dict(torch_dtype="bfloat16", return_router_logits=True,
                                                        **router_fields))
    moe = initialize_moe_module(config)
    assert moe.router.act_fn == "sigmoid" and moe.router.dtype == torch.float32
    assert moe.router.linear_router.weight.dtype == torch.float32
    assert {p.dtype for p in moe.expert_mlps.parameters()} == {torch.bfloat16}
    out, logits = moe(inputs(2, 3, seed=6).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and logits.dtype == torch.float32
    flat = initialize_moe_module(dict(config, neuron_config=dict(torch_dtype="bfloat16", router_dtype="bfloat16")))
    assert flat.router.linear_router.weight.dtype == torch.bfloat16  # the field is read, not assumed

@pytest.mark.parametrize("fields,expected", [
    (dict(quantized=False), "bf16"),
    (dict(quantized=True, quantization_type="per_channel_symmetric", quantization_dtype="f8e4m3"), "fp8"),
    (dict(quantized=True, quantization_type="expert_wise_per_channel_symmetric", quantization_dtype="f8e4m3fn"),
     "fp8"),
    (dict(quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f8e4m3",
          quantization_block_size=[128, 128]), "fp8_block"),
    (dict(quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f4e2m1fn_x4",
          quantization_block_size=[32]), "mxfp4"),
])
def test_quantization_fields(fields, expected):
    assert routed_quantization(fields) == expected


@pytest.mark.parametrize("fields", [
    dict(quantized=True),  # NeuronConfig's defaults: int8 per tensor
    dict(quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="f8e4m3",
         quantization_block_size=[64, 64]),
])
def test_quantization_fields_nxd_moe_does_not_store(fields):
    with pytest.raises(ValueError, match="nxd_moe stores routed experts as FP8 E4M3 per channel"):
        routed_quantization(fields)


def test_a_quantized_layer():
    config = dict(num_local_experts=E, num_experts_per_tok=K, hidden_size=128, intermediate_size=128,
                  hidden_act="silu", neuron_config=dict(quantized=True, quantization_type="blockwise_symmetric",
                                                        quantization_dtype="f8e4m3",
                                                        quantization_block_size=[128, 128], torch_dtype="bfloat16"))
    moe = initialize_moe_module(config)
    assert moe.expert_mlps.routed_experts_mlp_config.quantization == "fp8_block"
    assert moe.expert_mlps.mlp_op.gate_up_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("fields,error,match", [
    (dict(capacity_factor=2.0), ValueError, "ignores it and runs the experts dropless"),
    (dict(is_mxfp4_compute=True), ValueError, "is_hidden_dim_shuffled must be None or False"),
    (dict(moe_ep_degree=2, moe_tp_degree=1), RuntimeError, "call nxd_moe.parallel_state.initialize_model_parallel"),
    (dict(hybrid_sharding_config=dict(moe_cte_tp_degree=1, moe_cte_ep_degree=2, moe_tkg_tp_degree=2)), ValueError,
     "hybrid_sharding_config has no 'moe_tkg_ep_degree'"),
    (dict(router_config=3), TypeError, "router_config must be a RouterConfig or a dict"),
    (dict(router_config=dict(act_fn="relu")), ValueError, "RouterTopK.act_fn must be one of"),
])
def test_named_errors(fields, error, match):
    config = dict(num_local_experts=E, num_experts_per_tok=K, hidden_size=HIDDEN, intermediate_size=INTER,
                  hidden_act="silu", neuron_config=fields)
    with pytest.raises(error, match=match):
        initialize_moe_module(config)


def test_missing_model_fields_are_named():
    with pytest.raises(ValueError, match="config has no 'num_experts_per_tok'"):
        initialize_moe_module(dict(num_local_experts=E, hidden_size=HIDDEN, neuron_config={}))
    with pytest.raises(ValueError, match="config has no 'neuron_config'"):
        initialize_moe_module(SimpleNamespace(num_local_experts=E))


def _layer_config(**neuron_fields):
    return dict(num_local_experts=E, num_experts_per_tok=K, hidden_size=HIDDEN, intermediate_size=INTER,
                hidden_act="silu", neuron_config=neuron_fields)


def test_every_field_away_from_its_default_lands_where_it_should():
    """Each field read, set to a value other than MoENeuronConfig's default (and each keyword argument other than
    its default), seen on the module it configures -- a dropped or swapped field shows."""
    config = dict(_layer_config(
        torch_dtype="bfloat16", sequence_parallel_enabled=True, hidden_act_scaling_factor=1.5, hidden_act_bias=0.25,
        gate_clamp_upper_limit=6.0, gate_clamp_lower_limit=-5.0, up_clamp_upper_limit=4.0, up_clamp_lower_limit=-3.0,
        use_index_calc_kernel=True, normalize_top_k_affinities=False, fused_shared_experts=True,
        shared_experts_sequence_parallel_enabled=True, transpose_shared_experts_weights=True,
        return_expert_index=True, return_router_logits=True, is_prefill_stage=True),
        original_hidden_size=HIDDEN - 2, n_shared_experts=1)
    norm = rmsnorm(seed=3)
    moe = initialize_moe_module(config, norm, False, True, True, True, backend="nki_sim")
    router, experts, shared = moe.router, moe.expert_mlps, moe.shared_experts
    assert (router.apply_act_fn_over_topk, router.linear_router.bias is not None) == (True, True)
    assert (router.sequence_parallel_enabled, router.sequence_dimension) == (True, 1)
    assert (moe.sequence_parallel_enabled, moe.sequence_dimension, moe.rmsnorm) == (True, 1, norm)
    assert (moe.return_router_logits, moe.return_expert_index) == (True, True)
    assert experts.sequence_parallel_enabled and type(experts.backend).__name__ == "NkiSimBackend"
    assert {p.dtype for p in experts.parameters()} == {torch.bfloat16}
    cfg = experts.routed_experts_mlp_config
    assert (cfg.hidden_size_actual, cfg.intermediate_size_actual, cfg.bias, cfg.is_prefill) == (HIDDEN - 2, None,
                                                                                                  True, True)
    assert (cfg.gate_clamp_upper_limit, cfg.gate_clamp_lower_limit, cfg.up_clamp_upper_limit,
            cfg.up_clamp_lower_limit) == (6.0, -5.0, 4.0, -3.0)
    assert (cfg.hidden_act_scaling_factor, cfg.hidden_act_bias, cfg.use_index_calc_kernel,
            cfg.normalize_top_k_affinities) == (1.5, 0.25, True, False)
    assert (shared.fused_gate_up_projection, shared.sequence_parallel_enabled, shared.transpose_weights) == (
        True, True, True)
    assert {p.dtype for p in shared.parameters()} == {torch.bfloat16}


def test_the_keyword_defaults_and_an_object_neuron_config_missing_every_field():
    """NxDI's keyword defaults (no activation over the top-k, no biases) and MoENeuronConfig's defaults for every
    field an object ``neuron_config`` lacks (bf16, GLU, normalised affinities)."""
    moe = initialize_moe_module(SimpleNamespace(**dict(_layer_config(), neuron_config=SimpleNamespace())))
    assert not moe.router.apply_act_fn_over_topk and moe.router.linear_router.bias is None
    cfg = moe.expert_mlps.routed_experts_mlp_config
    assert (cfg.bias, cfg.glu_mlp, cfg.normalize_top_k_affinities, cfg.is_prefill) == (False, True, True, None)
    assert moe.expert_mlps.dtype == torch.bfloat16 and not moe.sequence_parallel_enabled


@pytest.mark.parametrize("fields,error,message", [
    (dict(capacity_factor=2.0), ValueError,
     "neuron_config.capacity_factor=2.0: NxD Inference's initialize_moe_module (moe_v2) ignores it and runs the "
     "experts dropless; set it to None (to drop tokens, build RoutedExpertsMLPOpsConfig(capacity_factor=...) "
     "yourself)"),
    (dict(torch_dtype="float33"), TypeError, "neuron_config.torch_dtype must be a floating torch.dtype"),
    (dict(is_hidden_dim_shuffled=True), ValueError, "is_hidden_dim_shuffled must be None or False"),
    (dict(is_intermediate_dim_shuffled=True), ValueError, "is_intermediate_dim_shuffled must be None or False"),
])
def test_named_errors_whole(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        initialize_moe_module(_layer_config(**fields))


def test_errors_of_the_arguments_and_the_missing_fields_say_exactly_what():
    with pytest.raises(TypeError, match="^init_tkg_module must be a bool, got int$"):
        initialize_moe_module(_layer_config(), None, 1)
    with pytest.raises(ValueError, match="^initialize_moe_module: config has no 'neuron_config'$"):
        initialize_moe_module(SimpleNamespace(num_local_experts=E))
    with pytest.raises(ValueError, match="^initialize_moe_module: config has no 'hidden_size'$"):
        initialize_moe_module(dict(num_local_experts=E, num_experts_per_tok=K, neuron_config={}))
    with pytest.raises(AttributeError, match="^no_such_field$"):
        assert nxd_moe.nxdi._NeuronConfig({}).no_such_field is None  # never reached: the read raises


@pytest.fixture
def spmd_layout():
    from nxd_moe import parallel_state
    parallel_state.initialize_spmd_model_parallel(
        8, 2, 4, moe_prefill_tensor_model_parallel_size=4, moe_prefill_expert_model_parallel_size=2,
        moe_decode_tensor_model_parallel_size=1, moe_decode_expert_model_parallel_size=8, num_experts=E)
    yield
    parallel_state.destroy_model_parallel()


def test_the_process_groups_of_each_phase(spmd_layout):
    """``(tkg tensor, tkg expert, cte tensor, cte expert)``: decode's groups first (a layout whose phases differ;
    the config asks for the sizes it already has, so nothing is re-created)."""
    from nxd_moe.nxdi import initialize_moe_process_group
    hybrid = dict(moe_cte_tp_degree=4, moe_cte_ep_degree=2, moe_tkg_tp_degree=1, moe_tkg_ep_degree=8)
    groups = initialize_moe_process_group(_layer_config(hybrid_sharding_config=hybrid), True)
    assert [g.kind for g in groups] == ["moe_decode_tensor_groups", "moe_decode_expert_groups",
                                        "moe_prefill_tensor_groups", "moe_prefill_expert_groups"]


def test_a_config_without_moe_degrees_keeps_the_layouts_groups():
    """moe_ep_degree 1 (the default) asks for nothing: a layout whose MoE is split (TP 2) keeps its groups."""
    from nxd_moe import parallel_state
    from nxd_moe.nxdi import initialize_moe_process_group
    parallel_state.initialize_spmd_model_parallel(2, 2, 1)
    try:
        groups = initialize_moe_process_group(_layer_config(), False)
        assert groups[0].size == 2 and groups[1].size == 1
    finally:
        parallel_state.destroy_model_parallel()


def test_hybrid_sharding_flag_and_degrees_without_a_layout():
    from nxd_moe.nxdi import initialize_moe_process_group
    ones = dict(moe_cte_tp_degree=1, moe_cte_ep_degree=1, moe_tkg_tp_degree=1, moe_tkg_ep_degree=1)
    assert initialize_moe_process_group(_layer_config(hybrid_sharding_config=ones), True) == (None,) * 4
    with pytest.raises(ValueError, match=re.escape("initialize_moe_process_group: enabled_hybrid_sharding=True "
                                                   "needs neuron_config.hybrid_sharding_config")):
        initialize_moe_process_group(_layer_config(), True)
    with pytest.raises(RuntimeError, match=re.escape(
            "initialize_moe_module: the config splits the MoE as (tp, ep) = ((1, 2), (1, 2)) for (prefill, decode); "
            "call nxd_moe.parallel_state.initialize_model_parallel first (on every rank, as NxDI does)")):
        initialize_moe_process_group(_layer_config(moe_ep_degree=2), False)
