"""Whole transformers models of the shipped architectures, with random weights, at any scale.

:func:`build_hf_model` turns a config (``configs/*.yaml`` or an :class:`~nxd_moe.config.MoEModelConfig`) into the
transformers ``...ForCausalLM`` of its ``hf_model_type``: the MoE layer from the config's MoE fields (scaled as
:meth:`MoEModelConfig.scaled <nxd_moe.config.MoEModelConfig.scaled>` scales them), everything else (attention,
vocabulary, rope, dense layers) from its ``transformers`` section, one table of the models' public ``config.json``
values. Every model it builds reads back through :func:`nxd_moe.hf.from_hf_config` as the same MoE layer.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping, NamedTuple

import torch

from nxd_moe.build import scaled_model
from nxd_moe.checks import check_int, to_torch_dtype
from nxd_moe.hf.configs import from_hf_config
from nxd_moe.model_config import MoEModelConfig, load_model_config, scaled_width

__all__ = ["HF_MODEL_TYPES", "build_hf_config", "build_hf_model"]

# Keys of a ``transformers`` section that are widths: divided by ``scale`` like H and I. ``vocab_size`` too, so a
# scaled model has a small vocabulary (its embedding and LM head are (V / scale, H)). Head counts are kept: they
# are structure (the GQA grouping, which tensor-parallel degrees divide them); the head widths shrink instead.
WIDTH_KEYS = frozenset({"vocab_size", "intermediate_size", "intermediate_size_mlp", "head_dim", "q_lora_rank",
                        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
# Per-layer lists that transformers derives from the layer count: a section giving them would fix the count.
PER_LAYER_KEYS = frozenset({"layer_types", "moe_layers", "no_rope_layers", "mlp_only_layers"})

# The fields of RoutedExpertsMLPOpsConfig that say what the experts compute (not how they are stored or run).
_EXPERT_FUNCTION_FIELDS = ("num_experts", "hidden_size", "intermediate_size", "top_k", "hidden_act", "glu_mlp",
                           "bias", "glu_type", "hidden_act_scaling_factor", "hidden_act_bias",
                           "gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit",
                           "up_clamp_lower_limit", "normalize_top_k_affinities", "early_expert_affinity_modulation")


# ----------------------------------------------------------------------------------------------------------
# each family: the transformers config keys its MoE layer and layer count decide
#
# ``moe`` is the scaled config, ``layers`` the number of MoE layers, ``probe`` the transformers config of the
# ``transformers`` section alone (for the dense-layer pattern it sets, e.g. DeepSeek's first_k_dense_replace).


def _qwen_moe(moe: MoEModelConfig, layers: int, probe: Any) -> dict[str, Any]:
    experts = moe.routed_experts_config()
    out = dict(hidden_size=moe.hidden_size, num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
               moe_intermediate_size=moe.intermediate_size, norm_topk_prob=experts.normalize_top_k_affinities,
               hidden_act=experts.hidden_act, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=layers)
    if probe.model_type == "qwen2_moe":
        if moe.shared_experts is None:
            raise ValueError(f"build_hf_model: qwen2_moe has a gated shared expert; config {moe.name!r} has none")
        out["shared_expert_intermediate_size"] = moe.shared_intermediate_size * moe.shared_experts.num_shared_experts
    return out


def _mixtral(moe: MoEModelConfig, layers: int, probe: Any) -> dict[str, Any]:
    return dict(hidden_size=moe.hidden_size, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                intermediate_size=moe.intermediate_size, hidden_act=moe.routed_experts_config().hidden_act,
                num_hidden_layers=layers)


def _gpt_oss(moe: MoEModelConfig, layers: int, probe: Any) -> dict[str, Any]:
    experts = moe.routed_experts_config()
    return dict(hidden_size=moe.hidden_size, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                intermediate_size=moe.intermediate_size, swiglu_alpha=experts.hidden_act_scaling_factor,
                swiglu_limit=experts.gate_clamp_upper_limit, num_hidden_layers=layers)


def _deepseek_v3(moe: MoEModelConfig, layers: int, probe: Any) -> dict[str, Any]:
    router = moe.router
    return dict(hidden_size=moe.hidden_size, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                moe_intermediate_size=moe.intermediate_size, n_group=router.n_group, topk_group=router.topk_group,
                norm_topk_prob=router.normalize, routed_scaling_factor=router.routed_scaling_factor,
                n_shared_experts=0 if moe.shared_experts is None else moe.shared_experts.num_shared_experts,
                hidden_act=moe.routed_experts_config().hidden_act,
                # the dense layers come first, then the MoE layers
                num_hidden_layers=probe.first_k_dense_replace + layers)


def _llama4_text(moe: MoEModelConfig, layers: int, probe: Any) -> dict[str, Any]:
    return dict(hidden_size=moe.hidden_size, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                intermediate_size=moe.intermediate_size, hidden_act=moe.routed_experts_config().hidden_act,
                # layer i is MoE when (i + 1) % step == 0: each MoE layer follows step - 1 dense ones
                num_hidden_layers=probe.interleave_moe_layer_step * layers)


def _dbrx(moe: MoEModelConfig, layers: int, probe: Any) -> dict[str, Any]:
    experts = moe.routed_experts_config()
    ffn = dict(ffn_hidden_size=moe.intermediate_size, moe_num_experts=moe.num_experts, moe_top_k=moe.top_k,
               moe_normalize_expert_weights=1.0 if experts.normalize_top_k_affinities else None,
               ffn_act_fn={"name": experts.hidden_act})
    return dict(d_model=moe.hidden_size, ffn_config=ffn, n_layers=layers)


class _Family(NamedTuple):
    config_class: str
    model_keys: Callable[[MoEModelConfig, int, Any], dict[str, Any]]
    # the (heads, kv heads) keys; ``a.b`` is key b of the mapping a
    heads: tuple[str, str] = ("num_attention_heads", "num_key_value_heads")
    # keys the modeling code reads with getattr although the config class has no such field
    extra_keys: frozenset[str] = frozenset()


_FAMILIES = {
    "qwen3_moe": _Family("Qwen3MoeConfig", _qwen_moe, extra_keys=frozenset({"head_dim"})),
    "qwen2_moe": _Family("Qwen2MoeConfig", _qwen_moe, extra_keys=frozenset({"head_dim"})),
    "mixtral": _Family("MixtralConfig", _mixtral),
    "gpt_oss": _Family("GptOssConfig", _gpt_oss),
    "deepseek_v3": _Family("DeepseekV3Config", _deepseek_v3),
    "llama4_text": _Family("Llama4TextConfig", _llama4_text),
    "dbrx": _Family("DbrxConfig", _dbrx, heads=("n_heads", "attn_config.kv_n_heads")),
}
HF_MODEL_TYPES = tuple(_FAMILIES)


def _get(section: Mapping[str, Any], defaults: Any, path: str) -> Any:
    """``section[path]`` (``a.b`` reads a nested mapping), else the transformers default."""
    head, _, rest = path.partition(".")
    value = section.get(head, getattr(defaults, head, None))
    if not rest:
        return value
    return value[rest] if isinstance(value, Mapping) else getattr(value, rest)


def _set(section: dict[str, Any], defaults: Any, path: str, value: Any) -> None:
    head, _, rest = path.partition(".")
    if not rest:
        section[head] = value
        return
    inner = section.get(head)
    inner = dict(inner) if isinstance(inner, Mapping) else getattr(defaults, head).to_dict()
    inner[rest] = value
    section[head] = inner


def _heads_for_width(width: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """Head counts for a model whose head width is ``width / heads``: the most heads (at most ``heads``) that
    leave an even head width (rope rotates pairs), and the most kv heads that divide them."""
    heads = math.gcd(heads, width // 2)
    return heads, math.gcd(kv_heads, heads)


def _scaled_section(section: Mapping[str, Any], scale: int, hidden_size: int, family: _Family, defaults: Any,
                    skip: Mapping[str, Any]) -> dict[str, Any]:
    """The section with every width (given, or transformers' default) but those in ``skip`` divided by
    ``scale``."""
    out = dict(section)
    for key in WIDTH_KEYS - set(skip):
        value = _get(out, defaults, key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = scaled_width(value, scale)
    if _get(out, defaults, "head_dim") is None:  # the model divides hidden_size among the heads
        heads, kv_heads = _heads_for_width(hidden_size, *(_get(out, defaults, k) for k in family.heads))
        for key, value in zip(family.heads, (heads, kv_heads)):
            _set(out, defaults, key, value)
    return out


def _check_round_trip(hf_config: Any, moe: MoEModelConfig) -> None:
    """The transformers model must compute the config's MoE layer: :func:`from_hf_config` reads it back."""
    back = from_hf_config(hf_config)
    ours, theirs = moe.routed_experts_config(), back.routed_experts_config()
    differ = [f"experts.{f}" for f in _EXPERT_FUNCTION_FIELDS if getattr(ours, f) != getattr(theirs, f)]
    if moe.router != back.router:
        differ.append("router")

    def shared(cfg: MoEModelConfig) -> tuple | None:
        s = cfg.shared_experts
        return None if s is None else (s.num_shared_experts, cfg.shared_intermediate_size, s.gate)

    if shared(moe) != shared(back):
        differ.append("shared_experts")
    if differ:
        raise ValueError(f"build_hf_model: config {moe.name!r} is not a transformers {hf_config.model_type} model: "
                         f"{', '.join(differ)} differ from what transformers' {type(hf_config).__name__} can hold")


def build_hf_config(config: MoEModelConfig | str | os.PathLike | Mapping[str, Any], *, num_layers: int | None = None,
                    scale: int = 1, quantization: str | None = None):
    """The transformers config :func:`build_hf_model` builds its model from (same arguments); no weights."""
    cfg = load_model_config(config)
    family = _FAMILIES.get(cfg.hf_model_type)
    if family is None:
        raise ValueError(f"build_hf_model: config {cfg.name!r} has hf_model_type {cfg.hf_model_type!r}; "
                         f"supported: {list(HF_MODEL_TYPES)}")
    if num_layers is None:
        if cfg.num_moe_layers is None:
            raise ValueError(f"build_hf_model: config {cfg.name!r} has no num_moe_layers; pass num_layers")
        num_layers = cfg.num_moe_layers
    check_int("num_layers", num_layers, minimum=1)
    import transformers

    config_class = getattr(transformers, family.config_class)
    defaults = config_class()
    section = dict(cfg.transformers)
    per_layer = sorted(PER_LAYER_KEYS & set(section))
    if per_layer:
        raise ValueError(f"build_hf_model: config {cfg.name!r}: transformers key(s) {per_layer} are derived from "
                         "the layer count; set the pattern instead (e.g. interleave_moe_layer_step)")
    unknown = sorted(k for k in section if not hasattr(defaults, k) and k not in family.extra_keys)
    if unknown:
        raise ValueError(f"build_hf_model: config {cfg.name!r}: transformers key(s) {unknown} are not "
                         f"{family.config_class} fields")
    moe = scaled_model(cfg, scale, quantization)
    model_keys = family.model_keys(moe, num_layers, config_class(**section))
    owned = sorted(set(model_keys) & set(section))
    if owned:
        raise ValueError(f"build_hf_model: config {cfg.name!r}: transformers key(s) {owned} come from the MoE "
                         "fields and the layer count, not from the transformers section")
    section = _scaled_section(section, scale, moe.hidden_size, family, defaults, skip=model_keys)
    hf_config = config_class(**section, **model_keys)
    _check_round_trip(hf_config, moe)
    return hf_config


def build_hf_model(config: MoEModelConfig | str | os.PathLike | Mapping[str, Any], *, num_layers: int | None = None,
                   scale: int = 1, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                   seed: int = 0, attn_implementation: str | None = None, quantization: str | None = None):
    """The transformers ``...ForCausalLM`` of ``config``'s architecture with random weights, in eval mode.

    ``config``: a shipped config name (``"qwen3-30b-a3b"``), a YAML path, a mapping or an
    :class:`~nxd_moe.config.MoEModelConfig` at full size whose ``hf_model_type`` is one of
    :data:`HF_MODEL_TYPES`. The MoE layer is ``config.scaled(scale)``'s (so ``from_hf_config(model.config)`` gives
    back its E, k, H, I, router and experts); the rest of the model comes from the config's ``transformers``
    section with every width in :data:`WIDTH_KEYS` divided by ``scale`` the same way (vocabulary included; head
    counts kept, except where the head width is ``hidden_size / heads`` (DBRX, Qwen2-MoE): there the most heads
    up to the model's that leave an even head width). Keys the section leaves out take transformers' defaults.

    ``num_layers``: how many MoE decoder layers (default: the config's ``num_moe_layers``). Dense layers the
    architecture places around them come on top: DeepSeek-V3's ``first_k_dense_replace`` dense layers first
    (``num_layers=2`` builds 3 dense + 2 MoE layers), Llama 4 Maverick's dense layer before each MoE layer
    (``interleave_moe_layer_step=2``: 4 layers). So ``from_hf_config(model.config).num_moe_layers == num_layers``.

    Weights are drawn on the CPU from ``seed`` directly in ``dtype``, then moved to ``device``: the same ``seed``
    and ``dtype`` give the same weights on every device (the caller's random state is left as it was). Another
    ``dtype`` draws other values -- transformers initialises each tensor in its own dtype -- so a bfloat16 build is
    not the float32 build rounded (drawing in float32 first would take twice the host memory of the model).
    ``attn_implementation``: transformers' name (``"eager"``, ``"sdpa"``...; default transformers' choice).
    ``quantization``: the expert weight format the model's MoE layers will be quantized to
    (``nxd_moe.hf.patch_model(model, quantization=...)``): the scaled MoE widths are rounded to its blocks too
    (:func:`nxd_moe.build.scaled_model`); the weights built are unquantized.
    """
    dtype = to_torch_dtype(dtype, "dtype")
    hf_config = build_hf_config(config, num_layers=num_layers, scale=scale, quantization=quantization)
    check_int("seed", seed)
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()
