"""Every name of the NKI API inventory (``nki_api_names.py``: the NKI API reference's public names plus what
nki-library imports) exists behind the front door; Trn3-only instructions raise ``Trn3OnlyError`` and collectives
between ranks ``CollectivesNotSimulatedError`` when called."""

from __future__ import annotations

import collections
import importlib

import numpy as np
import pytest
from nki_api_names import DOCUMENTED, MULTI_RANK, SIM, TRN3, TRN3_ONLY, inventory

from nxd_moe.nki_kernels import compat
from nxd_moe.nki_kernels.compat.collectives import CollectivesNotSimulatedError
from nxd_moe.nki_kernels.compat.pytest_plugin import nki_compat  # noqa: F401 -- the fixture
from nxd_moe.nki_kernels.instructions.trn3 import Trn3OnlyError


def test_every_listed_name_exists(nki_compat):  # noqa: F811
    def present(module: str, name: str) -> bool:
        obj = importlib.import_module(module)
        for part in name.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    missing = [f"{module}.{name}" for module, name, _ in inventory() if not present(module, name)]
    assert not missing, f"missing from the front door: {missing}"


def test_inventory_counts():
    """The numbers docs/nki.md quotes."""
    counts = collections.Counter(s for _, _, s in inventory())
    documented = sum(len(v) for v in DOCUMENTED.values())
    assert (documented, len(inventory())) == (215, 265)
    assert counts == {SIM: 249, TRN3: 6, MULTI_RANK: 10}


def test_trn3_only_instructions_raise_a_named_error_when_called(nki_compat):  # noqa: F811
    import nki.isa as nisa
    import nki.language as nl

    def body():
        t = nl.zeros((4, 4), nl.float32)
        for name in (n for n in TRN3_ONLY if "." not in n):
            with pytest.raises(Trn3OnlyError, match=rf"nisa\.{name} .*NeuronCore-v4"):
                getattr(nisa, name)(t, t)
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    assert not compat.run(body).outputs.any()


def test_collectives_between_ranks_raise_a_named_error(nki_compat):  # noqa: F811
    import nki.collectives as ncc

    group = ncc.ReplicaGroup([[0, 1], [2, 3]])
    assert group.groups == [[0, 1], [2, 3]] and ncc.rank_id() == 0
    with pytest.raises(ValueError, match="overlap"):
        ncc.ReplicaGroup([[0, 1], [1, 2]])
    for name, _, status in ((n, m, s) for m, n, s in inventory() if m == "nki.collectives"):
        if status == MULTI_RANK:
            with pytest.raises(CollectivesNotSimulatedError, match=rf"nki\.collectives\.{name}: collectives"):
                getattr(ncc, name)([], [], group)


def test_front_door_module_forms(nki_compat):  # noqa: F811
    """``nki.isa.NkiValidationError`` is the simulator's limit error; ``NkiInstruction.depends_on`` chains;
    ``nl.MemoryRegion`` holds the buffers; ``nl.DType`` the dtypes; ``nki.compiler.frontend`` traces by running."""
    import nki
    import nki.compiler.frontend as frontend
    import nki.isa as nisa
    import nki.language as nl

    from nxd_moe.nki_kernels.machine import HardwareLimitError

    assert nisa.NkiValidationError is HardwareLimitError
    a, b = nisa.NkiInstruction(1), nisa.NkiInstruction(2)
    assert b.depends_on(a) is b and b.dependencies == [a]
    assert nl.sbuf in list(nl.MemoryRegion) and isinstance(nl.bfloat16, nl.DType)

    @nki.jit
    def check_shape(x, rows):
        assert x.shape[0] == rows, "traced shape check"
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    x = np.ones((4, 2), np.float32)
    assert frontend.ParserFrontend().compile(check_shape, inputs={"x": x, "rows": 4}, target="trn2", lnc=1).module \
        is None
    with pytest.raises(AssertionError, match="traced shape check"):
        frontend.ParserFrontend().compile(check_shape, inputs={"x": x, "rows": 5}, target="trn2", lnc=1)


@pytest.mark.parametrize("first", ["nxd_moe.nki_kernels.instructions.top8", "nxd_moe.nki_kernels.tiles"])
def test_any_module_can_be_imported_first(first):
    """language, isa, tiles and the instruction families import each other: each must work as the first import."""
    import subprocess
    import sys

    code = f"import {first}; from nxd_moe.nki_kernels import isa, language; assert language.softmax and isa.max8"
    subprocess.run([sys.executable, "-c", code], check=True)
