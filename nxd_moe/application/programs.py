"""The two kinds of program of an MoE causal LM: context encoding (CTE) and token generation (TKG).

:class:`CausalLMPrograms` holds a transformers ``...ForCausalLM`` (its sparse-MoE blocks patched to nxd_moe's layer)
and the application's :class:`~nxd_moe.application.kv_cache.KVCache`, and computes:

- :meth:`~CausalLMPrograms.context_encoding`: right-padded prompts ``(Bc, S)`` -> the first generated token of each,
  sampled on the device from the logits of the prompt's last real token, the prompts' keys and values written to
  cache lines ``seq_ids``;
- :meth:`~CausalLMPrograms.token_generation`: one token per sequence at its own position -> the next token; the
  new keys and values written in place, attention over the first ``bucket`` positions. End of sequence is tracked
  here too: a sequence that is ``done`` gets ``pad_token_id``, and becomes done when it emits an EOS token.

Each is a function of tensors with static shapes for a given bucket, nothing read on the host: one XLA graph per
bucket, one CUDA graph per bucket. :class:`ContextEncodingProgram` and :class:`TokenGenerationProgram` are the
``nn.Module`` forms a tracer takes, whose outputs include the cache they update (the state a compiled program
aliases from input to output).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from nxd_moe.application.kv_cache import CacheWrites, KVCache, attention_masks
from nxd_moe.application.sampling import sample_tokens

__all__ = ["CausalLMPrograms", "ContextEncodingProgram", "TokenGenerationProgram", "decoder_of"]


def decoder_of(model: nn.Module) -> nn.Module:
    """The base model (embeddings, decoder layers, final norm) of a transformers ``...ForCausalLM``."""
    # .model for most families; DBRX names it after its base_model_prefix ("transformer")
    for name in ("model", getattr(model, "base_model_prefix", None)):
        decoder = getattr(model, name, None) if name else None
        if isinstance(decoder, nn.Module) and decoder is not model and hasattr(decoder, "get_input_embeddings"):
            return decoder
    raise TypeError(f"{type(model).__name__} is not a transformers causal LM with a base model (expected e.g. "
                    "Qwen3MoeForCausalLM, whose .model is the decoder)")


class CausalLMPrograms(nn.Module):
    """``model`` (a transformers causal LM, eval mode) with a KV cache of ``batch_size`` lines of ``max_length``
    positions. ``global_topk``: the sampling candidates (:func:`~nxd_moe.application.sampling.sample_tokens`);
    ``cache_shapes``: the cache's per-layer shapes (default: read from a one-token forward of the model)."""

    def __init__(self, model: nn.Module, batch_size: int, max_length: int, global_topk: int = 256,
                 cache_shapes: list | None = None):
        super().__init__()
        config = model.config.get_text_config()
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError(f"{type(model).__name__}: final_logit_softcapping is not served by the application")
        self.model = model
        self.text_config = config
        self.global_topk = global_topk
        if cache_shapes is None:
            self.cache = KVCache.for_model(decoder_of(model), batch_size, max_length)
        else:  # another build's KVCache.shapes (an SPMD rank's model cannot run a probe forward outside XLA)
            device = decoder_of(model).get_input_embeddings().weight.device
            self.cache = KVCache(cache_shapes, batch_size, max_length, device)
        # transformers 5.24 renamed the decoder's past_key_values argument to cache (5.23 has only the old name)
        parameters = inspect.signature(decoder_of(model).forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @property
    def dtype(self) -> torch.dtype:
        return decoder_of(self.model).get_input_embeddings().weight.dtype

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, key_length: int, cache: CacheWrites):
        mask = attention_masks(self.text_config, positions, key_length, self.dtype)
        out = decoder_of(self.model)(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                                     use_cache=True, **{self._cache_argument: cache})
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()

    def context_encoding(self, input_ids: torch.Tensor, lengths: torch.Tensor, seq_ids: torch.Tensor,
                         sampling_params: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids (Bc, S)`` right-padded prompts of ``lengths (Bc,)`` tokens (>= 1) into cache lines
        ``seq_ids (Bc,)`` -> ``(tokens (Bc,), logits (Bc, V))``: the next token of each prompt and the float32 logits
        it was drawn from."""
        batch, new = input_ids.shape
        positions = torch.arange(new, device=input_ids.device).expand(batch, new)
        hidden = self._hidden(input_ids, positions, new, CacheWrites(self.cache, seq_ids=seq_ids))
        last = (lengths - 1).view(batch, 1, 1).expand(batch, 1, hidden.shape[-1])
        logits = self._logits(hidden.gather(1, last)[:, 0])
        return sample_tokens(logits, sampling_params, self.global_topk), logits

    def token_generation(self, tokens: torch.Tensor, positions: torch.Tensor, done: torch.Tensor, bucket: int,
                         eos_token_ids: torch.Tensor, pad_token_id: torch.Tensor,
                         sampling_params: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens (B,)`` fed at ``positions (B,)`` -> ``(next (B,), done (B,))``: the next tokens
        (``pad_token_id`` for sequences already ``done``) and which sequences are done after them (an EOS token,
        one of ``eos_token_ids (n,)``, ends a sequence)."""
        hidden = self._hidden(tokens[:, None], positions[:, None], bucket,
                              CacheWrites(self.cache, positions=positions, bucket=bucket))
        sampled = sample_tokens(self._logits(hidden[:, 0]), sampling_params, self.global_topk)
        return finish(sampled, done, eos_token_ids, pad_token_id)


def finish(sampled: torch.Tensor, done: torch.Tensor, eos_token_ids: torch.Tensor, pad_token_id: torch.Tensor):
    """``(tokens, done')``: ``pad_token_id`` where ``done`` already, and done' = done or an EOS was emitted."""
    tokens = torch.where(done, pad_token_id.to(sampled.dtype), sampled)
    hit = (tokens[:, None] == eos_token_ids[None, :]).any(dim=-1)
    return tokens, done | hit


class ContextEncodingProgram(nn.Module):
    """The CTE program of one bucket as a module: ``(input_ids (Bc, S), lengths, seq_ids[, sampling_params]) ->
    (tokens (Bc,), *cache)``, the cache tensors after the write (layer by layer, keys then values)."""

    def __init__(self, programs: CausalLMPrograms):
        super().__init__()
        self.programs = programs

    def forward(self, input_ids, lengths, seq_ids, sampling_params=None) -> tuple[Any, ...]:
        tokens, _ = self.programs.context_encoding(input_ids, lengths, seq_ids, sampling_params)
        return (tokens, *self.programs.cache.buffers())


class TokenGenerationProgram(nn.Module):
    """The TKG program of one bucket as a module: ``(tokens, positions, done, eos_token_ids, pad_token_id[,
    sampling_params]) -> (next, done', *cache)``."""

    def __init__(self, programs: CausalLMPrograms, bucket: int):
        super().__init__()
        self.programs, self.bucket = programs, bucket

    def forward(self, tokens, positions, done, eos_token_ids, pad_token_id, sampling_params=None) -> tuple[Any, ...]:
        out, done = self.programs.token_generation(tokens, positions, done, self.bucket, eos_token_ids,
                                                   pad_token_id, sampling_params)
        return (out, done, *self.programs.cache.buffers())
