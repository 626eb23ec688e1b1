"""The split-key decode attention kernel on a CUDA device at real models' shapes, in bf16: against float64 softmax
attention, captured in a CUDA graph and replayed with new positions, and under ``torch.compile`` through its op.
Skipped without CUDA (tests/application/test_decode_attention.py runs it under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import assert_rounding_close, capture_cuda_graph, rounding_tolerance  # noqa: E402

from nxd_moe.triton_kernels.decode_attention import decode_attention, decode_attention_op  # noqa: E402


def _reference(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    return (torch.softmax(q.double() @ kk.transpose(-1, -2) * scale + mask.double(), dim=-1) @ vv).transpose(1, 2)


def _mask(positions, keys, dtype):
    allowed = torch.arange(keys, device="cuda")[None, :] <= positions[:, None]
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]


@pytest.mark.parametrize("batch,heads,kv_heads,dim,keys", [
    (1, 32, 4, 128, 2176),   # Qwen3-30B-A3B at batch 1 after a 2048-token prompt
    (16, 32, 4, 128, 384),   # Qwen3-30B-A3B at batch 16
    (4, 64, 8, 64, 1000),    # GPT-OSS-20B's heads
])
def test_bf16_equals_softmax_attention_and_replays_in_a_cuda_graph(batch, heads, kv_heads, dim, keys):
    g = torch.Generator(device="cuda").manual_seed(keys)
    cache = torch.randn(2, batch, kv_heads, keys + 500, dim, device="cuda", generator=g).bfloat16()
    k, v = cache[0, :, :, :keys], cache[1, :, :, :keys]  # the bucket's slice of a longer cache
    q = torch.randn(batch, heads, 1, dim, device="cuda", generator=g).bfloat16()
    positions = torch.randint(keys // 2, keys, (batch,), device="cuda", generator=g)
    mask = _mask(positions, keys, torch.bfloat16)
    scale = dim ** -0.5
    tolerance = rounding_tolerance(torch.bfloat16, keys, triton_roundings=2)
    assert_rounding_close(decode_attention(q, k, v, mask, scale), _reference(q, k, v, mask, scale), tolerance)
    graph, out = capture_cuda_graph(lambda: decode_attention(q, k, v, mask, scale))
    mask.copy_(_mask(positions // 3, keys, torch.bfloat16))  # other positions, same buffers
    graph.replay()
    assert_rounding_close(out, _reference(q, k, v, mask, scale), tolerance)


def test_the_compiled_op_equals_the_kernel():
    q = torch.randn(2, 16, 1, 128, device="cuda").bfloat16()
    k, v = torch.randn(2, 2, 2, 300, 128, device="cuda").bfloat16().unbind(0)
    mask = _mask(torch.tensor([100, 299], device="cuda"), 300, torch.bfloat16)
    compiled = torch.compile(lambda *a: decode_attention_op(*a, 0.1) * 2, fullgraph=True)
    assert torch.equal(compiled(q, k, v, mask), decode_attention(q, k, v, mask, 0.1) * 2)
