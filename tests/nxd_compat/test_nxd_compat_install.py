"""The NxD front door's mechanics: nothing aliased until asked, install / uninstall restoring ``sys.modules``,
refusing a real NxD unless forced, modules that are not served, the ``python -m`` runner and the fixture."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nxd_moe import nxd_compat
from nxd_moe.nxd_compat.namespaces import FAMILIES, UNSERVED
from nxd_moe.nxd_compat.pytest_plugin import nxd_compat as nxd_compat_fixture  # noqa: F401 -- the fixture

_ROOTS = ("neuronx_distributed", "neuronx_distributed_inference", "torch_neuronx")


def _aliased() -> dict:
    return {k: v for k, v in sys.modules.items() if any(k == r or k.startswith(r + ".") for r in _ROOTS)}


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_nothing_is_aliased_until_asked():
    """A fresh interpreter that imports all of nxd_moe (front doors included) still cannot import NxD."""
    done = _run("-c", textwrap.dedent("""
        import importlib, pkgutil, sys
        import nxd_moe
        for info in pkgutil.walk_packages(nxd_moe.__path__, "nxd_moe."):
            if not info.name.startswith(("nxd_moe.triton_kernels", "nxd_moe.nki_kernels.compat.__main__",
                                         "nxd_moe.nxd_compat.__main__")):
                importlib.import_module(info.name)
        assert "nxd_moe.nxd_compat" in sys.modules
        assert not [k for k in sys.modules if k.startswith("neuronx_distributed")], sorted(sys.modules)
        try:
            import neuronx_distributed
        except ImportError:
            print("not importable")
    """))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "not importable"


def test_install_aliases_every_module_and_uninstall_restores_sys_modules():
    before = _aliased()
    nxd_compat.install()
    try:
        assert nxd_compat.is_installed() and nxd_compat.installed_families() == _ROOTS
        for name, module in {k: v for family in FAMILIES.values() for k, v in family.items()}.items():
            assert sys.modules[name] is module
        # The imports of NxD's MoE docs and NxDI's model code, verbatim in form.
        import neuronx_distributed.modules.moe.model_utils as model_utils
        from neuronx_distributed.modules.moe import MoE, routing
        from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig, RouterConfig
        from neuronx_distributed.parallel_layers import parallel_state
        from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_module

        import nxd_moe
        from nxd_moe.nxd_compat import adapters
        from nxd_moe.nxdi import initialize_moe_module as ours

        assert MoE is adapters.MoE and routing.GroupLimitedRouter is nxd_moe.GroupLimitedRouter
        assert BlockwiseMatmulConfig is adapters.NxdBlockwiseMatmulConfig and RouterConfig is nxd_moe.RouterConfig
        assert initialize_moe_module is ours and model_utils.ACT2FN is nxd_moe.activations.ACT2FN
        assert parallel_state.model_parallel_is_initialized is nxd_moe.parallel_state.model_parallel_is_initialized
        nxd_compat.install()  # idempotent
    finally:
        nxd_compat.uninstall()
    assert _aliased() == before
    nxd_compat.uninstall()  # a second uninstall is a no-op
    with pytest.raises(ImportError):
        import neuronx_distributed  # noqa: F401


def test_one_family_and_bad_families():
    with nxd_compat.installed(families=("neuronx_distributed",)):
        assert nxd_compat.installed_families() == ("neuronx_distributed",)
        assert "neuronx_distributed_inference" not in sys.modules
        with pytest.raises(ValueError, match="uninstall"):
            nxd_compat.install(families=("neuronx_distributed_inference",))
    with pytest.raises(ValueError, match="each must be one of"):
        nxd_compat.install(families=("nki",))
    assert not nxd_compat.is_installed()


def test_unserved_modules_say_why(nxd_compat_fixture):  # noqa: F811
    for name, why in UNSERVED.items():
        with pytest.raises(ImportError, match="not served by nxd_moe's NxD front door") as error:
            if name.endswith("load_balancing_loss_func"):
                from neuronx_distributed.modules.moe import load_balancing_loss_func  # noqa: F401
            else:
                __import__(name)
        assert why in str(error.value)
    with pytest.raises(ImportError, match="neuronx_distributed.pipeline is not served.*not an MoE inference module"):
        import neuronx_distributed.pipeline  # noqa: F401


def test_nxd_parallel_linear_layers_say_why(nxd_compat_fixture):  # noqa: F811
    """Not Python's bare "cannot import name": the served layers module names its unserved tensor-parallel layers,
    and stays an ordinary module for any other name."""
    with pytest.raises(ImportError, match=r"neuronx_distributed\.parallel_layers\.layers\.ColumnParallelLinear is "
                                          r"not served by nxd_moe's NxD front door \(NxD's tensor-parallel layers"):
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear  # noqa: F401
    from neuronx_distributed.parallel_layers import layers
    from neuronx_distributed.parallel_layers.layers import SPMDRank  # noqa: F401

    assert not hasattr(layers, "no_such_name")


def _fake_package(tmp_path, root: str, text: str):
    package = tmp_path / root
    package.mkdir()
    (package / "__init__.py").write_text(text)


@pytest.mark.parametrize("root", _ROOTS)
def test_a_real_package_is_refused_unless_forced(root, tmp_path, monkeypatch):
    _fake_package(tmp_path, root, "REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(nxd_compat.RealNxdError, match=f"a real {root} package is importable .*force=True"):
        nxd_compat.install()
    assert not nxd_compat.is_installed() and root not in sys.modules
    other = [r for r in _ROOTS if r != root]
    with nxd_compat.installed(families=other):  # leaving it out is fine
        pass
    with nxd_compat.installed(force=True):
        assert not hasattr(sys.modules[root], "REAL")
    module = __import__(root)
    assert module.REAL  # the real one again
    sys.modules.pop(root)


def test_the_pypi_placeholder_does_not_count_as_real(tmp_path, monkeypatch):
    _fake_package(tmp_path, "neuronx_distributed", 'raise ImportError("WRONG PACKAGE. Install it from the Neuron '
                                                   'repository")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert nxd_compat.real_package() is None
    with nxd_compat.installed():
        from neuronx_distributed.modules.moe import MoE  # noqa: F401


def test_python_dash_m_runs_a_script_and_refuses_a_real_nxd_unless_forced(tmp_path):
    """As a user with the Neuron SDK would meet it: with a real ``neuronx_distributed`` on the path the runner
    refuses; ``--force`` runs the NxD-style script (its arguments in ``sys.argv``) on nxd_moe."""
    _fake_package(tmp_path, "neuronx_distributed", "REAL = True\n")
    script = tmp_path / "nxd_script.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        import neuronx_distributed
        from neuronx_distributed.modules.moe import MoE, routing
        from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
        from neuronx_distributed.modules.moe.moe_configs import RoutedExpertsMLPOpsConfig

        router = routing.RouterTopK(num_experts=4, top_k=2, hidden_size=8)
        experts = ExpertMLPsV2(RoutedExpertsMLPOpsConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4,
                                                         hidden_act="silu", glu_mlp=True))
        out, = MoE(router, experts).eval()(torch.randn(2, 3, 8))
        print(sys.argv[1], hasattr(neuronx_distributed, "REAL"), tuple(out.shape))
    """))
    refused = _run("-m", "nxd_moe.nxd_compat", str(script), "hello", cwd=tmp_path)
    assert refused.returncode != 0 and "RealNxdError" in refused.stderr and "--force" in refused.stderr
    forced = _run("-m", "nxd_moe.nxd_compat", "--force", str(script), "hello", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.split() == ["hello", "False", "(2,", "3,", "8)"]


def test_runner_usage_errors(capsys):
    from nxd_moe.nxd_compat.__main__ import main

    assert main(["--alias", "nki", "script.py"]) == 2
    assert "a comma-separated subset of neuronx_distributed,neuronx_distributed_inference" in capsys.readouterr().err
    assert main(["-m"]) == 2 and "-m needs a module name" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "usage: python -m nxd_moe.nxd_compat" in capsys.readouterr().out
    assert not nxd_compat.is_installed()


def test_python_dash_m_pytest_runs_an_nxd_style_suite(tmp_path):
    """A conftest importing NxD at import time and a test module written against NxD's names."""
    (tmp_path / "conftest.py").write_text("from neuronx_distributed.parallel_layers import parallel_state\n")
    (tmp_path / "test_nxd_like.py").write_text(textwrap.dedent("""
        import torch
        from neuronx_distributed.modules.moe.moe_configs import RouterConfig

        def test_router_config():
            assert RouterConfig.from_kwargs(router_dtype="bfloat16").dtype == torch.bfloat16
    """))
    done = _run("-m", "nxd_moe.nxd_compat", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path),
                cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_fixture_installs_for_one_test(nxd_compat_fixture):  # noqa: F811
    assert nxd_compat_fixture is nxd_compat and nxd_compat.is_installed()
    with nxd_compat.installed():  # nested: leaves the outer installation alone
        pass
    assert nxd_compat.is_installed()


def test_fixture_left_nothing_behind():
    assert not nxd_compat.is_installed() and not _aliased()


def test_core_never_imports_the_front_door():
    """The arrows point one way: nxd_compat imports nxd_moe; only nxd_compat imports nxd_compat, and nxd_moe.nxdi
    (NxDI's entry point) is imported by nothing but nxd_compat."""
    import ast
    from pathlib import Path

    root = Path(nxd_compat.__file__).resolve().parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        inside = "nxd_compat" in path.relative_to(root).parts
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "nxd_moe":
                names += [f"nxd_moe.{a.name}" for a in node.names]
            for name in names:
                if (name.startswith("nxd_moe.nxd_compat") and not inside) or (
                        name.startswith("nxd_moe.nxdi") and not inside and path.name != "nxdi.py"):
                    offenders.append(f"{path.relative_to(root)} imports {name}")
    assert not offenders, offenders
