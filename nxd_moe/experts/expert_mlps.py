"""``ExpertMLPsV2``: the routed experts' weights, and the front end that prepares routing for a backend."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe import parallel_state
from nxd_moe.checks import check_bool, check_int, to_torch_dtype
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import ExpertsBackend, check_backend_supports, get_backend
from nxd_moe.experts.capacity import expert_capacity
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ExpertsMode
from nxd_moe.experts.pairs import experts_forward_pairs, run_experts
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.shard import ShardSpec, WeightShard
from nxd_moe.experts.token_mapping import BlockMapping
from nxd_moe.fingerprint import config_fingerprint
from nxd_moe.moe_configs import BlockwiseMatmulConfig, ExpertParallelConfig, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization import QuantizedWeight, Shape, Weight, get_format
from nxd_moe.quantization.activations import activation_quantization_spec
from nxd_moe.quantization.formats import k_fastest
from nxd_moe.validation import (
    FiniteWeightsOnLoad,
    check_expert_index_range,
    check_finite,
    check_hidden_states,
    check_mask_dtype,
)


def _default_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s default (kaiming-uniform, a=sqrt(5)) applied to an ``(in, out)`` matrix."""
    nn.init.kaiming_uniform_(weight.t(), a=math.sqrt(5))


class ExpertLinear(FiniteWeightsOnLoad, nn.Module):
    """All experts' copies of one projection: ``weight (E, in, out)``, optional ``bias (E, out)``.

    Quantized (``quantization`` other than ``"bf16"``): ``weight`` and ``scale`` hold the format's stored tensors
    (:mod:`nxd_moe.quantization.formats`; not trainable), initialised by quantizing the default init, and every
    load checks their dtypes, shapes and scale values. ``dtype`` is the compute dtype either way.
    ``k_major=True`` stores the quantized weight with the contraction dim fastest (strides ``(K*N, 1, K)``,
    same logical ``(E, K, N)`` and state dict): what FP8 x FP8 tensor cores read directly (W8A8).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device=None, init_method=None, quantization: str = "bf16",
                 k_major: bool = False):
        super().__init__()
        self.compute_dtype = dtype
        self.format = get_format(quantization)
        shape = Shape(num_experts, in_features, out_features)
        self.format.check_shape(shape, f"ExpertLinear {tuple(shape)}")
        weight = torch.empty(num_experts, in_features, out_features, dtype=dtype, device=device)
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype, device=device))
                     if bias else None)
        with torch.no_grad():
            for expert_weight in weight:
                (init_method or _default_init)(expert_weight)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(in_features)
                self.bias.uniform_(-bound, bound)
        if not self.format.quantized:
            self.weight = nn.Parameter(weight)
            return
        if weight.is_meta:
            stored = self.format.empty(shape, device)
            stored = (k_fastest(stored[0]) if k_major else stored[0], stored[1])
        else:
            stored = self.format.quantize_by_expert(weight, k_major)
        self.weight = nn.Parameter(stored[0], requires_grad=False)
        self.scale = nn.Parameter(stored[1], requires_grad=False)
        self.register_load_state_dict_pre_hook(ExpertLinear._check_quantized)

    @staticmethod
    def _check_quantized(module, state_dict, prefix, *args, **kwargs):
        weight, scale = state_dict.get(prefix + "weight"), state_dict.get(prefix + "scale")
        if weight is not None and scale is not None:
            module.format.check(weight, scale, module.shape, prefix.rstrip(".") or "ExpertLinear")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (an unquantized weight's own dtype, which ``module.to(dtype)`` may change)."""
        return self.compute_dtype if self.format.quantized else self.weight.dtype

    @property
    def shape(self) -> Shape:
        return self.stored_weight().shape if self.format.quantized else Shape(*self.weight.shape)

    def stored_weight(self) -> Weight:
        """What the algorithms receive: the weight tensor, or a :class:`QuantizedWeight` over the stored ones."""
        if not self.format.quantized:
            return self.weight
        return QuantizedWeight.create(self.format, self.weight, self.scale, self.dtype)

    def extra_repr(self) -> str:
        e, i, o = self.shape
        quantized = f", quantization={self.format.name!r}" if self.format.quantized else ""
        return f"num_experts={e}, in_features={i}, out_features={o}, bias={self.bias is not None}{quantized}"


