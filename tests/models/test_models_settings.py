"""The settings of ``nxd_moe.models``' checkpoint writer, static-cache decoder step and ``nxd-moe generate``, each
seen: every argument and flag given a value other than its default, every message whole, the causal mask and the
rotary factors against hand-built references, the timing arithmetic against hand-computed numbers. Fakes stand in
for transformers' models and caches where only the calls matter, so the file runs in seconds."""

from __future__ import annotations

import argparse
import cmath
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from hf_helpers import MODELS, one_intra_op_thread  # noqa: E402, F401

from nxd_moe.models import checkpoint, generate  # noqa: E402
from nxd_moe.models.decoder_step import (  # noqa: E402
    PolarFreeRotaryEmbedding,
    StaticCacheStep,
    check_cache_length,
    replace_polar_rotary_embeddings,
)


@pytest.fixture(autouse=True)
def in_a_scratch_directory(tmp_path, monkeypatch):
    """Each test runs in its own directory: a changed command that writes where it should not (``--config`` taken
    for ``--out``) leaves nothing that a later test of the run would read as a built-in config's name."""
    monkeypatch.chdir(tmp_path)


def actions(add_arguments) -> dict[str, tuple]:
    """``dest -> (flags, required, type, default, help)`` of the arguments ``add_arguments`` adds."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {a.dest: (a.option_strings, a.required, a.type, a.default, a.help) for a in parser._actions
            if a.dest != "help"}


# ----------------------------------------------------------------------------------------------
# nxd_moe.models.checkpoint


SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "[UNK]": 3}


def test_tokenizer_vocabulary_special_tokens_and_chat_template():
    tok = checkpoint._tokenizer(100)  # 100 ids: 4 specials and 96 words (w0..w95), every id < 100
    assert tok.get_vocab() == {**SPECIALS, **{f"w{i}": 4 + i for i in range(96)}}
    assert len(checkpoint._tokenizer(10_000)) == 4 + 512  # the default word count
    assert len(checkpoint._tokenizer(10_000, words=7)) == 4 + 7
    assert tok("w0 w95 w96 zz")["input_ids"] == [4, 99, 3, 3]  # split on whitespace; unknown words are [UNK]
    assert tok("<|im_start|>user w1<|im_end|>")["input_ids"] == [1, 3, 5, 2]  # the special tokens split off
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    assert (tok.unk_token, tok.unk_token_id) == ("[UNK]", 3)
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w1 w2"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nw3<|im_end|>\n<|im_start|>user\nw1 w2<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False) == (
        "<|im_start|>user\nw1 w2<|im_end|>\n")


@pytest.fixture(scope="module")
def tiny_qwen3():
    return MODELS["qwen3_moe"].make()


def test_write_checkpoint_passes_its_settings_and_writes_what_transformers_reads(tiny_qwen3, tmp_path, monkeypatch):
    built = []

    def build(config, **kwargs):
        built.append((config, kwargs))
        return tiny_qwen3

    monkeypatch.setattr(checkpoint, "build_hf_model", build)
    out = checkpoint.write_checkpoint(str(tmp_path / "defaults"))
    assert out == tmp_path / "defaults" and isinstance(out, Path)
    out = checkpoint.write_checkpoint(tmp_path / "given", "mixtral-8x7b", num_layers=3, scale=32, seed=7,
                                      dtype="bfloat16", max_new_tokens=None)
    assert built == [("qwen3-30b-a3b", dict(num_layers=2, scale=16, seed=0, dtype=torch.float32)),
                     ("mixtral-8x7b", dict(num_layers=3, scale=32, seed=7, dtype="bfloat16"))]
    greedy = {"do_sample": False, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}
    written = json.loads((tmp_path / "defaults" / "generation_config.json").read_text())
    assert {k: written.get(k) for k in [*greedy, "max_new_tokens"]} == {**greedy, "max_new_tokens": 16}
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written.get(k) for k in greedy} == greedy and "max_new_tokens" not in written
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"] and not list(out.glob("*.bin"))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("<|im_start|>w0 w1")["input_ids"] == [1, 4, 5] and tok.eos_token == "<|im_end|>"


def test_checkpoint_command_flags(capsys, monkeypatch):
    assert actions(checkpoint.add_arguments) == {
        "config": (["--config"], True, None, None, "a shipped architecture (name or YAML)"),
        "out": (["--out"], True, None, None, "the directory to write"),
        "layers": (["--layers"], False, checkpoint.positive_int, 2, "MoE layers (default 2)"),
        "scale": (["--scale"], False, checkpoint.positive_int, 16, "divide the widths by this (default 16)"),
        "seed": (["--seed"], False, int, 0, None),
        "dtype": (["--dtype"], False, None, "float32", None),
        "max_new_tokens": (["--max-new-tokens"], False, checkpoint.positive_int, 16,
                           "the generation config's max_new_tokens (default 16)"),
    }
    calls = []
    monkeypatch.setattr(checkpoint, "write_checkpoint", lambda *a, **k: calls.append((a, k)) or Path("/ck/pt"))
    args = argparse.Namespace(out="/o", config="dbrx", layers=3, scale=8, seed=5, dtype="bfloat16", max_new_tokens=9)
    assert checkpoint.main(args) == 0
    assert calls == [(("/o", "dbrx"), dict(num_layers=3, scale=8, seed=5, dtype="bfloat16", max_new_tokens=9))]
    assert capsys.readouterr().out == "nxd-moe checkpoint: dbrx (3 MoE layers, scale 1/8) -> /ck/pt\n"


@pytest.mark.parametrize("error", [ValueError, TypeError, FileNotFoundError, ImportError])
def test_checkpoint_command_errors_are_one_line(error, monkeypatch):
    def fail(*args, **kwargs):
        raise error("no such config 'x'")

    monkeypatch.setattr(checkpoint, "write_checkpoint", fail)
    args = argparse.Namespace(out="/o", config="x", layers=1, scale=1, seed=0, dtype="float32", max_new_tokens=1)
    with pytest.raises(SystemExit) as exit_:
        checkpoint.main(args)
    assert exit_.value.code == "nxd-moe checkpoint: error: no such config 'x'"
    assert exit_.value.__suppress_context__


# ----------------------------------------------------------------------------------------------
# nxd_moe.models.decoder_step


def test_check_cache_length_names_the_bound_it_exceeds():
    config = SimpleNamespace(max_position_embeddings=20, sliding_window=None, attention_chunk_size=12)
    assert check_cache_length(config, 12) == 12 and check_cache_length(config, 1) == 1
    with pytest.raises(ValueError) as e:
        check_cache_length(config, 13)
    assert str(e.value) == ("cache_length must be <= the model's attention_chunk_size (12), got 13: beyond it "
                            "transformers' cache rolls its buffer under Python control flow, a graph per position")
    config = SimpleNamespace(max_position_embeddings=20, sliding_window=15)
    assert check_cache_length(config, 15, "tokens") == 15
    with pytest.raises(ValueError) as e:
        check_cache_length(config, 16, "tokens")
    assert str(e.value) == ("tokens must be <= the model's sliding_window (15), got 16: beyond it transformers' "
                            "cache rolls its buffer under Python control flow, a graph per position")
    with pytest.raises(ValueError) as e:
        check_cache_length(config, 21, "tokens")
    assert str(e.value) == ("tokens must be <= the model's max_position_embeddings (20), got 21: the model has no "
                            "positions beyond it")
    assert check_cache_length(SimpleNamespace(max_position_embeddings=20), 20) == 20
    assert check_cache_length(SimpleNamespace(max_position_embeddings=None), 10**6) == 10**6
    assert check_cache_length(SimpleNamespace(), 10**6) == 10**6
    with pytest.raises(ValueError) as e:
        check_cache_length(SimpleNamespace(), 0, "tokens")
    assert str(e.value) == "tokens must be in [1, inf], got 0"
    with pytest.raises(TypeError, match="^cache_length must be an int, got bool True$"):
        check_cache_length(SimpleNamespace(), True)


class FakeRotary(nn.Module):
    def __init__(self, rope_type: str = "default"):
        super().__init__()
        self.rope_type = rope_type
        self.attention_scaling = 0.5
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.25, 0.0625], dtype=torch.float64))


class Llama4TextRotaryEmbedding(FakeRotary):
    """transformers' class name: what replace_polar_rotary_embeddings looks for."""


