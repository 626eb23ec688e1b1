"""The application's KV cache: fixed-size buffers it owns, written in place at each sequence's own positions.

NxD Inference keeps one cache line per sequence (``kv_cache_batch_size`` lines) of ``max_length`` positions per
layer, right-padded prompts, and writes token ``s`` of sequence ``b`` at position ``position_ids[b, s]``: a
sequence's positions are its token indices, whatever the other sequences' lengths. :class:`KVCache` holds those
buffers; :class:`CacheWrites` is what a transformers decoder layer sees as ``past_key_values`` during one program
(its attention calls ``update(keys, values, layer_idx)``):

- context encoding (CTE) writes the prompt's keys and values at positions ``0 .. S-1`` of the cache lines
  ``seq_ids`` and returns the new keys and values alone (the prompt attends to itself only);
- token generation (TKG) writes each sequence's one new key and value at its position and returns the first
  ``bucket`` positions of every line (the token generation bucket: how far back this program reads).

:func:`attention_masks` gives the additive masks that go with it, per layer type (full, sliding window, chunked).
Nothing here reads a tensor value on the host, so every program is one static graph.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.nn as nn

__all__ = ["CacheWrites", "KVCache", "attention_masks", "layer_windows"]


class _ShapeProbe:
    """``past_key_values`` of a one-token forward that records each layer's key and value shapes."""

    def __init__(self) -> None:
        self.shapes: dict[int, tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.shapes[layer_idx] = (tuple(keys.shape), keys.dtype, tuple(values.shape), values.dtype)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class KVCache(nn.Module):
    """Per decoder layer, keys ``(Bc, Hk, L, Dk)`` and values ``(Bc, Hv, L, Dv)`` (buffers, so ``.to()`` moves them
    and a CUDA graph reads them at fixed addresses): ``Bc`` cache lines (NxDI's ``kv_cache_batch_size``), ``L``
    positions (``max_length``). Shapes are read from the model itself (:meth:`for_model`), so every attention
    variant -- grouped-query heads, DeepSeek-V3's compressed latents, GPT-OSS's sinks -- caches what its own
    attention hands to the cache."""

    def __init__(self, shapes: Sequence[tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]],
                 batch_size: int, max_length: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.batch_size, self.max_length = batch_size, max_length
        self.shapes = list(shapes)
        for i, (kshape, kdtype, vshape, vdtype) in enumerate(shapes):
            self.register_buffer(f"keys_{i}", torch.zeros(batch_size, kshape[1], max_length, *kshape[3:],
                                                          dtype=kdtype, device=device), persistent=False)
            self.register_buffer(f"values_{i}", torch.zeros(batch_size, vshape[1], max_length, *vshape[3:],
                                                            dtype=vdtype, device=device), persistent=False)
        self.num_layers = len(shapes)

    @classmethod
    @torch.no_grad()
    def for_model(cls, decoder: nn.Module, batch_size: int, max_length: int) -> "KVCache":
        """The cache of ``decoder`` (a transformers base model: embeddings and decoder layers), shapes read from a
        one-token forward."""
        probe = _ShapeProbe()
        device = decoder.get_input_embeddings().weight.device
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        parameters = inspect.signature(decoder.forward).parameters
        argument = "cache" if "cache" in parameters else "past_key_values"  # transformers 5.24 renamed it
        decoder(input_ids=ids, position_ids=ids, use_cache=True, attention_mask=_probe_mask(decoder, device),
                **{argument: probe})
        if sorted(probe.shapes) != list(range(len(probe.shapes))) or not probe.shapes:
            raise RuntimeError(f"KVCache: the model's attention layers wrote layers {sorted(probe.shapes)} of its "
                               "cache; expected 0..N-1 (every layer once)")
        return cls([probe.shapes[i] for i in range(len(probe.shapes))], batch_size, max_length, device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"keys_{i}"), getattr(self, f"values_{i}")

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def _probe_mask(decoder: nn.Module, device: torch.device) -> Any:
    zero = torch.zeros(1, 1, 1, 1, dtype=decoder.get_input_embeddings().weight.dtype, device=device)
    types = getattr(decoder.config, "layer_types", None)
    return zero if types is None else {t: zero for t in set(types)}


class CacheWrites:
    """``past_key_values`` of one CTE or TKG program over ``cache`` (see the module docstring).

    ``positions``: TKG, ``(B,)`` the position each sequence's new token takes; ``seq_ids``: CTE, ``(B,)`` the cache
    lines the prompts go to; ``bucket``: TKG, how many positions attention reads.
    """

    def __init__(self, cache: KVCache, *, seq_ids: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, bucket: int | None = None):
        if (seq_ids is None) == (positions is None):
            raise ValueError("CacheWrites: give seq_ids (context encoding) or positions (token generation)")
        self.cache, self.seq_ids, self.positions, self.bucket = cache, seq_ids, positions, bucket

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        cached_keys, cached_values = self.cache.layer(layer_idx)
        if self.seq_ids is not None:
            new = keys.shape[2]
            cached_keys[:, :, :new].index_copy_(0, self.seq_ids, keys.to(cached_keys.dtype))
            cached_values[:, :, :new].index_copy_(0, self.seq_ids, values.to(cached_values.dtype))
            return keys, values
        lines = torch.arange(keys.shape[0], device=keys.device)
        cached_keys[lines, :, self.positions] = keys[:, :, 0].to(cached_keys.dtype)
        cached_values[lines, :, self.positions] = values[:, :, 0].to(cached_values.dtype)
        return cached_keys[:, :, :self.bucket], cached_values[:, :, :self.bucket]

    def get_seq_length(self, layer_idx: int = 0):
        # What transformers calls "tokens already cached" (Llama 4 offsets its NoPE temperature tuning by it, one
        # offset for the whole batch as transformers' own caches do): 0 for a prompt, else the furthest position.
        return 0 if self.positions is None else self.positions.max()


def layer_windows(config: Any) -> dict[str | None, tuple[str, int] | None]:
    """How far back each layer type of ``config`` (a transformers text config) attends: ``None`` (every earlier
    position), ``("sliding", W)`` (the last ``W`` positions, the token's own included) or ``("chunked", C)`` (the
    positions of the token's own ``C``-aligned chunk). Key ``None`` when the model has no ``layer_types`` (one mask
    for every layer, sliding if the config sets ``sliding_window``, as transformers builds it)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        window = getattr(config, "sliding_window", None)
        return {None: ("sliding", window) if window else None}
    out: dict[str | None, tuple[str, int] | None] = {}
    for t in set(types):
        if t == "full_attention":
            out[t] = None
        elif t == "sliding_attention":
            out[t] = ("sliding", config.sliding_window)
        elif t == "chunked_attention":
            out[t] = ("chunked", config.attention_chunk_size)
        else:
            raise ValueError(f"layer type {t!r} of {getattr(config, 'model_type', '?')}: no attention mask rule "
                             "(full_attention, sliding_attention and chunked_attention are served)")
    return out


def attention_masks(config: Any, query_positions: torch.Tensor, key_length: int, dtype: torch.dtype) -> Any:
    """Additive masks ``(B, 1, S, key_length)`` for queries at ``query_positions (B, S)`` over keys at positions
    ``0 .. key_length-1``: 0 where allowed (key position <= query position, inside the layer's window), else the
    dtype's lowest value -- a tensor, or a dict per layer type (:func:`layer_windows`)."""
    keys = torch.arange(key_length, device=query_positions.device).view(1, 1, 1, -1)
    queries = query_positions[:, None, :, None]
    causal = keys <= queries
    low = torch.finfo(dtype).min
    masks = {}
    for layer_type, window in layer_windows(config).items():
        allowed = causal
        if window is not None and window[0] == "sliding":
            allowed = allowed & (keys > queries - window[1])
        elif window is not None:
            allowed = allowed & (torch.div(keys, window[1], rounding_mode="floor")
                                 == torch.div(queries, window[1], rounding_mode="floor"))
        masks[layer_type] = torch.where(allowed, 0.0, low).to(dtype)
    return masks[None] if None in masks else masks
