"""``nxd_moe.hf.patch_model`` on a CUDA device: the default backend there (triton), whole small models against
the unpatched transformers model, quantized experts against the torch backend, GPU memory, and no host sync in an
eager decode step. Skipped without CUDA (tests/models/test_patch_model.py covers the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from hf_helpers import LAYERS, MODELS, one_intra_op_thread, randomize_hf_  # noqa: E402,F401 (autouse fixture)

from nxd_moe.hf import patch_model  # noqa: E402
from nxd_moe.models.patch import PatchedMoEBlock  # noqa: E402

# float32 on both sides (the triton kernels multiply float32 with IEEE products, the router with tf32x3): only
# rounding in another summation order, ~1e-6 relative; the CPU tests' bound.
RTOL = 1e-4
PROMPT = torch.randint(0, LAYERS["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(11))
GENERATE = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def on_cuda(name: str, **sizes) -> torch.nn.Module:
    return randomize_hf_(MODELS[name].make(**sizes), seed=0).cuda()


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(PROMPT.cuda()).logits


def generate(model: torch.nn.Module) -> torch.Tensor:
    ids = PROMPT.cuda()
    return model.generate(ids, attention_mask=torch.ones_like(ids), **GENERATE)


@pytest.mark.parametrize("name", list(MODELS))
def test_triton_patched_model_matches_the_unpatched_model(name):
    model = on_cuda(name)
    patched = patch_model(copy.deepcopy(model))
    assert patched.nxd_moe_patched.backend == "triton"  # backend=None on CUDA
    assert rel_err(logits(patched), logits(model)) <= RTOL
    assert torch.equal(generate(patched), generate(model))


@pytest.mark.parametrize("name,quantization,shared,hidden,width", [
    ("mixtral", "fp8", None, 64, 64), ("gpt_oss", "mxfp4", None, 64, 64),
    ("deepseek_v3", "fp8_block", "fp8_block", 128, 128)])
def test_quantized_triton_matches_the_torch_backend(name, quantization, shared, hidden, width):
    """The same quantized weights on both backends."""
    model = on_cuda(name, hidden=hidden, intermediate=width)
    torch_backend = patch_model(copy.deepcopy(model), backend="torch", quantization=quantization,
                                shared_quantization=shared)
    triton_backend = patch_model(copy.deepcopy(model), quantization=quantization, shared_quantization=shared)
    assert triton_backend.nxd_moe_patched.backend == "triton"
    assert rel_err(logits(triton_backend), logits(torch_backend)) <= RTOL


def test_eager_decode_step_makes_no_host_sync():
    model = patch_model(on_cuda("qwen3_moe").to(torch.bfloat16))
    blocks = [m for m in model.modules() if isinstance(m, PatchedMoEBlock)]
    x = torch.randn(8, 1, blocks[0].moe.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for block in blocks:
            block(x)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for block in blocks:
                block(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_gpu_memory_of_the_patched_model():
    """bf16, E=16 experts of 1024 x 512 in 4 layers (50 MB a block): the patched model holds at most 5 % more
    than the unpatched one (float32 routers), during patching at most one block and a quarter more (the new layer
    exists before the old block goes; the earlier layer built with random weights and a converted copy held two),
    and after a prefill and a decode step still within 5 %."""
    config = transformers.Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048,
                                         num_experts=16, num_experts_per_tok=4, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                         vocab_size=1024, norm_topk_prob=True)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (4, 64), device="cuda")

    def after_steps() -> int:
        with torch.no_grad():
            out = model(ids, use_cache=False)
            out = model(ids[:, :1], use_cache=False)
        del out
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    # The unpatched steps come first: their first matmul allocates cuBLAS's workspace through the caching allocator
    # (32 MiB per handle and stream on Hopper), which stays. Measured after it, ``before`` holds the same runtime
    # allocations as ``patched`` (measured before them it was short by exactly that workspace: +32 MiB seen).
    unpatched_steps = after_steps()
    before = torch.cuda.memory_allocated()
    block = sum(p.nbytes for p in model.model.layers[0].mlp.experts.parameters())
    torch.cuda.reset_peak_memory_stats()
    patch_model(model)
    torch.cuda.synchronize()
    patched = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    assert patched <= 1.05 * before, (patched, before)
    assert peak <= before + 1.25 * block, (peak - before, block)
    assert after_steps() <= 1.05 * unpatched_steps


def test_a_quantized_checkpoint_loads_natively_through_transformers_on_the_gpu(tmp_path):
    """On an FP8-capable GPU transformers loads the FP8 checkpoint a patched model saved as FP8 (its FP8Experts
    with 128x128 block scales; on a CPU it dequantizes, tests/models/test_patch_model.py): every tensor loads, the
    experts stay FP8, and the logits are the patched model's up to what transformers adds -- bf16 activations and
    their dynamic E4M3 quantization per 128 columns (2**-4 relative per element; over two layers of this model a
    few percent of the largest logit: 0.1 leaves room, and a wrong layout, e.g. scales transposed, is O(1))."""
    pytest.importorskip("accelerate")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("transformers' FP8 kernels need compute capability >= 8.9")
    model = on_cuda("qwen3_moe", hidden=128, intermediate=128)
    quantized = patch_model(copy.deepcopy(model), quantization="fp8_block")
    quantized.save_pretrained(tmp_path)
    reloaded, info = type(model).from_pretrained(tmp_path, device_map="cuda", dtype=torch.bfloat16,
                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert reloaded.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    try:
        theirs = logits(reloaded).float()
    except ImportError as exc:  # transformers >= 5.17 runs FP8 experts through the `kernels` package
        pytest.skip(f"transformers cannot run its FP8 experts here: {exc}")
    assert rel_err(theirs, logits(quantized)) <= 0.1
