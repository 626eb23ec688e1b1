"""Routed experts across the ranks of an MoE block: dispatch this rank's tokens, compute the local pairs, combine.

:class:`ExpertParallel` runs a sharded :class:`~nxd_moe.expert_mlps_v2.ExpertMLPsV2` -- which holds its rank's
weights -- over the MoE model-parallel block, through the same routed pipeline as one device
(:meth:`~nxd_moe.expert_mlps_v2.ExpertMLPsV2.routed_forward`) with a :class:`~nxd_moe.parallel.dispatch.Route` of
this rank: the router's top-k travel with the tokens (never the ``(T, E)`` affinities), a dispatcher
(:mod:`~nxd_moe.parallel.all_gather` or :mod:`~nxd_moe.parallel.all_to_all`) brings each rank the pairs its
experts compute, and its combine sums the partial outputs back onto the ranks that own the tokens.

Everything is static: sizes come from the token shape and the group sizes, never from the routing (unless an
``exact`` all-to-all is asked for), so a CUDA graph captures the whole step and replays it with new routings.
Ranks agree on the inputs' shapes and dtypes on every call, before any collective: a fingerprint exchanged on the
host (a named error on every rank otherwise, whichever rank changed; no device sync, nothing in a CUDA graph).

In an SPMD layout the experts hold an :class:`~nxd_moe.parallel_state.SPMDRank`, and every rank-dependent value --
this rank's place in the groups, its experts' local slots, its slice of the intermediate dimension, the rows it
dispatches -- is computed from that tensor: the traced program is the same for every rank.
"""

from __future__ import annotations

import torch

from nxd_moe import parallel_state
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.fingerprint import config_fingerprint
from nxd_moe.parallel.collectives import CommLedger
from nxd_moe.parallel.dispatch import Route
from nxd_moe.parallel.dispatches import get_dispatcher
from nxd_moe.parallel.layout import ExpertShard, ExpertsParallelism, MoEGroups, held_weight_shard
from nxd_moe.parallel.overlap import micro_batch_count
from nxd_moe.parallel.token_layout import TokenLayout

_MODE_VALUES = frozenset(m.value for m in ExpertsMode)


