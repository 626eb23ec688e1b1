"""One SPMD program, rank by rank: each rank's forward traced lazily on its own XLA device, one executable compiled
for the world, and run on every device at once.

- :func:`trace_rank` traces one rank's forward lazily (an execution would be a host sync inside the layer: it is
  refused), and names each HLO parameter: an input, a weight of the rank's shard, the rank, or a value every rank
  shares;
- :func:`run_replicated` runs ONE compiled executable on every device, each with its rank's arguments, from one
  thread per device (XLA's CPU collectives meet in a rendezvous keyed by the executable, so the ranks must run the
  same one: ``xmp.spawn`` compiles one per device, and its all-reduce never meets).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from nxd_moe.tracing.hlo import ProgramParameter, hlo_parameters, module_tensor_names
from nxd_moe.tracing.spmd_layout import SPMDLayout
from nxd_moe.tracing.tensors import leaf_tensors
from nxd_moe.tracing.xla import counter_value, device_transfers, import_torch_xla, materialize, replicated


@contextlib.contextmanager
def session(layout: SPMDLayout, devices: Sequence[str]) -> Iterator[None]:
    """What tracing and compiling a layout's program needs: its SPMD state in :mod:`nxd_moe.parallel_state` (the
    groups the forward reads) and ``torch_xla`` replicating over its ``devices``."""
    with layout.initialized(), replicated(devices):
        yield


def to_devices(ranks: Sequence[nn.Module], devices: Sequence[str]) -> list[nn.Module]:
    """Rank ``r``'s layer moved to ``devices[r]`` (in place) and its weights materialized there."""
    for module, device in zip(ranks, devices, strict=True):
        module.to(torch.device(device))
        materialize(list(module.state_dict().values()), device)
    return list(ranks)


@dataclass
class RankProgram:
    """One rank's traced forward, not yet run: its HLO, graph hash, the device tensors it takes in HLO parameter
    order (``arguments``), what each is (``parameters``), its lazy ``outputs``, and what happened while tracing
    (device-to-host transfers, and a host sync's error: the layer is then not one graph)."""

    hlo_text: str
    graph_hash: bytes
    arguments: list[torch.Tensor]
    parameters: list[ProgramParameter]
    outputs: list[torch.Tensor]
    transfers_during_trace: int
    host_sync: str | None = None

    @property
    def program_text(self) -> str:
        """The HLO without its module name (a counter that differs between traces of the same program)."""
        return self.hlo_text.split("\n", 1)[1] if self.hlo_text.startswith("HloModule") else self.hlo_text

    def hlo_proto(self) -> bytes:
        return import_torch_xla()._XLAC._get_xla_tensors_hlo_proto(self.outputs)


def trace_rank(module: nn.Module, inputs: Sequence[torch.Tensor | None]) -> RankProgram:
    """Trace ``module(*inputs)`` (module and inputs on the rank's XLA device) without running it. Executions are
    refused while tracing: a host read of a computed value inside the layer ends the trace with ``host_sync``
    set (running it on one device would wait forever for the other ranks' collectives)."""
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    transfers = device_transfers(met)
    host_sync = None
    device, default = str(inputs[0].device), torch_xla._XLAC._xla_get_default_device()
    # Collectives chain through the default device's token: start a fresh chain on the rank's own device, so the
    # program holds this forward only (never an earlier trace that was run without a sync).
    before = module_tensor_names(module)  # a buffer the forward updates in place is named by its old value
    torch_xla._XLAC._xla_set_default_device(device)
    torch_xla._XLAC._set_all_reduce_token(device, None)
    torch_xla._XLAC._set_allow_execution(False)
    try:
        with torch.no_grad():
            outputs = leaf_tensors(module(*inputs))
    except RuntimeError as e:
        if "Unexpected execution" not in str(e):
            raise
        host_sync, outputs = str(e).splitlines()[0], []
    finally:
        torch_xla._XLAC._set_allow_execution(True)
        torch_xla._XLAC._set_all_reduce_token(device, None)
        torch_xla._XLAC._xla_set_default_device(default)
    transfers = device_transfers(met) - transfers
    if host_sync is not None:
        return RankProgram("", b"", [], [], [], transfers, host_sync)
    parameters, values = hlo_parameters(module, inputs, outputs, before)
    _restore_updated_buffers(module, before, parameters, values)
    return RankProgram(torch_xla._XLAC._get_xla_tensors_hlo(outputs), torch_xla._XLAC._get_graph_hash(outputs),
                       values, parameters, outputs, transfers)


