"""``patch_model``: every sparse-MoE block of a transformers model replaced by nxd_moe's ``MoE``.

The replacement, :class:`PatchedMoEBlock`, sits where the block was, returns what the block returned and keeps the
block's checkpoint format: its state-dict hooks convert between the ``MoE``'s own keys and the transformers ones
with the family converters of :mod:`nxd_moe.hf.families`, so ``state_dict``, ``load_state_dict`` and
``save_pretrained`` see the model they saw before.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any, Callable

import torch
import torch.nn as nn

from nxd_moe.build import build_moe, check_overrides
from nxd_moe.experts.backends import ExpertsBackend, TorchBackend
from nxd_moe.hf.blocks import from_hf_moe_block
from nxd_moe.hf.checkpoints import check_hf_block, hf_block_to_nxd, meta_state_dict
from nxd_moe.hf.configs import SUPPORTED_MODEL_TYPES, from_hf_config
from nxd_moe.hf.families import HF_QUANT_METHODS, family_of, unsaved_formats
from nxd_moe.hf.stored_formats import check_stored_formats, layer_formats
from nxd_moe.model_config import MoEModelConfig
from nxd_moe.moe import MoE
from nxd_moe.parallel.sharding import shard_state_dict
from nxd_moe.quantization.formats import get_format, reported_format
from nxd_moe.quantization.quantizer import holds_whole_experts, quantize_experts, quantize_shared_experts

__all__ = ["PatchReport", "PatchedMoEBlock", "patch_model"]

# build_moe arguments the transformers block decides: its weights' shapes, dtype and device.
_FIXED_BY_THE_BLOCK = ("scale", "dtype", "device")


def _gpt_oss_output(out: torch.Tensor, router_logits: torch.Tensor, expert_index: torch.Tensor) -> tuple:
    """``GptOssMLP``: ``(out (B, S, H), router_scores (T, k))``, the softmax over each token's top-k logits."""
    return out, torch.softmax(router_logits.gather(1, expert_index), dim=-1).to(out.dtype)


def _llama4_output(out: torch.Tensor, router_logits: torch.Tensor, expert_index: torch.Tensor) -> tuple:
    """``Llama4TextMoe``: ``(out (T, H), router_logits (T, E))``, tokens flattened."""
    return out.view(-1, out.shape[-1]), router_logits.to(out.dtype)


# Blocks that return a tuple; every other block returns its output (B, S, H) alone.
_TUPLE_OUTPUTS: dict[str, Callable[..., tuple]] = {"gpt_oss": _gpt_oss_output, "llama4_text": _llama4_output}


