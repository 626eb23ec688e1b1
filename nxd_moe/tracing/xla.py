"""``torch_xla``, imported on first use, and what the checks read from it: its metrics (compilations, executions,
device-to-host transfers, CPU fallbacks) and its devices (one per rank of an SPMD program).

``torch_xla`` is optional (``pip install -e '.[xla]'``, which moves the environment to torch 2.9): every function
here imports it, none at import time. Without ``PJRT_DEVICE`` set, the XLA CPU client is used. The CPU client has
``CPU_NUM_DEVICES`` devices, read when the XLA runtime starts: :func:`xla_devices` sets it if the runtime has not
started.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Iterator, Sequence

import torch
import torch.nn as nn

from nxd_moe.extras import MissingExtraError, require

XLA_INSTALL_HINT = "torch_xla 2.9 needs torch 2.9: install it in its own environment; PJRT_DEVICE=CPU on a CPU host"


def import_torch_xla():
    """``torch_xla`` (CPU client unless ``PJRT_DEVICE`` says otherwise), or an ImportError saying how to get it."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        require("torch_xla.debug.metrics", "tracing under XLA")
    except MissingExtraError as err:
        raise MissingExtraError(f"{err} ({XLA_INSTALL_HINT})") from None
    import torch_xla

    return torch_xla


# ----------------------------------------------------------------------------------------------------------
# metrics (``torch_xla.debug.metrics``: process-wide counters, read before and after what they measure)


def counter_value(met, name: str) -> int:
    """The metrics counter ``name`` (0 before its first increment)."""
    return met.counter_value(name) or 0


def fallback_counts(met) -> Counter[str]:
    """Executions of each operator ``torch_xla`` ran on the CPU so far (its ``aten::`` counters)."""
    return Counter({name: counter_value(met, name) for name in met.counter_names() if name.startswith("aten::")})


def new_fallbacks(met, before: Counter[str]) -> list[str]:
    """The operators run on the CPU since ``before`` (:func:`fallback_counts` then)."""
    return sorted((fallback_counts(met) - before).keys())


def device_transfers(met) -> int:
    """Device-to-host transfers so far."""
    data = met.metric_data("TransferFromDeviceTime")
    return data[0] if data else 0


# ----------------------------------------------------------------------------------------------------------
# devices


def xla_devices(world_size: int) -> list[str]:
    """The first ``world_size`` XLA devices. On the CPU client (``PJRT_DEVICE=CPU``) their number is
    ``CPU_NUM_DEVICES``, read once when the runtime starts: set here if it has not started, else a clear
    error if it has too few."""
    torch_xla = import_torch_xla()
    if not torch_xla._XLAC._xla_runtime_is_initialized() and os.environ.get("PJRT_DEVICE") == "CPU":
        current = int(os.environ.get("CPU_NUM_DEVICES", "1"))
        os.environ["CPU_NUM_DEVICES"] = str(max(current, world_size))
    import torch_xla.core.xla_model as xm

    devices = xm.get_xla_supported_devices()
    if len(devices) < world_size:
        raise RuntimeError(f"the SPMD program has {world_size} ranks but torch_xla has {len(devices)} device(s); "
                           f"start the process with CPU_NUM_DEVICES={world_size} (PJRT_DEVICE=CPU)")
    return devices[:world_size]


@contextlib.contextmanager
def replicated(devices: Sequence[str]) -> Iterator[None]:
    """Inside the block, ``torch_xla`` compiles programs as one replica of ``devices`` (replica ``r`` on
    ``devices[r]``), so their collectives span them. Set directly: ``xm.set_replication`` insists on every device
    of the runtime, and the runtime may have more than the program's ranks."""
    torch_xla = import_torch_xla()
    import torch_xla.core.xla_model as xm

    torch_xla._XLAC._xla_set_replication_devices(xm.xla_real_devices(list(devices)))
    try:
        yield
    finally:
        torch_xla._XLAC._xla_set_replication_devices([])


def device_of(module: nn.Module) -> str:
    """The device ``module``'s state is on (its first parameter or buffer's)."""
    return str(next(iter(module.state_dict().values())).device)


def materialize(tensors: Sequence[torch.Tensor], device: str) -> None:
    """Run the pending computations of ``tensors`` on ``device`` and wait: they become device data, which a program
    traced next reads as inputs."""
    torch_xla = import_torch_xla()
    torch_xla._XLAC._xla_sync_multi(list(tensors), [device], True)
