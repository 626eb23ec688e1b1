"""One forward traced under ``torch_xla`` on one device: proof that it is one static graph, and its HLO exported
for ``neuronx-cc``.

``neuronx-cc`` compiles the HLO that ``torch_xla`` traces. Trainium runs one compiled graph per input shape, so
a layer is deployable only if every routing traces to the *same* graph, with no data-dependent shape, no
operator that ``torch_xla`` runs on the host (a CPU fallback), and no device-to-host transfer in the middle of
the layer (each one cuts the graph in two and stalls the device). This module checks exactly that:

- :func:`check_static` runs the forward under XLA for several routings (one sends every token to the same
  experts) and reports how many distinct graphs were traced and compiled, the host syncs and CPU fallbacks
  seen while tracing, and the largest difference from eager PyTorch (:mod:`~nxd_moe.tracing.eager_parity`);
- :func:`export_hlo` writes the HLO module of one forward (text and serialized ``HloModuleProto``, the input
  of ``neuronx-cc compile --framework XLA``), its parameter map (:mod:`~nxd_moe.tracing.hlo`) and
  ``report.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from nxd_moe.tracing.block_counts import BlockCount, counting_blocks
from nxd_moe.tracing.eager_parity import Routing, compare, recording_routing
from nxd_moe.tracing.hlo import hlo_op_histogram, hlo_parameters, module_tensor_names, save_parameter_values
from nxd_moe.tracing.tensors import Inputs, describe_tensors, leaf_tensors
from nxd_moe.tracing.xla import counter_value, device_transfers, fallback_counts, import_torch_xla, new_fallbacks


@dataclass
class _Step:
    """One forward under XLA: what happened while tracing it, and at the sync that ran it."""

    graph_hash: bytes
    executions_during_trace: int
    transfers_during_trace: int
    compilations: int
    executions_at_sync: int
    output_fetch_transfers: int
    outputs: Any
    blocks: list[BlockCount]
    routing: Routing


def _to(value, device):
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _xla_step(xla_module: nn.Module, args: Inputs, kwargs: Mapping[str, Any], before_sync=None) -> _Step:
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    device = torch_xla.device()
    args, kwargs = _to(tuple(args), device), _to(dict(kwargs), device)
    torch_xla.sync(wait=True)  # the inputs are on the device before tracing starts
    executions, transfers = counter_value(met, "ExecuteComputation"), device_transfers(met)
    with torch.no_grad(), counting_blocks(xla_module) as counters, recording_routing(xla_module) as routing:
        outputs = xla_module(*args, **kwargs)
    executions_during_trace = counter_value(met, "ExecuteComputation") - executions
    transfers_during_trace = device_transfers(met) - transfers
    records = [r for c in counters for r in c.records]
    counts = leaf_tensors([(r.computed, r.active) for r in records])
    graph_hash = torch_xla._XLAC._get_graph_hash(leaf_tensors(outputs) + counts)
    if before_sync is not None:
        before_sync(outputs, args)
    compilations, executions = counter_value(met, "UncachedCompile"), counter_value(met, "ExecuteComputation")
    torch_xla.sync(wait=True)
    compilations = counter_value(met, "UncachedCompile") - compilations
    executions_at_sync = counter_value(met, "ExecuteComputation") - executions
    transfers = device_transfers(met)
    outputs = _to(outputs, "cpu")
    blocks = [r.read() for r in records]
    fetches = device_transfers(met) - transfers
    return _Step(graph_hash, executions_during_trace, transfers_during_trace, compilations, executions_at_sync,
                 fetches, outputs, blocks, _to(routing, "cpu"))


def _xla_copy(module: nn.Module) -> nn.Module:
    torch_xla = import_torch_xla()
    xla_module = copy.deepcopy(module).to(torch_xla.device())
    torch_xla.sync(wait=True)
    return xla_module


@dataclass
class StaticReport:
    """:func:`check_static`'s findings over ``routings`` forwards.

    - ``graphs``: distinct XLA graphs traced (1 = one static graph for every routing);
    - ``compilations``: XLA compilations the check caused (1; 0 if this process had compiled the graph before);
    - ``executions_during_trace`` / ``transfers_during_trace``: graphs run and device-to-host transfers while
      the forward was being traced -- each one is a host sync inside the layer (must be 0);
    - ``executions_per_step``: graphs run by each step's sync (1: the whole layer is one graph);
    - ``output_fetch_transfers``: the expected transfers that fetch the final outputs, reported apart;
    - ``fallback_ops``: operators ``torch_xla`` ran on the CPU (must be empty);
    - ``max_abs_diff``: largest ``|XLA - eager|`` over every output and routing, eager routed as XLA routed (its
      routers select from the XLA graph's logits: a near tie can flip under any rounding difference);
    - ``router_logits_max_abs_diff``: largest ``|XLA - eager|`` of the router logits, eager computing its own;
    - ``routing_flips``: per routing, the tokens (summed over MoE layers) whose experts eager, routing on its own,
      chose otherwise than XLA -- near ties, whose logits differ by less than ``router_logits_max_abs_diff``;
    - ``blocks``: per routing, the dynamic-while block counts (empty without dynamic-while experts).
    """

    routings: int
    graphs: int
    compilations: int
    executions_during_trace: int
    transfers_during_trace: int
    executions_per_step: list[int]
    output_fetch_transfers: int
    fallback_ops: list[str]
    max_abs_diff: float
    router_logits_max_abs_diff: float
    routing_flips: list[int]
    atol: float
    blocks: list[list[BlockCount]]

    @property
    def static(self) -> bool:
        return (self.graphs == 1 and self.compilations <= 1 and self.executions_during_trace == 0
                and self.transfers_during_trace == 0 and all(e == 1 for e in self.executions_per_step)
                and not self.fallback_ops)

    @property
    def matches_eager(self) -> bool:
        return self.max_abs_diff <= self.atol and self.router_logits_max_abs_diff <= self.atol

    @property
    def blocks_match_schedule(self) -> bool:
        return all(b.computed == b.expected for step in self.blocks for b in step)

    @property
    def ok(self) -> bool:
        return self.static and self.matches_eager and self.blocks_match_schedule

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["blocks"] = [[b.to_dict() for b in step] for step in self.blocks]
        out.update(static=self.static, matches_eager=self.matches_eager,
                   blocks_match_schedule=self.blocks_match_schedule, ok=self.ok)
        return out


def check_static(module: nn.Module, make_inputs: Callable[[int], Inputs], n: int = 3,
                 kwargs: Mapping[str, Any] | None = None, atol: float = 1e-5) -> StaticReport:
    """Run ``module(*make_inputs(i), **kwargs)`` for ``i`` in ``range(n)`` under XLA and in eager, and report
    whether every routing traced to the same single graph (see :class:`StaticReport`).

    ``make_inputs(i)`` returns CPU tensors; it should vary the routing with ``i`` and send every token to the
    same experts for one ``i`` (:func:`~nxd_moe.tracing.inputs.moe_inputs` does: ``i = 0`` repeats one token).
    ``module`` is not modified: a copy runs on the XLA device.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"n must be an int >= 2 (several routings, to see whether they share a graph), got {n!r}")
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    kwargs = dict(kwargs or {})
    xla_module = _xla_copy(module)
    fallbacks_before = fallback_counts(met)
    steps, comparisons = [], []
    for i in range(n):
        args = tuple(make_inputs(i))
        step = _xla_step(xla_module, args, kwargs)
        steps.append(step)
        comparisons.append(compare(module, args, kwargs, step.outputs, step.routing))
    return StaticReport(
        routings=n,
        graphs=len({s.graph_hash for s in steps}),
        compilations=sum(s.compilations for s in steps),
        executions_during_trace=sum(s.executions_during_trace for s in steps),
        transfers_during_trace=sum(s.transfers_during_trace for s in steps),
        executions_per_step=[s.executions_at_sync for s in steps],
        output_fetch_transfers=sum(s.output_fetch_transfers for s in steps),
        fallback_ops=new_fallbacks(met, fallbacks_before),
        max_abs_diff=max(c.max_abs_diff for c in comparisons),
        router_logits_max_abs_diff=max(c.router_logits_max_abs_diff for c in comparisons),
        routing_flips=[c.routing_flips for c in comparisons],
        atol=atol,
        blocks=[s.blocks for s in steps],
    )


