"""Argument types and resolvers the command line's subcommands share (``nxd-moe run``, ``trace``, ``generate``,
``compile``, ``checkpoint``): each subcommand lives with the code it drives and parses its own arguments with these,
so none of them imports the command line itself."""

from __future__ import annotations

import argparse
import os

import torch

from nxd_moe.checks import to_torch_dtype
from nxd_moe.experts.backends import get_backend

__all__ = ["AUTO_SCALE_MAX_HIDDEN", "MIN_AUTO_SCALE", "auto_scale", "positive_float", "positive_int", "resolve_device",
           "resolve_dtype", "scale_argument"]

MIN_AUTO_SCALE = 16
AUTO_SCALE_MAX_HIDDEN = 256


def auto_scale(hidden_size: int) -> int:
    """The smallest power of two >= 16 that brings H down to at most 256: with the Trainium block sizes of the
    shipped configs (every active expert owns at least one 256-512 row block) that keeps each step well under a
    second on a 2-core CPU, for 8 experts or 256."""
    scale = MIN_AUTO_SCALE
    while hidden_size / scale > AUTO_SCALE_MAX_HIDDEN:
        scale *= 2
    return scale


def scale_argument(text: str) -> int | str:
    """``--scale``: ``auto`` or a positive integer."""
    return text if text == "auto" else positive_int(text)


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse reports anything else)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (argparse reports anything else)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``--dtype``, or the device's default: bfloat16 on a GPU (what GPU inference runs), float32 on a CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return to_torch_dtype(name, "--dtype")


def resolve_device(name: str, backend: str) -> torch.device:
    """``--device`` checked against this machine and ``--backend``; ``ValueError`` says what is missing."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda (cuda:N), got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (cuda:N), got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__}, built "
                             f"{built})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
        if device.index is not None:  # kernels launched outside torch (Triton) go to the current device
            torch.cuda.set_device(device.index)
    try:
        get_backend(backend)
    except ImportError as e:
        raise ValueError(f"--backend {backend} is not available here: {e}") from None
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--backend triton runs Triton kernels: use --device cuda (or set TRITON_INTERPRET=1 to "
                         "run them on the CPU in Triton's interpreter, slowly)")
    return device
