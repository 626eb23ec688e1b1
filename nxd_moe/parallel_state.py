"""NxD's ``parallel_state`` on ``torch.distributed``: the process groups an MoE layer runs over.

Layout (NxD's, without pipeline or context parallelism): ranks are numbered ``((dp_exp * EP) + ep) * TP + tp``,

- tensor-parallel (TP) groups are blocks of ``TP`` consecutive ranks;
- expert-parallel (EP) groups take one rank per TP group, stride ``TP`` (a rank keeps its TP coordinate when it
  moves between the dense and the expert region);
- expert-data-parallel groups stride ``TP * EP``; the data-parallel group of the dense layers is everything that
  shares a TP coordinate (``DP = EP * DP_exp``);
- an *MoE model-parallel* group is one block of ``TP * EP`` consecutive ranks: together they hold one copy of
  every expert, and the MoE exchanges its tokens inside it.

Hybrid sharding: the MoE may split its ``TP * EP`` ranks differently for prefill and for decode
(``moe_prefill_*`` / ``moe_decode_*`` sizes, default the global TP and EP). Each phase gets its own MoE TP groups
(consecutive ranks) and EP groups (stride MoE-TP) inside the MoE model-parallel block, as NxD's
``moe_process_group`` builds them.

Every rank must call :func:`initialize_model_parallel` with the same arguments. The arguments are compared
across ranks first (an all-gather with a timeout), so a rank that disagrees makes every rank fail with the
same message instead of hanging in a later collective.

SPMD: :func:`initialize_spmd_model_parallel` sets up the same layout for ONE program that every rank runs (what
``neuronx-cc`` compiles for Trainium): no ``torch.distributed``; each group is a :class:`ReplicaGroups` (the
layout's rank lists, which the collectives pass to XLA as replica groups), and a module's rank is a tensor
(:class:`SPMDRank`, NxD's name) that the program takes as an input.
"""

from __future__ import annotations

import datetime
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from nxd_moe.checks import check_float, check_int
from nxd_moe.moe_configs import placed_distribution
from nxd_moe.rank_layout import ParallelLayout, model_parallel_layout

DEFAULT_TIMEOUT_S = 60.0

# Ranks built with different settings do not fail where the difference is: they exchange tensors of different
# shapes, or wait in collectives the others never enter. Comparing the settings first turns that into one clear
# error on every rank.
def check_same_on_all_ranks(values: Mapping[str, Any], what: str, group, timeout_s: float) -> None:
    """All-gather ``values`` over ``group`` (a gloo group whose timeout is ``timeout_s``) and raise on every rank
    if any key differs: ``ValueError`` listing the differing keys with each rank's value. A rank that does not
    arrive in time makes the others raise ``RuntimeError``."""
    size = dist.get_world_size(group)
    gathered: list[Any] = [None] * size
    try:
        dist.all_gather_object(gathered, dict(values), group=group)
    except RuntimeError as e:
        raise not_every_rank_arrived(what, timeout_s, e) from e
    keys = sorted({k for g in gathered for k in g})
    differing = [k for k in keys if len({repr(g.get(k)) for g in gathered}) > 1]
    if differing:
        lines = [f"{k}: " + ", ".join(f"rank {r}={g.get(k)!r}" for r, g in enumerate(gathered)) for k in differing]
        raise ValueError(f"{what} differ across ranks; every rank must use the same values:\n  " + "\n  ".join(lines))


def not_every_rank_arrived(what: str, timeout_s: float, error: Exception) -> RuntimeError:
    """The error for a collective that timed out because some rank never joined it."""
    return RuntimeError(f"{what}: not every rank arrived within {timeout_s:g} s (a rank failed before this point, "
                        f"was started with another world size, or runs different code); original error: {error}")


# ----------------------------------------------------------------------------------------------------------
# process groups


@dataclass(frozen=True)
class ReplicaGroups:
    """One kind of group in an SPMD program: ``groups`` lists every group's global ranks (XLA's
    ``replica_groups``: each rank takes part with the group that holds it), ``kind`` is its
    :class:`ParallelLayout` field. Collectives over it are XLA ops (:mod:`nxd_moe.parallel.collectives`)."""

    kind: str
    groups: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.groups[0])

    def as_lists(self) -> list[list[int]]:
        return [list(g) for g in self.groups]