def test_polar_free_rotary_embedding_is_scaling_times_e_to_the_i_position_frequency():
    rotary = PolarFreeRotaryEmbedding(FakeRotary())
    positions = torch.tensor([[0, 1, 5], [2, 3, 7]])
    got = rotary(torch.zeros(2, 3, dtype=torch.bfloat16), positions)
    assert got.dtype == torch.complex64 and got.shape == (2, 3, 3)
    expected = torch.tensor([[[0.5 * cmath.exp(1j * p * f) for f in (1.0, 0.25, 0.0625)] for p in row]
                             for row in positions.tolist()], dtype=torch.complex128)
    # float32 cos/sin of exact arguments (< 8): a few float32 ulps (2**-24 relative) of values <= 0.5
    assert float((got.to(torch.complex128) - expected).abs().max()) <= 1e-6
    # built on the inputs' device (the buffer follows them): "meta" stands in for an accelerator on a CPU machine
    got = rotary(torch.zeros(2, 3, device="meta"), positions.to("meta"))
    assert (got.device.type, got.shape, got.dtype) == ("meta", (2, 3, 3), torch.complex64)


def test_only_polar_rotary_embeddings_with_a_fixed_frequency_table_are_replaced():
    model = nn.Module()
    model.rotary_emb = Llama4TextRotaryEmbedding("default")
    model.layer = nn.Module()
    model.layer.rotary = Llama4TextRotaryEmbedding("llama3")
    model.layer.dynamic = Llama4TextRotaryEmbedding("dynamic")
    model.longrope = Llama4TextRotaryEmbedding("longrope")
    model.other = FakeRotary("default")  # another family's class
    originals = model.rotary_emb, model.layer.rotary
    assert replace_polar_rotary_embeddings(model) == ["rotary_emb", "layer.rotary"]
    assert isinstance(model.rotary_emb, PolarFreeRotaryEmbedding) and model.rotary_emb.rotary is originals[0]
    assert isinstance(model.layer.rotary, PolarFreeRotaryEmbedding) and model.layer.rotary.rotary is originals[1]
    assert type(model.layer.dynamic) is type(model.longrope) is Llama4TextRotaryEmbedding
    assert type(model.other) is FakeRotary


