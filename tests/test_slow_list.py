"""tests/slow_tests.txt stays exact: every entry names a test file that exists and, for a node id, a test function
(or class and method) defined in it -- a renamed or deleted test would otherwise leave a stale entry while the
renamed test ran in the default suite again. Test files are checked as text (collecting them would import them)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import slow_tests

ROOT = Path(__file__).resolve().parent.parent


def stale_entries(entries, root: Path = ROOT) -> list[str]:
    """The entries of ``entries`` that name no test under ``root``."""
    stale = []
    for entry in sorted(entries):
        path, *names = entry.split("::")
        file = root / path
        if not file.is_file() or not path.startswith("tests/"):
            stale.append(entry)
            continue
        source = file.read_text()
        for name in names:
            bare = name.split("[")[0]
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(bare)}\b", source, re.MULTILINE):
                stale.append(entry)
                break
    return stale


def test_every_slow_entry_names_a_test():
    entries = slow_tests()
    assert entries and stale_entries(entries) == []


def test_a_stale_entry_is_reported(tmp_path):
    """Negative control: a missing file, a missing function and a missing method are each reported; present ones
    (a parametrized id, a class method) are not."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("def test_a(x):\n    pass\n\n\n"
                                     "class TestB:\n    def test_c(self):\n        pass\n")
    good = {"tests/test_x.py", "tests/test_x.py::test_a[1-2]", "tests/test_x.py::TestB::test_c"}
    bad = {"tests/test_y.py", "tests/test_x.py::test_gone", "tests/test_x.py::TestB::test_d"}
    assert stale_entries(good | bad, tmp_path) == sorted(bad)
