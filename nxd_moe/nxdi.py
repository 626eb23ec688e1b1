"""NxD Inference's MoE entry point: ``initialize_moe_module(config, ...)`` (``neuronx_distributed_inference.modules.
moe_v2``) building nxd_moe's :class:`~nxd_moe.MoE` from an NxDI-shaped config.

``config`` is what NxDI's model code passes: an object (NxDI's ``InferenceConfig``, a ``SimpleNamespace``, ...) or a
mapping with the model's fields -- ``num_local_experts``, ``num_experts_per_tok``, ``hidden_size``,
``intermediate_size``, ``hidden_act``, optional ``n_shared_experts``, ``original_hidden_size`` /
``original_intermediate_size`` (padded checkpoints) -- and ``neuron_config`` holding NxDI's ``MoENeuronConfig`` fields.
Fields a ``neuron_config`` lacks take ``MoENeuronConfig``'s defaults (:data:`NEURON_CONFIG_DEFAULTS`; note
``normalize_top_k_affinities`` is True there). The GPT-OSS and Llama 4 model code set their architecture's fields
on ``neuron_config`` (and ``neuron_config.router_config``) before calling, as NxDI's does.

What is read, and how (see docs/nxd.md for the table):

- router: ``RouterTopK`` with ``neuron_config.router_config`` (``act_fn``, ``dtype``), ``router_bias``,
  ``apply_act_fn_over_topk``; sequence parallelism from ``sequence_parallel_enabled`` (sequence dimension 1);
- routed experts: the GLU / SwiGLU fields, clamps, ``early_expert_affinity_modulation``,
  ``normalize_top_k_affinities``, ``experts_bias``, ``blockwise_matmul_config`` (a ``BlockwiseMatmulConfig`` or
  its keyword dict), the weight quantization (``quantized``, ``quantization_type``, ``quantization_dtype``,
  ``quantization_block_size``: FP8 per channel, FP8 128x128 blocks or MXFP4), ``torch_dtype``;
- parallelism: ``moe_tp_degree`` x ``moe_ep_degree``, or ``hybrid_sharding_config`` (``moe_{cte,tkg}_{tp,ep}_degree``)
  for different prefill / decode splits, as groups of :mod:`nxd_moe.parallel_state` (initialise it first, as NxDI
  does);
- shared experts (``n_shared_experts``): ``fused_shared_experts``, ``transpose_shared_experts_weights``,
  ``shared_experts_sequence_parallel_enabled``;
- ``return_router_logits``, ``return_expert_index``.

Accepted and not needed here (they pick Neuron kernels or programs; the function computed is the same):
``init_tkg_module`` and the ``*_nki_kernel_enabled`` toggles (decode runs as the backend decides: one launch on
the triton backend), ``use_index_calc_kernel``, ``is_prefill_stage`` (one module serves prefill and decode),
``rpl_reduce_dtype``, ``activation_quantization_type`` (NxD's quantized expert layers ignore it too). Refused by
name: a ``capacity_factor`` (NxDI's moe_v2 drops it silently and runs dropless), ``is_mxfp4_compute`` (Trn3's
shuffled MXFP4 layout), quantization schemes nxd_moe does not store (int8, per-tensor).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.checks import to_torch_dtype
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.moe import MoE
from nxd_moe.moe_configs import BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig, RouterConfig
from nxd_moe.quantization.nxd_fields import format_of_nxd_fields
from nxd_moe.routing import RouterTopK
from nxd_moe.shared_experts import SharedExperts

__all__ = ["initialize_moe_module", "initialize_moe_process_group", "routed_quantization", "NEURON_CONFIG_DEFAULTS"]

# MoENeuronConfig's (and NeuronConfig's) defaults of the fields read here.
NEURON_CONFIG_DEFAULTS: dict[str, Any] = {
    "torch_dtype": torch.bfloat16,
    "sequence_parallel_enabled": False,
    "capacity_factor": None,
    "glu_mlp": True,
    "glu_type": "glu",
    "hidden_act_scaling_factor": 1.0,
    "hidden_act_bias": 0.0,
    "gate_clamp_upper_limit": None,
    "gate_clamp_lower_limit": None,
    "up_clamp_upper_limit": None,
    "up_clamp_lower_limit": None,
    "use_index_calc_kernel": False,
    "early_expert_affinity_modulation": False,
    "normalize_top_k_affinities": True,
    "fused_shared_experts": False,
    "shared_experts_sequence_parallel_enabled": False,
    "transpose_shared_experts_weights": False,
    "return_expert_index": False,
    "return_router_logits": False,
    "hybrid_sharding_config": None,
    "moe_tp_degree": 1,
    "moe_ep_degree": 1,
    "blockwise_matmul_config": None,
    "is_prefill_stage": None,
    "quantized": False,
    "quantization_type": "per_tensor_symmetric",
    "quantization_dtype": "int8",
    "quantization_block_size": None,
    "is_mxfp4_compute": False,
}

_REQUIRED = object()


def _get(source, name: str, default: Any, where: str) -> Any:
    value = source.get(name, default) if isinstance(source, Mapping) else getattr(source, name, default)
    if value is _REQUIRED:
        raise ValueError(f"initialize_moe_module: {where} has no {name!r}")
    return value


class _NeuronConfig:
    """Reads a ``neuron_config`` object or mapping with :data:`NEURON_CONFIG_DEFAULTS` for what it lacks."""

    def __init__(self, source):
        if source is None:
            raise ValueError("initialize_moe_module: config has no 'neuron_config'")
        self.source = source

    def __getattr__(self, name: str) -> Any:
        if name == "normalize_top_k_affinities" and isinstance(self.source, Mapping) and name not in self.source:
            return not self.source.get("disable_normalize_top_k_affinities", False)  # MoENeuronConfig's keyword
        if name in ("is_hidden_dim_shuffled", "is_intermediate_dim_shuffled"):
            return _get(self.source, name, self.is_mxfp4_compute, "neuron_config")  # NeuronConfig derives them so
        if name not in NEURON_CONFIG_DEFAULTS:
            raise AttributeError(name)
        return _get(self.source, name, NEURON_CONFIG_DEFAULTS[name], "neuron_config")

    @property
    def router_config(self) -> RouterConfig:
        value = _get(self.source, "router_config", None, "neuron_config")
        if isinstance(value, RouterConfig):
            return value
        if isinstance(value, Mapping):
            return RouterConfig(**value)
        if value is None and isinstance(self.source, Mapping):
            return RouterConfig.from_kwargs(**self.source)  # MoENeuronConfig's flat router_act_fn / router_dtype
        if value is None:
            return RouterConfig()
        raise TypeError(f"neuron_config.router_config must be a RouterConfig or a dict, got {type(value).__name__}")

    @property
    def blockwise_matmul_config(self) -> BlockwiseMatmulConfig:
        value = _get(self.source, "blockwise_matmul_config", None, "neuron_config")
        if isinstance(value, BlockwiseMatmulConfig):
            return value
        if value is None or isinstance(value, Mapping):
            return BlockwiseMatmulConfig.from_kwargs(**(value or {}))
        raise TypeError("neuron_config.blockwise_matmul_config must be a BlockwiseMatmulConfig or a dict, got "
                        f"{type(value).__name__}")


def routed_quantization(neuron_config) -> str:
    """The routed experts' weight format NxDI's quantization fields describe
    (:func:`nxd_moe.quantization.nxd_fields.format_of_nxd_fields`)."""
    nc = neuron_config if isinstance(neuron_config, _NeuronConfig) else _NeuronConfig(neuron_config)
    return format_of_nxd_fields(nc.quantized, nc.quantization_type, nc.quantization_dtype,
                                nc.quantization_block_size)


def _phase_degrees(nc: _NeuronConfig) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``((cte_tp, cte_ep), (tkg_tp, tkg_ep))`` the config asks for, or None for the global TP / EP groups."""
    hybrid = nc.hybrid_sharding_config
    if hybrid is not None:
        cte_tp, cte_ep, tkg_tp, tkg_ep = (_get(hybrid, f"moe_{phase}_{kind}_degree", _REQUIRED,
                                               "neuron_config.hybrid_sharding_config")
                                          for phase in ("cte", "tkg") for kind in ("tp", "ep"))
        return (cte_tp, cte_ep), (tkg_tp, tkg_ep)
    if nc.moe_ep_degree > 1:
        return (nc.moe_tp_degree, nc.moe_ep_degree), (nc.moe_tp_degree, nc.moe_ep_degree)
    return None


