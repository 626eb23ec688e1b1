"""NxD's constructor signatures on nxd_moe's modules, where they differ from ours.

Each class here is the nxd_moe module (a subclass: ``isinstance(router, nxd_moe.RouterTopK)`` holds) taking NxD's
arguments in NxD's order; nothing else changes. Per argument NxD has and nxd_moe does not:

- process groups (``tensor_model_parallel_group``, ``cte_*`` / ``tkg_*`` groups, ...): nxd_moe takes its groups
  from :mod:`nxd_moe.parallel_state`, so a group passed must be the one of that role there (else a named error;
  :func:`~nxd_moe.nxd_compat.parallel_state.check_group`);
- Neuron kernel layout or selection (``store_transposed_weights``, ``init_tkg_module`` / ``tkg_config``,
  ``is_prefill``, ``enabled_hybrid_sharding``): accepted; the function computed is the same (the fused decode
  config's ``norm_topk_prob`` must agree with the experts');
- training-only features NxD's inference never uses (``token_shuffle_group_size > 1``, ``sinkhorn_tol``,
  ``return_bias=True``, ``expert_affinities_masked_full``): refused by name.
"""

from __future__ import annotations

import dataclasses

import torch

from nxd_moe import expert_mlps_v2 as expert_mlps_module
from nxd_moe import moe as moe_module
from nxd_moe import shared_experts as shared_module
from nxd_moe.checks import check_bool, check_int, to_torch_dtype
from nxd_moe.moe_configs import (
    DEFAULT_BLOCK_SIZE,
    BlockShardStrategy,
    BlockwiseMatmulConfig,
    GLUType,
    MoEFusedTKGConfig,
    RoutedExpertsMLPOpsConfig,
    default_logical_nc_config,
)
from nxd_moe.nxd_compat.block_mapping import ExpertMLPsHelpers
from nxd_moe.nxd_compat.not_served import KERNELS, NotServed
from nxd_moe.nxd_compat.parallel_state import check_group
from nxd_moe.routing import sinkhorn as sinkhorn_module
from nxd_moe.routing import topk as topk_module
from nxd_moe.routing.sinkhorn import DEFAULT_SINKHORN_ITERATIONS, sinkhorn

__all__ = ["RouterTopK", "RouterSinkhorn", "NxdBlockwiseMatmulConfig", "AssignableRoutedExpertsMLPOpsConfig",
           "ExpertMLPsV2", "ExpertMLPs", "SharedExperts", "MoE"]

CPU = torch.device("cpu")  # NxD's default device for weights


def _drop_copy(state_dict: dict, key: str, original: str, transform, owner: str) -> None:
    """Remove ``state_dict[key]``, a copy NxD stores of ``state_dict[original]`` (``transform`` of it), after checking
    it is one; when ``original`` is missing, the copy is loaded as it."""
    copy = state_dict.pop(key)
    if original not in state_dict:
        state_dict[original] = transform(copy)
    elif not torch.equal(transform(copy), state_dict[original]):
        raise ValueError(f"{owner}: state dict entry {key!r} must hold the same values as {original!r} (NxD keeps "
                         "it as a copy for its fused decode kernel; nxd_moe loads the one tensor)")