class SPMDRank(nn.Module):
    """NxD's ``SPMDRank``: this rank's global id as a tensor, so that one traced program serves every rank.

    ``rank`` is a ``(1,)`` int32 parameter (no gradient) holding the global rank; a program traced with it takes
    it as an input, like the weights, and every rank-dependent value (which experts are mine, which rows I
    dispatch, my slice of the intermediate dimension) is computed from it on the device. Modules built under
    :func:`initialize_spmd_model_parallel` hold one, set to the rank whose shard they hold (NxD loads
    ``arange(world_size)`` split one element per rank, which is the same). ``get_rank()`` is NxD's accessor;
    :meth:`index_in_group` reads this rank's index in a group kind from ``layout`` (default: the current
    :func:`get_parallel_layout`), on the device.
    """

    def __init__(self, world_size: int, tensor_model_parallel_size: int | None = None, rank: int | None = None,
                 layout: ParallelLayout | None = None):
        super().__init__()
        self.layout = layout
        self.world_size = check_int("world_size", world_size, minimum=1)
        if tensor_model_parallel_size is None:  # NxD's default: the initialised layout's (1 without one)
            tensor_model_parallel_size = get_tensor_model_parallel_size() if model_parallel_is_initialized() else 1
        self.tensor_model_parallel_size = check_int("tensor_model_parallel_size", tensor_model_parallel_size,
                                                    minimum=1, maximum=world_size)
        if rank is None:  # outside an SPMD build: this process's rank, as NxD's checkpoint entry would set it
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        check_int("rank", rank, minimum=0, maximum=world_size - 1)
        self.rank = nn.Parameter(torch.full((1,), rank, dtype=torch.int32), requires_grad=False)
        self.built_rank = rank  # what reset_rank() restores
        self._tables: dict[tuple[str, str], torch.Tensor] = {}

    def get_rank(self) -> torch.Tensor:
        return self.rank

    def reset_rank(self) -> None:
        """Set the rank tensor back to the rank this module was built for: a layer built on the meta device and
        materialised with ``to_empty`` holds uninitialised memory there, and no checkpoint carries the rank."""
        with torch.no_grad():
            self.rank.fill_(self.built_rank)

    def index_in_group(self, kind: str) -> torch.Tensor:
        """0-d int64: this rank's index in its group of kind ``kind`` (a :class:`ParallelLayout` field), read from
        the layout's table at ``rank`` (the table is the same for every rank)."""
        key = (kind, str(self.rank.device))
        if key not in self._tables:
            layout = self.layout or get_parallel_layout()
            if layout.world_size != self.world_size:
                raise ValueError(f"SPMDRank: world_size {self.world_size} differs from the layout's "
                                 f"{layout.world_size}")
            table = torch.tensor(layout.index_in_groups(kind), dtype=torch.int64)
            self._tables[key] = table.to(self.rank.device)
        return self._tables[key].index_select(0, self.rank.long()).squeeze(0)

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}, tensor_model_parallel_size={self.tensor_model_parallel_size}"


@dataclass
class _State:
    layout: ParallelLayout
    rank: int
    check_group: Any  # None in an SPMD program: one process builds it, there is nothing to compare
    timeout_s: float
    groups: dict[str, Any] = field(default_factory=dict)  # kind -> this rank's ProcessGroup (SPMD: ReplicaGroups)
    created: list[Any] = field(default_factory=list)

    @property
    def spmd(self) -> bool:
        return self.check_group is None


_STATE: _State | None = None

