"""The HLO of a traced forward and its entry parameters: what each parameter is (an input, a weight, the SPMD rank,
a value the code put on the device), the files a runtime feeds the program from, and running an exported program
from those files alone; the HLO text's parameters and op histogram.

``torch_xla`` makes every device tensor the graph reads an entry parameter, so the parameter map is what a runtime
loading the compiled NEFF needs besides the HLO itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn as nn

from nxd_moe.parallel_state import SPMDRank
from nxd_moe.tracing.xla import import_torch_xla

_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (?:\([^()]*\)|\S+) ([a-z][a-z0-9\-]*)\(", re.MULTILINE)


@dataclass(frozen=True)
class ProgramParameter:
    """HLO entry parameter ``number`` (``parameter(number)`` in the module's ENTRY computation): ``kind`` is
    ``input`` (``name``: the forward's argument, e.g. ``hidden_states`` or ``cache.0.keys``), ``weight`` (a
    parameter or persistent buffer of the traced module, by module path -- the rank's shard in an SPMD program),
    ``rank`` (the
    :class:`~nxd_moe.parallel_state.SPMDRank` tensor) or ``shared`` (a value the module's code put on the device:
    a non-persistent buffer, named by its module path, or a table or scalar, ``shared.<number>``; the same
    for every rank). ``sharding``: how the value relates to the whole layer's -- ``whole`` on one device; in an
    SPMD program ``replicated``, ``split dim D: S of F`` (each rank holds ``S`` of the ``F`` entries along ``D``),
    ``per rank`` (the rank tensor, the rank's tokens)."""

    number: int
    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str = "whole"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


def input_names(module: nn.Module, count: int) -> list[str]:
    """Names of the first ``count`` positional arguments of ``module``'s forward: the module's own
    ``input_names(count)`` where it has one, else its signature's (a ``*args`` parameter gives ``args.<i>``)."""
    own = getattr(module, "input_names", None)
    if callable(own):
        return list(own(count))
    names: list[str] = []
    for parameter in inspect.signature(module.forward).parameters.values():
        if parameter.kind == parameter.VAR_POSITIONAL:
            names += [f"{parameter.name}.{i}" for i in range(count - len(names))]
        elif parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return names[:count]


def module_tensor_names(module: nn.Module) -> dict[int, tuple[str, str]]:
    """``{XLA tensor id: (kind, module path)}`` of ``module``'s parameters and buffers (on the XLA device). Taken
    before a forward that updates a buffer in place (an application's KV cache): the update gives the buffer a new
    value, and the program's parameter is the old one."""
    tensor_id = import_torch_xla()._XLAC._xla_get_tensor_id
    names: dict[int, tuple[str, str]] = {}
    # Module paths, not state-dict keys: a state-dict hook may rename and reshape (a patched transformers block).
    for path, owner in module.named_modules():
        prefix = f"{path}." if path else ""
        for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            kind = "rank" if isinstance(owner, SPMDRank) else "weight"
            if name in owner._non_persistent_buffers_set:  # derived on construction, never loaded: a constant
                kind = "shared"
            names.setdefault(tensor_id(tensor), (kind, prefix + name))
    return names


def hlo_parameters(module: nn.Module, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
                   before: dict[int, tuple[str, str]] | None = None
                   ) -> tuple[list[ProgramParameter], list[torch.Tensor]]:
    """What each entry parameter of the HLO of the lazy XLA ``outputs`` of ``module(*inputs)`` (module and inputs
    on the XLA device, before the sync) is, in parameter order, and the device values the program takes there.
    ``torch_xla`` makes every device tensor the graph reads a parameter: the inputs, the weights, and values the
    code put on the device (clamp bounds, index tables, buffers outside the state dict). ``before``:
    :func:`module_tensor_names` taken before the forward (names buffers the forward updated in place)."""
    torch_xla = import_torch_xla()
    tensor_id = torch_xla._XLAC._xla_get_tensor_id
    names = dict(before or {})
    for key, value in module_tensor_names(module).items():
        names.setdefault(key, value)
    for name, tensor in zip(input_names(module, len(inputs)), inputs):
        if tensor is not None:
            names[tensor_id(tensor)] = ("input", name)
    ids, values = torch_xla._XLAC._get_tensors_xla_device_data_node(list(outputs))
    parameters = []
    for number, (device_id, value) in enumerate(zip(ids, values, strict=True)):
        kind, name = names.get(device_id, ("shared", f"shared.{number}"))
        parameters.append(ProgramParameter(number, kind, name, tuple(value.shape),
                                           str(value.dtype).removeprefix("torch.")))
    return parameters, list(values)


_HLO_ENTRY_PARAMETER = re.compile(r"^\s*%\S+ = (\S+?)(?:\{[^}]*\})? parameter\((\d+)\)", re.MULTILINE)
# HLO element types -> torch dtype names, for the ones a trace produces
_HLO_DTYPES = {"f32": "float32", "f64": "float64", "bf16": "bfloat16", "f16": "float16", "s64": "int64",
               "s32": "int32", "s16": "int16", "s8": "int8", "u8": "uint8", "pred": "bool",
               "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def hlo_entry_parameters(hlo_text: str) -> list[tuple[list[int], str]]:
    """``[(shape, dtype)]`` of the ENTRY computation's parameters in number order, read from the HLO text
    (``%p3.7 = f32[8,16]{1,0} parameter(3)``); dtypes in torch's names."""
    entry = hlo_text[hlo_text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    found = {}
    for shape, number in _HLO_ENTRY_PARAMETER.findall(entry):
        element, _, dims = shape.partition("[")
        found[int(number)] = ([int(d) for d in dims.rstrip("]").split(",") if d], _HLO_DTYPES.get(element, element))
    return [found[i] for i in range(len(found))]


def save_parameter_values(parameters: Sequence[ProgramParameter], values: Sequence[torch.Tensor],
                          out_dir: Path, weights_file: str | None) -> None:
    """Write ``parameters.json`` and the values a runtime feeds besides the inputs: ``shared.pt`` (``{number:
    tensor}`` of the ``shared`` parameters) and, unless ``weights_file`` is None (the SPMD export writes each
    rank's shard instead), ``weights_file`` (``{module path: tensor}`` of the ``weight`` parameters)."""
    (out_dir / "parameters.json").write_text(json.dumps([p.to_dict() for p in parameters], indent=2) + "\n")
    torch.save({p.number: v.cpu() for p, v in zip(parameters, values) if p.kind == "shared"}, out_dir / "shared.pt")
    if weights_file is not None:
        torch.save({p.name: v.cpu() for p, v in zip(parameters, values) if p.kind == "weight"},
                   out_dir / weights_file)


def run_exported(out_dir: str | os.PathLike, inputs: Mapping[str, torch.Tensor],
                 weights: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Run the HLO an export wrote to ``out_dir`` on the XLA device, fed from its files alone -- what a runtime
    loading the compiled NEFF does: every entry parameter in ``parameters.json`` order, ``inputs[name]`` for an
    ``input``, ``weights[name]`` for a ``weight`` (default: ``weights.pt``; an SPMD rank passes its
    ``shards/rank{r}.pt``, which also holds its ``rank``) and ``shared.pt[number]`` for a ``shared`` one. Returns
    the outputs on the CPU. (Single-device programs: an SPMD program's collectives need every rank.)"""
    torch_xla = import_torch_xla()
    import torch_xla.core.xla_builder as xb

    out_dir = Path(out_dir)
    parameters = json.loads((out_dir / "parameters.json").read_text())
    if weights is None:
        weights = torch.load(out_dir / "weights.pt")
    shared = torch.load(out_dir / "shared.pt")
    missing = [p["name"] for p in parameters if p["kind"] == "input" and p["name"] not in inputs]
    if missing:
        raise ValueError(f"inputs: the program takes {missing} as well (parameters.json)")
    values = [inputs[p["name"]] if p["kind"] == "input" else shared[p["number"]] if p["kind"] == "shared"
              else weights[p["name"]] for p in parameters]
    computation = xb.computation_from_module_proto("exported", (out_dir / "model.hlo_module.pb").read_bytes())
    device = torch_xla.device()
    outputs = torch_xla._XLAC._xla_user_computation("xla::exported", [v.to(device) for v in values], computation)
    return [o.cpu() for o in outputs]


def hlo_op_histogram(hlo_text: str) -> dict[str, int]:
    """Instruction count per HLO opcode, over every computation of the module (loop bodies included)."""
    return dict(sorted(Counter(_HLO_OP.findall(hlo_text)).items()))
