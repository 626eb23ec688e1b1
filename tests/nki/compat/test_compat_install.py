"""install() / uninstall(): sys.modules aliasing, reversibility, refusing a real nki, the runner and the fixture."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nxd_moe.nki_kernels import compat, isa, language
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture


def _nki_modules() -> dict:
    return {k: v for k, v in sys.modules.items() if k == "nki" or k.startswith("nki.")}


def test_install_aliases_the_nki_modules_and_uninstall_restores_sys_modules():
    before = _nki_modules()
    module = compat.install()
    try:
        import nki
        import nki.isa as nisa
        import nki.language as nl
        from nki.isa.constants import dge_mode, oob_mode

        assert nki is module and nl is language and nisa is isa
        assert oob_mode is isa.oob_mode and dge_mode.hwdge == 2
        assert compat.install() is module  # idempotent
    finally:
        compat.uninstall()
    assert _nki_modules() == before
    compat.uninstall()  # a second uninstall is a no-op
    assert "nki" not in sys.modules or not hasattr(sys.modules["nki"], "jit")


def test_installed_context_manager_and_fixture(nki_compat):  # noqa: F811
    import nki.language as nl

    assert nki_compat.language is nl
    with compat.installed() as nki:  # nested: leaves the outer installation alone
        assert nki is nki_compat
    assert compat.is_installed()


def _fake_nki(tmp_path, text: str):
    package = tmp_path / "nki"
    package.mkdir()
    (package / "__init__.py").write_text(text)
    return package


def test_refuses_a_real_nki_unless_forced(tmp_path, monkeypatch):
    _fake_nki(tmp_path, "REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(compat.RealNkiError, match="real nki package is importable.*force=True"):
        compat.install()
    assert not compat.is_installed()
    compat.install(force=True)
    try:
        import nki

        assert not hasattr(nki, "REAL") and nki.jit is compat.jit
    finally:
        compat.uninstall()
    import nki

    assert nki.REAL  # the real one again
    sys.modules.pop("nki")


def test_the_pypi_placeholder_does_not_count_as_real(tmp_path, monkeypatch):
    _fake_nki(tmp_path, 'raise ImportError("WRONG PACKAGE. Please install the package from Neuron Repository")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with compat.installed() as nki:
        assert nki.simulate is compat.simulate


def test_python_dash_m_runs_a_script_with_nki_installed(tmp_path):
    script = tmp_path / "kernel_script.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import nki, nki.isa as nisa, nki.language as nl

        @nki.jit
        def double(a):
            out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
            nisa.dma_copy(dst=out, src=t)
            return out

        print(sys.argv[1], float(nki.simulate(double)(np.ones((4, 8), np.float32)).sum()))
    """))
    result = subprocess.run([sys.executable, "-m", "nxd_moe.nki_kernels.compat", str(script), "hello"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["hello", "64.0"]


def test_jit_launch_syntax_and_last_run(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl

    @nki_compat.jit(mode="trace")
    def who(a):
        out = nl.ndarray((2, 4), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.iota(t, [[1, 4]], offset=10 * nl.program_id(0) + nl.num_programs(0) + 100 * nl.program_ndim())
        nisa.dma_copy(dst=out[nl.program_id(0)], src=t)
        return out

    a = np.zeros(1, np.float32)
    np.testing.assert_array_equal(nki_compat.simulate(who[2])(a), [[102, 103, 104, 105], [112, 113, 114, 115]])
    assert compat.last_run().lnc == 2 and len(compat.last_run().cores) == 2
    np.testing.assert_array_equal(who(a)[0], [1, 2, 3, 4])  # a plain host call: one core, no launch grid
    with pytest.raises(ValueError, match="one axis of 1 or 2 cores"):
        who[4]


def test_torch_in_torch_out_and_inputs_written_back(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl
    import torch

    def scale_in_place(a):
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
        nisa.dma_copy(dst=a, src=t)
        return a

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    nki_compat.simulate(scale_in_place)(x)
    np.testing.assert_array_equal(x, np.arange(8).reshape(2, 4) * 3)
    y = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    out = nki_compat.simulate(scale_in_place)(y)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert out.float().tolist() == (torch.arange(8).reshape(2, 4) * 3).float().tolist()


def test_device_only_entry_points_explain_themselves(nki_compat):  # noqa: F811
    with pytest.raises(RuntimeError, match="NeuronDevice"):
        nki_compat.benchmark(lambda: None)
