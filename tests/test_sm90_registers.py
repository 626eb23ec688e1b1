"""The shipped Triton kernels, at the launch settings the rules give real model shapes, compile for an H100 (sm_90a)
without register spills -- checked on a machine without a GPU (:mod:`sm90_offline`: the launches captured under the
interpreter at small sizes of the same divisibility, compiled as the GPU runtime would specialise them).

A spill (``LDL`` / ``STL``, stack) in a kernel that streams weights costs bandwidth on every tile; this catches a
change that adds registers (another accumulator, a wider tile, an extra live tensor) before a GPU run would.

Known and left out: the blockwise gate/up at 32-row tiles (Qwen3-30B-A3B prefill of 512 tokens: ``block_m`` 32,
128x128 tiles, 4 warps) compiles to 255 registers and a 72-byte stack (20 spill loads, 23 stores) with Triton 3.6
and 3.7; the tile won the H100 tuning sweep as it is, so it stays until a GPU run weighs a smaller one against it.
"""

from __future__ import annotations

import copy

import pytest
import torch

triton = pytest.importorskip("triton")

import sm90_offline  # noqa: E402
from conftest import INTERPRETED, make_config, make_experts, quantized_pair, randn, random_routing  # noqa: E402

from nxd_moe.triton_kernels.backend import TritonBackend  # noqa: E402
from nxd_moe.triton_kernels.launch_configs import decode_config, launch_config  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="captures launches under Triton's interpreter (CPU runs)")

CPU = torch.device("cpu")
# real (E, H, I, k, T) -> small (E, H, I, k) with the same divisibility of H and I (what the runtime specialises).
QWEN3 = ((128, 2048, 768, 8), (8, 128, 64, 2))
MIXTRAL = ((8, 4096, 14336, 2), (4, 256, 128, 2))
GPT_OSS = ((32, 2880, 2880, 4), (4, 192, 192, 2))


def _launches(model, num_tokens: int, small_tokens: int, fmt: str = "bf16", activation: str = "glu_silu",
              decode: bool = False, **overrides) -> tuple[list[dict], dict]:
    """The launches of one layer call on the small layer, with the launch settings of the real shape."""
    (num_experts, hidden, inter, top_k), (e, h, i, k) = model
    settings = (decode_config if decode else launch_config)(num_experts, hidden, inter, top_k, num_tokens, CPU,
                                                            torch.bfloat16, fmt)
    settings = {**settings, **overrides}
    backend = (TritonBackend(decode_configs=settings, one_launch=True) if decode
               else TritonBackend(configs=settings, one_launch=False))
    config = make_config(e, h, i, k, activation, **({"bias": True} if activation == "swiglu_gptoss" else {}))
    if fmt == "bf16":
        experts = make_experts(config, block_size=16, dtype=torch.bfloat16)
        experts.backend = backend
    else:
        experts, _ = quantized_pair(config, fmt, torch.bfloat16, backend, "cpu")
    x = randn(small_tokens, h, seed=2).to(torch.bfloat16)
    affinities, index = random_routing(small_tokens, e, k, seed=3)

    def call():
        with torch.no_grad():
            experts(x, affinities, index, seq_len=1 if decode else None, mode=None if decode else "blockwise")

    return sm90_offline.capture(call), settings


def _with_tma(launch: dict, box_n: int, interleaved: bool | None = None) -> dict:
    """A captured gate/up or down launch as the GPU runs it with TMA weight loads (no descriptors on a CPU)."""
    launch = copy.deepcopy(launch)
    block_k = launch["args"]["BLOCK_K"]["int"]
    launch["args"]["TMA"] = {"value": True}
    launch["args"]["w_desc"] = {"tensordesc": f"tensordesc<bf16[1, {block_k}, {box_n}]>"}
    if interleaved is not None:
        launch["args"]["GATE_UP_INTERLEAVED"] = {"value": interleaved}
    return launch


# A few one-off spills (a value parked once outside the K loop) cost nothing measurable; a tile whose working set
# does not fit spills in its loop body, tens to thousands of static LDL/STL (the negative control: hundreds).
# Triton 3.7 (CPU CI) parks one word in GPT-OSS's interleaved TMA gate/up (8-byte stack); Triton 3.6 (the GPU
# machine's) none.
ONE_OFF_SPILLS = 4


