"""How each transformers model family lays out its sparse-MoE block, and the converters to and from our ``MoE``'s keys.

A family (:class:`Family`, one per model type: :func:`family_of`) names the block's transformers classes, where the
block sits in the model (``model.layers.N.mlp.``, ``...feed_forward.``, ``transformer.blocks.N.ffn.``) and converts
one block's tensors, keyed relative to the block (``experts.gate_up_proj``), to our ``MoE``'s state dict and back,
each layout written once, in one direction per function. The keys and shapes a block must have are derived by
running ``from_nxd`` on a meta-device ``MoE`` built from the config (:mod:`nxd_moe.hf.checkpoints`). Every converter
takes its ``config`` argument through :func:`as_model_config`: a transformers config, its dict, or an
``MoEModelConfig`` of a model type that has a family here.

Layouts (:data:`LAYOUTS`). The transformers side is the in-memory layout of transformers 5 (fused
``experts.gate_up_proj`` tensors). For ``mixtral``, ``qwen3_moe``, ``qwen2_moe`` and ``deepseek_v3`` the Hub
checkpoints store one module per expert instead (``experts.K.w1/w3/w2.weight`` under ``block_sparse_moe`` for
Mixtral, ``experts.K.gate_proj/up_proj/down_proj.weight`` otherwise), which transformers fuses on load
(``transformers/conversion_mapping.py``) and splits again in ``save_pretrained``; both are read, and ``"hub"`` writes
the per-expert one. GPT-OSS, Llama 4 and DBRX keep the same names in memory and on the Hub.

Which quantized formats each family's transformers checkpoints hold (:data:`HF_QUANT_METHODS`,
:func:`unsaved_formats`) is family knowledge too, and lives here.
"""

from __future__ import annotations

import abc
import re
from typing import Any

import torch

from nxd_moe.hf.configs import from_hf_config
from nxd_moe.hf.stored_formats import StateDict, hf_quantization, nxd_quantization
from nxd_moe.model_config import MoEModelConfig
from nxd_moe.quantization.checkpoint import mxfp4_from_gpt_oss, mxfp4_to_gpt_oss

LAYOUTS = ("transformers", "hub")

# Our MoE's state-dict keys.
ROUTER_W = "router.linear_router.weight"
ROUTER_B = "router.linear_router.bias"
SCORE_BIAS = "router.e_score_correction_bias"
GATE_UP_W = "expert_mlps.mlp_op.gate_up_proj.weight"
GATE_UP_S = "expert_mlps.mlp_op.gate_up_proj.scale"
GATE_UP_B = "expert_mlps.mlp_op.gate_up_proj.bias"
DOWN_W = "expert_mlps.mlp_op.down_proj.weight"
DOWN_S = "expert_mlps.mlp_op.down_proj.scale"
DOWN_B = "expert_mlps.mlp_op.down_proj.bias"
SHARED_PROJS = ("gate_proj", "up_proj", "down_proj")
SHARED_GATE = "shared_experts.shared_expert_gate.weight"
NXD_OWNED = ("router.", "expert_mlps.", "shared_experts.")


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
    for proj in SHARED_PROJS:
        key = f"{hf_name}.{proj}.weight"
        if key + "_scale_inv" in parts:
            out[f"shared_experts.{proj}.weight"] = parts[key].t()
            out[f"shared_experts.{proj}.scale"] = parts[key + "_scale_inv"].t()
        else:
            out[f"shared_experts.{proj}.weight"] = parts[key]
    return out