class ExpertsMLPOp(nn.Module):
    """Holds the projections under NxD's state-dict names (``mlp_op.gate_up_proj.weight`` ...).

    ``num_experts`` / ``intermediate_size`` override the config's for a shard (local experts, TP slice).
    """

    def __init__(self, config: RoutedExpertsMLPOpsConfig, dtype: torch.dtype, device=None,
                 num_experts: int | None = None, intermediate_size: int | None = None):
        super().__init__()
        e = config.num_experts if num_experts is None else num_experts
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        h = config.hidden_size
        k_major = config.activation_quantization != "none"
        first = ExpertLinear(e, h, 2 * i if config.glu_mlp else i, config.bias, dtype, device,
                             config.input_layer_init_method, config.quantization, k_major)
        if config.glu_mlp:
            self.gate_up_proj = first
        else:
            self.up_proj = first
        self.down_proj = ExpertLinear(e, i, h, config.bias, dtype, device, config.output_layer_init_method,
                                      config.quantization, k_major)

    @property
    def first_proj(self) -> ExpertLinear:
        return self.gate_up_proj if hasattr(self, "gate_up_proj") else self.up_proj


@dataclass
class ExpertsStats:
    """What one forward did. Sizes are Python ints; counts stay tensors so that asking for stats does not
    force a device-to-host sync (call :meth:`summary` when a sync is fine)."""

    mode: ExpertsMode
    num_tokens: int
    top_k: int
    num_experts: int
    tokens_per_expert: torch.Tensor
    dropped_tokens: torch.Tensor
    block_size: int | None = None
    num_blocks: int | None = None
    capacity: int | None = None
    mapping: BlockMapping | None = None
    dispatch: str | None = None
    local_experts: tuple[int, ...] | None = None
    local_tokens_per_expert: torch.Tensor | None = None
    communication: dict[str, int] | None = None

    def summary(self) -> dict:
        """Plain numbers (host sync). Padding overheads use the deep dive's two definitions:

        - ``padding_overhead_provisioned``: ``(N*B - A*B) / (A*B)`` -- blocks provisioned for the worst case
          beyond the ``A`` blocks this routing needed;
        - ``padding_overhead_algorithmic``: ``(A*B - T*k) / (T*k)`` -- empty slots inside the needed blocks.

        Under expert parallelism ``tokens_per_expert``, ``assignments`` and ``dropped_tokens`` describe the whole
        MoE block; the block layout, ``rank_load`` (pairs this rank computed) and the padding overheads are this
        rank's; ``bytes_moved`` is what this rank received, by step.
        """
        assignments = int(self.tokens_per_expert.sum())
        out = {
            "mode": self.mode.value,
            "num_tokens": self.num_tokens,
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "assignments": assignments,
            "dropped_tokens": int(self.dropped_tokens),
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "capacity": self.capacity,
        }
        if self.local_experts is not None:
            assignments = int(self.local_tokens_per_expert.sum())
            out["dispatch"] = self.dispatch
            out["local_experts"] = list(self.local_experts)
            out["rank_load"] = assignments
            out["bytes_moved"] = sum(self.communication.values())
            out["bytes_by_step"] = dict(self.communication)
        if self.mapping is not None:
            active = int(self.mapping.conditions.sum())
            needed_slots = active * self.block_size
            out["active_blocks"] = active
            out["padding_overhead_provisioned"] = (
                (self.num_blocks * self.block_size - needed_slots) / needed_slots if needed_slots else None
            )
            out["padding_overhead_algorithmic"] = (needed_slots - assignments) / assignments if assignments else None
        return out


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
    pairs it is handed on the rows it is handed (:meth:`forward_pairs`); moving tokens between ranks is the parallel
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
            distribution = parallel_state.expert_distribution_for(self.expert_parallel_config, prefill)
            tp_size = parallel_state.get_moe_tensor_model_parallel_size(prefill)
            if cfg.intermediate_size % tp_size:
                raise ValueError(
                    f"intermediate_size ({cfg.intermediate_size}) must be divisible by the MoE tensor-parallel size "
                    f"of {'prefill' if prefill else 'decode'} ({tp_size}); pad the checkpoint "
                    "and set intermediate_size_actual to the true size")
            if tp_size > 1:
                self._check_quantized_split(tp_size)
            experts = parallel_state.get_experts_for_expert_parallel_rank(
                parallel_state.get_moe_expert_model_parallel_rank(prefill), cfg.num_experts,
                parallel_state.get_moe_expert_model_parallel_size(prefill), distribution)
            shards.append(WeightShard(experts, tp_size, parallel_state.get_moe_tensor_model_parallel_rank(prefill)))
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
        cfg = self.routed_experts_mlp_config
        self.check_inputs(hidden_states, expert_affinities, expert_index, seq_len, padding_mask, check_index)
        self.check_addend(addend, hidden_states)
        num_tokens, in_width = hidden_states.shape
        x = self.pad_hidden(hidden_states)
        routing = self.routing(expert_affinities, expert_index, padding_mask)
        mode = self.resolve_mode(mode, num_tokens, seq_len)
        capacity = (expert_capacity(num_tokens, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
                    if mode is ExpertsMode.CAPACITY_FACTOR else None)
        # The backend may add the addend in its own last pass (fused) when the widths agree.
        fused = addend if in_width == cfg.hidden_size else None
        run = run_experts(self.backend, x, routing, self.expert_weights(), mode, self.blockwise_matmul_config,
                          capacity, fused)
        out, mapping = run.output, run.mapping
        if fused is not None:
            addend = None
        # Only when asked: the counts are a kernel launch, which decode latency would otherwise pay.
        stats = ExpertsStats(
            mode=mode,
            num_tokens=num_tokens,
            top_k=cfg.top_k,
            num_experts=cfg.num_experts,
            tokens_per_expert=routing.expert_mask.sum(dim=0) if mapping is None else mapping.tokens_per_expert,
            dropped_tokens=run.dropped,
            block_size=run.block_size,
            num_blocks=run.num_blocks,
            capacity=capacity,
            mapping=mapping,
        ) if return_stats else None
        if in_width != cfg.hidden_size:
            out = out[:, :in_width]
        if addend is not None:
            out = out + addend
        return (out, stats) if return_stats else out

    def pad_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(T, H_actual or H)`` -> ``(T, H)``: zero columns up to the stored ``hidden_size``."""
        width = self.routed_experts_mlp_config.hidden_size
        return hidden_states if hidden_states.shape[1] == width else F.pad(hidden_states,
                                                                           (0, width - hidden_states.shape[1]))

    def forward_pairs(self, rows: torch.Tensor, pair_expert: torch.Tensor, pair_weight: torch.Tensor,
                      mode: ExpertsMode, capacity: int | None, decode: bool, *, local_slot: torch.Tensor | None = None,
                      intermediate_part: torch.Tensor | None = None) -> tuple[torch.Tensor, PairsComputed]:
        """The pairs this module is handed, on the rows it is handed, with the weights it holds for the phase.

        ``rows (N, H)``; ``pair_expert (N, k)``: the global expert id of each pair to compute here (an expert this
        module holds), ``-1`` for the others; ``pair_weight (N, k)``: each pair's combine weight (already
        normalised). Returns the ``(N, H)`` sum over the computed pairs of ``weight * expert(row)`` restricted to
        this shard's slice of the intermediate dimension, and what was computed. ``mode`` and ``capacity`` are the
        whole layer's (the caller resolves them from the layer's token count, as on one device).

        ``local_slot (E,)`` (local index of each global expert held, ``-1`` elsewhere) and ``intermediate_part``
        (0-d) describe the held weights when they are inputs of an SPMD program, where they depend on the rank;
        by default they come from the held shard.
        """
        if local_slot is None:
            local_slot = self._local_slot(decode, rows.device)
        run = experts_forward_pairs(self.backend, rows, pair_expert, pair_weight,
                                    self.shard_weights(decode, intermediate_part), local_slot, mode,
                                    self.blockwise_matmul_config, capacity,
                                    self.routed_experts_mlp_config.early_expert_affinity_modulation)
        return run.output, PairsComputed(run.routing.expert_mask.sum(dim=0), run.mapping, run.block_size,
                                         run.num_blocks)

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


class PairsComputed(NamedTuple):
    """What :meth:`ExpertMLPsV2.forward_pairs` computed: pairs per local expert ``(E_local,)`` and, for blockwise,
    the block mapping and its sizes (None otherwise)."""

    tokens_per_local_expert: torch.Tensor
    mapping: BlockMapping | None
    block_size: int | None
    num_blocks: int | None


def check_expert_index(expert_index: torch.Tensor, num_experts: int, what: str) -> None:
    """Values in ``[0, E)`` and no expert twice in a row (reads the data: host sync)."""
    if expert_index.numel() == 0:
        return
    low, high = int(expert_index.min()), int(expert_index.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"{what} values must be in [0, {num_experts - 1}], got range [{low}, {high}]")
    ordered = expert_index.sort(dim=1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ValueError(f"{what}: a token lists the same expert twice; each row must hold k distinct experts")
