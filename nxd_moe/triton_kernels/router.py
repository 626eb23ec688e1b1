"""A top-k router in one kernel: the GPU twin of :class:`~nxd_moe.routing.topk.RouterTopK`'s forward.

The torch router on a 16-bit layer copies the tokens to fp32, runs an fp32 ``F.linear`` (no tensor cores at fp32),
then top-k, the activation and a scatter: five launches and ~110 us for a 4096-token Qwen3-30B-A3B prefill on an
H100. Here one program per block of tokens reads the tokens as stored, computes the fp32 logits from three TF32
tensor-core products (``tf32x3``: fp32 accuracy, as the one-launch decode's router), picks the top k by k rounds
of argmax (largest logit first; ties to the lower expert id) and writes ``logits (T, E)``, ``affinities (T, E)``
and ``expert_index (T, k)``. A token's row is computed from that token alone: a NaN stays in its row.

The top-k and activation helpers are shared with :mod:`~nxd_moe.triton_kernels.persistent_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nxd_moe.triton_kernels import interpreting

# Router widths one program holds in registers (E <= 256 covers every top-k router of the supported models).
MAX_EXPERTS = 256
# Below this many tokens torch's router is as fast (H100: 28 vs 35 us at T = 256, 47 vs 35 at 1024, E = 128): one
# program runs all of H for its tokens, ~35 us of dependent loads whatever the token count.
MIN_TOKENS = 1024


@triton.jit
def order_bits(logits):
    """fp32 ``logits``' bits as int32s that compare as the floats do (-0 just below +0; NaNs at the ends)."""
    bits = logits.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def top_k_rounds(logits, experts, expert_ok, index_ptr, tokens, token_ok, num_experts: tl.constexpr,
                 top_k: tl.constexpr):
    """Store each row's top ``top_k`` expert ids of ``logits (BLOCK_T, BLOCK_E)`` at ``index_ptr + token * top_k``
    (largest first, ties to the lower id) and return the k-hot ``(BLOCK_T, BLOCK_E)`` mask. Keys: the logit's bits
    made order-preserving as a signed integer, above the inverted expert id; k rounds of a row maximum (lighter on
    registers than a sorting network)."""
    key = order_bits(logits).to(tl.int64) << 32
    key = key | (num_experts - 1 - experts).to(tl.int64)[None, :]
    key = tl.where(expert_ok[None, :], key, -9223372036854775807 - 1)
    chosen = tl.zeros_like(key) != 0
    for j in tl.static_range(top_k):
        best = tl.max(key, axis=1)
        hit = key == best[:, None]
        chosen = chosen | hit
        key = tl.where(hit, -9223372036854775807 - 1, key)
        tl.store(index_ptr + tokens * top_k + j, (num_experts - 1 - (best & 0xFFFFFFFF)), mask=token_ok)
    return chosen


@triton.jit
def activation(logits, scope, SIGMOID: tl.constexpr):
    """``sigmoid(logits)``, or the softmax of each row's logits over ``scope`` (0 outside it; an empty row: 0)."""
    if SIGMOID:
        out = tl.sigmoid(logits)
    else:
        peak = tl.max(tl.where(scope, logits, float("-inf")), axis=1)
        weight = tl.where(scope, tl.exp(logits - peak[:, None]), 0.0)
        out = weight / tl.maximum(tl.sum(weight, axis=1), 1e-30)[:, None]
    return out


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, affinity_ptr, index_ptr, num_tokens, stride_xt,
                   hidden: tl.constexpr, num_experts: tl.constexpr, top_k: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SIGMOID: tl.constexpr, ACT_OVER_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + hs[None, :], mask=token_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None] * hidden + hs[None, :], mask=expert_ok[:, None] & h_ok[None, :],
                    other=0.0)
        logits = tl.dot(x, tl.trans(w), logits, input_precision=PRECISION)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + experts, mask=expert_ok, other=0.0)[None, :]
    ok = token_ok[:, None] & expert_ok[None, :]
    at = tokens[:, None] * num_experts + experts[None, :]
    tl.store(logits_ptr + at, logits, mask=ok)
    chosen = top_k_rounds(logits, experts, expert_ok, index_ptr, tokens, token_ok, num_experts, top_k)
    if ACT_OVER_TOPK:
        affinity = tl.where(chosen, activation(logits, chosen, SIGMOID), 0.0)
    else:
        affinity = activation(logits, ok, SIGMOID)
    tl.store(affinity_ptr + at, affinity, mask=ok)


def applies(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`router_top_k` takes these inputs: an fp32 ``(E, H)`` weight with ``E <= MAX_EXPERTS``, and
    16-bit or fp32 tokens ``(T, H)`` read along ``H``."""
    return (weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[0] <= MAX_EXPERTS
            and 1 <= top_k <= weight.shape[0] and hidden_states.dim() == 2
            and hidden_states.shape[1] == weight.shape[1] and hidden_states.shape[0] > 0
            and hidden_states.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and hidden_states.stride(1) == 1)


def router_top_k(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 sigmoid: bool, act_over_topk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden_states (T, H)``, ``weight (E, H)`` fp32, ``bias (E,)`` or None -> ``(logits (T, E) fp32,
    affinities (T, E) fp32, expert_index (T, k) int64)``: ``logits = x @ weight.T + bias``; ``expert_index`` its
    top k; affinities ``sigmoid`` or ``softmax`` of the logits, over the chosen k only (0 elsewhere) when
    ``act_over_topk`` -- :class:`~nxd_moe.routing.topk.RouterTopK`'s outputs (see :func:`applies`)."""
    if not applies(hidden_states, weight, top_k):
        raise ValueError(
            f"router_top_k: needs hidden_states (T, H), T >= 1, bf16 / fp16 / fp32 with unit stride along H, weight "
            f"(E, H) fp32 with E <= {MAX_EXPERTS}, and top_k in [1, E]; got hidden_states "
            f"{tuple(hidden_states.shape)} {hidden_states.dtype} strides {hidden_states.stride()}, weight "
            f"{tuple(weight.shape)} {weight.dtype}, top_k {top_k}")
    num_tokens, hidden = hidden_states.shape
    num_experts = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (num_experts,) or bias.dtype != torch.float32):
        raise ValueError(f"router_top_k: bias must be ({num_experts},) fp32, got {tuple(bias.shape)} {bias.dtype}")
    weight = weight.contiguous()
    device = hidden_states.device
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    affinities = torch.empty_like(logits)
    index = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    block_t, block_e, block_h = launch_config(num_tokens, num_experts)
    interpreted = interpreting()
    _router_kernel[(triton.cdiv(num_tokens, block_t),)](
        hidden_states, weight, bias if bias is not None else weight, logits, affinities, index, num_tokens,
        hidden_states.stride(0), hidden=hidden, num_experts=num_experts, top_k=top_k, HAS_BIAS=bias is not None,
        SIGMOID=sigmoid, ACT_OVER_TOPK=act_over_topk, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h,
        PRECISION="ieee" if interpreted else "tf32x3", num_warps=4, num_stages=3)
    return logits, affinities, index


def launch_config(num_tokens: int, num_experts: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_E, BLOCK_H)``, from an H100 sweep (``benchmarks/gpu_router.py --sweep``; 4 warps, 3 stages
    won everywhere): 16 tokens per program fill the GPU up to a few thousand tokens; wider ``H`` steps where the
    weight tile is narrow."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    block_t = 32 if num_tokens >= 4096 and block_e >= 128 else 16
    block_h = 128 if block_e <= 32 else (32 if block_t == 32 or block_e >= 256 else 64)
    return block_t, block_e, block_h
