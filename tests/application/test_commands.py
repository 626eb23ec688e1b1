"""The application's command line, end to end on the CPU: ``nxd-moe checkpoint`` writes a local checkpoint,
``nxd-moe compile --hf-model`` its compiled directory, ``nxd-moe generate --app`` generates from that directory --
the tokens of the application built in Python from the same checkpoint -- and each refuses bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from nxd_moe.application import ApplicationConfig, CausalLMApplication  # noqa: E402
from nxd_moe.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("commands")
    checkpoint, out = root / "ckpt", root / "compiled"
    assert main(["checkpoint", "--config", "mixtral-8x7b", "--out", str(checkpoint), "--layers", "1", "--scale", "32",
                 "--seed", "5"]) == 0
    assert main(["compile", "--hf-model", str(checkpoint), "--out", str(out), "--batch-size", "2", "--seq-len", "24",
                 "--max-context-length", "8", "--json"]) == 0
    return checkpoint, out


def test_checkpoint_and_compile_write_what_load_reads(compiled, capsys):
    checkpoint, out = compiled
    assert (checkpoint / "config.json").is_file() and list(checkpoint.glob("*.safetensors"))
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "mixtral"
    assert (out / "neuron_config.json").is_file()
    config = json.loads((out / "neuron_config.json").read_text())  # NxDI's: the model's config + neuron_config
    assert config["model_type"] == "mixtral"
    fields = config["neuron_config"]
    assert (fields["batch_size"], fields["seq_len"], fields["max_context_length"]) == (2, 24, 8)


def test_generate_from_the_compiled_directory_gives_the_applications_tokens(compiled, capsys):
    checkpoint, out = compiled
    capsys.readouterr()
    assert main(["generate", "--app", str(out), "--prompt-ids", "3,17,9,250", "--new-tokens", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    app = CausalLMApplication.from_pretrained(checkpoint, ApplicationConfig(batch_size=2, seq_len=24,
                                                                            max_context_length=8))
    expected = app.generate(torch.tensor([[3, 17, 9, 250]]), max_new_tokens=6, eos_token_id=[]).tokens
    assert report["tokens"] == expected.tolist()
    assert (report["prompt_len"], report["new_tokens"]) == (4, 6)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--app", "/nonexistent/app", "--new-tokens", "4"], "nxd-moe generate: error: "),
    (["compile", "--config", "mixtral-8x7b", "--out", "X", "--layers", "-1"], "nxd-moe compile: error: --layers must"),
    (["checkpoint", "--config", "no-such-model", "--out", "X"], "nxd-moe checkpoint: error: "),
])
def test_bad_input_is_one_line_naming_the_command(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    text = str(exit_.value.code)
    assert text.startswith(message) and "\n" not in text
