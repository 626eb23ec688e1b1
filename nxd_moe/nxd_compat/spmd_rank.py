"""NxD's ``SPMDRank`` (``neuronx_distributed.parallel_layers.layers``): this rank's global id as a module parameter.

NxD traces one program for every rank and loads each rank's id into it from the checkpoint (``spmd_rank.rank`` =
``arange(world)``, one entry per rank). nxd_moe has no such module yet -- its layers read their ranks from
:mod:`nxd_moe.parallel_state` -- so this thin one fills the parameter from ``torch.distributed`` (0 without a
process group); a checkpoint's entry, loaded the NxD way, overwrites it with the same value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from nxd_moe import parallel_state
from nxd_moe.config import check_int


class SPMDRank(nn.Module):
    """``rank``: a ``(1,)`` int32 parameter (no gradient) holding this rank's global id; ``get_rank()`` returns
    it. ``tensor_model_parallel_size`` defaults to :mod:`nxd_moe.parallel_state`'s (1 when not initialised)."""

    def __init__(self, world_size: int, tensor_model_parallel_size: int | None = None):
        super().__init__()
        self.world_size = check_int("SPMDRank.world_size", world_size, minimum=1)
        if tensor_model_parallel_size is None:
            tensor_model_parallel_size = (parallel_state.get_tensor_model_parallel_size()
                                          if parallel_state.model_parallel_is_initialized() else 1)
        self.tensor_model_parallel_size = check_int("SPMDRank.tensor_model_parallel_size",
                                                    tensor_model_parallel_size, minimum=1, maximum=world_size)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank >= world_size:
            raise ValueError(f"SPMDRank: this process is rank {rank}, outside world_size={world_size}")
        self.rank = nn.Parameter(torch.tensor([rank], dtype=torch.int32), requires_grad=False)

    def get_rank(self) -> torch.Tensor:
        return self.rank