_GROUP_KINDS = ("tensor_model_parallel_groups", "data_parallel_groups", "expert_model_parallel_groups",
                "expert_data_parallel_groups", "moe_model_parallel_groups", "moe_prefill_tensor_groups",
                "moe_prefill_expert_groups", "moe_decode_tensor_groups", "moe_decode_expert_groups")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    *,
    moe_prefill_tensor_model_parallel_size: int | None = None,
    moe_prefill_expert_model_parallel_size: int | None = None,
    moe_decode_tensor_model_parallel_size: int | None = None,
    moe_decode_expert_model_parallel_size: int | None = None,
    num_experts: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> None:
    """Create the groups of :func:`model_parallel_layout` on the initialised default process group.

    Before anything else, the arguments are all-gathered over a gloo group with a ``timeout_s`` deadline: if
    the ranks disagree, every rank raises ``ValueError`` listing each rank's values; if a rank does not arrive
    in time, the others raise ``RuntimeError``. Bad sizes then raise the same ``ValueError`` on every rank. The
    same ``timeout_s`` bounds every later agreement check (configurations, input shapes).

    ``collective_timeout_s``: how long the MoE's collectives wait for a rank that died or never came (NCCL's
    watchdog aborts the communicator, gloo raises); None keeps the backend's default (10 min for NCCL, 30 min for
    gloo). Leave room for the first call's kernel compilation on the slowest rank.
    """
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed: call "
                           "torch.distributed.init_process_group first (torchrun sets its environment)")
    if _STATE is not None:
        raise RuntimeError("model parallel is already initialized; call destroy_model_parallel first")
    arguments = dict(
        tensor_model_parallel_size=tensor_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        moe_prefill_tensor_model_parallel_size=moe_prefill_tensor_model_parallel_size,
        moe_prefill_expert_model_parallel_size=moe_prefill_expert_model_parallel_size,
        moe_decode_tensor_model_parallel_size=moe_decode_tensor_model_parallel_size,
        moe_decode_expert_model_parallel_size=moe_decode_expert_model_parallel_size,
        num_experts=num_experts,
    )
    timeout_s = check_float("timeout_s", timeout_s, positive=True)
    group_timeout = None
    if collective_timeout_s is not None:
        group_timeout = datetime.timedelta(seconds=check_float("collective_timeout_s", collective_timeout_s,
                                                               positive=True))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    try:
        check_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise not_every_rank_arrived("initialize_model_parallel", timeout_s, e) from e
    try:
        check_same_on_all_ranks({"world_size": world_size, **arguments}, "initialize_model_parallel arguments",
                                check_group, timeout_s)
        layout = model_parallel_layout(world_size, **arguments)
    except BaseException:
        dist.destroy_process_group(check_group)
        raise
    state = _State(layout=layout, rank=rank, check_group=check_group, timeout_s=timeout_s)
    state.created.append(check_group)
    for kind in _GROUP_KINDS:
        for ranks in getattr(layout, kind):
            # Every rank creates every group, in the same order (torch.distributed's rule for new_group).
            group = dist.new_group(list(ranks), timeout=group_timeout)
            state.created.append(group)
            if rank in ranks:
                state.groups[kind] = group
    _STATE = state


