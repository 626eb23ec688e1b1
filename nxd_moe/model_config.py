"""Model configurations: one MoE layer of a real architecture, as shipped in ``configs/<name>.yaml``.

- :class:`MoEModelConfig` -- one real architecture: its :class:`RouterSpec` and :class:`SharedExpertsSpec`, and the
  :class:`~nxd_moe.config.RoutedExpertsMLPOpsConfig` and :class:`~nxd_moe.config.BlockwiseMatmulConfig` it builds.
- :func:`load_model_config` -- from a YAML path, a built-in name or a mapping; :func:`builtin_config_names`.

Their public path is :mod:`nxd_moe.config`, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from nxd_moe.activations import ACT2FN
from nxd_moe.checks import check_int, to_torch_dtype
from nxd_moe.moe_configs import BlockwiseMatmulConfig, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization.formats import get_format

ROUTER_TYPES = ("topk", "group_limited", "sinkhorn")


@dataclass(frozen=True)
class RouterSpec:
    """Which router a model uses and its knobs (see :mod:`nxd_moe.routing`)."""

    type: str = "topk"
    act_fn: str = "softmax"
    apply_act_fn_over_topk: bool = False
    bias: bool = False
    dtype: torch.dtype = torch.float32
    n_group: int | None = None
    topk_group: int | None = None
    normalize: bool = False
    routed_scaling_factor: float = 1.0
    jitter_eps: float = 0.0

    def __post_init__(self):
        if self.type not in ROUTER_TYPES:
            raise ValueError(f"router.type must be one of {list(ROUTER_TYPES)}, got {self.type!r}")
        if self.act_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"router.act_fn must be 'softmax' or 'sigmoid', got {self.act_fn!r}")
        object.__setattr__(self, "dtype", to_torch_dtype(self.dtype, "router.dtype"))
        if self.type == "group_limited" and (self.n_group is None or self.topk_group is None):
            raise ValueError("router.type 'group_limited' needs router.n_group and router.topk_group")


@dataclass(frozen=True)
class SharedExpertsSpec:
    """Shared experts: ``num_shared_experts`` dense GLU MLPs of width ``intermediate_size`` each (default: the
    routed width), with activation ``hidden_act`` (default: the routed experts'), projections stored in
    ``quantization`` (default ``"bf16"``, the layer's dtype; independent of the routed experts' format)."""

    num_shared_experts: int = 1
    intermediate_size: int | None = None
    gate: bool = False
    fused_gate_up_projection: bool = False
    hidden_act: str | None = None
    quantization: str = "bf16"

    def __post_init__(self):
        check_int("shared_experts.num_shared_experts", self.num_shared_experts, minimum=1)
        object.__setattr__(self, "quantization", get_format(self.quantization, "shared_experts.quantization").name)
        if self.hidden_act is not None and self.hidden_act not in ACT2FN:
            raise ValueError(f"shared_experts.hidden_act must be one of {sorted(ACT2FN)}, got {self.hidden_act!r}")
        if self.intermediate_size is not None:
            check_int("shared_experts.intermediate_size", self.intermediate_size, minimum=1)


_EXPERT_KEYS = {
    f.name
    for f in fields(RoutedExpertsMLPOpsConfig)
    if f.name not in ("num_experts", "hidden_size", "intermediate_size", "top_k",
                      "input_layer_init_method", "output_layer_init_method")
}


def scaled_width(width: int, scale: int, multiple: int = 8) -> int:
    """``width / scale`` rounded up to a multiple of ``multiple`` (at least ``multiple``): how every width of a
    scaled-down model shrinks."""
    return max(multiple, -(-width // (scale * multiple)) * multiple)


@dataclass(frozen=True)
class MoEModelConfig:
    """One MoE layer of a real architecture, as shipped in ``configs/<name>.yaml``.

    ``experts`` holds the remaining :class:`RoutedExpertsMLPOpsConfig` keys (``hidden_act``, ``glu_mlp``,
    ...); ``blockwise`` holds :class:`BlockwiseMatmulConfig` keys. ``transformers`` holds the rest of the whole
    model (attention heads, vocabulary, rope, dense layers...) as keys of the transformers config class of
    ``hf_model_type``, at full size; ``nxd_moe.models.hf_models.build_hf_model`` reads and checks them.
    """

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    experts: Mapping[str, Any]
    router: RouterSpec = RouterSpec()
    shared_experts: SharedExpertsSpec | None = None
    blockwise: Mapping[str, Any] = field(default_factory=dict)
    hf_model_type: str | None = None
    num_moe_layers: int | None = None
    source: str = ""
    transformers: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.experts) - _EXPERT_KEYS)
        if unknown:
            raise ValueError(f"config {self.name!r}: unknown experts key(s) {unknown}; allowed: {sorted(_EXPERT_KEYS)}")
        if not isinstance(self.transformers, Mapping) or not all(isinstance(k, str) for k in self.transformers):
            raise TypeError(f"config {self.name!r}: transformers must be a mapping of transformers config keys, "
                            f"got {self.transformers!r}")
        if not isinstance(self.router, RouterSpec):
            object.__setattr__(self, "router", _build(RouterSpec, self.router, "router"))
        if self.shared_experts is not None and not isinstance(self.shared_experts, SharedExpertsSpec):
            object.__setattr__(self, "shared_experts", _build(SharedExpertsSpec, self.shared_experts, "shared_experts"))
        # Build both once so a bad file fails on load, not at first use.
        self.routed_experts_config()
        self.blockwise_config()

    def routed_experts_config(self, **overrides) -> RoutedExpertsMLPOpsConfig:
        kwargs = dict(
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
        )
        kwargs.update(self.experts)
        kwargs.update(overrides)
        return RoutedExpertsMLPOpsConfig(**kwargs)

    def blockwise_config(self, **overrides) -> BlockwiseMatmulConfig:
        return BlockwiseMatmulConfig.from_kwargs(**{**self.blockwise, **overrides})

    @property
    def shared_intermediate_size(self) -> int | None:
        """Per shared expert width (defaults to the routed expert width)."""
        if self.shared_experts is None:
            return None
        return self.shared_experts.intermediate_size or self.intermediate_size

    def scaled(self, scale: int, multiple: int = 8) -> "MoEModelConfig":
        """The same routing structure (E, k, groups) with H and I divided by ``scale``.

        Sizes are rounded up to a multiple of ``multiple`` (default 8, so the grouped matmul alignment rules still
        hold; a quantized format's block size where it is larger).
        """
        check_int("scale", scale, minimum=1)
        check_int("multiple", multiple, minimum=1)
        if scale == 1:
            return self

        def shrink(n: int | None) -> int | None:
            return None if n is None else scaled_width(n, scale, multiple)

        experts = dict(self.experts)
        for key in ("hidden_size_actual", "intermediate_size_actual"):
            experts.pop(key, None)
        shared = self.shared_experts
        if shared is not None and shared.intermediate_size is not None:
            shared = dataclasses.replace(shared, intermediate_size=shrink(shared.intermediate_size))
        return dataclasses.replace(
            self,
            name=f"{self.name}/scale{scale}",
            hidden_size=shrink(self.hidden_size),
            intermediate_size=shrink(self.intermediate_size),
            experts=experts,
            shared_experts=shared,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MoEModelConfig":
        return _build(cls, data, "config")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value = {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v)
                         for k, v in dataclasses.asdict(value).items()}
            elif isinstance(value, Mapping):
                value = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in value.items()}
            out[f.name] = value
        return out


def _build(cls, data: Mapping[str, Any], where: str):
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    return cls(**data)


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def builtin_config_names() -> list[str]:
    """Names of the YAML files shipped in ``configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_model_config(config: str | os.PathLike | Mapping[str, Any] | MoEModelConfig) -> MoEModelConfig:
    """Load a model config from a YAML path, a built-in name (``"qwen3-30b-a3b"``), or a mapping."""
    if isinstance(config, MoEModelConfig):
        return config
    if isinstance(config, Mapping):
        return MoEModelConfig.from_dict(config)
    import yaml

    path = Path(config)
    if not path.exists():
        candidate = CONFIG_DIR / f"{path.stem}.yaml"
        if path.suffix in ("", ".yaml") and candidate.exists():
            path = candidate
        else:
            raise FileNotFoundError(
                f"config {str(config)!r} is neither a file nor a built-in config; built-in: {builtin_config_names()}"
            )
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ValueError(f"{path}{where}: not valid YAML ({problem})") from None
    try:
        return MoEModelConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None


# nxd_moe.config, where these lived before it was split, is still their public path: pickles and reprs name it.
for _public in (RouterSpec, SharedExpertsSpec, scaled_width, MoEModelConfig, builtin_config_names, load_model_config):
    _public.__module__ = "nxd_moe.config"
del _public
