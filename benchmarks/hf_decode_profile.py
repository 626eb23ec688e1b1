"""Where a compiled decode step of a full-width Qwen3-30B-A3B goes: device time by kernel, host calls, CUDA graphs.

    PYTHONPATH=. python benchmarks/hf_decode_profile.py --layers 48 --path patch --batch 1 --out $OUT

Builds the model on the GPU with random weights (``--layers`` decoder layers of Qwen3-30B-A3B's full widths),
switches its experts (``--path``: ``patch`` = ``nxd_moe.hf.patch_model``, ``nxd_moe`` = the experts backend, or a
transformers experts implementation such as ``grouped_mm``), runs transformers' compiled recipe (each ``generate``
with a new static cache, transformers' default) twice to warm up, times ``generate`` of 1 and of 32 tokens
(``step_ms``: the difference over 31 steps, as ``hf_generate.py`` computed it before it shared one cache), then
profiles one ``--new-tokens`` ``generate`` (default 32; 1 profiles the prefill alone) with ``torch.profiler``:
``gpu_busy_ms`` (the union of kernel intervals: the prefill and the steps), the CUDA API calls on the host
(``cudaGraphLaunch``: one per replayed decode step; ``cudaStreamSynchronize``), and the top kernels by device time.
Writes ``<tag>.json`` and ``<tag>_cpu.txt`` (profiler table by host time) to ``--out``. Measured results:
``benchmarks/results/hf_decode_profile/``.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch


def busy_time_us(kernels) -> float:
    """Microseconds during which at least one of ``kernels`` (profiler events) ran."""
    busy, current = 0.0, None
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        if current is None or start > current[1]:
            if current:
                busy += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return busy + (current[1] - current[0] if current else 0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--path", default="patch", help="patch, nxd_moe, or a transformers experts implementation")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens of the profiled generate (1: prefill only)")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    import nxd_moe.hf as hf
    from nxd_moe.models.generate import generate_tokens
    from nxd_moe.models.hf_models import build_hf_config

    compiled = args.mode == "compiled"
    tag = f"L{args.layers}_{args.path}_B{args.batch}_{'c' if compiled else 'e'}"
    if args.new_tokens != 32:
        tag += f"_N{args.new_tokens}"
    config = build_hf_config("qwen3-30b-a3b", num_layers=args.layers, scale=1)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if args.path == "patch":
        hf.patch_model(model, backend="triton")
    elif args.path == "nxd_moe":
        hf.set_experts_implementation(model, "nxd_moe")
    else:
        model.set_experts_implementation(args.path)
    ids = torch.randint(0, config.vocab_size, (args.batch, 128), device="cuda")
    for _ in range(2):
        generate_tokens(model, ids, 32, compiled)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate_tokens(model, ids, n, compiled)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(1)
    one, whole = min(timed(1) for _ in range(3)), min(timed(32) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(args.new_tokens)
    events = prof.events()
    host_calls = collections.Counter(e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.end - e.time_range.start
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    result = dict(tag=tag, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  step_ms=round((whole - one) / 31 * 1e3, 3), prefill_ms=round(one * 1e3, 2),
                  profiled_wall_ms=round(wall * 1e3, 1), gpu_busy_ms=round(busy_time_us(kernels) / 1e3, 2),
                  kernels=len(kernels),
                  launches={k: v for k, v in host_calls.items()
                            if any(x in k for x in ("Graph", "LaunchKernel", "cuLaunch", "Memcpy", "Synchronize",
                                                    "StreamWait"))},
                  top_kernels=[(n[:90], c, round(t / 1e3, 3)) for n, (c, t) in top])
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{tag}_cpu.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
