"""Where the host time of an eager ``generate`` step goes, per experts path, one path per process.

    PYTHONPATH=. python3 benchmarks/hf_step_host.py --path nxd_moe --model qwen3-30b-a3b --layers 4 --out FILE.json

An eager decode step of a small model is bound by the host (the GPU idles while Python and the launches run), and
timed one after another in one process the contenders were measured to favour whichever ran first
(``hf_generate.py --interleave``'s docstring). This runs ONE path in a fresh process (``grouped_mm`` -- whose
``generate`` swaps in ``batched_mm`` for the decode steps on a GPU --, ``batched_mm``, ``nxd_moe`` (the experts
backend) or ``patch_model``) and splits its decode step's host time by module: forward hooks time the host work of
every decoder layer's MoE block, attention, norms, the LM head and the whole forward; the rest of the step is
``generate``'s own loop (logits processing, stopping criteria, the synchronize per token). Also: decode ms per
step (median of ``--repeats``), the step's kernel launches and host-device synchronizations (``torch.profiler``'s
CUDA runtime calls) and the top Python functions by own time (cProfile over one ``generate``). Writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import platform
import pstats
import statistics
import time

import torch

PATHS = ("grouped_mm", "batched_mm", "nxd_moe", "patch_model")


def build(model_name: str, layers: int, scale: int, path: str, device: torch.device, dtype: torch.dtype):
    import transformers

    import nxd_moe.hf as hf
    from nxd_moe.models.hf_models import build_hf_config

    config = build_hf_config(model_name, num_layers=layers, scale=scale)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if path == "patch_model":
        hf.patch_model(model, backend="triton" if device.type == "cuda" else "torch")
    elif path == "nxd_moe":
        hf.set_experts_implementation(model, "nxd_moe")
    else:
        model.set_experts_implementation(path)
    return model


class HostClock:
    """Forward pre/post hooks that add up each module kind's host time (``perf_counter``, no synchronize)."""

    def __init__(self, model):
        self.total = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.handles = []
        kinds = {"model": model.model, "lm_head": model.lm_head}
        for layer in model.model.layers:
            for name in ("mlp", "self_attn", "input_layernorm", "post_attention_layernorm"):
                if hasattr(layer, name):
                    kinds.setdefault(name, [])
                    kinds[name].append(getattr(layer, name))
        for kind, modules in kinds.items():
            for module in modules if isinstance(modules, list) else [modules]:
                self.handles.append(module.register_forward_pre_hook(self._start(kind)))
                self.handles.append(module.register_forward_hook(self._stop(kind)))
        self.started = {}

    def _start(self, kind):
        def hook(module, args):
            self.started[id(module)] = time.perf_counter()
        return hook

    def _stop(self, kind):
        def hook(module, args, output):
            self.total[kind] += time.perf_counter() - self.started.pop(id(module))
            self.calls[kind] += 1
        return hook

    def reset(self):
        self.total.clear()
        self.calls.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model, ids, new_tokens):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", choices=PATHS, required=True)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--scale", type=int, default=1, help="widths divided by this (a CPU run)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args.model, args.layers, args.scale, args.path, device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    steps = args.new_tokens - 1

    def timed(n):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            generate(model, ids, n)
        sync(device)
        return time.perf_counter() - start

    for _ in range(2):
        timed(args.new_tokens)
        timed(1)
    per_step = []
    for _ in range(args.repeats):
        one, full = timed(1), timed(args.new_tokens)
        per_step.append((full - one) / steps * 1e3)
    clock = HostClock(model)
    one = timed(1)
    prefill = dict(clock.total)
    clock.reset()
    full = timed(args.new_tokens)
    step_ms = (full - one) / steps * 1e3
    # decode steps only (the one-token generate's prefill taken off); the hooks' own cost is in these numbers:
    # what they compare is the paths' modules, timed the same way
    host = {k: round((v - prefill.get(k, 0.0)) / steps * 1e3, 3) for k, v in clock.total.items()}
    calls = dict(clock.calls)
    clock.remove()

    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, torch.no_grad():
        generate(model, ids, args.new_tokens)
        sync(device)
    runtime = collections.Counter()
    for event in prof.events():
        if event.name.startswith("cuda") or event.name.startswith("aten::item") or event.name in (
                "aten::_local_scalar_dense", "aten::nonzero"):
            runtime[event.name] += 1
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    profiler = cProfile.Profile()
    with torch.no_grad():
        profiler.enable()
        generate(model, ids, args.new_tokens)
        profiler.disable()
    sync(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    result = {"benchmark": "hf_step_host", "path": args.path, "model": args.model, "layers": args.layers,
              "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "transformers": transformers.__version__, "device": str(device),
                              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
              "decode_ms_per_step": round(statistics.median(per_step), 3),
              "decode_ms_per_step_runs": [round(v, 3) for v in per_step],
              "hooked_decode_ms_per_step": round(step_ms, 3),
              "host_ms_per_token_by_module": host, "hook_calls": calls,
              "host_ms_per_token_outside_forward": round(step_ms - host.get("model", 0.0) - host.get("lm_head", 0.0),
                                                          3),
              "runtime_calls_per_generate": dict(runtime.most_common()),
              "ops_by_self_cpu": ops, "cprofile_top": text.getvalue()}
    print(json.dumps({k: v for k, v in result.items() if k not in ("ops_by_self_cpu", "cprofile_top")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
