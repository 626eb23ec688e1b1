"""The MoE across processes: NxD's TP / EP / SP layouts on ``torch.distributed``, and what NxD lacks.

- :mod:`~nxd_moe.parallel.layout` -- this rank's groups and its share of the experts (per phase).
- :mod:`~nxd_moe.parallel.token_layout` -- where a rank's tokens sit in the MoE's token order.
- :mod:`~nxd_moe.parallel.placement` -- ``expert_distribution``, redundant copies and which copy serves a pair.
- :mod:`~nxd_moe.parallel.expert_parallel` -- :class:`ExpertParallel`: a sharded ``ExpertMLPsV2`` run over the
  block (dispatch, local pairs, combine); :mod:`~nxd_moe.parallel.shared_experts` -- shared experts over TP.
- :mod:`~nxd_moe.parallel.dispatch` -- the dispatch contract; :mod:`~nxd_moe.parallel.all_gather` (NxD's) and
  :mod:`~nxd_moe.parallel.all_to_all` (static per-destination buffers, or exact counts exchanged first).
- :mod:`~nxd_moe.parallel.collectives` -- the collectives, each counting the bytes it moves (in an SPMD program,
  XLA ops over replica groups: :mod:`~nxd_moe.parallel.xla_collectives`);
  :mod:`~nxd_moe.parallel.payload` -- per-token fields packed into one byte row.
- :mod:`~nxd_moe.parallel.sharding` -- a rank's shard of a full checkpoint.
- :mod:`~nxd_moe.parallel.eplb` -- expert-parallel load balancing: placements planned from measured loads.

The process groups themselves are :mod:`nxd_moe.parallel_state` (NxD's module name). The experts
(:mod:`nxd_moe.experts`) know nothing of ranks: this package drives them.
"""

from nxd_moe.moe_configs import contiguous_distribution
from nxd_moe.parallel.eplb import plan_expert_distribution, rank_loads
from nxd_moe.parallel.expert_parallel import ExpertParallel
from nxd_moe.parallel.placement import ExpertPlacement
from nxd_moe.parallel.sharding import ShardSpec, load_full_state_dict, shard_state_dict
from nxd_moe.parallel.token_layout import TokenLayout

__all__ = [
    "ExpertParallel",
    "ExpertPlacement",
    "ShardSpec",
    "TokenLayout",
    "contiguous_distribution",
    "load_full_state_dict",
    "plan_expert_distribution",
    "rank_loads",
    "shard_state_dict",
]
