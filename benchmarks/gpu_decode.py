"""Decode on one GPU: the triton backend's one-launch decode against its separate-kernel path, per launch config.

For each decode case of ``gpu_layer.py`` (same weights, inputs and rotations), the whole ``MoE`` layer is timed
(median per call, CUDA-graph replay and eager) as:

- ``separate``: ``TritonBackend(one_launch=False)``: fp32 router and shared expert in torch, then the routing,
  metadata, gate/up, down and combine kernels;
- ``seam``: router and shared expert in torch, the routed experts in one persistent launch (the backend seam's
  selective loading, what expert parallelism calls on received rows);
- ``fused``: ``TritonBackend.fused_decode``: router, routing, experts, shared expert and combine in one launch,
  with the shipped launch config, and ``fused:<variant>`` with the variants given by ``--variants``.

Each contender's output is compared with the float64 reference (relative error). The roofline (copy bandwidth,
bf16 matmul rate) is measured in the same run; ``vs_roofline`` = max(touched bytes / copy bandwidth, FLOPs /
matmul rate) / time. ``--profile`` adds a cProfile of eager calls (host time by function) of the first case.
Output: JSON (``--out``) and a table on stdout, printed last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# Launch-config variants: overrides of the rule's entry (see nxd_moe.triton_kernels.launch_configs).
VARIANTS = {
    "pps2": {"programs_per_sm": 2},
    "st3": {"num_stages": 3},
    "w8": {"num_warps": 8},
    "gk64": {"gate_up": {"BLOCK_K": 64}},
    "gu64": {"gate_up": {"BLOCK_N": 64, "BLOCK_K": 128}},
    "gu128": {"gate_up": {"BLOCK_N": 128, "BLOCK_K": 64}},
    "dn256": {"down": {"BLOCK_N": 256, "BLOCK_K": 64}},
    "split1": {"down": {"SPLIT_K": 1}},
    "split2x": {"down": {"SPLIT_K": "2x"}},
    # small-T dataflow (persistent_decode's pair tiles, the fused router's H per item)
    "pairs": {"pair_tiles": True},
    "nopairs": {"pair_tiles": False},
    "smalloff": {"pair_tiles": False, "router_chunk": 512, "down_prefetch": False},  # T=1 before pair tiles
    "rc64": {"router_chunk": 64},
    "rc256": {"router_chunk": 256},
    "rc512": {"router_chunk": 512},
    "rc128": {"router_chunk": 128},
    "pf": {"down_prefetch": True},  # down weights pulled into L2 while gate/up runs (capped at half the L2)
    "nopf": {"down_prefetch": False},
    "gu32": {"gate_up": {"BLOCK_N": 32, "BLOCK_K": 256}},
    "dn64": {"down": {"BLOCK_N": 64, "BLOCK_K": 128}},
    # T=1's gate/up items (96 for Qwen3) leave a third of the multiprocessors idle; narrower items only help when
    # two programs per multiprocessor hold them all at once (gu32 alone: two waves)
    "gu32pps2": {"gate_up": {"BLOCK_N": 32, "BLOCK_K": 256}, "programs_per_sm": 2},
    "dn64pps2": {"down": {"BLOCK_N": 64, "BLOCK_K": 128}, "programs_per_sm": 2},
    # fused gate/up + down items (no phase boundary between them): T=1 Qwen3 has 8 x I/BLOCK_N items, one wave
    # wherever programs_per_sm x SMs holds them all
    "fused": {"fused_mlp": True},
    "twophase": {"fused_mlp": False},  # gate/up and down in separate items (the rule before fused_mlp)
    "fused32pps2": {"fused_mlp": True, "gate_up": {"BLOCK_N": 32, "BLOCK_K": 256}, "programs_per_sm": 2},
    "fused16pps3": {"fused_mlp": True, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 512}, "programs_per_sm": 3},
    "fused32pps2dn256": {"fused_mlp": True, "gate_up": {"BLOCK_N": 32, "BLOCK_K": 256}, "programs_per_sm": 2,
                         "down": {"BLOCK_N": 256}},
    "fused64dn256": {"fused_mlp": True, "down": {"BLOCK_N": 256}},
    "fusedst6": {"fused_mlp": True, "num_stages": 6},
    "fusedw8": {"fused_mlp": True, "num_warps": 8},
    "fusedpps2": {"fused_mlp": True, "programs_per_sm": 2},
    "fusedgk256st3": {"fused_mlp": True, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 256}, "num_stages": 3},
    "fused32pps2st3": {"fused_mlp": True, "gate_up": {"BLOCK_N": 32, "BLOCK_K": 256}, "programs_per_sm": 2,
                       "num_stages": 3},
}
KINDS = ("router", "layout", "shared_gate_up", "gate_up", "shared_down", "down", "combine", "route", "down_prefetch",
         "fused_mlp")


def trace_summary(trace) -> dict:
    """Per item kind: count, median wait (fetch -> start of work) and work (start -> end) in us, and the window
    [first start, last end] relative to the first fetch; plus the span and how busy the programs were."""

    rows = trace[trace[:, 0] > 0].cpu().double()
    if rows.numel() == 0:
        return {}
    t0 = rows[:, 0].min()
    kinds = (rows[:, 3].long() % 16)
    programs = (rows[:, 3].long() // 16)
    out = {"span_us": float((rows[:, 2].max() - t0) / 1e3), "items": int(rows.shape[0]),
           "programs_seen": int(programs.unique().numel())}
    busy = float((rows[:, 2] - rows[:, 1]).sum() / 1e3)
    out["work_fraction"] = busy / (out["span_us"] * out["programs_seen"])
    for code, name in enumerate(KINDS):
        sel = rows[kinds == code]
        if sel.numel() == 0:
            continue
        wait = (sel[:, 1] - sel[:, 0]) / 1e3
        work = (sel[:, 2] - sel[:, 1]) / 1e3
        out[name] = {"n": int(sel.shape[0]), "wait_us_med": float(wait.median()), "wait_us_max": float(wait.max()),
                     "work_us_med": float(work.median()), "work_us_max": float(work.max()),
                     "first_start_us": float((sel[:, 1].min() - t0) / 1e3),
                     "last_end_us": float((sel[:, 2].max() - t0) / 1e3)}
    return out


def _merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict):
            value = {k: 2 * base[key][k] if v == "2x" else v for k, v in value.items()}
            out[key] = {**base[key], **value}
        else:
            out[key] = value
    return out


def run(args) -> dict:
    import gpu_layer
    import torch
    from _gpu_peers import build_ours, reference

    from nxd_moe.triton_kernels import persistent_decode
    from nxd_moe.triton_kernels.backend import TritonBackend
    from nxd_moe.triton_kernels.launch_configs import decode_config

    class SeamOnly(TritonBackend):
        def fused_decode(self, *unused):
            return None

    device, dtype = torch.device("cuda"), torch.bfloat16
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        roof_args = argparse.Namespace(device="cuda", child_out=f.name)
        gpu_layer.measure_roofline(roof_args)
        result = json.loads(Path(f.name).read_text())
    result.update(benchmark="gpu_decode", k_major_gate_up=args.k_major_gate_up,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), cases={})
    copy, mm = result["roofline"]["copy_TBps"], result["roofline"]["bf16_matmul_TFLOPs"]
    timer = gpu_layer.Timer(device, args.target_s, 5, 200, 3)
    for name in args.cases.split(","):
        if time.perf_counter() - started > args.budget_s:
            result["cases"][name] = {"error": "skipped: --budget-s exhausted"}
            continue
        case = gpu_layer.ALL_CASES[name]
        problem, inputs = gpu_layer.make_problem(case, dtype, device, 4, 0)
        sizes = gpu_layer.problem_sizes(case, problem, inputs)
        floor_us = max(sizes["touched_weight_bytes"] / (copy * 1e6), sizes["useful_flop"] / (mm * 1e6))
        ref = reference(problem, inputs[0])
        moe = build_ours(problem, "triton", None, dtype, device)
        experts = moe.expert_mlps
        if args.k_major_gate_up:  # same values, each gate/up column's H weights contiguous (strides (2I*H, 1, H))
            weight = experts.mlp_op.first_proj.weight
            weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)
        num_experts, hidden, _ = experts.mlp_op.first_proj.weight.shape
        rule = decode_config(num_experts, hidden, experts.mlp_op.down_proj.weight.shape[1], case.top_k, case.tokens,
                             device, dtype, shared_inter=case.shared_intermediate or 0)
        entry = {"case": name, "tokens": case.tokens, "roofline_us": floor_us, "rule": rule, "contenders": {},
                 **{k: v for k, v in sizes.items() if k != "experts_hit_per_input"}}
        result["cases"][name] = entry
        contenders = {"separate": TritonBackend(one_launch=False), "seam": SeamOnly(), "fused": TritonBackend()}
        for variant in [v for v in args.variants.split(",") if v and name in (args.variants_for or name)]:
            contenders[f"fused:{variant}"] = TritonBackend(decode_configs=_merged(rule, VARIANTS[variant]))
            if args.trace:
                contenders[f"fused:{variant}:trace"] = TritonBackend(decode_configs=_merged(rule, VARIANTS[variant]))
        if args.trace:
            contenders["fused:trace"] = TritonBackend()
        for label, backend in contenders.items():
            if time.perf_counter() - started > args.budget_s:
                entry["contenders"][label] = {"error": "skipped: --budget-s exhausted"}
                continue
            experts.backend = backend
            persistent_decode.TRACE_PLANS = label.endswith(":trace")
            row = entry["contenders"].setdefault(label, {})
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    out = moe(inputs[0].view(case.tokens, 1, -1))[0].view(case.tokens, -1).double()
                torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                row["rel_err"] = float((out - ref).norm() / ref.norm())
                row["timed_out"] = persistent_decode.timed_out(device)

                def layer(x, moe=moe, tokens=case.tokens):
                    return moe(x.view(tokens, 1, -1))[0]

                row["graph"] = timer.graph(layer, inputs)
                row["eager"] = timer.eager(layer, inputs)
                row["us"] = row["graph"]["us"]
                row["vs_roofline"] = floor_us / row["us"]
                row["TBps_touched"] = sizes["touched_weight_bytes"] / row["us"] / 1e6
                row["eager_target_us"] = 1.5 * row["us"] + 50
                if persistent_decode.TRACE_PLANS:
                    row["trace"] = trace_summary(persistent_decode.last_trace())
            except Exception as exc:  # recorded, the run goes on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                torch.cuda.synchronize()
            print(f"[{time.perf_counter() - started:5.0f} s] {name} {label}: {row.get('us', row.get('error'))}",
                  file=sys.stderr, flush=True)
        persistent_decode.TRACE_PLANS = False
        if args.profile and name == args.cases.split(",")[0]:
            entry["profile"] = {}
            for label in ("separate", "fused"):
                experts.backend = contenders[label]
                x = inputs[0].view(case.tokens, 1, -1)
                with torch.no_grad():
                    for _ in range(20):
                        moe(x)
                    torch.cuda.synchronize()
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(200):
                        moe(x)
                    profiler.disable()
                    torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                entry["profile"][label] = text.getvalue()[-6000:]
        kernels = {}
        for fn in (persistent_decode.decode_kernel,):
            for cache in fn.device_caches.values():
                for key, compiled in cache[0].items():
                    kernels[str(hash(key))] = {"n_regs": getattr(compiled, "n_regs", None),
                                               "n_spills": getattr(compiled, "n_spills", None),
                                               "shared": compiled.metadata.shared,
                                               "num_warps": compiled.metadata.num_warps,
                                               "num_stages": compiled.metadata.num_stages}
        entry["persistent_kernels"] = kernels
        del moe, experts, problem, inputs
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def table(result: dict) -> str:
    lines = [f"{result['environment'].get('gpu')}: copy {result['roofline']['copy_TBps']:.2f} TB/s, "
             f"matmul {result['roofline']['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
             f"{'case':36s} {'contender':14s} {'graph us':>9s} {'eager us':>9s} {'%roof':>6s} {'rel_err':>8s}"]
    for name, entry in result["cases"].items():
        for label, row in entry.get("contenders", {}).items():
            if "us" in row:
                lines.append(f"{name:36s} {label:14s} {row['us']:9.1f} {row['eager']['us']:9.1f} "
                             f"{100 * row['vs_roofline']:5.0f}% {row['rel_err']:8.1e}"
                             + (" TIMED-OUT" if row.get("timed_out") else ""))
            else:
                lines.append(f"{name:36s} {label:14s} {row.get('error', '?')[:80]}")
            trace = row.get("trace")
            if trace:
                lines.append(f"    span {trace['span_us']:.1f} us, work {trace['work_fraction']:.2f}; " + "; ".join(
                    f"{k} n={v['n']} wait {v['wait_us_med']:.1f}/{v['wait_us_max']:.1f} work {v['work_us_med']:.1f}/"
                    f"{v['work_us_max']:.1f} [{v['first_start_us']:.1f}, {v['last_end_us']:.1f}]"
                    for k, v in trace.items() if isinstance(v, dict)))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="qwen3-30b-a3b-decode-m1,mixtral-8x7b-decode-m1,qwen3-30b-a3b-decode-m32,"
                                      "llama4-scout-tp8-decode-m64,llama4-scout-tp8-shared-decode-m64,"
                                      "deepseek-v3-decode-m16")
    p.add_argument("--variants", default="", help=f"comma list of {sorted(VARIANTS)}")
    p.add_argument("--variants-for", default=None, help="comma list of the cases that get the variants (default all)")
    p.add_argument("--target-s", type=float, default=0.1)
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--trace", action="store_true",
                   help="add fused contenders (the rule's and each variant's) that record per-item device times")
    p.add_argument("--k-major-gate-up", action="store_true",
                   help="store the experts' gate/up weight K-major (a column's H values contiguous) for every "
                        "contender: does the weight's layout limit the decode's streaming rate?")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
