"""What ``nxd-moe trace``'s arguments resolve to (:func:`setup`), and their defaults.

Shared by the layer, whole-decoder and parallel-layout traces; the flags themselves are declared in
:mod:`~nxd_moe.tracing.command`.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

import torch

from nxd_moe.arguments import auto_scale
from nxd_moe.checks import to_torch_dtype
from nxd_moe.model_config import load_model_config

DEFAULT_TOKENS = {"prefill": 512, "decode": 8}
DEFAULT_MODEL_TOKENS = {"prefill": 64, "decode": 8}
# At most GPT-OSS's 128-token sliding window (the smallest of the shipped models), so every shipped model traces.
DEFAULT_CACHE_LENGTH = 128
# Layer-trace options a whole-decoder trace does not take.
LAYER_ONLY_FLAGS = {"dynamic_while": "--dynamic-while", "padding": "--padding", "skip_xla": "--skip-xla"}
# --dynamic-while -> (use_shard_on_intermediate_dynamic_while, use_shard_on_block_dynamic_while)
DYNAMIC_WHILE_FLAGS = {
    "off": (False, False),
    "intermediate": (True, False),
    "block": (False, True),
}


class TraceSetup(NamedTuple):
    """What ``nxd-moe trace``'s arguments resolve to: the config, dtype, scale, tokens per forward and the
    ``build_moe`` overrides."""

    model: Any
    dtype: torch.dtype
    scale: int
    tokens: int
    overrides: dict


def setup(args: argparse.Namespace) -> TraceSetup:
    """Resolve and check ``nxd-moe trace``'s layer arguments (``ValueError`` naming a bad one)."""
    model = load_model_config(args.config)
    dtype = to_torch_dtype(args.dtype, "--dtype")
    scale = auto_scale(model.hidden_size) if args.scale == "auto" else args.scale
    if args.routings < 2:
        raise ValueError(f"--routings must be >= 2, got {args.routings}")
    overrides: dict[str, Any] = {}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.quantization is not None:
        overrides["quantization"] = args.quantization
    if args.dynamic_while is not None:
        on_intermediate, on_block = DYNAMIC_WHILE_FLAGS[args.dynamic_while]
        overrides["block_use_shard_on_intermediate_dynamic_while"] = on_intermediate
        overrides["block_use_shard_on_block_dynamic_while"] = on_block
    return TraceSetup(model, dtype, scale, args.tokens or DEFAULT_TOKENS[args.mode], overrides)


def tolerance(args: argparse.Namespace, dtype: torch.dtype, full_precision: float = 1e-4) -> float:
    """``--atol``, else its default: ``full_precision`` in float32 and float64, 6e-2 in 16-bit dtypes."""
    if args.atol is not None:
        return args.atol
    return full_precision if dtype in (torch.float32, torch.float64) else 6e-2
