"""NxD's utilities that MoE code (and NxD's MoE unit tests) call beside the layers, served for real:
``utils.model_utils`` (``LogicalNCConfig``, ``get_platform_lnc``, ``move_model_to_device``), ``utils.logger``
(``get_logger``) and ``parallel_layers.random`` (``model_parallel_xla_manual_seed``); and the ``xla`` process-group
backend where torch_xla is not installed (:func:`serve_xla_backend`)."""

from __future__ import annotations

import datetime
import enum
import importlib.util
import logging
import os

import torch
import torch.distributed as dist

from nxd_moe.checks import check_int
from nxd_moe.moe_configs import default_logical_nc_config

__all__ = ["LogicalNCConfig", "get_platform_lnc", "move_model_to_device", "get_logger",
           "model_parallel_xla_manual_seed", "serve_xla_backend"]


class LogicalNCConfig(enum.IntEnum):
    """NxD's logical NeuronCore configuration: how many physical cores one logical core spans."""

    LNC_1 = 1
    LNC_2 = 2


def get_platform_lnc() -> LogicalNCConfig:
    """``NEURON_LOGICAL_NC_CONFIG`` if set, else the platform's default -- LNC 1, since this is never a Trn2 or
    Trn3 host (where NxD's default is 2)."""
    return LogicalNCConfig(default_logical_nc_config())


def move_model_to_device(model: torch.nn.Module, device) -> None:
    """``model.to(device)`` in place, as NxD's. NxD wraps the move to keep its parallel layers' parameter attributes
    and tied weights; ``Module.to`` keeps both for nxd_moe's modules (parameters are updated in place)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"move_model_to_device: model must be a torch.nn.Module, got {type(model).__name__}")
    model.to(device)


# NXD_LOG_LEVEL's values, as NxD reads them.
_LOG_LEVELS = {"off": logging.CRITICAL + 1, "fatal": logging.CRITICAL, "error": logging.ERROR,
               "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}


class _RankZero(logging.Filter):
    """Passes records on global rank 0 only (every record without ``torch.distributed``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def get_logger(name: str = "neuronx_distributed", rank0_only: bool = True) -> logging.Logger:
    """A standard :class:`logging.Logger` at ``NXD_LOG_LEVEL`` (``info`` by default; ``off``, ``fatal``,
    ``error``, ``warning``, ``debug``, ``trace``); ``rank0_only``: only global rank 0 emits (NxD's loggers
    ``name[0]`` and ``name[]``)."""
    level = os.environ.get("NXD_LOG_LEVEL", "info").lower()
    if level not in _LOG_LEVELS:
        raise ValueError(f"NXD_LOG_LEVEL must be one of {list(_LOG_LEVELS)}, got {level!r}")
    logger = logging.getLogger(name + ("[0]" if rank0_only else "[]"))
    logger.setLevel(_LOG_LEVELS[level])
    if rank0_only and not any(isinstance(f, _RankZero) for f in logger.filters):
        logger.addFilter(_RankZero())
    return logger


def model_parallel_xla_manual_seed(seed: int) -> None:
    """Seed torch's default generator with ``seed``, as NxD's does for the data-parallel stream. NxD also keeps a
    second, per-tensor-parallel-rank stream that its parallel layers draw initial weights and dropout from; nxd_moe's
    layers draw from the default generator (weights come from checkpoints, and there is no dropout), so that stream
    is not kept."""
    torch.manual_seed(check_int("seed", seed, minimum=0))


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def serve_xla_backend() -> str:
    """Let NxD code create its process groups with ``backend="xla"`` on the CPU; returns what serves it.

    NxD imports torch_xla with ``neuronx_distributed``, and torch_xla registers its ``xla`` backend when its
    ``distributed.xla_backend`` is imported; NxD code (its unit tests among it) then calls
    ``init_process_group(backend="xla")`` without importing torch_xla itself. So where torch_xla is installed, this
    imports that module (``"torch_xla"``; with ``PJRT_DEVICE=CPU`` its groups reduce CPU tensors). Without torch_xla,
    ``xla`` is registered as gloo (``"gloo"``): NxD's CPU code hands the group CPU tensors, which gloo reduces.
    torch.distributed cannot unregister a backend, so the name stays for the process."""
    if importlib.util.find_spec("torch_xla") is not None:
        importlib.import_module("torch_xla.distributed.xla_backend")
        return "torch_xla"
    if "xla" not in dist.Backend.backend_list:
        dist.Backend.register_backend("xla", _gloo_group, devices=["cpu"])
    return "gloo"
