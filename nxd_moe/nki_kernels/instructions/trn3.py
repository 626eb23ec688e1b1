"""NeuronCore-v4 (Trn3) instructions. The simulated target is Trn2 (``nisa.get_nc_version() == nc_version.gen3``),
so each raises :class:`Trn3OnlyError` naming itself -- a kernel that needs one fails clearly instead of running
something the hardware it targets would not."""

from __future__ import annotations

from nxd_moe.nki_kernels.hardware import Trn3OnlyError
from nxd_moe.nki_kernels.machine import instruction


def _trn3_only(name: str, what: str):
    def unavailable(*args, **kwargs):
        raise Trn3OnlyError(f"nisa.{name} ({what}) is only available on NeuronCore-v4 (Trn3); this simulator models "
                            "Trn2 (nisa.get_nc_version() == nc_version.gen3)")

    unavailable.__name__ = unavailable.__qualname__ = name
    unavailable.__doc__ = f"{what}: a NeuronCore-v4 (Trn3) instruction; raises :class:`Trn3OnlyError` on Trn2."
    return instruction(unavailable)


activate2 = _trn3_only("activate2", "activation with a tensor-scalar stage and a configurable fused reduction")
exponential = _trn3_only("exponential", "exp(src - max_value) with a running sum")
rand2 = _trn3_only("rand2", "uniform random numbers in [min, max]")
quantize_mx = _trn3_only("quantize_mx", "MX quantization")
nc_matmul_mx = _trn3_only("nc_matmul_mx", "MX matmul with integrated dequantization")
