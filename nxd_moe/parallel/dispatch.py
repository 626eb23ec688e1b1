"""The contract every token dispatcher implements, one device's included (:mod:`~nxd_moe.parallel.dispatches`
picks one by name).

A routed forward is one pipeline (:meth:`~nxd_moe.expert_mlps_v2.ExpertMLPsV2.routed_forward`): prepare (checks,
padding, routing, mode) -> **dispatch** -> expert compute -> **combine** -> finalize. A dispatcher owns the two
steps in bold, as DeepEP's buffer does: ``dispatch(inputs)`` takes this rank's tokens with their routing (a
:class:`DispatchInputs`; as pairs: ``pair_expert (T_r, k)``, global expert ids, ``-1`` for pairs that do not count
-- padded tokens -- and ``pair_weight (T_r, k)``) and returns the rows this rank computes
(:class:`Dispatched`: ``rows (N, H)``, ``pair_expert (N, k)`` keeping only the pairs of this rank's experts, ``-1``
elsewhere, ``pair_weight (N, k)``) with a ``handle``; ``combine(partial, handle)`` takes this rank's ``(N, H)``
partial output (its experts, its slice of the intermediate dimension) and returns the complete routed output of
this rank's tokens (:class:`DispatchResult`). Nothing calls back into the caller.

- ``local`` (:data:`LOCAL`): one device; nothing moves, and the router's routing of the tokens goes to the experts
  as it is (:attr:`Dispatched.routing`).
- ``all_gather`` (NxD's way): every rank gathers all tokens of the block, masks to its local experts, and the
  partial outputs are reduce-scattered back. Static shapes.
- ``all_to_all_v``: each token goes only to the ranks holding one of its experts, and the results come back;
  static per-destination buffers (no host sync, the default) or exact counts exchanged first (a host sync).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.parallel.collectives import CommLedger
from nxd_moe.parallel.layout import ExpertShard, MoEGroups
from nxd_moe.parallel.token_layout import TokenLayout


class DispatchInputs(NamedTuple):
    """What every dispatch takes: this rank's tokens ``hidden (T_r, H)`` and the router's ``routing`` of them, where
    they sit in the block (``layout``), the groups they move through, this rank's share of the experts for the phase
    (``shard``), the per-expert ``capacity`` of the block's tokens (capacity-factor mode) or None, the ``ledger``
    that counts the bytes moved, how an all-to-all sizes its buffers (``ExpertParallelConfig.all_to_all_splits``),
    and whether the block's pairs per expert are wanted (statistics: without replicas or a capacity they cost an
    extra collective in an all-to-all), and how a static all-to-all moves its rows
    (``ExpertParallelConfig.transport``). One device needs only ``hidden`` and ``routing``."""

    hidden: torch.Tensor
    routing: Routing
    layout: TokenLayout | None = None
    groups: MoEGroups | None = None
    shard: ExpertShard | None = None
    capacity: int | None = None
    ledger: CommLedger | None = None
    all_to_all_splits: str = "static"
    count_pairs: bool = True
    transport: str = "nccl"

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``pair_expert (T_r, k)`` (``-1`` for the pairs of padded tokens: they go nowhere) and ``pair_weight
        (T_r, k)``: the routing as the pairs a dispatcher moves."""
        routing = self.routing
        pair_expert = routing.expert_index
        if routing.has_padding:
            pair_expert = torch.where(routing.pair_valid(), pair_expert, -1)
        return pair_expert, routing.affinities.gather(1, routing.expert_index)


class Dispatched(NamedTuple):
    """The rows this rank computes: ``rows (N, H)``, ``pair_expert (N, k)`` (global ids of the pairs computed here,
    ``-1`` elsewhere), ``pair_weight (N, k)``, the dispatcher's ``handle`` for :meth:`TokenDispatcher.combine`, and
    ``routing``: when nothing moved (the rows are the tokens, in order), the router's routing of them instead of
    pairs -- the experts then compute from it directly and may add an addend in their last pass; else None (the
    backend builds the routing of the received pairs)."""

    rows: torch.Tensor
    pair_expert: torch.Tensor | None
    pair_weight: torch.Tensor | None
    handle: Any
    routing: Routing | None = None


class DispatchResult(NamedTuple):
    """``output (T_r, H)`` for this rank's tokens; ``pairs_per_expert (E,)`` valid pairs of each expert in the whole
    block (before any capacity drop; None unless ``count_pairs``, replicas or a capacity needed them -- and on one
    device, where the experts' own routing counts them)."""

    output: torch.Tensor
    pairs_per_expert: torch.Tensor | None


class TokenDispatcher(Protocol):
    """See the module docstring."""

    def dispatch(self, inputs: DispatchInputs) -> Dispatched: ...

    def combine(self, partial: torch.Tensor, handle: Any) -> DispatchResult: ...


class LocalDispatcher:
    """One device: the rows are the tokens, every pair is computed here, and the partial output is the output
    (torchtitan's local token dispatcher, vLLM's prepare-and-finalize without expert parallelism)."""

    def dispatch(self, inputs: DispatchInputs) -> Dispatched:
        return Dispatched(inputs.hidden, None, None, None, inputs.routing)

    def combine(self, partial: torch.Tensor, handle: Any) -> DispatchResult:
        return DispatchResult(partial, None)


LOCAL = LocalDispatcher()


class PendingCheck(Protocol):
    def wait(self) -> None: ...


class Route(NamedTuple):
    """Where one forward's tokens go, for :meth:`~nxd_moe.expert_mlps_v2.ExpertMLPsV2.routed_forward`: the
    ``dispatcher`` and what it needs -- where this rank's tokens sit in the block (``layout``; its ``num_tokens``
    choose the block's mode and capacity, as one device would), the ``groups``, this rank's ``shard`` of the
    phase, the ``ledger``, ``all_to_all_splits`` -- the dispatch's ``name`` for the statistics, in an SPMD program
    the held experts' ``local_slot (E,)`` and ``intermediate_part`` (0-d) computed from the rank tensor, and a
    started check of the ranks' inputs to wait for before anything is exchanged (``agreement``), and how many
    micro-batches the dispatch is split into (``micro_batches``; more than 1 only for a dispatcher with
    ``micro_batches(inputs, count)``: :class:`~nxd_moe.parallel.all_to_all.StaticMicroBatches`) and the static
    all-to-all's ``transport``. :data:`ONE_DEVICE` is one device's."""

    dispatcher: TokenDispatcher
    layout: TokenLayout | None = None
    groups: MoEGroups | None = None
    shard: ExpertShard | None = None
    ledger: CommLedger | None = None
    all_to_all_splits: str = "static"
    name: str | None = None
    local_slot: torch.Tensor | None = None
    intermediate_part: torch.Tensor | None = None
    agreement: PendingCheck | None = None
    micro_batches: int = 1
    transport: str = "nccl"


ONE_DEVICE = Route(LOCAL)
