"""The application on a CUDA device: every bucket's step captured as a CUDA graph and replayed, against the same
application run eagerly and against transformers' greedy ``generate``; no synchronisation inside the token loop.
Skipped without CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nxd_moe.application import ApplicationConfig, CausalLMApplication, SamplingConfig  # noqa: E402
from nxd_moe.models.hf_models import build_hf_model  # noqa: E402

SCALE = 32


def _config(**kw):
    base = dict(batch_size=3, seq_len=64, max_context_length=32, torch_dtype="float32",
                context_encoding_buckets=[8, 32], token_generation_buckets=[16, 32, 64])
    base.update(kw)
    return ApplicationConfig(**base)


def _prompts(vocab: int):
    lengths = [5, 11, 7]
    ids = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, 11 - n:] = torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(b))
        mask[b, 11 - n:] = 1
    return ids, mask


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3"])
@pytest.mark.parametrize("compiled", [False, True])
def test_graph_replay_equals_eager_and_transformers(name, compiled):
    """float32, 11-token prompts, 40 new tokens (positions 11..50: three token-generation buckets): the eager
    application on the torch backend gives transformers' greedy ``generate`` tokens on the same weights; the graphed
    application (triton backend, every bucket a CUDA graph, token generation compiled or not) gives the eager
    application's on the same backend."""
    assert not torch.backends.cuda.matmul.allow_tf32
    reference = build_hf_model(name, num_layers=2, scale=SCALE, device="cuda", seed=1)
    ids, mask = _prompts(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False,
                                      pad_token_id=0, eos_token_id=None).cpu()

    def app(**kw):
        return CausalLMApplication(build_hf_model(name, num_layers=2, scale=SCALE, device="cuda", seed=1), _config(),
                                   **kw)

    kwargs = dict(max_new_tokens=40, eos_token_id=[], pad_token_id=0)
    assert torch.equal(app(backend="torch", cuda_graphs=False).generate(ids, mask, **kwargs).sequences, expected)
    eager = app(cuda_graphs=False).generate(ids, mask, **kwargs).sequences
    graphed = app(compile_token_generation=compiled)
    graphed.load()
    assert len(graphed.runner.graphs) == 5
    assert torch.equal(graphed.generate(ids, mask, read_every=7, **kwargs).sequences, eager)
    # a second call with other prompts replays the same graphs (nothing captured again)
    graphs = dict(graphed.runner.graphs)
    graphed.generate(ids[:2, -4:], max_new_tokens=9, eos_token_id=[])
    assert graphed.runner.graphs == graphs


@pytest.mark.parametrize("compiled", [False, True])
def test_graphed_batch_of_16_decodes_in_separate_kernels_and_equals_eager(compiled, monkeypatch):
    """Qwen3-style layers (128 experts, top-8) at batch 16: 128 (token, expert) pairs per token step, which the
    triton backend decodes in separate kernels inside the application's replayed steps (and in one launch when run
    eagerly); the graphed application's tokens equal the eager one's."""
    from nxd_moe.graphs import in_replayed_steps
    from nxd_moe.triton_kernels import persistent_decode

    seen = []  # (inside replayed steps, tokens) of each one-launch decode; run by the layer, or by its op at run time
    one_launch = persistent_decode.moe_decode

    def recorded(hidden_states, *args):
        seen.append((in_replayed_steps(), hidden_states.shape[0]))
        return one_launch(hidden_states, *args)

    monkeypatch.setattr(persistent_decode, "moe_decode", recorded)
    config = _config(batch_size=16, context_encoding_buckets=[16],
                     token_generation_buckets=[32])
    ids = torch.randint(1, 100, (16, 9), generator=torch.Generator().manual_seed(5))

    def app(**kw):
        return CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=2, scale=SCALE, device="cuda",
                                                  seed=2), config, **kw)

    eager = app(cuda_graphs=False).generate(ids, max_new_tokens=12, eos_token_id=[]).sequences
    assert (False, 16) in seen
    seen.clear()
    graphed = app(compile_token_generation=compiled)
    graphed.load()
    assert all(tokens != 16 for _, tokens in seen)  # (the one-token decodes the load runs stay one launch)
    assert torch.equal(graphed.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences, eager)


