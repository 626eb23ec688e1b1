"""transformers' SDPA attention with the one-token decode step on nxd_moe's split-key kernel.

Under ``torch.compile`` with an attention mask, transformers' SDPA path repeats the cache's key/value heads for
every query head of a group before calling SDPA (``repeat_kv``): at decode that writes and reads the cache ``G``
times over each step, and a one-row query leaves most multiprocessors idle -- the step's attention grows with the
context far faster than its bytes. :data:`ATTENTION` (registered with transformers' ``AttentionInterface``) is SDPA
except where :func:`~nxd_moe.triton_kernels.decode_attention.decode_attention` computes the same function: one
query token, no dropout, none of SDPA's extras, keys and values of one head size, a mask of one row per sequence
(or none), tensors where Triton runs. The application selects it for its models on CUDA
(:func:`use_decode_attention`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["ATTENTION", "decode_kernel_applies", "nxd_moe_sdpa_attention", "use_decode_attention"]

ATTENTION = "nxd_moe_sdpa"
# SDPA keyword arguments that change the function (the kernel does not compute them)
_EXTRAS = ("softcap", "position_bias", "cache", "s_aux", "output_attentions")


def decode_kernel_applies(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    """Whether the split-key kernel computes what SDPA would for these arguments."""
    from nxd_moe.triton_kernels import interpreting  # imports Triton, which must not happen before a test sets its
    #                                                interpreter up (this module is imported with the application)
    batch, _, length, dim = query.shape
    runs = query.is_cuda or (interpreting() and query.device.type == "cpu")
    mask_ok = attention_mask is None or (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool
        and attention_mask.shape[1:] == (1, 1, key.shape[2]) and attention_mask.shape[0] in (1, batch))
    return (runs and length == 1 and (dropout == 0.0 or not module.training) and mask_ok
            and key.shape[-1] == value.shape[-1] == dim and query.shape[1] % key.shape[1] == 0
            and not any(kwargs.get(name) for name in _EXTRAS))


def nxd_moe_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query (B, Hq, S, D)``, ``key``, ``value (B, Hkv, L, D)`` ->
    ``((B, S, Hq, D), None)``; the decode kernel where it applies (:func:`decode_kernel_applies`), else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if not decode_kernel_applies(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    from nxd_moe.triton_kernels.decode_attention import decode_attention_op
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    # the kernel takes rows of contiguous head dimensions (what the projections and the cache give)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return decode_attention_op(query, key, value, attention_mask, scale), None


def use_decode_attention(model: nn.Module) -> bool:
    """Select :data:`ATTENTION` for ``model`` (a transformers model) where it runs SDPA; True if it did. Models on
    another attention (eager, flash, flex) keep it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(ATTENTION, nxd_moe_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # transformers' own masks: the ones SDPA takes
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(ATTENTION)
    return True
