"""``nki.collectives``: NKI's collective communication between ranks (NeuronCores of several devices, or several
logical cores). This simulator runs one logical NeuronCore (LNC1, or the two cores of LNC2, which exchange data
with ``nisa.sendrecv`` / ``nisa.core_barrier``), so it is one rank: ``rank_id()`` is 0 and a ``ReplicaGroup`` can
be built, but every communication routine raises :class:`CollectivesNotSimulatedError` naming itself -- a kernel
that communicates fails clearly instead of computing as if it were alone.
"""

from __future__ import annotations

from nxd_moe.nki_kernels import language as nl


class CollectivesNotSimulatedError(NotImplementedError):
    """A collective between ranks: not part of the one-logical-core simulator."""


class ReplicaGroup(nl.NKIObject):
    """The ranks taking part in a collective: ``ReplicaGroup([[0, 1], [2, 3]])`` (sub-groups must not overlap)."""

    def __init__(self, groups=None, **kwargs):
        groups = [list(g) for g in (groups or [])]
        ranks = [r for g in groups for r in g]
        if len(ranks) != len(set(ranks)):
            raise ValueError(f"ReplicaGroup: sub-groups overlap: {groups}")
        super().__init__(groups=groups, **kwargs)


def rank_id(name: str | None = None) -> int:
    """This rank's id: 0 (the simulator is one rank)."""
    return 0


def _not_simulated(name: str):
    def unavailable(*args, **kwargs):
        raise CollectivesNotSimulatedError(
            f"nki.collectives.{name}: collectives between ranks are not simulated (one logical NeuronCore: LNC1, or "
            "LNC2's two cores with nisa.sendrecv / nisa.core_barrier)")

    unavailable.__name__ = unavailable.__qualname__ = name
    unavailable.__doc__ = f"NKI's ``{name}``: raises :class:`CollectivesNotSimulatedError`."
    return unavailable


all_reduce = _not_simulated("all_reduce")
all_gather = _not_simulated("all_gather")
all_gather_v = _not_simulated("all_gather_v")
reduce_scatter = _not_simulated("reduce_scatter")
all_to_all = _not_simulated("all_to_all")
all_to_all_v = _not_simulated("all_to_all_v")
collective_permute = _not_simulated("collective_permute")
collective_permute_implicit = _not_simulated("collective_permute_implicit")
collective_permute_implicit_reduce = _not_simulated("collective_permute_implicit_reduce")
collective_permute_implicit_current_processing_rank_id = _not_simulated(
    "collective_permute_implicit_current_processing_rank_id")
