"""nxd_moe's application (``CausalLMApplication``) against transformers' compiled ``generate``, whole models.

What is compared
----------------
One transformers model (random weights, bf16, built on the GPU from a shipped config: ``--model qwen3-30b-a3b
--layers 0`` is the full 48-layer model), the same weights and prompts, greedy, ``--new-tokens`` tokens per sequence
(no EOS: every contender generates them all):

- ``grouped_mm``: transformers' compiled recipe (``StaticCache``, decode step under ``torch.compile(mode=
  "reduce-overhead", fullgraph=True)``) with its default experts implementation; one ``StaticCache`` shared by every
  ``generate`` call (``nxd_moe.models.generate.static_cache``: a new cache per call re-records the CUDA graphs);
- ``patch_model``: the same recipe on the model with ``nxd_moe.hf.patch_model`` (run after ``grouped_mm``: patching is
  in place);
- ``app``: ``nxd_moe.application.CausalLMApplication`` over the patched model: one context-encoding bucket (the
  prompt length) and one token-generation bucket (prompt + new tokens), each step a CUDA graph (token generation
  compiled by Inductor first), greedy sampling on the device, the host reading every ``--read-every`` steps;
  ``app_no_inductor``: the same without Inductor; ``app_freezing``: with Inductor's freezing (weights as constants);
  ``app_autotune``: with Inductor's GEMM autotuning (``max_autotune_gemm``: Triton templates timed against cuBLAS for
  the attention projections and the LM head); ``app_per_call_scratch``: ``app`` with the one-launch decode allocating
  and zeroing its scratch per call inside the compiled step, as before the runner declared its graphs plain;
  ``app_unfused_projections``: ``app`` with each projection its own GEMM, Inductor alone compiling the step (A/Bs of
  those two changes, same run); ``app_sdpa``: ``app`` with the one-token attention left to transformers' SDPA path
  (which repeats the cache's key/value heads per query head under ``torch.compile``) instead of nxd_moe's split-key
  decode kernel (``decode_attention=False``), SDPA's backend PyTorch's choice (cuDNN on Hopper);
  ``app_sdpa_efficient`` / ``app_sdpa_math``: the same with the backend chosen (``torch.nn.attention.sdpa_kernel``:
  memory-efficient, or the math form Inductor fuses); ``app_two_phase_moe``: ``app`` with the one-launch MoE decode's
  gate/up and down in separate items (the launch rule without ``fused_mlp``, as before it was the rule's choice);
  ``app_separate_moe``: ``app`` with the MoE decode in separate kernels (the triton backends' ``one_launch=False``).

Measured, per batch size (``--batches``): time to first token (``generate`` of one token for the compiled recipe; the
application's own context-encoding time to the first token on the host), decode tokens/s (``B * (N - 1)`` over the
decode wall time; medians of ``--repeats`` runs after warm-up), and for the application: the device time of one
token-generation step (its CUDA graph replayed back to back, CUDA events) and of the context-encoding program, so
``gpu_busy = device step time / wall time per step`` and ``ttft_over_device = time to first token / CTE device time``.
Roofline: ``B * copy bandwidth / bytes a decode step must read`` (``benchmarks/hf_generate.py``'s, measured in the
same run); under expert parallelism ``N * B * copy bandwidth / bytes one rank must read``. Same greedy tokens: the
fraction of the application's tokens equal to ``patch_model``'s (the same layer under transformers' loop), else to
``grouped_mm``'s.

Expert parallelism: under ``torchrun --nproc-per-node N`` each rank builds the same model and runs the application
with ``moe_ep_degree = N`` on its own ``B`` sequences (data-parallel attention, each rank E / N experts, lockstep);
only the application variants run, and rank 0 reports the slowest rank's step and the aggregate tokens/s
(``N * B`` per step). Compare with a one-process run at the same ``B`` per GPU.

Output: one JSON (``--out``) and a table. Run on the GPU machine; ``--device cpu`` with a small ``--scale`` is a smoke
test, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_generate import copy_bandwidth, decode_bytes_per_step, slowest  # noqa: E402

VARIANTS = ("grouped_mm", "patch_model", "app", "app_no_inductor", "app_freezing", "app_autotune",
            "app_per_call_scratch", "app_unfused_projections", "app_sdpa", "app_sdpa_efficient", "app_sdpa_math",
            "app_two_phase_moe", "app_separate_moe")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_ms(fn, device: torch.device, repeats: int = 20) -> float | None:
    """Device ms of one call of ``fn`` (a graph replay), ``repeats`` back to back between two CUDA events."""
    if device.type != "cuda":
        return None
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def profile_steps(fn, device: torch.device, replays: int = 10) -> dict | None:
    """Where the device time of one step (``fn``: a graph replay) goes: ``torch.profiler`` over ``replays`` replays
    back to back -- kernels per step, the sum of their durations, the time at least one kernel ran (the rest of the
    step's device time is the gaps between dependent kernels), and the top kernels per step."""
    if device.type != "cuda":
        return None
    import collections

    from hf_decode_profile import busy_time_us
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"kernels_per_step": 0}
    first = min(e.time_range.start for e in kernels)
    last = max(e.time_range.end for e in kernels)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.end - e.time_range.start
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {"kernels_per_step": round(len(kernels) / replays, 1),
            "span_us_per_step": round((last - first) / replays, 1),
            "busy_us_per_step": round(busy_time_us(kernels) / replays, 1),
            "kernel_sum_us_per_step": round(sum(t for _, t in by_name.values()) / replays, 1),
            "top_kernels": [(n[:100], round(c / replays, 2), round(t / replays, 2)) for n, (c, t) in top]}


