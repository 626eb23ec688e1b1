"""Launch configurations for the grouped GEMMs: tuned entries shipped as JSON, a rule for everything else.

A configuration is looked up once per forward from static shapes only -- ``(E, H, I, k, T)`` with ``T`` rounded
up to a power of two, and the weights' storage format (quantized weights stream fewer bytes per tile and do more
arithmetic per byte, so their best tiles differ) -- in ``configs/<GPU name>.json`` (written by
``benchmarks/tune_gpu.py`` on that GPU). A shape without an entry uses :func:`default_config`; nothing autotunes
inside a forward.

Each entry: ``block_m`` (rows per tile, a power of two >= 16), and for ``gate_up`` and ``down`` the column tile
``BLOCK_N``, the reduction tile ``BLOCK_K``, ``num_warps``, ``num_stages``, and ``TMA`` (load weight tiles with the
bulk tensor copy engine, on Hopper and newer; ignored elsewhere); ``down`` also has ``SPLIT_K``, and ``gate_up``
may (absent: 1, except for quantized weights at decode tiles, where :func:`decode_split_k` chooses it). An entry may add
``prefill``: the persistent prefill GEMMs' settings on Hopper (:func:`~nxd_moe.triton_kernels.prefill_gemm.
default_prefill_config` is the rule without it).

The one-launch decode (:mod:`~nxd_moe.triton_kernels.persistent_decode`) has its own entries, keyed
``decode:<shape key>``: ``block_m``, ``gate_up`` (``BLOCK_N``, ``BLOCK_K``), ``down`` (``BLOCK_N``, ``BLOCK_K``,
``SPLIT_K``), and for the whole launch ``num_warps``, ``num_stages`` and ``programs_per_sm``; optional
``pair_tiles`` (bool: one tile per (token, expert) pair, no sort, see ``persistent_decode``), ``down_prefetch``
(bool: items that pull the chosen experts' down weights into L2 while gate/up runs) and ``router_chunk`` (the fused
router's ``H`` per item, a power of two; default ``min(512, H)``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton

CONFIG_DIR = Path(__file__).parent / "configs"


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
              quantization: str = "bf16") -> str:
    key = f"E={num_experts},H={hidden},I={inter},k={top_k},T={triton.next_power_of_2(num_tokens)}"
    return key if quantization == "bf16" else f"{key},q={quantization}"


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The tuned table's name for ``device`` (looked up once per device: it is read on every forward)."""
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


@functools.lru_cache(maxsize=None)
def tuned_table(name: str) -> dict:
    path = CONFIG_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


