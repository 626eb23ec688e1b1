"""GPU benchmark: nxd_moe's MoE layer (torch and triton backends) against GPU peers, same weights, same routing.

What is compared
----------------
Per case (a shape), in one process per case, every contender runs the same full MoE layer -- router, routed
experts, combine, shared expert where the case has one -- over the same weights and the same inputs:

- peers: torch ``grouped_mm`` in a torchtitan-style layer written here; HuggingFace transformers' experts
  implementations (``grouped_mm``, ``batched_mm`` for decode, ``eager``); Liger-Kernel's fused MoE (from an
  unpacked wheel, ``--liger-src``); vLLM's ``fused_moe`` Triton kernel with its shipped tuned configs (from an
  unpacked wheel, ``--vllm-src``, through ``_vllm_stubs``, whose stand-ins for vLLM's compiled ops are one kernel
  each), and the same vLLM call with its block alignment computed outside the timed region
  (``vllm_triton_kernels_only``: a lower bound on a vLLM install's time); FlashInfer's CUTLASS fused MoE
  (TensorRT-LLM's kernels, ``flashinfer_cutlass``, from the folder ``flashinfer_carry.sh`` installs,
  ``--flashinfer-site``). A peer whose files are absent is skipped with a note.
- ours: ``nxd_moe.MoE`` on the torch backend (the layer's own mode choice; at prefill also block size 16, and
  forced modes where a case lists them) and on ``backend="triton"`` when it is registered and imports.

The layer functions are described in ``_gpu_peers.py``; cases in ``CASES`` below.

Measured
--------
- Roofline, at the start of the run in its own process: device copy bandwidth (read + write of a 1 GiB copy) and
  dense bf16 matmul TFLOP/s (8192^3).
- Per contender: median time per layer call in eager mode and as a CUDA-graph replay (CUDA events, warm-up
  first, median of many samples; p10/p90 kept). Each sample runs the layer on ``R`` different inputs (different
  routings: the weights one call touches are mostly not the next call's, so the L2 cache (50 MB on H100) does not
  serve weights a real decode step would read from HBM), and reports the time per call. The graph holds the same
  ``R`` calls. Contenders with a host sync (HF eager, Liger) have eager times only.
- Correctness in the same run: relative error ``||out - ref|| / ||ref||`` against a float64 evaluation of the same
  function on the same routing (``_gpu_peers.reference``).
- ``touched`` bytes: the weights of the experts the routing hits (averaged over the ``R`` inputs) plus the shared
  expert; ``useful`` FLOPs: ``2 * T * (k * 3 * H * I + 3 * H * I_s + H * E)``. Reported: TFLOP/s, TB/s on touched
  weights, the ratio to the best peer (best peer time / time: > 1 is faster than every peer) and to the roofline
  (roofline time / time, where roofline time = max(touched / copy bandwidth, FLOPs / matmul rate)).

Output: one JSON (``--out``), and a short table on stdout, printed last. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

DEFAULT_VLLM_SRC = ROOT / ".peers" / "vllm_src"
DEFAULT_LIGER_SRC = ROOT / ".peers"
DEFAULT_FLASHINFER_SITE = ROOT / ".peers" / "flashinfer" / "site"
SCHEMA_VERSION = 1
CORRECT_REL_ERR = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}


@dataclass(frozen=True)
class Case:
    """One shape. ``tokens`` = T; decode runs them as ``(T, 1, H)`` (S = 1), prefill as one ``(1, T, H)``
    sequence. ``routing="balanced"`` sends token t to expert ``(t + r) % E`` on input r (k = 1), so every expert
    gets exactly T / E rows: the grouped GEMMs then have the shapes of a published table (``quoted``)."""

    name: str
    group: str
    tokens: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    decode: bool
    function: str = "softmax_glu"
    shared_intermediate: int | None = None
    routing: str = "random"
    modes: tuple[str, ...] = ()
    quick: bool = False
    quoted: dict | None = None


QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)
SCOUT_TP8 = dict(num_experts=16, top_k=1, hidden=5120, intermediate=1024)
MAVERICK_TP8 = dict(num_experts=128, top_k=1, hidden=5120, intermediate=1024)
FORCED = ("selective_loading", "all_experts")
METASHUFFLING = "MetaShuffling blog (PyTorch, 2025), H100 BF16 GroupedGEMM table: GEMM13 + GEMM2 only, no routing"

CASES = [
    # the table (the same dims as shared/peers/gpu_project_vs_peers.py)
    Case("qwen3-30b-a3b-decode-m1", "issue", 1, decode=True, quick=True, **QWEN3),
    Case("mixtral-8x7b-decode-m1", "issue", 1, decode=True, quick=True, **MIXTRAL),
    Case("qwen3-30b-a3b-decode-m32", "issue", 32, decode=True, modes=FORCED, **QWEN3),
    Case("llama4-scout-tp8-decode-m64", "issue", 64, decode=True, modes=FORCED, **SCOUT_TP8),
    Case("deepseek-v3-decode-m16", "issue", 16, decode=True, modes=FORCED, num_experts=256, top_k=8, hidden=7168,
         intermediate=2048),
    Case("qwen3-30b-a3b-prefill-m4096", "issue", 4096, decode=False, quick=True, **QWEN3),
    Case("gpt-oss-20b-prefill-m4096", "issue", 4096, decode=False, num_experts=32, top_k=4, hidden=2880,
         intermediate=2880),
    Case("mixtral-8x7b-prefill-m4096", "issue", 4096, decode=False, **MIXTRAL),
    # Llama 4 Scout with its shared expert: sigmoid top-1 router, early affinity modulation
    Case("llama4-scout-tp8-shared-decode-m64", "llama4", 64, decode=True, function="llama4", shared_intermediate=1024,
         quick=True, quoted={"source": "MetaShuffling blog: whole Llama 4 Scout decode MoE layer (TP8 shard, shared "
                                       "expert, 64 tokens) on H100", "us": 197.456}, **SCOUT_TP8),
    Case("llama4-scout-shared-decode-m64", "llama4", 64, decode=True, function="llama4", shared_intermediate=8192,
         num_experts=16, top_k=1, hidden=5120, intermediate=8192),
    # one token: the decode rule's one-wave fused items (launch_configs) at top-1 with a shared expert
    Case("llama4-scout-shared-decode-m1", "llama4", 1, decode=True, function="llama4", shared_intermediate=8192,
         num_experts=16, top_k=1, hidden=5120, intermediate=8192),
    # the MetaShuffling GroupedGEMM table as layers: balanced top-1 routing gives exactly its GEMM shapes
    Case("metashuffling-scout-tp8-prefill-g16m1024", "metashuffling", 16384, decode=False, routing="balanced",
         quoted={"source": METASHUFFLING, "us": 523.85 + 294.95}, **SCOUT_TP8),
    Case("metashuffling-maverick-tp8-prefill-g128m128", "metashuffling", 16384, decode=False, routing="balanced",
         quoted={"source": METASHUFFLING, "us": 975.41 + 510.78}, **MAVERICK_TP8),
    Case("metashuffling-scout-tp8-decode-g16m8", "metashuffling", 128, decode=True, routing="balanced",
         quoted={"source": METASHUFFLING, "us": 112.54 + 60.00}, **SCOUT_TP8),
    Case("metashuffling-maverick-tp8-decode-g128m1", "metashuffling", 128, decode=True, routing="balanced",
         quoted={"source": METASHUFFLING, "us": 861.22 + 433.15}, **MAVERICK_TP8),
    # M sweep: decode batches of 16 and 128, a 1024-token prefill chunk
    Case("qwen3-30b-a3b-decode-m16", "sweep", 16, decode=True, **QWEN3),
    Case("qwen3-30b-a3b-decode-m128", "sweep", 128, decode=True, **QWEN3),
    Case("qwen3-30b-a3b-prefill-m1024", "sweep", 1024, decode=False, **QWEN3),
    Case("mixtral-8x7b-decode-m16", "sweep", 16, decode=True, **MIXTRAL),
    Case("mixtral-8x7b-decode-m128", "sweep", 128, decode=True, **MIXTRAL),
    Case("mixtral-8x7b-prefill-m1024", "sweep", 1024, decode=False, **MIXTRAL),
]

# Tiny shapes for a CPU smoke run (``--device cpu``; Triton peers need TRITON_INTERPRET=1 there).
SMOKE_CASES = [
    Case("smoke-decode-m3", "smoke", 3, decode=True, num_experts=8, top_k=2, hidden=64, intermediate=96,
         modes=FORCED),
    Case("smoke-prefill-m33", "smoke", 33, decode=False, num_experts=8, top_k=2, hidden=64, intermediate=96),
    Case("smoke-llama4-shared-decode-m4", "smoke", 4, decode=True, function="llama4", shared_intermediate=64,
         num_experts=4, top_k=1, hidden=64, intermediate=96),
    Case("smoke-balanced-prefill-m16", "smoke", 16, decode=False, routing="balanced", num_experts=8, top_k=1,
         hidden=64, intermediate=32),
]
ALL_CASES = {case.name: case for case in CASES + SMOKE_CASES}


# =========================================================================================================
# Child process: one case
# =========================================================================================================

def make_problem(case: Case, dtype, device, rotations: int, seed: int):
    """The case's weights and its ``rotations`` inputs. Weights are N(0, 1/fan_in): outputs stay O(1)."""
    import torch
    from _gpu_peers import Problem

    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, device=device, dtype=dtype) / math.sqrt(fan_in))

    e, k, h, i = case.num_experts, case.top_k, case.hidden, case.intermediate
    gate_up = torch.empty(e, 2 * i, h, device=device, dtype=dtype)
    down = torch.empty(e, h, i, device=device, dtype=dtype)
    for expert in range(e):  # one expert at a time: no full-size float32 temporary
        gate_up[expert] = normal(2 * i, h, fan_in=h)
        down[expert] = normal(h, i, fan_in=i)
    inputs = [torch.randn(case.tokens, h, generator=gen, device=device, dtype=dtype) for _ in range(rotations)]
    if case.routing == "balanced":
        if k != 1:
            raise ValueError(f"{case.name}: balanced routing is top-1")
        router = torch.zeros(e, h, device=device)
        router[:, :e] = torch.eye(e, device=device)  # logit e = feature e of the token
        tokens = torch.arange(case.tokens, device=device)
        for r, x in enumerate(inputs):
            x[:, :e] = 0
            x[tokens, (tokens + r) % e] = 8.0
    else:
        router = torch.randn(e, h, generator=gen, device=device) / math.sqrt(h)
    shared = (None, None)
    if case.shared_intermediate:
        s = case.shared_intermediate
        shared = (normal(2 * s, h, fan_in=h), normal(h, s, fan_in=s))
    return Problem(case.function, k, gate_up, down, router, *shared), inputs