def time_app(app, ids: torch.Tensor, new_tokens: int, repeats: int, read_every: int,
             profile_replays: int = 0) -> dict:
    device = app.runner.device
    batch = ids.shape[0]
    kwargs = dict(max_new_tokens=new_tokens, eos_token_id=[], read_every=read_every)
    app.generate(ids, **kwargs)  # warm-up (the graphs were captured by load)
    ttft, decode, out = [], [], None
    for _ in range(repeats):
        out = app.generate(ids, **kwargs)
        ttft.append(out.timings["context_encoding_s"])
        decode.append(out.timings["token_generation_s"])
    t_decode = statistics.median(decode)
    wall_step_ms = t_decode / (new_tokens - 1) * 1e3
    config = app.config
    runner = app.runner
    tkg = config.token_generation_buckets[-1]
    cte = config.context_encoding_buckets[-1]
    saved = [t.clone() for t in runner.state_tensors()]
    # replays from the prompt's end: every position they write stays inside the cache
    runner.positions.fill_(ids.shape[1])
    runner.step.fill_(1)
    step_ms = graph_ms(lambda: runner.token_generation(tkg), device)
    cte_ms = graph_ms(lambda: runner.context_encoding(cte), device, repeats=5)
    profile = (profile_steps(lambda: runner.token_generation(tkg), device, profile_replays)
               if profile_replays else None)
    for t, s in zip(runner.state_tensors(), saved):
        t.copy_(s)
    row = {"ttft_ms": round(statistics.median(ttft) * 1e3, 2),
           "decode_ms_per_step": round(wall_step_ms, 3),
           "decode_tokens_per_s": round(batch / wall_step_ms * 1e3, 1),
           "tokens": out.tokens.tolist()}
    if profile:
        row["profile"] = profile
    if step_ms is not None:
        row.update(device_ms_per_step=round(step_ms, 3), gpu_busy=round(step_ms / wall_step_ms, 3),
                   context_encoding_device_ms=round(cte_ms, 2),
                   ttft_over_device=round(statistics.median(ttft) * 1e3 / cte_ms, 3))
    return row


def distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """Under torchrun: the process group (NCCL on GPUs, gloo on CPUs), this rank's GPU; the application sets up
    expert parallelism over every rank itself (``moe_ep_degree`` = the world). One process: ``(0, 1, device)``."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def run(args) -> dict:
    import torch._inductor.config  # noqa: F401  (app_freezing patches it)
    from transformers import AutoModelForCausalLM

    from nxd_moe.application import ApplicationConfig, CausalLMApplication
    from nxd_moe.application import runner as runner_module
    from nxd_moe.application.attention import ATTENTION as DECODE_ATTENTION
    from nxd_moe.hf import patch_model
    from nxd_moe.models.generate import timed_generate
    from nxd_moe.models.hf_models import build_hf_config
    from nxd_moe.triton_kernels import launch_configs

    device = torch.device(args.device)
    rank, world, device = distributed(device)
    if world > 1:
        args.variants = [v for v in args.variants if v.startswith("app")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    import transformers
    env["transformers"] = transformers.__version__
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    bandwidth = copy_bandwidth(device)
    hf_config = build_hf_config(args.model, num_layers=args.layers or None, scale=args.scale)
    torch.manual_seed(0)
    with torch.device(device):  # random weights drawn on the device: a 30B model is built in seconds
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    text = model.config.get_text_config()
    result = {"benchmark": "app_generate", "model": args.model, "layers": text.num_hidden_layers,
              "expert_parallel": world,
              "scale": args.scale, "parameters": sum(p.numel() for p in model.parameters()),
              "vocab_size": text.vocab_size, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "read_every": args.read_every, "environment": env,
              "roofline": {"copy_TBps": None if bandwidth is None else bandwidth / 1e12}, "rows": {}}

    def save():
        if args.out and rank == 0:
            Path(args.out).write_text(json.dumps(result, indent=1))

    prompts = {b: torch.randint(0, text.vocab_size, (b, args.prompt_len), device=device,
                                generator=torch.Generator(device).manual_seed(b + 1000 * rank)) for b in args.batches}
    for b in args.batches:
        # per rank under expert parallelism; every rank reads its bytes at the same time
        bytes_step = decode_bytes_per_step(model, b, args.prompt_len + args.new_tokens // 2, world)
        result["roofline"][f"B{b}"] = {"bytes_per_step": bytes_step, "decode_tokens_per_s":
                                       None if bandwidth is None else world * b * bandwidth / bytes_step}
    patched = False
    for variant in [v for v in VARIANTS if v in args.variants]:
        row = result["rows"].setdefault(variant, {})
        started = time.perf_counter()
        try:
            if variant != "grouped_mm" and not patched:
                patch_model(model)
                patched = True
            torch._dynamo.reset()
            for b in args.batches:
                ids = prompts[b]
                if variant.startswith("app"):
                    length = args.prompt_len + args.new_tokens
                    config = ApplicationConfig(batch_size=b, seq_len=length, max_context_length=args.prompt_len,
                                               torch_dtype=dtype, context_encoding_buckets=[args.prompt_len],
                                               token_generation_buckets=[length], ctx_batch_size=args.ctx_batch or b,
                                               tp_degree=world, moe_ep_degree=world)
                    t0 = time.perf_counter()
                    unfused = mock.patch.object(runner_module, "compile_with_fused_projections", "inductor")
                    sdpa = variant.startswith("app_sdpa")
                    if sdpa and model.config._attn_implementation == DECODE_ATTENTION:
                        model.set_attn_implementation("sdpa")  # an earlier variant switched it to the decode kernel
                    with unfused if variant == "app_unfused_projections" else contextlib.nullcontext():
                        app = CausalLMApplication(model, config, decode_attention=not sdpa,
                                                  compile_token_generation=variant != "app_no_inductor")
                    # app_freezing: Inductor with its weights taken as constants (its freezing passes fuse the
                    # projections of one input into one GEMM: q, k, v); app_autotune: Inductor times its Triton GEMM
                    # templates against cuBLAS; app_per_call_scratch: the runner's step without its declaration;
                    # app_unfused_projections: the runner compiles with Inductor alone
                    per_call = mock.patch.object(runner_module, "kept_kernel_memory", contextlib.nullcontext)
                    two_phase = two_phase_moe(model, launch_configs)
                    separate = separate_moe(model)
                    with torch._inductor.config.patch(freezing=variant == "app_freezing",
                                                      max_autotune_gemm=variant == "app_autotune"), \
                            (per_call if variant == "app_per_call_scratch" else contextlib.nullcontext()), \
                            (two_phase if variant == "app_two_phase_moe" else contextlib.nullcontext()), \
                            (separate if variant == "app_separate_moe" else contextlib.nullcontext()), \
                            sdpa_backend(variant):
                        app.load()
                        load_s = time.perf_counter() - t0
                        timing = time_app(app, ids, args.new_tokens, args.repeats, args.read_every, args.profile)
                    timing["load_s"] = round(load_s, 1)
                    if world > 1:  # the slowest rank's step; every rank's sequences count
                        timing["decode_ms_per_step"] = slowest(timing["decode_ms_per_step"])
                        timing["decode_tokens_per_s"] = round(world * b / timing["decode_ms_per_step"] * 1e3, 1)
                    del app
                else:
                    timing = timed_generate(model, ids, args.new_tokens, True, args.repeats)
                    timing["tokens"] = timing["tokens"].tolist()
                    timing["ttft_ms"] = timing.pop("prefill_ms")
                row[f"B{b}"] = timing
                print(f"{variant:12s} B={b:3d} ttft {timing['ttft_ms']:9.2f} ms  decode "
                      f"{timing['decode_tokens_per_s']:9.1f} tok/s  busy {timing.get('gpu_busy')}", flush=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                save()
        except Exception as exc:  # a contender that cannot run is a row saying why
            import traceback
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        row["wall_s"] = round(time.perf_counter() - started, 1)
        save()
    derive(result, args.batches)
    save()
    return result


def _config_caching_backends(model, variant: str) -> list:
    """The triton backends a model's layers call: the shared instances ``patch_model``'s layers use, and any a module
    holds."""
    from nxd_moe.models import experts_backend

    held = [getattr(m, "backend", None) for m in model.modules()] + list(experts_backend._BACKENDS.values())
    backends = list({id(b): b for b in held if hasattr(b, "_configs")}.values())
    if not backends:
        raise RuntimeError(f"{variant}: no backend with a config cache found; the A/B would compare nothing")
    return backends


@contextlib.contextmanager
def separate_moe(model):
    """``app_separate_moe``: every triton backend of the model with ``one_launch=False`` inside, restored after."""
    backends = _config_caching_backends(model, "app_separate_moe")
    before = [b.one_launch for b in backends]
    for backend in backends:
        backend.one_launch = False
    try:
        yield
    finally:
        for backend, value in zip(backends, before):
            backend.one_launch = value


@contextlib.contextmanager
def two_phase_moe(model, launch_configs):
    """``app_two_phase_moe``: the decode launch rule without ``fused_mlp``; the backends' per-shape config caches
    (the shared instances ``patch_model``'s layers call, and any a module holds) emptied on the way in and out, so
    that each variant looks its configs up under its own rule."""
    rule = launch_configs.default_decode_config
    backends = _config_caching_backends(model, "app_two_phase_moe")
    for backend in backends:
        backend._configs.clear()
    try:
        with mock.patch.object(launch_configs, "default_decode_config",
                               lambda *a: {k: v for k, v in rule(*a).items() if k != "fused_mlp"}):
            yield
    finally:
        for backend in backends:
            backend._configs.clear()


def derive(result: dict, batches) -> None:
    rows = result["rows"]
    for b in batches:
        key = f"B{b}"
        roof = result["roofline"].get(key, {}).get("decode_tokens_per_s")
        peers = {v: rows[v][key]["decode_tokens_per_s"] for v in ("grouped_mm", "patch_model")
                 if key in rows.get(v, {})}
        for r in rows.values():
            cell = r.get(key)
            if not cell:
                continue
            if roof:
                cell["over_roofline"] = round(cell["decode_tokens_per_s"] / roof, 3)
            if peers:
                best = max(peers.values())
                cell["over_best_peer"] = round(cell["decode_tokens_per_s"] / best, 3)
            if "grouped_mm" in peers:
                cell["over_grouped_mm"] = round(cell["decode_tokens_per_s"] / peers["grouped_mm"], 3)
        reference = next((rows[v][key] for v in ("patch_model", "grouped_mm") if key in rows.get(v, {})), None)
        for variant in [v for v in rows if v.startswith("app")]:
            app = rows[variant].get(key)
            if app and reference and "tokens" in reference:
                a, r = torch.tensor(app["tokens"]), torch.tensor(reference["tokens"])
                n = min(a.shape[1], r.shape[1])
                app["same_tokens"] = round((a[:, :n] == r[:, :n]).float().mean().item(), 3)


def sdpa_backend(variant: str):
    """The SDPA backend an ``app_sdpa_*`` variant picks (chosen when the step is traced), else no choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"app_sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "app_sdpa_math": SDPBackend.MATH}.get(variant)
    return contextlib.nullcontext() if chosen is None else sdpa_kernel([chosen])


def table(result: dict, batches) -> str:
    lines = [f"{result['model']} ({result['layers']} layers), prompt {result['prompt_len']}, "
             f"{result['new_tokens']} new tokens, {result['environment'].get('gpu', result['environment']['device'])}"]
    for v, r in result["rows"].items():
        for b in batches:
            c = r.get(f"B{b}")
            if c:
                lines.append(f"{v:12s} B={b:3d} ttft {c['ttft_ms']:8.2f} ms  {c['decode_tokens_per_s']:8.1f} tok/s  "
                             f"roofline x{c.get('over_roofline')}  vs best peer x{c.get('over_best_peer')}  "
                             f"busy {c.get('gpu_busy')}  same {c.get('same_tokens')}")
        if "error" in r:
            lines.append(f"{v:12s} error: {r['error']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=0, help="MoE layers (0: the architecture's full depth)")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--read-every", type=int, default=16)
    p.add_argument("--ctx-batch", type=int, default=0, help="ctx_batch_size of the application (0: the batch)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N token-generation replays of the application (kernels per step, gaps)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(table(result, args.batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