def initialize_moe_process_group(config, enabled_hybrid_sharding: bool):
    """NxDI's helper: sets :mod:`nxd_moe.parallel_state`'s MoE groups to the config's degrees and returns
    ``(tkg_tensor, tkg_expert, cte_tensor, cte_expert)`` process groups (None on one process)."""
    nc = _NeuronConfig(_get(config, "neuron_config", None, "config"))
    degrees = _phase_degrees(nc)
    if enabled_hybrid_sharding and nc.hybrid_sharding_config is None:
        raise ValueError("initialize_moe_process_group: enabled_hybrid_sharding=True needs "
                         "neuron_config.hybrid_sharding_config")
    if not parallel_state.model_parallel_is_initialized():
        if degrees is not None and any(tp * ep > 1 for tp, ep in degrees):
            raise RuntimeError(f"initialize_moe_module: the config splits the MoE as (tp, ep) = {degrees} for "
                               "(prefill, decode); call nxd_moe.parallel_state.initialize_model_parallel first (on "
                               "every rank, as NxDI does)")
        return None, None, None, None
    if degrees is not None:
        parallel_state.set_moe_model_parallel_sizes(*degrees)
    return (parallel_state.get_moe_tensor_model_parallel_group(False),
            parallel_state.get_moe_expert_model_parallel_group(False),
            parallel_state.get_moe_tensor_model_parallel_group(True),
            parallel_state.get_moe_expert_model_parallel_group(True))