def problem_sizes(case: Case, problem, inputs) -> dict:
    """Touched weight bytes (mean over the inputs), useful FLOPs, experts hit."""
    import torch

    per_expert = (problem.gate_up[0].numel() + problem.down[0].numel()) * problem.gate_up.element_size()
    hits = [int(torch.unique(problem.route(x)[1]).numel()) for x in inputs]
    shared_bytes = 0 if problem.shared_gate_up is None else (
        (problem.shared_gate_up.numel() + problem.shared_down.numel()) * problem.gate_up.element_size())
    s = case.shared_intermediate or 0
    flop = 2 * case.tokens * (case.top_k * 3 * case.hidden * case.intermediate + 3 * case.hidden * s
                              + case.hidden * case.num_experts)
    return {"experts_hit": statistics.mean(hits), "experts_hit_per_input": hits,
            "touched_weight_bytes": statistics.mean(hits) * per_expert + shared_bytes,
            "all_weight_bytes": case.num_experts * per_expert + shared_bytes, "useful_flop": flop}


class Timer:
    """Median time per call of ``layer`` over the rotated inputs, eager or CUDA-graph replay."""

    def __init__(self, device, target_s: float, min_samples: int, max_samples: int, warmup: int):
        self.device, self.target_s = device, target_s
        self.min_samples, self.max_samples, self.warmup = min_samples, max_samples, warmup

    def _sample_s(self, run) -> float:
        import torch

        if self.device.type != "cuda":
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _measure(self, run, calls: int) -> dict:
        first = min(self._sample_s(run) for _ in range(max(1, self.warmup)))
        samples = max(self.min_samples, min(self.max_samples, int(self.target_s / max(first, 1e-6))))
        per_call_us = sorted(self._sample_s(run) / calls * 1e6 for _ in range(samples))
        q = statistics.quantiles(per_call_us, n=10) if len(per_call_us) > 1 else per_call_us * 9
        return {"us": statistics.median(per_call_us), "p10_us": q[0], "p90_us": q[-1], "samples": samples}

    def eager(self, layer, inputs) -> dict:
        import torch

        def run():
            with torch.no_grad():
                for x in inputs:
                    layer(x)
        return self._measure(run, len(inputs))

    def graph(self, layer, inputs) -> dict:
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(2):
                for x in inputs:
                    layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, stream=stream):  # the warm-up's stream (nxd_moe.graphs)
            for x in inputs:
                layer(x)
        try:
            return self._measure(graph.replay, len(inputs))
        finally:
            del graph


