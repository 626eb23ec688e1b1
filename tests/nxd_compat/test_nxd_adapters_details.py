"""The NxD-signature adapters (``nxd_moe/nxd_compat/adapters.py``) argument by argument, where test_nxd_modules.py's
layer-level cases leave them open: NxD's defaults, every keyword landing in its field, each process-group argument
checked against its own role, the state-dict copies NxD keeps (``weight_T``, ``moe_fused_tkg.*``) and every error
message word for word. Found by mutation testing (benchmarks/mutation.py).

Process groups: an SPMD layout of 8 ranks (no torch.distributed) seen from rank 5, where each MoE group kind holds
other ranks -- TP 2 x EP 2, the MoE split TP 4 x EP 1 for prefill and TP 2 x EP 2 for decode: prefill tensor
[4, 5, 6, 7], prefill expert [5], decode tensor [4, 5], decode expert [5, 7], global tensor-parallel [4, 5]. NxD
hands modules torch.distributed groups; here a group is a stand-in holding its ranks, and
``nxd_compat.parallel_state``'s ``dist`` answers rank 5 and those ranks.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import FP32_ATOL, assert_close, randn, randomize_

import nxd_moe
from nxd_moe import parallel_state as ours
from nxd_moe.experts.backends import TorchBackend
from nxd_moe.moe_configs import BlockShardStrategy, GLUType, MoEFusedTKGConfig, RoutedExpertsMLPOpsConfig
from nxd_moe.nxd_compat import adapters
from nxd_moe.nxd_compat import parallel_state as nxd_parallel_state
from nxd_moe.nxd_compat.not_served import NotServedError

H, INTER, E, K = 16, 12, 4, 2
META = torch.device("meta")


def _config(**kwargs) -> RoutedExpertsMLPOpsConfig:
    return RoutedExpertsMLPOpsConfig(**{**dict(num_experts=E, hidden_size=H, intermediate_size=INTER, top_k=K,
                                                hidden_act="silu", glu_mlp=True), **kwargs})


class Group:
    """A process group stand-in: its ranks."""

    def __init__(self, *ranks: int):
        self.ranks = list(ranks)


PREFILL_TP, PREFILL_EP, DECODE_TP, DECODE_EP = Group(4, 5, 6, 7), Group(5), Group(4, 5), Group(5, 7)
TP = Group(4, 5)
OTHER = Group(0, 1, 2, 3, 4, 5, 6, 7)  # no group of rank 5 but the world holds every rank


@pytest.fixture
def rank5(monkeypatch):
    ours.initialize_spmd_model_parallel(
        8, 2, 2, rank=5, moe_prefill_tensor_model_parallel_size=4, moe_prefill_expert_model_parallel_size=1,
        moe_decode_tensor_model_parallel_size=2, moe_decode_expert_model_parallel_size=2, num_experts=8)
    monkeypatch.setattr(nxd_parallel_state, "dist", SimpleNamespace(
        get_rank=lambda: 5, get_process_group_ranks=lambda group: group.ranks))
    yield
    ours.destroy_model_parallel()


def _mismatch(owner: str, name: str, ranks: list[int], what: str, expected: list[int]) -> str:
    return "^" + re.escape(
        f"{owner}: {name} holds ranks {ranks}, but this rank's {what} is {expected}; nxd_moe runs the layer over "
        "parallel_state's groups (pass None, or initialize_model_parallel with the layout you want)") + "$"


# ----------------------------------------------------------------------------------------------------------
# routers


def test_router_top_k_defaults_and_the_arguments_the_base_keeps():
    router = adapters.RouterTopK(E, K, H)
    assert (router.sequence_parallel_enabled, router.sequence_dimension, router.dtype, router.act_fn,
            router.apply_act_fn_over_topk, router.jitter_eps, router.store_transposed_weights) == (
        False, None, torch.float32, "softmax", False, 0.0, False)
    assert router.linear_router.bias is None and router.linear_router.weight.device.type == "cpu"
    group = object()
    other = adapters.RouterTopK(E, K, H, device=META, tensor_model_parallel_group=group, jitter_eps=0.25)
    assert other.linear_router.weight.device == META and other.tensor_model_parallel_group is group
    assert other.jitter_eps == 0.25


class _Holder(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.router = router


def test_router_top_k_drops_nxds_transposed_copy_of_its_weight():
    router = adapters.RouterTopK(E, K, H)
    weight = randn(E, H, seed=1)
    holder = _Holder(router)
    holder.load_state_dict({"router.linear_router.weight": weight, "router.weight_T": weight.T.clone()})
    assert torch.equal(router.linear_router.weight, weight)
    holder.load_state_dict({"router.weight_T": 2 * weight.T})  # only the copy: loaded as its transpose
    assert torch.equal(router.linear_router.weight, 2 * weight)
    router.load_state_dict({"linear_router.weight": weight, "weight_T": weight.T.clone()})  # no prefix
    assert torch.equal(router.linear_router.weight, weight)
    with pytest.raises(ValueError, match="^" + re.escape(
            "RouterTopK: state dict entry 'router.weight_T' must hold the same values as "
            "'router.linear_router.weight' (NxD keeps it as a copy for its fused decode kernel; nxd_moe loads the "
            "one tensor)") + "$"):
        holder.load_state_dict({"router.linear_router.weight": weight, "router.weight_T": weight.T + 1})
    with pytest.raises(ValueError, match="must hold the same values"):  # not transposed: not the copy
        square = adapters.RouterTopK(H, K, H)
        w = randn(H, H, seed=2)
        square.load_state_dict({"linear_router.weight": w, "weight_T": w.clone()})


def test_router_sinkhorn_defaults_arguments_and_refused_tolerance():
    router = adapters.RouterSinkhorn(E, 1, H)
    assert (router.act_fn, router.sequence_parallel_enabled, router.sequence_dimension) == ("sigmoid", False, None)
    other = adapters.RouterSinkhorn(E, 1, H, "softmax", True, 1, torch.float64, META, 7)
    assert (other.act_fn, other.sequence_parallel_enabled, other.sequence_dimension, other.dtype) == (
        "softmax", True, 1, torch.float64)  # (a sequence-parallel router's dimension is 0 unless given)
    assert other.linear_router.weight.device == META
    with pytest.raises(ValueError, match="^" + re.escape(
            "RouterSinkhorn.sinkhorn_tol must be None, got 0.001: nxd_moe runs a fixed number of Sinkhorn "
            "iterations (sinkhorn_iterations) and never checks the error on the host") + "$"):
        adapters.RouterSinkhorn(E, 1, H, sinkhorn_tol=1e-3)


def test_nxds_static_sinkhorn():
    cost = randn(6, E, seed=3)
    assert adapters.RouterSinkhorn._sinkhorn(cost, 0) is cost
    with pytest.raises(ValueError, match="^" + re.escape(
            "RouterSinkhorn._sinkhorn: tol must be None, got 0.5: nxd_moe never checks the Sinkhorn error on the "
            "host") + "$"):
        adapters.RouterSinkhorn._sinkhorn(cost, 2, tol=0.5)
    with pytest.raises(ValueError, match=r"^num_iters must be in \[0, inf\], got -1$"):
        adapters.RouterSinkhorn._sinkhorn(cost, -1)
    with pytest.raises(TypeError, match="^num_iters must be an int, got NoneType None$"):
        adapters.RouterSinkhorn._sinkhorn(cost, None)
    # Logits near 60: exp overflows float32 (above ~88.7) unless shifted down by their maximum.
    balanced = adapters.RouterSinkhorn._sinkhorn(cost + 60.0, 2)
    assert balanced.dtype == torch.float32 and torch.isfinite(balanced).all()
    assert_close(balanced.sum(dim=0), torch.full((E,), 1.0 / E), 1e-6)  # fp32 sums of 6 values ~ 1/24: ~1e-8 off
    big = (cost + 60.0).double()
    for iters in (1, 3):
        balanced = adapters.RouterSinkhorn._sinkhorn(big, iters)
        assert torch.isfinite(balanced).all()
        # the last step scales the columns to sum 1/E (up to sinkhorn's eps = 1e-8 against sums >= 1/T)
        assert_close(balanced.sum(dim=0), torch.full((E,), 1.0 / E, dtype=torch.float64), 1e-6)
        # exp(cost) scaled by a row and a column factor: log(balanced) - cost has rank one (a_i + b_j)
        residual = balanced.log() - big
        assert_close(residual - residual[:, :1] - residual[:1, :] + residual[0, 0], torch.zeros_like(big), 1e-9)
    many = adapters.RouterSinkhorn._sinkhorn(big, 50)
    assert_close(many.sum(dim=1), torch.full((6,), 1.0 / 6, dtype=torch.float64), 1e-6)


# ----------------------------------------------------------------------------------------------------------
# the blockwise config's experts settings


def test_blockwise_from_kwargs_keeps_the_experts_settings_aside():
    blockwise = adapters.NxdBlockwiseMatmulConfig.from_kwargs(block_size=8, early_expert_affinity_modulation=True,
                                                              normalize_top_k_affinities=False)
    assert blockwise.block_size == 8
    assert blockwise.experts_settings == {"early_expert_affinity_modulation": True,
                                          "normalize_top_k_affinities": False}
    experts = adapters.ExpertMLPsV2(_config(early_expert_affinity_modulation=True), blockwise)  # equal: accepted
    assert experts.routed_experts_mlp_config.early_expert_affinity_modulation is True
    with pytest.raises(ValueError, match="^" + re.escape(
            "ExpertMLPsV2: BlockwiseMatmulConfig.from_kwargs was given early_expert_affinity_modulation=True, a "
            "setting of the routed experts, but RoutedExpertsMLPOpsConfig.early_expert_affinity_modulation is "
            "False; set it in RoutedExpertsMLPOpsConfig (NxD ignores it in the blockwise config)") + "$"):
        adapters.ExpertMLPsV2(_config(), blockwise)
    plain = nxd_moe.BlockwiseMatmulConfig(block_size=8)  # nxd_moe's own: no settings to check
    assert adapters.ExpertMLPsV2(_config(), plain).blockwise_matmul_config is plain


# ----------------------------------------------------------------------------------------------------------
# ExpertMLPsV2 and ExpertMLPs


def test_expert_mlps_v2_defaults_and_arguments():
    experts = adapters.ExpertMLPsV2(_config())
    assert (experts.sequence_parallel_enabled, experts.is_prefill, experts.enabled_hybrid_sharding,
            experts.dtype) == (False, True, False, torch.float32)
    backend = TorchBackend()
    other = adapters.ExpertMLPsV2(_config(), None, False, torch.float64, True, META, backend=backend)
    assert other.backend is backend and other.sequence_parallel_enabled is True and other.dtype == torch.float64
    assert {p.device for p in other.parameters()} == {META}


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(return_bias=True), ValueError, "ExpertMLPsV2.return_bias must be False: the expert biases are added "
                                         "inside the layer (NxD raises NotImplementedError for it too)"),
    (dict(return_bias=1), TypeError, "ExpertMLPsV2.return_bias must be a bool, got int 1"),
    (dict(is_prefill=0), TypeError, "ExpertMLPsV2.is_prefill must be a bool, got int 0"),
    (dict(enabled_hybrid_sharding=1), TypeError, "ExpertMLPsV2.enabled_hybrid_sharding must be a bool, got int 1"),
    (dict(enabled_hybrid_sharding=True), ValueError, "ExpertMLPsV2: enabled_hybrid_sharding=True needs "
     "['cte_tensor_model_parallel_group', 'cte_expert_model_parallel_group', 'tkg_tensor_model_parallel_group', "
     "'tkg_expert_model_parallel_group'] (as in NxD)"),
    (dict(enabled_hybrid_sharding=True, cte_tensor_model_parallel_group=object(),
          tkg_expert_model_parallel_group=object()), ValueError, "ExpertMLPsV2: enabled_hybrid_sharding=True needs "
     "['cte_expert_model_parallel_group', 'tkg_tensor_model_parallel_group'] (as in NxD)"),
])
def test_expert_mlps_v2_refusals_word_for_word(kwargs, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        adapters.ExpertMLPsV2(_config(), **kwargs)


def test_expert_mlps_v2_forward_passes_every_argument_on():
    experts = randomize_(adapters.ExpertMLPsV2(_config(), nxd_moe.BlockwiseMatmulConfig(block_size=4)), seed=4)
    x = randn(6, H, seed=5)
    affinities = torch.softmax(randn(6, E, seed=6), dim=-1)
    index = affinities.topk(K, dim=-1).indices
    out, stats = experts(x, affinities, index, 1, None, return_stats=True)  # NxD's kwargs reach the layer
    assert stats.mode.value != experts(x, affinities, index, None, return_stats=True)[1].mode.value
    mask = torch.tensor([1, 0, 1, 1, 0, 1])
    masked = experts(x, affinities, index, 6, mask)
    assert torch.equal(masked[1], torch.zeros(H)) and torch.equal(masked[4], torch.zeros(H))
    assert_close(masked[0], out[0], FP32_ATOL)  # the other tokens as without a mask
    with pytest.raises(ValueError, match="^" + re.escape(
            "ExpertMLPsV2.forward: expert_affinities_masked_full must be None; nxd_moe masks (and normalises) "
            "expert_affinities itself, so a precomputed copy could disagree") + "$"):
        experts(x, affinities, index, 6, None, affinities)


def test_expert_mlps_v2_groups_are_checked_each_against_its_role(rank5):
    config = _config(num_experts=8)
    # NxD's order: (..., tp, ep, tkg tp, tkg ep, cte tp, cte ep, is_prefill, enabled_hybrid_sharding)
    built = adapters.ExpertMLPsV2(config, None, False, torch.float32, False, torch.device("cpu"), None, None,
                                  DECODE_TP, DECODE_EP, PREFILL_TP, PREFILL_EP, False, True)
    assert built.enabled_hybrid_sharding is True and built.is_prefill is False
    adapters.ExpertMLPsV2(config, cte_tensor_model_parallel_group=PREFILL_TP, cte_expert_model_parallel_group=
                          PREFILL_EP, tkg_tensor_model_parallel_group=DECODE_TP,
                          tkg_expert_model_parallel_group=DECODE_EP)
    cases = [  # (keyword, the role's name in the message, its ranks)
        ("tensor_model_parallel_group", "moe prefill tensor group", [4, 5, 6, 7]),
        ("expert_model_parallel_group", "moe prefill expert group", [5]),
        ("cte_tensor_model_parallel_group", "moe prefill tensor group", [4, 5, 6, 7]),
        ("cte_expert_model_parallel_group", "moe prefill expert group", [5]),
        ("tkg_tensor_model_parallel_group", "moe decode tensor group", [4, 5]),
        ("tkg_expert_model_parallel_group", "moe decode expert group", [5, 7]),
    ]
    for keyword, what, expected in cases:
        with pytest.raises(ValueError, match=_mismatch("ExpertMLPsV2", keyword, OTHER.ranks, what, expected)):
            adapters.ExpertMLPsV2(config, **{keyword: OTHER})
    # a phase's own group given: the global one (the default) is not checked for that phase
    with pytest.raises(ValueError, match=_mismatch("ExpertMLPsV2", "tkg_tensor_model_parallel_group", [4, 5, 6, 7],
                                                   "moe decode tensor group", [4, 5])):
        adapters.ExpertMLPsV2(config, tensor_model_parallel_group=PREFILL_TP,
                              tkg_tensor_model_parallel_group=PREFILL_TP)
    # ExpertMLPs passes each group on in its place
    flat = dict(num_experts=8, top_k=K, hidden_size=H, intermediate_size=INTER, hidden_act="silu", glu_mlp=True,
                capacity_factor=None)
    for keyword, what, expected in cases:
        with pytest.raises(ValueError, match=_mismatch("ExpertMLPsV2", keyword, OTHER.ranks, what, expected)):
            adapters.ExpertMLPs(**flat, **{keyword: OTHER})
    assert adapters.ExpertMLPs(**flat, tensor_model_parallel_group=PREFILL_TP, expert_model_parallel_group=PREFILL_EP,
                               tkg_tensor_model_parallel_group=DECODE_TP, tkg_expert_model_parallel_group=DECODE_EP,
                               cte_tensor_model_parallel_group=PREFILL_TP, cte_expert_model_parallel_group=PREFILL_EP,
                               enabled_hybrid_sharding=True).enabled_hybrid_sharding is True


NXD_EXPERT_MLPS_DEFAULTS = dict(  # NxD's ExpertMLPs keyword defaults, as the two configs hold them
    bias=False, glu_type=GLUType.GLU, hidden_act_scaling_factor=1.0, hidden_act_bias=0.0, gate_clamp_upper_limit=None,
    gate_clamp_lower_limit=None, up_clamp_upper_limit=None, up_clamp_lower_limit=None,
    normalize_top_k_affinities=False, early_expert_affinity_modulation=False,
    input_layer_init_method=torch.nn.init.kaiming_uniform_, output_layer_init_method=torch.nn.init.kaiming_uniform_,
    enable_spmd_rank=False, use_index_calc_kernel=False, expert_distribution=None)
NXD_BLOCKWISE_DEFAULTS = dict(
    block_size=512, use_block_parallel=False, block_sharding_strategy=BlockShardStrategy.HI_LO, skip_dma_token=False,
    skip_dma_weight=False, logical_nc_config=1, blockwise_nki_autograd_cls=None, use_torch_block_wise=False,
    parallelize_token_to_block_mapping=True, optimized_block_to_token_mapping=True,
    always_augment_inputs_for_blockwise_matmul=False, use_shard_on_intermediate_dynamic_while=False,
    use_shard_on_block_dynamic_while=False)


def test_expert_mlps_defaults_are_nxds(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    experts = adapters.ExpertMLPs(E, K, H, INTER, "silu", True, None)
    cfg, blockwise = experts.routed_experts_mlp_config, experts.blockwise_matmul_config
    assert {k: getattr(cfg, k) for k in NXD_EXPERT_MLPS_DEFAULTS} == NXD_EXPERT_MLPS_DEFAULTS
    assert {k: getattr(blockwise, k) for k in NXD_BLOCKWISE_DEFAULTS} == NXD_BLOCKWISE_DEFAULTS
    assert (experts.sequence_parallel_enabled, experts.is_prefill, experts.enabled_hybrid_sharding, experts.dtype,
            cfg.capacity_factor) == (False, True, False, torch.float32, None)


def test_expert_mlps_every_keyword_lands_in_its_field():
    def init(weight):
        return torch.nn.init.zeros_(weight)

    def output_init(weight):
        return torch.nn.init.ones_(weight)

    autograd, backend = object(), TorchBackend()
    experts_fields = dict(
        bias=True, glu_type=GLUType.SWIGLU, hidden_act_scaling_factor=1.5, hidden_act_bias=0.25,
        gate_clamp_upper_limit=7.0, gate_clamp_lower_limit=-6.0, up_clamp_upper_limit=5.0,
        up_clamp_lower_limit=-4.0, normalize_top_k_affinities=True, early_expert_affinity_modulation=True,
        enable_spmd_rank=True, use_index_calc_kernel=True, expert_distribution=((3, 0, 2, 1),))
    blockwise_fields = dict(
        block_size=8, use_block_parallel=True, block_sharding_strategy=BlockShardStrategy.PING_PONG,
        skip_dma_token=True, skip_dma_weight=True, logical_nc_config=2, blockwise_nki_autograd_cls=autograd,
        use_torch_block_wise=True, parallelize_token_to_block_mapping=False, optimized_block_to_token_mapping=False,
        always_augment_inputs_for_blockwise_matmul=True, use_shard_on_intermediate_dynamic_while=True)
    # (use_shard_on_block_dynamic_while excludes the intermediate one: test_nxd_modules.py sets it)
    experts = adapters.ExpertMLPs(
        E, K, H, INTER, "gelu", True, 1.75, True, init_method=init, output_layer_init_method=output_init,
        dtype=torch.float64, device=META, is_prefill=False, backend=backend, **experts_fields, **blockwise_fields)
    cfg, blockwise = experts.routed_experts_mlp_config, experts.blockwise_matmul_config
    assert {k: getattr(cfg, k) for k in experts_fields} == experts_fields
    assert {k: getattr(blockwise, k) for k in blockwise_fields} == blockwise_fields
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.glu_mlp,
            cfg.capacity_factor, cfg.input_layer_init_method, cfg.output_layer_init_method) == (
        E, K, H, INTER, "gelu", True, 1.75, init, output_init)
    assert (experts.sequence_parallel_enabled, experts.is_prefill, experts.dtype, experts.backend) == (
        True, False, torch.float64, backend)
    assert {p.device for p in experts.parameters()} == {META}


# ----------------------------------------------------------------------------------------------------------
# SharedExperts


def test_shared_experts_defaults_and_arguments():
    shared = adapters.SharedExperts(H, 6, 2, "silu")
    assert (shared.fused_gate_up_projection, shared.sequence_parallel_enabled, shared.transpose_weights,
            shared.reduce_dtype, shared.down_proj.weight.dtype) == (False, False, False, torch.float32,
                                                                    torch.float32)
    other = adapters.SharedExperts(H, 6, 2, "silu", torch.float64, None, None, False, True, False)
    assert (other.reduce_dtype, other.sequence_parallel_enabled, other.down_proj.weight.dtype) == (
        None, True, torch.float64)
    assert adapters.SharedExperts(H, 6, 1, "silu", reduce_dtype="bfloat16").reduce_dtype == torch.bfloat16
    with pytest.raises(TypeError, match="^SharedExperts.reduce_dtype must be a floating torch.dtype or one of"):
        adapters.SharedExperts(H, 6, 1, "silu", reduce_dtype=3)


def test_shared_experts_and_moe_check_the_tensor_parallel_group(rank5):
    adapters.SharedExperts(H, 6, 1, "silu", tensor_model_parallel_group=TP)
    with pytest.raises(ValueError, match=_mismatch("SharedExperts", "tensor_model_parallel_group", [5, 7],
                                                   "tensor model parallel group", [4, 5])):
        adapters.SharedExperts(H, 6, 1, "silu", tensor_model_parallel_group=DECODE_EP)
    with pytest.raises(ValueError, match=_mismatch("MoE", "tensor_model_parallel_group", [5, 7],
                                                   "tensor model parallel group", [4, 5])):
        adapters.MoE(None, None, tensor_model_parallel_group=DECODE_EP)
    with pytest.raises(TypeError, match="^MoE: router must be a RouterBase, got NoneType$"):  # the group passed
        adapters.MoE(None, None, tensor_model_parallel_group=TP)


# ----------------------------------------------------------------------------------------------------------
# MoE


def _parts(normalize: bool = True):
    router = adapters.RouterTopK(E, K, H)
    experts = adapters.ExpertMLPsV2(_config(normalize_top_k_affinities=normalize),
                                    nxd_moe.BlockwiseMatmulConfig(block_size=4))
    return router, experts


def test_moe_defaults_and_positional_arguments():
    router, experts = _parts()
    moe = adapters.MoE(router, experts)
    assert (moe.return_router_logits, moe.return_expert_index, moe.init_tkg_module, moe.tkg_config,
            moe.shared_experts, moe.rmsnorm, moe.sequence_dimension) == (False, False, False, None, None, None, None)
    assert "moe_fused_tkg" not in vars(moe)
    shared, norm = adapters.SharedExperts(H, 6, 1, "silu"), torch.nn.RMSNorm(H)
    tkg = MoEFusedTKGConfig(quantized=False, norm_topk_prob=True)
    other = adapters.MoE(router, experts, shared, norm, False, 0, True, True, 1, 9, None, True, tkg)
    assert (other.shared_experts, other.rmsnorm, other.sequence_dimension, other.return_router_logits,
            other.return_expert_index, other.init_tkg_module, other.tkg_config) == (
        shared, norm, 0, True, True, True, tkg)
    with pytest.raises(NotServedError, match="^" + re.escape(
            "MoE.moe_fused_tkg (NxD's MoEFusedTKG) is not served by nxd_moe's NxD front door (Neuron kernel "
            "plumbing: nxd_moe's kernels are its backends (backend='nki_sim' on the NKI tile simulator, 'triton' on "
            "GPUs), chosen by the backend rather than by NxD's eligibility rules); docs/nxd.md lists what is") + "$"):
        other.moe_fused_tkg()


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(token_shuffle_group_size=4), ValueError, "MoE.token_shuffle_group_size must be 1, got 4: token shuffling "
     "balances expert load in training, and nxd_moe is an inference layer"),
    (dict(init_tkg_module=1), TypeError, "MoE.init_tkg_module must be a bool, got int 1"),
    (dict(init_tkg_module=True), TypeError, "MoE: init_tkg_module=True needs tkg_config, a MoEFusedTKGConfig, got "
                                            "NoneType"),
    (dict(init_tkg_module=True, tkg_config=dict(norm_topk_prob=True)), TypeError,
     "MoE: init_tkg_module=True needs tkg_config, a MoEFusedTKGConfig, got dict"),
    (dict(init_tkg_module=True, tkg_config=MoEFusedTKGConfig(quantized=False, norm_topk_prob=False)), ValueError,
     "MoE: tkg_config.norm_topk_prob=False but the experts' normalize_top_k_affinities=True; NxD's fused decode "
     "kernel would compute another function than its other paths -- make them equal"),
])
def test_moe_refusals_word_for_word(kwargs, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        adapters.MoE(*_parts(), **kwargs)


def test_moe_reads_the_experts_normalisation_only_where_there_is_one():
    tkg = MoEFusedTKGConfig(quantized=False, norm_topk_prob=False)
    router, experts = _parts(normalize=False)
    assert adapters.MoE(router, experts, init_tkg_module=True, tkg_config=tkg).tkg_config is tkg
    # experts that are not nxd_moe's: the layer's own type check names them (not an AttributeError here)
    for expert_mlps in (object(), SimpleNamespace(routed_experts_mlp_config=SimpleNamespace())):
        with pytest.raises(TypeError, match="^MoE: expert_mlps must be an ExpertMLPsV2, got"):
            adapters.MoE(router, expert_mlps, init_tkg_module=True, tkg_config=tkg)


class _Layer(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.mlp = moe


def test_moe_drops_nxds_fused_decode_copies():
    router, experts = _parts()
    norm = torch.nn.RMSNorm(H)
    tkg = MoEFusedTKGConfig(quantized=False, norm_topk_prob=True)
    moe = randomize_(adapters.MoE(router, experts, None, norm, init_tkg_module=True, tkg_config=tkg), seed=7)
    own = {k: v.clone() for k, v in moe.state_dict().items()}
    copies = {f"moe_fused_tkg.{k}": v.clone() for k, v in own.items() if not k.startswith("rmsnorm.")}
    copies["moe_fused_tkg.post_attention_layernorm.weight"] = own["rmsnorm.weight"].clone()
    target = _Layer(randomize_(adapters.MoE(*_parts(), None, torch.nn.RMSNorm(H), init_tkg_module=True,
                                            tkg_config=tkg), seed=8))
    target.load_state_dict({f"mlp.{k}": v for k, v in {**own, **copies}.items()})
    assert all(torch.equal(v, own[k]) for k, v in target.mlp.state_dict().items())
    # only the copies: loaded as the tensors they copy (the norm's under its NxD name)
    target = _Layer(randomize_(adapters.MoE(*_parts(), None, torch.nn.RMSNorm(H), init_tkg_module=True,
                                            tkg_config=tkg), seed=9))
    target.load_state_dict({f"mlp.{k}": v for k, v in copies.items()})
    assert all(torch.equal(v, own[k]) for k, v in target.mlp.state_dict().items())
    bad = {**own, **copies, "moe_fused_tkg.post_attention_layernorm.weight": own["rmsnorm.weight"] + 1}
    with pytest.raises(ValueError, match="^" + re.escape(
            "MoE: state dict entry 'mlp.moe_fused_tkg.post_attention_layernorm.weight' must hold the same values as "
            "'mlp.rmsnorm.weight' (NxD keeps it as a copy for its fused decode kernel; nxd_moe loads the one "
            "tensor)") + "$"):
        target.load_state_dict({f"mlp.{k}": v for k, v in bad.items()})
