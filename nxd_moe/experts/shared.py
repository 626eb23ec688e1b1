"""Shared experts: a dense GLU MLP every token goes through, beside the routed experts."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe.activations import ACT2FN
from nxd_moe.config import check_bool, check_int, to_torch_dtype
from nxd_moe.validation import FiniteWeightsOnLoad, check_hidden_states


class DenseProjection(nn.Module):
    """A bias-free linear layer stored ``(out, in)`` like ``nn.Linear``, or ``(in, out)`` when ``transposed``
    (the layout NxD's decode kernels read)."""

    def __init__(self, in_features: int, out_features: int, transposed: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.transposed = transposed
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight.t() if transposed else self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight if self.transposed else F.linear(x, self.weight)


class SharedExperts(FiniteWeightsOnLoad, nn.Module):
    """``num_shared_experts`` GLU MLPs fused into one of width ``I_s = intermediate_size * num_shared_experts``:
    ``down(act(gate(x)) * up(x))``, optionally times a per-token ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE,
    Qwen3.5-MoE).

    State-dict names follow NxD: ``gate_up_proj.weight (2*I_s, H)`` (rows ``[gate; up]``) when
    ``fused_gate_up_projection``, else ``gate_proj.weight``/``up_proj.weight (I_s, H)``; ``down_proj.weight
    (H, I_s)``; all transposed when ``transpose_weights``. ``shared_expert_gate.weight (1, H)``.

    ``sequence_parallel_enabled`` marks sequence-parallel (replicated-weight) execution; on one device it
    changes nothing.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_shared_experts: int,
        hidden_act: str,
        dtype: torch.dtype | str = torch.float32,
        device=None,
        fused_gate_up_projection: bool = False,
        sequence_parallel_enabled: bool = False,
        transpose_weights: bool = False,
        shared_expert_gate: bool = False,
    ):
        super().__init__()
        self.hidden_size = check_int("SharedExperts.hidden_size", hidden_size, minimum=1)
        check_int("SharedExperts.intermediate_size", intermediate_size, minimum=1)
        self.num_shared_experts = check_int("SharedExperts.num_shared_experts", num_shared_experts, minimum=1)
        if hidden_act not in ACT2FN:
            raise ValueError(f"SharedExperts.hidden_act must be one of {sorted(ACT2FN)}, got {hidden_act!r}")
        self.hidden_act = hidden_act
        self.fused_gate_up_projection = check_bool("SharedExperts.fused_gate_up_projection", fused_gate_up_projection)
        self.sequence_parallel_enabled = check_bool("SharedExperts.sequence_parallel_enabled",
                                                    sequence_parallel_enabled)
        self.transpose_weights = check_bool("SharedExperts.transpose_weights", transpose_weights)
        dtype = to_torch_dtype(dtype, "SharedExperts.dtype")
        self.intermediate_size = intermediate_size * num_shared_experts
        width = self.intermediate_size
        if self.fused_gate_up_projection:
            self.gate_up_proj = DenseProjection(hidden_size, 2 * width, transpose_weights, dtype, device)
        else:
            self.gate_proj = DenseProjection(hidden_size, width, transpose_weights, dtype, device)
            self.up_proj = DenseProjection(hidden_size, width, transpose_weights, dtype, device)
        self.down_proj = DenseProjection(width, hidden_size, transpose_weights, dtype, device)
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False, dtype=dtype, device=device)
            if check_bool("SharedExperts.shared_expert_gate", shared_expert_gate) else None
        )

    def forward(self, hidden_states: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """``(..., H) -> (..., H)``. ``seq_len`` is accepted for NxD compatibility (decode vs prefill)."""
        check_hidden_states(hidden_states, self.hidden_size, "SharedExperts: hidden_states")
        if self.fused_gate_up_projection:
            gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        out = self.down_proj(ACT2FN[self.hidden_act](gate) * up)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(hidden_states)) * out
        return out