class RouterTopK(topk_module.RouterTopK):
    """NxD's signature. ``store_transposed_weights`` keeps a transposed copy of the router weight for NxD's fused
    decode kernel; nxd_moe's kernels read ``linear_router.weight`` itself, so no ``weight_T`` is stored: a
    ``weight_T`` entry of a state dict is checked to be that transpose, and dropped."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, sequence_parallel_enabled: bool = False,
                 sequence_dimension: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device = CPU, bias: bool = False, tensor_model_parallel_group=None,
                 act_fn: str = "softmax", apply_act_fn_over_topk: bool = False, jitter_eps: float = 0.0,
                 store_transposed_weights: bool = False):
        super().__init__(num_experts, top_k, hidden_size, sequence_parallel_enabled, sequence_dimension, dtype,
                         device, bias, tensor_model_parallel_group, act_fn, apply_act_fn_over_topk, jitter_eps)
        self.store_transposed_weights = check_bool("RouterTopK.store_transposed_weights", store_transposed_weights)
        self.register_load_state_dict_pre_hook(self._drop_weight_t)

    @staticmethod
    def _drop_weight_t(module, state_dict, prefix, *args) -> None:
        if f"{prefix}weight_T" in state_dict:
            _drop_copy(state_dict, f"{prefix}weight_T", f"{prefix}linear_router.weight", lambda w: w.T,
                       "RouterTopK")


class RouterSinkhorn(sinkhorn_module.RouterSinkhorn):
    """NxD's signature. ``sinkhorn_tol`` must be None: NxD asserts on the Sinkhorn error after training iterations
    (a host sync); nxd_moe runs the fixed iteration count and never reads the error."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, act_fn: str = "sigmoid",
                 sequence_parallel_enabled: bool = False, sequence_dimension: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device = CPU,
                 sinkhorn_iterations: int | None = None, sinkhorn_tol: float | None = None):
        if sinkhorn_tol is not None:
            raise ValueError(f"RouterSinkhorn.sinkhorn_tol must be None, got {sinkhorn_tol!r}: nxd_moe runs a fixed "
                             "number of Sinkhorn iterations (sinkhorn_iterations) and never checks the error on the "
                             "host")
        super().__init__(num_experts, top_k, hidden_size, act_fn, sequence_parallel_enabled, sequence_dimension,
                         dtype, device, sinkhorn_iterations)

    DEFAULT_SINKHORN_ITERS = DEFAULT_SINKHORN_ITERATIONS

    @staticmethod
    def _sinkhorn(cost: torch.Tensor, num_iters: int, tol: float | None = None) -> torch.Tensor:
        """NxD's Sinkhorn balancing of router logits ``cost (T, E)``: ``exp(cost)`` scaled ``num_iters`` times
        towards uniform row and column sums (``cost`` itself when ``num_iters`` is 0). ``tol`` must be None, as
        for ``sinkhorn_tol``."""
        if tol is not None:
            raise ValueError(f"RouterSinkhorn._sinkhorn: tol must be None, got {tol!r}: nxd_moe never checks the "
                             "Sinkhorn error on the host")
        if check_int("num_iters", num_iters, minimum=0) == 0:
            return cost
        # The balanced matrix does not depend on a global scale of exp(cost); shifting by the max cannot overflow.
        return sinkhorn(torch.exp(cost - cost.max()), num_iters)


class NxdBlockwiseMatmulConfig(BlockwiseMatmulConfig):
    """:class:`~nxd_moe.config.BlockwiseMatmulConfig` with NxD's ``from_kwargs``. NxD's ``ExpertMLPs`` -- and NxD
    code written after it, NxD's unit tests among it -- also passes settings of the routed experts there
    (``early_expert_affinity_modulation``), which NxD drops. They are kept aside (``experts_settings``) and
    :class:`ExpertMLPsV2` checks them against its ``RoutedExpertsMLPOpsConfig``: equal values pass, another value
    is an error (NxD would silently follow the experts' config). Any other unknown key is refused, as by
    nxd_moe's ``from_kwargs``."""

    @classmethod
    def from_kwargs(cls, **kwargs) -> "NxdBlockwiseMatmulConfig":
        experts_fields = {f.name for f in dataclasses.fields(RoutedExpertsMLPOpsConfig)}
        settings = {key: kwargs.pop(key) for key in list(kwargs) if key in experts_fields}
        config = super().from_kwargs(**kwargs)
        object.__setattr__(config, "experts_settings", settings)
        return config


