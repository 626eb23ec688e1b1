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


# The rules, shape by shape. Expected values worked by hand from the rules' stated terms (launch_configs' docstrings):
# rows per used expert -> block_m; the programs the tiles give -> split-K; one wave of items -> fused decode items.
@pytest.mark.parametrize("shape, block_m, warps, gate_up, down", [
    # Qwen3-30B-A3B prefill: 32768 pairs over 128 experts, 256 rows each -> 128-row tiles, 8 warps, TMA
    ((128, 2048, 768, 8, 4096), 128, 8, (128, 64), (256, 64, 1)),
    # 4096 pairs: 32 rows per expert -> 32-row tiles; 128 tiles x 16 columns cover the GPU: no split
    ((128, 2048, 768, 8, 512), 32, 4, (128, 128), (128, 128, 1)),
    # Mixtral T=1: 2 tiles x 32 columns = 64 programs -> down split 132 // 64 = 2
    ((8, 4096, 14336, 2, 1), 16, 4, (128, 128), (128, 128, 2)),
    # 64 rows per expert -> 64-row tiles, 4 warps, down 128 columns
    ((8, 4096, 14336, 2, 256), 64, 4, (128, 64), (128, 64, 1)),
])
def test_default_config_rule(shape, block_m, warps, gate_up, down):
    config = default_config(*shape, 132)
    assert config["block_m"] == block_m
    assert (config["gate_up"]["BLOCK_N"], config["gate_up"]["BLOCK_K"]) == gate_up
    assert (config["down"]["BLOCK_N"], config["down"]["BLOCK_K"], config["down"]["SPLIT_K"]) == down
    assert config["gate_up"]["num_warps"] == config["down"]["num_warps"] == warps
    assert config["gate_up"].get("TMA", False) == config["down"].get("TMA", False) == (block_m >= 64)


def test_default_config_split_follows_the_multiprocessors_and_the_depth():
    # Mixtral T=1 on 320 multiprocessors: 320 // 64 = 5; capped at 8, and by I // 256
    assert default_config(8, 4096, 14336, 2, 1, 320)["down"]["SPLIT_K"] == 5
    assert default_config(8, 4096, 14336, 2, 1, 4096)["down"]["SPLIT_K"] == 8
    assert default_config(8, 4096, 512, 2, 1, 4096)["down"]["SPLIT_K"] == 2
    assert default_config(8, 4096, 14336, 2, 1, 32)["down"]["SPLIT_K"] == 1


@pytest.mark.parametrize("shape, quantization, expected", [
    # Qwen3 T=1: 8 pair tiles x 6 column slices of 128 < 132 -> 64-column slices (K 128); down split 2 to cover the
    # GPU; router H cut to 128 (8 expert blocks x 16 = 128 items >= 66); one wave of 96 fused items
    ((128, 2048, 768, 8, 1), "bf16", dict(block_m=16, gu=(64, 128), split=2, router_chunk=128, pair_tiles=True,
                                          fused_mlp=True)),
    ((128, 2048, 768, 8, 1), "mxfp4", dict(block_m=16, gu=(64, 256), split=2, router_chunk=128, pair_tiles=True,
                                           fused_mlp=None)),
    # T=2: small (16 pairs) but no pair tiles
    ((128, 2048, 768, 8, 2), "bf16", dict(block_m=16, gu=(64, 128), split=1, router_chunk=128, pair_tiles=None,
                                          fused_mlp=None)),
    # Qwen3 T=32: 128 tiles x 6 slices of 128 cover the GPU; not small
    ((128, 2048, 768, 8, 32), "bf16", dict(block_m=16, gu=(128, 64), split=1, router_chunk=None, pair_tiles=None,
                                           fused_mlp=None)),
    # Mixtral T=1: 2 tiles x 112 slices of 128; down split ceil(132 / 64) = 3; a router of one expert block gets 256
    # columns; 224 items are two waves: not fused
    ((8, 4096, 14336, 2, 1), "bf16", dict(block_m=16, gu=(128, 64), split=3, router_chunk=256, pair_tiles=True,
                                          fused_mlp=None)),
    # 64 rows per used expert -> 64-row tiles
    ((8, 4096, 14336, 2, 256), "bf16", dict(block_m=64, gu=(128, 64), split=1, router_chunk=None, pair_tiles=None,
                                            fused_mlp=None)),
])
def test_default_decode_config_rule(shape, quantization, expected):
    config = launch_configs.default_decode_config(*shape, 132, quantization)
    assert config["block_m"] == expected["block_m"]
    assert (config["gate_up"]["BLOCK_N"], config["gate_up"]["BLOCK_K"]) == expected["gu"]
    assert config["down"] == {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": expected["split"]}
    assert (config["num_warps"], config["num_stages"], config["programs_per_sm"]) == (4, 4, 1)
    for key in ("router_chunk", "pair_tiles", "fused_mlp"):
        assert config.get(key) == expected[key], key


def test_for_dtype_halves_k_tiles_of_four_byte_elements_not_below_32():
    entry = {"block_m": 16, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128}, "down": {"BLOCK_N": 128, "BLOCK_K": 32}}
    assert launch_configs.for_dtype(entry, torch.bfloat16) is entry
    assert launch_configs.for_dtype(entry, torch.float16) is entry
    fp32 = launch_configs.for_dtype(entry, torch.float32)
    assert fp32["gate_up"] == {"BLOCK_N": 64, "BLOCK_K": 64} and fp32["down"] == {"BLOCK_N": 128, "BLOCK_K": 32}
    assert entry["gate_up"]["BLOCK_K"] == 128  # the table's entry is not changed


