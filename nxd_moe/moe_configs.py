"""NxD's MoE configs (``neuronx_distributed.modules.moe.moe_configs`` and the enums beside it) and the
expert-parallel config, validated at construction.

Everything a user can get wrong about a configuration is rejected here, at construction, with an
error that names the argument and the allowed range. The forward passes then only check what depends
on the inputs (shapes and dtypes).

- :class:`RoutedExpertsMLPOpsConfig` -- what the routed experts compute (NxD's class of that name).
- :class:`BlockwiseMatmulConfig` -- how the dropless blockwise prefill is laid out (NxD's 15 fields).
- :class:`RouterConfig` -- router activation and dtype (NxD's class of that name).
- :class:`MoEFusedTKGConfig` -- NxD's fused-decode kernel settings, kept so NxD code builds unchanged.
- :class:`ExpertParallelConfig` -- expert-parallel dispatch and expert placement.

Their public path is :mod:`nxd_moe.config`, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from nxd_moe.activations import ACT2FN
from nxd_moe.checks import check_bool, check_float, check_int, check_limits, to_torch_dtype
from nxd_moe.quantization.activations import ACTIVATION_QUANTIZATION_CHOICES, W8A8_WEIGHT_FORMATS
from nxd_moe.quantization.formats import get_format

DEFAULT_BLOCK_SIZE = 512
DEFAULT_SELECTIVE_LOADING_THRESHOLD = 1.0
DEFAULT_PADDING_VALUE = -1


def default_logical_nc_config() -> int:
    """NxD's default LNC: ``NEURON_LOGICAL_NC_CONFIG`` if set, else 1 (this is never a Trn2 host)."""
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1")
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {value!r}")
    return int(value)


def _from_kwargs(cls, kwargs: Mapping[str, Any]):
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"{cls.__name__}.from_kwargs got unknown key(s) {unknown}; allowed keys: {sorted(known)}")
    return cls(**kwargs)


class GLUType(str, enum.Enum):
    """``glu``: ``act(s*gate) * (up + b)``; ``swiglu``: ``gate * act(s*gate) * (up + b)``."""

    GLU = "glu"
    SWIGLU = "swiglu"

    @classmethod
    def validate(cls, glu_type: "GLUType | str | None") -> "GLUType":
        """NxD's ``GLUType.validate``: a member, its value (any case), or ``None`` (meaning ``GLU``)."""
        if glu_type is None:
            return cls.GLU
        try:
            return cls(glu_type.lower() if isinstance(glu_type, str) else glu_type)
        except ValueError:
            raise ValueError(f"glu_type must be one of {[e.value for e in cls]}, got {glu_type!r}") from None


class BlockShardStrategy(str, enum.Enum):
    """How LNC2 splits the blocks between its two cores: halves (HI_LO) or alternating (PING_PONG)."""

    HI_LO = "HI_LO"
    PING_PONG = "PING_PONG"


class SkipMode(NamedTuple):
    """Which DMA transfers a blockwise kernel may skip: padding token rows, repeated expert weights."""

    skip_token: bool
    skip_weight: bool


# RouterConfig.act_fn takes every activation name NxD's RouterConfig is documented to take ("See ACT2FN"); the
# routers themselves compute softmax or sigmoid only and refuse the others when built.
ROUTER_CONFIG_ACT_FNS = ("softmax", *sorted(ACT2FN))
ROUTER_CONFIG_KEYS = ("router_act_fn", "router_dtype")