def _check_experts_settings(blockwise: BlockwiseMatmulConfig, experts: RoutedExpertsMLPOpsConfig) -> None:
    """The routed experts' settings given to NxD's ``BlockwiseMatmulConfig.from_kwargs`` must be the experts'."""
    for key, value in getattr(blockwise, "experts_settings", {}).items():
        if getattr(RoutedExpertsMLPOpsConfig.replace(experts, **{key: value}), key) != getattr(experts, key):
            raise ValueError(f"ExpertMLPsV2: BlockwiseMatmulConfig.from_kwargs was given {key}={value!r}, a setting "
                             f"of the routed experts, but RoutedExpertsMLPOpsConfig.{key} is "
                             f"{getattr(experts, key)!r}; set it in RoutedExpertsMLPOpsConfig (NxD ignores it in "
                             "the blockwise config)")


class AssignableRoutedExpertsMLPOpsConfig(RoutedExpertsMLPOpsConfig):
    """The experts' config as a built :class:`ExpertMLPsV2` holds it. NxD's config is mutable and NxD code assigns
    its fields on a built module (NxD's unit tests switch ``normalize_top_k_affinities`` on after construction).
    Here the fields the layer reads at every forward may be assigned, validated as at construction; the others
    shaped the weights or the activation when the module was built, so assigning one raises."""

    ASSIGNABLE = ("normalize_top_k_affinities", "early_expert_affinity_modulation", "capacity_factor")

    @classmethod
    def of(cls, config: RoutedExpertsMLPOpsConfig) -> "AssignableRoutedExpertsMLPOpsConfig":
        """An assignable copy of ``config`` (its validated fields, not validated again)."""
        copy = object.__new__(cls)
        copy.__dict__.update(config.__dict__)
        return copy

    def __setattr__(self, name: str, value) -> None:
        if name not in self.ASSIGNABLE:
            raise AttributeError(f"ExpertMLPsV2.routed_experts_mlp_config.{name} cannot be assigned once the module "
                                 f"is built (it shaped the weights or the activation); only {list(self.ASSIGNABLE)} "
                                 "can -- build a new ExpertMLPsV2 for another value")
        object.__setattr__(self, name, getattr(RoutedExpertsMLPOpsConfig.replace(self, **{name: value}), name))