class PatchedMoEBlock(nn.Module):
    """nxd_moe's :class:`~nxd_moe.moe.MoE` in the place of a transformers sparse-MoE block.

    ``forward(hidden_states (B, S, H))`` returns what the block returned: ``(B, S, H)``, or for ``GptOssMLP`` and
    ``Llama4TextMoe`` their tuples (see ``_TUPLE_OUTPUTS``). The ``MoE`` is ``self.moe``; its weights are the
    only copy. ``state_dict`` gives the block's transformers keys in their dtypes (the router, which ``MoE`` keeps
    in float32, goes back to the block's dtype); quantized experts give the checkpoint's quantized tensors (GPT-OSS
    ``*_blocks``/``*_scales``, the Hub's per-expert FP8 ``weight_scale_inv`` layout) or, in a format the family's
    checkpoints do not have, a ``ValueError`` naming it. ``load_state_dict`` takes the block's keys in either layout
    (transformers' fused experts or the Hub's per-expert ones), stored in the layer's formats.
    """

    def __init__(self, moe: MoE, model_config: MoEModelConfig, block: nn.Module):
        super().__init__()
        self.moe = moe
        self.model_config = model_config
        self.block_class = type(block).__name__
        # The block's keys in order, with their dtypes: state_dict gives them back as they were -- unless the model
        # was cast since (the layer's own dtypes, recorded here, tell: _cast_dtype).
        self.hf_dtypes = {key: value.dtype for key, value in block.state_dict().items()}
        self.patched_dtypes = {key: value.dtype for key, value in moe.state_dict().items()}
        self._output = _TUPLE_OUTPUTS.get(model_config.hf_model_type)
        moe.return_router_logits = moe.return_expert_index = self._output is not None
        self.register_state_dict_post_hook(PatchedMoEBlock._to_hf_state_dict)
        self.register_load_state_dict_pre_hook(PatchedMoEBlock._from_hf_state_dict)

    def forward(self, hidden_states: torch.Tensor):
        out = self.moe(hidden_states)
        return out[0] if self._output is None else self._output(*out)

    def extra_repr(self) -> str:
        routed, shared = layer_formats(self.moe)
        formats = f"quantization={reported_format(routed)!r}" + (
            "" if shared is None else f", shared_quantization={reported_format(shared)!r}")
        return f"in place of {self.block_class}, backend={self.moe.expert_mlps.backend.name!r}, {formats}"

    @staticmethod
    def _to_hf_state_dict(module: PatchedMoEBlock, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if _sharded(module.moe):
            raise NotImplementedError(f"state_dict of {prefix or 'the block'!r} ({module.block_class} patched by "
                                      "nxd_moe): under model parallelism each rank holds only its shard of the "
                                      "experts; save the checkpoint from a model patched in one process")
        own = prefix + "moe."
        nxd = {key[len(own):]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(own)]}
        routed, shared = layer_formats(module.moe)
        unsaved = unsaved_formats(module.model_config, routed, shared)
        if unsaved:
            raise ValueError(f"state_dict of {prefix or 'the block'!r} ({module.block_class} patched by nxd_moe): "
                             f"{unsaved}")
        # The Hub's per-expert layout is the one FP8 checkpoints have; unquantized experts keep transformers' own.
        layout = "transformers" if routed == "bf16" else "hub"
        hf = family_of(module.model_config).from_nxd(nxd, layout)
        ordered = [k for k in module.hf_dtypes if k in hf] + [k for k in hf if k not in module.hf_dtypes]
        cast = module._cast_dtype(nxd)
        for key in ordered:
            value, dtype = hf[key], module.hf_dtypes.get(key)
            if cast is not None and dtype is not None and dtype.is_floating_point and dtype.itemsize > 1:
                dtype = cast  # the model was cast after patching: its keys follow it, as an unpatched one's would
            if layout == "hub":
                # Per-expert slices of one tensor, transposed: save_pretrained's shared-storage check needs each
                # contiguous (it views every tensor that shares storage as 1-D).
                value = value.contiguous()
            # Unquantized tensors in the block's dtypes (the router); FP8 and packed MXFP4 ones as stored.
            if dtype is not None and value.is_floating_point() and value.element_size() > 1:
                value = value.to(dtype)
            state_dict[prefix + key] = value

    def _cast_dtype(self, nxd: dict[str, torch.Tensor]) -> torch.dtype | None:
        """The dtype the model was cast to after patching (``model.to(torch.bfloat16)``), seen in the layer's own
        16- and 32-bit tensors that no longer have their dtype of patching; None if none changed."""
        changed = [value.dtype for key, value in nxd.items()
                   if key in self.patched_dtypes and value.dtype != self.patched_dtypes[key]
                   and value.is_floating_point() and value.element_size() > 1]
        return max(set(changed), key=changed.count) if changed else None

    @staticmethod
    def _from_hf_state_dict(module: PatchedMoEBlock, state_dict: dict, prefix: str, local_metadata: dict,
                            *args: Any) -> None:
        keys = [k for k in state_dict if k.startswith(prefix)]
        if not keys:  # a checkpoint without this block: strict loading reports the MoE's keys as missing
            return
        parts = {key[len(prefix):]: state_dict.pop(key) for key in keys}
        check_stored_formats(module.moe, parts, f"load_state_dict: {prefix or 'the block'!r}'s",
                             "patch the model with")
        nxd = shard_state_dict(module.moe, hf_block_to_nxd(parts, module.model_config,
                                                           meta_state_dict(module.model_config), prefix))
        if local_metadata.get("assign_to_params_buffers"):
            # Assigned tensors become the layer's own: in its dtypes (a float32 router), contiguous.
            own = module.moe.state_dict()
            nxd = {k: v.to(own[k].dtype).contiguous() for k, v in nxd.items()}
        state_dict.update({prefix + "moe." + k: v for k, v in nxd.items()})