def initialize_moe_module(config, rmsnorm: nn.Module | None = None, init_tkg_module: bool = False,
                          apply_act_fn_over_topk: bool = False, router_bias: bool = False,
                          experts_bias: bool = False, *, backend="torch") -> MoE:
    """NxD Inference's ``initialize_moe_module`` (moe_v2): the MoE layer ``config`` describes, in eval mode, on the
    default device (move it with ``.to(device)``). ``backend`` (keyword only, not NxDI's): the experts' backend,
    e.g. ``"triton"`` on a GPU."""
    nc = _NeuronConfig(_get(config, "neuron_config", None, "config"))
    if nc.capacity_factor is not None:
        raise ValueError(f"neuron_config.capacity_factor={nc.capacity_factor!r}: NxD Inference's "
                         "initialize_moe_module (moe_v2) ignores it and runs the experts dropless; set it to None "
                         "(to drop tokens, build RoutedExpertsMLPOpsConfig(capacity_factor=...) yourself)")
    if not isinstance(init_tkg_module, bool):
        raise TypeError(f"init_tkg_module must be a bool, got {type(init_tkg_module).__name__}")
    initialize_moe_process_group(config, nc.hybrid_sharding_config is not None)
    dtype = to_torch_dtype(nc.torch_dtype, "neuron_config.torch_dtype")

    def field(name: str, default: Any = _REQUIRED) -> Any:
        return _get(config, name, default, "config")

    num_experts, top_k, hidden_size = field("num_local_experts"), field("num_experts_per_tok"), field("hidden_size")
    router_config = nc.router_config
    sequence_parallel = nc.sequence_parallel_enabled
    router = RouterTopK(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                        sequence_parallel_enabled=sequence_parallel, sequence_dimension=1,
                        dtype=router_config.dtype, bias=router_bias, act_fn=router_config.act_fn,
                        apply_act_fn_over_topk=apply_act_fn_over_topk)
    experts_config = RoutedExpertsMLPOpsConfig(
        num_experts=num_experts, hidden_size=hidden_size, intermediate_size=field("intermediate_size"),
        hidden_size_actual=field("original_hidden_size", None),
        intermediate_size_actual=field("original_intermediate_size", None),
        is_hidden_dim_shuffled=nc.is_hidden_dim_shuffled, is_intermediate_dim_shuffled=nc.is_intermediate_dim_shuffled,
        top_k=top_k, hidden_act=field("hidden_act"), bias=experts_bias, glu_mlp=nc.glu_mlp, glu_type=nc.glu_type,
        hidden_act_scaling_factor=nc.hidden_act_scaling_factor, hidden_act_bias=nc.hidden_act_bias,
        use_index_calc_kernel=nc.use_index_calc_kernel, gate_clamp_upper_limit=nc.gate_clamp_upper_limit,
        gate_clamp_lower_limit=nc.gate_clamp_lower_limit, up_clamp_upper_limit=nc.up_clamp_upper_limit,
        up_clamp_lower_limit=nc.up_clamp_lower_limit,
        early_expert_affinity_modulation=nc.early_expert_affinity_modulation,
        normalize_top_k_affinities=nc.normalize_top_k_affinities,
        enable_spmd_rank=nc.blockwise_matmul_config.parallelize_token_to_block_mapping,
        is_prefill=nc.is_prefill_stage, quantization=routed_quantization(nc))
    expert_mlps = ExpertMLPsV2(experts_config, nc.blockwise_matmul_config, dtype=dtype,
                               sequence_parallel_enabled=sequence_parallel, backend=backend)
    shared_experts = None
    if field("n_shared_experts", None):
        shared_experts = SharedExperts(hidden_size, experts_config.intermediate_size, field("n_shared_experts"),
                                       experts_config.hidden_act, dtype,
                                       fused_gate_up_projection=nc.fused_shared_experts,
                                       sequence_parallel_enabled=nc.shared_experts_sequence_parallel_enabled,
                                       transpose_weights=nc.transpose_shared_experts_weights)
    moe = MoE(router, expert_mlps, shared_experts, rmsnorm, sequence_parallel_enabled=sequence_parallel,
              sequence_dimension=1, return_router_logits=nc.return_router_logits,
              return_expert_index=nc.return_expert_index)
    return moe.eval()
