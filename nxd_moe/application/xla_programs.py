"""The application's programs traced by ``torch_xla`` on the CPU: one HLO per phase and bucket for ``neuronx-cc``.

:func:`program_modules` gives each program as a module with example inputs (the module's KV cache buffers are HLO
parameters and, updated, outputs); :func:`export_programs` writes their HLO (:func:`nxd_moe.trace.export_hlo`: text,
``HloModuleProto``, a report) and the ``neuronx-cc`` command of each; :func:`nxd_moe.trace.check_static` over
:func:`program_inputs` proves a bucket is one static graph for every routing and step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from nxd_moe.application.programs import ContextEncodingProgram, TokenGenerationProgram
from nxd_moe.tracing.single_device import export_hlo

if TYPE_CHECKING:
    from nxd_moe.application.application import CausalLMApplication

__all__ = ["export_programs", "program_inputs", "program_modules", "xla_unavailable_reason"]


def xla_unavailable_reason(app: "CausalLMApplication") -> str | None:
    """Why the programs cannot be traced to HLO here (None: they can)."""
    if app.runner.device.type != "cpu":
        return f"the model is on {app.runner.device}; HLO is traced from a model on the CPU"
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return "torch_xla is not installed (pip install -e '.[xla]', see docs/trace.md)"
    return None


def program_modules(app: "CausalLMApplication") -> dict[str, tuple[nn.Module, str, int]]:
    """``name -> (module, phase, bucket)`` for every program of ``app``."""
    out: dict[str, tuple[nn.Module, str, int]] = {}
    for bucket in app.config.context_encoding_buckets:
        out[f"context_encoding_{bucket}"] = (ContextEncodingProgram(app.programs), "context_encoding", bucket)
    for bucket in app.config.token_generation_buckets:
        out[f"token_generation_{bucket}"] = (TokenGenerationProgram(app.programs, bucket), "token_generation", bucket)
    return out


def program_inputs(app: "CausalLMApplication", phase: str, bucket: int, seed: int = 0
                   ) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``i -> inputs`` of one program (CPU tensors): ``i = 0`` gives every sequence the same token (so every MoE
    layer routes every token to the same experts), other ``i`` random tokens, lengths and positions."""
    config = app.config
    vocab = app.programs.text_config.vocab_size
    sampling = app.sampling

    def make(i: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed + i)
        if phase == "context_encoding":
            rows = config.ctx_batch_size
            ids = torch.randint(0, vocab, (rows, bucket), generator=g)
            lengths = torch.randint(1, bucket + 1, (rows,), generator=g)
            if i == 0:
                ids, lengths = torch.full_like(ids, int(ids[0, 0])), torch.full_like(lengths, bucket)
            inputs = (ids, lengths, torch.arange(rows))
        else:
            batch = config.batch_size
            tokens = torch.randint(0, vocab, (batch,), generator=g)
            positions = torch.randint(0, bucket, (batch,), generator=g)
            if i == 0:
                tokens, positions = torch.full_like(tokens, int(tokens[0])), torch.full_like(positions, bucket - 1)
            done = torch.zeros(batch, dtype=torch.bool)
            done[0] = i % 2 == 1
            eos = torch.full((app.runner.eos_token_ids.numel(),), -1, dtype=torch.long)
            eos[0] = int(tokens[-1])
            inputs = (tokens, positions, done, eos, torch.tensor(0))
        if sampling:
            rows = inputs[0].shape[0]
            # top-k 1: the draw is the argmax, so XLA's tokens (its own random numbers) compare with eager's
            params = torch.tensor([[1.0, 0.9, 0.7]]).expand(rows, 3).contiguous()
            inputs = (*inputs, params)
        return inputs

    return make


def export_programs(app: "CausalLMApplication", path: Path, signatures: dict[str, dict[str, Any]]) -> None:
    """Trace every program of ``app`` under XLA, write its HLO under ``path/<program>/`` and record the files,
    the trace's checks and the ``neuronx-cc`` command in ``signatures[<program>]``."""
    lnc = app.config.logical_nc_config
    for name, (module, phase, bucket) in program_modules(app).items():
        out_dir = path / name
        report = export_hlo(module, program_inputs(app, phase, bucket)(1), out_dir, atol=_atol(app))
        cache_as_inputs(out_dir)
        signatures[name].update({
            "hlo": {"text": f"{name}/{report['files']['hlo_text']}", "proto": f"{name}/{report['files']['hlo_proto']}"},
            "static": report["static"], "matches_eager": report["matches_eager"],
            "hlo_instructions": report["hlo_instructions"],
            "neuronx_cc": (f"neuronx-cc compile {name}/model.hlo_module.pb --framework XLA --target trn2 --lnc {lnc} "
                           f"--output {name}/model.neff"),
        })


_CACHE_PATH = "programs.cache."


def cache_as_inputs(out_dir: Path) -> None:
    """The KV cache is state the runtime keeps and feeds to every program (and gets back updated), not a constant:
    in ``parameters.json`` its buffers become inputs named as in the manifest (``cache.keys_0``...), and they leave
    ``shared.pt``."""
    import json

    file = out_dir / "parameters.json"
    parameters = json.loads(file.read_text())
    shared = torch.load(out_dir / "shared.pt")
    for p in parameters:
        if p["name"].startswith(_CACHE_PATH):
            shared.pop(p["number"], None)
            p.update(kind="input", name="cache." + p["name"][len(_CACHE_PATH):])
    file.write_text(json.dumps(parameters, indent=2) + "\n")
    torch.save(shared, out_dir / "shared.pt")


def _atol(app: "CausalLMApplication") -> float:
    """XLA vs eager on the CPU: the same float ops in another order; tokens are compared exactly by the
    caller (they are argmaxes / draws), the cache to the dtype's rounding of values of order one."""
    return 1e-4 if app.config.torch_dtype in (torch.float32, torch.float64) else 6e-2
