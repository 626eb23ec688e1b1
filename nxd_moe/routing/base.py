"""The router contract every MoE router implements."""

from __future__ import annotations

import abc

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe.checks import check_bool, check_float, check_int, to_torch_dtype
from nxd_moe.layer_parts import RouterParts
from nxd_moe.validation import FiniteWeightsOnLoad, check_hidden_states

ROUTER_ACT_FNS = ("softmax", "sigmoid")


class RouterBase(FiniteWeightsOnLoad, nn.Module, abc.ABC):
    """A linear router ``(E, H)`` plus a selection rule.

    ``forward(hidden_states (T, H) or (..., H))`` returns ``(router_logits (T, E), expert_affinities (T, E),
    expert_index (T, k))``: logits and affinities in the routing dtype, indices int64. Every row of
    ``expert_index`` holds ``k`` distinct experts. Routing math runs in the router weight's dtype promoted to at
    least float32, so a bf16 model still routes in fp32 (the weight itself defaults to fp32). Unlike NxD, the
    affinities are not cast to the hidden dtype: top-k normalisation and scaling then run in full precision,
    and the experts' combine accumulates in fp32 anyway.

    ``sequence_parallel_enabled``/``sequence_dimension`` mark the router's input as a sequence-parallel shard;
    on one device they change nothing.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str | None = None,
        bias: bool = False,
        tensor_model_parallel_group=None,
        act_fn: str = "softmax",
        apply_act_fn_over_topk: bool = False,
        jitter_eps: float = 0.0,
    ):
        super().__init__()
        name = type(self).__name__
        self.num_experts = check_int(f"{name}.num_experts", num_experts, minimum=1)
        self.top_k = check_int(f"{name}.top_k", top_k, minimum=1, maximum=num_experts)
        self.hidden_size = check_int(f"{name}.hidden_size", hidden_size, minimum=1)
        if act_fn not in ROUTER_ACT_FNS:
            raise ValueError(f"{name}.act_fn must be one of {list(ROUTER_ACT_FNS)}, got {act_fn!r}")
        self.act_fn = act_fn
        self.sequence_parallel_enabled = check_bool(f"{name}.sequence_parallel_enabled", sequence_parallel_enabled)
        if sequence_dimension is None and sequence_parallel_enabled:
            sequence_dimension = 0
        self.sequence_dimension = sequence_dimension
        self.dtype = to_torch_dtype(dtype, f"{name}.dtype")
        self.jitter_eps = check_float(f"{name}.jitter_eps", jitter_eps)
        if not 0.0 <= self.jitter_eps < 1.0:
            raise ValueError(f"{name}.jitter_eps must be in [0, 1), got {jitter_eps}")
        self.apply_act_fn_over_topk = check_bool(f"{name}.apply_act_fn_over_topk", apply_act_fn_over_topk)
        self.tensor_model_parallel_group = tensor_model_parallel_group
        self.linear_router = nn.Linear(hidden_size, num_experts, bias=check_bool(f"{name}.bias", bias),
                                       dtype=self.dtype, device=device)

    @property
    def routing_dtype(self) -> torch.dtype:
        return torch.promote_types(self.linear_router.weight.dtype, torch.float32)

    def get_router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(..., H) -> (T, E)`` logits in :attr:`routing_dtype`."""
        check_hidden_states(hidden_states, self.hidden_size, f"{type(self).__name__}: hidden_states")
        x = hidden_states.reshape(-1, self.hidden_size).to(self.linear_router.weight.dtype)
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        return F.linear(x, self.linear_router.weight, self.linear_router.bias).to(self.routing_dtype)

    def apply_activation_fn(self, logits: torch.Tensor) -> torch.Tensor:
        if self.act_fn == "softmax":
            return torch.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def fused_parts(self) -> RouterParts | None:
        """This router as the plain parts a backend's fused forms take, or None where it has none (here: none;
        :class:`~nxd_moe.routing.topk.RouterTopK` has one)."""
        return None

    @abc.abstractmethod
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(router_logits (T, E), expert_affinities (T, E), expert_index (T, k))``."""