@pytest.mark.parametrize("quantization, expected_block_m", [("bf16", 32), ("fp8", 64), ("mxfp4", 32)])
def test_decode_config_takes_its_format_entry_else_the_bf16_one_else_the_rule(monkeypatch, quantization,
                                                                              expected_block_m):
    table = {"decode:" + shape_key(*SHAPE): _entry(32), "decode:" + shape_key(*SHAPE, quantization="fp8"): _entry(64),
             shape_key(*SHAPE): _entry(128)}  # a prefill entry of the same shape is not a decode entry
    monkeypatch.setattr(launch_configs, "tuned_table", lambda name: table)
    config = launch_configs.decode_config(*SHAPE, torch.device("cpu"), torch.bfloat16, quantization)
    assert config["block_m"] == expected_block_m
    monkeypatch.setattr(launch_configs, "tuned_table", lambda name: {})
    rule = launch_configs.default_decode_config(*SHAPE, 132, quantization, 64)
    assert launch_configs.decode_config(*SHAPE, torch.device("cpu"), torch.bfloat16, quantization, 64) == rule
    fp32 = launch_configs.decode_config(*SHAPE, torch.device("cpu"), torch.float32, quantization)
    assert fp32["gate_up"]["BLOCK_K"] == rule["gate_up"]["BLOCK_K"] // 2


def test_cpu_lookups_size_for_an_h100():
    cpu = torch.device("cpu")
    assert launch_configs.device_name(cpu) == "cpu"
    assert launch_configs.rule_multiprocessors(cpu) == 132
    assert launch_configs.l2_bytes(cpu) == 50 * 2**20
    assert launch_configs.tuned_table("no such GPU") == {}
    assert launch_configs.tuned_table("NVIDIA_H100_80GB_HBM3")  # the shipped table is read


# Boundaries of the rules (from the mutation run of launch_configs.py): each case sits where a threshold, a
# rounding or a default decides, so that a shifted one changes the answer.
def test_default_config_at_its_boundaries():
    # the whole parts, as the rule states them
    assert default_config(8, 4096, 14336, 2, 1, 132)["gate_up"] == {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
                                                                     "num_stages": 3}
    assert default_config(8, 4096, 14336, 2, 1, 132)["down"] == {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
                                                                  "num_stages": 4, "SPLIT_K": 2}
    assert default_config(128, 2048, 768, 8, 4096, 132)["gate_up"] == {"BLOCK_N": 128, "BLOCK_K": 64,
                                                                        "num_warps": 8, "num_stages": 3, "TMA": True}
    assert default_config(128, 2048, 768, 8, 4096, 132)["down"] == {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8,
                                                                     "num_stages": 3, "SPLIT_K": 1, "TMA": True}
    # 16.5 rows per expert round up to 17 -> 32-row tiles
    assert default_config(2, 64, 64, 1, 33, 132)["block_m"] == 32
    # 19 programs: 132 // 19 = 6 splits (the default multiprocessor count is an H100's 132)
    assert default_config(19, 128, 2048, 1, 19)["down"]["SPLIT_K"] == 6
    # H = 258 is 3 column slices of 128: 2 tiles x 3 = 6 programs, 12 // 6 = 2
    assert default_config(8, 258, 14336, 2, 1, 12)["down"]["SPLIT_K"] == 2
    split = default_config(8, 4096, 14336, 2, 1, 132)["down"]["SPLIT_K"]  # 132 // 64, as an integer
    assert split == 2 and type(split) is int
    # one program: all 4 multiprocessors' worth of splits
    assert default_config(4, 64, 1024, 1, 1, 4)["down"]["SPLIT_K"] == 4
    # I // 256 bounds the split, as an integer
    split = default_config(8, 4096, 700, 2, 1, 4096)["down"]["SPLIT_K"]
    assert split == 2 and type(split) is int


