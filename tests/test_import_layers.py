"""The package's import contract: layers that import downward only (docs/architecture.md draws them).

Read from the source with ``ast`` (nothing is imported): every ``import`` of an nxd_moe module, at module level or
inside a function. A module belongs to the layer of the longest entry of :data:`LAYERS` it falls under. The rules:

- **downward**: a module imports only modules of lower layers, or of its own entry (a package's modules import
  each other); two entries of one layer are siblings and do not import each other;
- **no circles**, imports inside functions counted;
- **no hidden edges**: an nxd_moe module is imported inside a function only where it needs an optional third-party
  package (:data:`OPTIONAL`), never to dodge a circle;
- **no private names across modules**: ``from nxd_moe.x import _y`` only inside ``x`` itself.

:data:`KNOWN` lists what breaks the rules today, each entry with the reason it is still there; the redesign empties
it. A new violation fails, and so does a known one that is gone (take it off the list), so the list stays exact.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1] / "nxd_moe"

# Lowest first. Entries are module paths under nxd_moe; a module falls under its longest matching entry.
LAYERS: list[tuple[str, list[str]]] = [
    ("vocabulary: leaf modules that import nothing of nxd_moe",
     ["quantization.formats", "quantization.nxd_fields", "activations", "aliasing", "extras", "graphs", "validation",
      "gpu_info", "layer_parts", "checks", "fingerprint"]),
    ("quantized weights", ["quantization.activations", "quantization.weight", "quantization.checkpoint",
                           "quantization"]),
    ("NxD's configs", ["moe_configs"]),
    ("model configurations (configs/*.yaml)", ["model_config"]),
    ("rank-free math: routers, expert algorithms, the float64 reference", ["routing", "experts", "reference"]),
    ("backends", ["triton_kernels", "nki_kernels"]),
    ("rank layouts: which ranks form which groups", ["rank_layout"]),
    ("ranks", ["parallel_state"]),
    ("parallel plumbing", ["parallel"]),
    ("expert modules: the routed experts (their one routed pipeline) and the shared experts",
     ["expert_mlps_v2", "shared_experts"]),
    ("layer modules", ["moe"]),
    ("builders and converters of layers", ["build", "quantization.quantizer", "arguments"]),
    ("transformers blocks", ["hf"]),
    ("transformers models", ["models"]),
    ("tracing for neuronx-cc", ["tracing"]),
    ("the application", ["application"]),
    ("NxD Inference's entry point", ["nxdi"]),
    ("NxD's front door", ["nxd_compat"]),
    ("command line", ["cli"]),
]
# Modules that only re-export (the package root, the public front of the transformers integration, the old module
# paths of tracing, nxd_moe.config -- the public path of checks, fingerprint, moe_configs and model_config): above
# every layer, so nothing inside the package imports them; they may import any layer.
FACADES = {"nxd_moe", "nxd_moe.hf", "nxd_moe.trace", "nxd_moe.trace_spmd", "nxd_moe.config"}
# Modules that need an optional third-party package (the gpu extra's triton; the hf extra's
# transformers, which nxd_moe.hf imports when it is imported): imported inside the function that uses them, so that
# the rest works without them (and does not pay for importing them).
OPTIONAL = ("triton_kernels", "hf", "models")


class Edge(NamedTuple):
    importer: str
    imported: str
    in_function: bool
    line: int
    names: tuple[str, ...] = ()


def module_files(root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def import_edges(files: dict[str, Path]) -> list[Edge]:
    """Every import of an nxd_moe module in ``files`` (``{module: path}``)."""
    edges = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    names = () if target != base else (alias.name,)
                    edges.append(Edge(module, _known(target, files), in_function, node.lineno, names))
            else:
                for alias in node.names:
                    edges.append(Edge(module, _known(alias.name, files), in_function, node.lineno))
    return [e for e in edges if e.imported and e.imported != e.importer]


def _imports(tree: ast.AST, in_function: bool = False):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        elif _type_checking_only(node):
            continue  # annotations only: never imported when the code runs
        else:
            yield from _imports(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).endswith("TYPE_CHECKING")


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _known(name: str, files: dict[str, Path]) -> str | None:
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name if name.startswith("nxd_moe") else None


def layer_of(module: str) -> tuple[int, str]:
    """``(layer index, entry)`` of an nxd_moe module."""
    if module in FACADES:
        return len(LAYERS), module
    name = module.removeprefix("nxd_moe.")
    found = [(i, entry) for i, (_, entries) in enumerate(LAYERS) for entry in entries
             if name == entry or name.startswith(entry + ".")]
    if not found:
        raise KeyError(f"{module} is in no layer of tests/test_import_layers.py's LAYERS: place it")
    return max(found, key=lambda f: len(f[1]))


def circles(edges: list[Edge]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(edges: list[Edge]) -> set[tuple[str, ...]]:
    """Every broken rule as ``(kind, importer, imported)`` (``("circle", *modules)`` for a circle)."""
    found: set[tuple[str, ...]] = set()
    for e in edges:
        if e.importer in FACADES or e.imported.startswith(e.importer + "."):
            continue  # the root re-exports every layer; a package's __init__ re-exports its own modules
        (i, entry), (j, other) = layer_of(e.importer), layer_of(e.imported)
        if j > i:
            found.add(("upward", e.importer, e.imported))
        elif j == i and entry != other:
            found.add(("sibling", e.importer, e.imported))
        if e.in_function and not e.imported.removeprefix("nxd_moe.").startswith(OPTIONAL):
            found.add(("in function", e.importer, e.imported))
        if any(n.startswith("_") and not n.startswith("__") for n in e.names):
            found.add(("private", e.importer, e.imported))
    for component in circles(edges):
        found.add(("circle", *component))
    return found


# What breaks the contract today, by the reason it is still there (issue 36 emptied it; keep it empty).
KNOWN: dict[str, list[tuple[str, ...]]] = {}


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(module_files())


def test_every_module_is_in_a_layer(edges):
    for module in module_files():
        if module not in FACADES:
            layer_of(module)


def test_the_package_keeps_its_import_contract(edges):
    found = violations(edges)
    known = {row for rows in KNOWN.values() for row in rows}
    new = sorted(found - known)
    assert not new, "imports that break the contract (docs/architecture.md): " + "; ".join(map(str, new))
    gone = sorted(known - found)
    assert not gone, "fixed: take these off KNOWN in tests/test_import_layers.py: " + "; ".join(map(str, gone))


def test_the_checker_sees_each_kind_of_violation(tmp_path):
    """Negative control: a tiny package with one violation of each kind, each reported."""
    pkg = tmp_path / "nxd_moe"
    (pkg / "experts").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "moe_configs.py": "from nxd_moe.moe import MoE\n",  # upward (and a circle with moe)
        "moe.py": "import nxd_moe.moe_configs\n\ndef f():\n    from nxd_moe.experts import mlp\n",  # in function
        "routing.py": "from nxd_moe.experts.mlp import _helper\n",  # sibling and private
        "experts/__init__.py": "",
        "experts/mlp.py": "def _helper():\n    pass\n",
        "triton_kernels.py": "",
        "hf.py": "def f():\n    import nxd_moe.triton_kernels\n",  # optional: allowed
        "cli.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nxd_moe.hf import f\n",  # not run
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = violations(import_edges(module_files(pkg)))
    assert found == {
        ("upward", "nxd_moe.moe_configs", "nxd_moe.moe"),
        ("in function", "nxd_moe.moe", "nxd_moe.experts.mlp"),
        ("sibling", "nxd_moe.routing", "nxd_moe.experts.mlp"),
        ("private", "nxd_moe.routing", "nxd_moe.experts.mlp"),
        ("circle", "nxd_moe.moe", "nxd_moe.moe_configs"),
    }


def test_the_package_and_its_pytest_plugins_import_neither_triton_nor_transformers():
    """pytest loads the plugins before conftest.py sets TRITON_INTERPRET (Triton reads it when its own jit functions
    are defined: imported earlier, ``tl.sum`` is not interpretable on a CPU), and the NxD front door must not pay for
    (or need) transformers: both stay out until a module that needs them is used."""
    import subprocess
    import sys

    code = ("import sys, nxd_moe, nxd_moe.nxd_compat.pytest_plugin, nxd_moe.nki_kernels.compat.pytest_plugin, "
            "nxd_moe.cli; print(sorted(m for m in ('triton', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
