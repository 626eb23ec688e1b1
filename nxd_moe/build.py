"""Build an MoE layer from a model config (``configs/*.yaml``)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Mapping

import torch

from nxd_moe.checks import check_bool, check_int, to_torch_dtype
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts.backends import ExpertsBackend
from nxd_moe.model_config import MoEModelConfig, RouterSpec, load_model_config
from nxd_moe.moe import MoE
from nxd_moe.moe_configs import BlockwiseMatmulConfig, ExpertParallelConfig, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization.formats import get_format
from nxd_moe.routing import GroupLimitedRouter, RouterBase, RouterSinkhorn, RouterTopK
from nxd_moe.shared_experts import SharedExperts


def build_router(spec: RouterSpec, num_experts: int, top_k: int, hidden_size: int, device=None,
                 sequence_parallel_enabled: bool = False) -> RouterBase:
    common = dict(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, dtype=spec.dtype, device=device,
                  jitter_eps=spec.jitter_eps, sequence_parallel_enabled=sequence_parallel_enabled)
    if spec.type == "group_limited":
        return GroupLimitedRouter(n_group=spec.n_group, topk_group=spec.topk_group, normalize=spec.normalize,
                                  routed_scaling_factor=spec.routed_scaling_factor, **common)
    if spec.type == "sinkhorn":
        return RouterSinkhorn(act_fn=spec.act_fn, **common)
    return RouterTopK(act_fn=spec.act_fn, apply_act_fn_over_topk=spec.apply_act_fn_over_topk, bias=spec.bias,
                      **common)


def _init_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


# The keyword arguments build_moe takes by name (the rest are overrides, below).
_BUILD_ARGUMENTS = ("scale", "dtype", "device", "seed", "backend", "validate_inputs", "expert_parallel_config",
                    "sequence_parallel", "model_parallel", "quantization", "shared_quantization")


def check_overrides(overrides: Mapping[str, Any], caller: str, taken: tuple[str, ...] = _BUILD_ARGUMENTS) -> None:
    """Raise a ``TypeError`` naming ``caller`` and the closest valid name for the first key of ``overrides`` that is
    none of ``taken`` (:func:`build_moe`'s own keyword arguments), a :class:`RoutedExpertsMLPOpsConfig` key,
    ``block_size`` or ``block_`` + a :class:`BlockwiseMatmulConfig` key."""
    experts, blockwise = _init_fields(RoutedExpertsMLPOpsConfig), _init_fields(BlockwiseMatmulConfig)
    valid = [*taken, *experts, *(f"block_{k}" for k in blockwise), "block_size"]
    for key in overrides:
        if key in taken or key in experts or key == "block_size" or (key.startswith("block_") and key[6:] in blockwise):
            continue
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{caller}: unknown keyword argument {key!r}{hint}; besides its own arguments it takes "
                        "RoutedExpertsMLPOpsConfig keys and block_size / block_<BlockwiseMatmulConfig key>")


def scaled_model(config: MoEModelConfig | str | os.PathLike | Mapping[str, Any], scale: int,
                 quantization: str | None = None, activation_group: int | None = None) -> MoEModelConfig:
    """``config`` with H and I divided by ``scale``, rounded up to a multiple of 8, of the blocks of the
    routed experts' weight format (``quantization``, default the config's) and of the shared experts', and of the
    activation quantization group (``activation_group``, default the config's)."""
    model = load_model_config(config)
    formats = [get_format(model.experts.get("quantization") if quantization is None else quantization)]
    if model.shared_experts is not None:
        formats.append(get_format(model.shared_experts.quantization))
    blocks = [size or 1 for fmt in formats for size in (fmt.block_k, fmt.block_n)]
    if activation_group is None:
        activation_group = model.experts.get("activation_quantization_group_size")
    if isinstance(activation_group, int) and activation_group > 0:  # a bad value is named by the experts' config
        blocks.append(activation_group)
    return model.scaled(check_int("scale", scale, minimum=1), multiple=math.lcm(8, *blocks))


def scale_rounding(model: MoEModelConfig, scale: int, hidden_size: int, intermediate_size: int) -> str:
    """The widths of ``model`` that ``scale`` does not divide into the scaled layer's ``hidden_size`` /
    ``intermediate_size`` (:func:`scaled_model` rounds each up to the alignment), as reports say it:
    ``"H 2048/3 -> 688"``; ``""`` when both divide exactly."""
    widths = (("H", model.hidden_size, hidden_size), ("I", model.intermediate_size, intermediate_size))
    return ", ".join(f"{name} {full}/{scale} -> {small}" for name, full, small in widths if full != small * scale)


def build_moe(
    config: MoEModelConfig | str | os.PathLike | Mapping[str, Any],
    *,
    scale: int = 1,
    dtype: torch.dtype | str = torch.float32,
    device=None,
    seed: int | None = None,
    backend: str | ExpertsBackend = "torch",
    validate_inputs: bool = False,
    expert_parallel_config: ExpertParallelConfig | None = None,
    sequence_parallel: bool = False,
    model_parallel: bool | None = None,
    quantization: str | None = None,
    shared_quantization: str | None = None,
    **overrides,
) -> MoE:
    """An ``MoE`` for ``config`` (a built-in name, a YAML path, a mapping or a :class:`MoEModelConfig`) with
    random weights.

    ``scale`` divides H and I (keeping E, k and the routing structure) so a real architecture fits a laptop.
    ``overrides`` replace :class:`~nxd_moe.config.RoutedExpertsMLPOpsConfig` keys (e.g. ``capacity_factor``)
    or, prefixed ``block_``, :class:`~nxd_moe.config.BlockwiseMatmulConfig` keys (``block_size=`` is accepted
    as is). Returns the module in eval mode.

    Model parallelism (see :mod:`nxd_moe.parallel_state`): with ``model_parallel=None`` the layer is sharded
    whenever model parallelism is initialised (``False`` builds the whole layer on every rank).
    ``expert_parallel_config`` picks the dispatch and the expert placement; ``sequence_parallel`` makes the
    router, the shared experts (replicated weights) and the layer sequence parallel. Every rank must pass the
    same ``seed``: replicated weights (router, sequence-parallel shared experts) must be equal on all ranks. A
    sharded layer's random expert weights are its own; to compare with a single-device layer, build that one
    with ``model_parallel=False`` and load it with :func:`nxd_moe.parallel.sharding.load_full_state_dict`.

    ``quantization`` (default: the config's, else ``"bf16"``): the routed experts' weight format, one of
    :data:`nxd_moe.quantization.QUANTIZATION_CHOICES` (see :mod:`nxd_moe.quantization`); the random weights are
    drawn as for bf16 with the same ``seed`` and then quantized, so the two layers are comparable. A scaled
    config rounds H and I up to the format's block size. ``activation_quantization="fp8"`` (an override, with
    ``fp8`` / ``fp8_block`` weights) makes the routed experts W8A8. ``shared_quantization`` (default: the config's
    ``shared_experts.quantization``, else ``"bf16"``) does the same for the shared experts' projections.
    """
    sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
    check_overrides(overrides, "build_moe")
    if quantization is not None:
        overrides["quantization"] = quantization
    model = load_model_config(config)
    if shared_quantization is not None:
        if model.shared_experts is None:
            raise ValueError(f"shared_quantization: config {model.name!r} has no shared experts")
        model = dataclasses.replace(model, shared_experts=dataclasses.replace(model.shared_experts,
                                                                             quantization=shared_quantization))
    model = scaled_model(model, scale, overrides.get("quantization"),
                         overrides.get("activation_quantization_group_size"))
    dtype = to_torch_dtype(dtype)
    blockwise_keys = {k: overrides.pop(k) for k in list(overrides) if k == "block_size"}
    blockwise_keys.update({k[len("block_"):]: overrides.pop(k) for k in list(overrides) if k.startswith("block_")})
    experts_config = model.routed_experts_config(**overrides)
    if seed is not None:
        torch.manual_seed(seed)
    router = build_router(model.router, model.num_experts, model.top_k, model.hidden_size, device, sequence_parallel)
    expert_mlps = ExpertMLPsV2(experts_config, model.blockwise_config(**blockwise_keys), dtype=dtype, device=device,
                               backend=backend, validate_inputs=validate_inputs,
                               expert_parallel_config=expert_parallel_config, model_parallel=model_parallel)
    shared = None
    if model.shared_experts is not None:
        spec = model.shared_experts
        shared = SharedExperts(model.hidden_size, model.shared_intermediate_size, spec.num_shared_experts,
                               spec.hidden_act or experts_config.hidden_act, dtype=dtype, device=device,
                               fused_gate_up_projection=spec.fused_gate_up_projection, shared_expert_gate=spec.gate,
                               sequence_parallel_enabled=sequence_parallel, model_parallel=model_parallel,
                               quantization=spec.quantization)
    return MoE(router, expert_mlps, shared, sequence_parallel_enabled=sequence_parallel,
               validate_inputs=validate_inputs).eval()
