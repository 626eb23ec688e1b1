"""Transformers checkpoints and our ``MoE`` state dicts, converted both ways, one block or a whole model.

:func:`check_hf_block` / :func:`hf_block_to_nxd` check and convert one transformers block's tensors (either layout,
any stored format; their expected keys and shapes come from :func:`meta_state_dict`, a meta-device ``MoE`` of the
config); :func:`hf_to_nxd_state_dict` / :func:`nxd_to_hf_state_dict` convert every MoE block of a whole checkpoint;
:func:`load_hf_layer` loads one layer of one into an ``MoE``.

The nxd side keeps each block's module path (``model.layers.N.mlp.``, ``...feed_forward.``,
``transformer.blocks.N.ffn.``) followed by this package's ``MoE`` state-dict keys. Every other key passes through
unchanged, so a whole checkpoint converts and converts back exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from nxd_moe.build import build_moe
from nxd_moe.hf.families import LAYOUTS, NXD_OWNED, as_model_config, family_of
from nxd_moe.hf.stored_formats import StateDict, check_stored_formats, hf_quantization, nxd_quantization
from nxd_moe.model_config import MoEModelConfig
from nxd_moe.moe import MoE
from nxd_moe.parallel.sharding import load_full_state_dict


def meta_state_dict(cfg: MoEModelConfig, quantization: str = "bf16",
                    shared_quantization: str = "bf16") -> dict[str, torch.Tensor]:
    """Our MoE's state dict for ``cfg`` on the meta device: key names and shapes, no storage."""
    shared = {} if cfg.shared_experts is None else {"shared_quantization": shared_quantization}
    return build_moe(cfg, device="meta", model_parallel=False, quantization=quantization, **shared).state_dict()


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
    there and no other, each of the right shape. ``expected_nxd``: :func:`meta_state_dict` of ``cfg`` (bf16)."""
    family = family_of(cfg)
    layout = "hub" if family.is_hub(parts) else "transformers"
    quantization = hf_quantization(parts)
    if quantization != ("bf16", "bf16"):
        expected_nxd = meta_state_dict(cfg, *quantization)
    _check_keys(parts, family.from_nxd(expected_nxd, layout), where, "HF")


def hf_block_to_nxd(parts: StateDict, cfg: MoEModelConfig, expected_nxd: StateDict,
                     where: str) -> dict[str, torch.Tensor]:
    """One HF block's tensors (checked by :func:`check_hf_block`) as our MoE's state dict. Tensors may be views of
    ``parts``: loading copies them, and writing a checkpoint needs ``.contiguous()``."""
    check_hf_block(parts, cfg, expected_nxd, where)
    return family_of(cfg).to_nxd(parts, cfg.num_experts)


def _nxd_block_to_hf(parts: StateDict, cfg: MoEModelConfig, expected_nxd: StateDict, where: str,
                     layout: str) -> dict[str, torch.Tensor]:
    quantization = nxd_quantization(parts), nxd_quantization(parts, "shared_experts.down_proj.")
    if quantization != ("bf16", "bf16"):
        expected_nxd = meta_state_dict(cfg, *quantization)
    _check_keys(parts, expected_nxd, where, "nxd")
    return {k: v.contiguous() for k, v in family_of(cfg).from_nxd(parts, layout).items()}


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
    cfg = as_model_config(config)
    family = family_of(cfg)
    expected = meta_state_dict(cfg)

    def match(key: str) -> tuple[str, str, str] | None:
        m = family.block_re.match(key)
        if m is None or not family.owns(m["rest"]):
            return None
        return key[:m.start("rest")], f"{m['pre']}{family.module}.", m["rest"]

    return _convert(hf_state_dict, match, lambda parts, where: {
        k: v.contiguous() for k, v in hf_block_to_nxd(parts, cfg, expected, where).items()})


def nxd_to_hf_state_dict(nxd_state_dict: StateDict, config: Any, *, layout: str = "transformers") -> dict[str, Any]:
    """The inverse of :func:`hf_to_nxd_state_dict`.

    ``layout="transformers"`` (default) gives transformers' in-memory layout (what ``model.state_dict()`` holds
    and ``load_state_dict`` takes); ``layout="hub"`` gives the per-expert layout of the Hub checkpoints
    (identical for GPT-OSS, Llama 4 and DBRX).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"nxd_to_hf_state_dict: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    cfg = as_model_config(config)
    family = family_of(cfg)
    expected = meta_state_dict(cfg)
    module = family.hub_module if layout == "hub" else family.module

    def match(key: str) -> tuple[str, str, str] | None:
        m = family.block_re.match(key)
        if m is None or m["module"] != family.module or not m["rest"].startswith(NXD_OWNED):
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
    cfg = as_model_config(config)
    family = family_of(cfg)
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
    return load_full_state_dict(moe, hf_block_to_nxd(parts, cfg, meta_state_dict(cfg), where))

