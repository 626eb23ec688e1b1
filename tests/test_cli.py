"""``nxd-moe``: the main job runs every shipped config, reports what the issue asks for, and fails cleanly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nxd_moe.cli import auto_scale, main
from nxd_moe.config import builtin_config_names

ROOT = Path(__file__).resolve().parent.parent


def run_json(capsys, *args: str) -> dict:
    assert main(["run", "--json", "--no-progress", "--repeats", "1", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", builtin_config_names())
def test_run_every_shipped_config(capsys, name):
    report = run_json(capsys, "--config", str(ROOT / "configs" / f"{name}.yaml"), "--tokens", "64",
                      "--decode-batch", "2")
    assert report["config"] == name
    prefill, decode = report["prefill"], report["decode"]
    assert prefill["mode"] in ("blockwise", "all_experts", "selective_loading")
    if prefill["mode"] == "blockwise":
        assert prefill["num_blocks"] >= prefill["active_blocks"] >= 1
    assert decode["mode"] in ("selective_loading", "all_experts")
    for step in (prefill, decode):
        assert step["ms"] > 0
        assert step["max_abs_err"] < 1e-5 * max(1.0, step["max_abs_ref"])
    assert report["dropped_tokens"] == 0  # every shipped config is dropless


def test_json_keys_scripts_rely_on(capsys):
    report = run_json(capsys, "--config", "qwen3-30b-a3b", "--tokens", "128", "--scale", "32")
    for key in ("config", "dropped_tokens"):
        assert key in report
    for key in ("mode", "num_blocks", "max_abs_err", "ms", "padding_overhead_provisioned",
                "padding_overhead_algorithmic", "dropped_tokens"):
        assert key in report["prefill"], key
    for key in ("mode", "max_abs_err", "ms"):
        assert key in report["decode"], key
    assert report["scale"] == 32 and report["hidden_size"] == 2048 // 32


def test_capacity_factor_reports_dropped_tokens(capsys):
    report = run_json(capsys, "--config", "mixtral-8x7b", "--tokens", "256", "--capacity-factor", "0.5",
                      "--scale", "32")
    assert report["prefill"]["mode"] == "capacity_factor"
    assert report["prefill"]["capacity"] == 256 * 2 * 0.5 // 8
    assert report["dropped_tokens"] > 0
    assert report["prefill"]["max_abs_err"] < 1e-5


def test_human_report_names_the_algorithm_and_overheads(capsys):
    assert main(["run", "--config", "qwen3-30b-a3b", "--tokens", "128", "--scale", "32", "--repeats", "1",
                 "--no-progress", "--block-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "-> blockwise" in text and "num_blocks" in text and "padding overhead" in text
    assert re.search(r"decode\s+batch 8 -> selective_loading", text)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_run_on_a_gpu_defaults_to_bf16_and_reports_graph_replays(capsys):
    """What a GPU user expects: bf16 unless asked, and the warm CUDA-graph step time next to the eager one."""
    report = run_json(capsys, "--config", "qwen3-30b-a3b", "--device", "cuda", "--backend", "triton", "--tokens", "256",
                      "--decode-batch", "4", "--quantization", "fp8_block", "--activation-quantization", "fp8")
    assert report["dtype"] == "bfloat16" and report["device"].startswith("cuda")
    for step in (report["prefill"], report["decode"]):
        assert step["ms"] > 0 and step["graph_ms"] > 0 and "graph_error" not in step, step
        assert step["max_abs_err"] < 6e-2 * max(1.0, step["max_abs_ref"])
    assert run_json(capsys, "--config", "mixtral-8x7b", "--device", "cuda", "--dtype", "float32",
                    "--tokens", "16")["dtype"] == "float32"
    assert main(["run", "--config", "mixtral-8x7b", "--device", "cuda", "--tokens", "16", "--repeats", "1",
                 "--no-progress"]) == 0
    assert re.search(r"ms/step eager, [0-9.]+ ms/step CUDA graph", capsys.readouterr().out)


def test_unquantized_weights_are_labelled_by_their_dtype(capsys):
    """Not "bf16" whatever the dtype: the JSON says the format ("none": not quantized) beside the dtype, the text
    the dtype."""
    args = ["run", "--config", "mixtral-8x7b", "--scale", "64", "--tokens", "16", "--repeats", "1", "--no-progress"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["quantization"], report["dtype"]) == ("none", "float32")
    assert main(args) == 0
    assert "experts  weights float32 (unquantized): " in capsys.readouterr().out
    assert main([*args, "--quantization", "fp8"]) == 0
    assert "experts  weights fp8: " in capsys.readouterr().out


def test_auto_scale_keeps_hidden_small():
    assert auto_scale(2048) == 16 and auto_scale(7168) == 32 and auto_scale(256) == 16


@pytest.mark.parametrize("args, message", [
    (["run", "--config", "no-such-model"], "neither a file nor a built-in config"),
    (["run", "--config", "mixtral-8x7b", "--tokens", "0"], "--tokens: must be >= 1"),
    (["run", "--config", "mixtral-8x7b", "--capacity-factor", "-1"], "--capacity-factor: must be > 0"),
    (["run", "--config", "mixtral-8x7b", "--dtype", "int8"], "--dtype must be a floating"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# What .ci/run may do besides the README's commands: keep no pip cache and drop the first environment before the
# second (the XLA environment's CUDA build of torch 2.9 needs the disk).
CI_HOUSEKEEPING = ("export PIP_NO_CACHE_DIR=1", "deactivate && rm -rf .venv")


def test_ci_runs_exactly_the_readme_test_commands():
    """.ci/run runs the README's two test commands verbatim and in order: the main suite, then the XLA suite."""
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd ")) and line not in CI_HOUSEKEEPING]
    assert len(commands) == 2 and all(f"\n{command}\n" in readme for command in commands)
    assert readme.index(commands[0]) < readme.index(commands[1])
    # both run the slow tests too: the main suite as a second pytest, the XLA suite (short) in one run of everything
    assert commands[0].endswith("&& pytest && pytest -m slow") and "'.[xla,test]'" in commands[1]
    assert "pytest -m 'slow or not slow' tests/xla" in commands[1]


