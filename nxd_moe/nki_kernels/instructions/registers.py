"""The engine-sequencer registers (:class:`~nxd_moe.nki_kernels.virtual_register.VirtualRegister`):
``register_alloc``, ``register_move``, ``register_load`` (a device value into a register: how values steer loops)
and ``register_store``. Each is a fence: nothing is reordered across it."""

from __future__ import annotations

from nxd_moe.nki_kernels.dtypes import is_integer
from nxd_moe.nki_kernels.machine import check_alive, current_core, instruction
from nxd_moe.nki_kernels.tensor import NkiTensor, scalar_value
from nxd_moe.nki_kernels.virtual_register import VirtualRegister


@instruction(fence=True)
def register_alloc(x: int | None = None) -> VirtualRegister:
    return VirtualRegister(current_core(), 0 if x is None else int(x))


@instruction(fence=True)
def register_move(dst: VirtualRegister, src) -> None:
    dst.value = src.value if isinstance(src, VirtualRegister) else int(src)


@instruction(fence=True)
def register_load(dst: VirtualRegister, src) -> None:
    """Load a one-element integer tensor (SBUF or HBM) into a register: how device values steer loops."""
    if not isinstance(dst, VirtualRegister):
        raise TypeError(f"register_load: dst must be a VirtualRegister, got {type(dst).__name__}")
    check_alive(src)
    dst.value = scalar_value(src)


@instruction(fence=True)
def register_store(dst, src) -> None:
    """Write a register's value into a one-element integer tensor."""
    if not isinstance(src, VirtualRegister):
        raise TypeError(f"register_store: src must be a VirtualRegister, got {type(src).__name__}")
    if not isinstance(dst, NkiTensor) or not is_integer(dst.dtype) or dst.size != 1:
        raise TypeError(f"register_store: dst must be a one-element integer tensor, got {dst!r}")
    check_alive(dst, write=True)
    dst.data[...] = src.value