def _restore_updated_buffers(module: nn.Module, before: dict[int, tuple[str, str]],
                             parameters: Sequence[ProgramParameter], values: Sequence[torch.Tensor]) -> None:
    """Give every buffer the traced forward updated in place (an application's KV cache) its value from before
    the trace back. The updated value is an unexecuted graph holding the program's collectives: a later sync on
    this one device would run it alone and wait forever for the other ranks."""
    now = {path: tensor_id for tensor_id, (_, path) in module_tensor_names(module).items()}
    old_values = {p.name: v for p, v in zip(parameters, values)}
    for tensor_id, (_, path) in before.items():
        if now.get(path, tensor_id) == tensor_id:
            continue
        if path not in old_values:
            raise RuntimeError(f"{path}: the forward overwrote this buffer without reading it; the trace cannot "
                               "give it its old value back")
        owner_path, _, name = path.rpartition(".")
        # A new tensor in the module, not new data in the old one: the program's outputs may be that tensor.
        module.get_submodule(owner_path).register_buffer(
            name, old_values[path], persistent=name not in module.get_submodule(owner_path)._non_persistent_buffers_set)


def compile_program(program: RankProgram) -> int:
    """Compile ``program`` (cached by its graph hash; the replication set by :func:`replicated` makes it one
    replica of the world) and return the number of new compilations (0 when the hash was compiled before)."""
    torch_xla = import_torch_xla()
    met = torch_xla.debug.metrics
    before = counter_value(met, "UncachedCompile")
    try:
        torch_xla._XLAC._xla_warm_up_cache(program.outputs, [])
    except (RuntimeError, ValueError) as e:  # XLA's verifier reports through either, by version
        if "replica groups should contain" not in str(e):
            raise
        # torch_xla compiles every program for all of the runtime's devices (its replica count), whatever
        # replicated() names: a collective's groups must then cover them all, which a smaller world's cannot.
        import torch_xla.core.xla_model as xm

        raise RuntimeError(
            f"the SPMD program's collectives span fewer ranks than the XLA runtime's "
            f"{len(xm.get_xla_supported_devices())} devices, and torch_xla compiles every program for all of them: "
            "trace a world of that size, or start the process with CPU_NUM_DEVICES (PJRT_DEVICE=CPU) equal to the "
            f"program's world size ({e})") from e
    return counter_value(met, "UncachedCompile") - before


def run_replicated(graph_hash: bytes, arguments: Sequence[Sequence[torch.Tensor]], devices: Sequence[str]
                   ) -> list[list[torch.Tensor]]:
    """Run the compiled program ``graph_hash`` on every device at once, device ``r`` with ``arguments[r]`` (its
    device tensors in HLO parameter order); returns each rank's outputs on the CPU. One thread per device, released
    together: XLA's CPU collectives wait for every rank of the same executable."""
    torch_xla = import_torch_xla()
    results: list[Any] = [None] * len(devices)
    barrier = threading.Barrier(len(devices))

    def run(rank: int) -> None:
        try:
            torch_xla._XLAC._xla_set_default_device(devices[rank])
            materialize(arguments[rank], devices[rank])
            barrier.wait()
            results[rank] = [t.cpu() for t in torch_xla._XLAC._run_cached_graph(graph_hash, list(arguments[rank]))]
        except BaseException as e:  # reported by the caller's thread
            barrier.abort()
            results[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(devices))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank, result in enumerate(results):
        if isinstance(result, BaseException) and not isinstance(result, threading.BrokenBarrierError):
            raise RuntimeError(f"rank {rank} failed running the SPMD program: {result}") from result
    return results
