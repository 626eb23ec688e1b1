"""Hugging Face ``transformers`` interoperability: configs, MoE blocks and whole checkpoints.

Supported model types: ``mixtral``, ``qwen3_moe``, ``qwen2_moe``, ``gpt_oss``, ``deepseek_v3``, ``llama4_text``
(and ``llama4`` through its ``text_config``) and ``dbrx``.

- :func:`from_hf_config` maps a transformers config (object or ``config.json`` dict) onto a
  :class:`~nxd_moe.config.MoEModelConfig` whose routing and activation knobs reproduce the model's MoE layer
  (section 6.2 of the NxD reference).
- :func:`from_hf_moe_block` builds an :class:`~nxd_moe.moe.MoE` holding the weights of one transformers
  sparse-MoE block, so that ``moe(x)[0]`` equals the block's output.
- :func:`hf_to_nxd_state_dict` / :func:`nxd_to_hf_state_dict` convert whole checkpoints; :func:`load_hf_layer`
  loads one layer of a transformers checkpoint into an ``MoE``.
- ``patch_model`` (:mod:`nxd_moe.models.patch`) replaces every MoE block of a whole transformers model.

Layouts. The transformers side is the in-memory layout of transformers 5 (fused ``experts.gate_up_proj``
tensors). For ``mixtral``, ``qwen3_moe``, ``qwen2_moe`` and ``deepseek_v3`` the Hub checkpoints store one module
per expert instead (``experts.K.w1/w3/w2.weight`` under ``block_sparse_moe`` for Mixtral,
``experts.K.gate_proj/up_proj/down_proj.weight`` otherwise), which transformers fuses on load
(``transformers/conversion_mapping.py``) and splits again in ``save_pretrained``; both are accepted, and
``nxd_to_hf_state_dict(..., layout="hub")`` writes the per-expert one. GPT-OSS, Llama 4 and DBRX keep the same
names in memory and on the Hub. The nxd side keeps each block's module path (``model.layers.N.mlp.``,
``...feed_forward.``, ``transformer.blocks.N.ffn.``) followed by this package's ``MoE`` state-dict keys. Every
other key passes through unchanged, so a whole checkpoint converts and converts back exactly.
"""

from __future__ import annotations

import abc
import functools
import re
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from nxd_moe import parallel_state

from nxd_moe.activations import ACT2FN
from nxd_moe.build import build_moe
from nxd_moe.config import (
    DEFAULT_BLOCK_SIZE,
    MoEModelConfig,
    RouterSpec,
    SharedExpertsSpec,
    builtin_config_names,
    load_model_config,
)
from nxd_moe.extras import require
from nxd_moe.moe import MoE
from nxd_moe.parallel.sharding import load_full_state_dict
from nxd_moe.quantization.checkpoint import mxfp4_from_gpt_oss, mxfp4_to_gpt_oss

# The transformers interop: without transformers, importing it is the error (naming the extra), not a later call.
require("transformers", "nxd_moe.hf")

__all__ = [
    "HF_QUANT_METHODS",
    "LAYOUTS",
    "SUPPORTED_MODEL_TYPES",
    "check_experts_support",
    "from_hf_config",
    "from_hf_moe_block",
    "hf_to_nxd_state_dict",
    "load_hf_layer",
    "nxd_to_hf_state_dict",
    "patch_model",  # noqa: F822 (loaded by the module __getattr__ below)
    "register_experts_implementations",
    "set_experts_implementation",
    "unsaved_formats",
]

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "llama4_text", "llama4",
                         "dbrx")
LAYOUTS = ("transformers", "hub")

StateDict = Mapping[str, Any]

# HF's ACT2FN spells SiLU both ways; every other name must exist in ours with the same meaning.
_ACT_ALIASES = {"swish": "silu"}


# ----------------------------------------------------------------------------------------------
# configs


def _hf_config_object(config: Any) -> Any:
    """A transformers config object from an object or a ``config.json`` dict.

    A dict goes through ``AutoConfig.for_model`` so that keys left out of the file take transformers' defaults
    (``save_pretrained`` omits keys equal to the class default).
    """
    if isinstance(config, Mapping):
        model_type = config.get("model_type")
        if not isinstance(model_type, str):
            raise ValueError(f"from_hf_config: a config dict needs a 'model_type' string; "
                             f"supported: {list(SUPPORTED_MODEL_TYPES)}")
        _check_model_type(model_type)
        from transformers import AutoConfig

        return AutoConfig.for_model(**config)
    if not isinstance(getattr(config, "model_type", None), str):
        raise TypeError(f"from_hf_config: config must be a transformers PretrainedConfig or a dict, "
                        f"got {type(config).__name__}")
    return config


def _check_model_type(model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported by nxd_moe.hf; "
                         f"supported: {list(SUPPORTED_MODEL_TYPES)}")


def _field(config: Any, name: str, model_type: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"from_hf_config({model_type}): config.{name} must be set, got None")
    return value


def _hidden_act(name: Any, model_type: str, field_name: str = "hidden_act") -> str:
    act = _ACT_ALIASES.get(name, name)
    if act not in ACT2FN:
        raise ValueError(f"from_hf_config({model_type}): {field_name}={name!r} is not supported; "
                         f"the experts support {sorted(ACT2FN)}")
    return act


def _mixtral(cfg: Any) -> dict[str, Any]:
    t = "mixtral"
    return dict(
        num_experts=_field(cfg, "num_local_experts", t),
        top_k=_field(cfg, "num_experts_per_tok", t),
        hidden_size=_field(cfg, "hidden_size", t),
        intermediate_size=_field(cfg, "intermediate_size", t),
        router=RouterSpec(type="topk", act_fn="softmax"),
        experts=dict(hidden_act=_hidden_act(cfg.hidden_act, t), glu_mlp=True, normalize_top_k_affinities=True),
        num_moe_layers=_field(cfg, "num_hidden_layers", t),
    )


def _qwen_moe_layers(cfg: Any, model_type: str) -> int:
    """The decoder-layer rule of Qwen2/Qwen3-MoE: sparse unless listed in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer."""
    step = _field(cfg, "decoder_sparse_step", model_type)
    dense = set(cfg.mlp_only_layers or ())
    return sum(1 for i in range(_field(cfg, "num_hidden_layers", model_type)) if i not in dense and (i + 1) % step == 0)


