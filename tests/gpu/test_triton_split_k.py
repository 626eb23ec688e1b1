"""Quantized decode with the gate/up GEMM split along ``H`` (issue 29): fp32 partial sums per split, added in split
order by a second launch that applies the activation (``grouped_gemm._gate_up_partial_kernel`` /
``_gate_up_reduce_kernel``), a launch setting (``SPLIT_K`` of a ``gate_up`` entry) that no rule turns on: measured
no faster for quantized decode on an H100 (see ``launch_configs``).

Against the float64 reference of the dequantized weights and the torch backend holding them, every quantized
format (MxFP4, FP8 per channel, FP8 128x128 blocks) read from the repacked copy, T=1 and T=32, uneven splits (the
last slice shorter), all tokens on one expert, an empty expert, a NaN token; bitwise equal run to run; a split that
drops its last K slice fails the same bound (negative control). Under Triton's interpreter on CPU, and on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import assert_nan_stays_in_its_row, make_config, quantized_pair, randn, random_routing
from test_triton_repacked import _check  # the same float64-reference and torch-backend check (folder on sys.path)

from nxd_moe.triton_kernels import grouped_gemm, repack
from nxd_moe.triton_kernels.backend import TritonBackend

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FORMATS = ("mxfp4", "fp8", "fp8_block")
# (E, k, H, I): H = 160 splits 3 ways in 64-deep K tiles as 64 + 64 + 32 (the last slice short, and not a
# multiple of the repacked 64-deep chunk: zero-padded); fp8_block needs multiples of 128.
SIZES = {"mxfp4": (6, 2, 160, 96), "fp8": (6, 2, 160, 96), "fp8_block": (4, 2, 256, 128)}
# The interpreter takes 3-25 s a case: the default suite keeps one format of the slower checks (-m slow: all).
SLOW = pytest.mark.slow
SLOW_BUT_FP8 = ["fp8", pytest.param("mxfp4", marks=SLOW), pytest.param("fp8_block", marks=SLOW)]


def _split_config(gate_up_split: int, down_split: int = 2) -> dict:
    """Decode tiles (16 rows) with both GEMMs split along K, 64-deep K tiles."""
    part = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    return {"block_m": 16, "gate_up": {**part, "SPLIT_K": gate_up_split}, "down": {**part, "SPLIT_K": down_split}}


class _Launches:
    """Wraps a Triton kernel: records each launch's grid (which split ran) and launches it unchanged."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def partial_launches(monkeypatch):
    spy = _Launches(grouped_gemm._gate_up_partial_kernel)
    monkeypatch.setattr(grouped_gemm, "_gate_up_partial_kernel", spy)
    return spy


def _layers(name, num_tokens, dtype=torch.bfloat16, config=None, sizes=None, seed=1):
    num_experts, top_k, hidden, inter = sizes or SIZES[name]
    layer_config = make_config(num_experts, hidden, inter, top_k, "swiglu_gptoss", bias=True,
                               normalize_top_k_affinities=True)
    tested, holding = quantized_pair(layer_config, name, dtype, TritonBackend(configs=config or _split_config(3)),
                                     DEVICE, seed=seed)
    x = randn(num_tokens, hidden, seed=seed + 1).to(DEVICE, dtype)
    affinities, index = (t.to(DEVICE) for t in random_routing(num_tokens, num_experts, top_k, seed=seed + 2))
    return tested, holding, x, affinities, index


@pytest.mark.parametrize("name, num_tokens", [(name, 1) for name in FORMATS] + [
    ("fp8", 32), pytest.param("fp8_block", 32, marks=SLOW), pytest.param("mxfp4", 32, marks=SLOW)])
def test_split_gate_up_decode_matches_reference(name, num_tokens, partial_launches):
    """Both GEMMs split along K, read from the repacked copy: the float64 reference and the torch backend."""
    tested, holding, x, affinities, index = _layers(name, num_tokens)
    repack._CACHE.clear()
    _check(tested, holding, x, affinities, index, torch.bfloat16, f"{name} T={num_tokens}")
    assert len(repack._CACHE) == 2  # the repacked copies were read
    hidden = SIZES[name][2]
    assert [grid[1] for grid in partial_launches.grids] == [3 if hidden == 160 else 2]  # 256 = 128 + 128 (+ 0)


