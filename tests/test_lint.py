"""The tree passes ruff with the project's rules (pyproject.toml: pycodestyle, pyflakes, bugbear and import order):
in CI, not only on the machines of those who remember to run it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
    return subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_the_tree_passes_ruff():
    result = _ruff(str(ROOT))
    assert result.returncode == 0, result.stdout[-4000:]


def test_unsorted_imports_fail_it(tmp_path):
    """Negative control: a file with its imports out of order is reported (I001), one in order is not."""
    (tmp_path / "unsorted.py").write_text("import sys\nimport os\n\nprint(os, sys)\n")
    (tmp_path / "sorted.py").write_text("import os\nimport sys\n\nprint(os, sys)\n")
    result = _ruff(str(tmp_path))
    assert result.returncode == 1 and "I001" in result.stdout
    assert "unsorted.py" in result.stdout and "sorted.py:" not in result.stdout.replace("unsorted.py", "")
