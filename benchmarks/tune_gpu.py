"""Tune the triton backend's launch configurations on this GPU and write them where the backend looks.

    PYTHONPATH=. python3 benchmarks/tune_gpu.py [--shapes NAME ...] [--quantization FORMAT] [--budget-s 480]
        [--out FILE]

Each candidate is timed the way the layer runs: the whole ``ExpertMLPsV2`` forward (bf16, a softmax router's
routing) replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``, median), with
``TritonBackend(configs=candidate)``. The search is coordinate descent from the default rule: the row tile
``block_m``, then the gate/up kernel's tiles, then the down kernel's (with its ``SPLIT_K``), keeping each
improvement. With ``--quantization`` the experts are quantized to that format first and the search starts from
what the layer would use without the entry (the shape's bf16 entry, else the rule). The best configuration per
shape (and format) is merged into ``nxd_moe/triton_kernels/configs/<GPU>.json`` (or
``--out``); one JSON line per shape goes to stdout with the default's and the best time. A shape keeps its old
entry if the budget runs out first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization.formats import QUANTIZATION_CHOICES
from nxd_moe.quantization.quantizer import quantize_experts
from nxd_moe.triton_kernels.backend import TritonBackend
from nxd_moe.triton_kernels.launch_configs import CONFIG_DIR, default_config, device_name, launch_config, shape_key

# name: (E, H, I, k, T) -- the shapes of benchmarks/gpu_layer.py.
SHAPES = {
    "qwen3-30b-a3b-decode-b1": (128, 2048, 768, 8, 1),
    "qwen3-30b-a3b-decode-b16": (128, 2048, 768, 8, 16),
    "qwen3-30b-a3b-decode": (128, 2048, 768, 8, 32),
    "qwen3-30b-a3b-m128": (128, 2048, 768, 8, 128),
    "qwen3-30b-a3b-m1024": (128, 2048, 768, 8, 1024),
    "mixtral-8x7b-decode-b1": (8, 4096, 14336, 2, 1),
    "mixtral-8x7b-decode-b16": (8, 4096, 14336, 2, 16),
    "mixtral-8x7b-m128": (8, 4096, 14336, 2, 128),
    "mixtral-8x7b-m1024": (8, 4096, 14336, 2, 1024),
    "llama4-scout-tp8-decode": (16, 5120, 1024, 1, 64),
    "llama4-scout-decode": (16, 5120, 8192, 1, 64),
    "deepseek-v3-decode": (256, 7168, 2048, 8, 16),
    "qwen3-30b-a3b-prefill": (128, 2048, 768, 8, 4096),
    "gpt-oss-20b-prefill": (32, 2880, 2880, 4, 4096),
    "mixtral-8x7b-prefill": (8, 4096, 14336, 2, 4096),
}


def gate_up_candidates(block_m: int, quantized: bool) -> list[dict]:
    if block_m >= 64:
        return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, TMA=True)
                for n, k, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]
    if quantized:  # dequantizing is arithmetic: more warps per tile are worth trying, deeper pipelines less so
        return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3)
                for n, k, w in itertools.product((64, 128), (128, 256), (4, 8))]
    return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=s)
            for n, k, s in itertools.product((32, 64, 128), (128, 256), (3, 4))]


def down_candidates(block_m: int, quantized: bool) -> list[dict]:
    if block_m >= 64:
        return [dict(BLOCK_N=n, BLOCK_K=64, num_warps=w, num_stages=s, SPLIT_K=1, TMA=True)
                for n, w, s in itertools.product((128, 256), (4, 8), (3, 4))]
    if quantized:
        return [dict(BLOCK_N=n, BLOCK_K=128, num_warps=w, num_stages=3, SPLIT_K=sk)
                for n, w, sk in itertools.product((64, 128), (4, 8), (1, 2, 4))]
    return [dict(BLOCK_N=n, BLOCK_K=128, num_warps=4, num_stages=s, SPLIT_K=sk)
            for n, s, sk in itertools.product((64, 128), (3, 4), (1, 2, 4))]


def layer_timer(num_experts, hidden, inter, top_k, num_tokens, quantization="bf16", seed=0):
    """``time(config) -> microseconds`` of the experts forward for this shape (inf if the config fails)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    config = RoutedExpertsMLPOpsConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                                       intermediate_size=inter, hidden_act="silu", glu_mlp=True,
                                       normalize_top_k_affinities=True)
    layer = ExpertMLPsV2(config, BlockwiseMatmulConfig(), dtype=torch.bfloat16, device="cuda", backend="triton")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    if quantization != "bf16":
        quantize_experts(layer, quantization)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    router = torch.randn(hidden, num_experts, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    affinities = torch.softmax((x @ router).float(), dim=-1)
    index = affinities.topk(top_k, dim=-1).indices
    seq_len = 1 if num_tokens <= 64 else None

    def time_config(candidate: dict) -> float:
        layer.backend = TritonBackend(configs=candidate)
        try:
            with torch.no_grad():
                return do_bench_cudagraph(lambda: layer(x, affinities, index, seq_len=seq_len), rep=50) * 1e3
        except Exception:  # a configuration that does not fit (shared memory, registers) is not a candidate
            return float("inf")
    return time_config


def tune_shape(num_experts, hidden, inter, top_k, num_tokens, quantization="bf16"):
    time_config = layer_timer(num_experts, hidden, inter, top_k, num_tokens, quantization)
    if quantization == "bf16":
        rule = default_config(num_experts, hidden, inter, top_k, num_tokens,
                              torch.cuda.get_device_properties(0).multi_processor_count)
    else:
        rule = launch_config(num_experts, hidden, inter, top_k, num_tokens, torch.device("cuda"))
    best, best_us = rule, time_config(rule)
    rule_us = best_us
    for block_m in sorted({max(16, rule["block_m"] // 2), min(128, rule["block_m"] * 2)} - {rule["block_m"]}):
        shape_rule = default_config(num_experts, hidden, inter, top_k, num_tokens)
        candidate = {**shape_rule, "block_m": block_m}
        us = time_config(candidate)
        if us < best_us:
            best, best_us = candidate, us
    for part, candidates in (("gate_up", gate_up_candidates), ("down", down_candidates)):
        for option in candidates(best["block_m"], quantization != "bf16"):
            candidate = {**best, part: option}
            us = time_config(candidate)
            if us < best_us:
                best, best_us = candidate, us
    return rule_us, best_us, best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--quantization", default="bf16", choices=QUANTIZATION_CHOICES)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or str(CONFIG_DIR / f"{device_name(torch.device('cuda'))}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(out) as f:
            table = json.load(f)
    except FileNotFoundError:
        table = {}
    start = time.time()
    for name in args.shapes:
        if time.time() - start > args.budget_s:
            print(json.dumps({"shape": name, "skipped": "budget"}), flush=True)
            continue
        num_experts, hidden, inter, top_k, num_tokens = SHAPES[name]
        rule_us, best_us, config = tune_shape(num_experts, hidden, inter, top_k, num_tokens, args.quantization)
        torch.cuda.empty_cache()
        table[shape_key(num_experts, hidden, inter, top_k, num_tokens, args.quantization)] = config
        print(json.dumps({"shape": name, "quantization": args.quantization, "default_us": round(rule_us, 1),
                          "best_us": round(best_us, 1), "config": config}), flush=True)
        with open(out, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    print(json.dumps({"wrote": out, "entries": len(table), "seconds": round(time.time() - start)}))


if __name__ == "__main__":
    main()