class FakeLayer:
    def __init__(self):
        self.keys = self.values = self.cumulative_length = None
        self.initialized = None

    def lazy_initialization(self, keys, values):
        self.initialized = (keys, values)


class FakeCausalLM(nn.Module):
    """What StaticCacheStep calls: ``config``, ``get_input_embeddings``, ``forward`` (recording its arguments and
    writing 10 + the layer index at the cache positions, as transformers' layers write their keys and values)."""

    def __init__(self, layer_types=None, positions=64, dtype=torch.bfloat16):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=positions, layer_types=layer_types)
        self.embed = nn.Embedding(10, 4, dtype=dtype)
        self.calls = []

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None):
        self.calls.append(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, cache=past_key_values))
        for i, layer in enumerate(past_key_values.layers):
            if layer.keys is None:  # cache_shapes' forward: the cache allocates (B, 2, 8, 3) keys, (B, 2, 8, 5) values
                layer.keys = torch.zeros(input_ids.shape[0], 2, 8, 3, dtype=torch.bfloat16)
                layer.values = torch.zeros(input_ids.shape[0], 2, 8, 5, dtype=torch.float16)
            else:
                self.cumulative = [layer.cumulative_length for layer in past_key_values.layers]
                start = int(layer.cumulative_length)
                layer.keys[:, :, start:start + input_ids.shape[1]] = 10 + i
                layer.values[:, :, start:start + input_ids.shape[1]] = 10 + i
        return SimpleNamespace(logits=torch.full((*input_ids.shape, 7), 0.25))


class FakeCausalLMWithCache(FakeCausalLM):
    """transformers >= 5.24's argument name."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, cache=None):
        return super().forward(input_ids, attention_mask, position_ids, use_cache, cache)


def fake_cache(step: StaticCacheStep, layers: int):
    cache = SimpleNamespace(layers=[FakeLayer() for _ in range(layers)])
    step._static_cache = lambda: cache
    return cache


def causal_mask(positions: list[int], length: int, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, S, L): 0 at keys <= the token's position, else the dtype's lowest value."""
    mask = torch.full((len(positions), length), torch.finfo(dtype).min, dtype=torch.float64)
    for s, p in enumerate(positions):
        mask[s, :p + 1] = 0
    return mask.to(dtype).expand(batch, 1, -1, -1)


def test_the_mask_is_causal_over_the_whole_cache_and_keyed_by_layer_type():
    step = StaticCacheStep(FakeCausalLM(), 5)
    mask = step._mask(torch.tensor([2, 3]), 3, torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (3, 1, 2, 5)
    assert torch.equal(mask, causal_mask([2, 3], 5, 3, torch.bfloat16))
    on_device = step._mask(torch.tensor([2, 3], device="meta"), 3, torch.bfloat16)  # "meta": an accelerator's stand-in
    assert (on_device.device.type, on_device.shape, on_device.dtype) == ("meta", (3, 1, 2, 5), torch.bfloat16)
    step = StaticCacheStep(FakeCausalLM(["sliding_attention", "full_attention", "sliding_attention"]), 4)
    masks = step._mask(torch.tensor([0]), 2, torch.float32)
    assert sorted(masks) == ["full_attention", "sliding_attention"]
    assert all(torch.equal(m, causal_mask([0], 4, 2, torch.float32)) for m in masks.values())


def test_input_names():
    step = StaticCacheStep(FakeCausalLM(), 4)
    assert step.input_names(0) == [] and step.input_names(1) == ["input_ids"]
    assert step.input_names(2) == ["input_ids", "cache_position"]
    assert step.input_names(5) == ["input_ids", "cache_position", "cache.0.keys", "cache.0.values", "cache.1.keys"]
    assert step.input_names(6)[4:] == ["cache.1.keys", "cache.1.values"]


def test_cache_shapes_come_from_a_one_token_forward_of_batch_size_sequences():
    model = FakeCausalLM()
    step = StaticCacheStep(model, 8)
    fake_cache(step, 2)
    assert step.cache_shapes(3) == [((3, 2, 8, 3), torch.bfloat16), ((3, 2, 8, 5), torch.float16)] * 2
    [call] = model.calls
    assert torch.equal(call["input_ids"], torch.zeros(3, 1, dtype=torch.long)) and call["use_cache"] is True
    with pytest.raises(ValueError) as e:
        step.cache_shapes(0)
    assert str(e.value) == "batch_size must be in [1, inf], got 0"


@pytest.mark.parametrize("model_class", [FakeCausalLM, FakeCausalLMWithCache])
def test_forward_writes_a_copy_of_the_cache_at_cache_position(model_class):
    model = model_class(positions=8)
    step = StaticCacheStep(model, 8)
    assert step.cache_length == 8
    cache = fake_cache(step, 2)
    inputs = [torch.full((2, 1, 8, 3), float(i)) for i in range(4)]
    ids, position = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([4, 5, 6])
    logits, *out = step(ids, position, *inputs)
    assert all(torch.equal(t, torch.full((2, 1, 8, 3), float(i))) for i, t in enumerate(inputs))  # left alone
    for i, t in enumerate(out):
        expected = torch.full((2, 1, 8, 3), float(i))
        expected[:, :, 4:7] = 10 + i // 2
        assert torch.equal(t, expected), i
    assert [layer.initialized for layer in cache.layers] == [(inputs[0], inputs[1]), (inputs[2], inputs[3])]
    assert [int(c) for c in model.cumulative] == [4, 4]
    [call] = model.calls
    assert call["input_ids"] is ids and call["use_cache"] is True and call["cache"] is cache
    assert torch.equal(call["position_ids"], torch.tensor([[4, 5, 6], [4, 5, 6]]))
    assert torch.equal(call["attention_mask"], causal_mask([4, 5, 6], 8, 2, torch.bfloat16))
    assert torch.equal(logits, torch.full((2, 3, 7), 0.25))


def test_forward_refuses_a_wrong_cache_and_an_old_transformers():
    step = StaticCacheStep(FakeCausalLM(), 4)
    fake_cache(step, 2)
    cache = [torch.zeros(1, 1, 4, 2)] * 4
    with pytest.raises(ValueError) as e:
        step(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), *cache[:3])
    assert str(e.value) == "StaticCacheStep: expected keys and values for 2 layers (4 cache tensors), got 3"
    with pytest.raises(ValueError) as e:
        step(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0, 1]]), *cache)
    assert str(e.value) == ("StaticCacheStep: cache_position must have shape (2,) (one position per new token), got "
                            "(1, 2)")
    step._static_cache = lambda: SimpleNamespace(layers=[SimpleNamespace(), SimpleNamespace()])
    with pytest.raises(RuntimeError) as e:
        step(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), *cache)
    assert str(e.value) == (f"transformers {transformers.__version__}: its StaticCache layers keep no "
                            "cumulative_length tensor; StaticCacheStep needs transformers >= 5.23")