def test_a_broken_yaml_config_is_one_line_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("name: broken\nnum_experts: [1, 2\n")
    problem = f"{path}, line 3, column 1: not valid YAML (expected ',' or ']', but got '<stream end>')\n"
    with pytest.raises(SystemExit) as exc:
        main(["run", "--config", str(path)])
    assert exc.value.code == 2 and capsys.readouterr().err == f"nxd-moe: error: {problem}"
    assert main(["plan", "--config", str(path), "--tokens", "8"]) == 2
    assert capsys.readouterr().err == f"nxd-moe plan: error: {problem}"
    assert main(["trace", "--config", str(path), "--skip-xla", "--out", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err == f"nxd-moe trace: error: {problem}"


@pytest.mark.parametrize("command", [["run", "--config", "mixtral-8x7b"], ["trace", "--config", "mixtral-8x7b",
                                                                            "--out", "unused"]])
def test_a_misspelled_flag_shows_the_subcommands_usage(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--tokns", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: nxd-moe {command[0]} " in err and f"nxd-moe {command[0]}: error: unrecognized arguments: " \
        "--tokns 5" in err, err


def test_scale_that_does_not_divide_says_how_it_rounded(capsys):
    """Mixtral's H = 4096 / 48 and I = 14336 / 48 are no integers: the layer gets 88 and 304 (multiples of 8), and
    the report says so."""
    args = ["run", "--config", "mixtral-8x7b", "--scale", "48", "--tokens", "8", "--decode-batch", "1",
            "--repeats", "1", "--no-progress"]
    assert main(args) == 0
    assert "(scale 1/48: H=88, I=304 (rounded up: H 4096/48 -> 88, I 14336/48 -> 304), " in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scale_rounding"] == "H 4096/48 -> 88, I 14336/48 -> 304"
    assert main([*args[:4], "64", *args[5:], "--json"]) == 0  # 4096/64 and 14336/64 divide
    assert json.loads(capsys.readouterr().out)["scale_rounding"] == ""
