"""The routed experts' weights (``ExpertLinear``, ``ExpertsMLPOp`` under NxD's state-dict names) and what a forward
reports (``ExpertsStats``); the module that holds them is :class:`nxd_moe.expert_mlps_v2.ExpertMLPsV2`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.token_mapping import BlockMapping
from nxd_moe.moe_configs import RoutedExpertsMLPOpsConfig
from nxd_moe.quantization import QuantizedWeight, Shape, Weight, get_format
from nxd_moe.quantization.formats import k_fastest
from nxd_moe.validation import (
    FiniteWeightsOnLoad,
)


def _default_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s default (kaiming-uniform, a=sqrt(5)) applied to an ``(in, out)`` matrix."""
    nn.init.kaiming_uniform_(weight.t(), a=math.sqrt(5))


class ExpertLinear(FiniteWeightsOnLoad, nn.Module):
    """All experts' copies of one projection: ``weight (E, in, out)``, optional ``bias (E, out)``.

    Quantized (``quantization`` other than ``"bf16"``): ``weight`` and ``scale`` hold the format's stored tensors
    (:mod:`nxd_moe.quantization.formats`; not trainable), initialised by quantizing the default init, and every
    load checks their dtypes, shapes and scale values. ``dtype`` is the compute dtype either way.
    ``k_major=True`` stores the quantized weight with the contraction dim fastest (strides ``(K*N, 1, K)``,
    same logical ``(E, K, N)`` and state dict): what FP8 x FP8 tensor cores read directly (W8A8).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device=None, init_method=None, quantization: str = "bf16",
                 k_major: bool = False):
        super().__init__()
        self.compute_dtype = dtype
        self.format = get_format(quantization)
        shape = Shape(num_experts, in_features, out_features)
        self.format.check_shape(shape, f"ExpertLinear {tuple(shape)}")
        weight = torch.empty(num_experts, in_features, out_features, dtype=dtype, device=device)
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype, device=device))
                     if bias else None)
        with torch.no_grad():
            for expert_weight in weight:
                (init_method or _default_init)(expert_weight)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(in_features)
                self.bias.uniform_(-bound, bound)
        if not self.format.quantized:
            self.weight = nn.Parameter(weight)
            return
        if weight.is_meta:
            stored = self.format.empty(shape, device)
            stored = (k_fastest(stored[0]) if k_major else stored[0], stored[1])
        else:
            stored = self.format.quantize_by_expert(weight, k_major)
        self.weight = nn.Parameter(stored[0], requires_grad=False)
        self.scale = nn.Parameter(stored[1], requires_grad=False)
        self.register_load_state_dict_pre_hook(ExpertLinear._check_quantized)

    @staticmethod
    def _check_quantized(module, state_dict, prefix, *args, **kwargs):
        weight, scale = state_dict.get(prefix + "weight"), state_dict.get(prefix + "scale")
        if weight is not None and scale is not None:
            module.format.check(weight, scale, module.shape, prefix.rstrip(".") or "ExpertLinear")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (an unquantized weight's own dtype, which ``module.to(dtype)`` may change)."""
        return self.compute_dtype if self.format.quantized else self.weight.dtype

    @property
    def shape(self) -> Shape:
        return self.stored_weight().shape if self.format.quantized else Shape(*self.weight.shape)

    def stored_weight(self) -> Weight:
        """What the algorithms receive: the weight tensor, or a :class:`QuantizedWeight` over the stored ones."""
        if not self.format.quantized:
            return self.weight
        return QuantizedWeight.create(self.format, self.weight, self.scale, self.dtype)

    def extra_repr(self) -> str:
        e, i, o = self.shape
        quantized = f", quantization={self.format.name!r}" if self.format.quantized else ""
        return f"num_experts={e}, in_features={i}, out_features={o}, bias={self.bias is not None}{quantized}"