def test_the_cache_argument_follows_the_models_forward():
    assert StaticCacheStep(FakeCausalLM(), 4)._cache_argument == "past_key_values"
    assert StaticCacheStep(FakeCausalLMWithCache(), 4)._cache_argument == "cache"
    with pytest.raises(ValueError, match=r"^cache_length must be <= the model's max_position_embeddings \(4\)"):
        StaticCacheStep(FakeCausalLM(positions=4), 5)


# ----------------------------------------------------------------------------------------------
# nxd_moe.models.generate


def test_load_checkpoint_model_refuses_what_it_does_not_read(tmp_path):
    def message(path) -> str:
        with pytest.raises(ValueError) as e:
            generate.load_checkpoint_model(path, torch.float32, torch.device("cpu"))
        return str(e.value)

    missing = tmp_path / "missing"
    assert message(str(missing)) == f"--hf-model must be a local checkpoint directory, got {str(missing)!r}"
    (tmp_path / "file").write_text("x")
    assert message(tmp_path / "file") == f"--hf-model must be a local checkpoint directory, got " \
        f"{str(tmp_path / 'file')!r}"
    assert message(tmp_path) == f"--hf-model {str(tmp_path)!r} has no config.json"
    (tmp_path / "config.json").write_text("{}")
    assert message(tmp_path) == (f"--hf-model {str(tmp_path)!r}: only safetensors checkpoints are read, and it holds "
                                 "no weights; convert it to safetensors first")
    for name in ("z.bin", "a.pt", "m.pth", "b.ckpt", "c.bin", "notes.txt"):
        (tmp_path / name).write_bytes(b"\x80")
    assert message(tmp_path) == (f"--hf-model {str(tmp_path)!r}: only safetensors checkpoints are read, and it holds "
                                 "pickle weights (a.pt, b.ckpt, c.bin, m.pth), which are never unpickled; convert it "
                                 "to safetensors first")


def test_load_checkpoint_model_reads_the_safetensors_in_the_dtype_asked(tiny_qwen3, tmp_path):
    tiny_qwen3.save_pretrained(tmp_path / "broken")
    stored = (tmp_path / "broken" / "model.safetensors").read_bytes()
    (tmp_path / "broken" / "model.safetensors").write_bytes(stored[:1000])
    with pytest.raises(ValueError) as e:
        generate.load_checkpoint_model(tmp_path / "broken", torch.float32, torch.device("cpu"))
    assert str(e.value).startswith(f"--hf-model {str(tmp_path / 'broken')!r} could not be read: SafetensorError: ")
    tiny_qwen3.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")  # never read
    model = generate.load_checkpoint_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    assert not model.training and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    expected = tiny_qwen3.state_dict()
    assert all(torch.equal(t, expected[name].to(torch.bfloat16)) for name, t in model.state_dict().items())
    # moved to the device asked ("meta" stands in for an accelerator on a CPU machine)
    model = generate.load_checkpoint_model(tmp_path, torch.float32, torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}


