"""The two cores of an LNC2 logical NeuronCore: ``core_barrier`` (both cores meet) and ``sendrecv`` (each sends a
tile to the other's SBUF). Both are fences; on one core the barrier is a no-op."""

from __future__ import annotations

from nxd_moe.nki_kernels.accounting import DmaTraffic
from nxd_moe.nki_kernels.hardware import Buffer, HardwareLimitError
from nxd_moe.nki_kernels.instruction_support import check_same_shape, mark_unknown, tile_operand
from nxd_moe.nki_kernels.machine import current_core, instruction
from nxd_moe.nki_kernels.tensor import NkiTensor


@instruction(fence=True)
def core_barrier(data, cores=(0, 1), engine=None, name=None) -> None:
    """Wait until both cores of the logical core reach this point (both must have finished writing ``data``, a
    shared HBM tensor). A no-op when the kernel runs on one core."""
    if tuple(cores) != (0, 1):
        raise HardwareLimitError(f"core_barrier: only cores=(0, 1) is supported, got {cores}")
    # NKI documents data as "shared HBM"; nki-library also passes SBUF tiles (its hybrid kernel's block counter),
    # which the compiler accepts: the barrier orders the cores whatever the tensor.
    if not isinstance(data, NkiTensor):
        raise TypeError(f"core_barrier: data must be a tensor, got {data!r}")
    core = current_core()
    if core.num_programs == 1:
        return
    core.accounting.barriers += 1
    core.accounting.record("gpsimd", "core_barrier", 0, False)
    core.launch.barrier.wait(core.program_id)


@instruction(fence=True)
def sendrecv(src, dst, send_to_rank: int, recv_from_rank: int, pipe_id: int, dma_engine=None, name=None) -> None:
    """Send ``src`` (SBUF) to the peer core's ``dst`` while receiving the peer's ``src`` into this core's ``dst``."""
    name = "sendrecv"
    src, dst = tile_operand(src, "src", name, (Buffer.SBUF,)), tile_operand(dst, "dst", name, (Buffer.SBUF,))
    check_same_shape(name, src, "src", dst, "dst")
    if src.dtype != dst.dtype:
        raise TypeError(f"{name}: src and dst dtypes differ ({src.dtype}, {dst.dtype})")
    core = current_core()
    if core.num_programs != 2:
        raise HardwareLimitError(f"{name} exchanges tiles between the two cores of an LNC2 launch; this launch has "
                                 f"{core.num_programs} core")
    for rank, role in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        if rank not in (0, 1) or rank == core.program_id:
            raise HardwareLimitError(f"{name}: {role} must be the peer core ({1 - core.program_id}), got {rank}")
    if dma_engine == 2 and src.free_size * src.dtype.itemsize > 1024 // (4 // min(4, src.dtype.itemsize)):
        raise HardwareLimitError(f"{name}: dma_engine.gpsimd_dma moves at most 1024 / 512 / 256 bytes per partition "
                                 f"for 4- / 2- / 1-byte types, got {src.free_size} x {src.dtype}")
    payload = src.data.copy() if src.alloc.has_data and src.alloc.known else None
    received = core.launch.exchange(core.program_id, payload, pipe_id, send_to_rank, recv_from_rank)
    if received is None:
        mark_unknown(dst, [f"{src.name} (peer)"])
    elif dst.alloc.has_data:
        dst.data[...] = received
    core.accounting.record_dma(src.name, "sbuf->sbuf", DmaTraffic(
        bytes=src.data.size * src.dtype.itemsize, transfers=1, rows=src.partitions))
