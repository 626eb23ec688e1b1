"""What ``CausalLMApplication.compile(path)`` writes, and what ``load(path)`` checks.

The directory, as NxD Inference lays out its compiled application where the two meet:

- ``neuron_config.json``: the model's transformers config fields and, under ``neuron_config``, the application's
  (NxDI's ``InferenceConfig.save``; ``_name_or_path`` is the checkpoint the weights are read from at load);
- ``manifest.json``: per phase and bucket, the program -- its inputs and outputs (name, shape, dtype; which
  outputs are the KV cache it updates in place), the HLO files when traced, the ``neuronx-cc`` command -- plus the
  model's identity (type, layers, parameter count and a digest of the parameter names, shapes and dtypes), so
  ``load`` refuses a directory compiled for another model;
- ``weights/`` when the application was built without a checkpoint (random weights) or with
  ``save_sharded_checkpoint``: a transformers checkpoint of the model (``save_pretrained``: safetensors, config);
- ``<phase>_<bucket>/model.hlo_module.pb`` and ``model.hlo.txt`` (:mod:`~nxd_moe.application.xla_programs`) when
  the model is on the CPU and ``torch_xla`` is installed; otherwise the manifest says why there is no HLO.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_moe.application import spmd, xla_programs
from nxd_moe.application.config import ApplicationConfig

if TYPE_CHECKING:
    from nxd_moe.application.application import CausalLMApplication

__all__ = ["CONFIG_FILE", "MANIFEST_FILE", "check_compiled", "model_identity", "program_signatures", "read_model",
           "write_compiled"]

CONFIG_FILE = "neuron_config.json"
MANIFEST_FILE = "manifest.json"
FORMAT = 1


def model_identity(app: "CausalLMApplication") -> dict[str, Any]:
    """What ties a compiled directory to one model: its type, layers, parameter count and a digest of every
    parameter's name, shape and dtype (not the values: the same model with new weights loads)."""
    digest = hashlib.sha256()
    count = 0
    for name, p in app.model.state_dict().items():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        count += p.numel()
    text = app.programs.text_config
    return {"model_type": app.model_type, "num_hidden_layers": text.num_hidden_layers, "parameters": count,
            "state_dict_digest": digest.hexdigest()}


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def program_signatures(app: "CausalLMApplication") -> dict[str, dict[str, Any]]:
    """Per program (``context_encoding_<S>``, ``token_generation_<L>``): inputs and outputs by name with shapes
    and dtypes; the cache outputs alias the cache inputs (state updated in place)."""
    config, runner = app.config, app.runner
    cache = [(name, buf) for name, buf in app.programs.cache.named_buffers()]
    sampling = {"sampling_params": {"shape": [config.ctx_batch_size, 3], "dtype": "float32"}} if app.sampling else {}
    out: dict[str, dict[str, Any]] = {}
    for bucket in config.context_encoding_buckets:
        ids, lengths, seq_ids, _ = runner.context_inputs[bucket]
        out[f"context_encoding_{bucket}"] = {
            "phase": "context_encoding", "bucket": bucket,
            "inputs": {"input_ids": _describe(ids), "lengths": _describe(lengths), "seq_ids": _describe(seq_ids),
                       **sampling, **{f"cache.{n}": _describe(b) for n, b in cache}},
            "outputs": {"tokens": _describe(lengths), **{f"cache.{n}": _describe(b) for n, b in cache}},
            "aliases": {f"cache.{n}": f"cache.{n}" for n, _ in cache},
        }
    batch = config.batch_size
    vector = {"shape": [batch], "dtype": "int64"}
    tkg_sampling = {"sampling_params": {"shape": [batch, 3], "dtype": "float32"}} if app.sampling else {}
    for bucket in config.token_generation_buckets:
        out[f"token_generation_{bucket}"] = {
            "phase": "token_generation", "bucket": bucket,
            "inputs": {"tokens": vector, "positions": vector, "done": {"shape": [batch], "dtype": "bool"},
                       "eos_token_ids": _describe(runner.eos_token_ids), "pad_token_id": _describe(runner.pad_token_id),
                       **tkg_sampling, **{f"cache.{n}": _describe(b) for n, b in cache}},
            "outputs": {"tokens": vector, "done": {"shape": [batch], "dtype": "bool"},
                        **{f"cache.{n}": _describe(b) for n, b in cache}},
            "aliases": {f"cache.{n}": f"cache.{n}" for n, _ in cache},
        }
    return out


def _hf_config_dict(app: "CausalLMApplication") -> dict[str, Any]:
    config = app.model.config.to_dict()
    if app.checkpoint is not None:
        config["_name_or_path"] = app.checkpoint
    return config