def test_no_synchronisation_inside_the_token_loop():
    """The token-generation replays and the asynchronous reads of the loop make no synchronising CUDA call
    (torch's sync debug mode turns one into an error); a read of a device value would (the negative control)."""
    from nxd_moe.application.generation import _read_async

    app = CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, device="cuda"), _config())
    app.load()
    ids, mask = _prompts(app.programs.text_config.vocab_size)
    app.generate(ids, mask, max_new_tokens=4, eos_token_id=[])
    runner = app.runner
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for _ in range(4):
                runner.token_generation(32)
            _read_async(runner, 3, 0, 4, None)
        with pytest.raises(RuntimeError, match="synchroniz"):
            runner.done.any().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_compiled_token_step_keeps_the_decode_kernels_scratch(monkeypatch):
    """The token-generation step is compiled without Inductor's CUDA-graph trees and captured by the runner, so the
    one-launch decode inside keeps its plan's scratch (made in the warm-up, outside any graph) instead of allocating
    and zeroing it in every replay; negative control: without the runner's declaration the compiled step's plans
    keep none. Both generate the same tokens."""
    from nxd_moe.application import runner
    from nxd_moe.triton_kernels import persistent_decode

    def run(declared: bool):
        monkeypatch.setattr(persistent_decode, "_PLANS", {})
        if not declared:
            monkeypatch.setattr(runner, "kept_kernel_memory", contextlib.nullcontext)
        app = CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=2, scale=SCALE, device="cuda", seed=2),
                                  _config(), compile_token_generation=True)
        app.load()
        plans = [p for p in persistent_decode._PLANS.values() if p.sizes[0] == 3]  # the token steps' (B=3)
        ids, mask = _prompts(app.programs.text_config.vocab_size)
        return plans, app.generate(ids, mask, max_new_tokens=30, eos_token_id=[], pad_token_id=0).sequences

    kept, tokens = run(True)
    assert kept and all(p.scratch is not None for p in kept)
    fresh, expected = run(False)
    assert fresh and all(p.scratch is None for p in fresh)
    assert torch.equal(tokens, expected)


def test_sampling_graph_is_reproducible_and_varies_with_the_seed():
    app = CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, device="cuda"),
                              _config(on_device_sampling_config=SamplingConfig(do_sample=True, top_k=50,
                                                                               temperature=1.5)))
    app.load()
    ids, mask = _prompts(app.programs.text_config.vocab_size)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(app.generate(ids, mask, max_new_tokens=20, eos_token_id=[]).tokens)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_a_hundred_generate_calls_capture_and_compile_nothing_after_load():
    """Prompt lengths and batch sizes varying within the buckets: after ``load`` no call captures a graph or makes
    Dynamo compile (its frame counter stays), and every call still gives the eager application's tokens."""
    import torch._dynamo.utils as dynamo_utils

    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, device="cuda", seed=4)
    app = CausalLMApplication(model, _config())
    app.load()
    graphs = dict(app.runner.graphs)
    compiled = dict(dynamo_utils.counters["stats"])
    eager = CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=1, scale=SCALE, device="cuda", seed=4),
                                _config(), cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    for call in range(100):
        batch, length = 1 + call % 3, 1 + call % 29
        ids = torch.randint(1, 1000, (batch, length), generator=g)
        new = 2 + call % 30
        out = app.generate(ids, max_new_tokens=new, eos_token_id=[])
        if call % 25 == 0:
            assert torch.equal(out.tokens, eager.generate(ids, max_new_tokens=new, eos_token_id=[]).tokens), call
    assert app.runner.graphs == graphs
    assert dict(dynamo_utils.counters["stats"]) == compiled
