"""The shared experts' projections (:class:`DenseProjection`); the module itself is
:class:`nxd_moe.shared_experts.SharedExperts`."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe.quantization.formats import Shape, get_format


class DenseProjection(nn.Module):
    """A bias-free linear layer stored ``(out, in)`` like ``nn.Linear``, or ``(in, out)`` when ``transposed``
    (the layout NxD's decode kernels read).

    Quantized (``quantization`` other than ``"bf16"``): ``weight`` and ``scale`` hold the format's stored tensors
    for the ``(in, out)`` matrix -- the ``(K, N)`` orientation every format is defined on (FP8 scales per output
    channel or 128x128 tile, MxFP4 blocks of 32 along ``in``) -- whatever ``transposed`` says; ``forward``
    dequantizes them to ``dtype``, one rounding, as the routed experts' torch path does.
    """

    def __init__(self, in_features: int, out_features: int, transposed: bool, dtype: torch.dtype, device=None,
                 quantization: str = "bf16"):
        super().__init__()
        self.transposed = transposed
        self.format = get_format(quantization, "SharedExperts.quantization")
        self.compute_dtype = dtype
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        weight = torch.empty(shape, dtype=dtype, device=device)
        with torch.no_grad():
            nn.init.kaiming_uniform_(weight.t() if transposed else weight, a=math.sqrt(5))
        if not self.format.quantized:
            self.weight = nn.Parameter(weight)
            return
        self.shape = Shape(1, in_features, out_features)
        self.format.check_shape(self.shape, f"shared-expert projection (in={in_features}, out={out_features})")
        self.store_quantized(weight)
        self.register_load_state_dict_pre_hook(DenseProjection._check_quantized)

    @torch.no_grad()
    def store_quantized(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (in the orientation ``transposed`` names) into ``self.weight`` and ``self.scale``
        (a meta-device ``weight``: the format's empty tensors)."""
        matrix = (weight if self.transposed else weight.t()).unsqueeze(0)
        stored = (self.format.empty(self.shape, matrix.device) if matrix.is_meta
                  else self.format.quantize(matrix.contiguous()))
        self.weight = nn.Parameter(stored[0][0], requires_grad=False)
        self.scale = nn.Parameter(stored[1][0], requires_grad=False)

    @staticmethod
    def _check_quantized(module, state_dict, prefix, *args, **kwargs):
        weight, scale = state_dict.get(prefix + "weight"), state_dict.get(prefix + "scale")
        if isinstance(weight, torch.Tensor) and isinstance(scale, torch.Tensor):
            what = prefix.rstrip(".") or "DenseProjection"
            for name, value in (("weight", weight), ("scale", scale)):
                if value.dim() != 2:
                    raise ValueError(f"{what}.{name} must be 2-D (the stored (in, out) matrix), got shape "
                                     f"{tuple(value.shape)}")
            module.format.check(weight.unsqueeze(0), scale.unsqueeze(0), module.shape, what)

    def matrix(self) -> torch.Tensor:
        """The weight in the compute dtype, in the orientation ``transposed`` names (dequantized if stored so)."""
        if not self.format.quantized:
            return self.weight
        w = self.format.dequantize(self.weight.unsqueeze(0), self.scale.unsqueeze(0), self.compute_dtype)[0]
        return w if self.transposed else w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.matrix()
        return x @ w if self.transposed else F.linear(x, w)

    def extra_repr(self) -> str:
        return f"transposed={self.transposed}" + (f", quantization={self.format.name!r}" if self.format.quantized
                                                  else "")