def time_layer(timer: Timer, layer, inputs, row: dict, graph: bool) -> None:
    """``row["eager"]`` and, if ``graph``, ``row["graph"]`` (or ``row["graph_error"]``)."""
    import torch

    row["eager"] = timer.eager(layer, inputs)
    if not graph:
        return
    try:
        row["graph"] = timer.graph(layer, inputs)
    except Exception as exc:  # recorded, not hidden: e.g. a host sync inside the layer
        row["graph_error"] = _error(exc)
        try:
            torch.cuda.synchronize()
        except Exception as sync_exc:
            row["graph_error"] += f" (device unusable after it: {_error(sync_exc)})"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def contenders(case: Case, problem, args, device, dtype):
    """Yield the case's contenders one at a time (ours last: they hold a second copy of the weights), or
    ``(name, why skipped)`` pairs."""
    from _gpu_peers import (
        backend_available,
        build_ours,
        flashinfer_contender,
        flashinfer_unavailable,
        grouped_mm_contender,
        hf_contenders,
        liger_contender,
        ours_contender,
        vllm_contender,
        vllm_kernels_only_contender,
    )

    triton_ok = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    yield "torch_grouped_mm", lambda: grouped_mm_contender(problem)
    try:
        hf = hf_contenders(problem, case.tokens, case.decode, args.batched_mm_limit_gib * 2**30)
    except ImportError as exc:
        hf = []
        yield "hf_grouped_mm", f"skipped: transformers' experts do not import: {_error(exc)}"
    for contender in hf:
        yield contender.name, (lambda c=contender: c)
    if not triton_ok:
        yield "liger", "skipped: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"
        yield "vllm_triton", "skipped: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    else:
        liger_src = args.liger_src if args.liger_src and os.path.isdir(os.path.join(args.liger_src, "liger_kernel")) \
            else None
        if liger_src is None and importlib.util.find_spec("liger_kernel") is None:
            yield "liger", f"skipped: no liger_kernel/ under --liger-src {args.liger_src!r} and none installed"
        else:
            yield "liger", lambda: liger_contender(problem, liger_src, args.liger_autotune)
        if args.vllm_src and os.path.isdir(args.vllm_src):
            yield "vllm_triton", lambda: vllm_contender(problem, args.vllm_src, case.tokens)
            yield "vllm_triton_kernels_only", lambda: vllm_kernels_only_contender(problem, args.vllm_src, case.tokens)
        else:
            yield "vllm_triton", f"skipped: no unpacked vLLM source at --vllm-src {args.vllm_src!r}"

    # triton first: the headline contender runs before anything else of ours could upset the device
    backends = ["torch"]
    why = backend_available("triton")
    if why is None and not triton_ok:
        why = "Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    if why is None:
        backends.insert(0, "triton")
    block_sizes = [None] if case.decode else [None, 16]
    built = {}

    def layer(backend, block):  # one weight copy for all of ours: the first layer built lends its tensors
        if (backend, block) not in built:
            share = next(iter(built.values()), None)
            built[backend, block] = build_ours(problem, backend, block, dtype, device, share_with=share)
        return built[backend, block]

    for backend in backends:
        base = f"nxd_{backend}"
        for block in block_sizes if backend == "torch" else [None]:
            name = base if block is None else f"{base}_bs{block}"
            yield name, (lambda backend=backend, block=block, name=name:
                         ours_contender(layer(backend, block), name, case.decode))
            for mode in case.modes:
                yield f"{name}_{mode}", (lambda backend=backend, block=block, name=name, mode=mode:
                                         ours_contender(layer(backend, block), f"{name}_{mode}", case.decode, mode))
    if why is not None:
        yield "nxd_triton", f"skipped: {why}"
    # FlashInfer last: a fault in its carried, partly built module (an aborting left-out instantiation, a CUDA
    # error) ends the case's process, and what ran before it is kept
    why_not_flashinfer = ("its CUTLASS kernels need CUDA" if device.type != "cuda"
                          else flashinfer_unavailable(args.flashinfer_site))
    if why_not_flashinfer is None:
        yield "flashinfer_cutlass", lambda: flashinfer_contender(problem, args.flashinfer_autotune)
    else:
        yield "flashinfer_cutlass", f"skipped: {why_not_flashinfer}"


