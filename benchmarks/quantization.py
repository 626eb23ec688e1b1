"""Decode with quantized expert weights vs bf16: bytes read, CPU time (torch backend), simulated Trn2 estimate.

For one model config (default Mixtral-8x7B, scaled for the CPU part) and each weight format (``bf16``, ``fp8``,
``fp8_block``, ``mxfp4``):

- ``bytes_read``: the routed experts' stored weight bytes (values + scales; biases excluded) that the decode step
  reads -- the distinct chosen experts for selective loading, every expert for all-experts. Analytic from the
  stored tensors' sizes; bf16 is stored in bfloat16.
- ``cpu_ms``: the layer's decode step on this CPU (torch backend, bfloat16 compute, interleaved timing, see
  ``_timing.py``). On CPU the dequantization is extra work done by the same cores that would otherwise stream
  the weights, so a smaller byte count need not mean a faster step here; the column shows what it costs.
- ``max_abs_err_vs_bf16``: the quantized layer's output against the bf16 layer's (same random weights).
- ``trn2_estimate_us``: ``nxd-moe plan``'s cost model on the *full-size* per-rank problem (one rank, LNC2): the
  decode kernel in a counting run with the weights DMA'd as stored and dequantized on chip. A model, not a
  measurement (``docs/nki.md``).

Output: one JSON object on stdout (``--out FILE`` writes it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import time_interleaved  # noqa: E402

from nxd_moe.build import build_moe, scaled_model  # noqa: E402
from nxd_moe.config import load_model_config  # noqa: E402
from nxd_moe.experts.mode import ExpertsMode  # noqa: E402
from nxd_moe.nki_kernels.plan import decode_candidate, rank_problem  # noqa: E402
from nxd_moe.quantization import QUANTIZATION_CHOICES  # noqa: E402
from nxd_moe.quantization.quantizer import expert_weight_bytes  # noqa: E402

MODES = {"selective_loading": ExpertsMode.SELECTIVE_LOADING, "all_experts": ExpertsMode.ALL_EXPERTS}


def bytes_read(moe, expert_index: torch.Tensor, mode: str) -> int:
    experts = moe.expert_mlps.num_experts
    touched = experts if mode == "all_experts" else int(expert_index.unique().numel())
    return expert_weight_bytes(moe.expert_mlps) * touched // experts


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model = load_model_config(args.config)
    shapes = scaled_model(model, args.scale, "fp8_block")  # one shape that every format's blocks divide
    layers = {q: build_moe(shapes, dtype=torch.bfloat16, seed=args.seed, quantization=q)
              for q in QUANTIZATION_CHOICES}
    cfg = layers["bf16"].expert_mlps.routed_experts_mlp_config
    generator = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, 1, cfg.hidden_size, generator=generator).to(torch.bfloat16)
    results = {}
    for mode_name, mode in MODES.items():
        with torch.no_grad():
            flat = x.view(-1, cfg.hidden_size)
            _, affinities, expert_index = layers["bf16"].router(flat)
            outputs = {q: m.expert_mlps(flat, affinities.to(flat.dtype), expert_index, seq_len=1, mode=mode)
                       for q, m in layers.items()}
            timing = time_interleaved(
                {q: (lambda m=m, flat=flat, affinities=affinities, expert_index=expert_index, mode=mode:
                     m.expert_mlps(flat, affinities.to(flat.dtype), expert_index, seq_len=1, mode=mode))
                 for q, m in layers.items()}, repeats=args.repeats)
        base = bytes_read(layers["bf16"], expert_index, mode_name)
        rows = {}
        for q, m in layers.items():
            read = bytes_read(m, expert_index, mode_name)
            rows[q] = {"bytes_read": read, "bytes_vs_bf16": read / base, "cpu_ms": timing[q]["median_ms"],
                       "cpu_ms_p10": timing[q]["p10_ms"], "cpu_ms_p90": timing[q]["p90_ms"],
                       "max_abs_err_vs_bf16": float((outputs[q].float() - outputs["bf16"].float()).abs().max()),
                       "max_abs_bf16_output": float(outputs["bf16"].float().abs().max())}
        results[mode_name] = rows
    trn2 = {}
    for q in QUANTIZATION_CHOICES:
        full = dataclasses.replace(model, experts={**model.experts, "quantization": q})
        problem = rank_problem(full, args.batch)
        trn2[q] = {}
        for mode_name, mode in MODES.items():
            c = decode_candidate(problem, args.batch, mode, 2, "decode")
            trn2[q][mode_name] = {"dma_bytes": c.dma_bytes, "estimated_us": c.estimated_us, "bound": c.bound,
                                  "error": c.error}
    return {
        "benchmark": "quantization",
        "config": model.name,
        "cpu_shapes": {"scale": args.scale, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                       "num_experts": cfg.num_experts, "top_k": cfg.top_k, "decode_batch": args.batch},
        "cpu": results,
        "trn2_full_size_per_rank": trn2,
        "environment": {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": platform.machine()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="mixtral-8x7b")
    parser.add_argument("--scale", type=int, default=8, help="divide H and I by this for the CPU part")
    parser.add_argument("--batch", type=int, default=4, help="decode sequences")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