def _sharded(moe: MoE) -> bool:
    return moe.expert_mlps.is_sharded or (moe.shared_experts is not None
                                          and moe.shared_experts.intermediate_shard is not None)


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What :func:`patch_model` did, kept as ``model.nxd_moe_patched``.

    ``patched``: module paths of the replaced blocks; ``kept``: ``(path, why)`` of each decoder layer's MLP left as
    it is (dense layers); ``backend``, ``quantization`` and ``shared_quantization`` (None without shared experts):
    how the ``MoE`` layers compute and store their experts (``"none"``: not quantized, in the model's dtype).
    """

    model_type: str
    block_class: str
    backend: str
    quantization: str
    shared_quantization: str | None
    patched: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]


def _quantization_config(model: nn.Module, blocks: dict[str, PatchedMoEBlock], routed: str,
                         shared: str | None) -> dict[str, Any] | None:
    """transformers' ``quantization_config`` for the checkpoint of ``model`` whose ``blocks`` (path -> patched block)
    store their routed / shared experts as ``routed`` / ``shared``; None where nothing is quantized or the formats
    have no checkpoint form (``state_dict`` then refuses, naming them).

    ``modules_to_not_convert`` lists every module transformers would otherwise turn into a quantized one on loading
    (its ``nn.Linear`` modules and ``*.experts``) that holds unquantized weights here: attention, dense MLPs, the
    routers, the shared experts when only the routed ones are quantized... Names differing only in a layer index
    become one pattern (``model.layers.\\d+.self_attn.q_proj``) where that pattern matches no quantized module.
    """
    methods = {HF_QUANT_METHODS.get(routed), HF_QUANT_METHODS.get(shared)} - {None}
    block = next(iter(blocks.values()))
    if not methods or unsaved_formats(block.model_config, routed, shared):
        return None
    family_shared = family_of(block.model_config).shared
    quantized, keep = set(), {name for name, module in model.named_modules() if type(module) is nn.Linear
                              and not any(name.startswith(path + ".") for path in blocks)}
    for path, wrapper in blocks.items():
        for key in wrapper.hf_dtypes:  # the block's transformers keys: its modules are the loaded model's
            module = key.rpartition(".")[0]
            is_quantized = (HF_QUANT_METHODS.get(routed) and module == "experts") or (
                HF_QUANT_METHODS.get(shared) and family_shared and module.startswith(family_shared + "."))
            (quantized if is_quantized else keep).add(f"{path}.{module}")
    patterns = set()
    for name in keep:
        pattern = re.sub(r"(?<=\.)\d+(?=\.)", r"\\d+", name)
        patterns.add(pattern if not any(re.fullmatch(pattern, q) or re.match(rf"{pattern}\.", q) for q in quantized)
                     else name)
    method, = methods
    config = {"quant_method": method, "modules_to_not_convert": sorted(patterns)}
    if method == "fp8":  # DeepSeek-V3's own: E4M3 weights, one float32 scale per 128x128 tile, dynamic activations
        config.update(activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128])
    return config


def _default_backend(device: torch.device) -> str:
    """``triton`` for a block on a CUDA device where the Triton kernels import, else ``torch``."""
    if device.type != "cuda":
        return "torch"
    try:
        importlib.import_module("nxd_moe.triton_kernels.backend")
    except ImportError:
        return "torch"
    return "triton"


def _check_model(model: Any) -> str:
    """The model's ``model_type``, or a named error for anything :func:`patch_model` cannot take."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or not isinstance(model_type, str):
        raise TypeError(f"patch_model: model must be a transformers model (an nn.Module with a config.model_type), "
                        f"got {type(model).__name__}")
    if isinstance(getattr(model, "nxd_moe_patched", None), PatchReport):
        raise ValueError(f"patch_model: the model is already patched ({len(model.nxd_moe_patched.patched)} MoE "
                         "blocks, model.nxd_moe_patched); patch a fresh model")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"patch_model: {type(model).__name__} (model_type {model_type!r}) has no sparse-MoE block "
                         f"nxd_moe converts; supported model types: {list(SUPPORTED_MODEL_TYPES)}")
    text_config = getattr(config, "text_config", None) or config
    if getattr(text_config, "output_router_logits", False):
        # transformers records them with hooks on its router classes, which the patched blocks no longer contain.
        raise ValueError("patch_model: config.output_router_logits is True, but patched blocks do not record router "
                         "logits (transformers' auxiliary training loss); set it to False")
    return model_type


