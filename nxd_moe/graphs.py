"""One CUDA graph for a whole layer step, replayed with new inputs.

Every forward of the layer -- on one device or across ranks, both dispatches, every mode -- has static shapes and
never reads device values on the host, so a CUDA graph captures all its kernels and collectives once and replays
them for any routing. :func:`capture` does the bookkeeping: warm-up calls (kernel compilation, cached device tables)
on a side stream, the capture on that same stream (what a layer keeps per stream -- the one-launch decode's
counters and scratch -- is then made by the warm-up, not allocated inside the graph's pool and zeroed only when it
replays), and static input buffers that each call copies the new inputs into. Under model
parallelism every rank of the world must capture (and later replay) the same step at the same time, as with any
collective.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

# True while steps run that a caller will replay as CUDA graphs (see :func:`replayed_steps`).
_replayed_steps = False


@contextlib.contextmanager
def replayed_steps() -> Iterator[None]:
    """Inside: the steps run are the warm-ups and the capture of CUDA graphs that will be replayed (what the
    application's runner does with every step), so launching a kernel costs nothing at replay and a rule that trades
    launches for work can choose by replay time -- the triton backend then decodes larger batches in separate
    kernels (:meth:`~nxd_moe.triton_kernels.backend.TritonBackend`'s ``one_launch``). Warm-ups and capture must run
    inside alike: the capture must launch the kernels the warm-ups compiled."""
    global _replayed_steps
    before, _replayed_steps = _replayed_steps, True
    try:
        yield
    finally:
        _replayed_steps = before


def in_replayed_steps() -> bool:
    """Whether the current step is run inside :func:`replayed_steps`."""
    return _replayed_steps


class GraphedStep:
    """A captured call. ``step(*inputs)`` copies ``inputs`` (tensors of the captured shapes and dtypes) into the
    static input buffers, replays the graph and returns the static outputs -- overwritten by the next replay, so
    copy what must outlive it."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple[torch.Tensor, ...], outputs: Any):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.inputs):
            raise ValueError(f"GraphedStep: captured with {len(self.inputs)} input tensors, got {len(inputs)}")
        for i, (static, new) in enumerate(zip(self.inputs, inputs)):
            if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                raise ValueError(f"GraphedStep: input {i} must be a {static.dtype} tensor of shape "
                                 f"{tuple(static.shape)} (the captured one), got "
                                 f"{getattr(new, 'dtype', type(new).__name__)} {tuple(getattr(new, 'shape', ()))}")
            static.copy_(new)
        self.graph.replay()
        return self.outputs


def capture(fn: Callable[..., Any], *example_inputs: torch.Tensor, warmup: int = 2, **kwargs) -> GraphedStep:
    """Capture ``fn(*inputs, **kwargs)`` (e.g. an ``MoE`` in ``eval`` mode) for CUDA tensors shaped like
    ``example_inputs``; ``kwargs`` are fixed at capture. Runs ``fn`` ``warmup`` times first (at least once: it
    compiles kernels and builds the device tables the captured graph reads)."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture needs CUDA (torch.cuda.is_available() is False)")
    if not example_inputs or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        raise ValueError("capture: example_inputs must be one or more CUDA tensors")
    if warmup < 1:
        raise ValueError(f"capture: warmup must be >= 1, got {warmup}")
    inputs = tuple(x.clone() for x in example_inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*inputs, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=side):  # the warm-up's stream: see the module doc
        outputs = fn(*inputs, **kwargs)
    return GraphedStep(graph, inputs, outputs)