def _qwen(cfg: Any, model_type: str) -> dict[str, Any]:
    if not _field(cfg, "num_experts", model_type):
        raise ValueError(f"from_hf_config({model_type}): config.num_experts is 0, the model has no MoE layer")
    out = dict(
        num_experts=cfg.num_experts,
        top_k=_field(cfg, "num_experts_per_tok", model_type),
        hidden_size=_field(cfg, "hidden_size", model_type),
        intermediate_size=_field(cfg, "moe_intermediate_size", model_type),
        router=RouterSpec(type="topk", act_fn="softmax"),
        experts=dict(hidden_act=_hidden_act(cfg.hidden_act, model_type), glu_mlp=True,
                     normalize_top_k_affinities=bool(cfg.norm_topk_prob)),
        num_moe_layers=_qwen_moe_layers(cfg, model_type),
    )
    if model_type == "qwen2_moe":
        out["shared_experts"] = SharedExpertsSpec(
            num_shared_experts=1,
            intermediate_size=_field(cfg, "shared_expert_intermediate_size", model_type),
            gate=True,
        )
    return out


def gpt_oss_swiglu(cfg: Any) -> tuple[float, float | None]:
    """``(alpha, limit)`` of GPT-OSS's clamped SwiGLU as the installed transformers computes it for ``cfg``.

    Where they live depends on the release: later transformers 5 releases read ``config.swiglu_alpha`` /
    ``config.swiglu_limit`` in ``GptOssExperts.__init__``; earlier ones (5.17) hard-code 1.702 / 7.0 there and
    ignore those config keys. So both are read from a ``GptOssExperts`` built for ``cfg`` on the meta device (no
    memory): what the model's own experts will use, whichever shape the config has.
    """
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    t = "gpt_oss"
    for name in ("num_local_experts", "hidden_size", "intermediate_size"):
        _field(cfg, name, t)
    with torch.device("meta"):
        experts = GptOssExperts(cfg)
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"from_hf_config({t}): config.swiglu_alpha must be a number, got {alpha!r}")
    if limit is not None and (not isinstance(limit, (int, float)) or isinstance(limit, bool)):
        raise ValueError(f"from_hf_config({t}): config.swiglu_limit must be a number or None, got {limit!r}")
    return float(alpha), None if limit is None else float(limit)


def _gpt_oss(cfg: Any) -> dict[str, Any]:
    t = "gpt_oss"
    alpha, limit = gpt_oss_swiglu(cfg)
    experts = dict(hidden_act="sigmoid", glu_mlp=True, glu_type="swiglu", hidden_act_scaling_factor=alpha,
                   hidden_act_bias=1.0, bias=True, normalize_top_k_affinities=False)
    if limit is not None:
        # HF clamps the gate from above only and the up projection on both sides.
        experts.update(gate_clamp_upper_limit=limit, up_clamp_lower_limit=-limit, up_clamp_upper_limit=limit)
    return dict(
        num_experts=_field(cfg, "num_local_experts", t),
        top_k=_field(cfg, "num_experts_per_tok", t),
        hidden_size=_field(cfg, "hidden_size", t),
        intermediate_size=_field(cfg, "intermediate_size", t),
        router=RouterSpec(type="topk", act_fn="softmax", apply_act_fn_over_topk=True, bias=True),
        experts=experts,
        num_moe_layers=_field(cfg, "num_hidden_layers", t),
    )


def _deepseek_v3(cfg: Any) -> dict[str, Any]:
    t = "deepseek_v3"
    num_layers = _field(cfg, "num_hidden_layers", t) - (cfg.first_k_dense_replace or 0)
    if num_layers <= 0:
        raise ValueError(f"from_hf_config({t}): first_k_dense_replace={cfg.first_k_dense_replace} >= "
                         f"num_hidden_layers={cfg.num_hidden_layers}, the model has no MoE layer")
    out = dict(
        num_experts=_field(cfg, "n_routed_experts", t),
        top_k=_field(cfg, "num_experts_per_tok", t),
        hidden_size=_field(cfg, "hidden_size", t),
        intermediate_size=_field(cfg, "moe_intermediate_size", t),
        router=RouterSpec(type="group_limited", act_fn="sigmoid", n_group=_field(cfg, "n_group", t),
                          topk_group=_field(cfg, "topk_group", t), normalize=bool(cfg.norm_topk_prob),
                          routed_scaling_factor=_field(cfg, "routed_scaling_factor", t)),
        # The router already normalises and scales (GroupLimitedRouter's contract).
        experts=dict(hidden_act=_hidden_act(cfg.hidden_act, t), glu_mlp=True, normalize_top_k_affinities=False),
        num_moe_layers=num_layers,
    )
    if cfg.n_shared_experts:
        # HF fuses them into one MLP of width moe_intermediate_size * n_shared_experts, as SharedExperts does.
        out["shared_experts"] = SharedExpertsSpec(num_shared_experts=cfg.n_shared_experts,
                                                  intermediate_size=cfg.moe_intermediate_size)
    return out


def _llama4_text(cfg: Any) -> dict[str, Any]:
    t = "llama4_text"
    return dict(
        num_experts=_field(cfg, "num_local_experts", t),
        top_k=_field(cfg, "num_experts_per_tok", t),
        hidden_size=_field(cfg, "hidden_size", t),
        intermediate_size=_field(cfg, "intermediate_size", t),
        router=RouterSpec(type="topk", act_fn="sigmoid"),
        experts=dict(hidden_act=_hidden_act(cfg.hidden_act, t), glu_mlp=True, early_expert_affinity_modulation=True,
                     normalize_top_k_affinities=False),
        shared_experts=SharedExpertsSpec(num_shared_experts=1, intermediate_size=cfg.intermediate_size),
        # moe_layers is derived from interleave_moe_layer_step unless the config lists the layers itself.
        num_moe_layers=len(_field(cfg, "moe_layers", t)),
    )


