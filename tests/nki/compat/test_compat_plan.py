"""The planner and the cost model take an external @nki.jit kernel as a candidate."""

from __future__ import annotations

import importlib
import sys

import pytest

from nxd_moe.cli import main
from nxd_moe.config import load_model_config
from nxd_moe.experts.token_mapping import num_blocks
from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.plan import plan, rank_problem

SMALL_MODEL = {
    "name": "small", "num_experts": 4, "top_k": 2, "hidden_size": 256, "intermediate_size": 256,
    "experts": {"hidden_act": "silu", "glu_mlp": True},
}


@pytest.fixture
def block_rows_copy(nki_compat):  # noqa: F811
    sys.modules.pop("nki_style_kernels", None)
    yield importlib.import_module("nki_style_kernels").block_rows_copy
    sys.modules.pop("nki_style_kernels", None)


def test_plan_simulates_an_external_kernel_on_the_prefill_problem(block_rows_copy):
    model = load_model_config(SMALL_MODEL)
    report = plan(model, tokens=256, external={"block_rows_copy@1": (block_rows_copy, 1)})
    (row,) = [c for c in report["candidates"] if c["section"] == "prefill external kernels"]
    problem = rank_problem(model, 256)
    blocks = num_blocks(256, 2, 4, report["block_size"], pad_to_even=True)
    slots = blocks * report["block_size"]
    # every slot's row read (padding slots read the zero row T) and written, bf16
    assert row["error"] is None and row["kernel"] == "block_rows_copy" and row["lnc"] == 1
    assert row["dma_bytes"] == 2 * slots * problem.hidden * 2 + slots * 4
    assert row["matmul_flops"] == 0 and row["estimated_us"] > 0


def test_plan_cli_kernel_option(tmp_path, capsys):
    module = tmp_path / "my_external_kernels.py"
    module.write_text("import nki\n\n@nki.jit\ndef broken(hidden_states):\n"
                      "    raise AssertionError('not for this shape')\n")
    path = list(sys.path)
    try:
        code = main(["plan", "--config", "qwen3-30b-a3b", "--tokens", "128", "--tp", "4", "--ep", "8",
                     "--kernel", "my_external_kernels:broken@1", "--kernel-path", str(tmp_path)])
        out = capsys.readouterr().out
        assert code == 0 and "prefill external kernels:" in out
        assert "broken@1 (my_external_kernels)" in out and "does not run: AssertionError: not for this shape" in out
        assert main(["plan", "--config", "qwen3-30b-a3b", "--tokens", "128", "--kernel", "nonsense"]) == 2
        assert "MODULE:FUNCTION" in capsys.readouterr().err
    finally:
        compat.uninstall()
        sys.modules.pop("my_external_kernels", None)
        sys.path[:] = path
