"""``python -m nxd_moe.nki_kernels.compat [--force] script.py [args...]``: run a script with ``nki`` installed."""

from __future__ import annotations

import argparse
import runpy
import sys

from nxd_moe.nki_kernels.compat import install


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nxd_moe.nki_kernels.compat",
                                     description="Run a Python script whose `import nki` resolves to the nxd_moe "
                                                 "NKI simulator.")
    parser.add_argument("--force", action="store_true", help="install even when a real nki package is importable")
    parser.add_argument("script", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    ns = parser.parse_args(argv)
    install(force=ns.force)
    sys.argv = [ns.script, *ns.args]
    runpy.run_path(ns.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