def run_case(case: Case, args) -> None:
    """Run one case in this process; rewrite ``args.child_out`` after every contender (a crash or a timeout
    keeps what was measured)."""
    import torch
    from _gpu_peers import reference

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rotations = args.rotations or (4 if case.decode else 2)
    result = {"case": dataclasses.asdict(case), "rotations": rotations, "contenders": {}}

    def save():
        Path(args.child_out).write_text(json.dumps(result))

    started = time.perf_counter()
    problem, inputs = make_problem(case, dtype, device, rotations, args.seed)
    result.update(problem_sizes(case, problem, inputs))
    ref = reference(problem, inputs[0])
    result["reference_s"] = round(time.perf_counter() - started, 2)
    save()
    timer = Timer(device, args.target_s, args.min_samples, args.max_samples, args.warmup)
    wanted = set(args.impls.split(",")) if args.impls else None
    for name, make in contenders(case, problem, args, device, dtype):
        if wanted is not None and name not in wanted and not any(name.startswith(w + "_") for w in wanted):
            continue
        row = result["contenders"].setdefault(name, {})
        if isinstance(make, str):
            row["skipped"] = make
            save()
            continue
        t0 = time.perf_counter()
        print(f"  {case.name}: {name}", file=sys.stderr, flush=True)
        try:
            contender = make()
            row.update(kind=contender.kind, what=contender.what)
            if contender.note:
                row["note"] = contender.note
            if contender.layer is None:
                row["skipped"] = contender.note
                continue
            describe = contender.info.pop("describe", None)
            row.update(contender.info)
            with torch.no_grad():
                out = contender.layer(inputs[0]).double()
                if describe is not None:
                    row.update(describe(inputs[0]))
            err = (out - ref).norm() / ref.norm()
            row.update(rel_err=float(err), max_abs_err=float((out - ref).abs().max()),
                       finite=bool(torch.isfinite(out).all()))
            row["correct"] = row["finite"] and row["rel_err"] <= CORRECT_REL_ERR.get(args.dtype, 2e-2)
            del out
            time_layer(timer, contender.layer, inputs, row, device.type == "cuda" and contender.graphable)
            for part, layer in contender.parts.items():
                time_layer(timer, layer, inputs, row.setdefault("parts", {}).setdefault(part, {}),
                           device.type == "cuda")
        except Exception as exc:
            row["error"] = _error(exc)
        finally:
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            contender = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
    result["wall_s"] = round(time.perf_counter() - started, 2)
    save()