def _dbrx(cfg: Any) -> dict[str, Any]:
    t = "dbrx"
    ffn = _field(cfg, "ffn_config", t)
    p = ffn.moe_normalize_expert_weights
    if p is not None and p != 1:
        raise ValueError(f"from_hf_config(dbrx): ffn_config.moe_normalize_expert_weights={p!r} is not supported; "
                         "only None (no normalisation) and 1 (L1 renormalisation of the top-k weights) map onto "
                         "normalize_top_k_affinities")
    act_name = (ffn.ffn_act_fn or {}).get("name", "silu")
    return dict(
        num_experts=_field(ffn, "moe_num_experts", t),
        top_k=_field(ffn, "moe_top_k", t),
        hidden_size=_field(cfg, "d_model", t),
        intermediate_size=_field(ffn, "ffn_hidden_size", t),
        router=RouterSpec(type="topk", act_fn="softmax"),
        experts=dict(hidden_act=_hidden_act(act_name, t, "ffn_config.ffn_act_fn['name']"), glu_mlp=True,
                     normalize_top_k_affinities=p is not None),
        num_moe_layers=_field(cfg, "n_layers", t),
    )


_CONFIG_READERS = {
    "mixtral": _mixtral,
    "qwen3_moe": lambda cfg: _qwen(cfg, "qwen3_moe"),
    "qwen2_moe": lambda cfg: _qwen(cfg, "qwen2_moe"),
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "llama4_text": _llama4_text,
    "dbrx": _dbrx,
}


@functools.lru_cache(maxsize=None)
def _shipped_configs() -> tuple[MoEModelConfig, ...]:
    return tuple(load_model_config(name) for name in builtin_config_names())


def _blockwise_for(fields: Mapping[str, Any], model_type: str) -> tuple[str | None, dict[str, Any]]:
    """``(name of the matching shipped config or None, blockwise section)``.

    A config whose architecture numbers match a shipped one exactly reuses that file's blockwise section (the
    settings NxD's model cards run it with). Otherwise only the block size is inherited, and only when every
    shipped config of the model type agrees on it (Llama 4: 256); else NxD's default of 512.
    """
    same_type = [c for c in _shipped_configs() if c.hf_model_type == model_type]
    for shipped in same_type:
        if all(getattr(shipped, k) == fields[k] for k in ("num_experts", "top_k", "hidden_size", "intermediate_size")):
            return shipped.name, dict(shipped.blockwise)
    sizes = {c.blockwise.get("block_size", DEFAULT_BLOCK_SIZE) for c in same_type}
    return None, {"block_size": sizes.pop() if len(sizes) == 1 else DEFAULT_BLOCK_SIZE}


def from_hf_config(config: Any, *, blockwise: Mapping[str, Any] | None = None) -> MoEModelConfig:
    """The :class:`MoEModelConfig` of one MoE layer of a transformers model.

    ``config``: a transformers ``PretrainedConfig`` or its dict (``config.json``) of a supported model type
    (:data:`SUPPORTED_MODEL_TYPES`); a ``llama4`` config is read through its ``text_config``. ``blockwise``
    replaces the blockwise section. By default a config whose E, k, H and I match a shipped one
    (``configs/*.yaml``) reuses that file's whole blockwise section; any other gets only the block size the
    shipped configs of its model type agree on (Llama 4: 256), else NxD's default 512.

    Train-time-only settings (router jitter, auxiliary losses) have no inference effect and are ignored.
    """
    if isinstance(config, MoEModelConfig):
        raise TypeError("from_hf_config: config is already an MoEModelConfig; pass a transformers config or dict")
    cfg = _hf_config_object(config)
    model_type = cfg.model_type
    _check_model_type(model_type)
    if model_type == "llama4":
        cfg = _field(cfg, "text_config", model_type)
        model_type = cfg.model_type
    fields = _CONFIG_READERS[model_type](cfg)
    shipped_name, shipped_blockwise = _blockwise_for(fields, model_type)
    return MoEModelConfig(
        name=f"hf:{shipped_name or model_type}",
        hf_model_type=model_type,
        blockwise=dict(shipped_blockwise if blockwise is None else blockwise),
        source=f"nxd_moe.hf.from_hf_config({type(cfg).__name__})",
        **fields,
    )


def _model_config(config: Any) -> MoEModelConfig:
    """Accept an :class:`MoEModelConfig` made for an HF model type, or anything :func:`from_hf_config` takes."""
    if isinstance(config, MoEModelConfig):
        if config.hf_model_type not in _FAMILIES:
            raise ValueError(f"config.hf_model_type {config.hf_model_type!r} is not one nxd_moe.hf converts; "
                             f"supported: {sorted(_FAMILIES)}")
        return config
    return from_hf_config(config)


# ----------------------------------------------------------------------------------------------
# weight layouts of one block
#
# Every family converts between the block's HF keys (relative to the block module, e.g. "experts.gate_up_proj")
# and our MoE's state-dict keys. Expected HF keys and shapes are derived by running ``from_nxd`` on a meta-device
# MoE built from the config, so each layout is written once, in one direction per function.

_ROUTER_W = "router.linear_router.weight"
_ROUTER_B = "router.linear_router.bias"
_SCORE_BIAS = "router.e_score_correction_bias"
_GATE_UP_W = "expert_mlps.mlp_op.gate_up_proj.weight"
_GATE_UP_S = "expert_mlps.mlp_op.gate_up_proj.scale"
_GATE_UP_B = "expert_mlps.mlp_op.gate_up_proj.bias"
_DOWN_W = "expert_mlps.mlp_op.down_proj.weight"
_DOWN_S = "expert_mlps.mlp_op.down_proj.scale"
_DOWN_B = "expert_mlps.mlp_op.down_proj.bias"
_SHARED_PROJS = ("gate_proj", "up_proj", "down_proj")
_SHARED_GATE = "shared_experts.shared_expert_gate.weight"
_NXD_OWNED = ("router.", "expert_mlps.", "shared_experts.")


def _split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(..., 2I)`` ``[gate | up]`` -> two ``(..., I)`` halves."""
    return gate_up.chunk(2, dim=-1)


def _deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS ``(..., 2I)`` with gate in even and up in odd columns -> ``[gate | up]``."""
    return torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)