H100_L2_BYTES = 50 << 20
# Stored bytes per weight value of each format (scales aside).
_VALUE_BYTES = {"bf16": 2, "fp8": 1, "fp8_block": 1, "mxfp4": 0.5}


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache in bytes (an H100's off a GPU: for the rule and the interpreter)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else H100_L2_BYTES


def default_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                   multiprocessors: int = 132) -> dict:
    """The rule for untuned shapes.

    ``block_m`` follows the expected rows per used expert (``T*k / min(E, T*k)``): decode-sized problems get
    16-row tiles, where the work is streaming weights and wider tiles only re-read nothing; prefill gets 128.
    Memory-bound shapes use long ``K`` tiles, and split the down projection's ``K`` while there are fewer
    programs than multiprocessors (otherwise a 2-expert decode would run on a few SMs).
    """
    pairs = num_tokens * top_k
    rows_per_expert = pairs / min(num_experts, pairs)
    block_m = max(16, min(128, triton.next_power_of_2(int(-(-rows_per_expert // 1)))))
    # The tiles below won on every shape benchmarks/tune_gpu.py tried on an H100 (2026-11-24); TMA weight loads
    # gained 2-4% at prefill there and nothing at decode.
    if block_m >= 64:
        warps = 8 if block_m == 128 else 4
        gate_up = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": warps, "num_stages": 3, "TMA": True}
        down = {"BLOCK_N": 256 if block_m == 128 else 128, "BLOCK_K": 64, "num_warps": warps, "num_stages": 3,
                "SPLIT_K": 1, "TMA": True}
        return {"block_m": block_m, "gate_up": gate_up, "down": down}
    gate_up = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    tiles = min(num_experts, pairs)
    programs = tiles * -(-hidden // 128)
    split = max(1, min(8, multiprocessors // max(programs, 1), inter // 256))
    down = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": split}
    return {"block_m": block_m, "gate_up": gate_up, "down": down}


def default_decode_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                          multiprocessors: int = 132, quantization: str = "bf16", l2: int = H100_L2_BYTES) -> dict:
    """The rule for the one-launch decode (one program per multiprocessor). Weight tiles are read in rows of 256
    bytes (128 columns of gate and of up; down 128 columns) when that still gives a gate/up item per program,
    else 128 bytes -- narrower rows cut HBM efficiency more than extra items help; deep ``K`` tiles keep ~100 KB
    of weights in flight per program (what one multiprocessor needs to reach its share of the bandwidth). The down
    projection's ``K`` is split while its items would not cover the programs. Measured on an H100: see
    ``benchmarks/notes/issue19_gpu_kernels.md``. MxFP4 (a quarter of bf16's bytes per value, read from the
    repacked copy, ``repack.py``) takes gate/up K tiles twice as deep (a useful run of bytes per tile); its down
    tile stays at 128 (256 measured 17 % slower on Mixtral-8x7B T=1, H100: register pressure). ``l2``: the GPU's
    L2 in bytes (small decodes prefetch down weights that fit half of it)."""
    pairs = num_tokens * top_k
    used = min(num_experts, pairs)
    block_m = max(16, min(64, triton.next_power_of_2(-(-pairs // used))))
    tiles = used * -(-pairs // (used * block_m))
    gu_n = 128 if tiles * -(-inter // 128) >= multiprocessors else 64
    split = max(1, min(inter // 256, -(-multiprocessors // (tiles * -(-hidden // 128)))))
    deeper = 2 if quantization == "mxfp4" else 1
    config = {"block_m": block_m, "gate_up": {"BLOCK_N": gu_n, "BLOCK_K": deeper * 8192 // gu_n},
              "down": {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": split}, "num_warps": 4, "num_stages": 4,
              "programs_per_sm": 1}
    if pairs <= SMALL_DECODE_PAIRS:
        down_bytes = pairs * inter * hidden * _VALUE_BYTES.get(quantization, 2)
        config.update(_small_decode(num_experts, hidden, num_tokens, multiprocessors, down_bytes <= l2 // 2))
    return config


# Up to this many (token, expert) pairs a decode's five phases are latency, not bytes (Qwen3-30B-A3B T=1: router
# 9 us, routing + layout 6 us of a 62 us step, H100): the small-T settings of _small_decode apply.
SMALL_DECODE_PAIRS = 32


def _small_decode(num_experts: int, hidden: int, num_tokens: int, multiprocessors: int,
                  down_fits_l2: bool) -> dict:
    """Pair tiles at ``T = 1`` (a token's k experts are distinct, so no weight is read twice; at ``T > 1`` two
    tokens on one expert would each read it), with the down weights prefetched into L2 by the programs the gate/up
    items leave idle where they fit half of it (Qwen3-30B-A3B: 24 MiB of 50; its down phase read HBM at 1.8 TB/s
    after the gate/up phase, H100). The fused router's ``H`` is cut finer while its items would cover fewer than half
    the multiprocessors (its 1 MB fp32 weight at Qwen3's size took 9 us on 32 items), not below 128 columns
    (512-byte rows); where even that would not reach half (a small router) 256 columns: Mixtral-8x7B T=1 measured
    248.2 us with 256 against 253.8 with 512 (H100, CUDA-graph replay, one run)."""
    blocks = -(-num_experts // 16)
    chunks = [c for c in (512, 256, 128) if blocks * -(-hidden // c) >= multiprocessors // 2]
    out = {"router_chunk": min(chunks[0] if chunks else 256, triton.next_power_of_2(hidden))}
    if num_tokens == 1:
        out["pair_tiles"] = True
        out["down_prefetch"] = down_fits_l2
    return out


# The quantized decode's split of the gate/up GEMM along H (issue 29). A decode GEMM's program streams its column
# slice of the weight once; with fewer programs than the GPU holds at once (an H100 keeps ~3 of these per
# multiprocessor resident), whole multiprocessors idle, and the programs that run leave the dequantization's
# latency exposed. Split while the launch has under DECODE_WAVES programs per multiprocessor (so that the last,
# partial wave is a small part of the time) and each split still runs MIN_K_TILES K tiles (the software pipeline's
# stages need a few iterations to fill). Mixtral-8x7B T=1 (2 experts x 14336/64 column slices = 448 programs)
# splits H=4096 in 2 (MxFP4, 256-deep K tiles) or 4 (FP8, 128-deep); Qwen3-30B-A3B T=32 (~128 tiles x 12 slices)
# and DeepSeek-V3 T=16 already have thousands of programs and stay unsplit.
DECODE_WAVES = 4
MIN_K_TILES = 4
MAX_DECODE_SPLIT = 8
QUANTIZED_DECODE_FORMATS = ("mxfp4", "fp8", "fp8_block")


def decode_split_k(programs: int, depth: int, block_k: int, multiprocessors: int) -> int:
    """How many ways to split a decode GEMM's sum of ``depth`` terms (``K``), given ``programs`` unsplit programs
    (tiles x column slices), ``block_k``-deep K tiles and the GPU's multiprocessors: the smallest power of two
    that gives ``DECODE_WAVES`` programs per multiprocessor, at most ``MAX_DECODE_SPLIT`` and no more than leaves
    ``MIN_K_TILES`` K tiles per split (1 when the problem is already wide or too shallow)."""
    split = 1
    while (split < MAX_DECODE_SPLIT and programs * split < DECODE_WAVES * multiprocessors
           and depth // (2 * split) >= MIN_K_TILES * block_k):
        split *= 2
    return split


def with_decode_split(config: dict, num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                      multiprocessors: int, quantization: str) -> dict:
    """``config`` with the gate/up GEMM's ``SPLIT_K`` chosen by :func:`decode_split_k` where it has none and the
    weights are quantized and the tiles decode-sized (``block_m < 64``); otherwise ``config`` itself (16-bit
    weights and prefill tiles never split the gate/up GEMM)."""
    gate_up = config["gate_up"]
    if quantization not in QUANTIZED_DECODE_FORMATS or config["block_m"] >= 64 or "SPLIT_K" in gate_up:
        return config
    pairs = num_tokens * top_k
    used = min(num_experts, pairs)
    tiles = used * -(-pairs // (used * config["block_m"]))
    programs = tiles * -(-inter // gate_up["BLOCK_N"])
    split = decode_split_k(programs, hidden, gate_up["BLOCK_K"], multiprocessors)
    return {**config, "gate_up": {**gate_up, "SPLIT_K": split}}


def for_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Entries are tuned for 16-bit weights; 4-byte elements get half the ``K`` tile so the same pipeline depth
    fits in shared memory."""
    if dtype.itemsize <= 2:
        return config
    return {**config, **{part: {**config[part], "BLOCK_K": max(32, config[part]["BLOCK_K"] // 2)}
                         for part in ("gate_up", "down")}}


def decode_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16, quantization: str = "bf16") -> dict:
    """The one-launch decode's entry for this GPU, shape and format (falling back as :func:`launch_config`),
    else :func:`default_decode_config`, adapted to ``dtype``."""
    table = tuned_table(device_name(device))
    entry = table.get("decode:" + shape_key(num_experts, hidden, inter, top_k, num_tokens, quantization))
    if entry is None:
        entry = table.get("decode:" + shape_key(num_experts, hidden, inter, top_k, num_tokens))
    if entry is None:
        entry = default_decode_config(num_experts, hidden, inter, top_k, num_tokens, _multiprocessors(device),
                                      quantization, l2_bytes(device))
    return for_dtype(entry, dtype)


def launch_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16, quantization: str = "bf16") -> dict:
    """The tuned entry for this GPU, shape and weight format (a quantized format without its own entry takes
    the bf16 one), else :func:`default_config`, adapted to ``dtype``; quantized decode's gate/up split by
    :func:`with_decode_split` where the entry does not fix it."""
    table = tuned_table(device_name(device))
    entry = table.get(shape_key(num_experts, hidden, inter, top_k, num_tokens, quantization))
    if entry is None:
        entry = table.get(shape_key(num_experts, hidden, inter, top_k, num_tokens))
    multiprocessors = _multiprocessors(device)
    if entry is None:
        entry = default_config(num_experts, hidden, inter, top_k, num_tokens, multiprocessors)
    return with_decode_split(for_dtype(entry, dtype), num_experts, hidden, inter, top_k, num_tokens,
                             multiprocessors, quantization)
