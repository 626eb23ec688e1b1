"""A transformers causal LM's forward over a static KV cache, as a pure function of tensors.

A compiler for a fixed-shape device (``neuronx-cc``) takes one graph per phase -- a prefill, a decode step -- whose
KV cache goes in and comes out as tensors of a fixed length, and whose write position is a tensor too, so that one
compiled graph serves every step. :class:`StaticCacheStep` wraps a transformers ``...ForCausalLM`` that way: it
rebuilds transformers' ``StaticCache`` around the cache tensors it is given on every call, writes the new keys and
values at ``cache_position``, and returns the logits and the whole updated cache. Nothing in the step reads a
tensor value on the host.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from nxd_moe.checks import check_int

__all__ = ["PolarFreeRotaryEmbedding", "StaticCacheStep", "check_cache_length", "replace_polar_rotary_embeddings"]

# transformers' config keys that bound how far back a layer attends (sliding window, Llama 4's chunks).
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size")


def check_cache_length(config, cache_length: int, name: str = "cache_length") -> int:
    """``cache_length``, checked against the model's ``config``: an int >= 1, at most its positions
    (``max_position_embeddings``) and its sliding window or attention chunk (see :class:`StaticCacheStep`).
    ``name``: the argument's name in errors."""
    check_int(name, cache_length, minimum=1)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and cache_length > positions:
        raise ValueError(f"{name} must be <= the model's max_position_embeddings ({positions}), got {cache_length}: "
                         "the model has no positions beyond it")
    for key in _WINDOW_KEYS:
        window = getattr(config, key, None)
        if isinstance(window, int) and cache_length > window:
            raise ValueError(f"{name} must be <= the model's {key} ({window}), got {cache_length}: beyond it "
                             "transformers' cache rolls its buffer under Python control flow, a graph per position")
    return cache_length