def _interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """``[gate | up]`` ``(..., 2I)`` -> GPT-OSS's even/odd interleaving."""
    gate, up = _split_gate_up(gate_up)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _shared_to_nxd(parts: StateDict, hf_name: str) -> dict[str, torch.Tensor]:
    """The shared experts' HF tensors ``<hf_name>.<proj>.weight (out, in)`` -> ours. An FP8 128x128 block-scaled
    projection (``weight_scale_inv (out/128, in/128)`` beside it, as in DeepSeek-V3's checkpoints) keeps its
    bytes, stored ``(in, out)`` as our quantized projections are."""
    out = {}
    for proj in _SHARED_PROJS:
        key = f"{hf_name}.{proj}.weight"
        if key + "_scale_inv" in parts:
            out[f"shared_experts.{proj}.weight"] = parts[key].t()
            out[f"shared_experts.{proj}.scale"] = parts[key + "_scale_inv"].t()
        else:
            out[f"shared_experts.{proj}.weight"] = parts[key]
    return out


def _shared_from_nxd(nxd: StateDict, hf_name: str, block: str) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_shared_to_nxd`."""
    quantization = _nxd_quantization(nxd, "shared_experts.down_proj.")
    if quantization not in ("bf16", "fp8_block"):
        raise ValueError(f"{block}: quantized shared experts ({quantization!r}) export as FP8 128x128 block-scaled "
                         "tensors only (DeepSeek-V3's weight_scale_inv): use shared quantization 'fp8_block'")
    out = {}
    for proj in _SHARED_PROJS:
        key, weight = f"{hf_name}.{proj}.weight", nxd[f"shared_experts.{proj}.weight"]
        if quantization == "bf16":
            out[key] = weight
        else:
            out[key], out[key + "_scale_inv"] = weight.t(), nxd[f"shared_experts.{proj}.scale"].t()
    return out


def _check_unquantized_export(nxd: StateDict, block: str) -> None:
    """For blocks whose checkpoints store the routed experts in the model's dtype only (Llama 4, DBRX)."""
    quantization = _nxd_quantization(nxd)
    if quantization != "bf16":
        raise ValueError(f"{block}: quantized experts ({quantization!r}) have no checkpoint form in this model's "
                         "layout; only unquantized experts export")


class _Family(abc.ABC):
    """How one HF model family lays out its MoE block.

    ``module``: the block's attribute name in transformers (``hub_module`` on the Hub); ``container``: the
    ``ModuleList`` of decoder layers; ``owned``: key prefixes, relative to the block, that belong to the MoE
    (anything else under the block, such as DeepSeek's dense-MLP ``gate_proj``, is not ours and passes through);
    ``block_classes``: transformers class names of the block.
    """

    module = "mlp"
    hub_module = "mlp"
    container = "layers"
    owned: tuple[str, ...] = ()
    block_classes: tuple[str, ...] = ()
    # The shared experts' module within the block (None: none); the quantized formats of the routed experts whose
    # checkpoints transformers loads for this family (see :func:`unsaved_formats`).
    shared: str | None = None
    saved_quantization: tuple[str, ...] = ()

    def __init__(self) -> None:
        modules = "|".join(sorted({self.module, self.hub_module}))
        self.block_re = re.compile(
            rf"^(?P<pre>(?:.*\.)?{self.container}\.(?P<layer>\d+)\.)(?P<module>{modules})\.(?P<rest>.+)$")

    def owns(self, rest: str) -> bool:
        return rest.startswith(self.owned)

    def is_hub(self, parts: StateDict) -> bool:
        """Whether a block's HF keys use the Hub's per-expert layout."""
        return False

    @abc.abstractmethod
    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        """One block's HF tensors (validated keys and shapes) -> our MoE's state dict."""

    @abc.abstractmethod
    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        """Our MoE's state dict -> the block's HF tensors in ``layout`` (one of :data:`LAYOUTS`)."""


class _FusedFamily(_Family):
    """Mixtral, Qwen2/Qwen3-MoE and DeepSeek-V3.

    transformers: ``gate.weight (E, H)``, ``experts.gate_up_proj (E, 2I, H)`` (rows ``[gate; up]``),
    ``experts.down_proj (E, H, I)``. Hub: ``experts.K.<gate>.weight``/``<up>`` ``(I, H)``, ``<down> (H, I)``.
    """

    _PER_EXPERT = re.compile(r"^experts\.\d+\.")
    saved_quantization = ("fp8_block",)

    def __init__(self, block_classes: tuple[str, ...], expert_names: tuple[str, str, str] = _SHARED_PROJS,
                 hub_module: str = "mlp", shared: str | None = None, shared_gate: bool = False,
                 score_bias: bool = False):
        self.hub_module = hub_module
        self.block_classes = block_classes
        self.expert_names = expert_names
        self.shared = shared
        self.shared_gate = shared_gate
        self.score_bias = score_bias
        self.owned = ("gate.", "experts.") + ((f"{shared}.",) if shared else ()) + (
            ("shared_expert_gate.",) if shared_gate else ())
        super().__init__()

    def is_hub(self, parts: StateDict) -> bool:
        return any(self._PER_EXPERT.match(k) for k in parts)

    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        out = {_ROUTER_W: parts["gate.weight"]}
        if self.score_bias:
            out[_SCORE_BIAS] = parts["gate.e_score_correction_bias"]
        if self.is_hub(parts):
            gate, up, down = self.expert_names
            gate_up = torch.stack([torch.cat([parts[f"experts.{e}.{gate}.weight"], parts[f"experts.{e}.{up}.weight"]])
                                   for e in range(num_experts)])
            down_hi = torch.stack([parts[f"experts.{e}.{down}.weight"] for e in range(num_experts)])
            if _hf_quantization(parts)[0] == "fp8_block":  # (out/128, in/128) tiles per expert, like the weights
                out[_GATE_UP_S] = torch.stack([torch.cat([parts[f"experts.{e}.{gate}.weight_scale_inv"],
                                                          parts[f"experts.{e}.{up}.weight_scale_inv"]])
                                               for e in range(num_experts)]).transpose(1, 2)
                out[_DOWN_S] = torch.stack([parts[f"experts.{e}.{down}.weight_scale_inv"]
                                            for e in range(num_experts)]).transpose(1, 2)
        else:
            gate_up, down_hi = parts["experts.gate_up_proj"], parts["experts.down_proj"]
        out[_GATE_UP_W] = gate_up.transpose(1, 2)  # (E, 2I, H) rows [gate; up] -> (E, H, 2I) columns [gate | up]
        out[_DOWN_W] = down_hi.transpose(1, 2)  # (E, H, I) -> (E, I, H)
        if self.shared:
            out.update(_shared_to_nxd(parts, self.shared))
        if self.shared_gate:
            out[_SHARED_GATE] = parts["shared_expert_gate.weight"]
        return out

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        out = {"gate.weight": nxd[_ROUTER_W]}
        if self.score_bias:
            out["gate.e_score_correction_bias"] = nxd[_SCORE_BIAS]
        gate_up, down = nxd[_GATE_UP_W], nxd[_DOWN_W]
        quantization = _nxd_quantization(nxd)
        if quantization not in ("bf16", "fp8_block") or (quantization != "bf16" and layout != "hub"):
            raise ValueError(f"{self.block_classes[0]}: quantized experts ({quantization!r}) export as the Hub's "
                             "FP8 128x128 block-scaled per-expert tensors only: use quantization 'fp8_block' and "
                             "layout='hub'")
        if layout == "hub":
            gate_name, up_name, down_name = self.expert_names
            gate, up = _split_gate_up(gate_up)
            for e in range(gate_up.shape[0]):
                out[f"experts.{e}.{gate_name}.weight"] = gate[e].t()
                out[f"experts.{e}.{up_name}.weight"] = up[e].t()
                out[f"experts.{e}.{down_name}.weight"] = down[e].t()
            if quantization == "fp8_block":
                gate_s, up_s = _split_gate_up(nxd[_GATE_UP_S])
                for e in range(gate_up.shape[0]):
                    out[f"experts.{e}.{gate_name}.weight_scale_inv"] = gate_s[e].t()
                    out[f"experts.{e}.{up_name}.weight_scale_inv"] = up_s[e].t()
                    out[f"experts.{e}.{down_name}.weight_scale_inv"] = nxd[_DOWN_S][e].t()
        else:
            out["experts.gate_up_proj"] = gate_up.transpose(1, 2)
            out["experts.down_proj"] = down.transpose(1, 2)
        if self.shared:
            out.update(_shared_from_nxd(nxd, self.shared, self.block_classes[0]))
        if self.shared_gate:
            out["shared_expert_gate.weight"] = nxd[_SHARED_GATE]
        return out


class _GptOssFamily(_Family):
    """``router.weight (E, H)``/``router.bias (E,)``; ``experts.gate_up_proj (E, H, 2I)`` and
    ``experts.gate_up_proj_bias (E, 2I)`` with gate/up interleaved; ``experts.down_proj (E, I, H)``,
    ``experts.down_proj_bias (E, H)``."""

    owned = ("router.", "experts.")
    block_classes = ("GptOssMLP",)
    saved_quantization = ("mxfp4",)

    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        out = {
            _ROUTER_W: parts["router.weight"],
            _ROUTER_B: parts["router.bias"],
            _GATE_UP_B: _deinterleave(parts["experts.gate_up_proj_bias"]),
            _DOWN_B: parts["experts.down_proj_bias"],
        }
        if _hf_quantization(parts)[0] == "mxfp4":  # the Hub checkpoint's MXFP4 experts, bytes kept as they are
            for name, weight_key, scale_key, columns in (("gate_up_proj", _GATE_UP_W, _GATE_UP_S, _deinterleave),
                                                         ("down_proj", _DOWN_W, _DOWN_S, lambda t: t)):
                weight, scale = mxfp4_from_gpt_oss(parts[f"experts.{name}_blocks"], parts[f"experts.{name}_scales"],
                                                   f"experts.{name}")
                out[weight_key], out[scale_key] = columns(weight), columns(scale)
        else:
            out[_GATE_UP_W] = _deinterleave(parts["experts.gate_up_proj"])
            out[_DOWN_W] = parts["experts.down_proj"]
        return out

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        out = {
            "router.weight": nxd[_ROUTER_W],
            "router.bias": nxd[_ROUTER_B],
            "experts.gate_up_proj_bias": _interleave(nxd[_GATE_UP_B]),
            "experts.down_proj_bias": nxd[_DOWN_B],
        }
        quantization = _nxd_quantization(nxd)
        if quantization == "mxfp4":
            for name, weight_key, scale_key, columns in (("gate_up_proj", _GATE_UP_W, _GATE_UP_S, _interleave),
                                                         ("down_proj", _DOWN_W, _DOWN_S, lambda t: t)):
                blocks, scales = mxfp4_to_gpt_oss(columns(nxd[weight_key]), columns(nxd[scale_key]))
                out[f"experts.{name}_blocks"], out[f"experts.{name}_scales"] = blocks, scales
        elif quantization == "bf16":
            out["experts.gate_up_proj"] = _interleave(nxd[_GATE_UP_W])
            out["experts.down_proj"] = nxd[_DOWN_W]
        else:
            raise ValueError(f"GptOssMLP: quantized experts ({quantization!r}) export as GPT-OSS's MXFP4 tensors only: "
                             "use quantization 'mxfp4'")
        return out


class _Llama4Family(_Family):
    """``router.weight (E, H)``; ``experts.gate_up_proj (E, H, 2I)`` already ``[gate | up]``;
    ``experts.down_proj (E, I, H)``; ``shared_expert.{gate,up,down}_proj.weight``."""

    module = hub_module = "feed_forward"
    owned = ("router.", "experts.", "shared_expert.")
    block_classes = ("Llama4TextMoe",)
    shared = "shared_expert"

    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        return {_ROUTER_W: parts["router.weight"], _GATE_UP_W: parts["experts.gate_up_proj"],
                _DOWN_W: parts["experts.down_proj"], **_shared_to_nxd(parts, "shared_expert")}

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        _check_unquantized_export(nxd, self.block_classes[0])
        return {"router.weight": nxd[_ROUTER_W], "experts.gate_up_proj": nxd[_GATE_UP_W],
                "experts.down_proj": nxd[_DOWN_W], **_shared_from_nxd(nxd, "shared_expert", self.block_classes[0])}


class _DbrxFamily(_Family):
    """``router.layer.weight (E, H)``; ``experts.mlp.w1``/``v1`` (gate/up) and ``w2`` (down), each ``(E*I, H)``
    with expert e in rows ``[e*I, (e+1)*I)``; w1/v1 act as ``x @ w.T``, w2 as ``h @ w``."""

    module = hub_module = "ffn"
    container = "blocks"
    owned = ("router.", "experts.")
    block_classes = ("DbrxFFN",)

    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        def per_expert(name: str) -> torch.Tensor:  # (E*I, H) -> (E, I, H)
            w = parts[f"experts.mlp.{name}"]
            return w.view(num_experts, -1, w.shape[-1])

        return {
            _ROUTER_W: parts["router.layer.weight"],
            _GATE_UP_W: torch.cat([per_expert("w1"), per_expert("v1")], dim=1).transpose(1, 2),
            _DOWN_W: per_expert("w2"),
        }

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        _check_unquantized_export(nxd, self.block_classes[0])
        gate, up = _split_gate_up(nxd[_GATE_UP_W])
        down = nxd[_DOWN_W]
        return {
            "router.layer.weight": nxd[_ROUTER_W],
            "experts.mlp.w1": gate.transpose(1, 2).reshape(-1, gate.shape[1]),
            "experts.mlp.v1": up.transpose(1, 2).reshape(-1, up.shape[1]),
            "experts.mlp.w2": down.reshape(-1, down.shape[-1]),
        }


_FAMILIES: dict[str, _Family] = {
    "mixtral": _FusedFamily(("MixtralSparseMoeBlock",), expert_names=("w1", "w3", "w2"),
                            hub_module="block_sparse_moe"),
    "qwen3_moe": _FusedFamily(("Qwen3MoeSparseMoeBlock",)),
    "qwen2_moe": _FusedFamily(("Qwen2MoeSparseMoeBlock",), shared="shared_expert", shared_gate=True),
    "deepseek_v3": _FusedFamily(("DeepseekV3MoE",), shared="shared_experts", score_bias=True),
    "gpt_oss": _GptOssFamily(),
    "llama4_text": _Llama4Family(),
    "dbrx": _DbrxFamily(),
}


def _family(cfg: MoEModelConfig) -> _Family:
    return _FAMILIES[cfg.hf_model_type]


# transformers' ``quantization_config.quant_method`` of the quantized formats real checkpoints have: GPT-OSS's MXFP4
# (``Mxfp4Config``) and DeepSeek-V3's FP8 with 128x128 block scales (``FineGrainedFP8Config``, which transformers
# reads for every family whose Hub checkpoints store one Linear per expert). Shared experts: FP8 block-scaled only.
HF_QUANT_METHODS = {"mxfp4": "mxfp4", "fp8_block": "fp8"}
_SAVED_SHARED_QUANTIZATION = ("fp8_block",)


def unsaved_formats(cfg: MoEModelConfig, routed: str, shared: str | None) -> str:
    """Why a block of ``cfg``'s family whose routed / shared experts are stored as ``routed`` / ``shared`` (format
    names; None: no shared experts) has no checkpoint transformers loads, or ``""`` if it has one."""
    family = _family(cfg)
    for what, fmt, saved, argument in (("routed", routed, family.saved_quantization, "quantization"),
                                       ("shared", shared, _SAVED_SHARED_QUANTIZATION, "shared_quantization")):
        if fmt in (None, "bf16") or fmt in saved:
            continue
        loads = (f"it loads {saved[0]!r}" if saved else "it loads them unquantized only")
        instead = f"patch with {argument}={saved[0]!r} to save them quantized, or " if saved else ""
        return (f"{what} experts stored as {fmt!r} have no checkpoint format that transformers loads for model_type "
                f"{cfg.hf_model_type!r} ({loads}); {instead}save the model before patching it with "
                f"{argument}={fmt!r}")
    return ""


def _expected_nxd(cfg: MoEModelConfig, quantization: str = "bf16",
                  shared_quantization: str = "bf16") -> dict[str, torch.Tensor]:
    """Our MoE's state dict for ``cfg`` on the meta device: key names and shapes, no storage."""
    shared = {} if cfg.shared_experts is None else {"shared_quantization": shared_quantization}
    return build_moe(cfg, device="meta", model_parallel=False, quantization=quantization, **shared).state_dict()


def _hf_quantization(parts: StateDict) -> tuple[str, str]:
    """The formats of one HF block's routed and shared experts: GPT-OSS MXFP4 ``*_blocks``/``*_scales``,
    DeepSeek-style FP8 ``weight_scale_inv``, else bf16 (the checkpoint's float dtype)."""
    routed, shared = "bf16", "bf16"
    for key in parts:
        if key.startswith("experts."):
            if key.endswith("_blocks"):
                routed = "mxfp4"
            elif key.endswith(".weight_scale_inv"):
                routed = "fp8_block"
        elif key.endswith(".weight_scale_inv"):
            shared = "fp8_block"
    return routed, shared


def _nxd_quantization(parts: StateDict, prefix: str = "expert_mlps.mlp_op.gate_up_proj.") -> str:
    """The format of the projection at ``prefix`` (default: the routed experts') in one of our MoE state dicts,
    read from its stored tensors."""
    scale = parts.get(prefix + "scale")
    if scale is None:
        return "bf16"
    weight = parts[prefix + "weight"]
    if weight.dtype == torch.uint8:
        return "mxfp4"
    return "fp8" if scale.shape[-1] == weight.shape[-1] else "fp8_block"


def _check_keys(given: StateDict, expected: StateDict, where: str, side: str) -> None:
    def listing(keys: Iterable[str]) -> str:
        keys = sorted(keys)
        return ", ".join(repr(where + k) for k in keys[:6]) + (f" ... ({len(keys)} in all)" if len(keys) > 6 else "")

    missing, unexpected = set(expected) - set(given), set(given) - set(expected)
    if missing:
        raise ValueError(f"{side} MoE block {where!r} is missing {listing(missing)}"
                         + ("; merge all checkpoint shards before converting" if side == "HF" else ""))
    if unexpected:
        hint = " (unknown weights are not converted)" if side == "HF" else ""
        raise ValueError(f"{side} MoE block {where!r} has unexpected {listing(unexpected)}{hint}")
    for key, ref in expected.items():
        value = given[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{side} key {where + key!r} must be a torch.Tensor, got {type(value).__name__}")
        if value.shape != ref.shape:
            raise ValueError(f"{side} key {where + key!r} has shape {tuple(value.shape)}, the config expects "
                             f"{tuple(ref.shape)}")


def check_hf_block(parts: StateDict, cfg: MoEModelConfig, expected_nxd: StateDict, where: str) -> None:
    """Raise unless ``parts`` are one HF block's tensors for ``cfg`` (either layout, any stored format): every key
    there and no other, each of the right shape. ``expected_nxd``: :func:`_expected_nxd` of ``cfg`` (bf16)."""
    family = _family(cfg)
    layout = "hub" if family.is_hub(parts) else "transformers"
    quantization = _hf_quantization(parts)
    if quantization != ("bf16", "bf16"):
        expected_nxd = _expected_nxd(cfg, *quantization)
    _check_keys(parts, family.from_nxd(expected_nxd, layout), where, "HF")


def _hf_block_to_nxd(parts: StateDict, cfg: MoEModelConfig, expected_nxd: StateDict,
                     where: str) -> dict[str, torch.Tensor]:
    """One HF block's tensors (checked by :func:`check_hf_block`) as our MoE's state dict. Tensors may be views of
    ``parts``: loading copies them, and writing a checkpoint needs ``.contiguous()``."""
    check_hf_block(parts, cfg, expected_nxd, where)
    return _family(cfg).to_nxd(parts, cfg.num_experts)


def _nxd_block_to_hf(parts: StateDict, cfg: MoEModelConfig, expected_nxd: StateDict, where: str,
                     layout: str) -> dict[str, torch.Tensor]:
    quantization = _nxd_quantization(parts), _nxd_quantization(parts, "shared_experts.down_proj.")
    if quantization != ("bf16", "bf16"):
        expected_nxd = _expected_nxd(cfg, *quantization)
    _check_keys(parts, expected_nxd, where, "nxd")
    return {k: v.contiguous() for k, v in _family(cfg).from_nxd(parts, layout).items()}


BlockMatch = Callable[[str], "tuple[str, str, str] | None"]
BlockConverter = Callable[[StateDict, str], "dict[str, torch.Tensor]"]


def _convert(state_dict: StateDict, match: BlockMatch, convert_block: BlockConverter) -> dict[str, Any]:
    """Group the keys ``match`` claims into blocks, convert each block, pass the rest through; keys keep their
    order (a block takes the place of its first key).

    ``match(key)`` returns ``(source block prefix, target block prefix, key within the block)`` or None.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of str to tensors, got {type(state_dict).__name__}")
    blocks: dict[str, tuple[str, dict[str, Any]]] = {}
    order: list[tuple[bool, str]] = []
    for key, value in state_dict.items():
        claimed = match(key)
        if claimed is None:
            order.append((False, key))
            continue
        source_prefix, target_prefix, rest = claimed
        if source_prefix not in blocks:
            blocks[source_prefix] = (target_prefix, {})
            order.append((True, source_prefix))
        blocks[source_prefix][1][rest] = value
    out: dict[str, Any] = {}
    for is_block, name in order:
        items = [(name, state_dict[name])] if not is_block else [
            (blocks[name][0] + k, v) for k, v in convert_block(blocks[name][1], name).items()]
        for key, value in items:
            if key in out:
                raise ValueError(f"two source keys convert to {key!r}; the state dict holds the same block twice "
                                 "(e.g. in both the transformers and the Hub layout)")
            out[key] = value
    return out


def hf_to_nxd_state_dict(hf_state_dict: StateDict, config: Any) -> dict[str, Any]:
    """A transformers checkpoint (in-memory or Hub per-expert layout) with every MoE block in nxd layout.

    ``config``: the model's transformers config (or dict), or an :class:`MoEModelConfig` with ``hf_model_type``.
    Block ``<path>.layers.N.mlp.`` (Mixtral Hub: ``block_sparse_moe.``, which transformers renames to ``mlp.``)
    becomes ``<path>.layers.N.mlp.`` + our MoE keys. Every MoE block must be complete: merge checkpoint shards
    first. Unknown keys inside an MoE block (e.g. MXFP4 ``_blocks``/``_scales``) raise rather than pass through.
    """
    cfg = _model_config(config)
    family = _family(cfg)
    expected = _expected_nxd(cfg)

    def match(key: str) -> tuple[str, str, str] | None:
        m = family.block_re.match(key)
        if m is None or not family.owns(m["rest"]):
            return None
        return key[:m.start("rest")], f"{m['pre']}{family.module}.", m["rest"]

    return _convert(hf_state_dict, match, lambda parts, where: {
        k: v.contiguous() for k, v in _hf_block_to_nxd(parts, cfg, expected, where).items()})


def nxd_to_hf_state_dict(nxd_state_dict: StateDict, config: Any, *, layout: str = "transformers") -> dict[str, Any]:
    """The inverse of :func:`hf_to_nxd_state_dict`.

    ``layout="transformers"`` (default) gives transformers' in-memory layout (what ``model.state_dict()`` holds
    and ``load_state_dict`` takes); ``layout="hub"`` gives the per-expert layout of the Hub checkpoints
    (identical for GPT-OSS, Llama 4 and DBRX).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"nxd_to_hf_state_dict: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    cfg = _model_config(config)
    family = _family(cfg)
    expected = _expected_nxd(cfg)
    module = family.hub_module if layout == "hub" else family.module

    def match(key: str) -> tuple[str, str, str] | None:
        m = family.block_re.match(key)
        if m is None or m["module"] != family.module or not m["rest"].startswith(_NXD_OWNED):
            return None
        return key[:m.start("rest")], f"{m['pre']}{module}.", m["rest"]

    return _convert(nxd_state_dict, match,
                    lambda parts, where: _nxd_block_to_hf(parts, cfg, expected, where, layout))


def load_hf_layer(moe: MoE, hf_state_dict: StateDict, config: Any, layer: int) -> MoE:
    """Load MoE layer ``layer`` of a transformers checkpoint (either layout) into ``moe`` (strict, with the
    NaN/Inf checks of ``load_state_dict``). A model-parallel ``moe`` takes only this rank's shard. Returns
    ``moe``."""
    if not isinstance(moe, MoE):
        raise TypeError(f"load_hf_layer: moe must be an nxd_moe MoE, got {type(moe).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"load_hf_layer: layer must be an int, got {type(layer).__name__}")
    cfg = _model_config(config)
    family = _family(cfg)
    blocks: dict[str, dict[str, Any]] = {}
    for key, value in hf_state_dict.items():
        m = family.block_re.match(key)
        if m is not None and int(m["layer"]) == layer and family.owns(m["rest"]):
            blocks.setdefault(key[:m.start("rest")], {})[m["rest"]] = value
    if len(blocks) != 1:
        found = "no MoE weights (a dense layer, or out of range)" if not blocks else f"several blocks {sorted(blocks)}"
        raise ValueError(f"load_hf_layer: layer {layer} has {found}")
    (where, parts), = blocks.items()
    check_stored_formats(moe, parts, f"load_hf_layer: layer {layer}'s", "build the layer with")
    return load_full_state_dict(moe, _hf_block_to_nxd(parts, cfg, _expected_nxd(cfg), where))


def layer_formats(moe: MoE) -> tuple[str, str | None]:
    """The weight formats of ``moe``'s routed and shared experts (None: no shared experts)."""
    shared = None if moe.shared_experts is None else moe.shared_experts.down_proj.format.name
    return moe.expert_mlps.routed_experts_mlp_config.quantization, shared


def check_stored_formats(moe: MoE, parts: StateDict, subject: str, remedy: str) -> None:
    """Raise unless one HF block's tensors ``parts`` are stored in ``moe``'s formats (checkpoint tensors load as
    stored, never requantized): ``"<subject> routed experts are stored as 'mxfp4' in the checkpoint, the layer's as
    'bf16': <remedy> quantization='mxfp4'"``."""
    for what, stored, argument, layer_format in zip(("routed", "shared"), _hf_quantization(parts),
                                                    ("quantization", "shared_quantization"), layer_formats(moe)):
        if layer_format is not None and stored != layer_format:
            raise ValueError(f"{subject} {what} experts are stored as {stored!r} in the checkpoint, the layer's as "
                             f"{layer_format!r}: {remedy} {argument}={stored!r}")


def from_hf_moe_block(block: nn.Module, config: Any, **build_kwargs: Any) -> MoE:
    """An :class:`MoE` computing what the transformers sparse-MoE ``block`` computes.

    ``block``: ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``GptOssMLP``,
    ``DeepseekV3MoE``, ``Llama4TextMoe`` or ``DbrxFFN``; ``config``: the model's config (or an
    :class:`MoEModelConfig` for it). ``build_kwargs`` go to :func:`~nxd_moe.build.build_moe` (``block_size``,
    ``backend``, ``validate_inputs``, experts overrides...); ``dtype`` and ``device`` default to those of the
    block's weights. Weights are copied with a strict ``load_state_dict``; under model parallelism the layer is
    sharded and each rank keeps its shard. The layer is built on the meta device first, so the only memory
    allocated is the layer's own weights (plus, for GPT-OSS and DBRX, one temporary gate/up projection).

    A block whose experts are stored quantized (GPT-OSS MXFP4 ``*_blocks``/``*_scales``, DeepSeek-style FP8
    ``weight_scale_inv``) loads as stored: ``quantization``/``shared_quantization`` default to the stored formats
    and must equal them if given (quantize a bf16 layer with :func:`~nxd_moe.quantization.quantizer.quantize_experts`).

    ``moe(x)[0]`` matches the block's output (for ``GptOssMLP`` and ``Llama4TextMoe``, the first element of
    the tuple the block returns) up to floating-point rounding; the router runs in float32 as in NxD.
    """
    if not isinstance(block, nn.Module):
        raise TypeError(f"from_hf_moe_block: block must be an nn.Module, got {type(block).__name__}")
    if "scale" in build_kwargs:
        raise TypeError("from_hf_moe_block: 'scale' would change the shapes the block's weights need")
    cfg = _model_config(config)
    family = _family(cfg)
    if not any(c.__name__ in family.block_classes for c in type(block).__mro__):
        raise TypeError(f"from_hf_moe_block: config is {cfg.hf_model_type!r}, whose MoE block is "
                        f"{' or '.join(family.block_classes)}, got {type(block).__name__}")
    parts = block.state_dict()
    nxd = _hf_block_to_nxd(parts, cfg, _expected_nxd(cfg), f"{type(block).__name__}.")
    routed, shared = _hf_quantization(parts)
    build_kwargs.setdefault("quantization", routed)
    if cfg.shared_experts is not None:
        build_kwargs.setdefault("shared_quantization", shared)
    # The layer dtype: the experts' weights', or where they are stored quantized the router's (the model's dtype).
    reference = nxd[_DOWN_W] if routed == "bf16" else nxd[_ROUTER_W]
    build_kwargs.setdefault("dtype", reference.dtype)
    device = build_kwargs.pop("device", reference.device)
    moe = build_moe(cfg, device="meta", **build_kwargs).to_empty(device=device)
    for module in moe.modules():  # to_empty left the SPMD rank (not in any checkpoint) uninitialised
        if isinstance(module, parallel_state.SPMDRank):
            module.reset_rank()
    check_stored_formats(moe, parts, "from_hf_moe_block: the block's", "build with")
    if reference.is_meta:  # a block without values (a model built on the meta device): load its weights later
        return moe
    return load_full_state_dict(moe, nxd)


def __getattr__(name: str) -> Any:
    # patch_model lives in nxd_moe.models, which imports this module: loaded on first use.
    if name == "patch_model":
        from nxd_moe.models.patch import patch_model

        return patch_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# transformers' experts interface: experts_implementation="nxd_moe" / "nxd_moe_torch" / "nxd_moe_triton".
# Imported last so that nxd_moe.models, which builds on this module, finds every name above defined.

from nxd_moe.models.experts_backend import (  # noqa: E402
    check_experts_support,
    register_experts_implementations,
    set_experts_implementation,
)

register_experts_implementations()
