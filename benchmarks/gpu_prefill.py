"""Prefill GEMMs on one GPU: the persistent TMA kernels (``prefill_gemm.py``) against the tile-per-program kernels.

For the prefill cases of ``gpu_layer.py`` (same dims, same weight and input distributions, the same fp32 softmax
router), on one routing of ``T`` tokens:

- per kernel, CUDA-graph replay: the previous path (``old``: ``grouped_gemm.gate_up_projection`` /
  ``down_projection`` with the shipped launch config) and each ``--variants`` entry of the persistent path (the rule
  ``default_prefill_config``'s persistent entry plus overrides: A-tile source, output by TMA, flattened or not,
  warp specialisation, stages, tiles): gate/up
  (the row permutation included where the variant permutes), down, and their sum; relative error of the rows
  against the old path's;
- the roofline of each GEMM in the same run: a dense ``torch.mm`` with the same FLOPs (``T*k`` rows), and the
  dense bf16 matmul rate (8192^3, as ``gpu_layer.py``);
- ``--layer``: the whole ``MoE`` layer (router, routing, metadata, GEMMs, combine) on the triton backend with and
  without the persistent path, CUDA-graph replay, plus a torch-profiler breakdown of device time per kernel.

Output: JSON (``--out``) and a table on stdout, printed last.

    PYTHONPATH=. python3 benchmarks/gpu_prefill.py --out $OUT/gpu_prefill.json --layer
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

CASES = ("qwen3-30b-a3b-prefill-m4096", "gpt-oss-20b-prefill-m4096", "mixtral-8x7b-prefill-m4096")

# Per GEMM: None = the tile-per-program kernel with the shipped launch config ("old"), else overrides of
# default_prefill_config's entry. "isolate": run in a child process with a timeout (warp specialisation: a hang
# must not take the run with it).
GATE_UP_VARIANTS = {
    "old": None,
    "persistent": {},
    "noflat": {"FLATTEN": False},
    "st3": {"num_stages": 3},
    "n64": {"BLOCK_N": 64},
    "out_st3": {"OUT_TMA": True, "num_stages": 3},
    "atma_out": {"A_TMA": True, "OUT_TMA": True, "num_stages": 3},
    "ws": {"A_TMA": True, "WARP_SPECIALIZE": True, "num_warps": 4, "isolate": True},
}
DOWN_VARIANTS = {
    "old": None,
    "persistent": {},
    "noflat": {"FLATTEN": False},
    "st3": {"num_stages": 3},
    "out_st3": {"OUT_TMA": True, "num_stages": 3},
    "n128": {"BLOCK_N": 128},
    "ws": {"WARP_SPECIALIZE": True, "num_warps": 4, "isolate": True},
}
VARIANTS = {"gate_up": GATE_UP_VARIANTS, "down": DOWN_VARIANTS}


def graph_time_us(fn, repeats: int = 10, samples: int = 7) -> float:
    """Median device time per call of ``fn`` replayed from a CUDA graph (``repeats`` calls per sample)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream (nxd_moe.graphs says why)
        fn()
    graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    del graph
    return statistics.median(times)


def dense_us(m: int, k: int, n: int) -> float:
    """``(m, k) @ (k, n)`` in bf16 (random data), CUDA-graph replay."""
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return graph_time_us(lambda: a @ b)


def rel_err(out, ref, rows) -> float:
    diff = (out[rows].double() - ref[rows].double()).norm()
    return float(diff / ref[rows].double().norm().clamp_min(1e-30))


def setup(name: str):
    """The case's weights, one routing of its tokens, and the old path's rows (the reference of every variant)."""
    import torch
    from gpu_layer import ALL_CASES

    from nxd_moe import RoutedExpertsMLPOpsConfig
    from nxd_moe.experts.activation import ExpertActivation
    from nxd_moe.triton_kernels.grouped_gemm import down_projection, gate_up_projection
    from nxd_moe.triton_kernels.launch_configs import launch_config
    from nxd_moe.triton_kernels.routing_metadata import max_tiles, routing_layout

    case = ALL_CASES[name]
    device, dtype = torch.device("cuda"), torch.bfloat16
    e, k, h, i, t = case.num_experts, case.top_k, case.hidden, case.intermediate, case.tokens
    gen = torch.Generator(device=device).manual_seed(0)
    p = argparse.Namespace(case=case, e=e, k=k, h=h, i=i, t=t)
    p.gate_up = torch.randn(e, h, 2 * i, generator=gen, device=device, dtype=dtype) / h ** 0.5
    p.down = torch.randn(e, i, h, generator=gen, device=device, dtype=dtype) / i ** 0.5
    p.x = torch.randn(t, h, generator=gen, device=device, dtype=dtype)
    router = torch.randn(e, h, generator=gen, device=device) / h ** 0.5
    p.index = index = torch.topk(p.x.float() @ router.T, k, dim=-1).indices
    p.mask = mask = torch.zeros(t, e, dtype=torch.bool, device=device).scatter(1, index, True)
    p.activation = ExpertActivation.from_config(RoutedExpertsMLPOpsConfig(
        num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, hidden_act="silu", glu_mlp=True))
    p.old = launch_config(e, h, i, k, t, device, dtype)
    block_m = p.old["block_m"]
    p.layout = routing_layout(mask, index, block_m, max_tiles(t * k, e, block_m), block_m)[1]
    used = torch.arange(p.layout.num_rows, device=device) < p.layout.num_tiles * block_m
    p.rows = torch.nonzero((p.layout.row_token >= 0) & used)[:, 0]
    p.ref_act = gate_up_projection(p.x, p.layout, p.gate_up, None, p.activation, None, p.old["gate_up"])
    p.ref_out = down_projection(p.ref_act, p.layout, p.down, None, p.old["down"])
    return p


