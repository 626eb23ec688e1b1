"""One GEMM for the projections of one input -- q, k and v of an attention block -- in the compiled token step.

At decode sizes a projection is a GEMV that reads its weight once; three GEMVs of one input cost three launches and
three ramp-ups (on an H200 at batch 1, Qwen3-30B-A3B's k and v projections, 2 MiB each, take 5.4 us apiece, q 7 us
for 16 MiB), one GEMV over their rows stacked reads the same bytes in one. Two steps:

- :func:`share_projection_storage` (at the application's construction, before anything is captured): a one-token
  forward finds the ``nn.Linear`` modules called on one tensor (q_proj, k_proj, v_proj; DeepSeek's q_a_proj and
  kv_a_proj_with_mqa) and re-points their weights (and biases) as consecutive rows of one new tensor each -- the same
  values, no extra memory, and a later in-place load of the weights reaches the stacked tensor too;
- :func:`fuse_projections` (a pass over the graph Dynamo captured, :func:`compile_with_fused_projections` runs it
  before Inductor): linear calls on one input whose weights are such consecutive rows become one linear over the
  whole tensor, split back into the outputs.

Weights that are not consecutive rows (never shared, or re-pointed since) are left to their own GEMMs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["compile_with_fused_projections", "fuse_projections", "share_projection_storage", "stacked_rows"]

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


@torch.no_grad()
def share_projection_storage(model: nn.Module, probe: Callable[[], object]) -> int:
    """Run ``probe()`` (a forward of ``model``) and stack, for every group of ``nn.Linear`` modules of ``model``
    called on one tensor, their weights (and their biases, when every one has one) as consecutive rows of one new
    tensor. Returns the number of groups stacked. Modules of other dtypes, devices or input widths than the group's
    first, and modules called more than once, are left alone."""
    calls: dict[int, tuple[torch.Tensor, list[nn.Linear]]] = {}
    seen: dict[nn.Linear, int] = defaultdict(int)

    def record(module, args):
        seen[module] += 1
        if args and isinstance(args[0], torch.Tensor):
            # the input itself is held: its id is not reused while the probe runs
            calls.setdefault(id(args[0]), (args[0], []))[1].append(module)

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if type(m) is nn.Linear]
    try:
        probe()
    finally:
        for hook in hooks:
            hook.remove()
    stacked = 0
    for _, modules in calls.values():
        modules = [m for m in modules if seen[m] == 1]
        if len(modules) < 2:
            continue
        first = modules[0]
        group = [m for m in modules if m.weight.dtype == first.weight.dtype
                 and m.weight.device == first.weight.device and m.in_features == first.in_features
                 and (m.bias is None) == (first.bias is None)]
        if len(group) < 2 or stacked_rows([m.weight for m in group]) is not None:
            continue
        _stack([m.weight for m in group])
        if first.bias is not None:
            _stack([m.bias for m in group])
        stacked += 1
    return stacked


def _stack(parameters: list[nn.Parameter]) -> None:
    whole = torch.cat([p.detach() for p in parameters])
    for parameter, rows in zip(parameters, whole.split([p.shape[0] for p in parameters])):
        parameter.data = rows


def stacked_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive rows ``tensors`` are (each contiguous, in order, in one storage), as a view
    of that storage; None if they are not."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        # one storage (so one device), in order, each contiguous, rows of one width and dtype
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset
                or not t.is_contiguous() or t.dim() != first.dim() or t.shape[1:] != first.shape[1:]
                or t.dtype != first.dtype):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return torch.as_strided(first.detach(), (rows, *first.shape[1:]), first.stride())  # from first's offset


def _linear_operands(node: torch.fx.Node):
    args, kwargs = node.args, node.kwargs
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return args[0], weight, bias


def fuse_projections(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """``gm`` (a graph Dynamo captured; ``example_inputs`` its placeholders' values) where every group of two or
    more ``linear(x, W_i, b_i)`` calls on one ``x`` whose weights -- and biases, if any -- are parameters stacked as
    consecutive rows of one tensor is one ``linear(x, W, b)`` over that tensor (an attribute of the returned graph
    module: to AOTAutograd a parameter of static shape), its output narrowed back into each call's
    ``(..., rows_i)``. ``gm`` itself is never changed (Dynamo reads it afterwards); with nothing to fuse, ``gm``."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(gm.graph, {}))
    # a graph module of our own: AOTAutograd lifts its attributes as parameters instead of asking Dynamo for
    # their sources (it has none)
    fused = torch.fx.GraphModule(gm, copy)
    return fused if _fuse(fused, example_inputs) else gm


def _fuse(gm: torch.fx.GraphModule, example_inputs: list) -> int:
    values = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    # calls on one input with weights in one storage, with or without biases: candidates for one GEMM
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _LINEAR:
            x, weight, bias = _linear_operands(node)
            if isinstance(values.get(weight), nn.Parameter) and (bias is None or
                                                                 isinstance(values.get(bias), nn.Parameter)):
                groups[x, values[weight].untyped_storage().data_ptr(), bias is None].append(node)
    fused = 0
    for (x, _, _), calls in groups.items():
        if len(calls) < 2:
            continue
        first = calls[0]  # graph order: the fused call goes before the first
        nodes = sorted(calls, key=lambda n: values[_linear_operands(n)[1]].storage_offset())
        operands = [_linear_operands(n) for n in nodes]
        weights = [values[w] for _, w, _ in operands]
        weight = stacked_rows(weights)
        bias = None if operands[0][2] is None else stacked_rows([values[b] for _, _, b in operands])
        if weight is None or (operands[0][2] is not None and bias is None):
            continue
        name = f"nxd_moe_stacked_{fused}"
        gm.register_buffer(f"{name}_weight", weight)
        if bias is not None:
            gm.register_buffer(f"{name}_bias", bias)
        with gm.graph.inserting_before(first):
            stacked = (gm.graph.get_attr(f"{name}_weight"), None if bias is None else gm.graph.get_attr(f"{name}_bias"))
            whole = gm.graph.call_function(torch._C._nn.linear, (x, *stacked))
            start = 0
            for node, w in zip(nodes, weights):
                part = gm.graph.call_method("narrow", (whole, -1, start, w.shape[0]))
                # contiguous as each call's own output was: what follows may view it in any way
                node.replace_all_uses_with(gm.graph.call_method("contiguous", (part,)))
                start += w.shape[0]
        for node in nodes:
            gm.graph.erase_node(node)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def compile_with_fused_projections(gm: torch.fx.GraphModule, example_inputs: list):
    """A ``torch.compile`` backend: :func:`fuse_projections`, then Inductor."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(fuse_projections(gm, example_inputs), example_inputs)
