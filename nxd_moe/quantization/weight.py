"""A quantized projection as the algorithms see it: a stand-in for an ``(E, K, N)`` weight tensor.

:class:`QuantizedWeight` answers the two questions an expert algorithm asks of a weight -- "the rows of these
experts" (``index_select(0, experts)``) and "all of it" (:func:`dequantized`) -- in the compute dtype, from the
stored tensors. A plain tensor answers both as itself, so the bf16 path pays nothing and an algorithm written
against ``weight.index_select(0, idx)`` / ``dequantized(weight)`` never asks which format it holds.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch

from nxd_moe.quantization.formats import QuantizationFormat, Shape


class QuantizedWeight(NamedTuple):
    """``weight`` and ``scale`` stored in ``format`` (see :mod:`nxd_moe.quantization.formats`) for a logical
    ``(E, K, N)`` weight computed in ``dtype``.

    Backends that consume the stored tensors directly read ``format``, ``weight``, ``scale``; everything else
    calls :meth:`index_select` or :meth:`dequantize`.
    """

    format: QuantizationFormat
    weight: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    # A field, not a property: Dynamo 2.9 (the torch_xla tracer's) cannot call a NamedTuple's properties.
    shape: Shape

    @classmethod
    def create(cls, format: QuantizationFormat, weight: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype) -> "QuantizedWeight":
        e, k, n = weight.shape
        return cls(format, weight, scale, dtype, Shape(e, k * format.values_per_byte, n))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """``(len(index), K, N)``: the chosen experts' weights, dequantized (only those experts are read)."""
        if dim != 0:
            raise ValueError(f"QuantizedWeight.index_select selects experts (dim 0), got dim={dim}")
        return self.format.dequantize(self.weight.index_select(0, index), self.scale.index_select(0, index),
                                      self.dtype)

    def dequantize(self) -> torch.Tensor:
        """``(E, K, N)`` in ``dtype``."""
        return self.format.dequantize(self.weight, self.scale, self.dtype)

    @property
    def stored_bytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes


Weight = Union[torch.Tensor, QuantizedWeight]


def dequantized(weight: Weight) -> torch.Tensor:
    """The whole ``(E, K, N)`` weight in the compute dtype (a plain tensor is returned as is)."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def format_name(weight: Weight) -> str:
    return "bf16" if isinstance(weight, torch.Tensor) else weight.format.name


def weight_tensors(weight: Weight) -> tuple[torch.Tensor, ...]:
    """The stored tensors of ``weight`` (what a traced loop must receive as inputs)."""
    return (weight,) if isinstance(weight, torch.Tensor) else (weight.weight, weight.scale)


class WeightLayout(NamedTuple):
    """How to rebuild a weight from :func:`weight_tensors` (no tensors held: safe to close over in a traced loop)."""

    format: QuantizationFormat | None
    dtype: torch.dtype | None
    num_tensors: int  # fields, not properties: see QuantizedWeight.shape

    @classmethod
    def of(cls, weight: Weight) -> "WeightLayout":
        return cls(None, None, 1) if isinstance(weight, torch.Tensor) else cls(weight.format, weight.dtype, 2)

    def rebuild(self, tensors) -> Weight:
        if self.format is None:
            return tensors[0]
        return QuantizedWeight.create(self.format, tensors[0], tensors[1], self.dtype)
