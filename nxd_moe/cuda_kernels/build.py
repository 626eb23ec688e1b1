"""The CUDA C++ kernels' build: ``nvcc`` on first use, a cache keyed by source and compiler, a ``ctypes`` loader.

Nothing happens at import: :func:`load` runs ``nvcc`` the first time a kernel is asked for (a few seconds), into
``$NXD_MOE_CUDA_CACHE`` (default: ``nxd_moe/cuda_kernels/_build/``, gitignored) under a name that hashes the
source, the flags and ``nvcc --version``, so an edited source or another CUDA rebuilds and an unchanged one is
loaded as built. The library is a plain shared object with ``extern "C"`` launch functions taking raw device
pointers and a ``cudaStream_t``: no torch headers are needed, so it builds with any torch build (the CPU wheel
included) next to a CUDA toolkit.

Where ``nvcc`` is missing or the build fails, :func:`load` returns None after one notice per process (a
``RuntimeWarning`` of one line) and callers run the Triton kernels instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("ws_grouped_gemm.cu")
# sm_90a, not sm_90: wgmma and setmaxnreg exist only in the architecture-specific target.
NVCC_FLAGS = ("-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC")
CACHE_ENV = "NXD_MOE_CUDA_CACHE"
BUILD_TIMEOUT_S = 300
# Where nvcc is looked for when it is not on PATH and CUDA_HOME is unset or has none.
DEFAULT_CUDA_HOME = "/usr/local/cuda"

_lock = threading.Lock()
_state: dict = {}  # "library": the loaded CDLL or None once tried; "noticed": the notice was given


def find_nvcc() -> str | None:
    """``nvcc`` on ``PATH``, else under ``$CUDA_HOME`` / :data:`DEFAULT_CUDA_HOME`; None if none has it."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), DEFAULT_CUDA_HOME):
        if root and os.access(Path(root, "bin", "nvcc"), os.X_OK):
            return str(Path(root, "bin", "nvcc"))
    return None


def cache_key(source: bytes, nvcc_version: str, flags: tuple[str, ...] = NVCC_FLAGS) -> str:
    """16 hex digits of SHA-256 over the source, the compiler's ``--version`` text and the flags."""
    digest = hashlib.sha256()
    for part in (source, nvcc_version.encode(), "\0".join(flags).encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(__file__).with_name("_build"))


def notice(reason: str) -> None:
    """Once per process: why the CUDA kernels are not used (the Triton kernels run instead)."""
    if not _state.get("noticed"):
        _state["noticed"] = True
        warnings.warn(f"nxd_moe.cuda_kernels: {reason}; the prefill runs the Triton kernels", RuntimeWarning,
                      stacklevel=3)


def _build(nvcc: str) -> Path:
    """Compiles :data:`SOURCE` unless its cached library exists; returns the library's path. Raises
    ``RuntimeError`` with the compiler's last output line on failure."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    target = cache_dir() / f"{SOURCE.stem}_{cache_key(SOURCE.read_bytes(), version)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: another process loading the same key never sees half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([nvcc, *NVCC_FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines()
            raise RuntimeError(f"nvcc failed ({lines[-1] if lines else f'exit {result.returncode}'})")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("nxd_ws_gate_up", "nxd_ws_down"):
        function = getattr(library, name)
        function.argtypes = [pointer] * 6 + [i64, i32, i32, i32, i32, i32, pointer]
        function.restype = ctypes.c_int
    library.nxd_ws_error_string.argtypes = [ctypes.c_int]
    library.nxd_ws_error_string.restype = ctypes.c_char_p
    return library


def load() -> ctypes.CDLL | None:
    """The kernels' library (built on the first call), or None after :func:`notice` where ``nvcc`` is missing or
    the build or load fails. Later calls return the first call's answer without retrying."""
    with _lock:
        if "library" not in _state:
            _state["library"] = None
            nvcc = find_nvcc()
            if nvcc is None:
                notice(f"nvcc not found (PATH, CUDA_HOME, {DEFAULT_CUDA_HOME})")
            else:
                try:
                    _state["library"] = _declare(ctypes.CDLL(str(_build(nvcc))))
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    notice(f"building {SOURCE.name} failed: {error}")
        return _state["library"]