def write_compiled(app: "CausalLMApplication", path: Path, *, xla: bool | None = None) -> dict[str, Any]:
    """Write ``path`` (module docstring) and return the manifest. ``xla``: trace the HLO of every program (None:
    when the model is on the CPU and ``torch_xla`` imports; True: required, an error if it cannot be)."""
    path.mkdir(parents=True, exist_ok=True)
    config = app.config
    weights = None
    if app.checkpoint is None or config.save_sharded_checkpoint:
        app.model.save_pretrained(path / "weights")  # transformers 5 writes safetensors only
        weights = "weights"
    manifest: dict[str, Any] = {
        "format": FORMAT, "model": model_identity(app), "checkpoint": app.checkpoint, "weights": weights,
        "device": str(app.runner.device), "sampling": app.sampling,
        "buckets": {"context_encoding": config.context_encoding_buckets,
                    "token_generation": config.token_generation_buckets},
        "parallel": {"tp_degree": config.tp_degree, "moe_tp_degree": config.moe_tp_degree,
                     "moe_ep_degree": config.moe_ep_degree, "logical_nc_config": config.logical_nc_config},
        "programs": program_signatures(app),
    }
    reason = xla_programs.xla_unavailable_reason(app)
    if xla and reason:
        raise RuntimeError(f"compile(xla=True): {reason}")
    if xla is False:
        reason = "not asked for (compile(xla=False))"
    if reason is None and config.tp_degree > 1:
        _export_spmd(app, path, manifest)
    elif reason is None:
        xla_programs.export_programs(app, path, manifest["programs"])
    else:
        manifest["hlo"] = f"no HLO written: {reason}"
        if xla is None:
            warnings.warn(f"compile: no HLO written ({reason}); the programs run here as they are", stacklevel=3)
    (path / CONFIG_FILE).write_text(json.dumps({**_hf_config_dict(app), "neuron_config": config.to_dict()},
                                               indent=2, sort_keys=True, default=str) + "\n")
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _export_spmd(app: "CausalLMApplication", path: Path, manifest: dict[str, Any]) -> None:
    """``tp_degree`` > 1: each program as ONE SPMD program for every rank (:mod:`nxd_moe.application.spmd`),
    checked -- every rank traces the same program, and run on one XLA CPU device per rank it gives each rank the
    single-device application's tokens -- then written."""
    if app.rebuild is None:
        raise ValueError("compile: an SPMD program (tp_degree > 1) builds the model once per rank; build the "
                         "application with CausalLMApplication.from_pretrained, from_model_config or from_compiled")
    layout = spmd.layout_of(app.config)
    full, ranks = spmd.rank_applications(app.rebuild, layout, full=app)
    checks = spmd.check_programs(full, ranks, layout)
    failed = {name: c for name, c in checks.items()
              if c.get("host_sync") or not c.get("identical_across_ranks") or not c.get("tokens_equal")}
    if failed:
        raise RuntimeError(f"compile: the SPMD programs {sorted(failed)} are not one program equal to the "
                           f"single-device application: {failed}")
    spmd.export_programs(full, ranks, layout, path, manifest["programs"])
    for name, check in checks.items():
        manifest["programs"][name]["spmd"].update(tokens_equal=check["tokens_equal"],
                                                  max_abs_diff=check["max_abs_diff"])


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a compiled application directory: no {MANIFEST_FILE} (write one "
                                "with compile(path))")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: format {manifest.get('format')!r}, this nxd_moe reads format {FORMAT}")
    return manifest


def check_compiled(app: "CausalLMApplication", path: Path) -> dict[str, Any]:
    """The manifest of ``path``, after checking it was compiled for ``app``'s model and buckets."""
    manifest = read_manifest(path)
    mine = model_identity(app)
    if manifest["model"] != mine:
        differ = sorted(k for k in mine if manifest["model"].get(k) != mine[k])
        raise ValueError(f"{path} was compiled for another model (differs in {differ}): compile this one")
    config = app.config
    buckets = {"context_encoding": config.context_encoding_buckets,
               "token_generation": config.token_generation_buckets}
    if manifest["buckets"] != buckets:
        raise ValueError(f"{path} was compiled for buckets {manifest['buckets']}, the application has {buckets}")
    return manifest


def read_model(path: Path, device: torch.device | str = "cpu"):
    """``(model, ApplicationConfig, checkpoint)`` of the compiled directory ``path``: the transformers model its
    ``neuron_config.json`` describes, in the config's dtype on ``device``, its weights read from ``weights/`` (when
    ``compile`` saved them) or from the checkpoint directory it names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = read_manifest(path)
    fields = json.loads((path / CONFIG_FILE).read_text())
    with warnings.catch_warnings():  # the fields were warned about when the directory was compiled
        warnings.simplefilter("ignore")
        config = ApplicationConfig(strict=False, **fields.pop("neuron_config"))
    fields = {k: v for k, v in fields.items() if k not in ("attribute_map", "metadata", "num_cores_per_group")}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    checkpoint = str(path / manifest["weights"]) if manifest.get("weights") else manifest.get("checkpoint")
    if not checkpoint or not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"{path}: its weights are read from the checkpoint {checkpoint!r}, which is not a "
                                "directory here (compile with save_sharded_checkpoint=True to keep them)")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, config=hf_config, dtype=config.torch_dtype,
                                                 use_safetensors=True)
    return model.to(device).eval(), config, None if manifest.get("weights") else checkpoint
