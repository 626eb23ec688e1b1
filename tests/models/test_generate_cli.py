"""``nxd-moe generate``: what it refuses, and how. Every refusal is exit status 2 and one line naming the argument,
the file or the extra; nothing runs or loads past the first thing found wrong. (Whole-model speed and parity are
measured by ``benchmarks/hf_generate.py`` and the tests of ``patch_model`` and the experts backend.)"""

from __future__ import annotations

import json
import sys

import pytest

transformers = pytest.importorskip("transformers")

from hf_helpers import LAYERS, MODELS  # noqa: E402

from nxd_moe.cli import main  # noqa: E402


def generate(*args: str) -> list[str]:
    return ["generate", "--new-tokens", "2", "--prompt-len", "4", "--repeats", "1", *args]


def error_line(capsys, argv: list[str]) -> str:
    """The message ``main(argv)`` exits with (SystemExit's, which Python prints to stderr), checked to be one line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    message = str(exc.value.code)
    assert "\n" not in message and message.startswith("nxd-moe generate: error: "), message
    return message


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Qwen3-MoE checkpoint written by transformers (one safetensors file)."""
    path = tmp_path_factory.mktemp("qwen3")
    MODELS["qwen3_moe"].make().save_pretrained(path)
    return path


@pytest.mark.parametrize("flags", [["--layers", "2"], ["--scale", "4"], ["--layers", "0", "--scale", "1"]])
def test_shape_flags_are_refused_with_a_checkpoint(checkpoint, capsys, flags):
    message = error_line(capsys, generate("--hf-model", str(checkpoint), *flags))
    named = " and ".join(f for f in flags if f.startswith("--"))
    assert message.startswith(f"nxd-moe generate: error: {named}: ") and "a --hf-model checkpoint is generated as " \
        "it is" in message, message


def test_a_corrupt_safetensors_file_is_named(checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes()[:1000])
    message = error_line(capsys, generate("--hf-model", str(broken)))
    assert message.startswith(f"nxd-moe generate: error: --hf-model {str(broken)!r} could not be read: "), message


def test_a_dense_model_is_refused_before_its_weights_load(tmp_path, capsys, monkeypatch):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, **LAYERS)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded"))
    message = error_line(capsys, generate("--hf-model", str(tmp_path)))
    assert message == (f"nxd-moe generate: error: --hf-model {str(tmp_path)!r}: model_type 'llama' has no sparse-MoE "
                       "block nxd_moe serves; supported: ['mixtral', 'qwen3_moe', 'qwen2_moe', 'gpt_oss', "
                       "'deepseek_v3', 'llama4_text', 'llama4', 'dbrx']")


def test_more_positions_than_the_model_has_are_refused(checkpoint, capsys):
    positions = transformers.AutoConfig.from_pretrained(checkpoint).max_position_embeddings
    message = error_line(capsys, generate("--hf-model", str(checkpoint), "--prompt-len", str(positions)))
    assert message == (f"nxd-moe generate: error: --prompt-len + --new-tokens ({positions + 2}) must be <= the "
                       f"model's max_position_embeddings ({positions})")


def test_a_family_transformers_does_not_dispatch_runs_its_own_experts_as_the_baseline(capsys):
    """DBRX's experts are not dispatched by name: transformers' default is its own experts module (generate used to
    fail setting grouped_mm), and --path experts is refused by name."""
    assert main(generate("--config", "dbrx", "--layers", "1", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["transformers"]["experts_implementation"] == "DbrxForCausalLM's own experts"
    assert report["same_tokens"] == 1.0
    message = error_line(capsys, generate("--config", "dbrx", "--layers", "1", "--path", "experts"))
    assert message == ("nxd-moe generate: error: --path experts: transformers does not dispatch DbrxForCausalLM's "
                       "experts by name (experts_implementation); use --path patch")


def test_without_transformers_names_the_hf_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    message = error_line(capsys, generate("--config", "qwen3-30b-a3b"))
    assert message == ("nxd-moe generate: error: nxd-moe generate needs transformers, which is not installed: pip "
                       "install 'nxd-moe[hf]'")


def test_import_nxd_moe_hf_without_transformers_names_the_extra(monkeypatch):
    from nxd_moe.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "nxd_moe.hf")
    with pytest.raises(MissingExtraError, match=r"^nxd_moe\.hf needs transformers, which is not installed: pip "
                                                r"install 'nxd-moe\[hf\]'$"):
        import nxd_moe.hf  # noqa: F401