def test_default_decode_config_at_its_boundaries():
    def rule(*shape, **kw):
        return launch_configs.default_decode_config(*shape, **kw)

    # router_chunk: blocks x H / chunk against half the multiprocessors, ">=" -- Qwen3 (8 blocks of 16 experts)
    assert rule(128, 2048, 768, 8, 1, 256)["router_chunk"] == 128  # 8 x 16 = 128 >= 128
    assert rule(128, 2048, 768, 8, 1, 128)["router_chunk"] == 256  # 8 x 8 = 64 >= 64
    assert rule(256, 7168, 2048, 8, 1, 132)["router_chunk"] == 512  # 16 x 14 = 224 >= 66
    assert rule(17, 2048, 768, 1, 1, 16)["router_chunk"] == 512  # 17 experts are 2 blocks: 2 x 4 = 8 >= 8
    assert rule(128, 2100, 768, 8, 1, 80)["router_chunk"] == 512  # 8 x ceil(2100 / 512) = 40 >= 40
    assert rule(32, 4224, 768, 4, 1, 133)["router_chunk"] == 128  # 2 x 33 = 66 >= 133 // 2
    # 32 pairs are still a small decode
    assert rule(128, 2048, 768, 8, 4, 132)["router_chunk"] == 128
    # block_m is capped at 64 rows
    assert rule(8, 4096, 14336, 2, 1024, 132)["block_m"] == 64
    # gate/up columns: 132 slices of 128 fill 132 multiprocessors (">="), 131 do not; the default count is 132
    assert rule(8, 4096, 16896, 1, 1)["gate_up"]["BLOCK_N"] == 128
    assert rule(8, 4096, 16897, 1, 1, 133)["gate_up"]["BLOCK_N"] == 128  # 133 slices, the last one partial
    assert rule(8, 4096, 16896, 1, 1, 133)["gate_up"]["BLOCK_N"] == 64
    # the down split: I // 256 bounds it (as an integer); H / 128 slices per tile set how many programs it fills
    assert rule(128, 2048, 768, 8, 1, 4096)["down"]["SPLIT_K"] == 3
    split = rule(128, 2048, 700, 8, 1, 4096)["down"]["SPLIT_K"]
    assert split == 2 and type(split) is int
    assert rule(128, 129, 8192, 8, 1, 132)["down"]["SPLIT_K"] == 9  # 8 tiles x 2 slices: ceil(132 / 16)
    assert type(rule(128, 2048, 768, 8, 1, 132)["gate_up"]["BLOCK_K"]) is int
    # fused items: 2 pairs x ceil(65 / 64) = 4 items do not fit 3 multiprocessors
    assert "fused_mlp" not in rule(8, 64, 65, 2, 1, 3)
    assert "fused_mlp" in rule(8, 64, 65, 2, 1, 4)


def test_for_dtype_keeps_integer_tiles():
    entry = {"block_m": 16, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128}, "down": {"BLOCK_N": 128, "BLOCK_K": 128}}
    assert type(launch_configs.for_dtype(entry, torch.float32)["gate_up"]["BLOCK_K"]) is int


def test_lookups_read_the_devices_own_table(monkeypatch):
    """Tables are looked up by the device's name; a decode without a shared expert asks the rule with width 0."""
    asked = []

    def table(name):
        asked.append(name)
        return {}
    monkeypatch.setattr(launch_configs, "tuned_table", table)
    monkeypatch.setattr(launch_configs, "rule_multiprocessors", lambda device: 96)
    cpu = torch.device("cpu")
    launch_config(*SHAPE, cpu)
    decoded = launch_configs.decode_config(128, 2048, 768, 8, 1, cpu)
    assert asked and set(asked) == {"cpu"}
    assert decoded["fused_mlp"]  # 96 items on 96 multiprocessors: a shared width of 0, not 1
    assert "fused_mlp" not in launch_configs.decode_config(128, 2048, 768, 8, 1, cpu, shared_inter=64)
    assert launch_config(8, 4096, 14336, 2, 1, cpu)["down"]["SPLIT_K"] == 1  # 96 // 64: the device's count
    # Mixtral T=1 through the lookup on 132 multiprocessors: the rule's split of 2 (its arguments in order)
    monkeypatch.setattr(launch_configs, "rule_multiprocessors", lambda device: 132)
    assert launch_config(8, 4096, 14336, 2, 1, cpu)["down"]["SPLIT_K"] == 2


def test_rules_size_for_the_cuda_device_they_run_on(monkeypatch):
    seen = []
    monkeypatch.setattr(launch_configs, "multiprocessors", lambda device: seen.append(device) or 78)
    cuda = torch.device("cuda", 1)
    assert launch_configs.rule_multiprocessors(cuda) == 78 and seen == [cuda]
    assert launch_configs.rule_multiprocessors(torch.device("cpu")) == 132