def patch_model(model: nn.Module, *, backend: str | ExpertsBackend | None = None, quantization: str | None = None,
                shared_quantization: str | None = None, **build_kwargs: Any) -> nn.Module:
    """Replace every sparse-MoE block of the transformers ``model`` with nxd_moe's ``MoE`` and return ``model``.

    ``model``: a transformers model of a type in :data:`~nxd_moe.hf.SUPPORTED_MODEL_TYPES` (a ``*ForCausalLM``,
    its base model, or Llama 4's multimodal model), its weights materialised (or all on the meta device: the
    layers are then built there too, to be loaded later). Each block (router, experts, shared experts and
    Qwen2-MoE's shared-expert gate) becomes a :class:`PatchedMoEBlock` holding an ``MoE`` built from it
    (:func:`~nxd_moe.hf.from_hf_moe_block`) that returns what the block returned; dense layers (DeepSeek's
    ``first_k_dense_replace``, Qwen's ``mlp_only_layers``, Llama 4's non-MoE layers) stay. One block at a time is
    converted and its tensors released, so patching needs the memory of one extra block at most.

    ``backend``: the experts' backend; None picks ``"triton"`` for a model on a CUDA device where Triton imports,
    else ``"torch"`` -- as ``TorchBackend(pairs=True)`` where ``grouped_mm`` takes the model's dtype (a CPU): every
    dropless forward then multiplies the ``T*k`` (token, expert) pairs sorted by expert, as transformers' default
    does, instead of NxD's Trainium rules (blockwise in ``block_size``-row blocks, all-experts decode), which
    eager CPU matmuls pay in full; the same outputs. Pass ``backend="torch"`` for NxD's rules (what a trace for
    Trainium wants). ``quantization`` (``"fp8"``, ``"fp8_block"``, ``"mxfp4"``; None keeps the block's format):
    quantize the routed experts after loading; ``shared_quantization``: the shared experts' format (bf16 unless
    given). ``build_kwargs`` go to :func:`~nxd_moe.build.build_moe` (``block_size``, ``validate_inputs``,
    experts overrides...); ``scale``, ``dtype`` and ``device`` are the model's and are refused.

    The model's state dict keeps its keys, shapes, dtypes and values; ``load_state_dict`` takes transformers
    checkpoints (GPT-OSS MXFP4 and DeepSeek-V3 FP8 tensors as stored, into a model patched with that
    quantization) and ``save_pretrained`` writes a checkpoint transformers loads unpatched. ``model.nxd_moe_patched``
    is a :class:`PatchReport`.

    With :mod:`nxd_moe.parallel_state` initialised (expert parallelism), each rank's layers hold its experts only and
    the rest of the model stays whole: each rank runs its own sequences (same shapes on every rank) and
    ``generate(..., synced_gpus=True)`` keeps the ranks in step; ``state_dict`` of such a model is refused.
    """
    model_type = _check_model(model)
    for name in _FIXED_BY_THE_BLOCK:
        if name in build_kwargs:
            raise TypeError(f"patch_model: {name!r} is the model's own (convert the model itself, e.g. model.to(), "
                            "before patching)")
    check_overrides(build_kwargs, "patch_model")
    cfg = from_hf_config(model.config)
    if quantization is not None:
        quantization = get_format(quantization, "patch_model: quantization").name
    if shared_quantization is not None:
        if cfg.shared_experts is None:
            raise ValueError(f"patch_model: shared_quantization={shared_quantization!r}, but model_type "
                             f"{model_type!r} has no shared experts")
        shared_quantization = get_format(shared_quantization, "patch_model: shared_quantization").name
    family = family_of(cfg)
    block_classes = set(family.block_classes)
    slot = re.compile(rf"(?:.*\.)?{family.container}\.\d+\.{family.module}")
    paths, kept = [], []
    for path, module in model.named_modules():
        if any(c.__name__ in block_classes for c in type(module).__mro__):
            paths.append(path)
        elif slot.fullmatch(path):
            kept.append((path, f"{type(module).__name__} is not a sparse-MoE block"))
    if not paths:
        raise ValueError(f"patch_model: {type(model).__name__} (model_type {model_type!r}) has no "
                         f"{' or '.join(family.block_classes)} to replace; every layer is dense")
    if backend is None:
        # device and dtype only: a parameter held here would keep the first block alive through the whole patch
        device, dtype = next((p.device, p.dtype) for p in model.get_submodule(paths[0]).parameters())
        backend = _default_backend(device)
        dims = (cfg.hidden_size, 2 * cfg.intermediate_size, cfg.intermediate_size, cfg.hidden_size)
        if backend == "torch" and TorchBackend().pairs_cheapest(device, dtype, dims):
            backend = TorchBackend(pairs=True)  # eager on a CPU / GPU: transformers' algorithm, not Trainium's
    # Everything that can be refused is checked before the first block changes: the layer's arguments (a layer on
    # the meta device, no memory) and every block's tensors.
    probe = build_moe(cfg, device="meta", backend=backend, quantization=quantization,
                      **({} if cfg.shared_experts is None else {"shared_quantization": shared_quantization}),
                      **build_kwargs)
    # The quantizer takes whole experts: one device, or expert-parallel shards.
    whole = holds_whole_experts(probe.expert_mlps) and (probe.shared_experts is None
                                                        or probe.shared_experts.intermediate_shard is None)
    if not whole and (quantization, shared_quantization) != (None, None):
        raise NotImplementedError("patch_model: quantizing on patch under tensor parallelism or hybrid sharding is "
                                  "not supported yet (expert parallelism alone is); patch in one process")
    expected = meta_state_dict(cfg)
    for path in paths:
        check_hf_block(model.get_submodule(path).state_dict(), cfg, expected, f"{path}.")
    # Only paths are held, so each block's tensors go as soon as its replacement is in place.
    wrappers = {}
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        block = getattr(parent, name)
        wrapper = PatchedMoEBlock(from_hf_moe_block(block, cfg, backend=backend, **build_kwargs), cfg, block)
        setattr(parent, name, wrapper)
        wrappers[path] = wrapper
        del block
        if quantization is not None and quantization != layer_formats(wrapper.moe)[0]:
            quantize_experts(wrapper.moe, quantization)
        if shared_quantization is not None and shared_quantization != layer_formats(wrapper.moe)[1]:
            quantize_shared_experts(wrapper.moe, shared_quantization)
        formats = layer_formats(wrapper.moe)
    quantization_config = _quantization_config(model, wrappers, *formats)
    if quantization_config is not None:  # save_pretrained writes it: transformers then loads the quantized experts
        model.config.quantization_config = quantization_config
    model.nxd_moe_patched = PatchReport(
        model_type=cfg.hf_model_type, block_class=family.block_classes[0], backend=wrapper.moe.expert_mlps.backend.name,
        quantization=reported_format(formats[0]),
        shared_quantization=None if formats[1] is None else reported_format(formats[1]),
        patched=tuple(paths), kept=tuple(kept))
    return model
