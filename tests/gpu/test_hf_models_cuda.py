"""``build_hf_model`` and ``StaticCacheStep`` on a CUDA device: the weights are the CPU build's of the same dtype
(drawn on the CPU from the seed, then moved), and a prefill plus a decode step over the static cache give the
uncached forward's logits on the GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nxd_moe.config import builtin_config_names  # noqa: E402
from nxd_moe.hf import patch_model  # noqa: E402
from nxd_moe.models.decoder_step import StaticCacheStep, replace_polar_rotary_embeddings  # noqa: E402
from nxd_moe.models.hf_models import build_hf_model  # noqa: E402

SCALE = 64
# float32 on the GPU (TF32 off: torch's default for matmuls): the two computations differ by float32 rounding only,
# bounded as in tests/models/test_decoder_step.py (~1e2 * 2**-24 of the logits' scale).
REL_TOL = 1e-5


@pytest.mark.parametrize("name", builtin_config_names())
def test_cuda_build_holds_the_cpu_builds_weights(name):
    """Same seed and dtype, same weights on either device (another dtype draws other values: not compared)."""
    cpu = build_hf_model(name, num_layers=1, scale=SCALE, seed=3, dtype=torch.bfloat16)
    gpu = build_hf_model(name, num_layers=1, scale=SCALE, seed=3, device="cuda", dtype=torch.bfloat16)
    assert cpu.state_dict().keys() == gpu.state_dict().keys()
    for (key, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values()):
        assert b.device.type == "cuda" and a.device.type == "cpu" and b.dtype == a.dtype, key
        assert torch.equal(a, b.cpu()), key
    ids = torch.randint(0, gpu.config.vocab_size, (2, 5), device="cuda")
    with torch.no_grad():
        assert torch.isfinite(gpu(ids).logits).all()


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "llama4-scout", "deepseek-v3"])
def test_static_cache_step_on_cuda_matches_the_uncached_forward(name):
    assert not torch.backends.cuda.matmul.allow_tf32
    reference = build_hf_model(name, num_layers=1, scale=SCALE, device="cuda", attn_implementation="eager")
    model = patch_model(build_hf_model(name, num_layers=1, scale=SCALE, device="cuda", attn_implementation="eager"),
                        backend="torch")
    replace_polar_rotary_embeddings(model)
    step = StaticCacheStep(model, 12).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1)).cuda()
    cache = [torch.zeros(shape, dtype=dtype, device="cuda") for shape, dtype in step.cache_shapes(2)]
    with torch.no_grad():
        expected = reference(ids).logits
        prefill = step(ids[:, :7], torch.arange(7, device="cuda"), *cache)
        decode = step(ids[:, 7:], torch.tensor([7], device="cuda"), *prefill[1:])
    got = torch.cat([prefill[0], decode[0]], dim=1)
    assert float((got - expected).abs().max()) <= REL_TOL * float(expected.abs().max()), name
