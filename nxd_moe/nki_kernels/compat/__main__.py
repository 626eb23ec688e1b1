"""``python -m nxd_moe.nki_kernels.compat [--force] [--alias F,...] (script.py | -m module) [args...]``: run a
script or a module (like ``python -m``) with the simulator installed under NKI's module names.

The runner exists to run NKI code unmodified, so by default it aliases every family (``nki``, AWS's
``nki_cpu_simulator``, the legacy ``neuronxcc.nki``, the ``neuron_dtypes`` stand-in) before the script's first
import -- nki-library's pytest harness imports ``nki`` while loading its conftest, before its own ``--test-mode
simulation`` would alias anything::

    python -m nxd_moe.nki_kernels.compat -m pytest test/integration/nkilib/core/max --test-mode simulation

``--alias nki`` aliases fewer; a family whose real package is importable is refused unless ``--force``.
"""

from __future__ import annotations

import os
import runpy
import sys

from nxd_moe.nki_kernels.compat import ALL_FAMILIES, install


USAGE = ("usage: python -m nxd_moe.nki_kernels.compat [--force] [--alias F,...] (script.py | -m MODULE) [args...]\n"
         f"  --alias F,...  module families to alias (default: all of {','.join(ALL_FAMILIES)})\n"
         "  --force        install even when a real package of a family is importable\n"
         "  -m MODULE      run a library module as a script, like python -m (e.g. -m pytest)")


class UsageError(ValueError):
    pass


def _families(text: str) -> tuple[str, ...]:
    families = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in families if f not in ALL_FAMILIES]
    if unknown or not families:
        raise UsageError(f"--alias {text!r}: a comma-separated subset of {','.join(ALL_FAMILIES)}")
    return families


def parse(argv: list[str]) -> tuple[bool, tuple[str, ...], str | None, list[str]]:
    """``(force, families, module, args)``: the runner's own options come first; everything from the script (or
    ``-m MODULE``) on belongs to it, as with ``python``."""
    force, families = False, ALL_FAMILIES
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--force":
            force = True
        elif arg == "--alias" or arg.startswith("--alias="):
            if arg == "--alias":
                i += 1
                if i == len(argv):
                    raise UsageError("--alias needs a value")
                arg = "=" + argv[i]
            families = _families(arg.split("=", 1)[1])
        elif arg == "-m":
            if i + 1 == len(argv):
                raise UsageError("-m needs a module name")
            return force, families, argv[i + 1], argv[i + 2:]
        elif arg.startswith("-m") and len(arg) > 2:  # -mpytest, as python accepts
            return force, families, arg[2:], argv[i + 1:]
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r}")
        else:
            return force, families, None, argv[i:]
        i += 1
    raise UsageError("give a script to run or -m MODULE")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        force, families, module, args = parse(argv)
    except UsageError as e:
        print(f"{USAGE}\nerror: {e}", file=sys.stderr)
        return 2
    install(force=force, families=families)
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script.py` does
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
