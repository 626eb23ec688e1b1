"""Launch configurations for the grouped GEMMs: tuned entries shipped as JSON, a rule for everything else.

A configuration is looked up once per forward from static shapes only -- ``(E, H, I, k, T)`` with ``T`` rounded
up to a power of two, and the weights' storage format (quantized weights stream fewer bytes per tile and do more
arithmetic per byte, so their best tiles differ) -- in ``configs/<GPU name>.json`` (written by
``benchmarks/tune_gpu.py`` on that GPU). A shape without an entry uses :func:`default_config`; nothing autotunes
inside a forward.

Each entry: ``block_m`` (rows per tile, a power of two >= 16), and for ``gate_up`` and ``down`` the column tile
``BLOCK_N``, the reduction tile ``BLOCK_K``, ``num_warps``, ``num_stages``, and ``TMA`` (load weight tiles with the
bulk tensor copy engine, on Hopper and newer; ignored elsewhere); ``down`` also has ``SPLIT_K``, and ``gate_up``
may (absent: 1; a split gate/up sums fp32 partials of each slice of ``H`` in a second launch, in a fixed order --
measured on an H100 for quantized decode, issue 29, it gained nothing: Mixtral-8x7B T=1 FP8 172.6 us split 4 ways
against 166.4 unsplit, MxFP4 118.7 split 2 ways against 121.0, ``benchmarks/results/gpu_quantized_split_h100.json``;
no rule turns it on). An entry may add
``prefill``: the persistent prefill GEMMs' settings on Hopper (:func:`~nxd_moe.triton_kernels.prefill_gemm.
default_prefill_config` is the rule without it).

The one-launch decode (:mod:`~nxd_moe.triton_kernels.persistent_decode`) has its own entries, keyed
``decode:<shape key>``: ``block_m``, ``gate_up`` (``BLOCK_N``, ``BLOCK_K``), ``down`` (``BLOCK_N``, ``BLOCK_K``,
``SPLIT_K``), and for the whole launch ``num_warps``, ``num_stages`` and ``programs_per_sm``; optional
``pair_tiles`` (bool: one tile per (token, expert) pair, no sort, see ``persistent_decode``), ``down_prefetch``
(bool: items that pull the chosen experts' down weights into L2 while gate/up runs), ``fused_mlp`` (bool: each
gate/up item also runs its columns' share of the down projection, no down items; unquantized weights) and
``router_chunk`` (the fused router's ``H`` per item, a power of two; default ``min(512, H)``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton

from nxd_moe.gpu_info import multiprocessors

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


def rule_multiprocessors(device: torch.device) -> int:
    """The multiprocessors the launch-config rules size for: the CUDA device's, or an H100's 132 on a CPU (Triton's
    interpreter runs the configs a GPU would get)."""
    return multiprocessors(device) if device.type == "cuda" else 132


H100_L2_BYTES = 50 << 20


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache in bytes (an H100's off a GPU: the interpreter's)."""
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
                          multiprocessors: int = 132, quantization: str = "bf16", shared_inter: int = 0) -> dict:
    """The rule for the one-launch decode (one program per multiprocessor). Weight tiles are read in rows of 256
    bytes (128 columns of gate and of up; down 128 columns) when that still gives a gate/up item per program,
    else 128 bytes -- narrower rows cut HBM efficiency more than extra items help; deep ``K`` tiles keep ~100 KB
    of weights in flight per program (what one multiprocessor needs to reach its share of the bandwidth). The down
    projection's ``K`` is split while its items would not cover the programs. Measured on an H100: see
    ``benchmarks/notes/issue19_gpu_kernels.md``. MxFP4 (a quarter of bf16's bytes per value, read from the
    repacked copy, ``repack.py``) takes gate/up K tiles twice as deep (a useful run of bytes per tile); its down
    tile stays at 128 (256 measured 17 % slower on Mixtral-8x7B T=1, H100: register pressure). ``shared_inter``:
    the width of a shared expert the launch also runs (its gate/up items take programs too), 0 for none."""
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
        config.update(_small_decode(num_experts, hidden, num_tokens, multiprocessors))
    # Fused gate/up + down items (``fused_mlp``) where they are one wave: pair tiles, unquantized, every item -- the
    # shared expert's gate/up items too -- on its own multiprocessor. Measured on an H200 (CUDA-graph replay of the
    # layer, ``benchmarks/results/gpu_decode_fused_rule_h200.json``): Qwen3-30B-A3B T=1 (96 items) 40.2 us against
    # 43.1 two-phase -- no phase boundary, each program streams its slice's gate/up and down weights back to back;
    # Llama 4 Scout T=1 (128 fused items beside its shared expert's 128 gate/up items: two waves) 169.8 against
    # 130.8. Narrower, more numerous items did not help Qwen3 (48 of 64 columns, 128 items: 42.1 us,
    # ``gpu_decode_fused48_qwen3_t1_h200.json``), nor did deeper pipelines, 8 warps or two programs per
    # multiprocessor (``gpu_decode_fused_qwen3_t1_h200.json``). In the whole model the gain is within noise
    # (full-size Qwen3 B=1 260.2 against 259.4 tokens/s, ``app_fused_mlp_ab_qwen3_full_b1_h200.json``).
    items = pairs * -(-inter // gu_n) + -(-num_tokens // block_m) * -(-shared_inter // gu_n)
    if config.get("pair_tiles") and quantization == "bf16" and items <= multiprocessors:
        config["fused_mlp"] = True
    return config


# Up to this many (token, expert) pairs a decode's five phases are latency, not bytes (Qwen3-30B-A3B T=1: router
# 9 us, routing + layout 6 us of a 62 us step, H100): the small-T settings of _small_decode apply.
SMALL_DECODE_PAIRS = 32


def _small_decode(num_experts: int, hidden: int, num_tokens: int, multiprocessors: int) -> dict:
    """Pair tiles at ``T = 1`` (a token's k experts are distinct, so no weight is read twice; at ``T > 1`` two
    tokens on one expert would each read it). The fused router's ``H`` is cut finer while its items would cover
    fewer than half the multiprocessors (its 1 MB fp32 weight at Qwen3's size took 9 us on 32 items), not below 128
    columns (512-byte rows); where even that would not reach half (a small router) 256 columns. Measured on an
    H100 (CUDA-graph replay, ``benchmarks/results/gpu_decode_small_t_h100.json``): Qwen3-30B-A3B T=1 51.1 us against
    63.2 before (router items 3.3 us instead of 9), Mixtral-8x7B T=1 246.9 against 257.7. ``down_prefetch`` (down
    weights pulled into L2 by the programs gate/up leaves idle) is not turned on: it measured slower in the same run
    (Qwen3 T=1 55.5 us: the prefetch takes HBM bandwidth from the gate/up stream; Mixtral 318.8)."""
    blocks = -(-num_experts // 16)
    chunks = [c for c in (512, 256, 128) if blocks * -(-hidden // c) >= multiprocessors // 2]
    out = {"router_chunk": min(chunks[0] if chunks else 256, triton.next_power_of_2(hidden))}
    if num_tokens == 1:
        out["pair_tiles"] = True
    return out


def for_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Entries are tuned for 16-bit weights; 4-byte elements get half the ``K`` tile so the same pipeline depth
    fits in shared memory."""
    if dtype.itemsize <= 2:
        return config
    return {**config, **{part: {**config[part], "BLOCK_K": max(32, config[part]["BLOCK_K"] // 2)}
                         for part in ("gate_up", "down")}}


def decode_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16, quantization: str = "bf16", shared_inter: int = 0) -> dict:
    """The one-launch decode's entry for this GPU, shape and format (falling back as :func:`launch_config`),
    else :func:`default_decode_config`, adapted to ``dtype``."""
    table = tuned_table(device_name(device))
    entry = table.get("decode:" + shape_key(num_experts, hidden, inter, top_k, num_tokens, quantization))
    if entry is None:
        entry = table.get("decode:" + shape_key(num_experts, hidden, inter, top_k, num_tokens))
    if entry is None:
        entry = default_decode_config(num_experts, hidden, inter, top_k, num_tokens, rule_multiprocessors(device),
                                      quantization, shared_inter)
    return for_dtype(entry, dtype)


def launch_config(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16, quantization: str = "bf16") -> dict:
    """The tuned entry for this GPU, shape and weight format (a quantized format without its own entry takes
    the bf16 one), else :func:`default_config`, adapted to ``dtype``."""
    table = tuned_table(device_name(device))
    entry = table.get(shape_key(num_experts, hidden, inter, top_k, num_tokens, quantization))
    if entry is None:
        entry = table.get(shape_key(num_experts, hidden, inter, top_k, num_tokens))
    if entry is None:
        entry = default_config(num_experts, hidden, inter, top_k, num_tokens, rule_multiprocessors(device))
    return for_dtype(entry, dtype)