class PolarFreeRotaryEmbedding(nn.Module):
    """Llama 4's rotary embedding with its complex factors ``attention_scaling * e^{i f}`` built from ``cos f``
    and ``sin f`` instead of ``torch.polar``: the same values, but ``torch_xla`` 2.9 has no lowering of
    ``torch.polar`` (nor of ``torch.complex``) and runs it on the CPU, a host round trip in every step, whereas
    ``view_as_complex`` of the stacked real parts lowers. Wraps the original module, whose buffers it reads."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.rotary.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.view_as_complex(torch.stack([freqs.cos(), freqs.sin()], dim=-1)) * self.rotary.attention_scaling


# transformers rotary embeddings that call torch.polar (Llama 4's).
_POLAR_ROTARY = ("Llama4TextRotaryEmbedding",)


def replace_polar_rotary_embeddings(model: nn.Module) -> list[str]:
    """Wrap every rotary embedding of ``model`` that calls ``torch.polar`` in a
    :class:`PolarFreeRotaryEmbedding`; returns the paths of the modules replaced (none for most families)."""
    # dynamic and longrope rotary types rescale inv_freq in a decorator around forward: left as they are
    # (one already wrapped is skipped: the function may run twice on a model)
    paths = [path for path, module in model.named_modules() if type(module).__name__ in _POLAR_ROTARY
             and "dynamic" not in module.rope_type and module.rope_type != "longrope"
             and not isinstance(model.get_submodule(path.rpartition(".")[0]), PolarFreeRotaryEmbedding)]
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, PolarFreeRotaryEmbedding(getattr(parent, name)))
    return paths


class StaticCacheStep(nn.Module):
    """``(input_ids (B, S), cache_position (S,), *cache) -> (logits (B, S, V), *cache)``: one forward of ``model``
    with a KV cache of ``cache_length`` positions.

    ``cache`` holds, for each decoder layer in order, its keys ``(B, kv_heads, L, k_head_dim)`` and values ``(B,
    kv_heads, L, v_head_dim)`` (:meth:`cache_shapes`); ``cache_position`` the positions the ``S`` new tokens take
    (consecutive; a prefill starts at 0, a decode step is one position). Token ``s`` attends to the cache positions
    ``<= cache_position[s]``; the new keys and values overwrite positions ``cache_position``. The inputs are not
    modified: the updated cache is returned (the same shapes, so a caller feeds it to the next step).

    ``cache_length`` must not exceed the model's sliding window or attention chunk (GPT-OSS: 128, Llama 4: 8192):
    there every layer sees its whole cache and the causal mask is the only one needed, whereas beyond the window
    transformers' cache rolls its buffer under Python control flow that depends on the position (one graph per
    position). The step builds that causal mask itself from ``cache_position`` (transformers derives it from Python
    counters of the cache object) and passes it as the ``attention_mask`` of every layer type.
    """

    def __init__(self, model: nn.Module, cache_length: int):
        super().__init__()
        self.model = model
        self.cache_length = check_cache_length(model.config, cache_length)
        # transformers 5.24 renamed the forward's past_key_values argument to cache (5.23 has only the old name)
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def _static_cache(self):
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=self.cache_length)

    @torch.no_grad()
    def cache_shapes(self, batch_size: int) -> list[tuple[torch.Size, torch.dtype]]:
        """``(shape, dtype)`` of each cache tensor for ``batch_size`` sequences (keys and values per layer), read
        from a one-token forward of the model on the cache transformers allocates for it."""
        check_int("batch_size", batch_size, minimum=1)
        cache = self._static_cache()
        device = self.model.get_input_embeddings().weight.device
        self.model(input_ids=torch.zeros(batch_size, 1, dtype=torch.long, device=device), use_cache=True,
                   **{self._cache_argument: cache})
        return [(t.shape, t.dtype) for layer in cache.layers for t in (layer.keys, layer.values)]

    def _mask(self, cache_position: torch.Tensor, batch_size: int, dtype: torch.dtype):
        """Additive causal mask ``(B, 1, S, L)`` (0 where ``key position <= cache_position[s]``, else the dtype's
        lowest value, as transformers' eager masks), keyed by layer type for models that have several."""
        keys = torch.arange(self.cache_length, device=cache_position.device)
        allowed = keys.view(1, 1, 1, -1) <= cache_position.view(1, 1, -1, 1)
        mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
        mask = mask.expand(batch_size, 1, -1, -1)
        layer_types = getattr(self.model.config, "layer_types", None)
        return mask if layer_types is None else {layer_type: mask for layer_type in set(layer_types)}

    def input_names(self, count: int) -> list[str]:
        """The first ``count`` inputs of :meth:`forward` by name (a trace's parameter map): ``input_ids``,
        ``cache_position``, then ``cache.<layer>.keys`` and ``cache.<layer>.values``."""
        cache = [f"cache.{i // 2}.{('keys', 'values')[i % 2]}" for i in range(max(0, count - 2))]
        return ["input_ids", "cache_position", *cache][:count]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, *cache: torch.Tensor):
        cache_layers = self._static_cache()
        if len(cache) != 2 * len(cache_layers.layers):
            raise ValueError(f"StaticCacheStep: expected keys and values for {len(cache_layers.layers)} layers "
                             f"({2 * len(cache_layers.layers)} cache tensors), got {len(cache)}")
        batch_size, new_tokens = input_ids.shape
        if cache_position.shape != (new_tokens,):
            raise ValueError(f"StaticCacheStep: cache_position must have shape ({new_tokens},) (one position per "
                             f"new token), got {tuple(cache_position.shape)}")
        for layer, keys, values in zip(cache_layers.layers, cache[0::2], cache[1::2]):
            if not hasattr(layer, "cumulative_length"):
                import transformers

                raise RuntimeError(f"transformers {transformers.__version__}: its StaticCache layers keep no "
                                   "cumulative_length tensor; StaticCacheStep needs transformers >= 5.23")
            layer.lazy_initialization(keys, values)
            # copies: the step writes into its cache and must leave the caller's tensors as they were
            layer.keys, layer.values = keys.clone(), values.clone()
            # where the layer writes: a device tensor, so every position runs the same graph
            layer.cumulative_length = cache_position[0].clone()
        dtype = self.model.get_input_embeddings().weight.dtype
        out = self.model(input_ids=input_ids, attention_mask=self._mask(cache_position, batch_size, dtype),
                         position_ids=cache_position.unsqueeze(0).expand(batch_size, -1), use_cache=True,
                         **{self._cache_argument: cache_layers})
        return (out.logits, *[t for layer in cache_layers.layers for t in (layer.keys, layer.values)])