def _shared_from_nxd(nxd: StateDict, hf_name: str, block: str) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_shared_to_nxd`."""
    quantization = nxd_quantization(nxd, "shared_experts.down_proj.")
    if quantization not in ("bf16", "fp8_block"):
        raise ValueError(f"{block}: quantized shared experts ({quantization!r}) export as FP8 128x128 block-scaled "
                         "tensors only (DeepSeek-V3's weight_scale_inv): use shared quantization 'fp8_block'")
    out = {}
    for proj in SHARED_PROJS:
        key, weight = f"{hf_name}.{proj}.weight", nxd[f"shared_experts.{proj}.weight"]
        if quantization == "bf16":
            out[key] = weight
        else:
            out[key], out[key + "_scale_inv"] = weight.t(), nxd[f"shared_experts.{proj}.scale"].t()
    return out


def _check_unquantized_export(nxd: StateDict, block: str) -> None:
    """For blocks whose checkpoints store the routed experts in the model's dtype only (Llama 4, DBRX)."""
    quantization = nxd_quantization(nxd)
    if quantization != "bf16":
        raise ValueError(f"{block}: quantized experts ({quantization!r}) have no checkpoint form in this model's "
                         "layout; only unquantized experts export")


class Family(abc.ABC):
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


class _FusedFamily(Family):
    """Mixtral, Qwen2/Qwen3-MoE and DeepSeek-V3.

    transformers: ``gate.weight (E, H)``, ``experts.gate_up_proj (E, 2I, H)`` (rows ``[gate; up]``),
    ``experts.down_proj (E, H, I)``. Hub: ``experts.K.<gate>.weight``/``<up>`` ``(I, H)``, ``<down> (H, I)``.
    """

    _PER_EXPERT = re.compile(r"^experts\.\d+\.")
    saved_quantization = ("fp8_block",)

    def __init__(self, block_classes: tuple[str, ...], expert_names: tuple[str, str, str] = SHARED_PROJS,
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
        out = {ROUTER_W: parts["gate.weight"]}
        if self.score_bias:
            out[SCORE_BIAS] = parts["gate.e_score_correction_bias"]
        if self.is_hub(parts):
            gate, up, down = self.expert_names
            gate_up = torch.stack([torch.cat([parts[f"experts.{e}.{gate}.weight"], parts[f"experts.{e}.{up}.weight"]])
                                   for e in range(num_experts)])
            down_hi = torch.stack([parts[f"experts.{e}.{down}.weight"] for e in range(num_experts)])
            if hf_quantization(parts)[0] == "fp8_block":  # (out/128, in/128) tiles per expert, like the weights
                out[GATE_UP_S] = torch.stack([torch.cat([parts[f"experts.{e}.{gate}.weight_scale_inv"],
                                                          parts[f"experts.{e}.{up}.weight_scale_inv"]])
                                               for e in range(num_experts)]).transpose(1, 2)
                out[DOWN_S] = torch.stack([parts[f"experts.{e}.{down}.weight_scale_inv"]
                                            for e in range(num_experts)]).transpose(1, 2)
        else:
            gate_up, down_hi = parts["experts.gate_up_proj"], parts["experts.down_proj"]
        out[GATE_UP_W] = gate_up.transpose(1, 2)  # (E, 2I, H) rows [gate; up] -> (E, H, 2I) columns [gate | up]
        out[DOWN_W] = down_hi.transpose(1, 2)  # (E, H, I) -> (E, I, H)
        if self.shared:
            out.update(_shared_to_nxd(parts, self.shared))
        if self.shared_gate:
            out[SHARED_GATE] = parts["shared_expert_gate.weight"]
        return out

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        out = {"gate.weight": nxd[ROUTER_W]}
        if self.score_bias:
            out["gate.e_score_correction_bias"] = nxd[SCORE_BIAS]
        gate_up, down = nxd[GATE_UP_W], nxd[DOWN_W]
        quantization = nxd_quantization(nxd)
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
                gate_s, up_s = _split_gate_up(nxd[GATE_UP_S])
                for e in range(gate_up.shape[0]):
                    out[f"experts.{e}.{gate_name}.weight_scale_inv"] = gate_s[e].t()
                    out[f"experts.{e}.{up_name}.weight_scale_inv"] = up_s[e].t()
                    out[f"experts.{e}.{down_name}.weight_scale_inv"] = nxd[DOWN_S][e].t()
        else:
            out["experts.gate_up_proj"] = gate_up.transpose(1, 2)
            out["experts.down_proj"] = down.transpose(1, 2)
        if self.shared:
            out.update(_shared_from_nxd(nxd, self.shared, self.block_classes[0]))
        if self.shared_gate:
            out["shared_expert_gate.weight"] = nxd[SHARED_GATE]
        return out


class _GptOssFamily(Family):
    """``router.weight (E, H)``/``router.bias (E,)``; ``experts.gate_up_proj (E, H, 2I)`` and
    ``experts.gate_up_proj_bias (E, 2I)`` with gate/up interleaved; ``experts.down_proj (E, I, H)``,
    ``experts.down_proj_bias (E, H)``."""

    owned = ("router.", "experts.")
    block_classes = ("GptOssMLP",)
    saved_quantization = ("mxfp4",)

    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        out = {
            ROUTER_W: parts["router.weight"],
            ROUTER_B: parts["router.bias"],
            GATE_UP_B: _deinterleave(parts["experts.gate_up_proj_bias"]),
            DOWN_B: parts["experts.down_proj_bias"],
        }
        if hf_quantization(parts)[0] == "mxfp4":  # the Hub checkpoint's MXFP4 experts, bytes kept as they are
            for name, weight_key, scale_key, columns in (("gate_up_proj", GATE_UP_W, GATE_UP_S, _deinterleave),
                                                         ("down_proj", DOWN_W, DOWN_S, lambda t: t)):
                weight, scale = mxfp4_from_gpt_oss(parts[f"experts.{name}_blocks"], parts[f"experts.{name}_scales"],
                                                   f"experts.{name}")
                out[weight_key], out[scale_key] = columns(weight), columns(scale)
        else:
            out[GATE_UP_W] = _deinterleave(parts["experts.gate_up_proj"])
            out[DOWN_W] = parts["experts.down_proj"]
        return out

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        out = {
            "router.weight": nxd[ROUTER_W],
            "router.bias": nxd[ROUTER_B],
            "experts.gate_up_proj_bias": _interleave(nxd[GATE_UP_B]),
            "experts.down_proj_bias": nxd[DOWN_B],
        }
        quantization = nxd_quantization(nxd)
        if quantization == "mxfp4":
            for name, weight_key, scale_key, columns in (("gate_up_proj", GATE_UP_W, GATE_UP_S, _interleave),
                                                         ("down_proj", DOWN_W, DOWN_S, lambda t: t)):
                blocks, scales = mxfp4_to_gpt_oss(columns(nxd[weight_key]), columns(nxd[scale_key]))
                out[f"experts.{name}_blocks"], out[f"experts.{name}_scales"] = blocks, scales
        elif quantization == "bf16":
            out["experts.gate_up_proj"] = _interleave(nxd[GATE_UP_W])
            out["experts.down_proj"] = nxd[DOWN_W]
        else:
            raise ValueError(f"GptOssMLP: quantized experts ({quantization!r}) export as GPT-OSS's MXFP4 tensors only: "
                             "use quantization 'mxfp4'")
        return out


class _Llama4Family(Family):
    """``router.weight (E, H)``; ``experts.gate_up_proj (E, H, 2I)`` already ``[gate | up]``;
    ``experts.down_proj (E, I, H)``; ``shared_expert.{gate,up,down}_proj.weight``."""

    module = hub_module = "feed_forward"
    owned = ("router.", "experts.", "shared_expert.")
    block_classes = ("Llama4TextMoe",)
    shared = "shared_expert"

    def to_nxd(self, parts: StateDict, num_experts: int) -> dict[str, torch.Tensor]:
        return {ROUTER_W: parts["router.weight"], GATE_UP_W: parts["experts.gate_up_proj"],
                DOWN_W: parts["experts.down_proj"], **_shared_to_nxd(parts, "shared_expert")}

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        _check_unquantized_export(nxd, self.block_classes[0])
        return {"router.weight": nxd[ROUTER_W], "experts.gate_up_proj": nxd[GATE_UP_W],
                "experts.down_proj": nxd[DOWN_W], **_shared_from_nxd(nxd, "shared_expert", self.block_classes[0])}


class _DbrxFamily(Family):
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
            ROUTER_W: parts["router.layer.weight"],
            GATE_UP_W: torch.cat([per_expert("w1"), per_expert("v1")], dim=1).transpose(1, 2),
            DOWN_W: per_expert("w2"),
        }

    def from_nxd(self, nxd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        _check_unquantized_export(nxd, self.block_classes[0])
        gate, up = _split_gate_up(nxd[GATE_UP_W])
        down = nxd[DOWN_W]
        return {
            "router.layer.weight": nxd[ROUTER_W],
            "experts.mlp.w1": gate.transpose(1, 2).reshape(-1, gate.shape[1]),
            "experts.mlp.v1": up.transpose(1, 2).reshape(-1, up.shape[1]),
            "experts.mlp.w2": down.reshape(-1, down.shape[-1]),
        }


_FAMILIES: dict[str, Family] = {
    "mixtral": _FusedFamily(("MixtralSparseMoeBlock",), expert_names=("w1", "w3", "w2"),
                            hub_module="block_sparse_moe"),
    "qwen3_moe": _FusedFamily(("Qwen3MoeSparseMoeBlock",)),
    "qwen2_moe": _FusedFamily(("Qwen2MoeSparseMoeBlock",), shared="shared_expert", shared_gate=True),
    "deepseek_v3": _FusedFamily(("DeepseekV3MoE",), shared="shared_experts", score_bias=True),
    "gpt_oss": _GptOssFamily(),
    "llama4_text": _Llama4Family(),
    "dbrx": _DbrxFamily(),
}


def family_of(cfg: MoEModelConfig) -> Family:
    return _FAMILIES[cfg.hf_model_type]



def as_model_config(config: Any) -> MoEModelConfig:
    """Accept an :class:`MoEModelConfig` made for an HF model type, or anything :func:`from_hf_config` takes."""
    if isinstance(config, MoEModelConfig):
        if config.hf_model_type not in _FAMILIES:
            raise ValueError(f"config.hf_model_type {config.hf_model_type!r} is not one nxd_moe.hf converts; "
                             f"supported: {sorted(_FAMILIES)}")
        return config
    return from_hf_config(config)


# transformers' ``quantization_config.quant_method`` of the quantized formats real checkpoints have: GPT-OSS's MXFP4
# (``Mxfp4Config``) and DeepSeek-V3's FP8 with 128x128 block scales (``FineGrainedFP8Config``, which transformers
# reads for every family whose Hub checkpoints store one Linear per expert). Shared experts: FP8 block-scaled only.
HF_QUANT_METHODS = {"mxfp4": "mxfp4", "fp8_block": "fp8"}
_SAVED_SHARED_QUANTIZATION = ("fp8_block",)


def unsaved_formats(cfg: MoEModelConfig, routed: str, shared: str | None) -> str:
    """Why a block of ``cfg``'s family whose routed / shared experts are stored as ``routed`` / ``shared`` (format
    names; None: no shared experts) has no checkpoint transformers loads, or ``""`` if it has one."""
    family = family_of(cfg)
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