class ExpertMLPsV2(ExpertMLPsHelpers, expert_mlps_module.ExpertMLPsV2):
    """NxD's signature. Process groups are checked against :mod:`nxd_moe.parallel_state`'s MoE groups: the
    ``cte_*`` ones (default: ``tensor_model_parallel_group`` / ``expert_model_parallel_group``) against prefill's,
    the ``tkg_*`` ones against decode's. ``is_prefill`` (NxD traces prefill and decode as separate programs) is
    stored: here one module serves both phases, told apart by ``seq_len``. ``backend`` (keyword only, not NxD's):
    nxd_moe's experts backend (``"triton"`` on a GPU). The module holds an
    :class:`AssignableRoutedExpertsMLPOpsConfig` copy of ``routed_experts_mlp_config``; NxD's static helpers are
    :class:`~nxd_moe.nxd_compat.block_mapping.ExpertMLPsHelpers`'."""

    def __init__(self, routed_experts_mlp_config: RoutedExpertsMLPOpsConfig,
                 blockwise_matmul_config: BlockwiseMatmulConfig | None = None, return_bias: bool = False,
                 dtype: torch.dtype = torch.float32, sequence_parallel_enabled: bool = False,
                 device: torch.device = CPU, tensor_model_parallel_group=None,
                 expert_model_parallel_group=None, tkg_tensor_model_parallel_group=None,
                 tkg_expert_model_parallel_group=None, cte_tensor_model_parallel_group=None,
                 cte_expert_model_parallel_group=None, is_prefill: bool = True, enabled_hybrid_sharding: bool = False,
                 *, backend="torch"):
        owner = "ExpertMLPsV2"
        if check_bool(f"{owner}.return_bias", return_bias):
            raise ValueError(f"{owner}.return_bias must be False: the expert biases are added inside the layer "
                             "(NxD raises NotImplementedError for it too)")
        check_bool(f"{owner}.is_prefill", is_prefill)
        phases = {"cte": (cte_tensor_model_parallel_group, cte_expert_model_parallel_group, "prefill"),
                  "tkg": (tkg_tensor_model_parallel_group, tkg_expert_model_parallel_group, "decode")}
        if check_bool(f"{owner}.enabled_hybrid_sharding", enabled_hybrid_sharding):
            missing = [f"{p}_{w}_model_parallel_group" for p, groups in phases.items()
                       for w, g in zip(("tensor", "expert"), groups) if g is None]
            if missing:
                raise ValueError(f"{owner}: enabled_hybrid_sharding=True needs {missing} (as in NxD)")
        for prefix, (tp, ep, phase) in phases.items():
            for what, group, default in (("tensor", tp, tensor_model_parallel_group),
                                         ("expert", ep, expert_model_parallel_group)):
                name = f"{prefix}_{what}_model_parallel_group" if group is not None else f"{what}_model_parallel_group"
                check_group(owner, name, default if group is None else group, f"moe_{phase}_{what}_groups")
        if isinstance(routed_experts_mlp_config, RoutedExpertsMLPOpsConfig):
            _check_experts_settings(blockwise_matmul_config, routed_experts_mlp_config)
            routed_experts_mlp_config = AssignableRoutedExpertsMLPOpsConfig.of(routed_experts_mlp_config)
        super().__init__(routed_experts_mlp_config, blockwise_matmul_config, dtype, device, sequence_parallel_enabled,
                         backend)
        self.is_prefill = is_prefill
        self.enabled_hybrid_sharding = enabled_hybrid_sharding

    def forward(self, hidden_states: torch.Tensor, expert_affinities: torch.Tensor, expert_index: torch.Tensor,
                seq_len: int | None = None, padding_mask: torch.Tensor | None = None,
                expert_affinities_masked_full: torch.Tensor | None = None, **kwargs):
        """NxD's signature; ``expert_affinities_masked_full`` (NxD's precomputed masked affinities for a
        sequence-parallel router) must be None: the masked affinities are computed here from the two above."""
        if expert_affinities_masked_full is not None:
            raise ValueError("ExpertMLPsV2.forward: expert_affinities_masked_full must be None; nxd_moe masks "
                             "(and normalises) expert_affinities itself, so a precomputed copy could disagree")
        return super().forward(hidden_states, expert_affinities, expert_index, seq_len, padding_mask, **kwargs)