@dataclass
class RouterConfig:
    """Router activation and the dtype routing math runs in (NxD's class of that name).

    ``act_fn``: ``"softmax"`` or an :data:`~nxd_moe.activations.ACT2FN` name, as NxD accepts; the routers compute
    ``softmax`` and ``sigmoid`` only and name the others when built. ``dtype``: a floating ``torch.dtype`` or its
    name (``"bfloat16"``, ``"float16"``, ``"float32"``, ...).

    Mutable, as NxD's is: NxD Inference's model code sets ``neuron_config.router_config.act_fn`` and ``.dtype`` in
    place (GPT-OSS, Llama 4). Every assignment is validated; other attributes are refused.
    """

    act_fn: str = "softmax"
    dtype: torch.dtype = torch.float32

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "act_fn":
            if value not in ROUTER_CONFIG_ACT_FNS:
                raise ValueError(f"RouterConfig.act_fn must be one of {list(ROUTER_CONFIG_ACT_FNS)}, got {value!r}")
        elif name == "dtype":
            value = to_torch_dtype(value, "RouterConfig.dtype")
        else:
            raise AttributeError(f"RouterConfig has no field {name!r}; its fields are act_fn and dtype")
        object.__setattr__(self, name, value)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "RouterConfig":
        """Read NxDI's flat keys ``router_act_fn`` and ``router_dtype``.

        NxD Inference passes every keyword argument of its ``NeuronConfig`` here, so other keys are ignored, as in
        NxD -- except near-misses of the two (``router_act_func``), which NxD would silently drop, keeping a default
        the caller meant to change."""
        for key in kwargs:
            if key not in ROUTER_CONFIG_KEYS:
                close = difflib.get_close_matches(key, ROUTER_CONFIG_KEYS, n=1, cutoff=0.8)
                if close:
                    raise TypeError(f"RouterConfig.from_kwargs got {key!r}: did you mean {close[0]!r}? "
                                    f"(it reads {list(ROUTER_CONFIG_KEYS)} and ignores unrelated keys)")
        return cls(act_fn=kwargs.get("router_act_fn", "softmax"), dtype=kwargs.get("router_dtype", torch.float32))


@dataclass(frozen=True)
class MoEFusedTKGConfig:
    """NxD's configuration of its fused decode (token-generation) kernel, ``MoE(init_tkg_module=True,
    tkg_config=...)``.

    Its toggles pick Neuron kernels. Here the backend decides how a decode step runs (the triton backend runs the
    whole layer in one launch, the others module by module) and every form computes the same function, so the
    toggles are kept only so NxD code builds unchanged. ``norm_topk_prob`` is part of that function: the NxD front
    door checks it against the experts' ``normalize_top_k_affinities`` (NxD's kernel follows the one, its unfused
    path the other).
    """

    quantized: bool
    moe_fused_kernel_enabled: bool | None = None
    router_topk_kernel_enabled: bool | None = None
    expert_mlp_kernel_enabled: bool | None = None
    shared_mlp_kernel_enabled: bool | None = None
    norm_topk_prob: bool = False
    is_mxfp4_compute: bool | None = None
    router_mm_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        owner = "MoEFusedTKGConfig"
        check_bool(f"{owner}.quantized", self.quantized)
        check_bool(f"{owner}.norm_topk_prob", self.norm_topk_prob)
        for name in ("moe_fused_kernel_enabled", "router_topk_kernel_enabled", "expert_mlp_kernel_enabled",
                     "shared_mlp_kernel_enabled", "is_mxfp4_compute"):
            if getattr(self, name) is not None:
                check_bool(f"{owner}.{name}", getattr(self, name))
        object.__setattr__(self, "router_mm_dtype", to_torch_dtype(self.router_mm_dtype, f"{owner}.router_mm_dtype"))


