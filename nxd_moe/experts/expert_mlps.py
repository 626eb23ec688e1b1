"""``ExpertMLPsV2``: the routed experts' weights, and the front end that prepares routing for a backend."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_moe.config import BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig, check_bool, check_int, to_torch_dtype
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.experts.backends import ExpertsBackend, TorchBackend, get_backend
from nxd_moe.experts.capacity import expert_capacity
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.mode import ExpertsMode, select_mode
from nxd_moe.experts.routing_inputs import build_routing
from nxd_moe.experts.token_mapping import BlockMapping, num_blocks, token_to_block_mapping
from nxd_moe.validation import FiniteWeightsOnLoad, check_finite, check_hidden_states, check_mask_dtype


def _default_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s default (kaiming-uniform, a=sqrt(5)) applied to an ``(in, out)`` matrix."""
    nn.init.kaiming_uniform_(weight.t(), a=math.sqrt(5))


class ExpertLinear(FiniteWeightsOnLoad, nn.Module):
    """All experts' copies of one projection: ``weight (E, in, out)``, optional ``bias (E, out)``."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device=None, init_method=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features, dtype=dtype, device=device))
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype, device=device))
                     if bias else None)
        with torch.no_grad():
            for expert_weight in self.weight:
                (init_method or _default_init)(expert_weight)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(in_features)
                self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        e, i, o = self.weight.shape
        return f"num_experts={e}, in_features={i}, out_features={o}, bias={self.bias is not None}"


class ExpertsMLPOp(nn.Module):
    """Holds the projections under NxD's state-dict names (``mlp_op.gate_up_proj.weight`` ...)."""

    def __init__(self, config: RoutedExpertsMLPOpsConfig, dtype: torch.dtype, device=None):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        first = ExpertLinear(e, h, 2 * i if config.glu_mlp else i, config.bias, dtype, device,
                             config.input_layer_init_method)
        if config.glu_mlp:
            self.gate_up_proj = first
        else:
            self.up_proj = first
        self.down_proj = ExpertLinear(e, i, h, config.bias, dtype, device, config.output_layer_init_method)

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

    def summary(self) -> dict:
        """Plain numbers (host sync). Padding overheads use the deep dive's two definitions:

        - ``padding_overhead_provisioned``: ``(N*B - A*B) / (A*B)`` -- blocks provisioned for the worst case
          beyond the ``A`` blocks this routing needed;
        - ``padding_overhead_algorithmic``: ``(A*B - T*k) / (T*k)`` -- empty slots inside the needed blocks.
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
    shapes and never read tensor values on the host, so they compile to one graph.

    ``backend``: ``"torch"`` (default) or any name in :data:`~nxd_moe.experts.backends.BACKENDS`, or an
    :class:`~nxd_moe.experts.backends.ExpertsBackend` instance. ``validate_inputs=True`` adds value checks
    (NaN/Inf, index range, duplicate experts per token) that cost a host sync.

    With ``hidden_size_actual`` set, the weights are stored at the padded ``hidden_size`` and inputs may have
    either width; the output has the input's width.
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
        self.routed_experts_mlp_config = routed_experts_mlp_config
        self.blockwise_matmul_config = blockwise_matmul_config
        self.sequence_parallel_enabled = check_bool("sequence_parallel_enabled", sequence_parallel_enabled)
        self.validate_inputs = check_bool("validate_inputs", validate_inputs)
        self.backend = get_backend(backend)
        self.activation = ExpertActivation.from_config(routed_experts_mlp_config)
        self.mlp_op = ExpertsMLPOp(routed_experts_mlp_config, to_torch_dtype(dtype), device)

    @property
    def num_experts(self) -> int:
        return self.routed_experts_mlp_config.num_experts

    @property
    def top_k(self) -> int:
        return self.routed_experts_mlp_config.top_k

    @property
    def dtype(self) -> torch.dtype:
        return self.mlp_op.down_proj.weight.dtype

    def expert_weights(self) -> ExpertWeights:
        first = self.mlp_op.first_proj
        return ExpertWeights(first.weight, self.mlp_op.down_proj.weight, first.bias, self.mlp_op.down_proj.bias,
                             self.activation)

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
    ):
        cfg = self.routed_experts_mlp_config
        self._check_inputs(hidden_states, expert_affinities, expert_index, seq_len, padding_mask)
        num_tokens, in_width = hidden_states.shape
        x = hidden_states
        if in_width != cfg.hidden_size:
            x = F.pad(x, (0, cfg.hidden_size - in_width))
        routing = build_routing(
            expert_affinities,
            expert_index.long(),
            cfg.num_experts,
            normalize=cfg.normalize_top_k_affinities,
            prescale=cfg.early_expert_affinity_modulation,
            padding_mask=None if padding_mask is None else padding_mask.reshape(-1).bool(),
        )
        mode = self._resolve_mode(mode, num_tokens, seq_len)
        weights = self.expert_weights()
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        mapping = capacity = None
        block_size = n_blocks = None
        if mode is ExpertsMode.BLOCKWISE:
            bcfg = self.blockwise_matmul_config
            block_size = bcfg.block_size
            n_blocks = num_blocks(num_tokens, cfg.top_k, cfg.num_experts, block_size, bcfg.pad_num_blocks_to_even)
            mapping = token_to_block_mapping(routing.expert_mask, routing.expert_index, block_size, n_blocks,
                                             optimized=bcfg.optimized_block_to_token_mapping)
            backend = self.backend
            if bcfg.use_torch_block_wise and not isinstance(backend, TorchBackend):
                backend = TorchBackend()
            out = backend.blockwise(x, routing, mapping, weights, bcfg)
        elif mode is ExpertsMode.CAPACITY_FACTOR:
            capacity = expert_capacity(num_tokens, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
            out, dropped = self.backend.capacity_factor(x, routing, capacity, weights)
        elif mode is ExpertsMode.SELECTIVE_LOADING:
            out = self.backend.selective_loading(x, routing, weights)
        else:
            out = self.backend.all_experts(x, routing, weights)
        if in_width != cfg.hidden_size:
            out = out[:, :in_width]
        if not return_stats:
            return out
        stats = ExpertsStats(
            mode=mode,
            num_tokens=num_tokens,
            top_k=cfg.top_k,
            num_experts=cfg.num_experts,
            tokens_per_expert=routing.expert_mask.sum(dim=0),
            dropped_tokens=dropped,
            block_size=block_size,
            num_blocks=n_blocks,
            capacity=capacity,
            mapping=mapping,
        )
        return out, stats

    def _resolve_mode(self, mode, num_tokens: int, seq_len: int | None) -> ExpertsMode:
        cfg = self.routed_experts_mlp_config
        if mode is None:
            return select_mode(num_tokens, seq_len, cfg.top_k, cfg.num_experts, self.blockwise_matmul_config.block_size,
                               cfg.capacity_factor, cfg.selective_loading_threshold)
        try:
            mode = ExpertsMode(mode)
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in ExpertsMode]} or None, got {mode!r}") from None
        if mode is ExpertsMode.CAPACITY_FACTOR and cfg.capacity_factor is None:
            raise ValueError("mode='capacity_factor' needs RoutedExpertsMLPOpsConfig.capacity_factor "
                             "(a value in (0, num_experts / top_k))")
        return mode

    def _check_inputs(self, hidden_states, expert_affinities, expert_index, seq_len, padding_mask) -> None:
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
