"""Host time of one sparse-MoE block call of a transformers model, per experts path, against transformers' own.

    PYTHONPATH=. python3 benchmarks/hf_block_host.py --model qwen3-30b-a3b --tokens 1,128 --out FILE.json

An eager decode step of a small model is bound by the host: what the GPU idles for is the Python and launch work
of each op. This measures that work for the MoE block alone (router + experts + combine, transformers' block
class), one layer at full widths with random bf16 weights, for transformers' ``grouped_mm`` and ``batched_mm``
experts (transformers' ``generate`` swaps the second in for every decode step on a GPU), nxd_moe's experts
backend (``set_experts_implementation("nxd_moe")``: transformers' router, our experts) and ``patch_model`` (the
whole block ours): ``host_us`` (200 back-to-back calls, no synchronize, divided), ``wall_us`` (the same
including the final synchronize), ``stream_us`` (CUDA events around 200 calls: the device's pace, which a
host-bound call sets to the host's), ratios to ``grouped_mm`` in the same run, and each path's top Python functions
by own time (cProfile over 100 calls). Writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time

import torch

PATHS = ("grouped_mm", "batched_mm", "nxd_moe", "patch_model")


def block_of(model_name: str, path: str):
    import transformers

    import nxd_moe.hf as hf
    from nxd_moe.models.hf_models import build_hf_config

    config = build_hf_config(model_name, num_layers=1, scale=1)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if path == "patch_model":
        hf.patch_model(model, backend="triton")
    elif path == "nxd_moe":
        hf.set_experts_implementation(model, "nxd_moe")
    else:
        model.set_experts_implementation(path)
    return model, model.model.layers[0].mlp, config.hidden_size


def measure(block, x: torch.Tensor, calls: int = 200) -> dict:
    with torch.no_grad():
        for _ in range(5):
            block(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            block(x)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            block(x)
        end.record()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            block(x)
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return dict(host_us=round(host / calls * 1e6, 1), wall_us=round(wall / calls * 1e6, 1),
                stream_us=round(begin.elapsed_time(end) / calls * 1e3, 1), cprofile_top=text.getvalue())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a shipped config name (nxd-moe configs)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 128])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import transformers
    import triton

    result = {"benchmark": "hf_block_host", "model": args.model,
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "transformers": transformers.__version__, "triton": triton.__version__,
                              "gpu": torch.cuda.get_device_name()},
              "rows": {}}
    for path in PATHS:
        model, block, hidden = block_of(args.model, path)
        for tokens in args.tokens:
            x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)
            result["rows"][f"{path}_T{tokens}"] = measure(block, x)
        del model, block
        torch.cuda.empty_cache()
    for key, row in result["rows"].items():
        peer = result["rows"]["grouped_mm_T" + key.rsplit("_T", 1)[1]]
        row["host_vs_grouped_mm"] = round(peer["host_us"] / row["host_us"], 3)
        print(f"{key:20s} host {row['host_us']:8.1f} us  wall {row['wall_us']:8.1f}  stream {row['stream_us']:8.1f}"
              f"  (x{row['host_vs_grouped_mm']:.2f} grouped_mm's host time)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