class ExpertParallel:
    """Runs ``experts`` (an :class:`~nxd_moe.expert_mlps_v2.ExpertMLPsV2` built while :mod:`nxd_moe.parallel_state` was
    initialised, so holding this rank's shard) over the MoE block.

    ``__call__(hidden_states (T_r, H), expert_affinities (T_r, E), expert_index (T_r, k), seq_len=None,
    padding_mask=None, *, mode=None, return_stats=False, token_layout=None, addend=None)`` takes this rank's tokens
    (see :class:`~nxd_moe.parallel.token_layout.TokenLayout`; without ``token_layout`` the ranks of a TP group
    share ``(T_r, H)``) and returns their complete routed output (``+ addend``), like ``ExpertMLPsV2.forward`` on
    one device. The mode and the capacity are the whole block's, as one device would choose them.
    ``check_index=False`` skips the expert-index range check (for callers whose ids are in range by construction,
    like ``MoE``'s router).
    """

    def __init__(self, experts):
        if not getattr(experts, "is_sharded", False) or not hasattr(experts, "routed_forward"):
            raise ValueError("ExpertParallel needs an ExpertMLPsV2 that holds a shard (built while "
                             "nxd_moe.parallel_state was initialised, model_parallel not False)")
        cfg = experts.routed_experts_mlp_config
        spmd = parallel_state.is_spmd()
        if spmd != (experts.spmd_rank is not None):
            raise RuntimeError("ExpertParallel: the experts were built for " + ("an SPMD program" if not spmd else
                               "torch.distributed") + ", not for the layout nxd_moe.parallel_state holds now; "
                               "build them again")
        if spmd and experts.expert_parallel_config.all_to_all_splits == "exact":
            raise ValueError("ExpertParallelConfig.all_to_all_splits='exact' reads the split sizes on the host, "
                             "which an SPMD program cannot do; use all_to_all_splits='static'")
        shards = {}
        for prefill in (True, False):
            expected = held_weight_shard(prefill, cfg.num_experts, experts.expert_parallel_config)
            held = experts.weight_shard(decode=not prefill)
            # SPMD: the program serves every rank, so compare what every rank shares (how many experts, which split).
            if ((len(expected.experts), expected.intermediate_parts) != (len(held.experts), held.intermediate_parts)
                    if spmd else expected != held):
                raise RuntimeError("ExpertParallel: the experts were built under another parallel layout than the "
                                   "one nxd_moe.parallel_state holds now; build them again")
            distribution = parallel_state.expert_distribution_for(experts.expert_parallel_config, prefill)
            shards[prefill] = ExpertShard.from_parallel_state(prefill, cfg.num_experts, distribution)
        self.experts = experts
        self.parallelism = ExpertsParallelism(MoEGroups.from_parallel_state(), shards[True], shards[False])
        self._described_inputs: dict[tuple, tuple[dict[str, str], int]] = {}
        self._token_layouts: dict[tuple[int, int, bool], TokenLayout] = {}

    @property
    def groups(self) -> MoEGroups:
        return self.parallelism.groups

    def _parallelism(self) -> ExpertsParallelism:
        """This rank's groups and shards: in an SPMD layout, with the ranks computed from the experts' rank tensor."""
        rank = self.experts.spmd_rank
        return self.parallelism if rank is None else self.parallelism.at(rank)

    def token_layout(self, batch: int, local_seq_len: int, sequence_parallel: bool) -> TokenLayout:
        """The :class:`TokenLayout` of this rank's ``(batch, local_seq_len)`` tokens (made once per shape and kept,
        except in an SPMD program, where its ranks are tensors of the program being traced)."""
        if self.experts.spmd_rank is not None:
            return self._parallelism().groups.token_layout(batch, local_seq_len, sequence_parallel)
        key = (batch, local_seq_len, sequence_parallel)
        layout = self._token_layouts.get(key)
        if layout is None:
            layout = self._token_layouts[key] = self.groups.token_layout(batch, local_seq_len, sequence_parallel)
        return layout

    # ExpertMLPsV2.forward's parameters plus token_layout: the same call, over the block.
    def __call__(
        self,
        hidden_states: torch.Tensor,
        expert_affinities: torch.Tensor,
        expert_index: torch.Tensor,
        seq_len: int | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        mode: ExpertsMode | str | None = None,
        return_stats: bool = False,
        token_layout: TokenLayout | None = None,
        addend: torch.Tensor | None = None,
        check_index: bool = True,
    ):
        experts = self.experts
        experts.check_inputs(hidden_states, expert_affinities, expert_index, seq_len, padding_mask, check_index)
        experts.check_addend(addend, hidden_states)
        num_tokens = hidden_states.shape[0]
        parallelism = self._parallelism()
        spmd = experts.spmd_rank is not None
        if spmd and return_stats:
            raise ValueError("ExpertParallel: return_stats=True is not available in an SPMD program (the statistics "
                             "name this rank's experts as Python values); trace without it")
        if token_layout is None:
            token_layout = self.token_layout(1, num_tokens, sequence_parallel=False)
        if not isinstance(token_layout, TokenLayout) or token_layout.num_local_tokens != num_tokens:
            raise ValueError(f"ExpertParallel: token_layout must be a TokenLayout of {num_tokens} local tokens, got "
                             f"{token_layout!r}")
        agreement = self._start_agreement(hidden_states, token_layout, seq_len, mode, padding_mask is not None,
                                          addend, return_stats)
        shard = parallelism.shard(seq_len == 1)
        epc = experts.expert_parallel_config
        # SPMD: which global experts are held here, and the intermediate slice, come from the rank tensor.
        held = dict(local_slot=shard.local_slot(hidden_states.device),
                    intermediate_part=shard.tensor_parallel_rank) if spmd else {}
        route = Route(get_dispatcher(epc.dispatch), token_layout, parallelism.groups, shard, CommLedger(),
                      epc.all_to_all_splits, epc.dispatch, agreement=agreement,
                      micro_batches=self.micro_batch_count(hidden_states, expert_index.shape[1], token_layout),
                      transport=epc.transport, **held)
        # Inputs checked above, before the agreement starts.
        return experts.routed_forward(hidden_states, expert_affinities, expert_index, seq_len, padding_mask, route,
                                      mode=mode, return_stats=return_stats, addend=addend, check_index=check_index,
                                      checked=True)

    def micro_batch_count(self, hidden_states: torch.Tensor, top_k: int, token_layout: TokenLayout) -> int:
        """How many micro-batches a call on ``hidden_states`` (routed to ``top_k`` experts each, laid out as
        ``token_layout``) is split into: the configured number, or where a static all-to-all runs over NCCL
        outside a trace the rule's (:func:`~nxd_moe.parallel.overlap.micro_batch_count`). Every rank computes the
        same number: it depends on the agreed shapes only."""
        epc = self.experts.expert_parallel_config
        if epc.dispatch != "all_to_all_v" or epc.all_to_all_splits != "static" or epc.transport == "nvlink":
            return 1
        cfg = self.experts.routed_experts_mlp_config
        rows = token_layout.num_segments * token_layout.segment_len
        overlappable = (hidden_states.is_cuda and self.experts.spmd_rank is None
                        and not torch.compiler.is_compiling())
        op = self.experts.mlp_op  # this rank's (prefill) shard
        # A rank computes, on average over the block, its rows' k pairs at the full intermediate width:
        # M * U * k / EP pairs at I / TP each.
        return micro_batch_count(
            epc.micro_batches, rows=rows, block_size=self.groups.block_size,
            row_bytes=cfg.hidden_size * hidden_states.element_size() + top_k * (4 + 4),  # int32 ids, fp32 weights
            partial_row_bytes=cfg.hidden_size * hidden_states.element_size(),
            weight_bytes=op.first_proj.weight.nbytes + op.down_proj.weight.nbytes,
            flops=2.0 * rows * top_k * 3 * cfg.hidden_size * cfg.intermediate_size, overlappable=overlappable)

    def _start_agreement(self, hidden_states: torch.Tensor, token_layout: TokenLayout, seq_len: int | None, mode,
                         padded: bool, addend: torch.Tensor | None, return_stats: bool
                         ) -> parallel_state.PendingAgreement | None:
        """Start checking that every rank of the world passes inputs of the same shapes and dtypes in this call
        (statistics included: they change which collectives run), so that ranks that disagree all raise one
        ``ValueError`` naming each rank's values instead of exchanging mismatched buffers
        (:func:`~nxd_moe.parallel_state.start_agreement`).

        Not while ``torch.compile`` traces the call: the check is a host exchange (a graph break), and a compiled
        graph's shapes are fixed when it is traced, so there is nothing to compare from call to call. The eager
        calls of the same program (a prefill) still check."""
        if torch.compiler.is_compiling():
            return None
        # a mode by its value, whichever form names it: a rank passing "blockwise" and one passing
        # ExpertsMode.BLOCKWISE ask for the same thing (a name that is no mode stays as given: the pipeline refuses it)
        mode = None if mode is None else ExpertsMode(mode).value if mode in _MODE_VALUES else str(mode)
        key = (tuple(hidden_states.shape), hidden_states.dtype, token_layout.batch, token_layout.local_seq_len,
               token_layout.sequence_parallel, seq_len, mode, padded, addend is not None, return_stats)
        cached = self._described_inputs.get(key)
        if cached is None:  # their text form and its digest, made once per combination (a steady step reuses them)
            described = config_fingerprint(
                hidden_states=(tuple(hidden_states.shape), hidden_states.dtype),
                token_layout=(token_layout.batch, token_layout.local_seq_len, token_layout.sequence_parallel),
                seq_len=seq_len, mode=key[6], padding_mask=padded, addend=addend is not None,
                return_stats=return_stats)
            cached = self._described_inputs[key] = (described, parallel_state.fingerprint(described))
        return parallel_state.start_agreement(cached[0], "MoE inputs", cached[1])
