"""NxD's ``neuronx_distributed.parallel_layers.mappings``: the region collectives its MoE code calls, forward only,
on :mod:`nxd_moe.parallel.collectives`.

NxD's mappings are autograd functions whose backward is the transposed collective (an all-reduce for a copy, ...).
nxd_moe is an inference layer, so these run the forward collective only and refuse a tensor that would need a
gradient through them (a wrong gradient would be silent). ``process_group=None`` is the tensor-parallel group of
:mod:`nxd_moe.parallel_state`, as in NxD.
"""

from __future__ import annotations

import torch

from nxd_moe import parallel_state
from nxd_moe.checks import check_bool
from nxd_moe.parallel.collectives import CommLedger, all_gather, all_reduce, group_size, reduce_scatter

__all__ = ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "gather_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
           "gather_from_sequence_parallel_region", "scatter_to_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region"]


def _prepare(name: str, x: torch.Tensor, process_group):
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(f"mappings.{name}: nxd_moe's NxD mappings run the forward collective only (inference); "
                           "call it under torch.no_grad() / torch.inference_mode() or on a tensor that needs no "
                           "gradient")
    return parallel_state.get_tensor_model_parallel_group() if process_group is None else process_group


def _rank_in(group) -> int:
    return torch.distributed.get_rank(group)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """Identity (the backward all-reduce is a training matter)."""
    _prepare("copy_to_tensor_model_parallel_region", input_, process_group)
    return input_


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """Sum over the group's ranks."""
    group = _prepare("reduce_from_tensor_model_parallel_region", input_, process_group)
    return all_reduce(input_, group, CommLedger(), "reduce_from_tensor_model_parallel_region")


def _gather(name: str, x: torch.Tensor, dim: int, process_group) -> torch.Tensor:
    group = _prepare(name, x, process_group)
    chunks = all_gather(x.movedim(dim, 0), group, CommLedger(), name)  # (G, n, ...) in group-rank order
    return chunks.reshape(-1, *chunks.shape[2:]).movedim(0, dim)


def _split(name: str, x: torch.Tensor, dim: int, process_group) -> torch.Tensor:
    group = _prepare(name, x, process_group)
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"mappings.{name}: dimension {dim} of size {x.shape[dim]} does not split into {size} ranks")
    return x.chunk(size, dim)[0 if size == 1 else _rank_in(group)].contiguous()


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """Concatenate the ranks' tensors along the last dimension."""
    return _gather("gather_from_tensor_model_parallel_region", input_, -1, process_group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    """This rank's slice of the last dimension."""
    return _split("scatter_to_tensor_model_parallel_region", input_, -1, process_group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                         to_model_parallel: bool = True, process_group=None,
                                         tile_cc: bool = False) -> torch.Tensor:
    """Concatenate the ranks' sequence shards along ``sequence_dimension``. ``to_model_parallel`` picks NxD's
    backward (reduce-scatter or split) and ``tile_cc`` its tiling of the collective: neither changes the forward."""
    check_bool("to_model_parallel", to_model_parallel)
    check_bool("tile_cc", tile_cc)
    return _gather("gather_from_sequence_parallel_region", input_, sequence_dimension, process_group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                        process_group=None) -> torch.Tensor:
    """This rank's shard of ``sequence_dimension``."""
    return _split("scatter_to_sequence_parallel_region", input_, sequence_dimension, process_group)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, sequence_dimension: int = 0,
                                               process_group=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the ranks, then this rank's shard of ``sequence_dimension``; ``dtype``: the dtype the sum runs
    in (NxD's), the result has the input's."""
    name = "reduce_scatter_to_sequence_parallel_region"
    group = _prepare(name, input_, process_group)
    size = group_size(group)
    if input_.shape[sequence_dimension] % size:
        raise ValueError(f"mappings.{name}: dimension {sequence_dimension} of size {input_.shape[sequence_dimension]} "
                         f"does not split into {size} ranks")
    x = input_ if dtype is None else input_.to(dtype)
    parts = torch.stack(x.chunk(size, sequence_dimension))  # (G, ...): rank r's shard of every rank's sum
    return reduce_scatter(parts, group, CommLedger(), name).to(input_.dtype)