@pytest.mark.parametrize("name", [pytest.param("mxfp4", marks=SLOW), "fp8"])
def test_split_gate_up_decode_in_fp32(name, partial_launches):
    tested, holding, x, affinities, index = _layers(name, 1, torch.float32)
    _check(tested, holding, x, affinities, index, torch.float32, f"{name} fp32")
    assert partial_launches.grids


@pytest.mark.parametrize("name", SLOW_BUT_FP8)
@pytest.mark.parametrize("case", ["all_to_one", "empty_expert"])
def test_split_gate_up_decode_adversarial_routings(name, case):
    """All tokens on one expert (two tiles of it at T=32), or an expert nobody chose among used ones."""
    tested, holding, x, affinities, index = _layers(name, 32, seed=5)
    num_experts = SIZES[name][0]
    if case == "all_to_one":
        index = torch.stack([torch.full((32,), num_experts - 1), torch.full((32,), 0)], 1).to(DEVICE)
    else:  # experts 0 and 2 only: 1 and 3.. stay empty between used ones
        index = torch.stack([torch.zeros(32, dtype=torch.int64), torch.full((32,), 2)], 1).to(DEVICE)
    _check(tested, holding, x, affinities, index, torch.bfloat16, case)


@pytest.mark.parametrize("name", SLOW_BUT_FP8)
def test_split_gate_up_decode_keeps_a_nan_token_to_itself(name):
    tested, _, x, affinities, index = _layers(name, 8, seed=7)
    assert_nan_stays_in_its_row(lambda tokens: tested(tokens, affinities, index, seq_len=1), x, 5)


@pytest.mark.parametrize("name", SLOW_BUT_FP8)
def test_split_gate_up_decode_is_bitwise_reproducible(name):
    """No atomics: the partials are added in split order, so every run gives the same bits."""
    tested, _, x, affinities, index = _layers(name, 8, seed=9)
    with torch.no_grad():
        runs = [tested(x, affinities, index, seq_len=1) for _ in range(3)]
    assert all(torch.equal(runs[0], run) for run in runs[1:])


@pytest.mark.parametrize("name", ["mxfp4", pytest.param("fp8_block", marks=SLOW)])
def test_split_that_drops_its_last_slice_fails_the_bound(name, monkeypatch):
    """Negative control: launching one split fewer than the slices of H (the last K partial never computed nor
    added) must fail the bound the tests above pass. (Four ways: 3 or 4 slices, so one fewer still splits.)"""
    tested, holding, x, affinities, index = _layers(name, 32, config=_split_config(4), seed=11)
    slices = grouped_gemm.split_k_slices

    def short(depth, split, block_k):
        per_split, count = slices(depth, split, block_k)
        return per_split, count - 1 if split > 1 and depth == SIZES[name][2] else count

    monkeypatch.setattr(grouped_gemm, "split_k_slices", short)
    with pytest.raises(AssertionError):
        _check(tested, holding, x, affinities, index, torch.bfloat16, "dropped slice")


def test_split_k_must_be_a_positive_int():
    tested, _, x, affinities, index = _layers("fp8", 1, config=_split_config(0))
    with pytest.raises(ValueError, match="SPLIT_K must be an int >= 1, got 0"):
        tested(x, affinities, index, seq_len=1)


def test_benchmark_times_the_shipped_config_against_its_variations():
    """``benchmarks/gpu_quantized.py --decode-variants``: gate/up unsplit (the code before the rule) is among the
    variations of a split configuration, and no variation repeats the shipped one or another."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_quantized

    shipped = {"block_m": 16, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3,
                                          "SPLIT_K": 2},
               "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 1}}
    variants = gpu_quantized.decode_variants(shipped)
    assert variants["gate_up_unsplit"]["gate_up"]["SPLIT_K"] == 1
    assert variants["gate_up_split_x2"]["gate_up"]["SPLIT_K"] == 4
    assert "gate_up_split_half" not in variants and "down_split_half" not in variants  # = unsplit / shipped
    configs = [shipped, *variants.values()]
    assert all(a != b for i, a in enumerate(configs) for b in configs[i + 1:])