def measure(p, part: str, vname: str) -> dict:
    """One variant of one GEMM: time (CUDA-graph replay), TFLOP/s, relative error against the old path."""
    import torch

    from nxd_moe.triton_kernels import prefill_gemm
    from nxd_moe.triton_kernels.grouped_gemm import down_projection, gate_up_projection

    spec = VARIANTS[part][vname]
    entry = {}
    if part == "gate_up":
        flop = 2 * p.t * p.k * p.h * 2 * p.i
        if spec is None:
            def fn():
                return gate_up_projection(p.x, p.layout, p.gate_up, None, p.activation, None, p.old["gate_up"])
        else:
            cfg = {**prefill_gemm.default_prefill_config(p.layout.block_m, p.i)["gate_up"], **spec}

            def fn():
                return prefill_gemm.gate_up_rows(p.x, p.layout, p.gate_up, None, p.activation, None, cfg)
            if cfg.get("A_TMA"):
                entry["permute_us"] = graph_time_us(lambda: prefill_gemm.permute_rows(p.x, p.layout))
        ref, got = p.ref_act, None
    else:
        flop = 2 * p.t * p.k * p.i * p.h
        if spec is None:
            def fn():
                return down_projection(p.ref_act, p.layout, p.down, None, p.old["down"])
        else:
            cfg = {**prefill_gemm.default_prefill_config(p.layout.block_m, p.i)["down"], **spec}

            def fn():
                return prefill_gemm.down_rows(p.ref_act, p.layout, p.down, None, cfg)
        ref = p.ref_out[0]
    got = fn()
    got = got[0] if part == "down" else got
    torch.cuda.synchronize()
    entry["rel_err"] = rel_err(got, ref, p.rows)
    entry["us"] = graph_time_us(fn)
    entry["TFLOPs"] = flop / entry["us"] / 1e6
    return entry


def layout_times(p, chunks) -> dict:
    """The routing-metadata kernels (NxD's block mapping at the layer's default block size + the tiles), per pair
    chunk, CUDA-graph replay."""
    from nxd_moe.config import BlockwiseMatmulConfig
    from nxd_moe.experts.token_mapping import num_blocks
    from nxd_moe.triton_kernels.routing_metadata import routing_layout

    block_size = BlockwiseMatmulConfig().block_size
    n = num_blocks(p.t, p.k, p.e, block_size)
    return {chunk: graph_time_us(lambda chunk=chunk: routing_layout(p.mask, p.index, block_size, n,
                                                                    p.layout.block_m, chunk)) for chunk in chunks}


