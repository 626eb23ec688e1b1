"""``nisa``: the ``nki.isa`` namespace -- the instructions, with NKI's names, arguments and limits, and their
constants.

Each instruction checks what the hardware requires (buffers, partition sizes <= 128, matmul free sizes, dtypes,
PSUM banks, DMA bounds) and raises :class:`~nxd_moe.nki_kernels.hardware.HardwareLimitError` naming the limit;
then it computes with NumPy -- engines in fp32, the result rounded to the destination's dtype -- and records
itself in the core's :class:`~nxd_moe.nki_kernels.accounting.Accounting`. One call is one instruction, vectorised
over its whole tile.

The instructions live in :mod:`nxd_moe.nki_kernels.instructions`, one module per family; this module gathers them
(and the constants of :mod:`~nxd_moe.nki_kernels.isa_constants`) into the one namespace, and defines what is NKI's
alone: the engine aliases, the NeuronCore version, ``NkiValidationError`` and ``NkiInstruction``. Signatures, keyword
names and defaults follow the NKI API reference, so :mod:`nxd_moe.nki_kernels.compat` can serve this module as
``nki.isa``.
"""

from __future__ import annotations

from nxd_moe.nki_kernels.hardware import BN_STATS_FMAX, HardwareLimitError, Trn3OnlyError  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.arithmetic import (  # noqa: F401 -- re-exports
    activation,
    activation_reduce,
    reciprocal,
    scalar_tensor_tensor,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_reduce,
    tensor_tensor,
)
from nxd_moe.nki_kernels.instructions.copy import (  # noqa: F401 -- re-exports
    dequantize,
    iota,
    memset,
    tensor_copy,
    tensor_copy_predicated,
)
from nxd_moe.nki_kernels.instructions.cores import core_barrier, sendrecv  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.dma import dma_compute, dma_copy, dma_transpose  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.gather import (  # noqa: F401 -- re-exports
    local_gather,
    nc_n_gather,
    nc_stream_shuffle,
    nonzero_with_count,
)
from nxd_moe.nki_kernels.instructions.matmul import MATMUL_DTYPES, nc_matmul, nc_transpose  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.prng import (  # noqa: F401 -- re-exports
    dropout,
    rand_get_state,
    rand_set_state,
    rng,
    set_rng_seed,
)
from nxd_moe.nki_kernels.instructions.registers import (  # noqa: F401 -- re-exports
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from nxd_moe.nki_kernels.instructions.scan import (  # noqa: F401 -- re-exports
    tensor_partition_reduce,
    tensor_scalar_cumulative,
    tensor_tensor_scan,
)
from nxd_moe.nki_kernels.instructions.select import (  # noqa: F401 -- re-exports
    affine_select,
    range_select,
    select_reduce,
    sequence_bounds,
)
from nxd_moe.nki_kernels.instructions.stats import bn_aggr, bn_stats  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.top8 import max8, nc_find_index8, nc_match_replace8, topk  # noqa: F401 -- re-exports
from nxd_moe.nki_kernels.instructions.trn3 import (  # noqa: F401 -- re-exports
    activate2,
    exponential,
    nc_matmul_mx,
    quantize_mx,
    rand2,
)
from nxd_moe.nki_kernels.isa_constants import (  # noqa: F401 -- re-exports
    dge_mode,
    dma_engine,
    engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)
from nxd_moe.nki_kernels.virtual_register import VirtualRegister  # noqa: F401 -- re-export

tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor, engine.vector, engine.scalar, engine.gpsimd, engine.unknown)


def get_nc_version() -> nc_version:
    """The simulated NeuronCore generation: Trn2's NeuronCore-v3."""
    return nc_version.gen3


def get_nc_sub_version() -> int:
    return 0


NkiValidationError = HardwareLimitError  # NKI's name for a violated hardware constraint


class NkiInstruction:
    """NKI's handle to a traced instruction, for ``.depends_on(*producers)`` (run after them). The simulator
    executes instructions in program order, which satisfies any such dependency, so this only records them."""

    def __init__(self, handle=None):
        self.handle = handle
        self.dependencies: list = []

    def depends_on(self, *producers) -> "NkiInstruction":
        self.dependencies.extend(producers)
        return self
