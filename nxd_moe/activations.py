"""Activation functions an expert MLP may use, by the names NxD accepts for ``hidden_act``, and the ids NxD's MoE
kernels know them by."""

from __future__ import annotations

import enum
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


class ACTFunc(enum.Enum):
    """NxD's ``ACTFunc``: the activation ids of its (and nki-library's) MoE kernels; ``name_str`` is the name."""

    SILU = 0
    GELU = 1
    GELU_TANH_APPROX = 2
    SIGMOID = 3
    RELU = 4
    TANH = 5
    LEAKY_RELU = 6

    @property
    def id(self) -> int:
        return self.value

    @property
    def name_str(self) -> str:
        return self.name.lower()

    @classmethod
    def validate(cls, act_func: "ACTFunc | str | None") -> "ACTFunc":
        """A member, its ``name_str``, or ``None`` (NxD's default: ``SIGMOID``)."""
        if isinstance(act_func, cls):
            return act_func
        if act_func is None:
            return cls.SIGMOID
        for member in cls:
            if member.name_str == act_func:
                return member
        raise ValueError(f"act_func must be an ACTFunc or one of {[m.name_str for m in cls]}, got {act_func!r}")


def get_kernel_activation_func_id(act_fn: ACTFunc, glu_type) -> int:
    """The id NxD's blockwise kernels take for a GLU: ``glu`` with SiLU or ``swiglu`` with sigmoid (NxD's only two
    kernel combinations; ``glu_type`` a ``GLUType`` or its value)."""
    glu = getattr(glu_type, "value", glu_type)
    if (glu, act_fn) in (("glu", ACTFunc.SILU), ("swiglu", ACTFunc.SIGMOID)):
        return act_fn.id
    raise ValueError(f"no MoE kernel computes glu_type={glu!r} with {act_fn}; the kernels take ('glu', SILU) and "
                     "('swiglu', SIGMOID)")
