"""What the kernels ask of a CUDA device, read once per device: its multiprocessor count and compute capability.

CUDA devices only; each caller says what a CPU run (Triton's interpreter) uses instead, because the answers differ by
purpose: a launch-config rule sizes for an H100 (132 multiprocessors), the persistent decode runs one program.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["capability", "multiprocessors"]


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device | int) -> int:
    """The streaming multiprocessors of CUDA ``device`` (a device or its index)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device: torch.device | int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of CUDA ``device``: (9, 0) is Hopper."""
    return torch.cuda.get_device_capability(device)