def measure_roofline(args) -> None:
    """Device copy bandwidth and bf16 matmul rate, plus the environment, into ``args.child_out``."""
    import torch

    device = torch.device(args.device)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    for package in ("triton", "transformers"):
        try:
            env[package] = importlib.import_module(package).__version__
        except ImportError:
            env[package] = None
    roof = {}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), capability=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
        timer = Timer(device, target_s=0.3, min_samples=20, max_samples=200, warmup=5)
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_us = timer.eager(lambda x: dst.copy_(src), [None])["us"]
        del src, dst
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        mm_us = timer.eager(lambda x: a @ b, [None])["us"]
        roof = {"copy_TBps": 2 * (1 << 30) / copy_us / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_us / 1e6,
                "copy_bytes": 2 * (1 << 30), "matmul": "bf16 8192x8192x8192, random data"}
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["note"] = "CPU run: a smoke test of the harness, not a performance measurement"
    Path(args.child_out).write_text(json.dumps({"environment": env, "roofline": roof}))


# =========================================================================================================
# Parent process: run cases, combine, report
# =========================================================================================================

def _child(args, what: str, timeout_s: float) -> tuple[dict | None, str | None]:
    """Run ``what`` (a case name or ``--roofline``) in a fresh interpreter; its JSON, and why it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *args.passthrough, "--child-out", out]
    cmd += ["--roofline-only"] if what == "--roofline" else ["--run-case", what]
    problem = None
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            problem = f"exit code {proc.returncode}: {proc.stderr.strip()[-600:]}"
    except subprocess.TimeoutExpired:
        problem = f"timed out after {timeout_s:.0f} s (what it measured before is kept)"
    try:
        data = json.loads(Path(out).read_text()) if Path(out).stat().st_size else None
    except (OSError, ValueError):
        data = None
    finally:
        Path(out).unlink(missing_ok=True)
    return data, problem


def _best(row: dict) -> tuple[float | None, str | None]:
    """The contender's headline time: graph replay where it has one, else eager."""
    if "graph" in row:
        return row["graph"]["us"], "graph"
    if "eager" in row:
        return row["eager"]["us"], "eager"
    return None, None


def derive(case_result: dict, roofline: dict) -> None:
    """Add throughput and ratios to every contender of one case (in place)."""
    touched, flop = case_result.get("touched_weight_bytes"), case_result.get("useful_flop")
    floor_us = None
    if roofline and touched is not None:
        floor_us = max(touched / (roofline["copy_TBps"] * 1e6), flop / (roofline["bf16_matmul_TFLOPs"] * 1e6))
        case_result["roofline_us"] = floor_us
    rows = case_result["contenders"]
    for row in rows.values():
        row["time_us"], row["timing"] = _best(row)
        for part in row.get("parts", {}).values():
            part["time_us"], part["timing"] = _best(part)
        if row["time_us"]:
            row["TFLOPs"] = flop / row["time_us"] / 1e6
            row["TBps_touched"] = touched / row["time_us"] / 1e6
            if floor_us:
                row["vs_roofline"] = floor_us / row["time_us"]
    peers = {name: row["time_us"] for name, row in rows.items()
             if row.get("kind") == "peer" and row.get("time_us") and row.get("correct")}
    if peers:
        best = min(peers, key=peers.get)
        case_result["best_peer"], case_result["best_peer_us"] = best, peers[best]
        for row in rows.values():
            if row.get("time_us"):
                row["vs_best_peer"] = peers[best] / row["time_us"]


