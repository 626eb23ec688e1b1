"""GPU kernels in Triton: routing metadata, fused grouped GEMMs, the combine -- the ``"triton"`` backend.

Optional: ``pip install 'nxd-moe[gpu]'``. Nothing else in nxd_moe imports this package, so nxd_moe works without
Triton; ``ExpertMLPsV2(..., backend="triton")`` imports it on first use.
"""

import os

try:
    import triton  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only where triton is absent
    raise ImportError("the triton backend needs Triton: pip install 'nxd-moe[gpu]' (or pip install triton)") from error


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: CPU tensors, programs one at a time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
