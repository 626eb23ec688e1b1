"""Quantized experts on a GPU: the triton backend's decode and prefill with FP8 / MxFP4 weights and FP8 x FP8
(W8A8) vs bf16.

    PYTHONPATH=. python3 benchmarks/gpu_quantized.py --out $OUT/gpu_quantized.json [--vllm-src .peers/vllm_src]

For each shape and format it times the routed experts' forward (``ExpertMLPsV2``, ``backend="triton"``, bf16
compute, replayed from a CUDA graph, median of ``triton.testing.do_bench_cudagraph``) and reports the bytes the
step actually reads of the expert weights -- the stored values and scales of the experts the routing touched --
as TB/s and as a fraction of the device copy bandwidth measured at the start of the same run, plus the relative
error of the quantized layer against the bf16 layer it was quantized from. The weights the step reads are
dequantized inside the GEMMs' tile loads, so a decode step reads 1/2 (FP8) or ~1/4 (MxFP4) of bf16's bytes.

``w8a8_fp8`` / ``w8a8_fp8_block``: the same weights with ``activation_quantization="fp8"`` (FP8 activations, FP8 x
FP8 tensor-core GEMMs; per token, resp. per token and 128 columns). Their launch configuration is the shipped one
(``"default"``) or, where that is slower, the best of a few candidates timed in the same run (``candidates``,
``config``): the in-run tuning that ``tune_gpu.py`` does at length, reported as such.

``--decode-variants``: for the quantized decode shapes (W8A16 ``fp8`` / ``fp8_block`` / ``mxfp4``), the shipped
launch configuration (the tuned table or the rule) timed next to variations of it in the same process: gate/up
unsplit and split twice as far / half as far (issue 29's split of ``H``, ``gate_up["SPLIT_K"]``), the down split
doubled / halved, one more pipeline stage, half-width gate/up column tiles, 8 warps (``decode_variants``: each
one's configuration, us, fraction of copy bandwidth, error against bf16). With it the one-launch /
separate-kernels comparison is skipped (``--paths`` turns it back on).

Peers (``_quantized_peers``, from an unpacked vLLM 0.33.0 wheel at ``--vllm-src``; skipped with a note when it
is absent) multiply the same stored weights, timed the same way: vLLM's Triton FP8 W8A8 fused MoE for the FP8
formats -- through the stand-ins of ``_vllm_stubs`` (one kernel per compiled op) and, as ``*_kernels_only``, with its
block alignment computed outside the timed region (a lower bound on a vLLM install's time) -- and OpenAI's
``triton_kernels`` MXFP4 ``matmul_ogs`` for ``mxfp4``; for the 128x128 block formats also FlashInfer's CUTLASS
fused MoE (``flashinfer_cutlass``, its DeepSeek FP8 block-scale path, from ``--flashinfer-site``; skipped with the
reason when flashinfer does not import). Each format reports ``vs_best_peer`` (the best peer's time /
ours: above 1 we are faster) and each peer its error against the bf16 layer and against our layer of the same
format.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, RoutedExpertsMLPOpsConfig
from nxd_moe.quantization.quantizer import quantize_experts
from nxd_moe.triton_kernels.backend import TritonBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _quantized_peers  # noqa: E402
from _gpu_peers import flashinfer_unavailable  # noqa: E402

# name: (T, E, k, H, I)
SHAPES = {
    "mixtral-8x7b-decode-m1": (1, 8, 2, 4096, 14336),
    "qwen3-30b-a3b-decode-m1": (1, 128, 8, 2048, 768),
    "qwen3-30b-a3b-decode-m32": (32, 128, 8, 2048, 768),
    "deepseek-v3-decode-m16": (16, 256, 8, 7168, 2048),
    "qwen3-30b-a3b-prefill-m4096": (4096, 128, 8, 2048, 768),
    "deepseek-v3-prefill-m4096": (4096, 256, 8, 7168, 2048),
}
FORMATS = ("bf16", "fp8", "fp8_block", "mxfp4", "w8a8_fp8", "w8a8_fp8_block")
VLLM_FP8 = ("vllm_fp8_w8a8", "vllm_fp8_w8a8_kernels_only")
FLASHINFER = "flashinfer_cutlass"
PEERS = {"fp8": VLLM_FP8, "fp8_block": (*VLLM_FP8, FLASHINFER), "mxfp4": ("oai_mxfp4",), "w8a8_fp8": VLLM_FP8,
         "w8a8_fp8_block": (*VLLM_FP8, FLASHINFER)}
W8A8 = "w8a8_"


def _config(block_m: int, gate_up: tuple, down: tuple, tma: bool = False) -> dict:
    """A launch configuration from ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` per GEMM (down: + SPLIT_K)."""
    names = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return {"block_m": block_m, "gate_up": {**dict(zip(names, gate_up)), "TMA": tma},
            "down": {**dict(zip(names + ("SPLIT_K",), down)), "TMA": tma}}


# W8A8 launch configurations timed next to the shipped one (None): pipeline depth, row tile, K tile.
# (The shipped prefill rule took the four-stage candidate after the first H100 run: three stages is now timed.)
W8A8_CANDIDATES = {
    "prefill": [None, _config(128, (128, 128, 8, 3), (128, 128, 8, 3, 1), True),
                _config(64, (128, 128, 4, 4), (128, 128, 4, 4, 1), True)],
    "decode": [None, _config(16, (128, 128, 4, 4), (128, 128, 4, 4, 1))],
}


def decode_variants(config: dict) -> dict:
    """Variations of a resolved decode launch ``config`` to time next to it (see the module docstring), by name;
    duplicates of it or of an earlier variation left out."""
    gate_up, down = config["gate_up"], config["down"]
    split = gate_up.get("SPLIT_K", 1)

    def changed(gate_up_part=None, down_part=None):
        return {**config, "gate_up": {**gate_up, **(gate_up_part or {})}, "down": {**down, **(down_part or {})}}

    candidates = {
        "gate_up_unsplit": changed({"SPLIT_K": 1}),
        "gate_up_split_x2": changed({"SPLIT_K": 2 * split}),
        "gate_up_split_half": changed({"SPLIT_K": max(1, split // 2)}),
        "down_split_x2": changed(down_part={"SPLIT_K": 2 * down["SPLIT_K"]}),
        "down_split_half": changed(down_part={"SPLIT_K": max(1, down["SPLIT_K"] // 2)}),
        "stages_plus_1": changed({"num_stages": gate_up["num_stages"] + 1}, {"num_stages": down["num_stages"] + 1}),
        "gate_up_half_width": changed({"BLOCK_N": max(16, gate_up["BLOCK_N"] // 2)}),
        "warps_8": changed({"num_warps": 8}, {"num_warps": 8}),
    }
    seen, variants = [config], {}
    for name, candidate in candidates.items():
        if candidate not in seen:
            seen.append(candidate)
            variants[name] = candidate
    return variants


def time_decode_variants(layer: ExpertMLPsV2, x, affinities, index, reference, read: int, bandwidth: float) -> dict:
    """The shipped decode configuration (``rule``) and each of :func:`decode_variants`: configuration, us,
    fraction of copy bandwidth and error against bf16, or the error that stopped it."""
    shipped = TritonBackend()._config(x, layer.expert_weights(), index.shape[1])
    backend, report = layer.backend, {}
    for name, config in {"rule": shipped, **decode_variants(shipped)}.items():
        layer.backend = TritonBackend(configs=config)
        try:
            with torch.no_grad():
                out = layer(x, affinities, index, seq_len=1).float()
                torch.cuda.synchronize()  # the graph warm-up runs on a side stream: never beside this call
                us = do_bench_cudagraph(lambda: layer(x, affinities, index, seq_len=1), rep=100) * 1e3
        except Exception as error:  # a variant that does not compile or fit is reported, not fatal
            report[name] = {"config": config, "error": f"{type(error).__name__}: {error}"[:500]}
            torch.cuda.synchronize()
            continue
        report[name] = {"config": config, "us": round(us, 1),
                        "fraction_of_copy_bandwidth": round(read / us / 1e6 / (bandwidth / 1e12), 3),
                        "rel_err_vs_bf16": relative_error(out, reference)}
    layer.backend = backend
    return report


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (do_bench(lambda: b.copy_(a), rep=200) * 1e-3)


def touched_bytes(layer: ExpertMLPsV2, expert_index: torch.Tensor) -> int:
    """Stored bytes (values + scales) of the experts ``expert_index`` touches, both projections."""
    used = torch.unique(expert_index).numel()
    op = layer.mlp_op
    total = sum(t.nbytes for lin in (op.first_proj, op.down_proj) for t in (lin.weight, getattr(lin, "scale", None))
                if t is not None)
    return total * used // layer.routed_experts_mlp_config.num_experts


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return round(((out.float() - reference).norm() / reference.norm()).item(), 5)


def time_peers(layer: ExpertMLPsV2, fmt: str, peers_src: str | None, x, affinities, index, reference, ours,
               flashinfer_site: str | None = None) -> dict:
    """Each peer of ``fmt`` on ``layer``'s stored weights: time, errors, or why it did not run."""
    peers = {}
    for peer in PEERS.get(fmt, ()):
        why_not = (flashinfer_unavailable(flashinfer_site) if peer == FLASHINFER
                   else None if peers_src is not None and os.path.isdir(peers_src)
                   else f"no --vllm-src directory ({peers_src})")
        if why_not:
            peers[peer] = {"skipped": why_not}
            continue
        try:
            if peer == FLASHINFER:
                forward, info = _quantized_peers.flashinfer_fp8_block(layer)
            elif peer in VLLM_FP8:
                forward, info = _quantized_peers.vllm_fp8_w8a8(layer, fmt.removeprefix(W8A8), peers_src, x.shape[0],
                                                               kernels_only=peer.endswith("kernels_only"))
            else:
                forward, info = _quantized_peers.oai_mxfp4(layer, peers_src)
            with torch.no_grad():
                out = forward(x, affinities, index)
                torch.cuda.synchronize()  # the graph warm-up runs on a side stream: never beside this call
                us = do_bench_cudagraph(lambda forward=forward: forward(x, affinities, index), rep=100) * 1e3
        except Exception as error:  # a peer that cannot run here is reported, not fatal
            peers[peer] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            continue
        peers[peer] = {"us": round(us, 1), "rel_err_vs_bf16": relative_error(out, reference),
                       "rel_err_vs_ours": relative_error(out, ours), **info}
        forward = None  # its copies of the weights go before the next peer's
        torch.cuda.empty_cache()
    return peers


def time_candidates(layer: ExpertMLPsV2, candidates: list, x, affinities, index, seq_len) -> dict:
    """Time ``layer`` under each launch configuration (None: the shipped table / rule); the fastest one's time and
    output, every candidate's time or error, and which won."""
    report, best, won = [], None, None
    for config in candidates:
        layer.backend = TritonBackend(configs=config)
        try:
            with torch.no_grad():
                out = layer(x, affinities, index, seq_len=seq_len).float()
                torch.cuda.synchronize()  # the graph warm-up runs on a side stream: never beside this call
                us = do_bench_cudagraph(lambda: layer(x, affinities, index, seq_len=seq_len), rep=100) * 1e3
        except Exception as error:  # a candidate that does not compile or fit is reported, not fatal
            report.append({"config": config or "default", "error": f"{type(error).__name__}: {error}"[:500]})
            torch.cuda.synchronize()
            continue
        report.append({"config": config or "default", "us": round(us, 1)})
        if best is None or us < best[0]:
            best, won = (us, out), config or "default"
    layer.backend = TritonBackend(configs=won if isinstance(won, dict) else None)
    return {"best": best, "config": won, "candidates": report}


def kernel_times(layer: ExpertMLPsV2, x, affinities, index, seq_len, calls: int = 5) -> dict:
    """Device time per forward of each kernel the forward launches (torch.profiler), microseconds: where a step's
    time goes."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            layer(x, affinities, index, seq_len=seq_len)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us:
            times[event.key[:80]] = round(us / calls, 1)
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def run_shape(name: str, bandwidth: float, peers_src: str | None, formats=FORMATS, candidates_on: bool = True,
              profile_kernels: bool = False, variants_on: bool = False, paths_on: bool = True,
              flashinfer_site: str | None = None) -> dict:
    num_tokens, num_experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    config = RoutedExpertsMLPOpsConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                                       intermediate_size=inter, hidden_act="silu", glu_mlp=True,
                                       normalize_top_k_affinities=True)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    affinities = torch.softmax(torch.randn(num_tokens, num_experts, device="cuda", generator=gen), dim=-1)
    index = affinities.topk(top_k, dim=-1).indices
    seq_len = 1 if num_tokens <= 64 else None
    result = {"shape": dict(zip(("T", "E", "k", "H", "I"), SHAPES[name])), "formats": {}}
    reference = None
    for fmt in formats:
        layer = ExpertMLPsV2(config, BlockwiseMatmulConfig(), dtype=torch.bfloat16, device="cuda", backend="triton")
        with torch.no_grad():
            gen.manual_seed(1)
            for p in layer.parameters():
                p.normal_(0.0, 0.02, generator=gen)  # in place: DeepSeek-V3's 22 GB of experts get no copy
        if fmt != "bf16":
            try:
                quantize_experts(layer, fmt.removeprefix(W8A8),
                                 activation_quantization="fp8" if fmt.startswith(W8A8) else "none")
            except ValueError as error:  # e.g. 128x128 blocks that do not divide the shape
                result["formats"][fmt] = {"skipped": str(error)}
                continue
        candidates = (W8A8_CANDIDATES["decode" if seq_len == 1 else "prefill"]
                      if fmt.startswith(W8A8) and candidates_on else [None])
        timed = time_candidates(layer, candidates, x, affinities, index, seq_len)
        if not timed["best"]:
            result["formats"][fmt] = {"error": timed["candidates"]}
            continue
        us, out = timed["best"]
        if reference is None:
            reference = out
        read = touched_bytes(layer, index)
        result["formats"][fmt] = {
            "us": round(us, 1), "weight_bytes_read": read, "TBps": round(read / us / 1e6, 3),
            "fraction_of_copy_bandwidth": round(read / us / 1e6 / (bandwidth / 1e12), 3),
            "rel_err_vs_bf16": relative_error(out, reference)}
        if len(candidates) > 1:
            result["formats"][fmt].update(config=timed["config"], candidates=timed["candidates"])
        if variants_on and seq_len == 1 and fmt in ("fp8", "fp8_block", "mxfp4"):
            result["formats"][fmt]["decode_variants"] = time_decode_variants(layer, x, affinities, index, reference,
                                                                             read, bandwidth)
        if paths_on and seq_len == 1 and not fmt.startswith(W8A8):  # both decode paths, whichever the rule picks
            backend = layer.backend
            for path, one_launch in (("one_launch", True), ("multi_launch", False)):
                layer.backend = TritonBackend(one_launch=one_launch)
                with torch.no_grad():
                    out_path = layer(x, affinities, index, seq_len=seq_len).float()
                    torch.cuda.synchronize()
                    path_us = do_bench_cudagraph(lambda layer=layer: layer(x, affinities, index, seq_len=seq_len),
                                                 rep=100) * 1e3
                result["formats"][fmt][path] = {"us": round(path_us, 1),
                                                "rel_err_vs_bf16": relative_error(out_path, reference)}
            layer.backend = backend
        if profile_kernels:
            try:
                result["formats"][fmt]["kernels_us"] = kernel_times(layer, x, affinities, index, seq_len)
            except Exception as error:  # the profiler is a diagnostic: its failure is recorded, not fatal
                result["formats"][fmt]["kernels_us"] = f"{type(error).__name__}: {error}"[:300]
        if fmt in PEERS:
            peers = time_peers(layer, fmt, peers_src, x, affinities, index, reference, out, flashinfer_site)
            result["formats"][fmt]["peers"] = peers
            timed = [p["us"] for p in peers.values() if "us" in p]
            if timed:
                result["formats"][fmt]["vs_best_peer"] = round(min(timed) / us, 2)
        del layer
        torch.cuda.empty_cache()
    bf16 = result["formats"]["bf16"]
    for entry in result["formats"].values():
        if "us" in entry and "us" in bf16:
            entry["bytes_vs_bf16"] = round(entry["weight_bytes_read"] / bf16["weight_bytes_read"], 3)
            entry["speedup_vs_bf16"] = round(bf16["us"] / entry["us"], 2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS,
                        help="bf16 is always run first: it is the reference and the baseline")
    parser.add_argument("--out", default=None)
    parser.add_argument("--candidates", action=argparse.BooleanOptionalAction, default=True,
                        help="time the W8A8 candidate launch configurations next to the shipped one")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also record each kernel's device time per forward (torch.profiler)")
    parser.add_argument("--decode-variants", action="store_true",
                        help="time variations of the quantized decode's launch configuration (split-K, stages, "
                             "tile width, warps) next to the shipped one")
    parser.add_argument("--paths", action=argparse.BooleanOptionalAction, default=None,
                        help="time the one-launch and separate-kernel decode paths (default: unless "
                             "--decode-variants)")
    parser.add_argument("--vllm-src", default=".peers/vllm_src",
                        help="an unpacked vLLM 0.33.0 wheel (see benchmarks/README.md); absent: peers skipped")
    parser.add_argument("--flashinfer-site", default=".peers/flashinfer/site",
                        help="folder holding flashinfer (benchmarks/flashinfer_carry.sh install); absent and not "
                             "installed: its peer is skipped")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    report = {"benchmark": "gpu_quantized", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_TBps": round(bandwidth / 1e12, 3), "cases": {}}
    for name in args.shapes:
        report["cases"][name] = run_shape(name, bandwidth, args.vllm_src,
                                            ("bf16", *(f for f in args.formats if f != "bf16")), args.candidates,
                                            args.kernel_times, args.decode_variants,
                                            not args.decode_variants if args.paths is None else args.paths,
                                            args.flashinfer_site)
        print(name, json.dumps({f: {k: v for k, v in e.items() if k in ("us", "fraction_of_copy_bandwidth",
                                                                          "speedup_vs_bf16", "rel_err_vs_bf16",
                                                                          "vs_best_peer", "error")}
                                for f, e in report["cases"][name]["formats"].items()}), file=sys.stderr, flush=True)
        if args.out:  # after every shape: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=1))
    print(table(report))
    return 0


def table(report: dict) -> str:
    """One line per shape and format: us, x bf16, fraction of copy bandwidth, best peer time and ratio."""
    lines = [f"{'shape':30s} {'format':16s} {'us':>9s} {'x bf16':>7s} {'copy BW':>8s} {'best peer us':>13s} "
             f"{'peer/ours':>9s} {'rel err':>8s} {'one-launch':>10s} {'multi us':>9s}"]
    for name, case in report["cases"].items():
        for fmt, e in case["formats"].items():
            if "us" not in e:
                lines.append(f"{name:30s} {fmt:16s} {str(e.get('error') or e.get('skipped'))[:60]}")
                continue
            timed = [p["us"] for p in e.get("peers", {}).values() if "us" in p]
            lines.append(f"{name:30s} {fmt:16s} {e['us']:9.1f} {e.get('speedup_vs_bf16', 0):7.2f} "
                         f"{e['fraction_of_copy_bandwidth']:8.2f} {min(timed) if timed else float('nan'):13.1f} "
                         f"{e.get('vs_best_peer', float('nan')):9.2f} {e['rel_err_vs_bf16']:8.4f} "
                         f"{e.get('one_launch', {}).get('us', float('nan')):9.1f} "
                         f"{e.get('multi_launch', {}).get('us', float('nan')):9.1f}")
            for variant, v in e.get("decode_variants", {}).items():
                timing = (f"{v['us']:9.1f} {'':7s} {v['fraction_of_copy_bandwidth']:8.2f}" if "us" in v
                          else v["error"][:60])
                lines.append(f"{'':30s} {'  ' + variant:16s} {timing}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
