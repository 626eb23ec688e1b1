"""The expert MLP ``down(act(gate_up(x) + b_gu)) + b_d`` over many experts at once."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.grouped_matmul import grouped_matmul, plan_groups
from nxd_moe.quantization.activations import ActivationQuantization
from nxd_moe.quantization.weight import Weight, WeightLayout, dequantized, format_name, weight_tensors


class ExpertWeights(NamedTuple):
    """All experts' weights, NxD layout.

    ``gate_up_proj (E, H, 2I)`` = ``[gate | up]`` on the last dim (``(E, H, I)`` up-projection for non-GLU
    experts), ``down_proj (E, I, H)``, optional biases ``(E, 2I)``/``(E, I)`` and ``(E, H)``.

    The two projections are tensors (bf16: the layer's dtype) or
    :class:`~nxd_moe.quantization.weight.QuantizedWeight` (stored tensors + scales + format). Both answer
    ``.index_select(0, experts)`` (those experts' weights in the compute dtype) and ``.shape`` ``(E, K, N)``;
    :func:`~nxd_moe.quantization.weight.dequantized` gives the whole weight. Biases are never quantized.

    ``activation_quantization``: None (activations in the compute dtype) or the FP8 activation spec (W8A8,
    :mod:`nxd_moe.quantization.activations`) that both GEMMs' inputs go through.
    """

    gate_up_proj: Weight
    down_proj: Weight
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: ExpertActivation
    activation_quantization: ActivationQuantization | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    @property
    def format(self) -> str:
        """The projections' storage format name (``"bf16"`` for plain tensors)."""
        return format_name(self.gate_up_proj)

    def flatten(self) -> tuple[list[torch.Tensor], "ExpertWeightsLayout"]:
        """Every stored tensor, and the tensor-free layout that :meth:`ExpertWeightsLayout.rebuild` reassembles
        them with (for a traced loop, whose body must receive its tensors as arguments)."""
        tensors = [*weight_tensors(self.gate_up_proj), *weight_tensors(self.down_proj)]
        tensors += [b for b in (self.gate_up_bias, self.down_bias) if b is not None]
        layout = ExpertWeightsLayout(WeightLayout.of(self.gate_up_proj), WeightLayout.of(self.down_proj),
                                     self.gate_up_bias is not None, self.down_bias is not None, self.activation,
                                     self.activation_quantization)
        return tensors, layout

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a GEMM of these weights sees it: FP8 quantized and dequantized under W8A8, else itself."""
        spec = self.activation_quantization
        return x if spec is None else spec.fake_quantize(x)


class ExpertWeightsLayout(NamedTuple):
    gate_up_proj: WeightLayout
    down_proj: WeightLayout
    has_gate_up_bias: bool
    has_down_bias: bool
    activation: ExpertActivation
    activation_quantization: ActivationQuantization | None = None

    def rebuild(self, tensors) -> ExpertWeights:
        tensors = list(tensors)
        split = self.gate_up_proj.num_tensors
        gate_up = self.gate_up_proj.rebuild(tensors[:split])
        down = self.down_proj.rebuild(tensors[split:split + self.down_proj.num_tensors])
        biases = tensors[split + self.down_proj.num_tensors:]
        gate_up_bias = biases.pop(0) if self.has_gate_up_bias else None
        down_bias = biases.pop(0) if self.has_down_bias else None
        return ExpertWeights(gate_up, down, gate_up_bias, down_bias, self.activation, self.activation_quantization)


def dense_expert_mlp(x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """Expert e on its own rows: ``x (E, M, H)`` -- or ``(1, M, H)``, every expert on the same rows --
    ``-> (E, M, H)``. Batched matmul against the weights as stored: no copies."""
    h = torch.matmul(weights.quantized_input(x), dequantized(weights.gate_up_proj))
    if weights.gate_up_bias is not None:
        h = h + weights.gate_up_bias.unsqueeze(1)
    # ``activation.__call__``, not ``activation(...)``: torch 2.11's dynamo hashes an object it is asked to call,
    # which fails for one built inside the trace (a layout derived on a compiled first call).
    y = torch.matmul(weights.quantized_input(weights.activation.__call__(h)), dequantized(weights.down_proj))
    if weights.down_bias is not None:
        y = y + weights.down_bias.unsqueeze(1)
    return y


def grouped_expert_mlp(
    x: torch.Tensor,
    weights: ExpertWeights,
    group_expert: torch.Tensor,
    group_active: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Each group of rows through its own expert: ``x (G, M, H) -> (G, M, H)``.

    Same contract as :func:`~nxd_moe.experts.grouped_matmul.plan_groups` (groups sorted by expert, active groups
    a prefix).
    """
    plan = plan_groups(x, (weights.gate_up_proj, weights.down_proj), group_expert, group_active, impl)
    h = grouped_matmul(weights.quantized_input(x), weights.gate_up_proj, plan)
    if weights.gate_up_bias is not None:
        h = h + weights.gate_up_bias.index_select(0, group_expert).unsqueeze(1)
    y = grouped_matmul(weights.quantized_input(weights.activation.__call__(h)), weights.down_proj, plan)  # see above
    if weights.down_bias is not None:
        y = y + weights.down_bias.index_select(0, group_expert).unsqueeze(1)
    return y


def combine(expert_rows: torch.Tensor, token_slot: torch.Tensor, pair_weights: torch.Tensor,
            may_miss: bool = True) -> torch.Tensor:
    """Sum each token's k expert outputs: ``out[t] = sum_j w[t, j] * rows[slot[t, j]]``.

    ``expert_rows (S, H)``; ``token_slot (T, k)``, where ``S`` means "no row" (padded token, dropped pair).
    ``may_miss=False`` promises no slot is ``S`` (known from the call's static shape of things, e.g. dropless
    with no padding mask), which saves appending a zero row to a copy of ``expert_rows``. A missing pair reads
    that zero row rather than being multiplied by a zero weight, so a NaN elsewhere cannot leak in.
    A gather and a weighted sum rather than a scatter-add: deterministic on every device, and accumulated in at
    least fp32 so bf16 models do not lose precision across the k terms.
    """
    acc_dtype = torch.promote_types(expert_rows.dtype, torch.float32)
    rows = expert_rows
    if may_miss:
        rows = torch.cat([expert_rows, expert_rows.new_zeros(1, expert_rows.shape[1])])
    picked = rows.index_select(0, token_slot.reshape(-1)).view(*token_slot.shape, -1)
    out = torch.bmm(pair_weights.unsqueeze(1).to(acc_dtype), picked.to(acc_dtype)).squeeze(1)
    return out.to(expert_rows.dtype)