class RecordingModel:
    def __init__(self):
        self.calls = []

    def generate(self, ids, **kwargs):
        self.calls.append((ids, kwargs, torch.is_inference_mode_enabled()))
        return "tokens"


def test_generate_tokens_asks_transformers_for_exactly_the_greedy_recipe(monkeypatch):
    model, ids = RecordingModel(), torch.zeros(1, 3, dtype=torch.long)
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, synced_gpus=False)
    assert generate.generate_tokens(model, ids, 6, False) == "tokens"
    assert model.calls == [(ids, {**greedy, "disable_compile": True}, True)]
    model.calls.clear()
    generate.generate_tokens(model, ids, 6, True)
    [(_, kwargs, _)] = model.calls
    config = kwargs.pop("compile_config")
    assert kwargs == {**greedy, "cache_implementation": "static"}
    assert (config.fullgraph, config.mode, config._compile_all_devices) == (True, "default", True)
    events = []
    cache = SimpleNamespace(reset=lambda: events.append(("reset", torch.is_inference_mode_enabled())))
    model.generate = lambda ids, **kwargs: events.append(("generate", kwargs)) or "tokens"
    cuda_ids = SimpleNamespace(device=torch.device("cuda", 1))
    generate.generate_tokens(model, cuda_ids, 6, True, cache)
    assert events[0] == ("reset", True)
    kwargs = events[1][1]
    config = kwargs.pop("compile_config")
    assert kwargs == {**greedy, "past_key_values": cache}
    assert (config.fullgraph, config.mode, config._compile_all_devices) == (True, "reduce-overhead", None)
    with pytest.raises(ValueError) as e:
        generate.generate_tokens(model, ids, 6, False, cache)
    assert str(e.value) == "cache: a shared StaticCache is for compiled=True only (eager generate makes its own)"


@pytest.mark.parametrize("world, synced", [(2, True), (1, False)])
def test_generate_tokens_syncs_the_ranks_of_a_world(world, synced, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)
    model = RecordingModel()
    generate.generate_tokens(model, torch.zeros(1, 2, dtype=torch.long), 3, False)
    assert model.calls[0][1]["synced_gpus"] is synced


def test_synchronize_waits_for_the_device_and_the_world(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append(("cuda", device)))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: events.append("barrier"))
    generate._synchronize(SimpleNamespace(is_cuda=True, device="cuda:3"))
    generate._synchronize(torch.zeros(1))
    assert events == [("cuda", "cuda:3")]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    generate._synchronize(torch.zeros(1))
    assert events == [("cuda", "cuda:3"), "barrier"]


def test_static_cache_has_the_length_asked(tiny_qwen3):
    cache = generate.static_cache(tiny_qwen3, 1)
    assert isinstance(cache, transformers.StaticCache) and cache.get_max_length() == 1
    assert generate.static_cache(tiny_qwen3, 9).get_max_length() == 9
    assert len(cache.layers) == tiny_qwen3.config.num_hidden_layers
    with pytest.raises(ValueError) as e:
        generate.static_cache(tiny_qwen3, 0)
    assert str(e.value) == "max_cache_len must be in [1, inf], got 0"


def test_generate_timing_is_the_medians_and_their_difference_per_step():
    ids, out = torch.zeros(2, 3, dtype=torch.long), torch.arange(20).view(2, 10)
    report = generate.generate_timing([0.004, 0.0012345, 0.001], [0.03, 0.0272345, 0.02], ids, 7, out)
    tokens = report.pop("tokens")
    # prefill 1.2345 ms; decode (27.2345 - 1.2345) / 6 = 4.3333 ms per step, 2 sequences / 4.3333 ms = 461.54 /s
    assert report == {"prefill_ms": 1.23, "decode_ms_per_step": 4.333, "decode_tokens_per_s": 461.5}
    assert torch.equal(tokens, torch.tensor([[3, 4, 5, 6, 7, 8, 9], [13, 14, 15, 16, 17, 18, 19]]))
    # a whole generate faster than its prefill: the step is floored at 1e-9 s
    report = generate.generate_timing([0.5], [0.2], torch.zeros(1, 2, dtype=torch.long), 3, out[:1, :5])
    assert (report["decode_ms_per_step"], report["decode_tokens_per_s"]) == (0.0, 2e9)