def table(result: dict) -> str:
    """Per case: roofline, best peer, our torch and triton backends (time, x best peer, % of roofline)."""
    def cell(row):
        if not row or not row.get("time_us"):
            return "-"
        flag = "" if row.get("correct") else " WRONG"
        pct = f" {100 * row['vs_roofline']:.0f}%rf" if row.get("vs_roofline") else ""
        ratio = f" x{row['vs_best_peer']:.2f}" if row.get("vs_best_peer") else ""
        return f"{row['time_us']:.0f}{'g' if row['timing'] == 'graph' else 'e'}{ratio}{pct}{flag}"

    lines = [f"{'case':44s} {'roofline':>9s} {'best peer (us)':>26s}  {'nxd_torch':>24s}  {'nxd_triton':>24s}"]
    for name, c in result["cases"].items():
        if "contenders" not in c:
            lines.append(f"{name:44s} {c.get('error', 'not run')}")
            continue
        rows = c["contenders"]
        best = f"{c['best_peer']} {c['best_peer_us']:.0f}" if c.get("best_peer") else "-"
        roof = f"{c['roofline_us']:.0f}" if c.get("roofline_us") else "-"
        lines.append(f"{name:44s} {roof:>9s} {best:>26s}  {cell(rows.get('nxd_torch')):>24s}  "
                     f"{cell(rows.get('nxd_triton')):>24s}")
    lines.append("us per layer call; g = CUDA-graph replay, e = eager; xN = best peer time / ours; %rf = roofline "
                 "time / ours")
    return "\n".join(lines)


GROUP_TITLES = {"issue": "Issue 9's shapes", "llama4": "Llama 4 Scout decode with its shared expert",
                "metashuffling": "MetaShuffling's GroupedGEMM shapes (balanced top-1 routing)",
                "sweep": "Qwen3-30B-A3B and Mixtral-8x7B at M = 16, 128, 1024", "smoke": "Smoke shapes"}
# issue 9's targets: prefill M=4096 speedups over the best peer, decode share of copy bandwidth, Llama 4 time
PREFILL_TARGETS = {"qwen3-30b-a3b-prefill-m4096": 1.5, "gpt-oss-20b-prefill-m4096": 1.3,
                   "mixtral-8x7b-prefill-m4096": 1.1}
DECODE_BANDWIDTH_TARGET, LLAMA4_TARGET_US = 0.85, 185.0
# issue 19: an eager (not graphed) decode call within this factor of the graphed time plus this allowance
EAGER_FACTOR, EAGER_ALLOWANCE_US = 1.5, 50.0


