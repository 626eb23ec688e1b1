"""A rank's shard of a full (single-device) checkpoint.

Expert parallelism keeps a subset of the experts (dim 0 of every expert tensor); tensor parallelism keeps one
slice of the intermediate dimension. ``gate_up_proj`` is ``[gate | up]`` on its last dim, so it is split with
**stride 2** (NxD's ``stride=2`` column-parallel layout): the dim is cut into ``2 * TP`` chunks and rank ``r``
keeps chunks ``r`` and ``TP + r``, i.e. ``[gate_r | up_r]`` -- gate and up stay paired per rank, and the GLU
activation needs no communication.

Modules that hold sharded weights describe each tensor with a :class:`ShardSpec` (``shard_specs()``); every other
tensor is replicated and loaded as is. :func:`shard_state_dict` builds a rank's state dict from the full one, so
each rank loads only its shard (``nxd_moe.hf`` checkpoints included). The rank tensor of an SPMD program
(:class:`~nxd_moe.parallel_state.SPMDRank`) is the module's own: a single-device checkpoint has none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn as nn

from nxd_moe.checks import check_int
from nxd_moe.experts.shard import ShardSpec
from nxd_moe.parallel_state import SPMDRank


def tensor_parallel_slice(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, stride: int = 1) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of ``full`` along ``dim``: the dim is ``stride`` equal parts, each cut into
    ``tp_size`` pieces; the rank keeps its piece of every part, concatenated (a view when ``stride == 1``)."""
    check_int("tp_size", tp_size, minimum=1)
    check_int("tp_rank", tp_rank, minimum=0, maximum=tp_size - 1)
    check_int("stride", stride, minimum=1)
    size = full.shape[dim]
    if size % (stride * tp_size):
        raise ValueError(f"dimension {dim} of size {size} must be divisible by stride * tensor-parallel size "
                         f"({stride} * {tp_size})")
    piece = size // (stride * tp_size)
    parts = [full.narrow(dim, s * (size // stride) + tp_rank * piece, piece) for s in range(stride)]
    return parts[0] if stride == 1 else torch.cat(parts, dim=dim)


def shard_tensor(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    out = full
    if spec.experts is not None:
        out = out.index_select(0, torch.tensor(spec.experts, device=full.device))
    if spec.dim is not None:
        out = tensor_parallel_slice(out, spec.dim, spec.tp_size, spec.tp_rank, spec.stride)
    return out.contiguous()


def shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """``{local state-dict key: spec}`` of every sharded tensor under ``module`` (modules that shard implement
    ``shard_specs()`` with keys relative to themselves)."""
    specs: dict[str, ShardSpec] = {}
    for name, sub in module.named_modules():
        own = getattr(type(sub), "shard_specs", None)
        if own is None:
            continue
        prefix = f"{name}." if name else ""
        for key, spec in sub.shard_specs().items():
            specs[prefix + key] = dataclasses.replace(spec, source=prefix + spec.source)
    return specs


def shard_state_dict(module: nn.Module, full_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's state dict for ``module`` from the single-device module's ``full_state_dict``.

    Raises ``KeyError`` naming missing keys and ``ValueError`` for keys the module does not use, so a checkpoint
    of another architecture cannot load half-way.
    """
    specs = shard_specs(module)
    local = module.state_dict()
    own = {f"{name}.{key}" if name else key: value for name, sub in module.named_modules()
           if isinstance(sub, SPMDRank) for key, value in sub.state_dict().items()}
    sources = {key: specs[key].source if key in specs else key for key in local if key not in own}
    missing = sorted({s for s in sources.values() if s not in full_state_dict})
    if missing:
        raise KeyError(f"full state dict is missing {missing[:6]}" + (f" ... ({len(missing)} in all)"
                                                                        if len(missing) > 6 else ""))
    unused = sorted(set(full_state_dict) - set(sources.values()))
    if unused:
        raise ValueError(f"full state dict has keys this module does not use: {unused[:6]}"
                         + (f" ... ({len(unused)} in all)" if len(unused) > 6 else ""))
    return {key: own[key] if key in own else shard_tensor(full_state_dict[src], specs[key]) if key in specs
            else full_state_dict[src] for key, src in ((k, sources.get(k)) for k in local)}


def load_full_state_dict(module: nn.Module, full_state_dict: Mapping[str, Any]) -> nn.Module:
    """Load a single-device checkpoint into ``module``, each rank taking its shard (strict). Returns ``module``."""
    module.load_state_dict(shard_state_dict(module, full_state_dict), strict=True)
    return module
