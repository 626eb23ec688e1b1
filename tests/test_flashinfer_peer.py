"""The FlashInfer peer's harness on the CPU, without FlashInfer: the weight layout it is handed, the carry script's
split / join, what is staged and what is prebuilt, and the skip when it is absent. (The peer itself runs on the
GPU: benchmarks/README.md, "FlashInfer's CUTLASS fused MoE".)"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpu_peers  # noqa: E402
import flashinfer_prebuild  # noqa: E402
import flashinfer_stage  # noqa: E402
import gpu_layer  # noqa: E402

CARRY = ROOT / "benchmarks" / "flashinfer_carry.sh"


def test_up_first_puts_each_up_row_before_the_gate_rows():
    gate_up = torch.randn(3, 8, 5)  # (E, 2I, H), rows [gate; up], I = 4
    fc1 = _gpu_peers.up_first(gate_up)
    assert fc1.shape == gate_up.shape and fc1.is_contiguous()
    for e in range(3):
        for r in range(4):
            assert torch.equal(fc1[e, r], gate_up[e, 4 + r])  # up row r first
            assert torch.equal(fc1[e, 4 + r], gate_up[e, r])  # then gate row r


def _emulated_flashinfer(problem, fc1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's gated activation as its kernel reads fc1's output (cutlass_fused_moe_kernels.cuh): the
    linear value at column c, the gate at column I + c; silu(gate) * linear; then down, weighted, summed. float64."""
    weights, ids = problem.route(x)
    inter = fc1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = fc1[e].double() @ x[t].double()
            out[t] += float(weights[t, slot]) * (problem.down[e].double() @ (F.silu(h[inter:]) * h[:inter]))
    return out


def test_converted_weights_under_flashinfers_contract_compute_the_reference():
    """The layout conversion composed with the kernel's gate/linear convention is the layer every peer computes;
    the unconverted weights (negative control) are not. Both sides are float64, summed in different orders: their
    difference is ~1e-15 relative, so 1e-10 is far above rounding and far below the control's O(1) error."""
    case = gpu_layer.ALL_CASES["smoke-decode-m3"]
    problem, inputs = gpu_layer.make_problem(case, torch.float32, torch.device("cpu"), rotations=2, seed=0)
    for x in inputs:
        ref = _gpu_peers.reference(problem, x)
        ours = _emulated_flashinfer(problem, _gpu_peers.up_first(problem.gate_up), x)
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-10
        control = _emulated_flashinfer(problem, problem.gate_up, x)
        assert ((control - ref).norm() / ref.norm()).item() > 0.1


def _dequantized(values: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    return values.float() * scales.repeat_interleave(block, 1).repeat_interleave(block, 2)


def test_up_first_moves_each_fp8_block_with_its_scale():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 512, 256, generator=gen).to(torch.float8_e4m3fn)  # 2I = 512: I = 256, two blocks
    scales = torch.rand(2, 4, 2, generator=gen) + 0.5  # (E, 2I / 128, H / 128)
    fc1, fc1_scales = _gpu_peers.up_first(values, scales)
    assert fc1.dtype == torch.float8_e4m3fn and fc1_scales.shape == scales.shape
    assert torch.equal(_dequantized(fc1, fc1_scales), _gpu_peers.up_first(_dequantized(values, scales)))
    # negative control: the values moved without their scales dequantize to other weights
    assert not torch.equal(_dequantized(fc1, scales), _gpu_peers.up_first(_dequantized(values, scales)))


def test_up_first_rejects_shapes_it_cannot_reorder():
    with pytest.raises(ValueError, match="gate_up must be"):
        _gpu_peers.up_first(torch.zeros(2, 7, 4))
    with pytest.raises(ValueError, match="I a multiple of the block"):  # I = 192: halves split a 128-row block
        _gpu_peers.up_first(torch.zeros(2, 384, 128), torch.ones(2, 3, 1))


def _carry(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CARRY), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_carry_split_and_join_round_trip(tmp_path):
    payload = tmp_path / "payload.bin"
    payload.write_bytes(torch.randint(0, 256, (10_000,), dtype=torch.uint8).numpy().tobytes())
    parts = tmp_path / "parts"
    assert _carry("split", payload, parts, 3000).returncode == 0
    assert [p.stat().st_size for p in sorted(parts.glob("part-*"))] == [3000, 3000, 3000, 1000]
    assert _carry("split", payload, parts, 6000).returncode == 0  # a new split leaves no stale part behind
    assert [p.name for p in sorted(parts.glob("part-*"))] == ["part-000", "part-001"]
    joined = tmp_path / "joined.bin"
    assert _carry("join", parts, joined).returncode == 0
    assert joined.read_bytes() == payload.read_bytes()
    empty = _carry("join", tmp_path / "nothing", tmp_path / "x")
    assert empty.returncode != 0 and "no " in empty.stderr