class ExpertMLPs(ExpertMLPsV2):
    """NxD's flat-argument ``ExpertMLPs``: the two configs built from its keyword arguments, then
    :class:`ExpertMLPsV2`. As in NxD, ``block_size=None`` is 512 and the projections' default initialiser is
    ``kaiming_uniform_``; ``backend`` as for :class:`ExpertMLPsV2`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 glu_mlp: bool, capacity_factor: float | None, sequence_parallel_enabled: bool = False,
                 block_size: int | None = None, normalize_top_k_affinities: bool = False, bias: bool = False,
                 glu_type: GLUType | str | None = GLUType.GLU, hidden_act_scaling_factor: float = 1.0,
                 hidden_act_bias: float = 0.0, gate_clamp_upper_limit: float | None = None,
                 gate_clamp_lower_limit: float | None = None, up_clamp_upper_limit: float | None = None,
                 up_clamp_lower_limit: float | None = None, return_bias: bool = False,
                 init_method=torch.nn.init.kaiming_uniform_, output_layer_init_method=torch.nn.init.kaiming_uniform_,
                 dtype: torch.dtype = torch.float32, device: torch.device = CPU,
                 tensor_model_parallel_group=None, expert_model_parallel_group=None, enable_spmd_rank: bool = False,
                 blockwise_nki_autograd_cls=None, use_torch_block_wise: bool = False,
                 logical_nc_config: int | None = None, parallelize_token_to_block_mapping: bool = True,
                 early_expert_affinity_modulation: bool = False, optimized_block_to_token_mapping: bool = True,
                 use_block_parallel: bool = False, always_augment_inputs_for_blockwise_matmul: bool = False,
                 block_sharding_strategy: BlockShardStrategy | str = BlockShardStrategy.HI_LO,
                 skip_dma_token: bool = False, skip_dma_weight: bool = False, tkg_tensor_model_parallel_group=None,
                 tkg_expert_model_parallel_group=None, cte_tensor_model_parallel_group=None,
                 cte_expert_model_parallel_group=None, is_prefill: bool = True, enabled_hybrid_sharding: bool = False,
                 use_shard_on_intermediate_dynamic_while: bool = False, use_shard_on_block_dynamic_while: bool = False,
                 use_index_calc_kernel: bool = False, expert_distribution=None, *, backend="torch"):
        experts = RoutedExpertsMLPOpsConfig(
            num_experts=num_experts, hidden_size=hidden_size, intermediate_size=intermediate_size, top_k=top_k,
            hidden_act=hidden_act, glu_mlp=glu_mlp, bias=bias, glu_type=glu_type,
            hidden_act_scaling_factor=hidden_act_scaling_factor, hidden_act_bias=hidden_act_bias,
            gate_clamp_upper_limit=gate_clamp_upper_limit, gate_clamp_lower_limit=gate_clamp_lower_limit,
            up_clamp_upper_limit=up_clamp_upper_limit, up_clamp_lower_limit=up_clamp_lower_limit,
            normalize_top_k_affinities=normalize_top_k_affinities,
            early_expert_affinity_modulation=early_expert_affinity_modulation, input_layer_init_method=init_method,
            output_layer_init_method=output_layer_init_method, capacity_factor=capacity_factor,
            enable_spmd_rank=enable_spmd_rank, use_index_calc_kernel=use_index_calc_kernel,
            expert_distribution=expert_distribution)
        blockwise = BlockwiseMatmulConfig(
            block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size,
            use_block_parallel=use_block_parallel, block_sharding_strategy=block_sharding_strategy,
            skip_dma_token=skip_dma_token, skip_dma_weight=skip_dma_weight,
            logical_nc_config=default_logical_nc_config() if logical_nc_config is None else logical_nc_config,
            blockwise_nki_autograd_cls=blockwise_nki_autograd_cls, use_torch_block_wise=use_torch_block_wise,
            parallelize_token_to_block_mapping=parallelize_token_to_block_mapping,
            optimized_block_to_token_mapping=optimized_block_to_token_mapping,
            always_augment_inputs_for_blockwise_matmul=always_augment_inputs_for_blockwise_matmul,
            use_shard_on_intermediate_dynamic_while=use_shard_on_intermediate_dynamic_while,
            use_shard_on_block_dynamic_while=use_shard_on_block_dynamic_while)
        super().__init__(experts, blockwise, return_bias, dtype, sequence_parallel_enabled, device,
                         tensor_model_parallel_group, expert_model_parallel_group, tkg_tensor_model_parallel_group,
                         tkg_expert_model_parallel_group, cte_tensor_model_parallel_group,
                         cte_expert_model_parallel_group, is_prefill, enabled_hybrid_sharding, backend=backend)


class SharedExperts(shared_module.SharedExperts):
    """NxD's signature. ``reduce_dtype`` (the dtype NxD sums tensor-parallel partial outputs in) is stored; nxd_moe
    sums them in the layer's dtype."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_shared_experts: int, hidden_act: str,
                 dtype: torch.dtype = torch.float32, tensor_model_parallel_group=None,
                 reduce_dtype: torch.dtype | None = torch.float32, fused_gate_up_projection: bool = False,
                 sequence_parallel_enabled: bool = False, transpose_weights: bool = False):
        check_group("SharedExperts", "tensor_model_parallel_group", tensor_model_parallel_group,
                    "tensor_model_parallel_groups")
        reduce_dtype = None if reduce_dtype is None else to_torch_dtype(reduce_dtype, "SharedExperts.reduce_dtype")
        super().__init__(hidden_size, intermediate_size, num_shared_experts, hidden_act, dtype,
                         fused_gate_up_projection=fused_gate_up_projection,
                         sequence_parallel_enabled=sequence_parallel_enabled, transpose_weights=transpose_weights)
        self.reduce_dtype = reduce_dtype


