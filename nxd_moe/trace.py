"""Prove that an MoE forward is one static graph, and export it for ``neuronx-cc``.

``neuronx-cc`` compiles the HLO that ``torch_xla`` traces. Trainium runs one compiled graph per input shape, so
a layer is deployable only if every routing traces to the *same* graph, with no data-dependent shape, no
operator that ``torch_xla`` runs on the host (a CPU fallback), and no device-to-host transfer in the middle of
the layer (each one cuts the graph in two and stalls the device). This module checks exactly that:

- :func:`check_static` runs the forward under XLA for several routings (one sends every token to the same
  experts) and reports how many distinct graphs were traced and compiled, the host syncs and CPU fallbacks
  seen while tracing, and the largest difference from eager PyTorch;
- :func:`export_hlo` writes the HLO module of one forward (text and serialized ``HloModuleProto``, the input
  of ``neuronx-cc compile --framework XLA``) and ``report.json``;
- :func:`export_program` (``torch.export``, strict) and :func:`compile_check`
  (``torch.compile(fullgraph=True)``) check the same property without ``torch_xla``, on any torch;
- ``nxd-moe trace`` does all of it for a shipped config; with ``--model-layers`` for a whole transformers decoder
  of its architecture (MoE blocks patched with this package's layer), one decode step or one prefill over a static
  KV cache (:func:`model_inputs`, :func:`routing_summary`, :func:`trace_model`).

``torch_xla`` is imported only by the functions that need it (``pip install -e '.[xla]'``, which moves the
environment to torch 2.9). Without ``PJRT_DEVICE`` set, the XLA CPU client is used.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from nxd_moe.arguments import MIN_AUTO_SCALE, auto_scale, positive_int, scale_argument
from nxd_moe.experts.backends import TorchBackend
from nxd_moe.experts.dynamic_while import blocks_per_iteration, dynamic_while_blockwise_forward, static_block_count
from nxd_moe.experts.expert_mlps import ExpertMLPsV2
from nxd_moe.extras import MissingExtraError, require
from nxd_moe.quantization import QUANTIZATION_CHOICES
from nxd_moe.quantization.formats import describe_weights, reported_format

HELP = "trace one MoE layer: torch.export, torch.compile(fullgraph) and XLA checks; write HLO for neuronx-cc"
XLA_INSTALL_HINT = "torch_xla 2.9 needs torch 2.9: install it in its own environment; PJRT_DEVICE=CPU on a CPU host"

# Ops that read tensor values on the host or give outputs whose shape depends on them.
SYNC_OPS = frozenset({"item", "_local_scalar_dense", "tolist", "numpy", "nonzero", "nonzero_static", "argwhere",
                      "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "histc",
                      "_assert_scalar"})

Inputs = Sequence[Any]


class DataDependentGraph(AssertionError):
    """A captured graph contains a host-sync op or a data-dependent (symbolic) size."""


# ----------------------------------------------------------------------------------------------------------
# FX graphs: torch.compile and torch.export


def _is_symbolic(value) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in value.shape)
    if isinstance(value, (list, tuple)):
        return any(_is_symbolic(v) for v in value)
    return False


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    return getattr(getattr(target, "overloadpacket", target), "__name__", str(target))


def data_dependence(gm: torch.fx.GraphModule) -> list[str]:
    """Every host-sync op and data-dependent (symbolic) size in ``gm`` and its subgraphs (e.g. a while loop's
    body). With static example shapes every legitimate size is a Python int, so a symbolic one can only come from
    tensor values (``nonzero``, ``.item()``)."""
    problems = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            name = _target_name(node.target)
            if name in SYNC_OPS:
                problems.append(f"host-sync op {name}: {node.format_node()}")
            elif _is_symbolic(node.meta.get("val", node.meta.get("example_value"))):
                problems.append(f"data-dependent size: {node.format_node()}")
    return problems


def assert_static_graph(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`DataDependentGraph` naming the first host-sync op or data-dependent size in ``gm``.

    ``fullgraph=True`` alone is not enough on recent PyTorch: Dynamo captures ``nonzero``, boolean masks and
    ``.item()`` (as ``_local_scalar_dense``) into the graph instead of breaking it."""
    problems = data_dependence(gm)
    if problems:
        raise DataDependentGraph(problems[0])


def _checked_inner(gm, example_inputs):
    from functorch.compile import make_boxed_func

    assert_static_graph(gm)  # the aten-level graph
    return make_boxed_func(gm.forward)


def static_backend(inner: str = "aot_eager"):
    """A Dynamo backend that checks the captured graph (torch level, then aten level for ``aot_eager``) and runs
    it with ``inner``: ``"aot_eager"`` (cheap) or ``"inductor"`` (in the ``mode`` ``torch.compile`` passes,
    ``"reduce-overhead"`` included)."""
    from torch._dynamo.backends.common import aot_autograd

    if inner not in ("aot_eager", "inductor"):
        raise ValueError(f"inner must be 'aot_eager' or 'inductor', got {inner!r}")

    def backend(gm, example_inputs, mode: str | None = None):
        assert_static_graph(gm)  # the Dynamo-level graph
        if inner == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=list_mode_options(mode) if mode else None)
        if mode is not None:
            raise ValueError(f"static_backend('aot_eager') has no modes, got mode={mode!r}")
        return aot_autograd(fw_compiler=_checked_inner)(gm, example_inputs)

    return backend


def _tensors(value) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _max_abs_diff(actual, expected) -> float:
    pairs = list(zip(_tensors(actual), _tensors(expected), strict=True))
    diffs = [float((a.detach().cpu().double() - e.detach().cpu().double()).abs().max()) if a.numel() else 0.0
             for a, e in pairs]
    return max(diffs, default=0.0)


