"""A transformers sparse-MoE block as nxd_moe's ``MoE``: :func:`from_hf_moe_block`."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.build import build_moe
from nxd_moe.hf.checkpoints import hf_block_to_nxd, meta_state_dict
from nxd_moe.hf.families import DOWN_W, ROUTER_W, as_model_config, family_of
from nxd_moe.hf.stored_formats import check_stored_formats, hf_quantization
from nxd_moe.moe import MoE
from nxd_moe.parallel.sharding import load_full_state_dict


def from_hf_moe_block(block: nn.Module, config: Any, **build_kwargs: Any) -> MoE:
    """An :class:`MoE` computing what the transformers sparse-MoE ``block`` computes.

    ``block``: ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``GptOssMLP``,
    ``DeepseekV3MoE``, ``Llama4TextMoe`` or ``DbrxFFN``; ``config``: the model's config (or an
    :class:`MoEModelConfig` for it). ``build_kwargs`` go to :func:`~nxd_moe.build.build_moe` (``block_size``,
    ``backend``, ``validate_inputs``, experts overrides...); ``dtype`` and ``device`` default to those of the
    block's weights. Weights are copied with a strict ``load_state_dict``; under model parallelism the layer is
    sharded and each rank keeps its shard. The layer is built on the meta device first, so the only memory
    allocated is the layer's own weights (plus, for GPT-OSS and DBRX, one temporary gate/up projection).

    A block whose experts are stored quantized (GPT-OSS MXFP4 ``*_blocks``/``*_scales``, DeepSeek-style FP8
    ``weight_scale_inv``) loads as stored: ``quantization``/``shared_quantization`` default to the stored formats
    and must equal them if given (quantize a bf16 layer with :func:`~nxd_moe.quantization.quantizer.quantize_experts`).

    ``moe(x)[0]`` matches the block's output (for ``GptOssMLP`` and ``Llama4TextMoe``, the first element of
    the tuple the block returns) up to floating-point rounding; the router runs in float32 as in NxD.
    """
    if not isinstance(block, nn.Module):
        raise TypeError(f"from_hf_moe_block: block must be an nn.Module, got {type(block).__name__}")
    if "scale" in build_kwargs:
        raise TypeError("from_hf_moe_block: 'scale' would change the shapes the block's weights need")
    cfg = as_model_config(config)
    family = family_of(cfg)
    if not any(c.__name__ in family.block_classes for c in type(block).__mro__):
        raise TypeError(f"from_hf_moe_block: config is {cfg.hf_model_type!r}, whose MoE block is "
                        f"{' or '.join(family.block_classes)}, got {type(block).__name__}")
    parts = block.state_dict()
    nxd = hf_block_to_nxd(parts, cfg, meta_state_dict(cfg), f"{type(block).__name__}.")
    routed, shared = hf_quantization(parts)
    build_kwargs.setdefault("quantization", routed)
    if cfg.shared_experts is not None:
        build_kwargs.setdefault("shared_quantization", shared)
    # The layer dtype: the experts' weights', or where they are stored quantized the router's (the model's dtype).
    reference = nxd[DOWN_W] if routed == "bf16" else nxd[ROUTER_W]
    build_kwargs.setdefault("dtype", reference.dtype)
    device = build_kwargs.pop("device", reference.device)
    moe = build_moe(cfg, device="meta", **build_kwargs).to_empty(device=device)
    for module in moe.modules():  # to_empty left the SPMD rank (not in any checkpoint) uninitialised
        if isinstance(module, parallel_state.SPMDRank):
            module.reset_rank()
    check_stored_formats(moe, parts, "from_hf_moe_block: the block's", "build with")
    if reference.is_meta:  # a block without values (a model built on the meta device): load its weights later
        return moe
    return load_full_state_dict(moe, nxd)