class MoE(moe_module.MoE):
    """NxD's signature. ``token_shuffle_group_size`` must be 1 (token shuffling balances training; with 1,
    ``token_shuffle_seed`` is unused, as in NxD); ``init_tkg_module``
    needs a :class:`~nxd_moe.config.MoEFusedTKGConfig` whose ``norm_topk_prob`` equals the experts'
    ``normalize_top_k_affinities`` (NxD's fused decode kernel would follow the one, its other paths the other)."""

    def __init__(self, router, expert_mlps, shared_experts=None, rmsnorm=None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: int | None = None, return_router_logits: bool = False,
                 return_expert_index: bool = False, token_shuffle_group_size: int = 1, token_shuffle_seed=None,
                 tensor_model_parallel_group=None, init_tkg_module: bool = False,
                 tkg_config: MoEFusedTKGConfig | None = None):
        if token_shuffle_group_size != 1:
            raise ValueError(f"MoE.token_shuffle_group_size must be 1, got {token_shuffle_group_size!r}: token "
                             "shuffling balances expert load in training, and nxd_moe is an inference layer")
        check_group("MoE", "tensor_model_parallel_group", tensor_model_parallel_group, "tensor_model_parallel_groups")
        if check_bool("MoE.init_tkg_module", init_tkg_module):
            if not isinstance(tkg_config, MoEFusedTKGConfig):
                raise TypeError("MoE: init_tkg_module=True needs tkg_config, a MoEFusedTKGConfig, got "
                                f"{type(tkg_config).__name__}")
            normalize = getattr(getattr(expert_mlps, "routed_experts_mlp_config", None),
                                "normalize_top_k_affinities", None)
            if normalize is not None and tkg_config.norm_topk_prob != normalize:
                raise ValueError(f"MoE: tkg_config.norm_topk_prob={tkg_config.norm_topk_prob} but the experts' "
                                 f"normalize_top_k_affinities={normalize}; NxD's fused decode kernel would compute "
                                 "another function than its other paths -- make them equal")
        super().__init__(router, expert_mlps, shared_experts, rmsnorm, sequence_parallel_enabled, sequence_dimension,
                         return_router_logits, return_expert_index)
        self.init_tkg_module = init_tkg_module
        self.tkg_config = tkg_config
        if init_tkg_module:
            self.moe_fused_tkg = NotServed("MoE.moe_fused_tkg (NxD's MoEFusedTKG)", KERNELS)
            self.register_load_state_dict_pre_hook(self._drop_fused_tkg_copies)

    @staticmethod
    def _drop_fused_tkg_copies(module, state_dict, prefix, *args) -> None:
        """NxD's fused decode module holds this layer's own router, experts, shared experts and norm (its
        ``post_attention_layernorm``), so NxD's state dicts list each of their tensors twice, once under
        ``moe_fused_tkg.``: the copies are checked and dropped."""
        head = f"{prefix}moe_fused_tkg."
        for key in [k for k in state_dict if k.startswith(head)]:
            name = key[len(head):]
            if name.startswith("post_attention_layernorm."):
                name = "rmsnorm." + name[len("post_attention_layernorm."):]
            _drop_copy(state_dict, key, prefix + name, lambda t: t, "MoE")