@pytest.mark.parametrize("compiled", [False, True])
def test_timed_generate_warms_up_then_times_prefills_and_whole_generates(compiled, monkeypatch):
    """Three warm-ups (new_tokens twice, then one token), then per repeat a one-token and a new_tokens generate."""
    clock = [0.0]
    # seconds of each generate: the warm-ups' are large (never counted)
    seconds = iter([9.0, 9.0, 9.0, 0.004, 0.02, 0.009, 0.013, 0.005, 0.017])
    calls, caches = [], []

    def fake_generate(model, ids, n, compiled_, cache):
        calls.append((n, compiled_, cache))
        clock[0] += next(seconds)
        return torch.cat([ids, torch.full((ids.shape[0], n), len(calls))], dim=1)

    monkeypatch.setattr(generate, "generate_tokens", fake_generate)
    monkeypatch.setattr(generate, "static_cache", lambda model, length: caches.append((model, length)) or "cache")
    monkeypatch.setitem(generate.CLOCKS, "wall", lambda: pytest.fail("the wall clock read"))
    monkeypatch.setitem(generate.CLOCKS, "process", lambda: clock[0])
    ids = torch.zeros(2, 4, dtype=torch.long)
    report = generate.timed_generate("model", ids, 5, compiled, 3, clock="process")
    cache = "cache" if compiled else None
    assert calls == [(n, compiled, cache) for n in (5, 5, 1, 1, 5, 1, 5, 1, 5)]
    assert caches == ([("model", 9)] if compiled else [])
    tokens = report.pop("tokens")
    # prefill median 5 ms, whole median 17 ms: (17 - 5) / 4 = 3 ms per step, 2 sequences / 3 ms = 666.7 /s
    assert report == {"prefill_ms": 5.0, "decode_ms_per_step": 3.0, "decode_tokens_per_s": 666.7}
    assert torch.equal(tokens, torch.full((2, 5), 9))


