"""XLA's outputs against eager PyTorch's, with eager routed as XLA routed.

Routing is discontinuous: a token whose k-th and (k+1)-th router logits nearly tie can choose another expert in
eager and under XLA when rounding upstream of the router differs -- 16-bit attention and norms, which XLA fuses
and rounds elsewhere than eager does (measured on a bf16 GPT-OSS decoder: hidden states one bf16 ulp apart,
float32 router logits 5e-3 apart, a token whose gap was 6e-4 flipped and moved its output by 0.4). So XLA is
compared with eager routed as XLA routed: the eager routers select from the logits the XLA graph computed, and
those logits are checked against eager's own separately; tokens whose experts differed are counted (near ties).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from nxd_moe.routing.base import RouterBase
from nxd_moe.tracing.tensors import Inputs, max_abs_diff

# Per router of a module (module order), per call: (router_logits (T, E), expert_index (T, k)).
Routing = list[list[tuple[torch.Tensor, torch.Tensor]]]


def _routers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, RouterBase)]


@contextlib.contextmanager
def recording_routing(module: nn.Module) -> Iterator[Routing]:
    """Per router of ``module`` (module order), per call: ``(router_logits (T, E), expert_index (T, k))``."""
    routers = _routers(module)
    calls: Routing = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda m, args, out, seen=seen: seen.append((out[0], out[2])))
             for router, seen in zip(routers, calls)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _routing_pinned(module: nn.Module, routing: Routing) -> Iterator[None]:
    """``module``'s routers select from the given logits (:func:`recording_routing`'s, call by call) instead of
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
class Comparison:
    """XLA against eager on one input: outputs with eager routed as XLA routed, the router logits, and the tokens
    whose experts differed when eager routed on its own."""

    max_abs_diff: float
    router_logits_max_abs_diff: float
    routing_flips: int


def compare(module: nn.Module, args: Inputs, kwargs: Mapping[str, Any], outputs: Any, routing: Routing
            ) -> Comparison:
    """Eager ``module(*args, **kwargs)`` against the ``outputs`` XLA computed on the same input and the ``routing``
    it recorded (:func:`recording_routing`, on the CPU)."""
    with torch.no_grad(), recording_routing(module) as own:
        module(*args, **kwargs)
    with torch.no_grad(), _routing_pinned(module, routing):
        pinned = module(*args, **kwargs)
    pairs = [(ours, theirs) for a, b in zip(own, routing, strict=True) for ours, theirs in zip(a, b, strict=True)]
    flips = sum(int((e.sort(dim=-1).values != x.sort(dim=-1).values).any(dim=-1).sum())
                for (_, e), (_, x) in pairs)
    return Comparison(max_abs_diff(outputs, pinned),
                      max_abs_diff([x for (_, _), (x, _) in pairs], [e for (e, _), _ in pairs]), flips)