def markdown(result: dict) -> str:
    """The run as Markdown tables for docs/performance.md: every number is read from ``result``."""
    env, roof = result.get("environment", {}), result.get("roofline", {})
    copy = roof.get("copy_TBps")
    lines = [f"Run: {result.get('date')}, commit {result.get('git_commit')}, {env.get('gpu', env.get('device'))}, "
             f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
             f"wall {result.get('wall_s')} s. Measured in the run: copy "
             + (f"{copy:.2f} TB/s, bf16 matmul {roof['bf16_matmul_TFLOPs']:.0f} TFLOP/s." if copy else "none (CPU).")
             , ""]

    def us(row):
        if not row:
            return "—"
        if row.get("error"):
            return "error"
        if not row.get("time_us"):
            return "—"
        eager_only = "" if row["timing"] == "graph" else " (e)"
        return f"{row['time_us']:.0f}{eager_only}{'' if row.get('correct') else ' WRONG'}"

    def best_of(rows, prefix):
        found = [r for n, r in rows.items() if n.startswith(prefix) and r.get("time_us") and r.get("correct")]
        return min(found, key=lambda r: r["time_us"]) if found else None

    groups = {}
    for name, c in result["cases"].items():
        groups.setdefault(c.get("case", {}).get("group", "other"), []).append((name, c))
    for group, cases in groups.items():
        lines += [f"### {GROUP_TITLES.get(group, group)}", "",
                  "| case | touched MB | GFLOP | roofline us | vLLM | vLLM kernels only | Liger | FlashInfer | "
                  "HF best | grouped_mm | nxd torch | nxd triton | triton / best peer | triton % roofline | "
                  "triton TB/s | triton TFLOP/s |",
                  "|" + " --- |" * 16]
        for name, c in cases:
            if "contenders" not in c:
                lines.append(f"| {name} | {c.get('error', 'not run')} |" + " |" * 14)
                continue
            rows = c["contenders"]
            tri = rows.get("nxd_triton", {})
            torch_cell = us(rows.get("nxd_torch")) + (f" / {us(rows['nxd_torch_bs16'])} (bs16)"
                                                       if "nxd_torch_bs16" in rows else "")
            lines.append("| " + " | ".join([
                name, f"{c['touched_weight_bytes'] / 1e6:.0f}", f"{c['useful_flop'] / 1e9:.1f}",
                f"{c['roofline_us']:.0f}" if c.get("roofline_us") else "—", us(rows.get("vllm_triton")),
                us(rows.get("vllm_triton_kernels_only")), us(rows.get("liger")), us(rows.get("flashinfer_cutlass")),
                us(best_of(rows, "hf_")),
                us(rows.get("torch_grouped_mm")), torch_cell, us(tri),
                f"{tri['vs_best_peer']:.2f}x" if tri.get("vs_best_peer") else "—",
                f"{100 * tri['vs_roofline']:.0f}%" if tri.get("vs_roofline") else "—",
                f"{tri['TBps_touched']:.2f}" if tri.get("TBps_touched") else "—",
                f"{tri['TFLOPs']:.0f}" if tri.get("TFLOPs") else "—"]) + " |")
        lines += ["", "us per layer call, CUDA-graph replay unless (e) = eager only; HF best = fastest correct "
                  "transformers implementation.", ""]
    lines += ["### Targets", "", "| target | measured | met? |", "| --- | --- | --- |"]
    cases = result["cases"]

    def triton(name):
        return cases.get(name, {}).get("contenders", {}).get("nxd_triton", {})

    decode = [(n, triton(n)) for n, c in cases.items()
              if c.get("case", {}).get("decode") and c["case"]["tokens"] <= 64 and c["case"]["group"] != "smoke"]
    shares = [(n, r["TBps_touched"] / copy) for n, r in decode if r.get("TBps_touched") and copy]
    if shares:
        worst = min(shares, key=lambda s: s[1])
        lines.append(f"| decode M <= 64: >= {DECODE_BANDWIDTH_TARGET:.0%} of copy bandwidth on touched weights | "
                     f"worst {worst[1]:.0%} ({worst[0]}) | {'yes' if worst[1] >= DECODE_BANDWIDTH_TARGET else 'no'} |")
    eager = [(n, r["eager"]["us"], r["graph"]["us"], cases[n]["contenders"].get("vllm_triton", {}).get("eager", {}))
             for n, r in decode if "eager" in r and "graph" in r]
    if eager:
        worst = max(eager, key=lambda e: e[1] / (EAGER_FACTOR * e[2] + EAGER_ALLOWANCE_US))
        lines.append(f"| eager decode <= {EAGER_FACTOR}x the graphed time + {EAGER_ALLOWANCE_US:.0f} us | worst "
                     f"{worst[1]:.0f} us eager vs {worst[2]:.0f} us graphed ({worst[0]}) | "
                     f"{'yes' if worst[1] <= EAGER_FACTOR * worst[2] + EAGER_ALLOWANCE_US else 'no'} |")
        versus = [(n, e / v["us"]) for n, e, _, v in eager if v.get("us")]
        if versus:
            slowest = max(versus, key=lambda v: v[1])
            lines.append(f"| eager decode faster than vLLM's eager call | worst {slowest[1]:.2f}x its time "
                         f"({slowest[0]}) | {'yes' if slowest[1] < 1 else 'no'} |")
    llama = triton("llama4-scout-tp8-shared-decode-m64")
    if llama.get("time_us"):
        lines.append(f"| Llama 4 Scout TP8 decode layer with shared expert <= {LLAMA4_TARGET_US:.0f} us | "
                     f"{llama['time_us']:.0f} us | {'yes' if llama['time_us'] <= LLAMA4_TARGET_US else 'no'} |")
    for name, target in PREFILL_TARGETS.items():
        r = triton(name)
        if r.get("vs_best_peer"):
            lines.append(f"| {name}: >= {target}x the best peer ({cases[name].get('best_peer')}) | "
                         f"{r['vs_best_peer']:.2f}x | {'yes' if r['vs_best_peer'] >= target else 'no'} |")
    ratios = [(n, c["contenders"]["nxd_triton"]["vs_best_peer"]) for n, c in cases.items()
              if c.get("contenders", {}).get("nxd_triton", {}).get("vs_best_peer")]
    if ratios:
        worst = min(ratios, key=lambda r: r[1])
        lines.append(f"| never slower than the best peer | slowest {worst[1]:.2f}x ({worst[0]}) | "
                     f"{'yes' if worst[1] >= 1 else 'no'} |")
    return "\n".join(lines)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def selected_cases(args) -> list[Case]:
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]

        def picked(case: Case, name: str) -> bool:  # a full case name picks that case alone
            return name == case.group or (name == case.name if name in ALL_CASES else name in case.name)

        unknown = [n for n in names if not any(picked(c, n) for c in ALL_CASES.values())]
        if unknown:
            raise SystemExit(f"--cases: unknown {unknown}; known: {sorted(ALL_CASES)} and the groups "
                             f"{sorted({c.group for c in ALL_CASES.values()})}")
        return [c for c in ALL_CASES.values() if any(picked(c, n) for n in names)]
    pool = SMOKE_CASES if args.device == "cpu" else CASES
    return [c for c in pool if c.quick] if args.quick and args.device != "cpu" else list(pool)


