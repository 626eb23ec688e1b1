"""Activation functions an expert MLP may use, by the names NxD accepts for ``hidden_act``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ACT2FN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "leaky_relu": F.leaky_relu,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
}
