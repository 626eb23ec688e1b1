"""The per-expert activation between the two projections (GLU / SwiGLU with GPT-OSS's knobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nxd_moe.activations import ACT2FN
from nxd_moe.moe_configs import GLUType, RoutedExpertsMLPOpsConfig


@dataclass(frozen=True)
class ExpertActivation:
    """``(..., 2I) -> (..., I)`` for GLU experts, ``(..., I) -> (..., I)`` otherwise.

    GLU:    ``act(s * gate) * (up + b)``
    SwiGLU: ``gate * act(s * gate) * (up + b)``
    with ``gate``/``up`` clamped first when limits are set. Columns at or beyond ``intermediate_size_actual``
    are zeroed: they are checkpoint padding, and ``act(0) * (0 + b)`` is not zero for every activation.

    ``gate_up_interleaved``: the GLU input's columns are ``g0, u0, g1, u1, ...`` (GPT-OSS's stored order) instead
    of NxD's ``[gate | up]``; the gate/up weight and bias it multiplies have their columns in the same order, so
    the weight is used as stored.

    ``intermediate_size_actual`` may be a 0-d tensor where it depends on the rank of an SPMD program (a
    tensor-parallel slice of a padded checkpoint).
    """

    hidden_act: str
    glu_mlp: bool
    glu_type: GLUType
    scaling_factor: float = 1.0
    act_bias: float = 0.0
    gate_lower: float | None = None
    gate_upper: float | None = None
    up_lower: float | None = None
    up_upper: float | None = None
    intermediate_size: int | None = None
    intermediate_size_actual: int | torch.Tensor | None = None
    gate_up_interleaved: bool = False

    @classmethod
    def from_config(cls, config: RoutedExpertsMLPOpsConfig) -> "ExpertActivation":
        return cls(
            hidden_act=config.hidden_act,
            glu_mlp=config.glu_mlp,
            glu_type=config.glu_type,
            scaling_factor=config.hidden_act_scaling_factor,
            act_bias=config.hidden_act_bias,
            gate_lower=config.gate_clamp_lower_limit,
            gate_upper=config.gate_clamp_upper_limit,
            up_lower=config.up_clamp_lower_limit,
            up_upper=config.up_clamp_upper_limit,
            intermediate_size=config.intermediate_size,
            intermediate_size_actual=config.intermediate_size_actual,
        )

    def __call__(self, projected: torch.Tensor) -> torch.Tensor:
        act = ACT2FN[self.hidden_act]
        if not self.glu_mlp:
            out = act(projected)
        else:
            if self.gate_up_interleaved:
                gate, up = projected[..., 0::2], projected[..., 1::2]
            else:
                gate, up = projected.chunk(2, dim=-1)
            if self.gate_lower is not None or self.gate_upper is not None:
                gate = gate.clamp(min=self.gate_lower, max=self.gate_upper)
            if self.up_lower is not None or self.up_upper is not None:
                up = up.clamp(min=self.up_lower, max=self.up_upper)
            scaled = gate if self.scaling_factor == 1.0 else gate * self.scaling_factor
            out = act(scaled)
            if self.glu_type is GLUType.SWIGLU:
                out = gate * out
            out = out * (up + self.act_bias if self.act_bias != 0.0 else up)
        actual = self.intermediate_size_actual
        if actual is not None and (isinstance(actual, torch.Tensor) or actual < out.shape[-1]):
            keep = torch.arange(out.shape[-1], device=out.device) < actual
            out = torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out
