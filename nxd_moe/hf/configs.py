"""transformers configs read as nxd_moe's: :func:`from_hf_config` and what it reads for each model type.

One reader per model type maps the config's fields onto :class:`~nxd_moe.config.MoEModelConfig`'s routing and
activation knobs (section 6.2 of the NxD reference); the blockwise section comes from the shipped config of the same
architecture where there is one (``configs/*.yaml``). ``llama4`` is read through its ``text_config``.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from nxd_moe.activations import ACT2FN
from nxd_moe.model_config import MoEModelConfig, RouterSpec, SharedExpertsSpec, builtin_config_names, load_model_config
from nxd_moe.moe_configs import DEFAULT_BLOCK_SIZE

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "llama4_text", "llama4",
                         "dbrx")

# HF's ACT2FN spells SiLU both ways; every other name must exist in ours with the same meaning.
_ACT_ALIASES = {"swish": "silu"}


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


# One reader per family (a table, _CONFIG_READERS): the families name and derive their fields differently, so
# each reader reads like its transformers config class; the common fields repeat by design.
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