def _assert_no_spills(reports: list[dict]) -> None:
    spilled = [r for r in reports if r["spill_loads"] + r["spill_stores"] > ONE_OFF_SPILLS]
    assert not spilled, f"kernels spill on sm_90: {spilled}"


def test_prefill_gemms_compile_without_spills():
    """Blockwise prefill (128-row tiles) of Qwen3-30B-A3B and GPT-OSS-20B (bias, clamps, SwiGLU): the pointer and
    TMA weight paths, GPT-OSS's interleaved gate/up read as one TMA box of 2 * BLOCK_N columns."""
    launches, settings = _launches(QWEN3, 4096, 64)
    by_name = {launch["kernel"]: launch for launch in launches}
    assert settings["block_m"] == 128 and settings["gate_up"]["TMA"] and settings["down"]["TMA"]
    gate_up, down = by_name["_gate_up_kernel"], by_name["_down_kernel"]
    oss, oss_settings = _launches(GPT_OSS, 4096, 64, activation="swiglu_gptoss")
    oss_gate_up = next(launch for launch in oss if launch["kernel"] == "_gate_up_kernel")
    block_n = oss_settings["gate_up"]["BLOCK_N"]
    reports = sm90_offline.compile_launches(
        launches + [_with_tma(gate_up, settings["gate_up"]["BLOCK_N"]),
                    _with_tma(down, settings["down"]["BLOCK_N"]),
                    _with_tma(oss_gate_up, 2 * block_n, interleaved=True)])
    assert {r["kernel"] for r in reports} >= {"_gate_up_kernel", "_down_kernel", "_layout_kernel"}
    _assert_no_spills(reports)


@pytest.mark.parametrize("model, fmt, num_tokens, small_tokens", [
    pytest.param(QWEN3, "bf16", 1, 1, id="qwen3-t1"), pytest.param(QWEN3, "bf16", 32, 8, id="qwen3-t32"),
    pytest.param(MIXTRAL, "mxfp4", 1, 1, id="mixtral-mxfp4-t1"),
    pytest.param(MIXTRAL, "fp8", 1, 1, id="mixtral-fp8-t1")])
def test_one_launch_decode_compiles_without_spills(model, fmt, num_tokens, small_tokens):
    launches, _ = _launches(model, num_tokens, small_tokens, fmt, decode=True)
    reports = sm90_offline.compile_launches(launches)
    assert "decode_kernel" in {r["kernel"] for r in reports}
    _assert_no_spills(reports)


def test_gpt_oss_interleaved_decode_compiles_without_spills():
    """GPT-OSS-20B's one-launch decode at T=32 (bias, clamps, SwiGLU) reading transformers' interleaved gate/up
    columns as 2 * BLOCK_N adjacent ones (the experts backend's layout; the flag set on the captured launch)."""
    launches, _ = _launches(GPT_OSS, 32, 8, activation="swiglu_gptoss", decode=True)
    decode = copy.deepcopy(next(launch for launch in launches if launch["kernel"] == "decode_kernel"))
    decode["args"]["GATE_UP_INTERLEAVED"] = {"value": True}
    _assert_no_spills(sm90_offline.compile_launches([decode]))


def test_a_register_hungry_tile_is_reported():
    """Negative control: the blockwise gate/up with a 256-column, 256-deep tile at 4 warps spills, and the check
    says so (the same capture and compile as above)."""
    launches, _ = _launches(QWEN3, 4096, 64, gate_up={"BLOCK_N": 256, "BLOCK_K": 256, "num_warps": 4,
                                                       "num_stages": 3})
    gate_up = [launch for launch in launches if launch["kernel"] == "_gate_up_kernel"]
    reports = sm90_offline.compile_launches(gate_up)
    assert reports[0]["spill_loads"] + reports[0]["spill_stores"] > 10 * ONE_OFF_SPILLS
    with pytest.raises(AssertionError, match="kernels spill on sm_90"):
        _assert_no_spills(reports)
