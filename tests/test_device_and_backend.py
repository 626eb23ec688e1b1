"""``build_moe(..., backend=)`` and ``nxd-moe run --device/--backend``: the choice reaches the layer, the layer
computes the same function on every backend, and a device or backend this machine cannot run is a clear error.

The CUDA tests skip without a GPU; on the GPU machine: ``pytest tests/test_device_and_backend.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from nxd_moe import build_moe
from nxd_moe.cli import main
from nxd_moe.experts import backends
from nxd_moe.experts.backends import BACKENDS, TorchBackend
from nxd_moe.nki_kernels.backend import NkiSimBackend
from nxd_moe.reference import reference_for_moe

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_BACKENDS = [name for name in ("torch", "triton") if name in BACKENDS]


def run_json(capsys, *args: str) -> dict:
    assert main(["run", "--json", "--no-progress", "--repeats", "1", *args]) == 0
    return json.loads(capsys.readouterr().out)


def exit_message(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-progress", *args])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("backend, cls", [("torch", TorchBackend), ("nki_sim", NkiSimBackend),
                                          (TorchBackend("gather"), TorchBackend)])
def test_build_moe_passes_the_backend_to_the_experts(backend, cls):
    moe = build_moe("mixtral-8x7b", scale=64, seed=0, backend=backend, block_size=16)
    assert isinstance(moe.expert_mlps.backend, cls)
    if not isinstance(backend, str):
        assert moe.expert_mlps.backend is backend


def test_every_cpu_backend_computes_the_reference_function():
    """Same seed, same weights: each backend's layer matches the float64 reference (computed independently)."""
    x = torch.randn(1, 40, 4096 // 64, generator=torch.Generator().manual_seed(1))
    for backend in ("torch", "nki_sim"):
        moe = build_moe("mixtral-8x7b", scale=64, seed=0, backend=backend, block_size=16)
        with torch.no_grad():
            out = moe(x)[0].double()
        ref = reference_for_moe(moe, x)
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), backend


def test_build_moe_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        build_moe("mixtral-8x7b", scale=64, backend="no-such-backend")


def test_run_reports_its_device_and_backend(capsys):
    report = run_json(capsys, "--config", "qwen3-30b-a3b", "--scale", "32", "--tokens", "32", "--decode-batch", "2",
                      "--backend", "nki_sim")
    assert report["device"] == "cpu" and report["backend"] == "nki_sim"
    for step in (report["prefill"], report["decode"]):
        assert step["max_abs_err"] <= 1e-5 * step["max_abs_ref"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(capsys):
    err = exit_message(capsys, "--config", "mixtral-8x7b", "--device", "cuda")
    assert "--device cuda: no CUDA device is available" in err


@pytest.mark.parametrize("device", ["tpu", "gpu0"])
def test_unknown_device_is_a_clear_error(capsys, device):
    assert f"--device must be cpu or cuda (cuda:N), got '{device}'" in exit_message(
        capsys, "--config", "mixtral-8x7b", "--device", device)


def test_backend_that_does_not_import_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "missing", "nxd_moe.no_such_module:Backend")
    err = exit_message(capsys, "--config", "mixtral-8x7b", "--backend", "missing")
    assert "--backend missing is not available here" in err and "no_such_module" in err


def test_triton_backend_on_cpu_asks_for_cuda_or_the_interpreter(capsys, monkeypatch):
    # An importable stand-in under the name "triton": the check is about the device, not the kernels.
    monkeypatch.setitem(backends.BACKENDS, "triton", "nxd_moe.experts.backends:TorchBackend")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = exit_message(capsys, "--config", "mixtral-8x7b", "--backend", "triton", "--device", "cpu")
    assert "use --device cuda" in err and "TRITON_INTERPRET=1" in err


def test_model_parallel_run_on_cuda_outside_torchrun_says_how_to_launch(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = exit_message(capsys, "--config", "mixtral-8x7b", "--device", "cuda", "--tp", "2")
    assert "torchrun --nproc-per-node 2" in err


@cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS + ["nki_sim"])
def test_run_on_cuda_end_to_end(capsys, backend):
    """The layer on the GPU, the float64 reference on the CPU, for each backend (bf16 and fp32; a Triton kernel may
    run fp32 matmuls in TF32)."""
    for dtype, tol in (("float32", 1e-4 if backend != "triton" else 2e-3), ("bfloat16", 3e-2)):
        report = run_json(capsys, "--config", "qwen3-30b-a3b", "--scale", "16", "--tokens", "96",
                          "--decode-batch", "4", "--device", "cuda", "--backend", backend, "--dtype", dtype)
        assert report["device"].startswith("cuda") and report["backend"] == backend
        for step in (report["prefill"], report["decode"]):
            assert step["max_abs_err"] <= tol * step["max_abs_ref"], (dtype, step)


@cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_build_moe_on_cuda_matches_the_cpu_reference(backend):
    moe = build_moe("llama4-scout", scale=32, seed=0, device="cuda", backend=backend, block_size=16)
    x = torch.randn(1, 33, moe.hidden_size, generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        out = moe(x)[0].double().cpu()
    ref = reference_for_moe(moe, x)
    assert ref.device.type == "cpu"
    assert (out - ref).abs().max() <= (1e-4 if backend != "triton" else 2e-3) * ref.abs().max()


def test_without_triton_everything_but_the_triton_backend_works():
    """Triton is an optional extra: with it unimportable, the package imports, a quantized layer (routed and
    shared) runs on the torch backend, and asking for backend="triton" names the extra to install."""
    import subprocess
    import sys

    script = """
import sys
sys.modules["triton"] = None
import torch
from nxd_moe import build_moe
moe = build_moe("deepseek-v3", scale=32, seed=0, quantization="mxfp4", shared_quantization="fp8")
x = torch.randn(1, 3, moe.expert_mlps.routed_experts_mlp_config.hidden_size)
assert torch.isfinite(moe(x)[0]).all()
try:
    build_moe("deepseek-v3", scale=32, backend="triton")
except ImportError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the triton backend needs Triton: pip install 'nxd-moe[gpu]'" in done.stdout
