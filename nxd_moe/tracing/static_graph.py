"""Static-graph checks without ``torch_xla``, on any torch: ``torch.export`` (strict) and
``torch.compile(fullgraph=True)``, each captured graph checked for host-sync ops and data-dependent sizes.

A layer is deployable on Trainium only if every routing traces to the same graph; these FX-level checks prove the
same property the XLA checks (:mod:`~nxd_moe.tracing.single_device`) do, on the graphs Dynamo and ``torch.export``
capture. :func:`static_backend` is also the Dynamo backend the GPU tests compile with.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

from nxd_moe.tracing.tensors import Inputs, max_abs_diff

# Ops that read tensor values on the host or give outputs whose shape depends on them.
SYNC_OPS = frozenset({"item", "_local_scalar_dense", "tolist", "numpy", "nonzero", "nonzero_static", "argwhere",
                      "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "histc",
                      "_assert_scalar"})


class DataDependentGraph(AssertionError):
    """A captured graph contains a host-sync op or a data-dependent (symbolic) size."""


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
    return CompileReport(True, max_abs_diff(out, eager))


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