@dataclass(frozen=True)
class BlockwiseMatmulConfig:
    """Layout of the dropless blockwise matmul (NxD's ``BlockwiseMatmulConfig``, same 15 fields and defaults).

    Who reads what: ``block_size``, ``optimized_block_to_token_mapping`` and ``pad_num_blocks_to_even``
    shape the token->block mapping every backend uses; the dynamic-while flags and ``num_static_blocks`` select
    the dynamic-while schedule (a static prefix, then a device-side while loop over active blocks) in the torch
    backend too; the skip flags, ``logical_nc_config``, ``block_sharding_strategy``, ``use_block_parallel`` and
    ``always_augment_inputs_for_blockwise_matmul`` choose the kernel variant of the ``nki_sim`` backend;
    ``use_torch_block_wise`` forces the torch blockwise path whatever the backend. Two fields are kept only so
    NxD configs load unchanged: ``parallelize_token_to_block_mapping`` (NxD splits the mapping's scatter over
    TP ranks to save Neuron cycles; here every rank computes its own mapping, with the same result) and
    ``blockwise_nki_autograd_cls`` (NxD's NKI autograd function).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    use_block_parallel: bool = False
    block_sharding_strategy: BlockShardStrategy = BlockShardStrategy.HI_LO
    skip_dma_token: bool = False
    skip_dma_weight: bool = False
    logical_nc_config: int = field(default_factory=default_logical_nc_config)
    blockwise_nki_autograd_cls: Any = None
    use_torch_block_wise: bool = False
    parallelize_token_to_block_mapping: bool = True
    optimized_block_to_token_mapping: bool = True
    always_augment_inputs_for_blockwise_matmul: bool = False
    use_shard_on_intermediate_dynamic_while: bool = False
    use_shard_on_block_dynamic_while: bool = False
    num_static_blocks: int | None = None
    pad_num_blocks_to_even: bool = False

    def __post_init__(self):
        owner = "BlockwiseMatmulConfig"
        check_int(f"{owner}.block_size", self.block_size, minimum=1)
        for f in fields(self):
            if f.type in ("bool", bool):
                check_bool(f"{owner}.{f.name}", getattr(self, f.name))
        strategy = self.block_sharding_strategy
        try:
            strategy = BlockShardStrategy(strategy.upper() if isinstance(strategy, str) else strategy)
        except ValueError:
            raise ValueError(
                f"{owner}.block_sharding_strategy must be one of {[s.value for s in BlockShardStrategy]}, "
                f"got {self.block_sharding_strategy!r}"
            ) from None
        object.__setattr__(self, "block_sharding_strategy", strategy)
        check_int(f"{owner}.logical_nc_config", self.logical_nc_config, minimum=1, maximum=2)
        if self.use_shard_on_intermediate_dynamic_while and self.use_shard_on_block_dynamic_while:
            raise ValueError(
                f"{owner}: use_shard_on_intermediate_dynamic_while and use_shard_on_block_dynamic_while "
                "are mutually exclusive; set at most one"
            )
        if self.num_static_blocks is not None:
            check_int(f"{owner}.num_static_blocks", self.num_static_blocks, minimum=0)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "BlockwiseMatmulConfig":
        """Build from keyword arguments; unlike NxD, an unknown key is an error, not silently dropped."""
        return _from_kwargs(cls, kwargs)

    @classmethod
    def default(cls) -> "BlockwiseMatmulConfig":
        return cls()

    @property
    def skip_dma(self) -> SkipMode:
        """Derived, never stored: NxD mutates a shared default instance to add this (a defect we avoid)."""
        return SkipMode(self.skip_dma_token, self.skip_dma_weight)

    @property
    def use_dynamic_while(self) -> bool:
        return self.use_shard_on_intermediate_dynamic_while or self.use_shard_on_block_dynamic_while


InitMethod = Callable[[torch.Tensor], Any]


@dataclass(frozen=True)
class RoutedExpertsMLPOpsConfig:
    """What each routed expert computes and how the top-k outputs are combined (NxD's class of that name).

    The expert MLP is ``down(act_part(gate_up(x) + b_gu)) + b_d`` with, for ``glu_mlp=True``::

        gate, up = clamp(gate), clamp(up)
        glu:    act(s * gate) * (up + hidden_act_bias)
        swiglu: gate * act(s * gate) * (up + hidden_act_bias)

    where ``s = hidden_act_scaling_factor``. Unlike NxD, ``hidden_act_bias`` is applied at run time whether
    or not ``bias=True``, clamps of ``0.0`` are honoured, and nothing mutates this object.

    ``capacity_factor``: ``None`` is dropless. A value ``>= num_experts / top_k`` gives every expert room
    for every token, so it is treated as dropless too (NxD's rule); otherwise each expert keeps at most
    ``min(ceil(T * top_k * capacity_factor / E), T)`` tokens.

    NxD's fields that pick Neuron kernels or runtime rank tensors are accepted, in NxD's positional order, so NxD
    code builds unchanged; the function computed does not depend on them: ``use_index_calc_kernel`` (NxD's NKI
    token->block index kernel; every backend here computes the same mapping its own way), ``enable_spmd_rank``
    (NxD's rank tensor for SPMD tracing; ranks come from :mod:`nxd_moe.parallel_state`), ``is_prefill`` (stored,
    as in NxD). ``is_hidden_dim_shuffled`` / ``is_intermediate_dim_shuffled`` must be ``None`` or ``False``: NxD's
    MXFP4-compute checkpoints permute those dimensions for a Trn3 kernel, and nxd_moe reads weights in their logical
    order. ``expert_distribution`` (per expert-parallel rank, the experts it holds) is the default placement of an
    :class:`ExpertParallelConfig`'s ``expert_distribution``.

    ``selective_loading_threshold`` is the deep dive's alpha: decode loads only the chosen experts while
    ``T * top_k < alpha * E`` and switches to all-experts above it.

    ``quantization``: how the routed experts' projections are stored (:mod:`nxd_moe.quantization`): ``"bf16"``
    (not quantized, the layer's dtype), ``"fp8"`` (E4M3, per expert and output channel: NxD's
    ``EXPERT_WISE_PER_CHANNEL_SYMMETRIC``), ``"fp8_block"`` (E4M3, 128x128 blocks: DeepSeek-V3 / Qwen3 FP8) or
    ``"mxfp4"`` (OCP MX, GPT-OSS). Biases and the router stay in the layer's dtype; the shared experts have their
    own setting (:class:`SharedExpertsSpec`), bf16 unless asked.

    ``activation_quantization``: ``"none"`` (default: the experts multiply activations in the layer's dtype) or
    ``"fp8"`` (W8A8: E4M3 activations quantized on the fly in front of both GEMMs, :mod:`nxd_moe.quantization.
    activations`); only with ``quantization`` ``"fp8"`` or ``"fp8_block"``. ``activation_quantization_group_size``:
    columns per activation scale; ``None`` follows the weights (per token for ``fp8``, per token and 128 columns
    for ``fp8_block``, DeepSeek-V3's recipe); an int must divide ``hidden_size`` and ``intermediate_size`` (the K
    of both GEMMs).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    hidden_act: str
    glu_mlp: bool
    bias: bool = False
    glu_type: GLUType = GLUType.GLU
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    hidden_size_actual: int | None = None
    intermediate_size_actual: int | None = None
    is_hidden_dim_shuffled: bool | None = None
    is_intermediate_dim_shuffled: bool | None = None
    use_index_calc_kernel: bool = True
    gate_clamp_upper_limit: float | None = None
    gate_clamp_lower_limit: float | None = None
    up_clamp_upper_limit: float | None = None
    up_clamp_lower_limit: float | None = None
    normalize_top_k_affinities: bool = False
    early_expert_affinity_modulation: bool = False
    input_layer_init_method: InitMethod | None = None
    output_layer_init_method: InitMethod | None = None
    capacity_factor: float | None = None
    enable_spmd_rank: bool = False
    is_prefill: bool | None = None
    expert_distribution: tuple[tuple[int, ...], ...] | None = None
    selective_loading_threshold: float = DEFAULT_SELECTIVE_LOADING_THRESHOLD
    quantization: str = "bf16"
    activation_quantization: str = "none"
    activation_quantization_group_size: int | None = None

    def __post_init__(self):
        owner = "RoutedExpertsMLPOpsConfig"
        check_int(f"{owner}.num_experts", self.num_experts, minimum=1)
        check_int(f"{owner}.hidden_size", self.hidden_size, minimum=1)
        check_int(f"{owner}.intermediate_size", self.intermediate_size, minimum=1)
        check_int(f"{owner}.top_k", self.top_k, minimum=1, maximum=self.num_experts)
        if self.hidden_act not in ACT2FN:
            # NxD's MoE deep dive writes hidden_act="swiglu", which NxD itself rejects too: say what to write.
            hint = (
                " (SwiGLU is a GLU, not an activation: silu(gate) * up, as in Mixtral, Qwen3 or Llama 4, is "
                "hidden_act='silu' with glu_mlp=True; GPT-OSS's gate * sigmoid(1.702 * gate) * (up + 1) is "
                "glu_type='swiglu', hidden_act='sigmoid', hidden_act_scaling_factor=1.702, hidden_act_bias=1.0, "
                "plus its clamps)"
                if self.hidden_act == "swiglu"
                else ""
            )
            raise ValueError(f"{owner}.hidden_act must be one of {sorted(ACT2FN)}, got {self.hidden_act!r}{hint}")
        check_bool(f"{owner}.glu_mlp", self.glu_mlp)
        check_bool(f"{owner}.bias", self.bias)
        try:
            glu_type = GLUType.validate(self.glu_type)
        except ValueError:
            raise ValueError(f"{owner}.glu_type must be 'glu' or 'swiglu', got {self.glu_type!r}") from None
        object.__setattr__(self, "glu_type", glu_type)
        if glu_type is GLUType.SWIGLU and not self.glu_mlp:
            raise ValueError(f"{owner}.glu_type='swiglu' needs glu_mlp=True")
        object.__setattr__(
            self,
            "hidden_act_scaling_factor",
            check_float(f"{owner}.hidden_act_scaling_factor", self.hidden_act_scaling_factor),
        )
        object.__setattr__(self, "hidden_act_bias", check_float(f"{owner}.hidden_act_bias", self.hidden_act_bias))
        if self.hidden_size_actual is not None:
            check_int(f"{owner}.hidden_size_actual", self.hidden_size_actual, minimum=1, maximum=self.hidden_size)
        if self.intermediate_size_actual is not None:
            check_int(
                f"{owner}.intermediate_size_actual",
                self.intermediate_size_actual,
                minimum=1,
                maximum=self.intermediate_size,
            )
        check_limits(owner, "gate_clamp_lower_limit", self.gate_clamp_lower_limit, "gate_clamp_upper_limit",
                      self.gate_clamp_upper_limit)
        check_limits(owner, "up_clamp_lower_limit", self.up_clamp_lower_limit, "up_clamp_upper_limit",
                      self.up_clamp_upper_limit)
        if not self.glu_mlp and any(
            v is not None
            for v in (self.gate_clamp_upper_limit, self.gate_clamp_lower_limit,
                      self.up_clamp_upper_limit, self.up_clamp_lower_limit)
        ):
            raise ValueError(f"{owner}: gate/up clamp limits need glu_mlp=True")
        for name in ("is_hidden_dim_shuffled", "is_intermediate_dim_shuffled"):
            if getattr(self, name) not in (None, False):
                raise ValueError(f"{owner}.{name} must be None or False, got {getattr(self, name)!r}: NxD's "
                                 "MXFP4-compute checkpoints (NxDI's is_mxfp4_compute) permute that dimension for a "
                                 "Trn3 kernel, and nxd_moe reads expert weights in their logical order; load the "
                                 "unshuffled weights (quantization='mxfp4' keeps them in MXFP4)")
        check_bool(f"{owner}.use_index_calc_kernel", self.use_index_calc_kernel)
        check_bool(f"{owner}.enable_spmd_rank", self.enable_spmd_rank)
        if self.is_prefill is not None:
            check_bool(f"{owner}.is_prefill", self.is_prefill)
        if self.expert_distribution is not None:
            distribution = normalize_distribution(self.expert_distribution, f"{owner}.expert_distribution")
            outside = sorted({e for rank in distribution for e in rank if e >= self.num_experts})
            if outside:
                raise ValueError(f"{owner}.expert_distribution names experts {outside} outside [0, "
                                 f"{self.num_experts - 1}]")
            object.__setattr__(self, "expert_distribution", distribution)
        check_bool(f"{owner}.normalize_top_k_affinities", self.normalize_top_k_affinities)
        check_bool(f"{owner}.early_expert_affinity_modulation", self.early_expert_affinity_modulation)
        for name in ("input_layer_init_method", "output_layer_init_method"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{owner}.{name} must be callable or None, got {type(value).__name__}")
        if self.capacity_factor is not None:
            cf = check_float(f"{owner}.capacity_factor", self.capacity_factor, positive=True)
            object.__setattr__(self, "capacity_factor", None if cf >= self.num_experts / self.top_k else cf)
        object.__setattr__(
            self,
            "selective_loading_threshold",
            check_float(f"{owner}.selective_loading_threshold", self.selective_loading_threshold, positive=True),
        )
        object.__setattr__(self, "quantization", get_format(self.quantization, f"{owner}.quantization").name)
        self._check_activation_quantization(owner)

    def _check_activation_quantization(self, owner: str) -> None:
        value = "none" if self.activation_quantization is None else self.activation_quantization
        if not isinstance(value, str) or value.lower() not in ACTIVATION_QUANTIZATION_CHOICES:
            raise ValueError(f"{owner}.activation_quantization must be one of {list(ACTIVATION_QUANTIZATION_CHOICES)}, "
                             f"got {self.activation_quantization!r}")
        value = value.lower()
        object.__setattr__(self, "activation_quantization", value)
        group = self.activation_quantization_group_size
        if value == "none":
            if group is not None:
                raise ValueError(f"{owner}.activation_quantization_group_size={group!r} needs "
                                 "activation_quantization='fp8'")
            return
        if self.quantization not in W8A8_WEIGHT_FORMATS:
            raise ValueError(f"{owner}.activation_quantization='fp8' multiplies FP8 activations by FP8 weights: it "
                             f"needs quantization in {list(W8A8_WEIGHT_FORMATS)}, got quantization="
                             f"{self.quantization!r}")
        if group is not None:
            check_int(f"{owner}.activation_quantization_group_size", group, minimum=1)
            for name, size in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
                if size % group:
                    raise ValueError(f"{owner}.activation_quantization_group_size={group} must divide the K of both "
                                     f"expert GEMMs: {name}={size} is not a multiple of it")

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def replace(self, **changes) -> "RoutedExpertsMLPOpsConfig":
        return dataclasses.replace(self, **changes)


EXPERT_PARALLEL_DISPATCHES = ("all_gather", "all_to_all_v")
ALL_TO_ALL_SPLITS = ("static", "exact")
TRANSPORTS = ("nccl", "nvlink")


def normalize_distribution(expert_distribution: Sequence[Sequence[int]], what: str = "expert_distribution"
                           ) -> tuple[tuple[int, ...], ...]:
    """Tuples of ints; every rank the same number of experts (static weight shapes), no expert twice on a rank."""
    if isinstance(expert_distribution, (str, bytes)) or not isinstance(expert_distribution, Sequence):
        raise TypeError(f"{what} must be a sequence of per-rank expert lists, got {type(expert_distribution).__name__}")
    out = []
    for p, experts in enumerate(expert_distribution):
        if isinstance(experts, (str, bytes)) or not isinstance(experts, Sequence) or not experts:
            raise ValueError(f"{what}[{p}] must be a non-empty list of expert ids, got {experts!r}")
        ids = tuple(check_int(f"{what}[{p}] entries", e, minimum=0) for e in experts)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}[{p}] lists an expert twice: {list(ids)}; a rank holds each expert at most once")
        out.append(ids)
    if not out:
        raise ValueError(f"{what} must list at least one rank")
    lengths = {len(ids) for ids in out}
    if len(lengths) > 1:
        raise ValueError(f"{what}: every rank must hold the same number of experts (static weight shapes), got "
                         f"{[len(ids) for ids in out]}")
    return tuple(out)



def contiguous_distribution(num_experts: int, expert_parallel_size: int) -> tuple[tuple[int, ...], ...]:
    """NxD's default: EP rank ``p`` holds experts ``[p * E / EP, (p + 1) * E / EP)``."""
    check_int("num_experts", num_experts, minimum=1)
    check_int("expert_parallel_size", expert_parallel_size, minimum=1)
    if num_experts % expert_parallel_size:
        raise ValueError(f"the expert-parallel size ({expert_parallel_size}) must divide num_experts ({num_experts}) "
                         "for the contiguous placement; pass an expert_distribution to place experts unevenly")
    per = num_experts // expert_parallel_size
    return tuple(tuple(range(p * per, (p + 1) * per)) for p in range(expert_parallel_size))


def placed_distribution(num_experts: int, expert_parallel_size: int,
                        expert_distribution: Sequence[Sequence[int]] | None = None) -> tuple[tuple[int, ...], ...]:
    """The experts of each of ``expert_parallel_size`` EP ranks: ``expert_distribution`` checked (one list per rank,
    experts in ``[0, num_experts)``, every expert placed at least once; :func:`normalize_distribution`'s rules), or
    the contiguous blocks ``[p * E / EP, (p + 1) * E / EP)`` when it is None."""
    if expert_distribution is None:
        return contiguous_distribution(num_experts, expert_parallel_size)
    check_int("num_experts", num_experts, minimum=1)
    check_int("expert_parallel_size", expert_parallel_size, minimum=1)
    distribution = normalize_distribution(expert_distribution)
    if len(distribution) != expert_parallel_size:
        raise ValueError(f"expert_distribution lists {len(distribution)} ranks, the expert-parallel size is "
                         f"{expert_parallel_size}")
    held = {e for ids in distribution for e in ids}
    out_of_range = sorted(e for e in held if e >= num_experts)
    if out_of_range:
        raise ValueError(f"expert_distribution names experts {out_of_range} outside [0, {num_experts - 1}]")
    missing = sorted(set(range(num_experts)) - held)
    if missing:
        raise ValueError(f"expert_distribution must place every expert at least once; missing {missing}")
    return distribution


@dataclass(frozen=True)
class ExpertParallelConfig:
    """How routed experts run under expert parallelism (ignored on one device).

    - ``dispatch``: ``"all_gather"`` (NxD's: every rank gathers all tokens, masks to its experts, reduces) or
      ``"all_to_all_v"`` (a token goes only to the ranks that compute one of its experts).
    - ``all_to_all_splits`` (``all_to_all_v`` only): ``"static"`` (default) sends every destination a buffer of
      the sender's token count, its rows compacted in front and counted on the device: no host sync, one CUDA
      graph for any routing, never a dropped token (a token goes to a rank at most once, so that is the worst
      case); the wire carries the padding rows. ``"exact"`` exchanges the counts and sends only the rows needed
      (fewer bytes when tokens skip ranks: large EP prefill), at the price of a host sync per forward (not
      capturable) -- DeepEP's normal vs low-latency split.
    - ``expert_distribution``: experts of each expert-parallel rank in prefill (NxD's argument); ``None`` is the
      contiguous placement. An expert listed on several ranks is replicated and its tokens split between the
      copies (EPLB, :func:`nxd_moe.parallel.eplb.plan_expert_distribution`). Every rank lists the same number
      of experts, none twice.
    - ``decode_expert_distribution``: the same for decode; ``None`` reuses ``expert_distribution`` when the decode
      expert-parallel size is the prefill one, else the contiguous placement.
    - ``micro_batches`` (static ``all_to_all_v`` only): split the rows a rank dispatches into this many micro-batches
      whose exchanges run while the experts compute the others (the dispatch of micro-batch ``i + 1`` and the
      combine of ``i - 1`` under the expert GEMMs of ``i``; vLLM's dual-batch overlap, DeepEP's hooks). ``None``
      (default): :func:`nxd_moe.parallel.overlap.micro_batch_count`'s rule from the exchange's bytes, 1 where
      overlap cannot pay. The pairs' positions are the whole block's either way, so capacity drops and replica
      splits are the same as without it; a call asking for statistics runs as one batch.
    - ``transport`` (static ``all_to_all_v`` only): ``"nccl"`` (default) or ``"nvlink"`` -- each rank writes its rows
      straight into the peers' receive buffers (torch symmetric memory, no NCCL kernel;
      :mod:`nxd_moe.parallel.nvlink`), NCCL where that cannot run. One batch: not with ``micro_batches > 1``.
    """

    dispatch: str = "all_gather"
    expert_distribution: tuple[tuple[int, ...], ...] | None = None
    decode_expert_distribution: tuple[tuple[int, ...], ...] | None = None
    all_to_all_splits: str = "static"
    micro_batches: int | None = None
    transport: str = "nccl"

    def __post_init__(self):
        if self.dispatch not in EXPERT_PARALLEL_DISPATCHES:
            raise ValueError(f"ExpertParallelConfig.dispatch must be one of {list(EXPERT_PARALLEL_DISPATCHES)}, "
                             f"got {self.dispatch!r}")
        if self.all_to_all_splits not in ALL_TO_ALL_SPLITS:
            raise ValueError(f"ExpertParallelConfig.all_to_all_splits must be one of {list(ALL_TO_ALL_SPLITS)}, "
                             f"got {self.all_to_all_splits!r}")
        if self.micro_batches is not None:
            check_int("ExpertParallelConfig.micro_batches", self.micro_batches, minimum=1)
            if self.micro_batches > 1 and (self.dispatch, self.all_to_all_splits) != ("all_to_all_v", "static"):
                raise ValueError("ExpertParallelConfig.micro_batches > 1 needs dispatch='all_to_all_v' with "
                                 f"all_to_all_splits='static', got dispatch={self.dispatch!r}, "
                                 f"all_to_all_splits={self.all_to_all_splits!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ExpertParallelConfig.transport must be one of {list(TRANSPORTS)}, got "
                             f"{self.transport!r}")
        if self.transport == "nvlink":
            if (self.dispatch, self.all_to_all_splits) != ("all_to_all_v", "static"):
                raise ValueError("ExpertParallelConfig.transport='nvlink' needs dispatch='all_to_all_v' with "
                                 f"all_to_all_splits='static', got dispatch={self.dispatch!r}, "
                                 f"all_to_all_splits={self.all_to_all_splits!r}")
            if self.micro_batches is not None and self.micro_batches > 1:
                raise ValueError("ExpertParallelConfig.transport='nvlink' runs one batch (its receive buffer is "
                                 f"reused by the next exchange), got micro_batches={self.micro_batches}")
        for name in ("expert_distribution", "decode_expert_distribution"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, normalize_distribution(value, f"ExpertParallelConfig.{name}"))

    def distribution_for(self, prefill: bool, prefill_ep_size: int, decode_ep_size: int):
        """The distribution a phase uses (see the class docstring)."""
        if prefill:
            return self.expert_distribution
        if self.decode_expert_distribution is not None:
            return self.decode_expert_distribution
        return self.expert_distribution if decode_ep_size == prefill_ep_size else None


# nxd_moe.config, where these lived before it was split, is still their public path: pickles and reprs name it.
for _public in (default_logical_nc_config, GLUType, BlockShardStrategy, SkipMode, RouterConfig, MoEFusedTKGConfig,
                BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig, normalize_distribution, contiguous_distribution,
                placed_distribution, ExpertParallelConfig):
    _public.__module__ = "nxd_moe.config"
del _public
