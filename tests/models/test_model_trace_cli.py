"""``nxd-moe trace --model-layers``: bad arguments fail with exit status 2 and a message naming them, before any
model is built; without ``torch_xla`` the command says how to get it. (The traces themselves run under
``torch_xla``: ``tests/xla/test_model_trace.py``.)"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

pytest.importorskip("transformers")

from nxd_moe.cli import main as cli_main  # noqa: E402


def trace(tmp_path, *args: str) -> list[str]:
    return ["trace", "--config", "qwen3-30b-a3b", "--model-layers", "2", "--scale", "64", "--out", str(tmp_path),
            *args]


@pytest.mark.parametrize("args, message", [
    (["--padding"], "--padding: one-layer trace options, not taken with --model-layers"),
    (["--dynamic-while", "block"], "--dynamic-while"),
    (["--skip-xla"], "--skip-xla"),
    (["--routings", "1"], "--routings must be >= 2"),
    (["--mode", "prefill", "--tokens", "200"], r"--tokens \(200\) must be <= --cache-length \(128\)"),
    (["--cache-length", "16", "--tokens", "17"], r"--tokens \(17\) must be <= --cache-length \(16\)"),
    (["--dtype", "int8"], "--dtype"),
])
def test_bad_arguments_exit_2_naming_them(tmp_path, capsys, args, message):
    assert cli_main(trace(tmp_path, *args)) == 2
    err = capsys.readouterr().err
    assert "nxd-moe trace: error:" in err
    assert re.search(message, err), err


def test_cache_longer_than_the_sliding_window_is_refused(tmp_path, capsys):
    assert cli_main(["trace", "--config", "gpt-oss-20b", "--model-layers", "1", "--cache-length", "129",
                     "--out", str(tmp_path)]) == 2
    assert "--cache-length must be <= the model's sliding_window (128), got 129" in capsys.readouterr().err


def test_cache_longer_than_the_models_positions_is_refused(tmp_path, capsys):
    """Qwen3-30B-A3B has 40,960 positions: a longer cache is named, not accepted."""
    assert cli_main(trace(tmp_path, "--cache-length", "100000")) == 2
    assert "--cache-length must be <= the model's max_position_embeddings (40960), got 100000" in \
        capsys.readouterr().err


def test_without_transformers_names_the_hf_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "nxd_moe.hf")
    assert cli_main(trace(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err == ("nxd-moe trace: error: --model-layers needs transformers, which is not installed: pip install "
                   "'nxd-moe[hf]'\n")


def test_argparse_rejects_non_positive_counts(tmp_path, capsys):
    for flag in ("--model-layers", "--cache-length"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["trace", "--config", "qwen3-30b-a3b", flag, "0", "--out", str(tmp_path)])
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err


def test_unknown_config(tmp_path, capsys):
    assert cli_main(["trace", "--config", "no-such-model", "--model-layers", "1", "--out", str(tmp_path)]) == 2
    assert "built-in" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_without_torch_xla_says_how_to_get_it(tmp_path, capsys):
    assert cli_main(trace(tmp_path, "--mode", "decode")) == 2
    assert "needs torch_xla, which is not installed: pip install 'nxd-moe[xla]'" in capsys.readouterr().err