def main_parent(args) -> dict:
    started = time.perf_counter()
    cases = selected_cases(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gpu_layer", "schema_version": SCHEMA_VERSION,
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": _git_commit(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                       if k not in ("passthrough", "child_out", "run_case", "roofline_only")},
              "method": __doc__.split("Measured\n--------\n")[1].split("\nOutput:")[0].strip(), "cases": {}}
    print(f"gpu_layer: roofline, then {len(cases)} case(s), budget {args.budget_s:.0f} s", file=sys.stderr, flush=True)
    roof, problem = _child(args, "--roofline", timeout_s=120)
    result.update(roof or {"environment": {}, "roofline": {}})
    if problem:
        result["roofline_error"] = problem
    for case in cases:
        left = args.budget_s - (time.perf_counter() - started)
        if left < 15:
            result["cases"][case.name] = {"error": "skipped: --budget-s exhausted"}
            continue
        print(f"[{time.perf_counter() - started:5.0f} s] {case.name}", file=sys.stderr, flush=True)
        data, problem = _child(args, case.name, timeout_s=min(args.case_timeout_s, left))
        entry = data or {"case": dataclasses.asdict(case)}
        if problem:
            entry["error"] = problem
        if "contenders" in entry:
            derive(entry, result["roofline"])
        result["cases"][case.name] = entry
        if args.out:  # keep a partial file while running
            Path(args.out).write_text(json.dumps(result, indent=1))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["headline"] = [
        {"case": name, "contender": cname, "time_us": row.get("time_us"), "timing": row.get("timing"),
         "vs_best_peer": row.get("vs_best_peer"), "vs_roofline": row.get("vs_roofline"),
         "TBps_touched": row.get("TBps_touched"), "TFLOPs": row.get("TFLOPs"), "rel_err": row.get("rel_err"),
         "correct": row.get("correct")}
        for name, c in result["cases"].items() for cname, row in c.get("contenders", {}).items()
        if row.get("time_us")]
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout before the table)")
    p.add_argument("--cases", default=None,
                   help="comma list of case names, name substrings or groups (issue, llama4, metashuffling, sweep, "
                        "smoke); default: all but smoke on cuda, smoke on cpu")
    p.add_argument("--impls", default=None,
                   help="comma list of contenders to run (e.g. nxd_triton,vllm_triton; a name also selects its "
                        "forced-mode variants)")
    p.add_argument("--quick", action="store_true",
                   help="fewer samples, and only the cases marked quick (decode m1, Qwen3 prefill, Llama 4 shared)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test of the harness)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--vllm-src", default=str(DEFAULT_VLLM_SRC) if DEFAULT_VLLM_SRC.is_dir() else None,
                   help="unpacked vLLM wheel root (holds vllm/model_executor/layers/fused_moe/fused_moe.py); "
                        "default .peers/vllm_src when present")
    p.add_argument("--liger-src", default=str(DEFAULT_LIGER_SRC) if (DEFAULT_LIGER_SRC / "liger_kernel").is_dir()
                   else None, help="folder holding an unpacked liger_kernel/ (default .peers when present); "
                                   "else an installed liger_kernel is used if any")
    p.add_argument("--liger-autotune", action="store_true",
                   help="let Liger autotune (about a minute per shape on first call); default: its pinned config")
    p.add_argument("--flashinfer-site", default=str(DEFAULT_FLASHINFER_SITE),
                   help="folder holding flashinfer (installed by benchmarks/flashinfer_carry.sh; default "
                        ".peers/flashinfer/site), put first on sys.path; else an installed flashinfer is used if any")
    p.add_argument("--flashinfer-autotune", action="store_true",
                   help="let FlashInfer's autotuner profile its tactics on the first call; default: its default tactic")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new cases after this (default 480)")
    p.add_argument("--case-timeout-s", type=float, default=150.0, help="kill one case's process after this")
    p.add_argument("--rotations", type=int, default=None, help="inputs per sample (default 4 decode, 2 prefill)")
    p.add_argument("--target-s", type=float, default=None, help="timing time per contender and mode (default 0.2)")
    p.add_argument("--min-samples", type=int, default=None, help="default 10 (5 with --quick)")
    p.add_argument("--max-samples", type=int, default=200)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batched-mm-limit-gib", type=float, default=8.0,
                   help="skip HF batched_mm where its gathered weights exceed this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", default=None, metavar="JSON",
                   help="print a finished run's JSON as Markdown tables (for docs/performance.md) and exit")
    p.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--roofline-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.target_s = args.target_s if args.target_s is not None else (0.08 if args.quick else 0.2)
    args.min_samples = args.min_samples if args.min_samples is not None else (5 if args.quick else 10)
    # what a child process needs to see of the parent's options
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])
                        if a not in ("--quick",)] + (["--quick"] if args.quick else [])
    args.passthrough = _strip_options(args.passthrough, ("--out", "--cases", "--budget-s", "--case-timeout-s"))
    return args


def _strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.roofline_only:
        measure_roofline(args)
        return 0
    if args.run_case:
        run_case(ALL_CASES[args.run_case], args)
        return 0
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("gpu_layer: --device cuda but torch sees no CUDA device (use --device cpu for a smoke "
                             "test)")
    result = main_parent(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        print(text)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
