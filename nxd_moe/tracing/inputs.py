"""Inputs that vary the routing: ``make_inputs(i)`` factories for the checks, each sending every token to the same
experts for ``i = 0`` (the most skewed routing), and what routing a whole decoder's inputs reached.

- :func:`moe_inputs`: one ``MoE`` layer's hidden states (and padding mask);
- :func:`model_inputs`, :func:`routing_summary`: a whole decoder step over a static KV cache;
- :func:`block_inputs`, :func:`local_inputs`: an SPMD program's world-wide inputs (one EP rank's experts for
  ``i = 0``) and each rank's part of them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from nxd_moe.moe import MoE
from nxd_moe.tracing.spmd_layout import SPMDLayout
from nxd_moe.tracing.tensors import Inputs


def moe_inputs(moe: nn.Module, tokens: int, mode: str = "prefill", padding: bool = False,
               seed: int = 0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``make_inputs`` for an ``MoE``: ``i -> (hidden_states[, padding_mask])``.

    ``mode="prefill"``: one sequence of ``tokens`` tokens ``(1, T, H)``; ``"decode"``: ``tokens`` sequences of
    one token ``(T, 1, H)``. ``i = 0`` repeats a single token, so every token goes to the same ``k`` experts (the
    most skewed routing: one expert receives all ``T`` tokens); other ``i`` draw independent random tokens.
    ``padding`` masks out the last quarter of the tokens (at least one).
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    shape = (1, tokens) if mode == "prefill" else (tokens, 1)
    dtype, hidden = moe.expert_mlps.dtype, moe.hidden_size

    def make(i: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed + i)
        x = torch.randn(*shape, hidden, generator=generator, dtype=torch.float64)
        if i == 0:
            x = x[:1, :1].expand_as(x)
        x = x.to(dtype).contiguous()
        if not padding:
            return (x,)
        mask = torch.ones(tokens, dtype=torch.bool)
        mask[tokens - max(1, tokens // 4):] = False
        return x, mask.view(shape)

    return make


def model_inputs(step: nn.Module, tokens: int, mode: str = "decode",
                 seed: int = 0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``make_inputs`` for a whole decoder step (:class:`nxd_moe.models.decoder_step.StaticCacheStep`):
    ``i -> (input_ids, cache_position, *cache)``.

    ``mode="decode"``: ``tokens`` sequences of one new token each, written at cache position ``L - 1 - i`` (mod
    ``L``, the cache length: every input also moves the write position), after a context of random keys and values
    in the positions before it (zeros after). ``"prefill"``: one sequence of ``tokens`` new tokens at positions
    ``0 .. tokens - 1`` of an empty (zero) cache. ``i = 0`` gives every token the same id (and, decoding, every
    sequence the same context), so every token of every MoE layer goes to the same experts -- except where the
    attention output depends on the position itself (GPT-OSS's attention sinks at prefill); other ``i`` draw random
    ids. :func:`routing_summary` says which experts each input reached.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    length = step.cache_length
    if mode == "prefill" and tokens > length:
        raise ValueError(f"tokens must be <= the cache length ({length}) for a prefill, got {tokens}")
    batch, new = (tokens, 1) if mode == "decode" else (1, tokens)
    shapes = step.cache_shapes(batch)
    vocab = step.model.get_input_embeddings().weight.shape[0]

    def make(i: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(0, vocab, (batch, new), generator=generator)
        if i == 0:
            ids = ids[:1, :1].expand(batch, new).contiguous()
        if mode == "prefill":
            return (ids, torch.arange(tokens), *(torch.zeros(shape, dtype=dtype) for shape, dtype in shapes))
        position = (length - 1 - i) % length
        cache = []
        for shape, dtype in shapes:
            context = torch.randn(shape, generator=generator, dtype=torch.float64)
            if i == 0:
                context = context[:1].expand(shape).clone()
            context[:, :, position:] = 0.0  # not written yet
            cache.append(context.to(dtype).contiguous())
        return (ids, torch.tensor([position]), *cache)

    return make


@torch.no_grad()
def routing_summary(module: nn.Module, inputs: Inputs) -> list[dict[str, Any]]:
    """Per ``MoE`` layer in ``module`` (in call order), for one eager forward on ``inputs``: ``tokens`` routed,
    the ``experts_mode`` their shape selects, ``experts_used`` (distinct experts any token chose) and
    ``max_expert_tokens`` (tokens of the busiest expert). Every token sent to the same ``k`` experts reads
    ``experts_used == k`` and ``max_expert_tokens == tokens``."""
    found: list[dict[str, Any]] = []

    def record_shape(moe, args):
        batch, seq_len, _ = args[0].shape
        mode = moe.expert_mlps.resolve_mode(None, batch * seq_len, seq_len)
        found.append({"tokens": batch * seq_len, "experts_mode": mode.value})

    def record_routing(router, args, output):
        expert_index = output[2]
        counts = torch.bincount(expert_index.reshape(-1).cpu(), minlength=router.num_experts)
        found[-1].update(experts_used=int((counts > 0).sum()), max_expert_tokens=int(counts.max()))

    layers = [m for m in module.modules() if isinstance(m, MoE)]
    hooks = [m.register_forward_pre_hook(record_shape) for m in layers]
    hooks += [m.router.register_forward_hook(record_routing) for m in layers]
    try:
        module(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return found


def one_rank_token(full: nn.Module, experts: Sequence[int]) -> torch.Tensor:
    """``(H,)``: a hidden state the router sends to experts among ``experts`` (one EP rank's) only. The direction is
    the least-squares solution of ``router logits = +m`` on the first ``k`` of them and ``-m`` elsewhere; its length
    starts at a standard normal token's (``sqrt(H)``, so the outputs keep their usual size) and doubles until the
    router itself picks only ``experts`` (up to 64x; the last one is returned, and the report says where its pairs
    went)."""
    linear = full.router.linear_router
    weight = linear.weight.detach().double()
    k = full.router.top_k
    target = torch.full((weight.shape[0],), -8.0, dtype=torch.float64)
    target[list(experts[:k])] = 8.0
    if linear.bias is not None:
        target = target - linear.bias.detach().double()
    direction = torch.linalg.lstsq(weight, target.unsqueeze(1)).solution.squeeze(1)
    direction = direction * (weight.shape[1] ** 0.5 / direction.norm())
    allowed = set(experts)
    for scale in (1, 2, 4, 8, 16, 32, 64):
        x = direction * scale
        with torch.no_grad():
            chosen = full.router(x.to(linear.weight.dtype).unsqueeze(0))[2]
        if set(chosen.flatten().tolist()) <= allowed:
            break
    return x


def block_inputs(full: nn.Module, layout: SPMDLayout, tokens: int, mode: str, padding: bool = False,
                 seed: int = 0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``make_inputs`` for the whole world: ``i -> (hidden_states (G * B, S, H)[, padding_mask (G * B, S)])``, ``G``
    token groups (``D`` per MoE block), each one sequence of ``tokens`` (prefill) or ``tokens`` sequences of one
    token (decode). ``i = 0`` repeats one token aimed at EP rank 0's experts (every pair of the block on one rank;
    :class:`~nxd_moe.tracing.spmd.SPMDReport` says where they went); other ``i`` draw random tokens. ``padding``
    masks the last quarter of each group's tokens."""
    groups = layout.expert_model_parallel_size * layout.expert_data_parallel_size
    shape = (groups, tokens) if mode == "prefill" else (groups * tokens, 1)
    dtype, hidden = full.expert_mlps.dtype, full.hidden_size
    per_rank = full.router.num_experts // layout.moe_expert_parallel_size(mode)
    target = one_rank_token(full, range(per_rank))

    def make(i: int) -> tuple[torch.Tensor, ...]:
        if i == 0:
            x = target.expand(*shape, hidden)
        else:
            x = torch.randn(*shape, hidden, generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64)
        x = x.to(dtype).contiguous()
        if not padding:
            return (x,)
        mask = torch.ones(groups, tokens, dtype=torch.bool)
        mask[:, tokens - max(1, tokens // 4):] = False
        return x, mask.view(shape)

    return make


def local_inputs(layout: SPMDLayout, block: Sequence[torch.Tensor], rank: int, mode: str) -> list[torch.Tensor]:
    """Rank ``rank``'s part of the world-wide inputs ``block`` (:meth:`SPMDLayout.local`; its positions of them in
    a sequence-parallel prefill)."""
    sharded = layout.sequence_parallel and mode == "prefill"
    return [layout.local(t, rank, sharded).contiguous() for t in block]
