"""Does the layer compile, and what does a compiled call cost? ``torch.compile`` against eager and our own CUDA graph.

For each backend (``torch``, ``triton``) and case (decode / prefill shapes, capacity factor, quantized weights, W8A8)
of one config's layer in bfloat16 on a GPU, this records:

- ``explain``: ``torch._dynamo.explain`` of the layer -- graphs, graph breaks and their reasons, and the nxd_moe ops
  in the graphs (the triton backend's seam steps, ``triton_kernels/compiled.py``);
- ``compile``: whether ``torch.compile(fullgraph=True, mode="reduce-overhead")`` compiles (else the error), the
  seconds the first calls took, and the largest difference from eager;
- ``us_per_call``: wall-clock microseconds per call, host work included (back-to-back calls, one synchronize per
  sample; contenders interleaved) for ``eager``, ``compiled`` (Inductor's CUDA-graph trees) and ``graph``
  (:func:`nxd_moe.graphs.capture`, a replay of our own captured graph).

One JSON object on stdout (and ``--out``), a table on stderr. On an H100, from the repository root:

    PYTHONPATH=. python3 benchmarks/compile_check.py --out $OUT/compile_check_h100.json

``--device cpu`` runs the same checks on a CPU (no CUDA graphs: no ``graph`` contender, ``mode="default"``; the
triton backend needs ``TRITON_INTERPRET=1``), e.g. to measure the host time of an eager call.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback

import torch

from nxd_moe import build_moe
from nxd_moe.graphs import capture

# name -> (batch, seq_len, build_moe keyword arguments)
CASES = {
    "decode_T1": (1, 1, {}),
    "decode_T16": (16, 1, {}),
    "decode_T64": (64, 1, {}),
    "prefill_T2048": (1, 2048, {}),
    "prefill_capacity_T2048": (1, 2048, dict(capacity_factor=1.0)),
    "decode_T16_fp8": (16, 1, dict(quantization="fp8")),
    "decode_T16_mxfp4": (16, 1, dict(quantization="mxfp4")),
    "prefill_T2048_fp8_block_w8a8": (1, 2048, dict(quantization="fp8_block", activation_quantization="fp8")),
}
DEFAULT_CASES = ("decode_T1", "decode_T16", "prefill_T2048", "prefill_capacity_T2048", "decode_T16_mxfp4",
                 "prefill_T2048_fp8_block_w8a8")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_per_call_us(contenders: dict, samples: int, calls: int, device: str) -> dict:
    """Median and min microseconds per call of each contender: ``samples`` samples of ``calls`` back-to-back calls
    and one synchronize, contenders interleaved with a rotating start."""
    times = {name: [] for name in contenders}
    names = list(contenders)
    for rep in range(samples):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                contenders[name]()
            synchronize(device)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: {"median": round(statistics.median(t), 1), "min": round(min(t), 1)} for name, t in times.items()}


def explain(fn, x) -> dict:
    out = torch._dynamo.explain(fn)(x)
    ops = sorted({str(node.target).split(".")[1] for graph in out.graphs for node in graph.graph.nodes
                  if node.op == "call_function" and str(node.target).startswith("nxd_moe.")})
    return {"graphs": out.graph_count, "graph_breaks": out.graph_break_count,
            "break_reasons": [str(reason.reason)[:300] for reason in out.break_reasons], "nxd_moe_ops": ops}


def run_case(config: str, scale: int, backend: str, case: str, samples: int, calls: int, device: str) -> dict:
    batch, seq_len, overrides = CASES[case]
    row = {"backend": backend, "case": case, "batch": batch, "seq_len": seq_len, **overrides}
    torch._dynamo.reset()
    moe = build_moe(config, scale=scale, dtype=torch.bfloat16, device=device, backend=backend, seed=0,
                    **overrides).eval()
    x = torch.randn(batch, seq_len, moe.hidden_size, device=device, dtype=torch.bfloat16)
    cuda = device == "cuda"

    def fn(x):
        return moe(x)[0]

    with torch.no_grad():
        eager = fn(x)  # first eager call: kernels compiled, repacked weights built
        row["explain"] = explain(fn, x)
        torch._dynamo.reset()
        graphed = capture(fn, x) if cuda else None
        compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead" if cuda else "default")
        start = time.perf_counter()
        try:
            for _ in range(3):  # warm-up, recording, first replay
                torch.compiler.cudagraph_mark_step_begin()
                out = compiled(x)
            synchronize(device)
            row["compile"] = {"ok": True, "first_3_calls_s": round(time.perf_counter() - start, 1),
                              "max_abs_diff_vs_eager": (out.float() - eager.float()).abs().max().item()}
            if cuda:
                row["compile"]["graph_max_abs_diff_vs_eager"] = (graphed(x).float() - eager.float()).abs().max().item()
        except Exception as error:  # noqa: BLE001 - the report says why it failed
            row["compile"] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:2000]}",
                              "traceback": traceback.format_exc()[-3000:]}
            compiled = None

        def compiled_call():
            torch.compiler.cudagraph_mark_step_begin()
            compiled(x)

        contenders = {"eager": lambda: fn(x)}
        if cuda:
            contenders["graph"] = lambda: graphed(x)
        if compiled is not None:
            contenders["compiled"] = compiled_call
        row["us_per_call"] = time_per_call_us(contenders, samples, calls, device)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--backends", default="torch,triton")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    rows = []
    for backend in args.backends.split(","):
        for case in cases:
            row = run_case(args.config, args.scale, backend, case, args.samples, args.calls, args.device)
            rows.append(row)
            gc.collect()  # the case's layer, graphs and compiled function
            if args.device == "cuda":
                torch.cuda.empty_cache()
            times = row["us_per_call"]
            print(f"{backend:6s} {case:30s} compile {'ok ' if row['compile']['ok'] else 'FAIL'} "
                  f"breaks {row['explain']['graph_breaks']}  us/call: "
                  + "  ".join(f"{name} {t['median']:.1f}" for name, t in times.items()), file=sys.stderr)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"config": args.config, "scale": args.scale, "device": device, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "triton": __import__("triton").__version__, "rows": rows}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(row["compile"]["ok"] and row["explain"]["graph_breaks"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