def export_hlo(module: nn.Module, example_inputs: Inputs, out_dir: str | os.PathLike,
               kwargs: Mapping[str, Any] | None = None, atol: float = 1e-5) -> dict:
    """Trace one forward under XLA and write to ``out_dir``:

    - ``model.hlo.txt``: the HLO module, readable;
    - ``model.hlo_module.pb``: the serialized ``HloModuleProto`` (what ``neuronx-cc compile --framework XLA``
      reads);
    - ``parameters.json``: each entry parameter of the HLO in order
      (:class:`~nxd_moe.tracing.hlo.ProgramParameter`), and the values a runtime feeds besides the inputs:
      ``weights.pt`` (``{module path: tensor}``) and ``shared.pt`` (``{parameter number: tensor}``);
    - ``report.json``: the returned report -- compiled graphs, HLO op histogram (``while`` ops included), input
      and output shapes, CPU fallbacks, device-to-host transfers during tracing (must be 0) apart from the final
      output fetch, ``max_abs_diff`` against eager routed as XLA routed and the router logits' own difference
      (see :class:`StaticReport`), and dynamic-while block counts.
    """
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    kwargs = dict(kwargs or {})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    xla_module = _xla_copy(module)
    fallbacks_before = fallback_counts(met)
    hlo = {}
    before = module_tensor_names(xla_module)

    def dump(outputs, device_inputs):
        tensors = leaf_tensors(outputs)
        hlo["text"] = torch_xla._XLAC._get_xla_tensors_hlo(tensors)
        hlo["proto"] = torch_xla._XLAC._get_xla_tensors_hlo_proto(tensors)
        parameters, values = hlo_parameters(xla_module, device_inputs, tensors, before)
        # read before the sync runs the program: a state buffer the program updates in place (an application's KV
        # cache) is donated to its output, and its input value is gone afterwards
        hlo["parameters"] = parameters, [v.cpu() for v in values]

    step = _xla_step(xla_module, example_inputs, kwargs, before_sync=dump)
    compared = compare(module, example_inputs, kwargs, step.outputs, step.routing)
    (out_dir / "model.hlo.txt").write_text(hlo["text"])
    (out_dir / "model.hlo_module.pb").write_bytes(hlo["proto"])
    parameters, values = hlo["parameters"]
    save_parameter_values(parameters, values, out_dir, "weights.pt")
    histogram = hlo_op_histogram(hlo["text"])
    report = {
        "files": {"hlo_text": "model.hlo.txt", "hlo_proto": "model.hlo_module.pb", "parameters": "parameters.json",
                  "weights": "weights.pt", "shared": "shared.pt"},
        "compiled_graphs": step.executions_at_sync,
        "compilations": step.compilations,
        "hlo_instructions": sum(histogram.values()),
        "op_histogram": histogram,
        "while_ops": histogram.get("while", 0),
        "inputs": describe_tensors((tuple(example_inputs), kwargs)),
        "parameters": [p.to_dict() for p in parameters],
        "outputs": describe_tensors(step.outputs),
        "fallback_ops": new_fallbacks(met, fallbacks_before),
        "executions_during_trace": step.executions_during_trace,
        "transfers_during_trace": step.transfers_during_trace,
        "output_fetch_transfers": step.output_fetch_transfers,
        "max_abs_diff": compared.max_abs_diff,
        "router_logits_max_abs_diff": compared.router_logits_max_abs_diff,
        "routing_flips": compared.routing_flips,
        "atol": atol,
        "blocks": [b.to_dict() for b in step.blocks],
    }
    report["static"] = (report["compiled_graphs"] == 1 and not report["fallback_ops"]
                        and report["executions_during_trace"] == 0 and report["transfers_during_trace"] == 0)
    report["matches_eager"] = max(compared.max_abs_diff, compared.router_logits_max_abs_diff) <= atol
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
