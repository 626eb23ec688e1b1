"""GPU kernels in CUDA C++, built with the machine's ``nvcc`` on first use and loaded with ``ctypes``.

Today: the warp-specialised Hopper prefill GEMMs (:mod:`~nxd_moe.cuda_kernels.ws_gemm`), an opt-in of the
triton backend (``TritonBackend(prefill_kernel="cuda_ws")``). Importing this package runs nothing: the build
(:mod:`~nxd_moe.cuda_kernels.build`) happens when a kernel is first asked for, and where ``nvcc`` is missing or the
build fails the callers keep the Triton kernels after a one-line notice.
"""

from nxd_moe.cuda_kernels import build


def available() -> bool:
    """Whether the kernels' library is built and loaded (builds it on the first call)."""
    return build.load() is not None
