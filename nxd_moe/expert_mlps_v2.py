"""``ExpertMLPsV2`` (NxD's ``expert_mlps_v2``): the routed experts' weights -- on one device, or this rank's shard
under model parallelism -- and the one routed pipeline every forward takes (:meth:`ExpertMLPsV2.routed_forward`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe import parallel_state
from nxd_moe.checks import check_bool, check_int, to_torch_dtype
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import ExpertsBackend, check_backend_supports, get_backend
from nxd_moe.experts.capacity import expert_capacity
from nxd_moe.experts.expert_mlps import ExpertsMLPOp, ExpertsStats, check_expert_index
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.pairs import ExpertsRun, experts_forward_pairs, run_experts
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.shard import ShardSpec, WeightShard
from nxd_moe.fingerprint import config_fingerprint
from nxd_moe.moe_configs import BlockwiseMatmulConfig, ExpertParallelConfig, RoutedExpertsMLPOpsConfig
from nxd_moe.parallel.dispatch import ONE_DEVICE, Dispatched, DispatchInputs, DispatchResult, Route
from nxd_moe.parallel.layout import held_weight_shard
from nxd_moe.quantization import Shape, get_format
from nxd_moe.quantization.activations import activation_quantization_spec
from nxd_moe.validation import check_expert_index_range, check_finite, check_hidden_states, check_mask_dtype

__all__ = ["ExpertMLPsV2"]


class ExpertMLPsV2(nn.Module):
    """Routed experts with every NxD inference forward mode.

    ``forward(hidden_states (T, H), expert_affinities (T, E), expert_index (T, k), seq_len=None,
    padding_mask=None)`` returns ``(T, H)``. The mode follows :func:`~nxd_moe.experts.mode.select_mode`
    (``seq_len == 1`` is decode; ``None`` means prefill) unless ``mode=`` forces one. All modes have static
    shapes and never read tensor values on the host, so they compile to one graph. ``addend (T, H)`` (keyword; the
    shared experts' output when ``MoE`` calls) is added to the output, inside the backend's last pass where it
    can (``ExpertsBackend.fuses_addend``).

    ``backend``: ``"torch"`` (default) or any name in :data:`~nxd_moe.experts.backends.BACKENDS`, or an
    :class:`~nxd_moe.experts.backends.ExpertsBackend` instance. An ``expert_index`` outside ``[0, E)`` is an
    error, checked without a host sync (:func:`~nxd_moe.validation.check_expert_index_range`; ``check_index=False``
    skips it for ids in range by construction, as ``MoE`` does with its router's). ``validate_inputs=True`` adds
    value checks that cost a host sync (NaN/Inf, duplicate experts per token).

    With ``hidden_size_actual`` set, the weights are stored at the padded ``hidden_size`` and inputs may have
    either width; the output has the input's width.

    Model parallelism (``model_parallel=None``: whenever :mod:`nxd_moe.parallel_state` is initialised with an MoE
    block of more than one rank; ``False``: never): the module holds only this rank's shard (``weight_shards``,
    one :class:`~nxd_moe.experts.shard.WeightShard` per phase) -- the experts of its expert-parallel rank
    (``expert_parallel_config.expert_distribution``, by default the config's ``expert_distribution``), the slice
    of the intermediate dimension of its tensor-parallel rank -- for prefill in ``mlp_op`` and, when hybrid
    sharding splits decode differently, for decode in ``mlp_op_tkg`` (NxD's names). A sharded module computes the
    pairs it is handed on the rows it is handed (:meth:`compute`); moving tokens between ranks is the parallel
    layer's job: :class:`~nxd_moe.MoE` does it, or :class:`nxd_moe.parallel.ExpertParallel` for the experts alone.
    Load a single-device checkpoint with :func:`nxd_moe.parallel.sharding.load_full_state_dict`. Every rank must build
    the module with the same arguments; they are compared across ranks once, here.
    """

    def __init__(
        self,
        routed_experts_mlp_config: RoutedExpertsMLPOpsConfig,
        blockwise_matmul_config: BlockwiseMatmulConfig | None = None,
        dtype: torch.dtype | str = torch.float32,
        device=None,
        sequence_parallel_enabled: bool = False,
        backend: str | ExpertsBackend = "torch",
        validate_inputs: bool = False,
        expert_parallel_config: ExpertParallelConfig | None = None,
        model_parallel: bool | None = None,
    ):
        super().__init__()
        if not isinstance(routed_experts_mlp_config, RoutedExpertsMLPOpsConfig):
            raise TypeError("routed_experts_mlp_config must be a RoutedExpertsMLPOpsConfig, got "
                            f"{type(routed_experts_mlp_config).__name__}")
        if blockwise_matmul_config is None:
            blockwise_matmul_config = BlockwiseMatmulConfig()
        if not isinstance(blockwise_matmul_config, BlockwiseMatmulConfig):
            raise TypeError("blockwise_matmul_config must be a BlockwiseMatmulConfig, got "
                            f"{type(blockwise_matmul_config).__name__}")
        distribution = routed_experts_mlp_config.expert_distribution
        if expert_parallel_config is None:
            expert_parallel_config = ExpertParallelConfig(expert_distribution=distribution)
        if not isinstance(expert_parallel_config, ExpertParallelConfig):
            raise TypeError("expert_parallel_config must be an ExpertParallelConfig or None, got "
                            f"{type(expert_parallel_config).__name__}")
        if distribution is not None and expert_parallel_config.expert_distribution != distribution:
            raise ValueError("ExpertMLPsV2: routed_experts_mlp_config.expert_distribution and "
                             "expert_parallel_config.expert_distribution differ; give the placement once")
        self.routed_experts_mlp_config = routed_experts_mlp_config
        self.blockwise_matmul_config = blockwise_matmul_config
        self.expert_parallel_config = expert_parallel_config
        self.sequence_parallel_enabled = check_bool("sequence_parallel_enabled", sequence_parallel_enabled)
        self.validate_inputs = check_bool("validate_inputs", validate_inputs)
        self.backend = get_backend(backend)
        check_backend_supports(self.backend, routed_experts_mlp_config.quantization,
                               routed_experts_mlp_config.activation_quantization)
        dtype = to_torch_dtype(dtype)
        self.weight_shards = self._weight_shards(model_parallel, dtype)
        # In an SPMD program the rank is an input (NxD's ``expert_mlps.spmd_rank``): the parallel layer reads it.
        self.spmd_rank = None if self.weight_shards is None else parallel_state.spmd_rank()
        self.activation = ExpertActivation.from_config(routed_experts_mlp_config)
        self._shard_activations: dict[tuple[int, int], ExpertActivation] = {}
        self._local_slots: dict[tuple[bool, str], torch.Tensor] = {}
        if self.weight_shards is None:
            self.mlp_op = ExpertsMLPOp(routed_experts_mlp_config, dtype, device)
            return
        prefill, decode = self.weight_shards
        self.mlp_op = self._shard_op(prefill, dtype, device)
        if not decode.holds_same_weights_as(prefill):
            self.mlp_op_tkg = self._shard_op(decode, dtype, device)

    def _weight_shards(self, model_parallel: bool | None, dtype: torch.dtype
                       ) -> tuple[WeightShard, WeightShard] | None:
        """``(prefill, decode)`` shards this rank holds, from :mod:`nxd_moe.parallel_state`; None on one device."""
        if model_parallel is not None:
            check_bool("model_parallel", model_parallel)
        if model_parallel is False:
            return None
        if not parallel_state.model_parallel_is_initialized():
            if model_parallel:
                raise RuntimeError("ExpertMLPsV2(model_parallel=True) needs nxd_moe.parallel_state."
                                   "initialize_model_parallel first")
            return None
        if parallel_state.get_moe_model_parallel_size() == 1 and not model_parallel:
            return None
        cfg = self.routed_experts_mlp_config
        parallel_state.check_configuration(
            config_fingerprint(routed_experts_mlp_config=cfg, blockwise_matmul_config=self.blockwise_matmul_config,
                               expert_parallel_config=self.expert_parallel_config, dtype=dtype,
                               backend=type(self.backend)),
            "ExpertMLPsV2 arguments")
        shards = []
        for prefill in (True, False):
            shard = held_weight_shard(prefill, cfg.num_experts, self.expert_parallel_config)
            tp_size = shard.intermediate_parts
            if cfg.intermediate_size % tp_size:
                raise ValueError(
                    f"intermediate_size ({cfg.intermediate_size}) must be divisible by the MoE tensor-parallel size "
                    f"of {'prefill' if prefill else 'decode'} ({tp_size}); pad the checkpoint "
                    "and set intermediate_size_actual to the true size")
            if tp_size > 1:
                self._check_quantized_split(tp_size)
            shards.append(shard)
        return shards[0], shards[1]

    def _check_quantized_split(self, tp_size: int) -> None:
        """A quantized format's slices along the intermediate dimension must keep its scale blocks whole, and FP8
        activation groups of the intermediate (W8A8) must lie inside one slice."""
        cfg = self.routed_experts_mlp_config
        spec = activation_quantization_spec(cfg)
        width = cfg.intermediate_size // tp_size
        if spec is not None and (spec.group_size is None or width % spec.group_size):
            raise ValueError(f"ExpertMLPsV2: activation_quantization='fp8' under tensor parallelism needs the "
                             f"intermediate activations quantized in groups that lie inside one rank's slice of "
                             f"{width} columns (intermediate_size {cfg.intermediate_size} / TP {tp_size}); got "
                             f"{spec.describe()} -- set activation_quantization_group_size to a divisor of {width}")
        fmt = get_format(cfg.quantization)
        width = (2 if cfg.glu_mlp else 1) * cfg.intermediate_size
        fmt.check_split(Shape(1, cfg.hidden_size, width), 2, tp_size, 2 if cfg.glu_mlp else 1,
                        f"ExpertMLPsV2 {'gate_up_proj' if cfg.glu_mlp else 'up_proj'} (intermediate_size "
                        f"{cfg.intermediate_size}, tensor-parallel size {tp_size})")
        fmt.check_split(Shape(1, cfg.intermediate_size, cfg.hidden_size), 1, tp_size, 1,
                        f"ExpertMLPsV2 down_proj (intermediate_size {cfg.intermediate_size}, tensor-parallel size "
                        f"{tp_size})")

    def _shard_op(self, shard: WeightShard, dtype: torch.dtype, device) -> ExpertsMLPOp:
        cfg = self.routed_experts_mlp_config
        return ExpertsMLPOp(cfg, dtype, device, len(shard.experts), cfg.intermediate_size // shard.intermediate_parts)

    @property
    def num_experts(self) -> int:
        return self.routed_experts_mlp_config.num_experts

    @property
    def top_k(self) -> int:
        return self.routed_experts_mlp_config.top_k

    @property
    def dtype(self) -> torch.dtype:
        return self.mlp_op.down_proj.dtype

    @property
    def is_sharded(self) -> bool:
        """The module holds one rank's shard of the experts (see the class docstring)."""
        return self.weight_shards is not None

    def weight_shard(self, decode: bool) -> WeightShard:
        """The shard of a phase (the whole layer on one device)."""
        if self.weight_shards is None:
            return WeightShard(tuple(range(self.num_experts)))
        return self.weight_shards[1 if decode else 0]

    def expert_weights(self) -> ExpertWeights:
        """The experts' weights (on a sharded module: this rank's prefill shard, see :meth:`shard_weights`)."""
        if self.weight_shards is not None:
            return self.shard_weights(decode=False)
        first = self.mlp_op.first_proj
        return ExpertWeights(first.stored_weight(), self.mlp_op.down_proj.stored_weight(), first.bias,
                             self.mlp_op.down_proj.bias, self.activation,
                             activation_quantization_spec(self.routed_experts_mlp_config))

    def held_weights(self, decode: bool, intermediate_part: torch.Tensor | None = None) -> ExpertWeights:
        """The weights this module computes a phase with: all of them on one device, else this rank's shard."""
        if self.weight_shards is None:
            return self.expert_weights()
        return self.shard_weights(decode, intermediate_part)

    def shard_weights(self, decode: bool, intermediate_part: int | torch.Tensor | None = None) -> ExpertWeights:
        """This rank's weights for a phase. The down-projection bias is added on the first intermediate slice only:
        the partial outputs are summed over the slices, so it is counted once and exactly (NxD divides it by TP
        instead). ``intermediate_part`` (default: the held shard's) may be a 0-d tensor (an SPMD program, where
        the slice is an input): the bias and the padded columns are then selected on the device."""
        shard = self.weight_shard(decode)
        op = self.mlp_op_tkg if decode and hasattr(self, "mlp_op_tkg") else self.mlp_op
        cfg = self.routed_experts_mlp_config
        part = shard.intermediate_part if intermediate_part is None else intermediate_part
        width = cfg.intermediate_size // shard.intermediate_parts
        down_bias = op.down_proj.bias
        if isinstance(part, torch.Tensor):
            actual = cfg.intermediate_size_actual
            if actual is not None:
                actual = (actual - part * width).clamp(0, width)
            if down_bias is not None:
                down_bias = down_bias * (part == 0).to(down_bias.dtype)
            activation = dataclasses.replace(self.activation, intermediate_size=width, intermediate_size_actual=actual)
        else:
            down_bias = down_bias if part == 0 else None
            activation = self._shard_activation(width, part)
        return ExpertWeights(op.first_proj.stored_weight(), op.down_proj.stored_weight(), op.first_proj.bias,
                             down_bias, activation, activation_quantization_spec(cfg))

    def _shard_activation(self, width: int, part: int) -> ExpertActivation:
        """The activation of intermediate slice ``part`` of ``width`` columns (made once per slice: an eager
        expert-parallel step asks on every call)."""
        activation = self._shard_activations.get((width, part))
        if activation is None:
            actual = self.routed_experts_mlp_config.intermediate_size_actual
            if actual is not None:
                actual = min(max(actual - part * width, 0), width)
                actual = None if actual == width else actual
            activation = self._shard_activations[width, part] = dataclasses.replace(
                self.activation, intermediate_size=width, intermediate_size_actual=actual)
        return activation

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How each local tensor comes from the single-device checkpoint (see :mod:`nxd_moe.parallel.sharding`)."""
        if self.weight_shards is None:
            return {}
        glu = self.routed_experts_mlp_config.glu_mlp
        first = "gate_up_proj" if glu else "up_proj"
        specs = {}
        phases = [("mlp_op", self.weight_shards[0])]
        if hasattr(self, "mlp_op_tkg"):
            phases.append(("mlp_op_tkg", self.weight_shards[1]))
        fmt = get_format(self.routed_experts_mlp_config.quantization)
        stride = 2 if glu else 1
        for name, shard in phases:
            # gate/up is cut along its outputs (N, stride 2: [gate_r | up_r]), down along its inputs (K).
            for proj, dim, proj_stride in ((first, 2, stride), ("down_proj", 1, 1)):
                specs[f"{name}.{proj}.weight"] = shard.spec(f"mlp_op.{proj}.weight", dim, proj_stride)
                if fmt.quantized:
                    specs[f"{name}.{proj}.scale"] = shard.spec(f"mlp_op.{proj}.scale", fmt.scale_split_dim(dim),
                                                               proj_stride)
            if self.routed_experts_mlp_config.bias:
                specs[f"{name}.{first}.bias"] = shard.spec(f"mlp_op.{first}.bias", 1, stride)
                specs[f"{name}.down_proj.bias"] = shard.spec("mlp_op.down_proj.bias")
        return specs

    def routing(self, expert_affinities: torch.Tensor, expert_index: torch.Tensor,
                padding_mask: torch.Tensor | None = None) -> Routing:
        """The router's output over all ``E`` experts in the algorithms' form (the backend's ``build_routing``)."""
        cfg = self.routed_experts_mlp_config
        return self.backend.build_routing(
            expert_affinities,
            expert_index.long(),
            cfg.num_experts,
            normalize=cfg.normalize_top_k_affinities,
            prescale=cfg.early_expert_affinity_modulation,
            padding_mask=None if padding_mask is None else padding_mask.reshape(-1).bool(),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        expert_affinities: torch.Tensor,
        expert_index: torch.Tensor,
        seq_len: int | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        mode: ExpertsMode | str | None = None,
        return_stats: bool = False,
        addend: torch.Tensor | None = None,
        check_index: bool = True,
    ):
        if self.weight_shards is not None:
            raise RuntimeError("ExpertMLPsV2: this module holds one rank's shard of the experts (it was built while "
                               "nxd_moe.parallel_state was initialised); run it inside MoE(...), or wrap it in "
                               "nxd_moe.parallel.ExpertParallel(experts), which move the tokens between the ranks")
        return self.routed_forward(hidden_states, expert_affinities, expert_index, seq_len, padding_mask,
                                   ONE_DEVICE, mode=mode, return_stats=return_stats, addend=addend,
                                   check_index=check_index)

    def routed_forward(self, hidden_states: torch.Tensor, expert_affinities: torch.Tensor,
                       expert_index: torch.Tensor, seq_len: int | None, padding_mask: torch.Tensor | None,
                       route: Route, *, mode: ExpertsMode | str | None = None, return_stats: bool = False,
                       addend: torch.Tensor | None = None, check_index: bool = True, checked: bool = False):
        """The one routed pipeline, for one device (:data:`~nxd_moe.parallel.dispatch.ONE_DEVICE`, what
        :meth:`forward` passes) and across ranks (:class:`~nxd_moe.parallel.ExpertParallel`'s route): **prepare**
        (check the inputs, pad the width, build the routing, resolve the mode and capacity from the block's token
        count) -> **dispatch** (``route.dispatcher``) -> **compute** (:meth:`compute`: the pairs dispatched here,
        with the weights held for the phase) -> **combine** -> **finalize** (the width, the addend, the
        statistics). With ``route.micro_batches > 1`` the middle three run per micro-batch, each exchange beside
        another micro-batch's compute (the dispatcher's ``micro_batches``). Arguments as :meth:`forward`'s
        (``checked``: the caller checked the inputs already); returns ``(T, H)`` for this rank's tokens (and
        :class:`ExpertsStats` with ``return_stats``)."""
        cfg = self.routed_experts_mlp_config
        if not checked:
            self.check_inputs(hidden_states, expert_affinities, expert_index, seq_len, padding_mask, check_index)
            self.check_addend(addend, hidden_states)
        num_tokens, in_width = hidden_states.shape
        x = self.pad_hidden(hidden_states)
        routing = self.routing(expert_affinities, expert_index, padding_mask)
        total = num_tokens if route.layout is None else route.layout.num_tokens
        mode = self.resolve_mode(mode, total, seq_len)
        capacity = (expert_capacity(total, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
                    if mode is ExpertsMode.CAPACITY_FACTOR else None)
        if route.agreement is not None:
            route.agreement.wait()
        inputs = DispatchInputs(x, routing, route.layout, route.groups, route.shard, capacity, route.ledger,
                                route.all_to_all_splits, count_pairs=return_stats, transport=route.transport)
        fused = computed = None
        if route.micro_batches > 1 and not return_stats:  # statistics describe one run of the experts
            batches = route.dispatcher.micro_batches(inputs, route.micro_batches)
            for i in range(len(batches)):
                dispatched = batches.received(i)
                partial, _ = self.compute(dispatched, mode, capacity, seq_len == 1, route)
                batches.start_combine(i, partial, dispatched.handle)
            result = batches.result()
        else:
            dispatched = route.dispatcher.dispatch(inputs)
            # The experts may add the addend in their own last pass (fused) when the rows are the tokens.
            fused = addend if dispatched.routing is not None and in_width == cfg.hidden_size else None
            partial, computed = self.compute(dispatched, mode, capacity, seq_len == 1, route, fused)
            result = route.dispatcher.combine(partial, dispatched.handle)
        out = result.output
        if in_width != cfg.hidden_size:
            out = out[:, :in_width]
        if addend is not None and fused is None:
            out = out + addend
        if not return_stats:
            return out
        return out, self._stats(mode, total, capacity, computed, result, route)

    def compute(self, dispatched: Dispatched, mode: ExpertsMode, capacity: int | None, decode: bool,
                route: Route = ONE_DEVICE, addend: torch.Tensor | None = None) -> tuple[torch.Tensor, ExpertsRun]:
        """The pipeline's compute step: the rows dispatched here through the experts this module holds for the
        phase (``decode``), ``mode`` and ``capacity`` being the whole block's. The rows come with the router's
        routing (one device) or as pairs (``pair_expert (N, k)``, the global id of each pair to compute here,
        ``-1`` for the others; ``pair_weight (N, k)``, each pair's combine weight, already normalised), which the
        backend turns into the routing of the held experts (``route.local_slot`` and ``route.intermediate_part``
        describe them in an SPMD program, where they depend on the rank; by default they come from the held shard).
        Returns the ``(N, H)`` sum over the computed pairs of ``weight * expert(row)`` on this shard's slice of the
        intermediate dimension (``+ addend``), and what ran (None when no row came here)."""
        rows = dispatched.rows
        if dispatched.routing is not None:
            run = run_experts(self.backend, rows, dispatched.routing, self.held_weights(decode), mode,
                              self.blockwise_matmul_config, capacity, addend)
            return run.output, run
        if rows.shape[0] == 0:  # an exact all-to-all that brought this rank no row
            return rows.new_zeros(rows.shape), None
        local_slot = self._local_slot(decode, rows.device) if route.local_slot is None else route.local_slot
        run = experts_forward_pairs(self.backend, rows, dispatched.pair_expert, dispatched.pair_weight,
                                    self.held_weights(decode, route.intermediate_part), local_slot, mode,
                                    self.blockwise_matmul_config, capacity,
                                    self.routed_experts_mlp_config.early_expert_affinity_modulation)
        return run.output, run

    def _stats(self, mode: ExpertsMode, total: int, capacity: int | None, run: ExpertsRun | None,
               result: DispatchResult, route: Route) -> ExpertsStats:
        """The pipeline's statistics: the block's pairs per expert and drops as the dispatcher counted them, or,
        where it did not (one device), as the experts did, who then saw every pair."""
        cfg = self.routed_experts_mlp_config
        device = result.output.device
        if run is None:  # nothing computed here
            num_local = len(route.shard.local_experts)
            local_counts = torch.zeros(num_local, dtype=torch.int64, device=device)
            mapping = block_size = n_blocks = None
            dropped = torch.zeros((), dtype=torch.int64, device=device)
        else:
            mapping, block_size, n_blocks, dropped = run.mapping, run.block_size, run.num_blocks, run.dropped
            local_counts = run.routing.expert_mask.sum(dim=0) if mapping is None else mapping.tokens_per_expert
        counts = result.pairs_per_expert
        if counts is None:
            counts = local_counts
        elif capacity is not None:
            dropped = (counts - counts.clamp(max=capacity)).sum()
        else:
            dropped = torch.zeros((), dtype=torch.int64, device=device)
        parallel = {} if route.name is None else dict(
            dispatch=route.name, local_experts=route.shard.local_experts, local_tokens_per_expert=local_counts,
            communication=dict(route.ledger.steps))
        return ExpertsStats(mode=mode, num_tokens=total, top_k=cfg.top_k, num_experts=cfg.num_experts,
                            tokens_per_expert=counts, dropped_tokens=dropped, block_size=block_size,
                            num_blocks=n_blocks, capacity=capacity, mapping=mapping, **parallel)

    def pad_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(T, H_actual or H)`` -> ``(T, H)``: zero columns up to the stored ``hidden_size``."""
        width = self.routed_experts_mlp_config.hidden_size
        return hidden_states if hidden_states.shape[1] == width else F.pad(hidden_states,
                                                                           (0, width - hidden_states.shape[1]))

    def _local_slot(self, decode: bool, device) -> torch.Tensor:
        """``(E,)`` local index of each global expert this phase's shard holds, ``-1`` elsewhere (one table per
        device, built on first use: a captured CUDA graph must not copy from the host)."""
        key = (decode, str(device))
        if key not in self._local_slots:
            # Made in a graph being compiled, a table stored here would be that graph's output, held across
            # CUDA-graph replays that overwrite it: there it is made and not kept. So an eager call (the prefill
            # before compiled decode steps) makes both phases' tables.
            if torch.compiler.is_compiling():
                return self._make_local_slot(decode, device)
            for phase in (False, True):
                self._local_slots[phase, str(device)] = self._make_local_slot(phase, device)
        return self._local_slots[key]

    def _make_local_slot(self, decode: bool, device) -> torch.Tensor:
        experts = self.weight_shard(decode).experts
        slot = torch.full((self.num_experts,), -1, dtype=torch.int64)
        slot[list(experts)] = torch.arange(len(experts))
        return slot.to(device)

    def resolve_mode(self, mode, num_tokens: int, seq_len: int | None) -> ExpertsMode:
        """The algorithm for ``num_tokens`` tokens (the whole layer's, under model parallelism): ``mode`` if forced,
        else the backend's rule."""
        cfg = self.routed_experts_mlp_config
        if mode is None:
            return self.backend.select_mode(num_tokens, seq_len, cfg.top_k, cfg.num_experts,
                                            self.blockwise_matmul_config.block_size, cfg.capacity_factor,
                                            cfg.selective_loading_threshold)
        try:
            mode = ExpertsMode(mode)
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in ExpertsMode]} or None, got {mode!r}") from None
        if mode is ExpertsMode.CAPACITY_FACTOR and cfg.capacity_factor is None:
            raise ValueError("mode='capacity_factor' needs RoutedExpertsMLPOpsConfig.capacity_factor "
                             "(a value in (0, num_experts / top_k))")
        return mode

    def check_addend(self, addend, hidden_states: torch.Tensor) -> None:
        if addend is not None and (not isinstance(addend, torch.Tensor) or addend.shape != hidden_states.shape
                                   or addend.dtype != hidden_states.dtype):
            raise ValueError(f"ExpertMLPsV2: addend must be a tensor shaped and typed like hidden_states "
                             f"{tuple(hidden_states.shape)} {hidden_states.dtype}, got "
                             f"{tuple(getattr(addend, 'shape', ())) or type(addend).__name__}")

    def check_inputs(self, hidden_states, expert_affinities, expert_index, seq_len, padding_mask,
                     check_index: bool = True) -> None:
        """Shapes, dtypes and ranges of one forward's inputs; value checks only with ``validate_inputs``, except
        the expert-index range, which is checked without a host sync unless ``check_index`` is False (ids in range
        by construction)."""
        cfg = self.routed_experts_mlp_config
        widths = (cfg.hidden_size,) if cfg.hidden_size_actual is None else (cfg.hidden_size, cfg.hidden_size_actual)
        check_hidden_states(hidden_states, widths, "ExpertMLPsV2: hidden_states")
        if hidden_states.dim() != 2 or hidden_states.shape[0] == 0:
            raise ValueError(f"ExpertMLPsV2: hidden_states must be (T, H) with T >= 1, "
                             f"got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != self.dtype:
            raise TypeError(f"ExpertMLPsV2: hidden_states dtype {hidden_states.dtype} does not match the expert "
                            f"weights' dtype {self.dtype}; cast the input or build the module with that dtype")
        num_tokens = hidden_states.shape[0]
        if not isinstance(expert_affinities, torch.Tensor) or not expert_affinities.is_floating_point():
            raise TypeError("ExpertMLPsV2: expert_affinities must be a floating-point tensor")
        if tuple(expert_affinities.shape) != (num_tokens, cfg.num_experts):
            raise ValueError(f"ExpertMLPsV2: expert_affinities must be (T, E) = ({num_tokens}, {cfg.num_experts}), "
                             f"got {tuple(expert_affinities.shape)}")
        if not isinstance(expert_index, torch.Tensor) or expert_index.is_floating_point() or expert_index.is_complex() \
                or expert_index.dtype == torch.bool:
            raise TypeError("ExpertMLPsV2: expert_index must be an integer tensor")
        if tuple(expert_index.shape) != (num_tokens, cfg.top_k):
            raise ValueError(f"ExpertMLPsV2: expert_index must be (T, k) = ({num_tokens}, {cfg.top_k}), "
                             f"got {tuple(expert_index.shape)}")
        if seq_len is not None:
            check_int("seq_len", seq_len, minimum=1)
        if padding_mask is not None:
            check_mask_dtype(padding_mask, "ExpertMLPsV2: padding_mask")
            if padding_mask.numel() != num_tokens:
                raise ValueError(f"ExpertMLPsV2: padding_mask must hold one entry per token ({num_tokens}), got "
                                 f"{getattr(padding_mask, 'shape', padding_mask)}")
        if self.validate_inputs:
            check_finite(hidden_states, "ExpertMLPsV2: hidden_states")
            check_finite(expert_affinities, "ExpertMLPsV2: expert_affinities")
            check_expert_index(expert_index, cfg.num_experts, "ExpertMLPsV2: expert_index")
        elif check_index:
            check_expert_index_range(expert_index, cfg.num_experts, "ExpertMLPsV2: expert_index")
