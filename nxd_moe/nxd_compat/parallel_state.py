"""NxD's ``neuronx_distributed.parallel_layers.parallel_state`` (and ``modules.moe.moe_process_group``) on
:mod:`nxd_moe.parallel_state`: the same groups, under NxD's signatures.

What differs from our module, and why each adapter exists:

- :func:`initialize_model_parallel` takes NxD's arguments in NxD's order. ``pipeline_model_parallel_size`` and
  ``context_parallel_size`` must be 1 (nxd_moe is an MoE layer: it has neither); ``lnc_size`` only picks NxD's Trn2
  ring layouts and ``skip_collective_init`` its warm-up all-reduce, so both are checked and otherwise change
  nothing. ``mesh_only=True`` returns the rank lists (:class:`ParallelGroups`) without creating groups. Sizes that
  do not fit the world raise (NxD clamps them to the world size, silently giving another layout than asked).
- The ``get_*_group(as_list=False)`` getters also return the rank lists (``as_list=True`` / ``*_replica_groups``),
  as NxD's meshes.
- NxD's MoE process groups (``init_tensor_expert_parallel_moe_process_groups``) are the prefill (CTE) and decode
  (TKG) MoE groups of our layout: initialising them re-creates the groups with those MoE sizes (every rank calls
  it, as in NxD).
- NxD's token-shuffle group (a training feature) exists with size 1 only: no shuffling.
- NxD's private module state (``_TENSOR_MODEL_PARALLEL_GROUP``, ``_TOKEN_SHUFFLE_GROUP_SIZE``, ...) is here too,
  because NxD's test helpers save and restore it by name. The layout lives in :mod:`nxd_moe.parallel_state`; these
  names mirror it (refreshed by this module's initialise and destroy functions) and are never read, so assigning
  them does not change the layout -- call :func:`initialize_model_parallel`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from nxd_moe import parallel_state as _ours
from nxd_moe.checks import check_bool, check_int
from nxd_moe.parallel_state import (  # noqa: F401 -- NxD's names, the same functions
    get_data_parallel_rank,
    get_data_parallel_size,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_size,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
    get_tensor_model_parallel_src_rank,
    model_parallel_is_initialized,
)


class ParallelGroups(NamedTuple):
    """NxD's ``initialize_model_parallel(..., mesh_only=True)`` result: each kind's groups as lists of ranks."""

    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]]
    ep_model_groups: list[list[int]]
    ep_data_groups: list[list[int]]
    cp_groups: list[list[int]]


def _lists(groups) -> list[list[int]]:
    return [list(g) for g in groups]


def _check_unsupported(name: str, value, why: str) -> None:
    if check_int(name, value, minimum=1) != 1:
        raise ValueError(f"initialize_model_parallel: {name} must be 1, got {value} ({why})")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    mesh_only: bool = False,
) -> ParallelGroups | None:
    """NxD's signature; see the module docstring for what differs."""
    _check_unsupported("pipeline_model_parallel_size", pipeline_model_parallel_size,
                       "nxd_moe has no pipeline parallelism")
    _check_unsupported("context_parallel_size", context_parallel_size, "nxd_moe has no context parallelism")
    check_bool("skip_collective_init", skip_collective_init)
    check_int("lnc_size", lnc_size, minimum=1, maximum=2)
    if not check_bool("mesh_only", mesh_only):
        _ours.initialize_model_parallel(tensor_model_parallel_size, expert_model_parallel_size)
        _mirror_layout()
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel(mesh_only=True) needs torch.distributed for the world size: "
                           "call torch.distributed.init_process_group first (torchrun sets its environment)")
    layout = _ours.model_parallel_layout(dist.get_world_size(), tensor_model_parallel_size,
                                         expert_model_parallel_size)
    alone = [[r] for r in range(layout.world_size)]
    return ParallelGroups(_lists(layout.tensor_model_parallel_groups), _lists(layout.data_parallel_groups), alone,
                          _lists(layout.expert_model_parallel_groups), _lists(layout.expert_data_parallel_groups),
                          alone)


def _replica_groups(kind: str):
    def replica_groups() -> list[list[int]]:
        return _lists(getattr(_ours.get_parallel_layout(), kind))

    return replica_groups


get_tensor_model_parallel_replica_groups = _replica_groups("tensor_model_parallel_groups")
get_expert_model_parallel_replica_groups = _replica_groups("expert_model_parallel_groups")
get_data_parallel_replica_groups = _replica_groups("data_parallel_groups")
get_expert_data_parallel_replica_groups = _replica_groups("expert_data_parallel_groups")


