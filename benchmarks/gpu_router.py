"""The fused top-k router against torch's router, alone and inside the whole layer (CUDA-graph replay, one GPU).

torch's router on a 16-bit layer is an fp32 copy of the tokens, an fp32 ``F.linear``, top-k and the activation;
``TritonBackend(fuse_router=True)`` (the default) runs it as one kernel (``nxd_moe/triton_kernels/router.py``). For
each model's full-size layer in bf16 this times, in one run: the router alone both ways, the whole layer (router,
routing, experts, combine) both ways, and a copy roofline (the router's bytes -- tokens, fp32 weight, fp32 logits
and affinities -- over the HBM copy rate measured here). Also records how far the two layers' outputs and routings
differ. One JSON object on stdout (or ``--out``), a table on stderr:

    PYTHONPATH=. python3 benchmarks/gpu_router.py --sweep --out $OUT/gpu_router_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from nxd_moe import build_moe
from nxd_moe.triton_kernels.backend import TritonBackend
from nxd_moe.triton_kernels.router import MIN_TOKENS, router_top_k

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_prefill import graph_time_us  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("gpt-oss-20b", 4096), ("mixtral-8x7b", 4096), ("qwen3-30b-a3b", 1024),
         ("qwen3-30b-a3b", 256)]


def copy_GBps() -> float:
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / graph_time_us(lambda: dst.copy_(src)) / 1e3


def run_case(name: str, tokens: int, copy_rate: float) -> dict:
    torch.manual_seed(0)
    layer = build_moe(name, dtype=torch.bfloat16, device="cuda", backend=TritonBackend(), seed=0).eval()
    layer.return_router_logits = layer.return_expert_index = True
    backend, router, linear = layer.expert_mlps.backend, layer.router, layer.router.linear_router
    x = torch.randn(1, tokens, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    flat = x.view(tokens, -1)
    experts, hidden = router.linear_router.weight.shape
    row = {"config": name, "tokens": tokens, "num_experts": experts, "hidden": hidden, "top_k": router.top_k}
    router_bytes = tokens * hidden * 2 + experts * hidden * 4 + 2 * tokens * experts * 4 + tokens * router.top_k * 8
    row["router_roofline_us"] = router_bytes / copy_rate / 1e3
    with torch.inference_mode():
        row["router_torch_us"] = graph_time_us(lambda: router(flat))
        row["router_fused_us"] = graph_time_us(lambda: router_top_k(flat, linear.weight, linear.bias, router.top_k,
                                                                 router.act_fn == "sigmoid",
                                                                 router.apply_act_fn_over_topk))
        outputs = {}
        for fused in (False, True):  # forced either way; the default rule takes the fused one from MIN_TOKENS on
            backend.fuse_router = fused
            row[f"layer_{'fused' if fused else 'torch'}_router_us"] = graph_time_us(lambda: layer(x))
            outputs[fused] = layer(x)
    row["default_takes_fused"] = tokens >= MIN_TOKENS
    (out_t, logits_t, index_t), (out_f, logits_f, index_f) = outputs[False], outputs[True]
    row["logits_max_abs_diff"] = float((logits_f - logits_t).abs().max())
    row["tokens_with_other_experts"] = int((index_f.sort(dim=1).values != index_t.sort(dim=1).values).any(1).sum())
    same = (index_f == index_t).all(dim=1)
    row["output_max_abs_diff_same_experts"] = float((out_f.view(tokens, -1)[same] - out_t.view(tokens, -1)[same])
                                                    .abs().max()) if same.any() else None
    row["router_speedup"] = row["router_torch_us"] / row["router_fused_us"]
    row["router_vs_roofline"] = row["router_roofline_us"] / row["router_fused_us"]
    row["layer_speedup"] = row["layer_torch_router_us"] / row["layer_fused_router_us"]
    return row


SWEEP_SHAPES = [(256, 128, 2048, 8), (1024, 128, 2048, 8), (4096, 128, 2048, 8), (4096, 32, 2880, 4)]


def sweep() -> list[dict]:
    """The kernel's launch configurations on (T, E, H, k) shapes of Qwen3-30B-A3B and GPT-OSS-20B, next to torch's
    router: what :func:`~nxd_moe.triton_kernels.router.launch_config` and ``MIN_TOKENS`` were read from."""
    from nxd_moe.triton_kernels.router import launch_config

    rows = []
    for tokens, experts, hidden, top_k in SWEEP_SHAPES:
        mine = _sweep_shape(tokens, experts, hidden, top_k)
        best = min((r for r in mine if r["impl"] == "fused"), key=lambda r: r["us"])
        print(f"sweep T={tokens} E={experts} H={hidden}: torch {mine[0]['us']:.1f} us, best fused {best['us']:.1f} "
              f"us (BLOCK_T {best['block_t']}, BLOCK_H {best['block_h']}, {best['num_warps']} warps), rule "
              f"{launch_config(tokens, experts)}", file=sys.stderr)
        rows += mine
    return rows


def _sweep_shape(tokens: int, experts: int, hidden: int, top_k: int) -> list[dict]:
    import itertools

    import triton

    from nxd_moe import RouterTopK
    from nxd_moe.triton_kernels import router as kernel

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    router = RouterTopK(experts, top_k, hidden, device="cuda").eval()
    weight = router.linear_router.weight
    logits = torch.empty(tokens, experts, device="cuda")
    affinities, index = torch.empty_like(logits), torch.empty(tokens, top_k, dtype=torch.int64, device="cuda")
    block_e = max(16, triton.next_power_of_2(experts))
    shape = {"tokens": tokens, "num_experts": experts, "hidden": hidden}
    with torch.inference_mode():
        rows = [{**shape, "impl": "torch", "us": graph_time_us(lambda: router(x))}]
    for block_t, block_h, warps in itertools.product((16, 32, 64), (32, 64, 128), (4, 8)):
        if block_t * block_e > 8192 or 3 * 4 * block_h * (block_e + block_t) > 200_000:  # registers, shared memory
            continue

        def launch(block_t=block_t, block_h=block_h, warps=warps):
            kernel._router_kernel[(triton.cdiv(tokens, block_t),)](
                x, weight, weight, logits, affinities, index, tokens, x.stride(0), hidden=hidden,
                num_experts=experts, top_k=top_k, HAS_BIAS=False, SIGMOID=False, ACT_OVER_TOPK=False,
                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, PRECISION="tf32x3", num_warps=warps, num_stages=3)
        rows.append({**shape, "impl": "fused", "block_t": block_t, "block_h": block_h, "num_warps": warps,
                     "us": graph_time_us(launch)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(f"{n}:{t}" for n, t in CASES),
                        help="config:tokens,... (default: %(default)s)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch configurations")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cases = [case.partition(":")[::2] for case in args.cases.split(",")]
    for name, tokens in cases:
        if not tokens.isdigit() or int(tokens) < 1:
            parser.error(f"--cases: each case is config:tokens with tokens >= 1, got {name}:{tokens}")
    if not torch.cuda.is_available():
        sys.exit("gpu_router.py needs a CUDA device")
    swept = sweep() if args.sweep else None
    rate = copy_GBps()
    rows = []
    for name, tokens in cases:
        rows.append(run_case(name, int(tokens), rate))
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{name:16s} T={int(tokens):5d} E={r['num_experts']:3d} | router: torch "
              f"{r['router_torch_us']:7.1f} us, fused {r['router_fused_us']:6.1f} us ({r['router_speedup']:.2f}x; "
              f"roofline {r['router_roofline_us']:.1f}, {r['router_vs_roofline']:.0%}) | layer: torch router "
              f"{r['layer_torch_router_us']:7.1f} us, fused {r['layer_fused_router_us']:7.1f} us "
              f"({r['layer_speedup']:.2f}x) | {r['tokens_with_other_experts']} tokens routed differently",
              file=sys.stderr)
    report = {"benchmark": "gpu_router", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "copy_GBps": rate,
              "method": "CUDA-graph replay, median of 7 samples of 10 replays; bf16 layers, full size, seed 0",
              "min_tokens_rule": MIN_TOKENS,
              "rows": rows, "sweep": swept}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
