"""The application's greedy generation against transformers' greedy ``generate`` on the same weights, every family
served: a batch of three prompts of different lengths (left-padded for transformers, as its ``generate`` wants;
the application packs them right-padded into its buckets), 28 new tokens across three token-generation buckets,
one sequence ending early at an EOS token."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from nxd_moe.application import ApplicationConfig, CausalLMApplication  # noqa: E402
from nxd_moe.models.hf_models import build_hf_model  # noqa: E402

FAMILIES = ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v3", "llama4-scout", "llama4-maverick", "dbrx"]
LENGTHS = [5, 9, 7]
NEW = 28


def config(**kw) -> ApplicationConfig:
    base = dict(batch_size=4, seq_len=48, max_context_length=16, torch_dtype="float32",
                context_encoding_buckets=[8, 16], token_generation_buckets=[16, 32])
    base.update(kw)
    return ApplicationConfig(**base)


def left_padded(vocab: int, lengths=LENGTHS, pad: int = 0):
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(10 + b))
        mask[b, width - n:] = 1
    return ids, mask


def hf_greedy(model, ids, mask, eos):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=eos)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = build_hf_model(request.param, num_layers=1, scale=32, seed=3)
    ids, mask = left_padded(model.config.get_text_config().vocab_size)
    free = hf_greedy(model, ids, mask, None)[:, ids.shape[1]:]
    # EOS: the first token a sequence emits from its 4th on that it has not emitted before (so it ends there)
    row, end = next((b, i + 1) for b in range(len(LENGTHS)) for i in range(3, NEW // 2)
                    if int(free[b, i]) not in free[b, :i].tolist())
    return request.param, model, ids, mask, (int(free[row, end - 1]), row, end)


def test_greedy_tokens_equal_transformers(family):
    name, model, ids, mask, (eos, row, end) = family
    expected = hf_greedy(model, ids, mask, eos)
    app = CausalLMApplication(model, config())
    out = app.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0, read_every=5)
    assert out.sequences.shape == expected.shape, name
    assert torch.equal(out.sequences, expected), name
    assert out.lengths[row] == end and out.tokens[row, end:].eq(0).all(), "it ends at its EOS, pads after"


def test_right_padded_input_gives_the_same_tokens(family):
    """NxDI's tokenizers pad on the right: the same prompts, padded there, give the same generated tokens."""
    name, model, ids, mask, (eos, _, _) = family
    if name not in ("qwen3-30b-a3b", "llama4-scout"):
        pytest.skip("the packing is the families' common code: two families show it")
    left = CausalLMApplication(model, config()).generate(ids, mask, max_new_tokens=12, eos_token_id=eos).tokens
    right_ids, right_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for b, n in enumerate(LENGTHS):
        right_ids[b, :n], right_mask[b, :n] = ids[b, -n:], 1
    app = CausalLMApplication(model, config(padding_side="right"))
    assert torch.equal(app.generate(right_ids, right_mask, max_new_tokens=12, eos_token_id=eos).tokens, left)


def test_groups_of_context_encoding_and_batch_padding_change_nothing():
    """``ctx_batch_size`` 1 (NxDI's demo: prompts encoded one at a time into their cache lines) and a batch smaller
    than ``batch_size`` (dummy lines, done from the start) give the tokens of the plain run."""
    model = build_hf_model("qwen3-30b-a3b", num_layers=2, scale=16, seed=3)
    ids, mask = left_padded(model.config.vocab_size)
    plain = CausalLMApplication(model, config(batch_size=3)).generate(ids, mask, max_new_tokens=10,
                                                                      eos_token_id=[]).tokens
    grouped = CausalLMApplication(model, config(batch_size=4, ctx_batch_size=1))
    assert torch.equal(grouped.generate(ids, mask, max_new_tokens=10, eos_token_id=[]).tokens, plain)


def test_streaming_delivers_every_token_once_in_order():
    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=16, seed=3)
    ids, mask = left_padded(model.config.vocab_size)
    blocks = []
    out = CausalLMApplication(model, config()).generate(ids, mask, max_new_tokens=23, eos_token_id=[],
                                                         read_every=4, on_tokens=blocks.append)
    assert [b.shape[1] for b in blocks] == [1, 4, 4, 4, 4, 4, 2]
    assert torch.equal(torch.cat(blocks, dim=1), out.tokens)


def test_generation_stops_once_every_sequence_is_done():
    """All three sequences end at an EOS long before the budget: the loop stops within two reads of it (it reads
    the flags one block late, so the device is never waited for) and the output is as long as the longest."""
    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=16, seed=3)
    ids, mask = left_padded(model.config.vocab_size)
    app = CausalLMApplication(model, config())
    free = app.generate(ids, mask, max_new_tokens=30, eos_token_id=[]).tokens
    eos = [int(free[b, 2]) for b in range(3)]  # each sequence's third token ends it (or an earlier one)
    out = app.generate(ids, mask, max_new_tokens=30, eos_token_id=eos, read_every=2)
    assert int(out.lengths.max()) <= 3 and out.tokens.shape[1] == int(out.lengths.max())
    assert out.timings["steps"] <= 3 + 2 * 2


def test_progress_bar_counts_every_token(capsys):
    model = build_hf_model("qwen3-30b-a3b", num_layers=1, scale=16, seed=3)
    ids, mask = left_padded(model.config.vocab_size)
    CausalLMApplication(model, config()).generate(ids, mask, max_new_tokens=13, eos_token_id=[], read_every=5,
                                                  progress=True)
    assert "13/13" in capsys.readouterr().err


@pytest.mark.parametrize("name, key", [("gpt-oss-20b", "sliding_window"), ("llama4-scout", "attention_chunk_size")])
def test_generation_past_the_sliding_window_and_chunk_equals_transformers(name, key):
    """Positions beyond GPT-OSS's sliding window and across Llama 4's attention chunks (both set small here):
    the cache keeps every position and the mask does the windowing; transformers' own caches roll or chunk. Equal
    prompt lengths, so transformers' positions (cache slots) are the tokens' own."""
    model = build_hf_model(name, num_layers=1, scale=32, seed=5)
    text = model.config.get_text_config()
    setattr(text, key, 6)
    ids = torch.randint(1, text.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = CausalLMApplication(model, config()).generate(ids, max_new_tokens=20, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out.sequences, expected), name
