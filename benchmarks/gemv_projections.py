"""The attention projections' GEMVs at decode sizes: a one-pass Triton GEMV against cuBLAS (``F.linear``).

    python3 benchmarks/gemv_projections.py FILE.json        # on a GPU

Asks whether the application's B=1 step could read its projection weights closer to the copy bandwidth with a
GEMV kernel of its own (docs/application.md: q/k/v as one cuBLAS GEMV 8.0 us, o 7.4 + 1.8 us of split-K reduction
per layer). Shapes (N, K) of Qwen3-30B-A3B's stacked q/k/v (5120, 2048), its o (2048, 4096) and one between
(4608, 2048); M = 1, 2, 4 rows. Each contender is timed inside one CUDA graph of back-to-back calls, each call
on another copy of the weight (copies spanning ~512 MiB, so the weights come from HBM as in a model whose layers each
have their own); microseconds per call, the weight's bytes per time as TB/s. The Triton kernel: each program a block
of ``BLOCK_N`` output columns over all of K (fp32 sums of products, no split-K), the best of a sweep of block sizes
and warps per shape. Roofline: the device copy bandwidth measured in the same run (``copy_TBps``; bytes read +
written by a 256 MiB copy). Output checked against a float64 product (``max_err``). Writes JSON.
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om, M: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & n_ok[None, :])


def gemv(x, w, out, bn, bk, warps):
    M, K = x.shape
    N = w.shape[0]
    bm = max(1, triton.next_power_of_2(M))
    _gemv[(triton.cdiv(N, bn),)](x, w, out, N, K, x.stride(0), w.stride(0), out.stride(0), M=M, BLOCK_M=bm,
                                 BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def timed(fn, copies, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in copies:
            fn(c)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in copies:
            fn(c)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / len(copies)


def main():
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "rows": []}
    x0 = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    src = torch.empty_like(x0)
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    x0.copy_(src)
    a.record()
    for _ in range(10):
        x0.copy_(src)
    b.record()
    torch.cuda.synchronize()
    copy_tbps = 2 * x0.numel() * 10 / (a.elapsed_time(b) * 1e-3) / 1e12
    result["copy_TBps"] = copy_tbps
    del x0, src
    for (N, K), M in itertools.product([(5120, 2048), (2048, 4096), (4608, 2048)], [1, 2, 4]):
        n_copies = max(4, int(4 * 2 ** 30 // (N * K * 2) // 8))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n_copies)]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().t())
        cublas = timed(lambda w, x=x: F.linear(x, w), ws)
        best = None
        for bn, bk, warps in itertools.product([2, 4, 8, 16], [256, 512, 1024], [4, 8]):
            if bn * bk * max(1, triton.next_power_of_2(M)) > 16384:
                continue
            try:
                gemv(x, ws[0], out, bn, bk, warps)
                err = (out.double() - ref).abs().max().item()
                t = timed(lambda w, x=x, out=out, c=(bn, bk, warps): gemv(x, w, out, *c), ws)
            except Exception as exc:  # noqa: BLE001
                print("fail", bn, bk, warps, exc, file=sys.stderr)
                continue
            if best is None or t < best[0]:
                best = (t, bn, bk, warps, err)
        bytes_ = N * K * 2
        row = dict(N=N, K=K, M=M, cublas_us=round(cublas, 2), cublas_TBps=round(bytes_ / cublas / 1e6, 2),
                   triton_us=round(best[0], 2), triton_TBps=round(bytes_ / best[0] / 1e6, 2),
                   config=dict(BLOCK_N=best[1], BLOCK_K=best[2], num_warps=best[3]), max_err=best[4],
                   speedup=round(cublas / best[0], 3))
        print(row, flush=True)
        result["rows"].append(row)
        del ws
    if len(sys.argv) > 1:
        json.dump(result, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