class ExpertsMLPOp(nn.Module):
    """Holds the projections under NxD's state-dict names (``mlp_op.gate_up_proj.weight`` ...).

    ``num_experts`` / ``intermediate_size`` override the config's for a shard (local experts, TP slice).
    """

    def __init__(self, config: RoutedExpertsMLPOpsConfig, dtype: torch.dtype, device=None,
                 num_experts: int | None = None, intermediate_size: int | None = None):
        super().__init__()
        e = config.num_experts if num_experts is None else num_experts
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        h = config.hidden_size
        k_major = config.activation_quantization != "none"
        first = ExpertLinear(e, h, 2 * i if config.glu_mlp else i, config.bias, dtype, device,
                             config.input_layer_init_method, config.quantization, k_major)
        if config.glu_mlp:
            self.gate_up_proj = first
        else:
            self.up_proj = first
        self.down_proj = ExpertLinear(e, i, h, config.bias, dtype, device, config.output_layer_init_method,
                                      config.quantization, k_major)

    @property
    def first_proj(self) -> ExpertLinear:
        return self.gate_up_proj if hasattr(self, "gate_up_proj") else self.up_proj


@dataclass
class ExpertsStats:
    """What one forward did. Sizes are Python ints; counts stay tensors so that asking for stats does not
    force a device-to-host sync (call :meth:`summary` when a sync is fine)."""

    mode: ExpertsMode
    num_tokens: int
    top_k: int
    num_experts: int
    tokens_per_expert: torch.Tensor
    dropped_tokens: torch.Tensor
    block_size: int | None = None
    num_blocks: int | None = None
    capacity: int | None = None
    mapping: BlockMapping | None = None
    dispatch: str | None = None
    local_experts: tuple[int, ...] | None = None
    local_tokens_per_expert: torch.Tensor | None = None
    communication: dict[str, int] | None = None

    def summary(self) -> dict:
        """Plain numbers (host sync). Padding overheads use the deep dive's two definitions:

        - ``padding_overhead_provisioned``: ``(N*B - A*B) / (A*B)`` -- blocks provisioned for the worst case
          beyond the ``A`` blocks this routing needed;
        - ``padding_overhead_algorithmic``: ``(A*B - T*k) / (T*k)`` -- empty slots inside the needed blocks.

        Under expert parallelism ``tokens_per_expert``, ``assignments`` and ``dropped_tokens`` describe the whole
        MoE block; the block layout, ``rank_load`` (pairs this rank computed) and the padding overheads are this
        rank's; ``bytes_moved`` is what this rank received, by step.
        """
        assignments = int(self.tokens_per_expert.sum())
        out = {
            "mode": self.mode.value,
            "num_tokens": self.num_tokens,
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "assignments": assignments,
            "dropped_tokens": int(self.dropped_tokens),
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "capacity": self.capacity,
        }
        if self.local_experts is not None:
            assignments = int(self.local_tokens_per_expert.sum())
            out["dispatch"] = self.dispatch
            out["local_experts"] = list(self.local_experts)
            out["rank_load"] = assignments
            out["bytes_moved"] = sum(self.communication.values())
            out["bytes_by_step"] = dict(self.communication)
        if self.mapping is not None:
            active = int(self.mapping.conditions.sum())
            needed_slots = active * self.block_size
            out["active_blocks"] = active
            out["padding_overhead_provisioned"] = (
                (self.num_blocks * self.block_size - needed_slots) / needed_slots if needed_slots else None
            )
            out["padding_overhead_algorithmic"] = (needed_slots - assignments) / assignments if assignments else None
        return out


def check_expert_index(expert_index: torch.Tensor, num_experts: int, what: str) -> None:
    """Values in ``[0, E)`` and no expert twice in a row (reads the data: host sync)."""
    if expert_index.numel() == 0:
        return
    low, high = int(expert_index.min()), int(expert_index.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"{what} values must be in [0, {num_experts - 1}], got range [{low}, {high}]")
    ordered = expert_index.sort(dim=1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ValueError(f"{what}: a token lists the same expert twice; each row must hold k distinct experts")
