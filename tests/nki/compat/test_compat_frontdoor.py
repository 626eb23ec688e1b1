"""The harness front door: module families (AWS's ``nki_cpu_simulator`` names, legacy ``neuronxcc.nki``, the
``neuron_dtypes`` stand-in), ``nki.cpu_simulate(kernel)[lnc](**inputs)``, and ``python -m ...compat -m MODULE``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from nxd_moe.nki_kernels import compat, isa, language
from nxd_moe.nki_kernels.compat import neuron_dtypes
from nxd_moe.nki_kernels.compat.__main__ import UsageError, parse

_ROOTS = ("nki", "nki_cpu_simulator", "neuronxcc", "neuron_dtypes")


def _aliased() -> dict:
    return {k: v for k, v in sys.modules.items() if any(k == r or k.startswith(r + ".") for r in _ROOTS)}


def test_every_family_resolves_to_one_implementation_and_uninstall_restores():
    before = _aliased()
    compat.install(families=compat.ALL_FAMILIES)
    try:
        # The imports of nki-library's test/utils/simulation_setup.py, verbatim in form (and order).
        # isort: off
        import nki_cpu_simulator.nki.builtin as sim_builtin
        import nki_cpu_simulator.nki.compiler as sim_ncc
        import nki_cpu_simulator.nki.isa as sim_nisa
        import nki_cpu_simulator.nki.isa.constants as sim_nisa_constants
        import nki_cpu_simulator.nki.language as sim_nl
        import nki_cpu_simulator.nki.language.dtypes as sim_dtypes
        import nki_cpu_simulator.nki.tensor as sim_ntensor
        import nki_cpu_simulator.nki.typing as sim_nt
        from nki_cpu_simulator import nki as sim_nki

        import neuron_dtypes as dt
        import neuronxcc.nki.isa as legacy_nisa
        import neuronxcc.nki.typing as legacy_nt
        from neuronxcc.starfish.support.dtype import static_cast

        import nki
        # isort: on

        assert sim_nki is nki and sim_nisa is isa is legacy_nisa and sim_nl is language
        assert sim_nisa_constants.oob_mode is isa.oob_mode and sim_nt is legacy_nt
        assert sim_dtypes.bfloat16 == ml_dtypes.bfloat16 and sim_dtypes.float8_e4m3fn_x4 is language.float8_e4m3fn_x4
        assert sim_ntensor.Tensor is language.NkiTensor and sim_builtin.isa is isa
        assert dt is neuron_dtypes and static_cast is neuron_dtypes.static_cast
        with pytest.raises(AttributeError, match="Neuron compiler is not part of"):
            sim_ncc.NKIFrontend  # noqa: B018
    finally:
        compat.uninstall()
    assert _aliased() == before


def test_nothing_is_aliased_unless_asked():
    with compat.installed():
        assert compat.installed_families() == ("nki",)
        assert "nki_cpu_simulator" not in sys.modules and "neuron_dtypes" not in sys.modules
        with pytest.raises(ValueError, match="uninstall"):
            compat.install(families=("neuronxcc",))
    with pytest.raises(ValueError, match="one of"):
        compat.install(families=("numpy",))


@pytest.mark.parametrize("root", ["neuronxcc", "neuron_dtypes", "nki_cpu_simulator"])
def test_a_real_package_of_any_family_is_refused_unless_forced(root, tmp_path, monkeypatch):
    package = tmp_path / root
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(compat.RealNkiError, match=f"{root} .*--alias"):
        compat.install(families=compat.ALL_FAMILIES)
    assert not compat.is_installed()
    with compat.installed(families=("nki",)):  # leaving it out is fine
        pass
    with compat.installed(force=True, families=(root,)):
        assert not hasattr(sys.modules[root], "REAL")
    sys.modules.pop(root, None)


def _double_rows(a, b):
    """out = 2 * a + b on one core, or one half of the rows per core of an LNC2 launch."""
    nl, nisa = language, isa
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    rows = a.shape[0] // nl.num_programs(0)
    r0 = nl.program_id(0) * rows
    t = nl.ndarray((rows, a.shape[1]), a.dtype, buffer=nl.sbuf)
    u = nl.ndarray((rows, a.shape[1]), a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[r0:r0 + rows])
    nisa.dma_copy(dst=u, src=b[r0:r0 + rows])
    nisa.scalar_tensor_tensor(dst=t, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=u)
    nisa.dma_copy(dst=out[r0:r0 + rows], src=t)
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_cpu_simulate_as_the_harness_calls_it(lnc):
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    b = np.full((8, 4), 0.5, np.float32)
    with compat.installed() as nki:
        out = nki.cpu_simulate(nki.jit(_double_rows))[lnc](a=a, b=b)  # keyword inputs, as the harness passes them
        assert compat.last_run().lnc == lnc
        np.testing.assert_array_equal(out, 2 * a + b)
        np.testing.assert_array_equal(nki.cpu_simulate(_double_rows)(a, b), 2 * a + b)  # no grid: one core
        with pytest.raises(ValueError, match="1 or 2 cores"):
            nki.cpu_simulate(_double_rows)[3]


def test_neuron_dtypes_stand_in_against_ml_dtypes():
    x = np.array([1.00390625, -2.5, 1e-3, 3.0e5, np.nan], np.float32)
    np.testing.assert_array_equal(neuron_dtypes.static_cast(x, "bfloat16").view(np.uint16),
                                  x.astype(ml_dtypes.bfloat16).view(np.uint16))  # nearest-even, NaN kept
    e4m3 = neuron_dtypes.static_cast(x[:3], neuron_dtypes.float8_e4m3fn)
    assert e4m3.dtype == ml_dtypes.float8_e4m3fn and e4m3.astype(np.float32).tolist() == [1.0, -2.5, 2.0**-9]
    bf = x[:2].astype(ml_dtypes.bfloat16)
    assert neuron_dtypes.static_cast(bf, np.float16).tolist() == [1.0, -2.5]  # narrow to narrow through fp32
    np.testing.assert_array_equal(neuron_dtypes.static_cast(np.array([2.7, -2.7, 0.5]), np.int32), [2, -2, 0])
    ids = np.array([[3, 1]], np.int64)
    assert neuron_dtypes.static_cast(ids, np.int32).dtype == np.int32
    assert neuron_dtypes.sizeinbytes(np.float32) == 4 and neuron_dtypes.sizeinbytes(ml_dtypes.float8_e4m3fn) == 1
    assert neuron_dtypes.finfo(ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
    assert neuron_dtypes.finfo(np.float32).max == np.finfo(np.float32).max
    assert neuron_dtypes.is_float_type(ml_dtypes.bfloat16) and neuron_dtypes.is_float_type("float8_e4m3")
    assert not neuron_dtypes.is_float_type(np.int32) and not neuron_dtypes.is_float_type(np.bool_)
    with pytest.raises(neuron_dtypes.MxFormatError, match="Trn3"):
        neuron_dtypes.static_cast(x, neuron_dtypes.float8_e4m3fn_x4)


def test_runner_options_come_before_the_script_or_module():
    assert parse(["-m", "pytest", "-x", "--test-mode", "simulation"]) == (
        False, compat.ALL_FAMILIES, "pytest", ["-x", "--test-mode", "simulation"])
    assert parse(["--force", "--alias", "nki,neuron_dtypes", "s.py", "--force"]) == (
        True, ("nki", "neuron_dtypes"), None, ["s.py", "--force"])
    assert parse(["--alias=nki", "-mpytest"])[1:3] == (("nki",), "pytest")
    for bad in (["--alias", "numpy", "s.py"], ["-m"], ["--verbose", "s.py"], []):
        with pytest.raises(UsageError):
            parse(bad)


def test_python_dash_m_pytest_runs_a_harness_like_suite(tmp_path):
    """A conftest importing ``nki`` at import time (as nki-library's does) and a test calling
    ``nki.cpu_simulate(kernel)[lnc]`` through AWS's simulator module name."""
    (tmp_path / "conftest.py").write_text("import nki.isa  # imported while pytest loads the conftest\n")
    (tmp_path / "test_harness_like.py").write_text(textwrap.dedent("""
        import numpy as np
        import neuron_dtypes as dt
        import nki.isa as nisa
        import nki.language as nl
        from nki_cpu_simulator import nki as sim_nki

        def kernel(a):
            out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            nisa.activation(dst=t, op=nl.exp, data=t)
            nisa.dma_copy(dst=out, src=t)
            return out

        def test_exp():
            a = dt.static_cast(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), np.float32)
            np.testing.assert_allclose(sim_nki.cpu_simulate(kernel)[1](a=a), np.exp(a), rtol=1e-6)
    """))
    result = subprocess.run([sys.executable, "-m", "nxd_moe.nki_kernels.compat", "-m", "pytest", "-q",
                             "-p", "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
