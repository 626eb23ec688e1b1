"""``StaticCacheStep``: a prefill then a decode step over the static KV cache give the logits of transformers' own
forward over the whole sequence (without a cache), for every family, with nxd_moe's MoE patched in; the model input
factory and routing summary of ``nxd_moe.trace``; the Llama 4 rotary embedding without ``torch.polar``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_helpers import one_intra_op_thread  # noqa: E402, F401

from nxd_moe.hf import patch_model  # noqa: E402
from nxd_moe.models.decoder_step import StaticCacheStep, replace_polar_rotary_embeddings  # noqa: E402
from nxd_moe.models.hf_models import build_hf_model  # noqa: E402
from nxd_moe.trace import model_inputs, routing_summary  # noqa: E402

SCALE = 64
CACHE = 12
PROMPT = 7
# One config per transformers family: plain GQA, sliding-window attention with sinks (GPT-OSS), chunked attention
# and no-rope layers (Llama 4), multi-head latent attention with dense layers first (DeepSeek-V3), DBRX's fused QKV.
CONFIGS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "llama4-scout", "deepseek-v3", "dbrx")
# float32 logits of O(1) computed two ways (cache of 12 positions with masked slots, or the plain sequence): both
# round each op to 2**-24 ~ 6e-8; the differences pass through dot products of <= ~200 terms in a few layers, so
# they stay below ~1e2 * 6e-8 ~ 6e-6 of the logits' scale. Measured: <= 4e-7.
REL_TOL = 1e-5


def build(name: str, patched: bool):
    model = build_hf_model(name, num_layers=1, scale=SCALE, attn_implementation="eager")
    return patch_model(model, backend="torch") if patched else model


def empty_cache(step: StaticCacheStep, batch: int) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in step.cache_shapes(batch)]


@torch.no_grad()
def prefill_then_decode(step: StaticCacheStep, ids: torch.Tensor, decode_position: int) -> torch.Tensor:
    """Logits of the prompt (prefill at positions 0..P-1) and of the next token (decoded at
    ``decode_position``), concatenated along the sequence."""
    prompt, last = ids[:, :-1], ids[:, -1:]
    cache = empty_cache(step, ids.shape[0])
    prefill = step(prompt, torch.arange(prompt.shape[1]), *cache)
    decode = step(last, torch.tensor([decode_position]), *prefill[1:])
    return torch.cat([prefill[0], decode[0]], dim=1)


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_match_the_uncached_forward(name):
    reference = build(name, patched=False)
    model = build(name, patched=True)
    replace_polar_rotary_embeddings(model)
    step = StaticCacheStep(model, CACHE).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, PROMPT + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids).logits
    got = prefill_then_decode(step, ids, PROMPT)
    scale = float(expected.abs().max())
    assert scale > 0.05
    assert float((got - expected).abs().max()) <= REL_TOL * scale, name
    # negative control: the next token written one slot too far (a zero key left at PROMPT) is not the same model
    skipped = prefill_then_decode(step, ids, PROMPT + 1)
    assert float((skipped[:, -1] - expected[:, -1]).abs().max()) > 100 * REL_TOL * scale


def test_step_leaves_its_inputs_alone_and_returns_the_whole_cache():
    step = StaticCacheStep(build("qwen3-30b-a3b", patched=True), CACHE).eval()
    make = model_inputs(step, 3, "decode")
    inputs = make(1)
    before = [t.clone() for t in inputs]
    with torch.no_grad():
        out = step(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))
    position = int(inputs[1])
    assert len(out) == len(inputs) - 1 and out[0].shape == (3, 1, step.model.config.vocab_size)
    for new, old in zip(out[1:], inputs[2:]):
        assert new.shape == old.shape
        assert torch.equal(new[:, :, :position], old[:, :, :position])  # the context is kept
        assert new[:, :, position].abs().sum() > 0 and old[:, :, position].abs().sum() == 0  # the new token


def test_model_inputs_vary_tokens_and_positions_and_route_input_0_to_the_same_experts():
    step = StaticCacheStep(build("qwen3-30b-a3b", patched=True), CACHE).eval()
    make = model_inputs(step, 4, "decode", seed=5)
    positions = [int(make(i)[1]) for i in range(3)]
    assert positions == [CACHE - 1, CACHE - 2, CACHE - 3]
    ids, _, *cache = make(0)
    assert (ids == ids[0]).all() and all((t == t[:1]).all() for t in cache)
    summary = routing_summary(step, make(0))
    assert len(summary) == 1 and summary[0]["experts_mode"] == "selective_loading"  # 4 * 8 < 128 experts
    assert (summary[0]["experts_used"], summary[0]["max_expert_tokens"], summary[0]["tokens"]) == (8, 4, 4)
    assert routing_summary(step, make(1))[0]["experts_used"] > 8
    ids, position, *cache = model_inputs(step, 6, "prefill")(2)
    assert ids.shape == (1, 6) and torch.equal(position, torch.arange(6)) and all(not t.any() for t in cache)
    with pytest.raises(ValueError, match="tokens must be <= the cache length"):
        model_inputs(step, CACHE + 1, "prefill")
    with pytest.raises(ValueError, match="mode must be"):
        model_inputs(step, 2, "train")


def test_polar_free_rotary_embedding_is_llama4s():
    model = build("llama4-scout", patched=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(ids).logits
        assert replace_polar_rotary_embeddings(model) == ["model.rotary_emb"]
        after = model(ids).logits
    # cos/sin instead of polar: float32 rounding of the rotation factors only
    assert float((after - before).abs().max()) <= REL_TOL * float(before.abs().max())
    assert list(model.state_dict()) == keys
    assert replace_polar_rotary_embeddings(build("qwen3-30b-a3b", patched=False)) == []


def test_errors_name_the_argument():
    model = build("gpt-oss-20b", patched=False)
    with pytest.raises(ValueError, match=r"cache_length must be <= the model's sliding_window \(128\), got 129"):
        StaticCacheStep(model, 129)
    with pytest.raises(ValueError, match="cache_length"):
        StaticCacheStep(model, 0)
    step = StaticCacheStep(model, 8)
    cache = empty_cache(step, 1)
    with pytest.raises(ValueError, match="expected keys and values for 1 layers"):
        step(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), *cache[:1])
    with pytest.raises(ValueError, match=r"cache_position must have shape \(2,\)"):
        step(torch.zeros(1, 2, dtype=torch.long), torch.tensor([0]), *cache)


def test_replacing_polar_rotary_embeddings_twice_changes_nothing_more():
    """The application replaces them on every model it is given; a model given twice keeps one wrapper."""
    from nxd_moe.models.decoder_step import PolarFreeRotaryEmbedding, replace_polar_rotary_embeddings
    from nxd_moe.models.hf_models import build_hf_model

    model = build_hf_model("llama4-scout", num_layers=1, scale=64)
    assert replace_polar_rotary_embeddings(model) and replace_polar_rotary_embeddings(model) == []
    wrapped = [m for m in model.modules() if isinstance(m, PolarFreeRotaryEmbedding)]
    assert len(wrapped) == 1 and not isinstance(wrapped[0].rotary, PolarFreeRotaryEmbedding)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
