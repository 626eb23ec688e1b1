"""``flashinfer_carry.sh pack``'s staging step: ``WHEELS`` -> ``STAGE/site`` + ``STAGE/cuda-extra/include``.

    python3 benchmarks/flashinfer_stage.py WHEELS STAGE

Every wheel of ``WHEELS`` but FlashInfer's is unpacked whole into ``site``; of FlashInfer's, the Python package and
only the parts of ``flashinfer/data/`` that its SM90 fused-MoE module compiles (:data:`KEEP_DATA`); of the header
wheels under ``WHEELS/headers`` (nvidia-cublas, nvidia-cuda-nvrtc: 600 MB of libraries), the ``.h`` files alone.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

# under flashinfer/data/: what the fused_moe_90 build includes (from its ninja dependency files), and the DeepGEMM
# headers (under csrc/nv_internal) that its FP8 block-scale path compiles with nvcc at run time
KEEP_DATA = ("csrc/nv_internal/", "csrc/fused_moe/cutlass_backend/", "cutlass/include/", "cutlass/tools/util/include/",
             "cccl/", "spdlog/include/", "include/")


def kept(name: str) -> bool:
    """Whether a member of FlashInfer's wheel is staged."""
    if not name.startswith("flashinfer/"):
        return False
    data = name.removeprefix("flashinfer/data/")
    # csrc's own headers (tvm_ffi_utils.h ...), which the binding includes by relative path ("../../tvm_ffi_utils.h")
    top_header = data.startswith("csrc/") and data.count("/") == 1 and data.endswith((".h", ".cuh"))
    return data == name or data.startswith(KEEP_DATA) or top_header


def stage(wheels: Path, out: Path) -> None:
    site, headers = out / "site", out / "cuda-extra" / "include"
    site.mkdir(parents=True, exist_ok=True)
    headers.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                if wheel.name.startswith("flashinfer_python-") and not kept(info.filename):
                    continue
                path = Path(archive.extract(info, site))
                if (info.external_attr >> 16) & 0o111:  # zipfile drops the mode: ninja's binary must stay runnable
                    path.chmod(0o755)
    for wheel in sorted((wheels / "headers").glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if "/include/" in name and name.endswith(".h"):
                    (headers / Path(name).name).write_bytes(archive.read(name))


if __name__ == "__main__":
    stage(Path(sys.argv[1]), Path(sys.argv[2]))
