"""Serve modules under another package's import names: the ``sys.modules`` mechanics and the command line that the
compat front doors share (:mod:`nxd_moe.nki_kernels.compat` for ``nki``, :mod:`nxd_moe.nxd_compat` for
``neuronx_distributed`` and ``neuronx_distributed_inference``).

A front door groups its module names in *families* (an import root and the modules under it). Installing puts a
family's modules into ``sys.modules`` under their foreign names, so ``import nki.isa`` or ``from
neuronx_distributed.modules.moe import MoE`` finds them without any file on disk; uninstalling restores exactly what
``sys.modules`` held under those names before. A family whose real package is importable is refused unless forced:
silently shadowing the real thing would be worse than an error.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys
import types
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Sequence


def new_module(name: str, doc: str, **attributes) -> types.ModuleType:
    """A module object ``name`` holding ``attributes`` (no file behind it)."""
    module = types.ModuleType(name, doc)
    module.__dict__.update(attributes)
    return module


def new_package(name: str, doc: str, **attributes) -> types.ModuleType:
    """:func:`new_module` made a package: ``import name.sub`` looks its submodules up in ``sys.modules``."""
    module = new_module(name, doc, **attributes)
    module.__path__ = []
    return module


class UsageError(ValueError):
    """A front door's command line is malformed."""


def placeholder(origin: str | None) -> bool:
    """PyPI's ``nki`` and ``neuronx-distributed`` are empty placeholders ("WRONG PACKAGE ... install from the Neuron
    repository"); they do not count as the real package."""
    if not origin:
        return False
    try:
        with open(origin, encoding="utf-8", errors="replace") as f:
            return "WRONG PACKAGE" in f.read(4096)
    except OSError:
        return False


class _Unserved(importlib.abc.MetaPathFinder):
    """While installed: importing a module under an aliased root that the front door does not serve raises an
    ``ImportError`` saying why (a plain ``ModuleNotFoundError`` would not; ``from pkg import name`` would even
    swallow it into "cannot import name")."""

    def __init__(self, aliases: "ModuleAliases"):
        self.aliases = aliases

    def find_spec(self, name, path=None, target=None):
        if name in sys.modules or not ModuleAliases._owned(name, self.aliases.installed_families()):
            return None
        raise ImportError(self.aliases.unserved(name), name=name)


