"""GPU kernels in Triton: routing metadata, fused grouped GEMMs, the combine -- the ``"triton"`` backend.

Optional: ``pip install 'nxd-moe[gpu]'``. Nothing else in nxd_moe imports this package, so nxd_moe works without
Triton; ``ExpertMLPsV2(..., backend="triton")`` imports it on first use.
"""

import contextlib
import os
import threading

try:
    import triton  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only where triton is absent
    raise ImportError("the triton backend needs Triton: pip install 'nxd-moe[gpu]' (or pip install triton)") from error


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: CPU tensors, programs one at a time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class _GraphCall(threading.local):
    active = False
    memory_kept = False


_graph_call = _GraphCall()


@contextlib.contextmanager
def compiled_graph_call():
    """Marks the launches inside as one op of a ``torch.compile``'d graph
    (:mod:`~nxd_moe.triton_kernels.compiled`). There, memory belongs to the graph: under ``mode="reduce-overhead"``
    Inductor's CUDA-graph trees run and capture the op with every allocation going to their private pool, whose
    allocator state they later roll back to checkpoints that know nothing of tensors we would keep. So inside, no
    device tensor may outlive the call: scratch is allocated per call, and no weight copy is built and cached."""
    outer = _graph_call.active
    _graph_call.active = True
    try:
        yield
    finally:
        _graph_call.active = outer


@contextlib.contextmanager
def plain_compiled_graphs():
    """Declares that the compiled graphs run inside are plain Inductor graphs -- no CUDA-graph trees of Inductor's
    own, whose pool rolls back what an op keeps -- so their ops may keep memory as eager launches do: the one-launch
    decode reuses its plan's scratch and counters instead of allocating and zeroing them per call (five small kernels
    per layer in a captured step). For callers that compile without ``mode="reduce-overhead"`` and capture the
    compiled step themselves (the application's token-generation step)."""
    outer = _graph_call.memory_kept
    _graph_call.memory_kept = True
    try:
        yield
    finally:
        _graph_call.memory_kept = outer


def in_compiled_graph_call() -> bool:
    """Whether the current launch runs inside :func:`compiled_graph_call` where memory belongs to the graph (not
    declared a :func:`plain_compiled_graphs` call)."""
    return _graph_call.active and not _graph_call.memory_kept