def test_timed_generate_reads_the_wall_clock_by_default_and_names_the_clocks(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setattr(generate, "generate_tokens", lambda model, ids, n, compiled, cache: ids)
    monkeypatch.setitem(generate.CLOCKS, "wall", lambda: next(ticks))
    generate.timed_generate("model", torch.zeros(1, 2, dtype=torch.long), 3, False, 1)
    assert next(ticks) == 10  # (3 warm-ups + 2 timed generates) * 2 readings
    with pytest.raises(ValueError) as e:
        generate.timed_generate("model", torch.zeros(1, 2, dtype=torch.long), 3, False, 1, clock="cpu")
    assert str(e.value) == "clock must be one of ['wall', 'process'], got 'cpu'"


def test_generate_command_flags():
    parser = argparse.ArgumentParser()
    source = generate.add_arguments(parser)
    assert source.required and [a.dest for a in source._group_actions] == ["config", "hf_model"]
    got = actions(generate.add_arguments)
    names = ", ".join(generate.builtin_config_names())
    assert got["config"] == (["--config"], False, None, None, f"YAML path or built-in name ({names}): the "
                             "architecture, with random weights")
    assert got["hf_model"] == (["--hf-model"], False, None, None,
                               "a local transformers checkpoint directory (safetensors only)")
    assert got["scale"] == (["--scale"], False, generate.scale_argument, None,
                            "with --config: divide the widths by this (rounded up to a multiple of 8); 1 = full size; "
                            "'auto' (default): 1 on a GPU, else the layer scale `nxd-moe run` picks")
    assert got["layers"] == (["--layers"], False, int, None, "with --config: decoder layers (default 4; 0 = the "
                             "architecture's full depth)")
    positive = generate.positive_int
    assert {k: v for k, v in got.items() if k not in ("config", "hf_model", "scale", "layers")} == {
        "device": (["--device"], False, None, "cpu", "cpu (default) or cuda / cuda:N"),
        "dtype": (["--dtype"], False, None, None, "default: bfloat16 on a GPU, float32 on a CPU"),
        "batch": (["--batch"], False, positive, 1, "sequences (default 1)"),
        "prompt_len": (["--prompt-len"], False, positive, 32, "prompt tokens (default 32)"),
        "new_tokens": (["--new-tokens"], False, positive, 16, "generated tokens (default 16, >= 2)"),
        "compile": (["--compile"], False, None, False,
                    "transformers' compiled recipe: static cache, decode step under torch.compile("
                    "mode='reduce-overhead', fullgraph=True) (on a CPU: mode='default')"),
        "path": (["--path"], False, None, "patch",
                 "patch (default): nxd_moe.hf.patch_model replaces each sparse-MoE block; experts: transformers' "
                 "blocks with experts_implementation='nxd_moe'"),
        "backend": (["--backend"], False, None, None,
                    "nxd_moe backend (default: triton on CUDA where it imports, else torch)"),
        "repeats": (["--repeats"], False, positive, 3, None),
        "seed": (["--seed"], False, int, 0, None),
        "json": (["--json"], False, None, False, "print one JSON object"),
    }
    assert parser.parse_args(["--config", "x", "--compile", "--json"]).compile is True
    assert [a.choices for a in parser._actions if a.dest == "path"] == [("patch", "experts")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", "x", "--hf-model", "y"])


class FakeMoEModel:
    """What ``run`` reads of a transformers model."""

    def __init__(self, dispatched=True, positions=9, vocab=2):
        self.config = SimpleNamespace(model_type="fake_moe", get_text_config=lambda: self.text)
        self.text = SimpleNamespace(max_position_embeddings=positions, vocab_size=vocab, num_hidden_layers=7)
        self.dispatched = dispatched
        self.calls = []

    def _can_set_experts_implementation(self):
        return self.dispatched

    def set_experts_implementation(self, name):
        self.calls.append(name)


BASELINE = {"prefill_ms": 8.0, "decode_ms_per_step": 3.25, "decode_tokens_per_s": 300.0}
OURS = {"prefill_ms": 3.0, "decode_ms_per_step": 1.5, "decode_tokens_per_s": 700.0}


@pytest.fixture
def fake_run(monkeypatch):
    """``run`` with its model builders, patcher and timer recording their calls."""
    seen = SimpleNamespace(model=FakeMoEModel(), built=[], loaded=[], patched=[], registered=0, timed=[])

    def build(config, **kwargs):
        seen.built.append((config.name, kwargs))
        return seen.model

    def load(path, dtype, device):
        seen.loaded.append((path, dtype, device))
        return seen.model

    def register():
        seen.registered += 1

    def timed(model, ids, new_tokens, compiled, repeats):
        seen.timed.append((list(model.calls), ids, new_tokens, compiled, repeats, len(seen.patched)))
        tokens = torch.tensor([[1, 2, 3], [4, 5, 6]]) if len(seen.timed) == 1 else \
            torch.tensor([[1, 0, 0], [0, 5, 0]])
        return {**(BASELINE if len(seen.timed) == 1 else OURS), "tokens": tokens}

    import nxd_moe.models.hf_models
    import nxd_moe.models.patch

    monkeypatch.setattr(nxd_moe.models.hf_models, "build_hf_model", build)
    monkeypatch.setattr(nxd_moe.models.patch, "patch_model", lambda model, backend: seen.patched.append(backend))
    monkeypatch.setattr(generate, "load_checkpoint_model", load)
    monkeypatch.setattr(generate, "register_experts_implementations", register)
    monkeypatch.setattr(generate, "timed_generate", timed)
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    seen.run = lambda *argv: generate.run(parser.parse_args(argv))
    return seen


def test_run_times_transformers_then_nxd_moes_experts_and_reports_both(fake_run):
    report = fake_run.run("--config", "qwen3-30b-a3b", "--layers", "3", "--batch", "2", "--prompt-len", "4",
                          "--new-tokens", "5", "--repeats", "2", "--seed", "9", "--path", "experts", "--backend",
                          "torch", "--dtype", "bfloat16", "--scale", "4")
    assert fake_run.built == [("qwen3-30b-a3b", dict(num_layers=3, scale=4, dtype=torch.bfloat16,
                                                     device=torch.device("cpu"), seed=9))]
    (before, ids, *rest, patched), (after, ids2, *rest2, _) = fake_run.timed
    assert before == ["grouped_mm"] and after == ["grouped_mm", "nxd_moe_torch"] and fake_run.registered == 1
    assert rest == rest2 == [5, False, 2] and ids2 is ids and patched == 0 and fake_run.patched == []
    assert ids.shape == (2, 4) and ids.dtype == torch.long and set(ids.unique().tolist()) == {0, 1}
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(9).get_state())  # seeded
    assert report == {
        "config": "qwen3-30b-a3b", "scale": 4, "model_type": "fake_moe", "layers": 7, "device": "cpu",
        "dtype": "bfloat16", "batch": 2, "prompt_len": 4, "new_tokens": 5, "compiled": False,
        "transformers": {"experts_implementation": "grouped_mm", **BASELINE},
        "nxd_moe": {"path": "nxd_moe_torch", **OURS},
        "speedup_decode": 2.33, "speedup_prefill": 2.67, "same_tokens": 0.333}  # 700 / 300, 8 / 3, 2 of 6
    fake_run.run("--config", "qwen3-30b-a3b", "--batch", "2", "--prompt-len", "4", "--seed", "9", "--new-tokens", "5")
    assert torch.equal(fake_run.timed[2][1], ids)  # the prompts come from the seed
    fake_run.run("--config", "qwen3-30b-a3b", "--batch", "2", "--prompt-len", "4", "--seed", "10", "--new-tokens", "5")
    assert not torch.equal(fake_run.timed[4][1], ids)


def test_run_patches_the_model_by_default_and_names_its_own_experts(fake_run):
    fake_run.model = FakeMoEModel(dispatched=False)
    report = fake_run.run("--config", "deepseek-v3", "--new-tokens", "2", "--prompt-len", "7", "--compile",
                          "--layers", "0")
    # --scale auto on a CPU: the smallest power of two >= 16 taking the hidden size (7168) to <= 256
    assert fake_run.built == [("deepseek-v3", dict(num_layers=None, scale=32, dtype=torch.float32,
                                                   device=torch.device("cpu"), seed=0))]
    assert fake_run.model.calls == [] and fake_run.patched == [None] and fake_run.registered == 0
    assert [t[0] for t in fake_run.timed] == [[], []] and [t[-1] for t in fake_run.timed] == [0, 1]
    assert [t[2:5] for t in fake_run.timed] == [(2, True, 3)] * 2
    assert report["transformers"]["experts_implementation"] == "FakeMoEModel's own experts"
    assert (report["nxd_moe"]["path"], report["scale"], report["compiled"]) == ("patch_model", 32, True)
    fake_run.model = FakeMoEModel()
    assert fake_run.run("--config", "mixtral-8x7b", "--new-tokens", "2", "--prompt-len", "7", "--path", "experts",
                        "--scale", "auto")["nxd_moe"]["path"] == "nxd_moe"
    assert fake_run.built[-1] == ("mixtral-8x7b", dict(num_layers=4, scale=16, dtype=torch.float32,
                                                       device=torch.device("cpu"), seed=0))
    assert fake_run.model.calls == ["grouped_mm", "nxd_moe"]
    fake_run.run("--config", "mixtral-8x7b", "--new-tokens", "2", "--prompt-len", "7", "--backend", "torch")
    assert fake_run.patched == [None, "torch"]


def test_run_generates_a_checkpoint_as_it_is(fake_run):
    report = fake_run.run("--hf-model", "/some/ckpt", "--new-tokens", "2", "--prompt-len", "3")
    assert fake_run.loaded == [("/some/ckpt", torch.float32, torch.device("cpu"))] and fake_run.built == []
    assert report["hf_model"] == "/some/ckpt" and "config" not in report and "scale" not in report


@pytest.mark.parametrize("argv, message", [
    (["--config", "x", "--new-tokens", "1"],
     "--new-tokens must be >= 2 (one prefill token and at least one decode step), got 1"),
    (["--hf-model", "/c", "--layers", "0"], "--layers: it shapes a --config model; a --hf-model checkpoint is "
                                            "generated as it is"),
    (["--hf-model", "/c", "--scale", "2", "--layers", "1"], "--layers and --scale: they shape a --config model; a "
                                                            "--hf-model checkpoint is generated as it is"),
    (["--config", "x", "--layers", "-1"], "--layers must be >= 0 (0 = full depth), got -1"),
    (["--hf-model", "/c", "--prompt-len", "8", "--new-tokens", "2"],
     "--prompt-len + --new-tokens (10) must be <= the model's max_position_embeddings (9)"),
    (["--hf-model", "/c", "--path", "experts", "--prompt-len", "7", "--new-tokens", "2"],
     "--path experts: transformers does not dispatch FakeMoEModel's experts by name (experts_implementation); use "
     "--path patch"),
])
def test_run_refuses_with_one_message(fake_run, argv, message):
    fake_run.model = FakeMoEModel(dispatched=False)
    with pytest.raises(ValueError) as e:
        fake_run.run(*argv)
    assert str(e.value) == message


def test_run_checks_the_backend_it_is_given_against_the_device(fake_run, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^--backend triton "):  # (not installed, or not on a CPU)
        fake_run.run("--config", "qwen3-30b-a3b", "--backend", "triton")
    assert fake_run.built == []


def test_run_takes_positions_up_to_the_models_and_any_without_a_bound(fake_run):
    fake_run.run("--hf-model", "/c", "--prompt-len", "7", "--new-tokens", "2")  # 9 = max_position_embeddings
    fake_run.model = FakeMoEModel(positions=None)
    fake_run.run("--hf-model", "/c", "--prompt-len", "70", "--new-tokens", "2")
    del fake_run.model.text.max_position_embeddings  # a config without the key
    fake_run.run("--hf-model", "/c", "--prompt-len", "70", "--new-tokens", "2")
    assert len(fake_run.timed) == 6


REPORT = {"config": "qwen3-30b-a3b", "scale": 16, "model_type": "qwen3_moe", "layers": 3, "device": "cpu",
          "dtype": "float32", "batch": 2, "prompt_len": 32, "new_tokens": 16, "compiled": True,
          "transformers": {"experts_implementation": "grouped_mm", **BASELINE},
          "nxd_moe": {"path": "patch_model", **OURS},
          "speedup_decode": 2.33, "speedup_prefill": 1.6, "same_tokens": 0.625}


def test_format_report():
    assert generate.format_report(REPORT) == "\n".join([
        "nxd-moe generate: qwen3-30b-a3b (qwen3_moe, 3 layers, float32 on cpu, compiled), batch 2, prompt 32, 16 new "
        "tokens",
        "transformers (grouped_mm)          prefill      8.00 ms   decode     300.0 tokens/s",
        "nxd_moe (patch_model)              prefill      3.00 ms   decode     700.0 tokens/s",
        "nxd_moe vs transformers: decode x2.33, prefill x1.6; same greedy tokens: 62%"])
    checkpoint_report = {**REPORT, "hf_model": "/m", "compiled": False}
    del checkpoint_report["config"]
    assert generate.format_report(checkpoint_report).splitlines()[0] == (
        "nxd-moe generate: /m (qwen3_moe, 3 layers, float32 on cpu), batch 2, prompt 32, 16 new tokens")


def test_generate_main_prints_the_report_or_its_json(capsys, monkeypatch):
    monkeypatch.setattr(generate, "run", lambda args: dict(REPORT))
    assert generate.main(argparse.Namespace(json=False)) == 0
    assert capsys.readouterr().out == generate.format_report(REPORT) + "\n"
    assert generate.main(argparse.Namespace(json=True)) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == REPORT and out.startswith('{\n  "config": "qwen3-30b-a3b",\n')

    def fail(args):
        raise FileNotFoundError("no such file 'x'")

    monkeypatch.setattr(generate, "run", fail)
    with pytest.raises(SystemExit) as exit_:
        generate.main(argparse.Namespace(json=False))
    assert exit_.value.code == "nxd-moe generate: error: no such file 'x'" and exit_.value.__suppress_context__
