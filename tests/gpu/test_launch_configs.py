"""Launch-configuration lookup of the triton backend: shape keys, per-format entries and their fallbacks, and the
shipped tables' well-formedness. Pure Python: no GPU needed."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("triton")

from nxd_moe.quantization.formats import QUANTIZATION_CHOICES  # noqa: E402
from nxd_moe.triton_kernels import launch_configs  # noqa: E402
from nxd_moe.triton_kernels.launch_configs import CONFIG_DIR, default_config, launch_config, shape_key  # noqa: E402

SHAPE = (8, 4096, 14336, 2, 3)  # E, H, I, k, T (T rounds up to 4)
KEY = re.compile(r"E=(\d+),H=(\d+),I=(\d+),k=(\d+),T=(\d+)(,q=(\w+))?")


def _entry(block_m: int) -> dict:
    part = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
    return {"block_m": block_m, "gate_up": dict(part), "down": {**part, "SPLIT_K": 2}}


def test_shape_key_rounds_tokens_and_names_quantized_formats_only():
    assert shape_key(*SHAPE) == "E=8,H=4096,I=14336,k=2,T=4"
    assert shape_key(*SHAPE, quantization="bf16") == shape_key(*SHAPE)
    assert shape_key(*SHAPE, quantization="mxfp4") == "E=8,H=4096,I=14336,k=2,T=4,q=mxfp4"


@pytest.mark.parametrize("quantization, expected_block_m", [("bf16", 32), ("fp8", 64), ("fp8_block", 32),
                                                             ("mxfp4", 32)])
def test_a_format_takes_its_own_entry_else_the_bf16_one(monkeypatch, quantization, expected_block_m):
    table = {shape_key(*SHAPE): _entry(32), shape_key(*SHAPE, quantization="fp8"): _entry(64)}
    monkeypatch.setattr(launch_configs, "tuned_table", lambda name: table)
    config = launch_config(*SHAPE, torch.device("cpu"), torch.bfloat16, quantization)
    assert config["block_m"] == expected_block_m


def test_no_entry_falls_back_to_the_rule_and_fp32_halves_the_k_tile(monkeypatch):
    monkeypatch.setattr(launch_configs, "tuned_table", lambda name: {})
    rule = default_config(*SHAPE, 132)
    assert launch_config(*SHAPE, torch.device("cpu"), torch.bfloat16, "fp8") == rule
    # No rule splits the quantized decode's gate/up GEMM (measured no faster on an H100, see launch_configs).
    assert "SPLIT_K" not in launch_config(*SHAPE[:4], 1, torch.device("cpu"), torch.bfloat16, "fp8")["gate_up"]
    fp32 = launch_config(*SHAPE, torch.device("cpu"), torch.float32, "fp8")
    assert fp32["gate_up"]["BLOCK_K"] == rule["gate_up"]["BLOCK_K"] // 2


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_tables_are_well_formed(path):
    table = json.loads(path.read_text())
    assert table
    for key, entry in table.items():
        match = KEY.fullmatch(key)
        assert match, key
        assert match.group(7) in (None, *QUANTIZATION_CHOICES) and match.group(7) != "bf16", key
        tokens = int(match.group(5))
        assert tokens & (tokens - 1) == 0, key
        assert entry["block_m"] >= 16 and entry["block_m"] & (entry["block_m"] - 1) == 0, key
        for part in ("gate_up", "down"):
            assert {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= set(entry[part]), (key, part)
        assert entry["down"]["SPLIT_K"] >= 1, key
