"""The dense reference every algorithm is checked against: each token through its k experts, in float64.

Written from the definitions, sharing no code with the algorithms under test (not even the activation),
so a bug there cannot hide by appearing on both sides of a comparison.
"""

from __future__ import annotations

import math

import torch

from nxd_moe.moe_configs import GLUType, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization.weight import dequantized

_ACTS = {
    "silu": lambda x: x * torch.sigmoid(x),
    "sigmoid": torch.sigmoid,
    "relu": lambda x: torch.clamp(x, min=0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "tanh": torch.tanh,
    "leaky_relu": lambda x: torch.where(x >= 0, x, 0.01 * x),
}


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """Float64 ``v`` (``|v| <= 448``) rounded to the nearest OCP E4M3 value, ties to even: 3 mantissa bits in
    each binade from 2**-6 up, steps of 2**-9 below it (subnormals)."""
    a = v.abs()
    exponent = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    step = torch.where(a < 2.0 ** -6, torch.full_like(a, 2.0 ** -9), torch.pow(2.0, exponent - 3))
    return torch.sign(v) * torch.round(a / step) * step  # torch.round: half to even


def _fp8_activations(x: torch.Tensor, cfg: RoutedExpertsMLPOpsConfig) -> torch.Tensor:
    """``x (M, K)`` as W8A8 multiplies it (activation_quantization='fp8'): each row's groups of columns scaled
    by their max magnitude / 448, rounded to E4M3, scaled back."""
    if cfg.activation_quantization == "none":
        return x
    group = cfg.activation_quantization_group_size or (128 if cfg.quantization == "fp8_block" else x.shape[-1])
    groups = x.reshape(x.shape[0], -1, group)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (_e4m3((groups / scale).clamp(-448.0, 448.0)) * scale).reshape(x.shape)


def _expert(x: torch.Tensor, e: int, cfg: RoutedExpertsMLPOpsConfig, gate_up, down, gate_up_bias, down_bias):
    act = _ACTS[cfg.hidden_act]
    h = _fp8_activations(x, cfg) @ gate_up[e]
    if gate_up_bias is not None:
        h = h + gate_up_bias[e]
    if cfg.glu_mlp:
        width = h.shape[-1] // 2
        gate, up = h[:, :width], h[:, width:]
        if cfg.gate_clamp_lower_limit is not None or cfg.gate_clamp_upper_limit is not None:
            gate = torch.clamp(gate, cfg.gate_clamp_lower_limit, cfg.gate_clamp_upper_limit)
        if cfg.up_clamp_lower_limit is not None or cfg.up_clamp_upper_limit is not None:
            up = torch.clamp(up, cfg.up_clamp_lower_limit, cfg.up_clamp_upper_limit)
        a = act(cfg.hidden_act_scaling_factor * gate)
        if cfg.glu_type is GLUType.SWIGLU:
            a = gate * a
        inner = a * (up + cfg.hidden_act_bias)
    else:
        inner = act(h)
    if cfg.intermediate_size_actual is not None:
        inner[:, cfg.intermediate_size_actual:] = 0.0
    y = _fp8_activations(inner, cfg) @ down[e]
    if down_bias is not None:
        y = y + down_bias[e]
    return y


def reference_pair_weights(expert_affinities: torch.Tensor, expert_index: torch.Tensor,
                           normalize: bool) -> torch.Tensor:
    """``(T, k)`` float64 weights: the chosen affinities, divided by their sum if ``normalize``."""
    w = expert_affinities.double().gather(1, expert_index.long())
    if normalize:
        w = w / w.abs().sum(dim=1, keepdim=True).clamp_min(1e-12)
    return w


def first_come_first_served(expert_index: torch.Tensor, num_experts: int, capacity: int,
                            token_is_real: torch.Tensor | None = None) -> torch.Tensor:
    """``(T, k)`` bool: which assignments fit in the experts' capacity, tokens admitted in order."""
    taken = [0] * num_experts
    keep = torch.zeros(expert_index.shape, dtype=torch.bool)
    for t, row in enumerate(expert_index.tolist()):
        if token_is_real is not None and not bool(token_is_real[t]):
            continue
        for j, e in enumerate(row):
            if taken[e] < capacity:
                taken[e] += 1
                keep[t, j] = True
    return keep


def dense_moe_reference(
    hidden_states: torch.Tensor,
    expert_index: torch.Tensor,
    pair_weights: torch.Tensor,
    config: RoutedExpertsMLPOpsConfig,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(T, H) -> (T, H)`` in float64: ``out[t] = sum_j w[t,j] * expert_{idx[t,j]}(x[t])`` over kept pairs
    (with early affinity modulation: ``sum_j expert_{idx[t,j]}(w[t,j] * x[t])``).

    Weights in NxD layout (``gate_up_proj (E, H, 2I)``, ``down_proj (E, I, H)``). ``keep (T, k)`` removes
    assignments (padding, capacity drops). Each token's slots are added in slot order ``j = 0..k-1``; within a
    slot, the tokens that chose expert ``e`` go through it together (rows never mix in a matmul), so the loop runs
    per (slot, expert) and stays fast at prefill sizes.
    """
    f64 = torch.float64
    x = hidden_states.detach().to(f64).cpu()
    weights = [w if w is None else w.detach().to(f64).cpu() for w in (gate_up_proj, down_proj, gate_up_bias,
                                                                       down_bias)]
    pair_weights = pair_weights.detach().to(f64).cpu()
    index = expert_index.detach().long().cpu()
    kept = torch.ones(index.shape, dtype=torch.bool) if keep is None else keep.detach().bool().cpu()
    out = torch.zeros(x.shape[0], down_proj.shape[-1], dtype=f64)
    for j in range(index.shape[1]):
        for e in index[:, j][kept[:, j]].unique().tolist():
            tokens = torch.nonzero((index[:, j] == e) & kept[:, j])[:, 0]
            w = pair_weights[tokens, j, None]
            if config.early_expert_affinity_modulation:
                out[tokens] += _expert(w * x[tokens], e, config, *weights)
            else:
                out[tokens] += w * _expert(x[tokens], e, config, *weights)
    return out


def reference_for_experts(expert_mlps, hidden_states, expert_affinities, expert_index, keep=None) -> torch.Tensor:
    """:func:`dense_moe_reference` with the weights and config of an ``ExpertMLPsV2`` (quantized weights as
    their dequantized values)."""
    cfg = expert_mlps.routed_experts_mlp_config
    op = expert_mlps.mlp_op
    first = op.first_proj
    x = hidden_states
    if x.shape[-1] != cfg.hidden_size:
        x = torch.nn.functional.pad(x, (0, cfg.hidden_size - x.shape[-1]))
    out = dense_moe_reference(
        x,
        expert_index,
        reference_pair_weights(expert_affinities, expert_index, cfg.normalize_top_k_affinities),
        cfg,
        dequantized(first.stored_weight()),
        dequantized(op.down_proj.stored_weight()),
        first.bias,
        op.down_proj.bias,
        keep=keep,
    )
    return out[:, : hidden_states.shape[-1]]


def _shared_reference(shared, x: torch.Tensor) -> torch.Tensor:
    """Float64 shared-expert output from the module's weights (its layout options undone by hand)."""

    def matrix(proj) -> torch.Tensor:  # as (out, in); quantized weights as their dequantized values
        w = proj.matrix().detach().to(torch.float64).cpu()
        return w.t() if proj.transposed else w

    if shared.fused_gate_up_projection:
        gate_w, up_w = matrix(shared.gate_up_proj).chunk(2, dim=0)
    else:
        gate_w, up_w = matrix(shared.gate_proj), matrix(shared.up_proj)
    out = (_ACTS[shared.hidden_act](x @ gate_w.t()) * (x @ up_w.t())) @ matrix(shared.down_proj).t()
    if shared.shared_expert_gate is not None:
        out = torch.sigmoid(x @ shared.shared_expert_gate.weight.detach().to(torch.float64).cpu().t()) * out
    return out


@torch.no_grad()
def reference_for_moe(moe, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None,
                      capacity: int | None = None) -> torch.Tensor:
    """Float64 output of a whole ``MoE`` for ``hidden_states (B, S, H)``.

    Routing decisions are taken from the module's own router (the reference checks what happens after
    routing; a float64 router could legitimately break near-ties differently). ``capacity`` applies
    first-come-first-served dropping, as in capacity-factor mode.
    """
    batch, seq_len, hidden = hidden_states.shape
    x = hidden_states if moe.rmsnorm is None else moe.rmsnorm(hidden_states)
    flat = x.reshape(-1, hidden)
    _, affinities, expert_index = moe.router(flat)
    real = None if padding_mask is None else padding_mask.reshape(-1).bool().cpu()
    keep = torch.ones(expert_index.shape, dtype=torch.bool)
    if real is not None:
        keep &= real.unsqueeze(1)
    if capacity is not None:
        keep &= first_come_first_served(expert_index.cpu(), moe.expert_mlps.num_experts, capacity, real)
    out = reference_for_experts(moe.expert_mlps, flat, affinities, expert_index, keep=keep)
    if moe.shared_experts is not None:
        out = out + _shared_reference(moe.shared_experts, flat.detach().to(torch.float64).cpu())
    if real is not None:
        out[~real] = 0.0
    return out.view(batch, seq_len, hidden)