@dataclass
class CompileReport:
    """``torch.compile(fullgraph=True, dynamic=False)`` with the static-graph check on every captured graph."""

    fullgraph: bool
    max_abs_diff: float | None
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def compile_check(module: nn.Module, example_inputs: Inputs, kwargs: Mapping[str, Any] | None = None,
                  backend: str = "aot_eager") -> CompileReport:
    """Compile ``module`` with ``fullgraph=True``: a graph break, a host-sync op or a data-dependent size fails.
    Runs under ``no_grad`` and compares the compiled output with eager. Resets Dynamo's caches before and after
    (``torch._dynamo.reset()``), so that earlier compilations of the same ``forward`` cannot hide a failure."""
    kwargs = dict(kwargs or {})
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(module, fullgraph=True, dynamic=False, backend=static_backend(backend))
            out = compiled(*example_inputs, **kwargs)
            eager = module(*example_inputs, **kwargs)
    except Exception as e:  # any failure to capture one static graph is the answer
        return CompileReport(False, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        torch._dynamo.reset()
    return CompileReport(True, _max_abs_diff(out, eager))


@dataclass
class ExportReport:
    """``torch.export`` (strict) of one forward. ``data_dependent`` lists host-sync ops and symbolic sizes."""

    program: torch.export.ExportedProgram = field(repr=False)
    data_dependent: list[str]
    op_histogram: dict[str, int]

    @property
    def static(self) -> bool:
        return not self.data_dependent

    def to_dict(self) -> dict:
        return {"static": self.static, "data_dependent": self.data_dependent, "op_histogram": self.op_histogram}


def export_program(module: nn.Module, example_inputs: Inputs, kwargs: Mapping[str, Any] | None = None,
                   strict: bool = True) -> ExportReport:
    """``torch.export.export(module, example_inputs, kwargs, strict=strict)`` with static example shapes,
    checked for data dependence (also inside higher-order-op subgraphs). Export errors propagate."""
    with torch.no_grad():
        program = torch.export.export(module, tuple(example_inputs), dict(kwargs or {}), strict=strict)
    histogram: Counter[str] = Counter()
    for sub in program.graph_module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            histogram.update(_target_name(n.target) for n in sub.graph.nodes if n.op == "call_function")
    return ExportReport(program, data_dependence(program.graph_module), dict(sorted(histogram.items())))


# ----------------------------------------------------------------------------------------------------------
# XLA


def import_torch_xla():
    """``torch_xla`` (CPU client unless ``PJRT_DEVICE`` says otherwise), or an ImportError saying how to get it."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        require("torch_xla.debug.metrics", "tracing under XLA")
    except MissingExtraError as err:
        raise MissingExtraError(f"{err} ({XLA_INSTALL_HINT})") from None
    import torch_xla

    return torch_xla


@dataclass
class BlockCount:
    """What one dynamic-while blockwise call computed, read from the device: ``computed`` is the loop's own
    counter (static prefix + loop iterations), ``active`` the number of blocks holding a real token."""

    num_blocks: int
    static_blocks: int
    blocks_per_iteration: int
    computed: int
    active: int

    @property
    def expected(self) -> int:
        """The schedule: the static prefix, then whole iterations while the next block is active."""
        beyond = max(self.active - self.static_blocks, 0)
        iterations = -(-beyond // self.blocks_per_iteration)
        return min(self.static_blocks + iterations * self.blocks_per_iteration, self.num_blocks)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "skipped": self.num_blocks - self.computed, "expected": self.expected}


class _PendingBlockCount(NamedTuple):
    """A :class:`BlockCount` whose counts are still device tensors (part of the traced graph)."""

    num_blocks: int
    static_blocks: int
    blocks_per_iteration: int
    computed: torch.Tensor
    active: torch.Tensor

    def read(self) -> BlockCount:
        return BlockCount(self.num_blocks, self.static_blocks, self.blocks_per_iteration, int(self.computed.cpu()),
                          int(self.active.cpu()))


class _CountingBackend(TorchBackend):
    """The torch backend, keeping the dynamic-while loop's block counter (a device tensor) of every call."""

    def __init__(self, matmul: str):
        super().__init__(matmul)
        self.records: list[_PendingBlockCount] = []

    def blockwise(self, hidden_states, routing, mapping, weights, config):
        if not config.use_dynamic_while:
            return super().blockwise(hidden_states, routing, mapping, weights, config)
        result = dynamic_while_blockwise_forward(hidden_states, routing, mapping, weights, config, self.matmul)
        static = static_block_count(config, hidden_states.shape[0], routing.expert_index.shape[1],
                                    mapping.num_blocks)
        self.records.append(_PendingBlockCount(mapping.num_blocks, static, blocks_per_iteration(config),
                                               result.computed_blocks, mapping.conditions.sum()))
        return result.output


@contextlib.contextmanager
def _counting_blocks(module: nn.Module) -> Iterator[list[_CountingBackend]]:
    """Swap the torch backend of every dynamic-while ``ExpertMLPsV2`` in ``module`` for a counting one."""
    swapped = []
    for sub in module.modules():
        if (isinstance(sub, ExpertMLPsV2) and type(sub.backend) is TorchBackend
                and sub.blockwise_matmul_config.use_dynamic_while):
            swapped.append((sub, sub.backend))
            sub.backend = _CountingBackend(sub.backend.matmul)
    try:
        yield [sub.backend for sub, _ in swapped]
    finally:
        for sub, backend in swapped:
            sub.backend = backend


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
    routing: list[list[tuple[torch.Tensor, torch.Tensor]]]


def _counter(met, name: str) -> int:
    return met.counter_value(name) or 0


def _fallback_counts(met) -> Counter[str]:
    """Executions of each operator ``torch_xla`` ran on the CPU so far (its ``aten::`` counters)."""
    return Counter({name: _counter(met, name) for name in met.counter_names() if name.startswith("aten::")})


def _new_fallbacks(met, before: Counter[str]) -> list[str]:
    return sorted((_fallback_counts(met) - before).keys())


def _transfers(met) -> int:
    data = met.metric_data("TransferFromDeviceTime")
    return data[0] if data else 0


def _to(value, device):
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _xla_step(xla_module: nn.Module, args: Inputs, kwargs: Mapping[str, Any], before_sync=None) -> _Step:
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    device = torch_xla.device()
    args, kwargs = _to(tuple(args), device), _to(dict(kwargs), device)
    torch_xla.sync(wait=True)  # the inputs are on the device before tracing starts
    executions, transfers = _counter(met, "ExecuteComputation"), _transfers(met)
    with torch.no_grad(), _counting_blocks(xla_module) as counters, _recording_routing(xla_module) as routing:
        outputs = xla_module(*args, **kwargs)
    executions_during_trace = _counter(met, "ExecuteComputation") - executions
    transfers_during_trace = _transfers(met) - transfers
    records = [r for c in counters for r in c.records]
    counts = _tensors([(r.computed, r.active) for r in records])
    graph_hash = torch_xla._XLAC._get_graph_hash(_tensors(outputs) + counts)
    if before_sync is not None:
        before_sync(outputs, args)
    compilations, executions = _counter(met, "UncachedCompile"), _counter(met, "ExecuteComputation")
    torch_xla.sync(wait=True)
    compilations = _counter(met, "UncachedCompile") - compilations
    executions_at_sync = _counter(met, "ExecuteComputation") - executions
    transfers = _transfers(met)
    outputs = _to(outputs, "cpu")
    blocks = [r.read() for r in records]
    fetches = _transfers(met) - transfers
    return _Step(graph_hash, executions_during_trace, transfers_during_trace, compilations, executions_at_sync,
                 fetches, outputs, blocks, _to(routing, "cpu"))


# Routing is discontinuous: a token whose k-th and (k+1)-th router logits nearly tie can choose another expert in
# eager and under XLA when rounding upstream of the router differs -- 16-bit attention and norms, which XLA fuses
# and rounds elsewhere than eager does (measured on a bf16 GPT-OSS decoder: hidden states one bf16 ulp apart,
# float32 router logits 5e-3 apart, a token whose gap was 6e-4 flipped and moved its output by 0.4). So XLA is
# compared with eager routed as XLA routed: the eager routers select from the logits the XLA graph computed, and
# those logits are checked against eager's own separately; tokens whose experts differed are counted (near ties).


def _routers(module: nn.Module) -> list[nn.Module]:
    from nxd_moe.routing.base import RouterBase

    return [m for m in module.modules() if isinstance(m, RouterBase)]


@contextlib.contextmanager
def _recording_routing(module: nn.Module) -> Iterator[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Per router of ``module`` (module order), per call: ``(router_logits (T, E), expert_index (T, k))``."""
    routers = _routers(module)
    calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda m, args, out, seen=seen: seen.append((out[0], out[2])))
             for router, seen in zip(routers, calls)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _routing_pinned(module: nn.Module, routing: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> Iterator[None]:
    """``module``'s routers select from the given logits (:func:`_recording_routing`'s, call by call) instead of
    computing their own: every selection rule (top-k, group-limited, Sinkhorn) is a function of the logits."""
    routers = _routers(module)
    for router, calls in zip(routers, routing, strict=True):
        given = iter([logits for logits, _ in calls])
        router.get_router_logits = lambda hidden_states, given=given: next(given)
    try:
        yield
    finally:
        for router in routers:
            del router.get_router_logits


@dataclass
class _Comparison:
    """XLA against eager on one input: outputs with eager routed as XLA routed, the router logits, and the tokens
    whose experts differed when eager routed on its own."""

    max_abs_diff: float
    router_logits_max_abs_diff: float
    routing_flips: int


def _compare(module: nn.Module, args: Inputs, kwargs: Mapping[str, Any], step: _Step) -> _Comparison:
    with torch.no_grad(), _recording_routing(module) as own:
        module(*args, **kwargs)
    with torch.no_grad(), _routing_pinned(module, step.routing):
        pinned = module(*args, **kwargs)
    pairs = [(ours, theirs) for a, b in zip(own, step.routing, strict=True) for ours, theirs in zip(a, b, strict=True)]
    flips = sum(int((e.sort(dim=-1).values != x.sort(dim=-1).values).any(dim=-1).sum())
                for (_, e), (_, x) in pairs)
    return _Comparison(_max_abs_diff(step.outputs, pinned),
                       _max_abs_diff([x for (_, _), (x, _) in pairs], [e for (e, _), _ in pairs]), flips)


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
    same experts for one ``i`` (:func:`moe_inputs` does: ``i = 0`` repeats one token). ``module`` is not
    modified: a copy runs on the XLA device.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"n must be an int >= 2 (several routings, to see whether they share a graph), got {n!r}")
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    kwargs = dict(kwargs or {})
    xla_module = _xla_copy(module)
    fallbacks_before = _fallback_counts(met)
    steps, comparisons = [], []
    for i in range(n):
        args = tuple(make_inputs(i))
        step = _xla_step(xla_module, args, kwargs)
        steps.append(step)
        comparisons.append(_compare(module, args, kwargs, step))
    return StaticReport(
        routings=n,
        graphs=len({s.graph_hash for s in steps}),
        compilations=sum(s.compilations for s in steps),
        executions_during_trace=sum(s.executions_during_trace for s in steps),
        transfers_during_trace=sum(s.transfers_during_trace for s in steps),
        executions_per_step=[s.executions_at_sync for s in steps],
        output_fetch_transfers=sum(s.output_fetch_transfers for s in steps),
        fallback_ops=_new_fallbacks(met, fallbacks_before),
        max_abs_diff=max(c.max_abs_diff for c in comparisons),
        router_logits_max_abs_diff=max(c.router_logits_max_abs_diff for c in comparisons),
        routing_flips=[c.routing_flips for c in comparisons],
        atol=atol,
        blocks=[s.blocks for s in steps],
    )


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
    from nxd_moe.parallel_state import SPMDRank

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


def _describe(value) -> list[dict]:
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in _tensors(value)]


def export_hlo(module: nn.Module, example_inputs: Inputs, out_dir: str | os.PathLike,
               kwargs: Mapping[str, Any] | None = None, atol: float = 1e-5) -> dict:
    """Trace one forward under XLA and write to ``out_dir``:

    - ``model.hlo.txt``: the HLO module, readable;
    - ``model.hlo_module.pb``: the serialized ``HloModuleProto`` (what ``neuronx-cc compile --framework XLA``
      reads);
    - ``parameters.json``: each entry parameter of the HLO in order (:class:`ProgramParameter`), and the values a
      runtime feeds besides the inputs: ``weights.pt`` (``{module path: tensor}``) and ``shared.pt``
      (``{parameter number: tensor}``);
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
    fallbacks_before = _fallback_counts(met)
    hlo = {}
    before = module_tensor_names(xla_module)

    def dump(outputs, device_inputs):
        tensors = _tensors(outputs)
        hlo["text"] = torch_xla._XLAC._get_xla_tensors_hlo(tensors)
        hlo["proto"] = torch_xla._XLAC._get_xla_tensors_hlo_proto(tensors)
        parameters, values = hlo_parameters(xla_module, device_inputs, tensors, before)
        # read before the sync runs the program: a state buffer the program updates in place (an application's KV
        # cache) is donated to its output, and its input value is gone afterwards
        hlo["parameters"] = parameters, [v.cpu() for v in values]

    step = _xla_step(xla_module, example_inputs, kwargs, before_sync=dump)
    compared = _compare(module, example_inputs, kwargs, step)
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
        "inputs": _describe((tuple(example_inputs), kwargs)),
        "parameters": [p.to_dict() for p in parameters],
        "outputs": _describe(step.outputs),
        "fallback_ops": _new_fallbacks(met, fallbacks_before),
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


# ----------------------------------------------------------------------------------------------------------
# inputs that vary the routing


def moe_inputs(moe: nn.Module, tokens: int, mode: str = "prefill", padding: bool = False,
               seed: int = 0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``make_inputs`` for an ``MoE``: ``i -> (hidden_states[, padding_mask])``.

    ``mode="prefill"``: one sequence of ``tokens`` tokens ``(1, T, H)``; ``"decode"``: ``tokens`` sequences of
    one token ``(T, 1, H)``. ``i = 0`` repeats a single token, so every token goes to the same ``k`` experts (the
    most skewed routing: one expert receives all ``T`` tokens); other ``i`` draw independent random tokens.
    ``padding`` masks out the last quarter of the tokens (at least one).
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    shape = (1, tokens) if mode == "prefill" else (tokens, 1)
    dtype, hidden = moe.expert_mlps.dtype, moe.hidden_size

    def make(i: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed + i)
        x = torch.randn(*shape, hidden, generator=generator, dtype=torch.float64)
        if i == 0:
            x = x[:1, :1].expand_as(x)
        x = x.to(dtype).contiguous()
        if not padding:
            return (x,)
        mask = torch.ones(tokens, dtype=torch.bool)
        mask[tokens - max(1, tokens // 4):] = False
        return x, mask.view(shape)

    return make


def model_inputs(step: nn.Module, tokens: int, mode: str = "decode",
                 seed: int = 0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``make_inputs`` for a whole decoder step (:class:`nxd_moe.models.decoder_step.StaticCacheStep`):
    ``i -> (input_ids, cache_position, *cache)``.

    ``mode="decode"``: ``tokens`` sequences of one new token each, written at cache position ``L - 1 - i`` (mod
    ``L``, the cache length: every input also moves the write position), after a context of random keys and values
    in the positions before it (zeros after). ``"prefill"``: one sequence of ``tokens`` new tokens at positions
    ``0 .. tokens - 1`` of an empty (zero) cache. ``i = 0`` gives every token the same id (and, decoding, every
    sequence the same context), so every token of every MoE layer goes to the same experts -- except where the
    attention output depends on the position itself (GPT-OSS's attention sinks at prefill); other ``i`` draw random
    ids. :func:`routing_summary` says which experts each input reached.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    length = step.cache_length
    if mode == "prefill" and tokens > length:
        raise ValueError(f"tokens must be <= the cache length ({length}) for a prefill, got {tokens}")
    batch, new = (tokens, 1) if mode == "decode" else (1, tokens)
    shapes = step.cache_shapes(batch)
    vocab = step.model.get_input_embeddings().weight.shape[0]

    def make(i: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(0, vocab, (batch, new), generator=generator)
        if i == 0:
            ids = ids[:1, :1].expand(batch, new).contiguous()
        if mode == "prefill":
            return (ids, torch.arange(tokens), *(torch.zeros(shape, dtype=dtype) for shape, dtype in shapes))
        position = (length - 1 - i) % length
        cache = []
        for shape, dtype in shapes:
            context = torch.randn(shape, generator=generator, dtype=torch.float64)
            if i == 0:
                context = context[:1].expand(shape).clone()
            context[:, :, position:] = 0.0  # not written yet
            cache.append(context.to(dtype).contiguous())
        return (ids, torch.tensor([position]), *cache)

    return make


@torch.no_grad()
def routing_summary(module: nn.Module, inputs: Inputs) -> list[dict[str, Any]]:
    """Per ``MoE`` layer in ``module`` (in call order), for one eager forward on ``inputs``: ``tokens`` routed,
    the ``experts_mode`` their shape selects, ``experts_used`` (distinct experts any token chose) and
    ``max_expert_tokens`` (tokens of the busiest expert). Every token sent to the same ``k`` experts reads
    ``experts_used == k`` and ``max_expert_tokens == tokens``."""
    from nxd_moe.moe import MoE

    found: list[dict[str, Any]] = []

    def record_shape(moe, args):
        batch, seq_len, _ = args[0].shape
        mode = moe.expert_mlps.resolve_mode(None, batch * seq_len, seq_len)
        found.append({"tokens": batch * seq_len, "experts_mode": mode.value})

    def record_routing(router, args, output):
        expert_index = output[2]
        counts = torch.bincount(expert_index.reshape(-1).cpu(), minlength=router.num_experts)
        found[-1].update(experts_used=int((counts > 0).sum()), max_expert_tokens=int(counts.max()))

    layers = [m for m in module.modules() if isinstance(m, MoE)]
    hooks = [m.register_forward_pre_hook(record_shape) for m in layers]
    hooks += [m.router.register_forward_hook(record_routing) for m in layers]
    try:
        module(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return found


# ----------------------------------------------------------------------------------------------------------
# nxd-moe trace

DEFAULT_TOKENS = {"prefill": 512, "decode": 8}
DEFAULT_MODEL_TOKENS = {"prefill": 64, "decode": 8}
# At most GPT-OSS's 128-token sliding window (the smallest of the shipped models), so every shipped model traces.
DEFAULT_CACHE_LENGTH = 128
# Layer-trace options a whole-decoder trace does not take.
_LAYER_ONLY_FLAGS = {"dynamic_while": "--dynamic-while", "padding": "--padding", "skip_xla": "--skip-xla"}
DYNAMIC_WHILE_FLAGS = {
    "off": (False, False),
    "intermediate": (True, False),
    "block": (False, True),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from nxd_moe.config import builtin_config_names

    parser.add_argument("--config", required=True,
                        help=f"YAML path or built-in name ({', '.join(builtin_config_names())})")
    parser.add_argument("--out", required=True, help="directory for the HLO, the exported program and the reports")
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                        help="prefill: one sequence of --tokens tokens; decode: --tokens sequences of one token")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help=f"tokens per forward (default {DEFAULT_TOKENS['prefill']} prefill, "
                             f"{DEFAULT_TOKENS['decode']} decode)")
    parser.add_argument("--scale", type=scale_argument, default="auto",
                        help="divide H and I by this (rounded up to a multiple of 8, or of the weight format's "
                             f"block; the report says when); 'auto' (default) picks a power of two >= {MIN_AUTO_SCALE}")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--block-size", type=positive_int, default=None, help="override the config's block_size")
    parser.add_argument("--dynamic-while", choices=sorted(DYNAMIC_WHILE_FLAGS), default=None,
                        help="blockwise padding-block skipping: use_shard_on_intermediate_dynamic_while "
                             "('intermediate'), use_shard_on_block_dynamic_while ('block'), or 'off' "
                             "(default: the config's)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="routed experts' weight format (default: the config's, bf16)")
    parser.add_argument("--padding", action="store_true", help="mask out the last quarter of the tokens")
    parser.add_argument("--routings", type=positive_int, default=3,
                        help="routings check_static runs under XLA (>= 2; default 3, the first sends every token "
                             "to the same experts)")
    parser.add_argument("--atol", type=float, default=None,
                        help="largest |XLA - eager| accepted (default 1e-4; 6e-2 for 16-bit dtypes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-xla", action="store_true", help="only torch.export and torch.compile")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--model-layers", type=positive_int, default=None,
                        help="trace a whole transformers decoder of the config's architecture instead of one layer: "
                             "this many MoE layers (the dense layers it places around them on top), MoE blocks "
                             "patched with nxd_moe, one prefill or decode step over a static KV cache; needs "
                             f"torch_xla (default --tokens {DEFAULT_MODEL_TOKENS['prefill']} prefill, "
                             f"{DEFAULT_MODEL_TOKENS['decode']} decode)")
    parser.add_argument("--cache-length", type=positive_int, default=None,
                        help=f"with --model-layers: KV cache positions (default {DEFAULT_CACHE_LENGTH}, at most the "
                             "model's sliding window)")

    spmd = parser.add_argument_group("parallel layouts (one SPMD program for every rank; runs on --tp x --ep XLA "
                                     "CPU devices, no torchrun)")
    spmd.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    spmd.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size")
    spmd.add_argument("--sp", action="store_true", help="sequence-parallel prefill (the tokens split over --tp)")
    spmd.add_argument("--decode-tp", type=positive_int, default=None,
                      help="MoE tensor-parallel size in decode (hybrid sharding; default --tp)")
    spmd.add_argument("--decode-ep", type=positive_int, default=None,
                      help="MoE expert-parallel size in decode (hybrid sharding; default --ep)")
    spmd.add_argument("--dispatch", default="all_gather", choices=("all_gather", "all_to_all", "all_to_all_v"),
                      help="expert-parallel dispatch: all_gather (default, NxD's) or all_to_all (= all_to_all_v "
                           "with static splits, the only all-to-all a static graph has)")
    spmd.add_argument("--lnc", type=int, choices=(1, 2), default=2,
                      help="logical NeuronCore size in the printed neuronx-cc command (default 2, Trn2)")


class TraceSetup(NamedTuple):
    """What ``nxd-moe trace``'s arguments resolve to: the config, dtype, scale, tokens per forward and the
    ``build_moe`` overrides."""

    model: Any
    dtype: torch.dtype
    scale: int
    tokens: int
    overrides: dict


def setup(args: argparse.Namespace) -> TraceSetup:
    """Resolve and check ``nxd-moe trace``'s layer arguments (``ValueError`` naming a bad one)."""
    from nxd_moe.config import load_model_config, to_torch_dtype

    model = load_model_config(args.config)
    dtype = to_torch_dtype(args.dtype, "--dtype")
    scale = auto_scale(model.hidden_size) if args.scale == "auto" else args.scale
    if args.routings < 2:
        raise ValueError(f"--routings must be >= 2, got {args.routings}")
    overrides: dict[str, Any] = {}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.quantization is not None:
        overrides["quantization"] = args.quantization
    if args.dynamic_while is not None:
        on_intermediate, on_block = DYNAMIC_WHILE_FLAGS[args.dynamic_while]
        overrides["block_use_shard_on_intermediate_dynamic_while"] = on_intermediate
        overrides["block_use_shard_on_block_dynamic_while"] = on_block
    return TraceSetup(model, dtype, scale, args.tokens or DEFAULT_TOKENS[args.mode], overrides)


def layer_report(args: argparse.Namespace, run: TraceSetup, moe: nn.Module, stats: dict,
                 experts: nn.Module | None = None) -> dict[str, Any]:
    """The report's description of the traced layer ``moe`` (``stats``: its ``ExpertsStats.summary()``);
    ``experts``: the ``ExpertMLPsV2`` whose stored weights the graph takes (default ``moe``'s)."""
    from nxd_moe.build import scale_rounding

    bcfg = moe.expert_mlps.blockwise_matmul_config
    experts = moe.expert_mlps if experts is None else experts
    return {
        "config": run.model.name,
        "scale": run.scale,
        "dtype": str(run.dtype).removeprefix("torch."),
        "mode": args.mode,
        "tokens": run.tokens,
        "padding": args.padding,
        "hidden_size": moe.hidden_size,
        "scale_rounding": scale_rounding(run.model, run.scale, moe.hidden_size,
                                         moe.expert_mlps.routed_experts_mlp_config.intermediate_size),
        "num_experts": run.model.num_experts,
        "top_k": run.model.top_k,
        "router": type(moe.router).__name__,
        "experts_mode": stats["mode"],
        "num_blocks": stats["num_blocks"],
        "active_blocks": stats.get("active_blocks"),
        "dynamic_while": ("intermediate" if bcfg.use_shard_on_intermediate_dynamic_while
                          else "block" if bcfg.use_shard_on_block_dynamic_while else "off"),
        "quantization": reported_format(moe.expert_mlps.routed_experts_mlp_config.quantization),
        # what the graph's weight inputs hold: the stored (8-bit / packed 4-bit) tensors, not dequantized copies
        "expert_weight_dtypes": {k: str(v.dtype).removeprefix("torch.")
                                 for k, v in experts.mlp_op.state_dict().items()},
    }


def trace(args: argparse.Namespace) -> dict:
    """Build the layer a config describes and run every check; write the artifacts to ``args.out``."""
    if args.model_layers is not None:
        return trace_model(args)
    from nxd_moe.build import build_moe

    run = setup(args)
    if not args.skip_xla:
        import_torch_xla()  # the HLO is what was asked for: without torch_xla, stop before any work
    dtype = run.dtype
    moe = build_moe(run.model, scale=run.scale, dtype=dtype, seed=args.seed, **run.overrides)
    atol = args.atol if args.atol is not None else (1e-4 if dtype in (torch.float32, torch.float64) else 6e-2)
    make_inputs = moe_inputs(moe, run.tokens, args.mode, args.padding, args.seed)
    example = make_inputs(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        stats = moe(*example, return_stats=True)[-1].summary()
    report = layer_report(args, run, moe, stats)
    exported = export_program(moe, example)
    torch.export.save(exported.program, out_dir / "program.pt2")
    report["export"] = {**exported.to_dict(), "file": "program.pt2",
                        "ops": sum(exported.op_histogram.values())}
    report["compile"] = compile_check(moe, example).to_dict()
    if args.skip_xla:
        report["xla"] = {"skipped": "--skip-xla"}
    else:
        # check_static first: it then reports the one compilation (export_hlo reuses the compiled graph).
        static = check_static(moe, make_inputs, n=args.routings, atol=atol)
        hlo = export_hlo(moe, example, out_dir, atol=atol)
        report["xla"] = {"hlo": hlo, "check_static": static.to_dict()}
    report["ok"] = _all_ok(report)
    (out_dir / "trace.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _all_ok(report: dict) -> bool:
    checks = [report["export"]["static"], report["compile"]["fullgraph"]]
    if "hlo" in report["xla"]:
        hlo, static = report["xla"]["hlo"], report["xla"]["check_static"]
        checks += [hlo["static"], hlo["matches_eager"], static["ok"]]
    return all(checks)


LABEL = 27  # width of the check names in the report


def _yes(flag: bool) -> str:
    return "ok" if flag else "FAILED"


def _parameters_line(hlo: dict, out_dir: str) -> str:
    """The HLO's entry parameters by kind, and where their map and values are."""
    kinds = Counter(p["kind"] for p in hlo["parameters"])
    files = hlo["files"]
    return (f"{'HLO parameters':<{LABEL}}{len(hlo['parameters'])}: {kinds['input']} inputs, {kinds['weight']} weights "
            f"-> {out_dir}/{files['weights']}, {kinds['shared']} shared -> {out_dir}/{files['shared']}; map "
            f"{out_dir}/{files['parameters']}")


def _eager_parity(static: dict) -> str:
    """check_static's comparison with eager, for the report line."""
    flips = static["routing_flips"]
    ties = f", near-tie flips {'/'.join(map(str, flips))} (eager routed as XLA routed)" if any(flips) else ""
    return (f"max |XLA - eager| {static['max_abs_diff']:.2e}, router logits {static['router_logits_max_abs_diff']:.2e}"
            f"{ties}")


def format_report(report: dict, out_dir: str) -> str:
    blocks = ""
    if report["num_blocks"] is not None:
        blocks = f" (num_blocks {report['num_blocks']}, active {report['active_blocks']})"
    lines = [
        f"nxd-moe trace: {report['config']}  (scale 1/{report['scale']}: H={report['hidden_size']}"
        + (f" (rounded up: {report['scale_rounding']})" if report["scale_rounding"] else "")
        + f", E={report['num_experts']}, k={report['top_k']}, router={report['router']}; {report['dtype']})",
        f"{report['mode']} {report['tokens']} tokens{' with padding' if report['padding'] else ''} -> "
        f"{report['experts_mode']}{blocks}, dynamic while: {report['dynamic_while']}",
        f"expert weights {describe_weights(report['quantization'], report['dtype'])}: "
        + ", ".join(f"{k} {v}" for k, v in report["expert_weight_dtypes"].items()),
    ]
    export, compiled = report["export"], report["compile"]
    lines.append(f"{'torch.export (strict)':<{LABEL}}{_yes(export['static'])}: {export['ops']} ops, "
                 f"{len(export['data_dependent'])} data-dependent -> {out_dir}/{export['file']}")
    for problem in export["data_dependent"][:3]:
        lines.append(f"    {problem}")
    detail = (f"max |compiled - eager| {compiled['max_abs_diff']:.2e}" if compiled["fullgraph"]
              else compiled["error"])
    lines.append(f"{'torch.compile(fullgraph)':<{LABEL}}{_yes(compiled['fullgraph'])}: {detail}")
    xla = report["xla"]
    if "skipped" in xla:
        lines.append(f"{'XLA':<{LABEL}}skipped: {xla['skipped']}")
    else:
        hlo, static = xla["hlo"], xla["check_static"]
        lines.append(
            f"{'XLA HLO':<{LABEL}}{_yes(hlo['static'] and hlo['matches_eager'])}: "
            f"{hlo['compiled_graphs']} graph, {hlo['hlo_instructions']} instructions, {hlo['while_ops']} while, "
            f"CPU fallbacks {hlo['fallback_ops'] or 'none'}, host transfers during trace "
            f"{hlo['transfers_during_trace']} -> {out_dir}/{hlo['files']['hlo_proto']}")
        lines.append(_parameters_line(hlo, out_dir))
        lines.append(
            f"{'XLA check_static':<{LABEL}}{_yes(static['ok'])}: {static['routings']} routings -> "
            f"{static['graphs']} graph, {static['compilations']} compilation, "
            f"{static['executions_during_trace']} mid-layer executions, "
            f"{static['transfers_during_trace']} mid-layer transfers "
            f"({static['output_fetch_transfers']} output fetches), fallbacks {static['fallback_ops'] or 'none'}, "
            f"{_eager_parity(static)}")
        for i, step in enumerate(static["blocks"]):
            for b in step:
                lines.append(f"    routing {i}: computed {b['computed']} of {b['num_blocks']} blocks "
                             f"(active {b['active']}, static prefix {b['static_blocks']}, "
                             f"{b['blocks_per_iteration']} per iteration; skipped {b['skipped']})")
        lines.append(f"compile for Trainium2: neuronx-cc compile {out_dir}/{hlo['files']['hlo_proto']} "
                     f"--framework XLA --target trn2 --output {out_dir}/model.neff")
    if not report["ok"]:
        lines.append("SOME CHECKS FAILED")
    elif "skipped" in xla:
        lines.append("torch.export and torch.compile checks passed; XLA checks skipped, no HLO written")
    else:
        lines.append("all checks passed")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# nxd-moe trace --model-layers: a whole decoder


def trace_model(args: argparse.Namespace) -> dict:
    """Build the transformers decoder of the config's architecture, patch its MoE blocks with nxd_moe's ``MoE``
    (torch backend), and check one ``args.mode`` step over a static KV cache under XLA; write the HLO and reports
    to ``args.out``."""
    require("transformers", "--model-layers")
    from nxd_moe.build import scaled_model
    from nxd_moe.hf import patch_model
    from nxd_moe.models.decoder_step import StaticCacheStep, check_cache_length, replace_polar_rotary_embeddings
    from nxd_moe.models.hf_models import build_hf_config, build_hf_model

    given = [flag for name, flag in _LAYER_ONLY_FLAGS.items() if getattr(args, name) not in (None, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: one-layer trace options, not taken with --model-layers")
    run = setup(args)
    config, dtype, scale = run.model, run.dtype, run.scale
    tokens = args.tokens or DEFAULT_MODEL_TOKENS[args.mode]
    cache_length = args.cache_length or DEFAULT_CACHE_LENGTH
    hf_config = build_hf_config(config, num_layers=args.model_layers, scale=scale, quantization=args.quantization)
    check_cache_length(hf_config, cache_length, "--cache-length")
    if args.mode == "prefill" and tokens > cache_length:
        raise ValueError(f"--tokens ({tokens}) must be <= --cache-length ({cache_length}) for a prefill")
    import_torch_xla()
    # eager attention: plain matmuls and a softmax, which every family has (GPT-OSS's attention sinks exist only
    # there); sdpa decomposes into the same ops under torch_xla
    model = build_hf_model(config, num_layers=args.model_layers, scale=scale, dtype=dtype, seed=args.seed,
                           attn_implementation="eager", quantization=args.quantization)
    build_kwargs = {} if args.block_size is None else {"block_size": args.block_size}
    patch_model(model, backend="torch", quantization=args.quantization, **build_kwargs)
    patched = model.nxd_moe_patched
    rewritten = replace_polar_rotary_embeddings(model)
    step = StaticCacheStep(model, cache_length).eval()
    make_inputs = model_inputs(step, tokens, args.mode, args.seed)
    atol = args.atol if args.atol is not None else (1e-4 if dtype in (torch.float32, torch.float64) else 6e-2)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    routings = [routing_summary(step, make_inputs(i)) for i in range(args.routings)]
    # check_static first: it then reports the one compilation (export_hlo reuses the compiled graph).
    static = check_static(step, make_inputs, n=args.routings, atol=atol)
    hlo = export_hlo(step, make_inputs(1), out_dir, atol=atol)
    moe = scaled_model(config, scale, args.quantization)
    report: dict[str, Any] = {
        "config": config.name,
        "scale": scale,
        "dtype": str(dtype).removeprefix("torch."),
        "mode": args.mode,
        "tokens": tokens,
        "cache_length": cache_length,
        "hidden_size": moe.hidden_size,
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "model": {
            "class": type(model).__name__,
            "model_type": hf_config.model_type,
            "decoder_layers": hf_config.num_hidden_layers,
            "moe_layers": args.model_layers,
            "vocab_size": model.get_input_embeddings().weight.shape[0],
            "attn_implementation": "eager",
            "patched": list(patched.patched),
            "kept": [path for path, _ in patched.kept],
            "backend": patched.backend,
            "quantization": patched.quantization,
            "rewritten": {path: "PolarFreeRotaryEmbedding" for path in rewritten},
        },
        "routings": routings,
        "xla": {"hlo": hlo, "check_static": static.to_dict()},
        "neuronx_cc": (f"neuronx-cc compile {out_dir}/{hlo['files']['hlo_proto']} --framework XLA --target trn2 "
                       f"--output {out_dir}/model.neff"),
    }
    # every MoE layer ran nxd_moe's MoE in every input (none left to transformers' block)
    report["model"]["moe_layers_traced"] = all(len(r) == args.model_layers for r in routings)
    report["ok"] = (report["model"]["moe_layers_traced"] and hlo["static"] and hlo["matches_eager"]
                    and static.ok)
    (out_dir / "trace.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _routing_line(i: int, layers: list[dict]) -> str:
    modes = sorted({layer["experts_mode"] for layer in layers})
    used = "/".join(str(layer["experts_used"]) for layer in layers)
    busiest = "/".join(f"{layer['max_expert_tokens']}" for layer in layers)
    return (f"    input {i}: {', '.join(modes)}; experts used per MoE layer {used}, busiest expert's tokens {busiest} "
            f"of {layers[0]['tokens'] if layers else 0}")


def format_model_report(report: dict, out_dir: str) -> str:
    model, hlo, static = report["model"], report["xla"]["hlo"], report["xla"]["check_static"]
    shape = (f"{report['tokens']} sequences x 1 new token" if report["mode"] == "decode"
             else f"1 sequence of {report['tokens']} tokens")
    rewritten = f"; rewritten for XLA: {', '.join(model['rewritten'])}" if model["rewritten"] else ""
    experts = describe_weights(model["quantization"], report["dtype"])
    lines = [
        f"nxd-moe trace: {report['config']} whole decoder  ({model['class']}: {model['decoder_layers']} layers, "
        f"{model['moe_layers']} MoE; scale 1/{report['scale']}: H={report['hidden_size']}, E={report['num_experts']}, "
        f"k={report['top_k']}, vocab {model['vocab_size']}; {report['dtype']}; {model['attn_implementation']} "
        "attention)",
        f"{report['mode']} {shape}, static KV cache of {report['cache_length']} positions; MoE blocks patched "
        f"{len(model['patched'])} ({model['backend']} backend, experts {experts}){rewritten}",
        *(_routing_line(i, layers) for i, layers in enumerate(report["routings"])),
        f"{'XLA HLO':<{LABEL}}{_yes(hlo['static'] and hlo['matches_eager'])}: "
        f"{hlo['compiled_graphs']} graph, {hlo['hlo_instructions']} instructions, CPU fallbacks "
        f"{hlo['fallback_ops'] or 'none'}, host transfers during trace {hlo['transfers_during_trace']} -> "
        f"{out_dir}/{hlo['files']['hlo_proto']}",
        _parameters_line(hlo, out_dir),
        f"{'XLA check_static':<{LABEL}}{_yes(static['ok'])}: {static['routings']} inputs -> {static['graphs']} "
        f"graph, {static['compilations']} compilation, {static['executions_during_trace']} mid-step executions, "
        f"{static['transfers_during_trace']} mid-step transfers ({static['output_fetch_transfers']} output "
        f"fetches), fallbacks {static['fallback_ops'] or 'none'}, {_eager_parity(static)}",
        f"compile for Trainium2: {report['neuronx_cc']}",
    ]
    if not model["moe_layers_traced"]:
        lines.append(f"not every MoE layer ran nxd_moe's MoE (expected {model['moe_layers']} per input)")
    lines.append("all checks passed" if report["ok"] else "SOME CHECKS FAILED")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from nxd_moe import trace_spmd

    try:
        layout = trace_spmd.spmd_layout_from_args(args)
        if layout is not None and args.skip_xla:
            raise ValueError("--skip-xla: a parallel layout (--tp/--ep/--sp/--decode-*) is checked under XLA only")
        if layout is not None and args.model_layers is not None:
            raise ValueError("--model-layers traces a whole decoder on one device; it does not combine with a parallel "
                             "layout (--tp/--ep/--sp/--decode-*)")
        report = trace(args) if layout is None else trace_spmd.trace(args, layout)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"nxd-moe trace: error: {e}", file=sys.stderr)
        return 2
    if layout is not None:
        text = trace_spmd.format_report(report, args.out)
    else:
        text = (format_model_report if "model" in report else format_report)(report, args.out)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0 if report["ok"] else 1