def test_stage_keeps_the_python_package_and_the_fused_moe_build_inputs_only():
    kept = flashinfer_stage.kept
    assert kept("flashinfer/fused_moe/core.py") and kept("flashinfer/jit/fused_moe.py")
    assert kept("flashinfer/data/csrc/nv_internal/tensorrt_llm/deep_gemm/compiler.cuh")
    assert kept("flashinfer/data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu")
    # its binding includes ../../tvm_ffi_utils.h: a device build failed without it (2026-11-29)
    assert kept("flashinfer/data/csrc/tvm_ffi_utils.h") and not kept("flashinfer/data/csrc/tvm_ffi_utils.cu")
    assert not kept("flashinfer/data/csrc/sampling/sampling.cuh")
    assert kept("flashinfer/data/cutlass/include/cute/tensor.hpp") and kept("flashinfer/data/cccl/cub/cub/cub.cuh")
    assert not kept("flashinfer/data/csrc/fused_moe/cake_mxfp4_situ_moe/kernel.cu")
    assert not kept("flashinfer/data/cutlass/examples/00_basic_gemm/basic_gemm.cu")
    assert not kept("b12x/__init__.py") and not kept("flashinfer_python-0.7.2.post1.dist-info/METADATA")


def test_prebuild_keeps_the_bf16_and_fp8_moe_gemms_only():
    grouped = Path("90/gemm_grouped/90/cutlass_kernel_file_gemm_grouped_sm90_M128_group1.generated.cu")
    keeps = flashinfer_prebuild.keeps_generated
    assert keeps(grouped, "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, __nv_bfloat16, __nv_bfloat16,")
    assert keeps(grouped, "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, __nv_fp8_e4m3, __nv_fp8_e4m3, "
                          "__nv_bfloat16,")
    assert not keeps(grouped, "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, half, half, half,")
    assert not keeps(grouped, "sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, SafeFP4, __nv_bfloat16,")
    dense = Path("90/gemm/90/cutlass_kernel_file_gemm_sm90_M128_group0.generated.cu")
    assert not keeps(dense, "sm90_generic_mixed_gemm_kernelLauncher<__nv_bfloat16, cutlass::uint4b_t,")
    handwritten = flashinfer_prebuild.keeps_handwritten
    assert handwritten(Path("moe_gemm/moe_gemm_kernels_bf16_bf16.cu"))
    assert handwritten(Path("moe_gemm/moe_gemm_kernels_fp8_fp8.cu"))
    assert handwritten(Path("cutlass_backend/cutlass_fused_moe_instantiation.cu"))
    assert not handwritten(Path("moe_gemm/moe_gemm_kernels_fp16_fp16.cu"))
    assert not handwritten(Path("moe_gemm/moe_gemm_kernels_bf16_fp4.cu"))


def test_the_layer_benchmark_skips_flashinfer_with_the_reason():
    case = gpu_layer.ALL_CASES["smoke-decode-m3"]
    problem, _ = gpu_layer.make_problem(case, torch.float32, torch.device("cpu"), rotations=1, seed=0)
    args = argparse.Namespace(batched_mm_limit_gib=8.0, liger_src=None, vllm_src=None, liger_autotune=False,
                              flashinfer_site=None, flashinfer_autotune=False)
    rows = dict(gpu_layer.contenders(case, problem, args, torch.device("cpu"), torch.float32))
    assert rows["flashinfer_cutlass"] == "skipped: its CUTLASS kernels need CUDA"


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here")
def test_flashinfer_unavailable_says_how_to_carry_it(tmp_path):
    why = _gpu_peers.flashinfer_unavailable(str(tmp_path / "no-such-site"))
    assert "flashinfer does not import" in why and "flashinfer_carry.sh" in why


TOY = """
extern void left_out(void) __asm__("_ZN12tensorrt_llm8left_outEv");
extern void only_called(void) __asm__("_ZN12tensorrt_llm11only_calledEv");
void (*const dispatch_table[])(void) = {left_out};
void call_it(void) { only_called(); }
"""


@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("ninja") and shutil.which("readelf")),
                    reason="needs cc, ninja and binutils")
def test_prebuild_links_address_taken_left_out_instantiations_to_aborting_stubs(tmp_path):
    """A toy library with one left-out instantiation in a dispatch table (bound at load: the library would not open)
    and one only called (bound lazily, on a call that never comes): the first gets a weak aborting definition, the
    second stays undefined."""
    (tmp_path / "toy.c").write_text(TOY)
    subprocess.run(["cc", "-c", "-fPIC", "toy.c", "-o", "toy.o"], cwd=tmp_path, check=True)
    (tmp_path / "build.ninja").write_text(  # absolute paths, as FlashInfer's build.ninja has
        f"rule link\n  command = cc -shared $in -o $out\nbuild {tmp_path}/toy.so: link {tmp_path}/toy.o\n")
    ninja = shutil.which("ninja")
    subprocess.run([ninja, "-C", str(tmp_path)], check=True, capture_output=True)
    library = tmp_path / "toy.so"
    undefined, eager = flashinfer_prebuild.undefined_kernel_symbols(library)
    assert undefined == ["_ZN12tensorrt_llm11only_calledEv", "_ZN12tensorrt_llm8left_outEv"]
    assert eager == ["_ZN12tensorrt_llm8left_outEv"]
    flashinfer_prebuild.relink_with_abort_stubs(ninja, tmp_path, tmp_path / "build.ninja", library, eager)
    assert flashinfer_prebuild.undefined_kernel_symbols(library) == (["_ZN12tensorrt_llm11only_calledEv"], [])
    defined = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    assert " W _ZN12tensorrt_llm8left_outEv" in defined