def _group_getter(group, replica_groups):
    def getter(as_list: bool = False):
        return replica_groups() if check_bool("as_list", as_list) else group()

    getter.__name__ = getter.__qualname__ = group.__name__
    getter.__doc__ = f"{group.__doc__} ``as_list=True``: every such group as a list of ranks (NxD's mesh)."
    return getter


get_tensor_model_parallel_group = _group_getter(_ours.get_tensor_model_parallel_group,
                                                get_tensor_model_parallel_replica_groups)
get_expert_model_parallel_group = _group_getter(_ours.get_expert_model_parallel_group,
                                                get_expert_model_parallel_replica_groups)
get_data_parallel_group = _group_getter(_ours.get_data_parallel_group, get_data_parallel_replica_groups)
get_expert_data_parallel_group = _group_getter(_ours.get_expert_data_parallel_group,
                                               get_expert_data_parallel_replica_groups)


def get_world_group(as_list: bool = False):
    """The world group; ``as_list=True``: ``[[0, ..., world - 1]]``."""
    if check_bool("as_list", as_list):
        return [list(range(dist.get_world_size()))]
    return _ours.get_world_group()


def get_experts_for_expert_parallel_rank(expert_parallel_rank: int, total_number_of_experts: int,
                                         expert_model_parallel_size: int, expert_distribution=None) -> list[int]:
    """NxD's argument names; the experts EP rank ``expert_parallel_rank`` holds."""
    return list(_ours.get_experts_for_expert_parallel_rank(expert_parallel_rank, total_number_of_experts,
                                                           expert_model_parallel_size, expert_distribution))


def destroy_model_parallel() -> None:
    """Destroy the groups :func:`initialize_model_parallel` created (the default group stays)."""
    _ours.destroy_model_parallel()
    _mirror_layout()


# NxD's private module state, mirrored from nxd_moe.parallel_state (see the module docstring). The kinds nxd_moe
# does not have (pipeline, KV-head sharing) and NxD's size / rank overrides stay None.
_TENSOR_MODEL_PARALLEL_GROUP = _TENSOR_MODEL_PARALLEL_GROUP_SPMD = None
_EXPERT_MODEL_PARALLEL_GROUP = _EXPERT_MODEL_PARALLEL_GROUP_SPMD = None
_DATA_PARALLEL_GROUP = _DATA_PARALLEL_GROUP_SPMD = None
_EXP_DATA_PARALLEL_GROUP = _EXP_DATA_PARALLEL_GROUP_SPMD = None
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = _MPU_TENSOR_MODEL_PARALLEL_RANK = None
_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = _MPU_EXPERT_MODEL_PARALLEL_RANK = None
_PIPELINE_MODEL_PARALLEL_GROUP = _PIPELINE_MODEL_PARALLEL_GROUP_SPMD = _PIPELINE_GLOBAL_RANKS = None
_NEXT_RANK_GROUP = _NEXT_RANK_GROUP_SPMD = _PREV_RANK_GROUP = _PREV_RANK_GROUP_SPMD = None
_KV_SHARED_GROUP = _KV_SHARED_GROUP_SPMD = _KV_SHARED_GROUP_SIZE = None
PP_GROUP_PG_GLOO = None
_TOKEN_SHUFFLE_GROUP = _TOKEN_SHUFFLE_GROUP_SPMD = _TOKEN_SHUFFLE_GROUP_SIZE = None

_MIRRORED = {"_TENSOR_MODEL_PARALLEL_GROUP": get_tensor_model_parallel_group,
             "_EXPERT_MODEL_PARALLEL_GROUP": get_expert_model_parallel_group,
             "_DATA_PARALLEL_GROUP": get_data_parallel_group,
             "_EXP_DATA_PARALLEL_GROUP": get_expert_data_parallel_group}


def _mirror_layout() -> None:
    """Set NxD's private group names (the group, and ``_SPMD``: every such group's ranks) from the layout."""
    initialized = model_parallel_is_initialized()
    for name, getter in _MIRRORED.items():
        globals()[name] = getter() if initialized else None
        globals()[f"{name}_SPMD"] = getter(as_list=True) if initialized else None


# ----------------------------------------------------------------------------------------------------------
# the token-shuffle group (training): size 1 only


