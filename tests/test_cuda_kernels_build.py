"""The CUDA C++ kernels' build and loader (``nxd_moe/cuda_kernels/build.py``) without a GPU: cache key, the
fallback notice where nvcc is missing or fails (a fake ``nvcc`` script stands in), the cache, and the opt-in's
argument checks. The kernels themselves: tests/gpu/test_cuda_ws_gemm.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import warnings

import pytest
import torch

from nxd_moe.cuda_kernels import build, ws_gemm


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A loader that has tried nothing yet, caching under ``tmp_path``, with no nvcc anywhere."""
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(build, "DEFAULT_CUDA_HOME", str(tmp_path / "no_cuda"))
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)
    return tmp_path


def _fake_nvcc(tmp_path, compile_status: int) -> str:
    """An ``nvcc`` that prints a version, logs each compile to ``calls`` and writes ``-o``'s file (not a library)
    or fails with an error line."""
    script = tmp_path / "nvcc"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 99.9"; exit 0; fi
echo compile >> {tmp_path}/calls
if [ {compile_status} -ne 0 ]; then echo "ws_grouped_gemm.cu(1): error: broken on purpose" >&2; exit 2; fi
while [ "$1" != "-o" ]; do shift; done
echo "not a library" > "$2"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_cache_key_follows_source_compiler_and_flags():
    key = build.cache_key(b"source", "release 13.0")
    assert len(key) == 16 and int(key, 16) >= 0
    assert key == build.cache_key(b"source", "release 13.0")
    assert len({key, build.cache_key(b"source!", "release 13.0"), build.cache_key(b"source", "release 13.1"),
                build.cache_key(b"source", "release 13.0", ("-O2",))}) == 4
    # The parts are length-prefixed: moving bytes from the source into the version changes the key.
    assert build.cache_key(b"ab", "c") != build.cache_key(b"a", "bc")


def test_missing_nvcc_gives_one_notice_and_no_library(fresh):
    assert build.find_nvcc() is None
    with pytest.warns(RuntimeWarning, match=r"^nxd_moe.cuda_kernels: nvcc not found .*runs the Triton kernels$"):
        assert build.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call neither warns nor retries
        assert build.load() is None


def test_nvcc_under_cuda_home_is_found(fresh, monkeypatch):
    (fresh / "cuda" / "bin").mkdir(parents=True)
    nvcc = _fake_nvcc(fresh, 0)
    os.rename(nvcc, fresh / "cuda" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(fresh / "cuda"))
    assert build.find_nvcc() == str(fresh / "cuda" / "bin" / "nvcc")


def test_failed_build_gives_the_compiler_error_in_the_notice(fresh, monkeypatch):
    nvcc = _fake_nvcc(fresh, 2)
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: nvcc)
    with pytest.warns(RuntimeWarning, match="building ws_grouped_gemm.cu failed: nvcc failed .*broken on purpose"):
        assert build.load() is None
    assert not list((fresh / "cache").iterdir())  # no half-built file left behind


def test_build_is_cached_by_key_and_a_bad_library_falls_back(fresh, monkeypatch):
    nvcc = _fake_nvcc(fresh, 0)
    first = build._build(nvcc)
    assert first.parent == fresh / "cache" and first.name.startswith("ws_grouped_gemm_")
    assert build._build(nvcc) == first
    assert (fresh / "calls").read_text().split() == ["compile"]  # the second call loaded the cached file
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: nvcc)
    with pytest.warns(RuntimeWarning, match="building ws_grouped_gemm.cu failed"):
        assert build.load() is None  # ctypes refuses the fake library: fallback, not a crash


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
def test_real_build_loads_and_reports_errors_without_a_gpu(monkeypatch):
    """With the real compiler (cached after the first build): the library loads, and its launch functions
    answer bad sizes and a machine without a usable GPU with error codes, not crashes."""
    monkeypatch.setattr(build, "_state", {})
    library = build.load()
    assert isinstance(library, ctypes.CDLL)
    null = [None] * 6
    code = library.nxd_ws_gate_up(*null, 128, 100, 64, 2, 1, 0, None)  # H = 100: not a multiple of 64
    assert code == -3 and b"multiples of 64" in library.nxd_ws_error_string(code)
    if not torch.cuda.is_available():
        assert library.nxd_ws_down(*null, 128, 64, 64, 2, 1, 0, None) > 0  # a cudaError_t (no device)


def test_applies_only_on_sm90_cuda_tensors():
    from conftest import make_config

    from nxd_moe import ExpertMLPsV2

    layer = ExpertMLPsV2(make_config(4, 64, 64, 2, "glu_silu"), dtype=torch.bfloat16, backend="torch")
    assert not ws_gemm.applies(torch.zeros(4, 64, dtype=torch.bfloat16), layer.expert_weights(), 128, False)


def test_triton_backend_prefill_kernel_is_checked_and_shown():
    pytest.importorskip("triton")
    from nxd_moe.triton_kernels.backend import TritonBackend

    assert TritonBackend().prefill_kernel == "triton"
    assert "prefill_kernel='cuda_ws'" in repr(TritonBackend(prefill_kernel="cuda_ws"))
    with pytest.raises(ValueError, match=r"prefill_kernel must be one of \('triton', 'cuda_ws'\), got 'cuda'"):
        TritonBackend(prefill_kernel="cuda")
