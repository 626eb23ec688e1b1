"""transformers' experts interface served by nxd_moe on a GPU: ``experts_implementation="nxd_moe"`` picks the triton
backend for CUDA tensors. Tiny whole models of the five decorated families against transformers' ``eager`` experts,
which kernels ran, GPU memory after switching, and the torch backend compiled. CPU coverage (float64 references,
the triton kernels under the interpreter, errors): ``tests/models/test_experts_backend.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hf_helpers import DISPATCHING_FAMILIES, LAYERS, LOGITS_RTOL, ExpertsModeSpy, tiny_causal_lm, token_ids  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

import nxd_moe.hf  # noqa: E402,F401 (registers the implementations)
import nxd_moe.models.experts_backend as backend_module  # noqa: E402
from nxd_moe.triton_kernels.backend import TritonBackend  # noqa: E402

# bf16 logits: eager and nxd_moe round differently (unit roundoff 2**-8) through two layers; 16 roundings' worth of
# the largest logit bounds what rounding alone does to a token, a wrong gate or layout is O(1) on every token.
BF16_LOGITS_RTOL = 16 * 2.0 ** -8


def _relative(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("family", DISPATCHING_FAMILIES)
def test_whole_model_on_the_triton_backend_matches_eager(family, monkeypatch):
    model = tiny_causal_lm(family, torch.float32, "cuda")
    spy = ExpertsModeSpy(monkeypatch)
    backends = []
    original = backend_module._automatic_backend
    monkeypatch.setattr(backend_module, "_automatic_backend",
                        lambda h: backends.append(original(h)) or backends[-1])
    # (1, 600): T*k > 1024 -> blockwise on the triton rule; (2, 20) and decode: one-launch selective loading.
    prompts = [token_ids(1, 600, seed=1).cuda(), token_ids(2, 20, seed=2).cuda()]
    mask = torch.ones(2, 6, dtype=torch.long, device="cuda")
    with torch.no_grad():
        reference = [model(ids).logits for ids in prompts]
        greedy = model.generate(prompts[1][:, :6], attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                do_sample=False)
        model.set_experts_implementation("nxd_moe")
        ours = [model(ids).logits for ids in prompts]
        ours_greedy = model.generate(prompts[1][:, :6], attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False)
    for got, want in zip(ours, reference):
        assert _relative(got, want) <= LOGITS_RTOL
    assert torch.equal(ours_greedy, greedy)
    assert backends and all(isinstance(b, TritonBackend) for b in backends)
    assert {"blockwise", "selective_loading"} <= set(spy.modes)


@pytest.mark.parametrize("implementation", ["nxd_moe", "nxd_moe_torch"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_whole_model(family, implementation):
    """bf16: decode-sized (2, 40) and a (1, 600) prefill (triton: blockwise, on Hopper the TMA prefill path; GPT-OSS's
    interleaved gate/up then runs the tile-per-program gate/up kernel)."""
    model = tiny_causal_lm(family, torch.bfloat16, "cuda")
    for ids in (token_ids(2, 40, seed=3).cuda(), token_ids(1, 600, seed=5).cuda()):
        with torch.no_grad():
            model.set_experts_implementation("eager")
            reference = model(ids).logits
            model.set_experts_implementation(implementation)
            ours = model(ids).logits
        assert ours.dtype == torch.bfloat16
        # Layer 0's experts round differently, so layer 1's router may flip a near-tied expert for a few tokens:
        # nearly every token must agree within the bound.
        error = (ours.float() - reference.float()).abs().amax(dim=-1)
        agree = (error <= BF16_LOGITS_RTOL * reference.float().abs().max()).float().mean().item()
        assert agree >= 0.95, f"{family} {implementation}: {agree:.1%} of tokens within the bf16 bound"


def test_switching_costs_no_gpu_memory():
    """A model with 0.4 GB of bf16 expert weights: after switching to nxd_moe and running a prefill and decode
    steps, the memory held is within 5 % of what the unswitched model held after the same calls."""
    config = Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                            head_dim=64, **{**LAYERS, "num_attention_heads": 16, "num_key_value_heads": 4,
                                            "vocab_size": 1024})
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").to("cuda",
                                                                                         torch.bfloat16).eval()
    experts = [m for m in model.modules() if backend_module.is_experts_module(m)]
    pointers = [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for m in experts]
    ids = token_ids(4, 256, seed=4).cuda()

    def held_after_calls() -> int:
        with torch.no_grad():
            model(ids)
            model.generate(ids[:, :8], max_new_tokens=4, min_new_tokens=4, do_sample=False,
                           attention_mask=torch.ones(4, 8, dtype=torch.long, device="cuda"))
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    unswitched = held_after_calls()
    model.set_experts_implementation("nxd_moe")
    switched = held_after_calls()
    assert switched <= 1.05 * unswitched, f"{switched / 2**20:.1f} MiB held vs {unswitched / 2**20:.1f} MiB"
    assert [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for m in experts] == pointers


def test_torch_backend_compiles_on_cuda():
    """``nxd_moe_torch`` in bf16 (grouped_mm inside the graph) under ``fullgraph=True``."""
    from nxd_moe.trace import static_backend

    model = tiny_causal_lm("mixtral", torch.bfloat16, "cuda")
    model.set_experts_implementation("nxd_moe_torch")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(40, experts.gate_up_proj.shape[2], device="cuda", dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(8, device="cuda")[:2] for _ in range(40)])
    weight = torch.rand(40, 2, device="cuda")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(experts, fullgraph=True, dynamic=False, backend=static_backend("aot_eager"))
        with torch.no_grad():
            got, expected = compiled(x, index, weight), experts(x, index, weight)
    finally:
        torch._dynamo.reset()
    assert _relative(got, expected) <= BF16_LOGITS_RTOL
