"""Turn a layer's bf16 routed experts into a quantized format (round to nearest, scales from each block's max)."""

from __future__ import annotations

import torch
import torch.nn as nn

from nxd_moe.checks import check_bool
from nxd_moe.expert_mlps_v2 import ExpertMLPsV2
from nxd_moe.experts.backends import check_backend_supports
from nxd_moe.experts.expert_mlps import ExpertLinear
from nxd_moe.experts.shared import DenseProjection
from nxd_moe.quantization.formats import QuantizationFormat, get_format


def quantize_expert_linear(linear: ExpertLinear, quantization: str | QuantizationFormat,
                           k_major: bool = False) -> ExpertLinear:
    """A new :class:`ExpertLinear` holding ``linear``'s weights in ``quantization`` (bias shared, unquantized);
    ``k_major``: stored contraction-dim fastest (see :class:`ExpertLinear`)."""
    fmt = get_format(quantization)
    if linear.format.quantized:
        raise ValueError(f"quantize: the projection is already stored as {linear.format.name!r}; quantize a bf16 layer")
    experts, k, n = linear.weight.shape
    out = ExpertLinear(experts, k, n, False, linear.dtype, "meta", quantization=fmt)
    if fmt.quantized:
        weight, scale = fmt.quantize_by_expert(linear.weight, k_major)
        out.weight = nn.Parameter(weight, requires_grad=False)
        out.scale = nn.Parameter(scale, requires_grad=False)
    else:
        out.weight = linear.weight
    out.bias = linear.bias
    return out


def quantize_dense_projection(proj: DenseProjection, quantization: QuantizationFormat) -> DenseProjection:
    """A new :class:`DenseProjection` holding ``proj``'s weight in ``quantization``, same orientation flag."""
    if proj.format.quantized:
        raise ValueError(f"quantize: the shared-expert projection is already stored as {proj.format.name!r}")
    in_features, out_features = proj.weight.shape if proj.transposed else proj.weight.shape[::-1]
    out = DenseProjection(in_features, out_features, proj.transposed, proj.weight.dtype, "meta", quantization)
    out.store_quantized(proj.weight)
    return out


@torch.no_grad()
def quantize_experts(layer: nn.Module, quantization: str | QuantizationFormat, *,
                     shared_experts: bool = False, activation_quantization: str = "none",
                     activation_quantization_group_size: int | None = None) -> nn.Module:
    """Quantize the routed experts of ``layer`` (an ``MoE`` or an ``ExpertMLPsV2``) in place and return it.

    The two expert projections change; with ``shared_experts=True`` an ``MoE``'s shared-expert projections are
    quantized to the same format too. Biases, the router and the shared-expert gate keep their dtype. The
    experts' config records the format, so the layer's state dict and ``forward`` follow it.
    ``activation_quantization="fp8"`` (with ``fp8`` / ``fp8_block`` weights) makes the experts W8A8 (see
    :class:`~nxd_moe.config.RoutedExpertsMLPOpsConfig`); their FP8 weights are then stored K-major.
    """
    experts = getattr(layer, "expert_mlps", layer)
    if not isinstance(experts, ExpertMLPsV2):
        raise TypeError(f"quantize_experts: layer must be an MoE or an ExpertMLPsV2, got {type(layer).__name__}")
    fmt = get_format(quantization)
    shared = getattr(layer, "shared_experts", None) if check_bool("shared_experts", shared_experts) else None
    if shared_experts and shared is None:
        raise ValueError("quantize_experts: shared_experts=True, but the layer has no shared experts")
    # The new config first: it checks the activation settings against the format before anything changes.
    config = experts.routed_experts_mlp_config.replace(
        quantization=fmt.name, activation_quantization=activation_quantization,
        activation_quantization_group_size=activation_quantization_group_size)
    check_backend_supports(experts.backend, fmt.name, config.activation_quantization)
    if not holds_whole_experts(experts):
        raise NotImplementedError("quantize_experts: quantizing a tensor-parallel or hybrid-sharded layer is not "
                                  "supported yet; quantize the single-device layer")
    op = experts.mlp_op
    first = "gate_up_proj" if hasattr(op, "gate_up_proj") else "up_proj"
    # Everything is quantized (and its shape checked) before anything is replaced: a refusal leaves the layer as is.
    k_major = config.activation_quantization != "none"
    replaced = [(op, name, quantize_expert_linear(getattr(op, name), fmt, k_major)) for name in (first, "down_proj")]
    if shared is not None and fmt.quantized:
        replaced += _shared_projections(shared, fmt, "quantize_experts")
    for module, name, quantized in replaced:
        setattr(module, name, quantized)
    experts.routed_experts_mlp_config = config
    return layer


def holds_whole_experts(experts: ExpertMLPsV2) -> bool:
    """Whether ``experts`` holds each of its experts whole, in one projection pair: on one device, or as an
    expert-parallel shard (the formats' scales never cross experts, so such a shard quantizes to the bytes the
    single-device layer's shard would have)."""
    shards = experts.weight_shards
    return shards is None or (all(s.intermediate_parts == 1 for s in shards) and not hasattr(experts, "mlp_op_tkg"))


def _shared_projections(shared: nn.Module, fmt: QuantizationFormat,
                        caller: str) -> list[tuple[nn.Module, str, DenseProjection]]:
    """``(shared, name, quantized projection)`` for each of a ``SharedExperts``' projections."""
    if shared.intermediate_shard is not None:
        raise NotImplementedError(f"{caller}: quantizing tensor-parallel shared experts is not supported yet")
    names = ["gate_up_proj"] if shared.fused_gate_up_projection else ["gate_proj", "up_proj"]
    return [(shared, name, quantize_dense_projection(getattr(shared, name), fmt)) for name in names + ["down_proj"]]


@torch.no_grad()
def quantize_shared_experts(layer: nn.Module, quantization: str | QuantizationFormat) -> nn.Module:
    """Quantize only the shared experts of ``layer`` (an ``MoE``) in place and return it; the routed experts and
    the shared-expert gate keep their format (``quantize_experts(..., shared_experts=True)`` quantizes both to one
    format)."""
    shared = getattr(layer, "shared_experts", None)
    if shared is None:
        raise ValueError(f"quantize_shared_experts: layer must be an MoE with shared experts, got "
                         f"{type(layer).__name__}" + (" without shared experts" if hasattr(layer, "shared_experts")
                                                      else ""))
    fmt = get_format(quantization, "shared_quantization")
    if fmt.quantized:
        for module, name, quantized in _shared_projections(shared, fmt, "quantize_shared_experts"):
            setattr(module, name, quantized)
    return layer


def expert_weight_bytes(experts: ExpertMLPsV2) -> int:
    """Bytes of the routed experts' stored projection tensors (scales included, biases not): what a decode
    step that reads every expert reads."""
    op = experts.mlp_op
    return sum(t.nbytes for linear in (op.first_proj, op.down_proj)
               for t in (linear.weight, getattr(linear, "scale", None)) if t is not None)