# The arguments of model_parallel_layout (NxD's initialize_model_parallel's sizes) and the rank being built: the
# same layout as initialize_model_parallel, so the same parameter list.
def initialize_spmd_model_parallel(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    *,
    rank: int = 0,
    moe_prefill_tensor_model_parallel_size: int | None = None,
    moe_prefill_expert_model_parallel_size: int | None = None,
    moe_decode_tensor_model_parallel_size: int | None = None,
    moe_decode_expert_model_parallel_size: int | None = None,
    num_experts: int | None = None,
) -> None:
    """The layout of :func:`model_parallel_layout` for one SPMD program (no ``torch.distributed``): the groups are
    :class:`ReplicaGroups`, whose collectives are XLA ops, and sharded modules built now hold ``rank``'s shard
    of the weights and an :class:`SPMDRank` set to ``rank``. The program traced from them computes every
    rank-dependent value from that tensor, so it serves every rank, each with its own shard and rank as inputs
    (``nxd_moe.trace_spmd`` builds, traces and checks it). Bad sizes raise ``ValueError`` naming the argument."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("model parallel is already initialized; call destroy_model_parallel first")
    layout = model_parallel_layout(
        world_size, tensor_model_parallel_size, expert_model_parallel_size,
        moe_prefill_tensor_model_parallel_size=moe_prefill_tensor_model_parallel_size,
        moe_prefill_expert_model_parallel_size=moe_prefill_expert_model_parallel_size,
        moe_decode_tensor_model_parallel_size=moe_decode_tensor_model_parallel_size,
        moe_decode_expert_model_parallel_size=moe_decode_expert_model_parallel_size, num_experts=num_experts)
    check_int("rank", rank, minimum=0, maximum=world_size - 1)
    groups = {kind: ReplicaGroups(kind, getattr(layout, kind)) for kind in _GROUP_KINDS}
    _STATE = _State(layout=layout, rank=rank, check_group=None, timeout_s=DEFAULT_TIMEOUT_S, groups=groups)


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def set_moe_model_parallel_sizes(prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    """Split the MoE's ranks as ``(tensor, expert)`` parallel sizes ``prefill`` and ``decode`` (hybrid sharding)
    after :func:`initialize_model_parallel`: the groups are re-created with the same global sizes and timeout.
    Every rank calls it, with the same values; layers built before keep the groups they were built with, so call
    it first. Nothing happens when the sizes are already these (NxD's MoE process groups are created this way)."""
    state = _state()
    layout = state.layout
    if (layout.moe_prefill, layout.moe_decode) == (tuple(prefill), tuple(decode)):
        return
    sizes = dict(moe_prefill_tensor_model_parallel_size=prefill[0], moe_prefill_expert_model_parallel_size=prefill[1],
                 moe_decode_tensor_model_parallel_size=decode[0], moe_decode_expert_model_parallel_size=decode[1])
    # Bad sizes raise here, before the current groups are destroyed.
    model_parallel_layout(layout.world_size, layout.tensor_model_parallel_size, layout.expert_model_parallel_size,
                          **sizes)
    destroy_model_parallel()
    initialize_model_parallel(layout.tensor_model_parallel_size, layout.expert_model_parallel_size, **sizes,
                              timeout_s=state.timeout_s)


def is_spmd() -> bool:
    """Whether the layout is an SPMD program's (:func:`initialize_spmd_model_parallel`)."""
    return _STATE is not None and _STATE.spmd


def spmd_rank() -> SPMDRank | None:
    """A new :class:`SPMDRank` set to the rank whose shard is being built, in an SPMD layout; None otherwise."""
    if not is_spmd():
        return None
    layout = _STATE.layout
    return SPMDRank(layout.world_size, layout.tensor_model_parallel_size, _STATE.rank, layout)


def destroy_model_parallel() -> None:
    """Destroy the groups :func:`initialize_model_parallel` created (the default group stays).

    Release first every CUDA graph that captured these groups' collectives -- ``torch.compile``'s
    ``mode="reduce-overhead"`` keeps its graphs in global CUDA-graph trees (``torch._dynamo.reset()`` and
    ``torch._inductor.cudagraph_trees.reset_cudagraph_trees()`` free them): destroying a NCCL group whose kernels a
    live graph holds hung on two H100s."""
    global _STATE
    if _STATE is None:
        return
    for group in _STATE.created:  # none in an SPMD layout
        dist.destroy_process_group(group)
    _STATE = None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("model parallel is not initialized: call nxd_moe.parallel_state.initialize_model_parallel")
    return _STATE


def get_parallel_layout() -> ParallelLayout:
    return _state().layout


def _group(kind: str) -> dist.ProcessGroup:
    return _state().groups[kind]


def _ranks(kind: str) -> tuple[int, ...]:
    state = _state()
    return state.layout.group_of(kind, state.rank)


def _size(kind: str) -> int:
    return len(_ranks(kind))


def _rank_in(kind: str) -> int:
    return _ranks(kind).index(_state().rank)


def check_configuration(values: dict[str, Any], what: str) -> None:
    """Raise on every rank if the ranks' ``values`` differ (see :func:`initialize_model_parallel`); modules call
    this once at construction so that ranks built differently fail there, not in a later collective."""
    state = _state()
    if state.spmd:  # one process builds the program for every rank from the same arguments
        return
    check_same_on_all_ranks(values, what, state.check_group, state.timeout_s)


def fingerprint(values: Mapping[str, Any]) -> int:
    """A 62-bit digest of ``values`` (by ``repr``) that every process computes alike (``hash()`` of a ``str`` is
    salted per process); 62 bits so that it and its negation fit an int64."""
    digest = hashlib.blake2b(repr(sorted(values.items())).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class PendingAgreement:
    """One call's check that every rank passes the same ``values`` (:func:`start_agreement`); :meth:`wait` before the
    first collective whose shapes depend on them."""

    def __init__(self, values: Mapping[str, Any], what: str, state: _State, digest: int | None = None):
        self.values, self.what, self.state = values, what, state
        if digest is None:
            digest = fingerprint(values)
        # max(d) and max(-d) over the ranks: equal fingerprints iff max(d) == -max(-d). The tensor views this host
        # array, so the result is read from the array: no tensor read, nothing to synchronise with a device.
        self.extremes = array("q", [digest, -digest])
        self.work = dist.all_reduce(torch.frombuffer(self.extremes, dtype=torch.int64), op=dist.ReduceOp.MAX,
                                    group=state.check_group, async_op=True)

    def wait(self) -> None:
        """Return if every rank passed the same values; otherwise raise on every rank (all see the same reduced
        fingerprints, so all take the same branch): ``ValueError`` naming each rank's differing values, or
        ``RuntimeError`` if a rank did not arrive within ``timeout_s``."""
        try:
            self.work.wait()
        except RuntimeError as e:
            raise not_every_rank_arrived(self.what, self.state.timeout_s, e) from e
        if self.extremes[0] != -self.extremes[1]:
            check_same_on_all_ranks(self.values, self.what, self.state.check_group, self.state.timeout_s)


# Agreeing once per new shape is not enough: a rank only learns that another rank's shape changed by exchanging
# something, and ranks that skip the check enter the data collectives while the changed rank waits in the check (on
# NCCL the others then die on an aborted communicator, and nobody names the cause). The data collectives cannot carry
# the fingerprint: their sizes follow the shapes (mismatched, they hang or abort before anything can be compared),
# and on a GPU reading a compared value would be a device sync. So every call exchanges a fingerprint of the shapes
# on the host: one tiny gloo all-reduce -- no device sync, nothing a CUDA graph records -- started before the local
# routing so that its latency overlaps it; only a mismatch pays for the full comparison. Its price is one host round
# trip between the ranks per eager call (gloo, world 2, a shared 2-core CPU: +0.3-1.1 ms on a 3.3-4.3 ms step of a
# small EP2 layer, mostly thread scheduling on an oversubscribed CPU); a step that must not pay it is captured in a
# CUDA graph, whose replays run no Python.
def start_agreement(values: Mapping[str, Any], what: str, digest: int | None = None) -> PendingAgreement | None:
    """Start checking that every rank of the world passes the same ``values`` (texts; see
    :func:`nxd_moe.config.config_fingerprint`) in this call: an all-reduce of their fingerprint over the gloo check
    group. Every rank must call it at the same point of the same call. None in a world of one rank, and in an SPMD
    program (one traced program for every rank: its shapes are the same on every rank by construction).
    ``digest``: ``fingerprint(values)`` if the caller keeps it (a steady step then hashes nothing)."""
    state = _state()
    if state.layout.world_size == 1 or state.spmd:
        return None
    return PendingAgreement(values, what, state, digest)


def get_world_group():
    state = _STATE
    if state is not None and state.spmd:
        return ReplicaGroups("world", (tuple(range(state.layout.world_size)),))
    return dist.group.WORLD


def _phase(prefill: bool) -> str:
    if not isinstance(prefill, bool):
        raise TypeError(f"prefill must be a bool, got {type(prefill).__name__} {prefill!r}")
    return "prefill" if prefill else "decode"


def _getter(read: Callable[[str], Any], kind: str) -> Callable[..., Any]:
    """``read(kind)`` as a function; a ``kind`` with a ``{phase}`` field makes it take ``prefill: bool = True``."""
    if "{phase}" not in kind:
        def getter():
            return read(kind)
    else:
        def getter(prefill: bool = True):
            return read(kind.format(phase=_phase(prefill)))
    getter.__annotations__["return"] = read.__annotations__["return"]
    return getter


def _getters(name: str, what: str, kind: str) -> tuple[Callable[..., Any], Callable[..., int], Callable[..., int]]:
    """NxD's ``get_{name}_group``, ``get_{name}_size`` and ``get_{name}_rank`` of the groups ``kind`` (a
    :class:`ParallelLayout` field, see :func:`_getter` for ``{phase}``); ``what`` names the group in docstrings."""
    made = []
    for suffix, read, doc in (("group", _group, f"This rank's {what}."),
                              ("size", _size, f"The number of ranks in this rank's {what}."),
                              ("rank", _rank_in, f"This rank's index in its {what}.")):
        getter = _getter(read, kind)
        getter.__name__ = getter.__qualname__ = f"get_{name}_{suffix}"
        getter.__doc__ = doc
        made.append(getter)
    return tuple(made)


get_tensor_model_parallel_group, get_tensor_model_parallel_size, get_tensor_model_parallel_rank = _getters(
    "tensor_model_parallel", "tensor-parallel group (``TP`` consecutive ranks)", "tensor_model_parallel_groups")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 of this rank's TP group."""
    return _ranks("tensor_model_parallel_groups")[0]


get_data_parallel_group, get_data_parallel_size, get_data_parallel_rank = _getters(
    "data_parallel", "data-parallel group of the dense layers (the ranks that share its TP coordinate)",
    "data_parallel_groups")
get_expert_model_parallel_group, get_expert_model_parallel_size, get_expert_model_parallel_rank = _getters(
    "expert_model_parallel", "expert-parallel group (one rank per TP group, stride ``TP``)",
    "expert_model_parallel_groups")
get_expert_data_parallel_group, get_expert_data_parallel_size, get_expert_data_parallel_rank = _getters(
    "expert_data_parallel", "expert-data-parallel group (stride ``TP * EP``)", "expert_data_parallel_groups")
get_moe_model_parallel_group, get_moe_model_parallel_size, get_moe_model_parallel_rank = _getters(
    "moe_model_parallel", "MoE model-parallel group (the ``TP * EP`` ranks that together hold every expert once; "
    "MoE tokens are exchanged inside it)", "moe_model_parallel_groups")
# Hybrid sharding: the MoE TP / EP groups differ between the phases.
get_moe_tensor_model_parallel_group, get_moe_tensor_model_parallel_size, get_moe_tensor_model_parallel_rank = \
    _getters("moe_tensor_model_parallel", "MoE tensor-parallel group of the phase (``prefill=True``: prefill's, "
             "else decode's)", "moe_{phase}_tensor_groups")
get_moe_expert_model_parallel_group, get_moe_expert_model_parallel_size, get_moe_expert_model_parallel_rank = \
    _getters("moe_expert_model_parallel", "MoE expert-parallel group of the phase (``prefill=True``: prefill's, "
             "else decode's)", "moe_{phase}_expert_groups")


def expert_distribution_for(expert_parallel_config, prefill: bool):
    """The expert distribution a phase uses under the current layout (``ExpertParallelConfig.distribution_for``)."""
    layout = get_parallel_layout()
    return expert_parallel_config.distribution_for(prefill, layout.moe_prefill[1], layout.moe_decode[1])


def get_experts_for_expert_parallel_rank(
    ep_rank: int,
    num_experts: int,
    expert_parallel_size: int,
    expert_distribution: Sequence[Sequence[int]] | None = None,
) -> tuple[int, ...]:
    """The experts EP rank ``ep_rank`` holds: ``expert_distribution[ep_rank]`` if given, else the contiguous
    block ``[ep_rank * E / EP, (ep_rank + 1) * E / EP)``."""
    check_int("expert_parallel_size", expert_parallel_size, minimum=1)
    check_int("ep_rank", ep_rank, minimum=0, maximum=expert_parallel_size - 1)
    return placed_distribution(num_experts, expert_parallel_size, expert_distribution)[ep_rank]