class ModuleAliases:
    """One front door's families and whether (and which of) them are installed.

    ``families``: ``{family: {module name: module}}``, each name under the family's root. ``front_door``: the
    module whose ``install()`` users call (named in the refusal); ``error``: the exception a refusal raises;
    ``replacement`` says what would shadow the real package ("the CPU simulator"). ``unserved(name)``, if given,
    explains why a module under an installed root is not served; importing one then raises ``ImportError`` with it.
    """

    def __init__(self, families: Mapping[str, Mapping[str, types.ModuleType]], front_door: str,
                 error: type[RuntimeError], replacement: str, unserved: Callable[[str], str] | None = None):
        self.families = {name: dict(modules) for name, modules in families.items()}
        self.front_door = front_door
        self.error = error
        self.replacement = replacement
        self.unserved = unserved
        self._finder = None if unserved is None else _Unserved(self)
        self._saved: dict[str, types.ModuleType] | None = None
        self._installed: tuple[str, ...] = ()

    def ours(self, module: types.ModuleType) -> bool:
        return any(module is m for family in self.families.values() for m in family.values())

    def real_package(self, name: str) -> str | None:
        """Where a real package ``name`` would be imported from, or ``None`` (also for PyPI's placeholders, for
        namespace packages -- a ``tests/nki`` folder on ``sys.path`` is not ``nki`` -- and for our own aliases)."""
        loaded = sys.modules.get(name)
        if loaded is not None:
            if self.ours(loaded) or getattr(loaded, "__file__", None) is None:
                return None
            return loaded.__file__
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if spec is None or spec.origin in (None, "namespace") or placeholder(spec.origin):
            return None
        return spec.origin

    def is_installed(self) -> bool:
        return self._saved is not None

    def installed_families(self) -> tuple[str, ...]:
        """The families :meth:`install` aliased (empty when not installed)."""
        return self._installed

    @staticmethod
    def _owned(name: str, roots: Sequence[str]) -> bool:
        return any(name == root or name.startswith(root + ".") for root in roots)

    def install(self, force: bool, families: Sequence[str]) -> None:
        """Alias ``families``; idempotent. Raises ``self.error`` when a real package of one of them is importable,
        unless ``force``; ``ValueError`` for an unknown family or a second install with other ones."""
        families = tuple(dict.fromkeys(families))
        unknown = [f for f in families if f not in self.families]
        if unknown or not families:
            raise ValueError(f"install(families={families!r}): each must be one of {list(self.families)}")
        if self._saved is not None:
            if set(families) - set(self._installed):
                raise ValueError(f"{self.front_door} is installed with families {list(self._installed)}; "
                                 f"uninstall() before installing {list(families)}")
            return
        found = {f: where for f in families if (where := self.real_package(f)) is not None}
        if found and not force:
            what = "; ".join(f"a real {f} package is importable ({where})" for f, where in found.items())
            raise self.error(f"{what}; {self.front_door}.install() would shadow it with {self.replacement}. Use the "
                             "real one, leave its family out (CLI: --alias), or pass force=True (CLI: --force) to "
                             "install anyway.")
        self._saved = {name: module for name, module in sys.modules.items() if self._owned(name, families)}
        for name in list(self._saved):
            del sys.modules[name]
        for family in families:
            sys.modules.update(self.families[family])
        self._installed = families
        if self._finder is not None:
            sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        """Undo :meth:`install`: every ``sys.modules`` entry under an aliased root is restored to what it was."""
        if self._saved is None:
            return
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        for name in [n for n in sys.modules if self._owned(n, self._installed)]:
            del sys.modules[name]
        sys.modules.update(self._saved)
        self._saved, self._installed = None, ()

    @contextmanager
    def installed(self, force: bool, families: Sequence[str]) -> Iterator[None]:
        """Installed inside the block only (unless it already was)."""
        already = self.is_installed()
        self.install(force, families)
        try:
            yield
        finally:
            if not already:
                self.uninstall()


# ----------------------------------------------------------------------------------------------------------
# the command line: python -m FRONT_DOOR [--force] [--alias F,...] (script.py | -m MODULE) [args...]


def parse_families(text: str, all_families: Sequence[str]) -> tuple[str, ...]:
    families = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in families if f not in all_families]
    if unknown or not families:
        raise UsageError(f"--alias {text!r}: a comma-separated subset of {','.join(all_families)}")
    return families


def parse(argv: Sequence[str], all_families: Sequence[str]) -> tuple[bool, tuple[str, ...], str | None, list[str]]:
    """``(force, families, module, args)``: the runner's own options come first; everything from the script (or
    ``-m MODULE``) on belongs to it, as with ``python``. ``families`` defaults to all of them."""
    argv = list(argv)
    force, families = False, tuple(all_families)
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
            families = parse_families(arg.split("=", 1)[1], all_families)
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


def run(module: str | None, args: list[str]) -> None:
    """Run ``-m module args`` or the script ``args[0]`` as ``python`` would, in this process."""
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script.py` does
        runpy.run_path(args[0], run_name="__main__")


def main(argv: Sequence[str] | None, usage: str, all_families: Sequence[str],
         install: Callable[..., object]) -> int:
    """A front door's ``__main__``: parse, ``install(force=..., families=...)``, run the target."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    try:
        force, families, module, args = parse(argv, all_families)
    except UsageError as e:
        print(f"{usage}\nerror: {e}", file=sys.stderr)
        return 2
    install(force=force, families=families)
    run(module, args)
    return 0
