"""Tune the triton backend's launch configurations on this GPU and write them where the backend looks.

    PYTHONPATH=. python3 benchmarks/tune_gpu.py [--shapes NAME ...] [--budget-s 480] [--out FILE]

For each shape ``(E, H, I, k, T)`` (bf16, random softmax routing) it times, with ``triton.testing.do_bench``
(L2 flushed between runs, median), each candidate row tile ``block_m`` and, for it, every candidate
configuration of the gate/up kernel and of the down kernel (the latter together with the combine, since its
``SPLIT_K`` partials are summed there). The fastest pair per shape is merged into
``nxd_moe/triton_kernels/configs/<GPU>.json`` (or ``--out``); one JSON line per shape goes to stdout with the
best time and the default rule's time. A shape keeps its old entry if the budget runs out before it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
from triton.testing import do_bench

from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.config import RoutedExpertsMLPOpsConfig
from nxd_moe.experts.token_mapping import num_blocks
from nxd_moe.triton_kernels.combine import combine_rows
from nxd_moe.triton_kernels.grouped_gemm import down_projection, gate_up_projection
from nxd_moe.triton_kernels.launch_configs import CONFIG_DIR, default_config, device_name, shape_key
from nxd_moe.triton_kernels.routing_metadata import routing_layout

# name: (E, H, I, k, T) -- the benchmark's shapes (benchmarks/gpu_layer.py).
SHAPES = {
    "qwen3-30b-a3b-decode-b1": (128, 2048, 768, 8, 1),
    "qwen3-30b-a3b-decode-b16": (128, 2048, 768, 8, 16),
    "qwen3-30b-a3b-decode": (128, 2048, 768, 8, 32),
    "mixtral-8x7b-decode-b1": (8, 4096, 14336, 2, 1),
    "mixtral-8x7b-decode-b16": (8, 4096, 14336, 2, 16),
    "llama4-scout-tp8-decode": (16, 5120, 1024, 1, 64),
    "llama4-scout-decode": (16, 5120, 8192, 1, 64),
    "deepseek-v3-decode": (256, 7168, 2048, 8, 16),
    "qwen3-30b-a3b-prefill": (128, 2048, 768, 8, 4096),
    "gpt-oss-20b-prefill": (32, 2880, 2880, 4, 4096),
    "mixtral-8x7b-prefill": (8, 4096, 14336, 2, 4096),
}


def candidates(block_m: int) -> tuple[list[dict], list[dict]]:
    if block_m >= 64:
        gate_up = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                   for n, k, w, s in itertools.product((64, 128), (64,), (4, 8), (3, 4))]
        down = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, SPLIT_K=1)
                for n, k, w, s in itertools.product((128, 256), (64,), (4, 8), (3, 4))]
        return gate_up, down
    gate_up = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=s)
               for n, k, s in itertools.product((32, 64, 128), (128, 256), (3, 4, 5))]
    down = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=s, SPLIT_K=sk)
            for n, k, s, sk in itertools.product((64, 128), (128,), (4,), (1, 2, 4, 8))]
    return gate_up, down


def tune_shape(num_experts, hidden, inter, top_k, num_tokens, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype, dev = torch.bfloat16, "cuda"
    x = torch.randn(num_tokens, hidden, device=dev, dtype=dtype, generator=gen)
    w13 = torch.randn(num_experts, hidden, 2 * inter, device=dev, dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(num_experts, inter, hidden, device=dev, dtype=dtype, generator=gen) * 0.02
    logits = torch.randn(num_tokens, num_experts, device=dev, generator=gen)
    index = logits.topk(top_k, dim=-1).indices
    mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=dev).scatter_(1, index, True)
    affinities = torch.softmax(logits, -1) * mask
    act = ExpertActivation.from_config(RoutedExpertsMLPOpsConfig(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter, hidden_act="silu",
        glu_mlp=True))
    rule = default_config(num_experts, hidden, inter, top_k, num_tokens,
                          torch.cuda.get_device_properties(0).multi_processor_count)
    block_ms = sorted({rule["block_m"], max(16, rule["block_m"] // 2), min(128, rule["block_m"] * 2)})

    def timed(fn):
        try:
            return do_bench(fn, warmup=10, rep=40)
        except Exception:  # a configuration that does not fit (shared memory, registers) is not a candidate
            return float("inf")

    best = None
    rule_ms = None
    for block_m in block_ms:
        _, layout = routing_layout(mask, index, block_m, num_blocks(num_tokens, top_k, num_experts, block_m), block_m)
        gate_up, down = candidates(block_m)
        gu_times = [(timed(lambda c=c: gate_up_projection(x, layout, w13, None, act, None, c)), c) for c in gate_up]
        gu_ms, gu_cfg = min(gu_times, key=lambda t: t[0])
        h = gate_up_projection(x, layout, w13, None, act, None, gu_cfg)

        def down_and_combine(c):
            return combine_rows(down_projection(h, layout, w2, None, c), layout.pair_row, index, affinities, False, dtype)

        dn_times = [(timed(lambda c=c: down_and_combine(c)), c) for c in down]
        dn_ms, dn_cfg = min(dn_times, key=lambda t: t[0])
        total = gu_ms + dn_ms
        if block_m == rule["block_m"]:
            rule_ms = timed(lambda: gate_up_projection(x, layout, w13, None, act, None, rule["gate_up"])) + timed(
                lambda: down_and_combine(rule["down"]))
        if best is None or total < best[0]:
            best = (total, {"block_m": block_m, "gate_up": gu_cfg, "down": dn_cfg})
    return best[0], rule_ms, best[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or str(CONFIG_DIR / f"{device_name(torch.device('cuda'))}.json")
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
        best_ms, rule_ms, config = tune_shape(num_experts, hidden, inter, top_k, num_tokens)
        table[shape_key(num_experts, hidden, inter, top_k, num_tokens)] = config
        print(json.dumps({"shape": name, "best_us": round(best_ms * 1e3, 1),
                          "rule_us": None if rule_ms is None else round(rule_ms * 1e3, 1), "config": config}),
              flush=True)
        with open(out, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    print(json.dumps({"wrote": out, "entries": len(table), "seconds": round(time.time() - start)}))


if __name__ == "__main__":
    main()