def initialize_token_shuffle_group(token_shuffle_group_size: int = 1) -> None:
    """NxD's token-shuffle group: ranks that permute tokens among themselves to balance expert load in training.
    ``token_shuffle_group_size`` must be 1 (no shuffling; nxd_moe is an inference layer)."""
    global _TOKEN_SHUFFLE_GROUP_SIZE, _TOKEN_SHUFFLE_GROUP_SPMD
    if check_int("token_shuffle_group_size", token_shuffle_group_size, minimum=1) != 1:
        raise ValueError(f"initialize_token_shuffle_group: token_shuffle_group_size must be 1, got "
                         f"{token_shuffle_group_size} (token shuffling balances expert load in training, and "
                         "nxd_moe is an inference layer)")
    if not model_parallel_is_initialized():
        raise RuntimeError("initialize_token_shuffle_group needs initialize_model_parallel first (as in NxD)")
    _TOKEN_SHUFFLE_GROUP_SIZE = 1
    _TOKEN_SHUFFLE_GROUP_SPMD = [[r] for r in range(_ours.get_parallel_layout().world_size)]


def get_token_shuffle_group_size() -> int:
    """1 once :func:`initialize_token_shuffle_group` ran."""
    if _TOKEN_SHUFFLE_GROUP_SIZE is None:
        raise RuntimeError("the token-shuffle group is not initialized: call initialize_token_shuffle_group(1)")
    return _TOKEN_SHUFFLE_GROUP_SIZE


def destroy_token_shuffle_group() -> None:
    global _TOKEN_SHUFFLE_GROUP_SIZE, _TOKEN_SHUFFLE_GROUP_SPMD
    _TOKEN_SHUFFLE_GROUP_SIZE = _TOKEN_SHUFFLE_GROUP_SPMD = None


def rmsg(msg: str) -> str:
    """NxD's log prefix: the message with this rank's global, TP and EP ranks."""
    if not model_parallel_is_initialized():
        return msg
    return (f"[rank {dist.get_rank()} tp {get_tensor_model_parallel_rank()} "
            f"ep {get_expert_model_parallel_rank()}] {msg}")


# ----------------------------------------------------------------------------------------------------------
# modules.moe.moe_process_group


def init_tensor_expert_parallel_moe_process_groups(tkg_tp_degree: int, tkg_ep_degree: int, cte_tp_degree: int,
                                                   cte_ep_degree: int) -> None:
    """NxD's MoE-only groups: prefill (CTE) and decode (TKG) TP x EP splits of the MoE's ranks. Here they are the
    MoE groups of :mod:`nxd_moe.parallel_state` (:func:`~nxd_moe.parallel_state.set_moe_model_parallel_sizes`), so
    ``cte_tp * cte_ep`` and ``tkg_tp * tkg_ep`` must equal the layout's TP * EP; every rank calls it, as in NxD."""
    _ours.set_moe_model_parallel_sizes((cte_tp_degree, cte_ep_degree), (tkg_tp_degree, tkg_ep_degree))


def get_moe_tp_ep_group(prefill: bool = True):
    """NxD's name for the MoE *tensor*-parallel group of a phase (prefill: CTE, else TKG)."""
    return _ours.get_moe_tensor_model_parallel_group(prefill)


def get_moe_ep_group(prefill: bool = True):
    """The MoE expert-parallel group of a phase (prefill: CTE, else TKG)."""
    return _ours.get_moe_expert_model_parallel_group(prefill)


def destroy_moe_model_parallel() -> None:
    """Nothing to do: the MoE groups belong to the layout, and :func:`destroy_model_parallel` destroys them with
    it (NxD forgets its separate MoE groups here)."""


# ----------------------------------------------------------------------------------------------------------
# process groups NxD code hands to modules


def check_group(owner: str, name: str, group, kind: str) -> None:
    """A process group NxD code passes to a module must be the :mod:`nxd_moe.parallel_state` group of that role
    (``kind``, a :class:`~nxd_moe.parallel_state.ParallelLayout` field): nxd_moe modules take their groups from
    there, so another group would silently not be used."""
    if group is None:
        return
    if not model_parallel_is_initialized():
        raise RuntimeError(f"{owner}: {name} was given, but nxd_moe.parallel_state is not initialized; nxd_moe "
                           "modules take their groups from parallel_state.initialize_model_parallel")
    expected = _ours.get_parallel_layout().group_of(kind, dist.get_rank())
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks != expected:
        raise ValueError(f"{owner}: {name} holds ranks {list(ranks)}, but this rank's {kind[:-1].replace('_', ' ')} "
                         f"is {list(expected)}; nxd_moe runs the layer over parallel_state's groups (pass None, or "
                         "initialize_model_parallel with the layout you want)")
