"""NKI kernels you can unit-test on a CPU: a NumPy tile machine named and shaped after NKI, the blockwise-matmul
and decode MoE kernels written on it, and a Trn2 cost model over what it counts.

- :mod:`~nxd_moe.nki_kernels.language` (``nl``) and :mod:`~nxd_moe.nki_kernels.isa` (``nisa``): the NKI subset;
- :func:`simulate`: run a kernel on one core or the two cores of an LNC2 logical core;
- :mod:`~nxd_moe.nki_kernels.kernels`: the MoE kernels;
- :mod:`~nxd_moe.nki_kernels.cost_model`: estimated Trn2 time from the accounting (a model, not a measurement);
- :class:`~nxd_moe.nki_kernels.backend.NkiSimBackend`: ``ExpertMLPsV2(..., backend="nki_sim")``.
"""

from nxd_moe.nki_kernels.accounting import Accounting, DmaTraffic, EngineOp
from nxd_moe.nki_kernels.hardware import HardwareLimitError, OutOfBoundsError
from nxd_moe.nki_kernels.lnc import CoreDivergenceError, KernelRun, simulate
from nxd_moe.nki_kernels.tensor import NkiTensor

__all__ = [
    "Accounting",
    "CoreDivergenceError",
    "DmaTraffic",
    "EngineOp",
    "HardwareLimitError",
    "KernelRun",
    "NkiTensor",
    "OutOfBoundsError",
    "simulate",
]
