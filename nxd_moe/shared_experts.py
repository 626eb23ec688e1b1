"""``SharedExperts`` (NxD's ``shared_experts``): the dense MLP every token goes through beside the routed experts --
whole on one device, or this rank's slice of its intermediate dimension under tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe import parallel_state
from nxd_moe.activations import ACT2FN
from nxd_moe.checks import check_bool, check_int, to_torch_dtype
from nxd_moe.experts.shard import ShardSpec
from nxd_moe.experts.shared import DenseProjection
from nxd_moe.layer_parts import SharedParts
from nxd_moe.quantization.formats import Shape, get_format
from nxd_moe.validation import FiniteWeightsOnLoad, check_hidden_states

__all__ = ["SharedExperts"]


class SharedExperts(FiniteWeightsOnLoad, nn.Module):
    """``num_shared_experts`` GLU MLPs fused into one of width ``I_s = intermediate_size * num_shared_experts``:
    ``down(act(gate(x)) * up(x))``, optionally times a per-token ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE,
    Qwen3.5-MoE).

    State-dict names follow NxD: ``gate_up_proj.weight (2*I_s, H)`` (rows ``[gate; up]``) when
    ``fused_gate_up_projection``, else ``gate_proj.weight``/``up_proj.weight (I_s, H)``; ``down_proj.weight
    (H, I_s)``; all transposed when ``transpose_weights``. ``shared_expert_gate.weight (1, H)``.

    ``quantization`` (default ``"bf16"``: the layer's dtype): the three projections' stored format, one of
    :data:`nxd_moe.quantization.QUANTIZATION_CHOICES`; stored as :class:`DenseProjection` describes, names
    ``<proj>.weight`` and ``<proj>.scale``. The sizes must divide into the format's blocks. The gate stays in
    ``dtype``.

    ``sequence_parallel_enabled`` marks sequence-parallel (replicated-weight) execution; on one device it
    changes nothing.

    Under tensor parallelism (``model_parallel=None``: whenever :mod:`nxd_moe.parallel_state` has a TP group of
    more than one rank; ``False``: never) the module takes part in a shared expert split over the TP group,
    ``intermediate_shard = (TP, tp_rank)``:

    - ``sequence_parallel_enabled=True``: weights are replicated; :meth:`forward` computes a sequence-parallel
      input (prefill) locally, and :meth:`partial` uses this rank's slice of the intermediate dimension (a view,
      no copy) for a shared input (decode): NxD's SP-prefill / TP-decode split.
    - ``sequence_parallel_enabled=False``: the module holds only its slice of the intermediate dimension
      (``[gate_r; up_r]`` for the fused projection) and only :meth:`partial` runs.

    The reductions over the TP group are the parallel layer's (:mod:`nxd_moe.parallel.shared_experts`, driven by
    :class:`~nxd_moe.MoE`).
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
        model_parallel: bool | None = None,
        quantization: str = "bf16",
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
        self.intermediate_shard = self._intermediate_shard(model_parallel)
        # In an SPMD program the rank is an input (NxD's ``shared_experts.spmd_rank``): the parallel layer reads it.
        self.spmd_rank = None if self.intermediate_shard is None else parallel_state.spmd_rank()
        fmt = get_format(quantization, "SharedExperts.quantization")
        quantization = fmt.name
        width = self.intermediate_size
        if self.intermediate_shard is not None:
            size = self.intermediate_shard[0]
            if width % size:
                raise ValueError(f"SharedExperts: intermediate_size * num_shared_experts ({width}) must be divisible "
                                 f"by the tensor-parallel size ({size})")
            if not self.sequence_parallel_enabled:
                # Quantized slices must keep the format's scale blocks whole: gate/up cut along N, down along K.
                what = f"SharedExperts (intermediate {width}, tensor-parallel size {size})"
                fmt.check_split(Shape(1, hidden_size, 2 * width if fused_gate_up_projection else width), 2, size,
                                2 if fused_gate_up_projection else 1, what)
                fmt.check_split(Shape(1, width, hidden_size), 1, size, 1, what)
                width //= size
        if self.fused_gate_up_projection:
            self.gate_up_proj = DenseProjection(hidden_size, 2 * width, transpose_weights, dtype, device, quantization)
        else:
            self.gate_proj = DenseProjection(hidden_size, width, transpose_weights, dtype, device, quantization)
            self.up_proj = DenseProjection(hidden_size, width, transpose_weights, dtype, device, quantization)
        self.down_proj = DenseProjection(width, hidden_size, transpose_weights, dtype, device, quantization)
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False, dtype=dtype, device=device)
            if check_bool("SharedExperts.shared_expert_gate", shared_expert_gate) else None
        )

    @staticmethod
    def _intermediate_shard(model_parallel: bool | None) -> tuple[int, int] | None:
        """``(parts, part)``: this rank's slice of the intermediate dimension under TP, or None."""
        if model_parallel is not None:
            check_bool("SharedExperts.model_parallel", model_parallel)
        if model_parallel is False or not parallel_state.model_parallel_is_initialized():
            if model_parallel:
                raise RuntimeError("SharedExperts(model_parallel=True) needs nxd_moe.parallel_state."
                                   "initialize_model_parallel first")
            return None
        size = parallel_state.get_tensor_model_parallel_size()
        if size == 1:
            return None
        return size, parallel_state.get_tensor_model_parallel_rank()

    @property
    def holds_whole_weights(self) -> bool:
        """:meth:`forward` can compute the whole shared expert here (one device, or replicated weights)."""
        return self.intermediate_shard is None or self.sequence_parallel_enabled

    def shard_specs(self) -> dict[str, ShardSpec]:
        """TP slices of the intermediate dimension (see :mod:`nxd_moe.parallel.sharding`); replicated weights
        (``sequence_parallel_enabled``) have none."""
        if self.holds_whole_weights:
            return {}
        size, rank = self.intermediate_shard
        fmt = self.down_proj.format
        # The intermediate dim of gate/up, and of down (on the other side). Quantized projections store the (in, out)
        # matrix, the formats' (K, N), whatever transpose_weights says; their scales follow the format's rule.
        inner = 1 if self.transpose_weights or fmt.quantized else 0
        names = ["gate_up_proj"] if self.fused_gate_up_projection else ["gate_proj", "up_proj"]
        cuts = [(n, inner, 2 if n == "gate_up_proj" else 1) for n in names] + [("down_proj", 1 - inner, 1)]
        specs = {}
        for name, dim, stride in cuts:
            specs[f"{name}.weight"] = ShardSpec(f"{name}.weight", dim=dim, tp_size=size, tp_rank=rank, stride=stride)
            if fmt.quantized:
                scale_dim = fmt.scale_split_dim(dim + 1)  # the format's dims count the expert dim first
                specs[f"{name}.scale"] = (ShardSpec(f"{name}.scale") if scale_dim is None else
                                          ShardSpec(f"{name}.scale", dim=scale_dim - 1, tp_size=size, tp_rank=rank,
                                                    stride=stride))
        return specs

    def fused_parts(self, dtype: torch.dtype) -> SharedParts | None:
        """These shared experts as ``(K, N)`` weight views for a fused layer on ``dtype`` tokens, or None where
        they have no such form (tensor-parallel, quantized, gated, weights of another dtype, or gate and up views
        of different strides). Which activations a backend fuses is its own check."""
        projections = [self.gate_up_proj] if self.fused_gate_up_projection else [self.gate_proj, self.up_proj]
        projections.append(self.down_proj)
        if (self.intermediate_shard is not None or self.shared_expert_gate is not None
                or any(p.format.quantized or p.weight.dtype != dtype for p in projections)):
            return None
        # DenseProjection stores (out, in) unless transposed; the kernels read (K, N) = (in, out) views.
        gate_up, *_, down = (p.weight if p.transposed else p.weight.t() for p in projections)
        if self.fused_gate_up_projection:
            width = gate_up.shape[1] // 2
            gate, up = gate_up[:, :width], gate_up[:, width:]
        else:
            gate, up = gate_up, (projections[1].weight if projections[1].transposed else projections[1].weight.t())
        if gate.stride() != up.stride():
            return None
        return SharedParts(gate, up, down, self.hidden_act)

    def forward(self, hidden_states: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """``(..., H) -> (..., H)``: the whole shared expert. ``seq_len`` is accepted for NxD compatibility."""
        check_hidden_states(hidden_states, self.hidden_size, "SharedExperts: hidden_states")
        if not self.holds_whole_weights:
            raise RuntimeError("SharedExperts: this module holds one tensor-parallel rank's slice of the shared "
                               "experts; run it inside MoE(...), which reduces the slices over the TP group "
                               "(nxd_moe.parallel.shared_experts)")
        if self.fused_gate_up_projection:
            gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        return self._gated(self.down_proj(ACT2FN[self.hidden_act](gate) * up), hidden_states)

    def partial(self, hidden_states: torch.Tensor, part: torch.Tensor | None = None) -> torch.Tensor:
        """``(..., H) -> (..., H)``: the contribution of this rank's slice of the intermediate dimension; the slices'
        contributions sum to :meth:`forward` (the per-token gate applies to each slice, so it commutes). ``part``
        (0-d tensor) names the slice of replicated weights where it is an input of an SPMD program (default: the
        held rank's)."""
        check_hidden_states(hidden_states, self.hidden_size, "SharedExperts: hidden_states")
        if self.intermediate_shard is None:
            return self(hidden_states)

        def linear(inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return inp @ weight if self.transpose_weights else F.linear(inp, weight)

        gate_w, up_w, down_w = self._slices(part)
        out = linear(ACT2FN[self.hidden_act](linear(hidden_states, gate_w)) * linear(hidden_states, up_w), down_w)
        return self._gated(out, hidden_states)

    def _gated(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared_expert_gate is None:
            return out
        return torch.sigmoid(self.shared_expert_gate(hidden_states)) * out

    def _slices(self, part: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's ``gate``, ``up`` and ``down`` weights in the orientation ``transpose_weights`` names (views;
        dequantized where stored quantized; gathered on the device for a tensor ``part``)."""
        size, rank = self.intermediate_shard
        inner = 1 if self.transpose_weights else 0
        if self.fused_gate_up_projection:
            gate, up = self.gate_up_proj.matrix().chunk(2, dim=inner)
        else:
            gate, up = self.gate_proj.matrix(), self.up_proj.matrix()
        down = self.down_proj.matrix()
        if self.sequence_parallel_enabled:  # replicated weights: take this rank's slice
            width = gate.shape[inner] // size
            if part is None:
                gate, up = (w.narrow(inner, rank * width, width) for w in (gate, up))
                down = down.narrow(1 - inner, rank * width, width)
            else:
                columns = part * width + torch.arange(width, device=gate.device)
                gate, up = (w.index_select(inner, columns) for w in (gate, up))
                down = down.index_select(1 - inner, columns)
        return gate, up, down
