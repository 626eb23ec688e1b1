"""The collectives of an SPMD program as XLA ops over replica groups (``torch_xla``'s ``xm`` collectives).

:mod:`~nxd_moe.parallel.collectives` calls these when its group is a
:class:`~nxd_moe.parallel_state.ReplicaGroups` (an SPMD layout), so the parallel MoE's code is the same on
``torch.distributed`` and in a traced XLA program. Each call emits one HLO collective whose ``replica_groups``
are the layout's groups -- every rank runs the same op and takes part with the group that holds it -- on the
shapes the caller gives; nothing is read on the host. ``pin_layout=False``: the program is one module that every
rank runs, so there are no differently compiled participants whose layouts would need pinning.
"""

from __future__ import annotations

import torch

from nxd_moe.parallel_state import ReplicaGroups


def _xm(group: ReplicaGroups):
    import torch_xla
    import torch_xla.core.xla_model as xm

    # The program is compiled for torch_xla's replication devices: there must be one per rank.
    ranks = 1 + max(max(g) for g in group.groups)
    replicas = torch_xla._XLAC._xla_get_replication_devices_count()
    if replicas != ranks:
        raise RuntimeError(f"{group.kind}: the SPMD program has {ranks} ranks but torch_xla replicates over "
                           f"{replicas} device(s); run it inside nxd_moe.trace_spmd.replicated(devices) with "
                           f"{ranks} devices")
    return xm


def all_gather(x: torch.Tensor, group: ReplicaGroups) -> torch.Tensor:
    """``x (n, ...)`` -> ``(G * n, ...)``: the group's chunks concatenated in group order (HLO ``all-gather``)."""
    return _xm(group).all_gather(x, dim=0, groups=group.as_lists(), pin_layout=False)


def reduce_scatter(x: torch.Tensor, group: ReplicaGroups) -> torch.Tensor:
    """``x (G * n, ...)`` -> ``(n, ...)``: this rank's chunk of the sum over the group (HLO ``reduce-scatter``)."""
    xm = _xm(group)
    return xm.reduce_scatter(xm.REDUCE_SUM, x, scale=1.0, scatter_dim=0, shard_count=group.size,
                             groups=group.as_lists(), pin_layout=False)


def all_reduce(x: torch.Tensor, group: ReplicaGroups) -> torch.Tensor:
    """Sum over the group (HLO ``all-reduce``; out of place). Not through ``xm.all_reduce``, which returns its input
    when ``torch_xla.runtime.world_size()`` -- cached by the process's first call -- says 1."""
    import torch_xla

    xm = _xm(group)
    return torch_xla._XLAC._xla_all_reduce(xm.REDUCE_SUM, x, 1.0, group.as_lists(), False)


def all_to_all(x: torch.Tensor, group: ReplicaGroups) -> torch.Tensor:
    """``x (G * n, ...)``: rows ``[r * n, (r + 1) * n)`` go to group rank ``r``; returns the rows received, in
    group order (HLO ``all-to-all`` with equal splits)."""
    return _xm(group).all_to_all(x, split_dimension=0, concat_dimension=0, split_count=group.size,
                            groups=group.as_lists(), pin_layout=False)