def run_case(name: str, args, result: dict) -> None:
    import subprocess

    p = setup(name)
    row = {"case": name, "E": p.e, "k": p.k, "H": p.h, "I": p.i, "T": p.t, "block_m": p.layout.block_m,
           "tiles": int(p.layout.num_tiles), "real_rows": int(p.rows.numel()),
           "dense_gate_up_us": dense_us(p.t * p.k, p.h, 2 * p.i), "dense_down_us": dense_us(p.t * p.k, p.i, p.h),
           "old_config": p.old, "variants": {"gate_up": {}, "down": {}}}
    row["layout_us"] = layout_times(p, args.layout_chunks)
    print(f"  {name} layout: {row['layout_us']}", flush=True)
    for part in ("gate_up", "down"):
        for vname in [v for v in args.variants if v in VARIANTS[part]]:
            spec = VARIANTS[part][vname] or {}
            start = time.time()
            try:
                if (part, vname) in args.hung:
                    entry = {"error": "not run: it hung on an earlier case"}
                elif spec.get("isolate") and not args.child:
                    done = subprocess.run([sys.executable, __file__, "--child", "--cases", name, "--part", part,
                                           "--variants", vname], capture_output=True, text=True,
                                          timeout=args.isolate_timeout_s)
                    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                    entry = json.loads(lines[-1]) if lines else {"error": done.stderr.strip()[-400:]}
                else:
                    entry = measure(p, part, vname)
            except subprocess.TimeoutExpired:
                entry = {"error": f"timed out after {args.isolate_timeout_s} s (a hang: the kernel never finished)"}
                args.hung.add((part, vname))
            except Exception as exc:  # recorded: a variant that does not compile or launch on this GPU
                entry = {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
            entry["wall_s"] = round(time.time() - start, 1)
            row["variants"][part][vname] = entry
            print(f"  {name} {part} {vname}: {json.dumps(entry)}", flush=True)
    result["cases"][name] = row


def kernel_profile(layer, x, steps: int = 5) -> list:
    """Device time per kernel name (us per layer call), largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        layer(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                layer(x)
            torch.cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / steps
    return sorted(([n[:90], round(us, 1)] for n, us in totals.items()), key=lambda r: -r[1])[:14]


def run_layer(name: str, args, result: dict) -> None:
    """The whole layer on the triton backend with and without the persistent path."""
    import torch
    from _gpu_peers import build_ours
    from gpu_layer import ALL_CASES, make_problem

    from nxd_moe.triton_kernels import prefill_gemm

    case = ALL_CASES[name]
    device, dtype = torch.device("cuda"), torch.bfloat16
    problem, inputs = make_problem(case, dtype, device, 2, seed=0)
    moe = build_ours(problem, "triton", None, dtype, device)
    backend = moe.expert_mlps.backend
    row = result["cases"].get(name, {})
    if "variants" in row:  # the fastest measured variant of each GEMM
        chosen = {}
        for part in ("gate_up", "down"):
            timed = {v: e["us"] + e.get("permute_us", 0.0) for v, e in row["variants"][part].items()
                     if "us" in e and e["rel_err"] < 1e-2}
            best = min(timed, key=timed.get)
            spec = VARIANTS[part][best]
            chosen[part] = ({"persistent": False} if spec is None else
                            {**prefill_gemm.default_prefill_config(row["block_m"], row["I"])[part],
                             **{k: v for k, v in spec.items() if k != "isolate"}, "persistent": True})
        backend.configs = {**row["old_config"], "prefill": chosen}
    out = {"prefill_config": (backend.configs or {}).get("prefill")}
    for label, persistent in (("old", False), ("persistent", True)):
        backend.persistent_prefill = persistent
        x = inputs[0].view(1, case.tokens, -1)
        with torch.no_grad():
            us = graph_time_us(lambda x=x: moe(x), repeats=5, samples=5)
        out[label] = {"graph_us": us, "kernels": kernel_profile(moe, x)}
        print(f"  layer {name} {label}: {us:.1f} us", flush=True)
    result["layers"][name] = out


def dense_rate(result: dict) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = graph_time_us(lambda: a @ b, repeats=5)
    result["roofline"] = {"bf16_matmul_TFLOPs": 2 * 8192 ** 3 / us / 1e6, "matmul": "bf16 8192^3, random data"}


def table(result: dict) -> str:
    lines = [f"dense bf16 matmul {result['roofline']['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
             "case | GEMM | variant | us | TFLOP/s | vs dense same-FLOP mm | rel err"]
    for name, row in result["cases"].items():
        if "variants" not in row:
            lines.append(f"{name} | ERROR {row.get('error')}")
            continue
        for part in ("gate_up", "down"):
            dense = row[f"dense_{part}_us"]
            lines.append(f"{name} | {part} | dense mm | {dense:.0f} | | 1.00 |")
            for vname, v in row["variants"][part].items():
                if "us" not in v:
                    lines.append(f"{name} | {part} | {vname} | ERROR {v.get('error', '')[:160]}")
                    continue
                extra = f" (+{v['permute_us']:.0f} permute)" if "permute_us" in v else ""
                lines.append(f"{name} | {part} | {vname} | {v['us']:.0f}{extra} | {v['TFLOPs']:.0f} | "
                             f"{dense / v['us']:.2f} | {v['rel_err']:.1e}")
    for name, layer in result.get("layers", {}).items():
        if "old" not in layer:
            lines.append(f"layer {name}: {layer}")
            continue
        shown = [w for w in ("old", "persistent") if w in layer]
        lines.append(f"layer {name}: " + ", ".join(f"{w} {layer[w]['graph_us']:.0f} us" for w in shown))
        for which in shown:
            lines.append(f"  {which}: " + "; ".join(f"{n[:40]} {us}" for n, us in layer[which]["kernels"][:8]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--variants", default=",".join(dict.fromkeys([*GATE_UP_VARIANTS, *DOWN_VARIANTS])),
                   help="per-GEMM variants (names of GATE_UP_VARIANTS / DOWN_VARIANTS)")
    p.add_argument("--layout-chunks", default="4096", help="pair chunks to time the routing metadata with")
    p.add_argument("--layer", action="store_true", help="also time and profile the whole layer")
    p.add_argument("--isolate-timeout-s", type=float, default=45.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    args.hung = set()
    args.layout_chunks = [int(c) for c in args.layout_chunks.split(",")]
    import torch
    import triton

    if args.child:  # one isolated variant: its entry as the last line of stdout
        print(json.dumps(measure(setup(args.cases), args.part, args.variants[0])), flush=True)
        return 0

    start = time.time()
    result = {"benchmark": "gpu_prefill", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cases": {}, "layers": {}}
    dense_rate(result)
    for name in args.cases.split(","):
        try:
            run_case(name, args, result)
        except Exception as exc:
            result["cases"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: {exc}", flush=True)
            break
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    if args.layer:
        for name in args.cases.split(","):
            try:
                run_layer(name, args, result)
            except Exception as exc:
                result["layers"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.time() - start
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
