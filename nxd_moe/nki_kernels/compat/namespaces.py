"""The module names under which NKI code imports the simulator, grouped in families that :func:`install` aliases
on request:

- ``nki``: ``nki``, ``nki.language`` (+ ``nki.language.dtypes``), ``nki.isa`` (+ ``nki.isa.constants``),
  ``nki.typing``, ``nki.compiler`` (+ ``nki.compiler.frontend``), ``nki.tensor``, ``nki.builtin``, ``nki.dtype`` --
  every name nki-library's ``test/utils/simulation_setup.py`` puts in ``sys.modules`` -- and ``nki.collectives``;
- ``nki_cpu_simulator``: the same modules under AWS's CPU-simulator package (``nki_cpu_simulator.nki.isa``, ...),
  which that harness imports in ``--test-mode simulation``;
- ``neuronxcc``: the legacy ``neuronxcc.nki.*`` namespace (NxD and some nki-library files import
  ``neuronxcc.nki.typing``; the qkv tests ``neuronxcc.starfish.support.dtype``; NxD's MoE unit tests
  ``neuronxcc.nki._private_kernels.blockwise_mm.SkipMode``, the blockwise kernels' DMA-skipping flags);
- ``neuron_dtypes``: the stand-in :mod:`~nxd_moe.nki_kernels.compat.neuron_dtypes` on ``ml_dtypes``.

One implementation behind every name: ``nki.isa`` *is* :mod:`nxd_moe.nki_kernels.isa` whichever way it is reached.
"""

from __future__ import annotations

import types

import numpy as np

from nxd_moe.aliasing import new_module as _module
from nxd_moe.aliasing import new_package as _package
from nxd_moe.moe_configs import SkipMode
from nxd_moe.nki_kernels import isa, language
from nxd_moe.nki_kernels.compat import collectives, frontend, neuron_dtypes, nki_typing


def _no_compiler(name: str):
    def __getattr__(attribute: str):  # noqa: N807 -- a module's __getattr__
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise AttributeError(f"{name}.{attribute}: the Neuron compiler is not part of the nxd_moe CPU simulator "
                             "(nki.jit kernels run on the simulator; compile on a Neuron SDK image)")

    return __getattr__


constants = _module("nki.isa.constants", "NKI's instruction constants (nki.isa.constants).",
                    oob_mode=isa.oob_mode, dge_mode=isa.dge_mode, engine=isa.engine, nc_version=isa.nc_version,
                    reduce_cmd=isa.reduce_cmd, matmul_perf_mode=isa.matmul_perf_mode, dma_engine=isa.dma_engine)
dtypes = _module("nki.language.dtypes", "NKI's dtypes (nki.language.dtypes): NumPy / ml_dtypes dtypes.",
                 **{name: value for name, value in vars(language).items()
                    if not name.startswith("_") and isinstance(value, np.dtype)})
typing = nki_typing
compiler = _package("nki.compiler", "nki.compiler: the Neuron compiler's driver -- not part of the CPU simulator "
                    "(only its trace front end, nki.compiler.frontend, which traces by simulating).")
compiler.__getattr__ = _no_compiler("nki.compiler")


class ParserFrontend:
    """``nki.compiler.frontend.ParserFrontend``: the compiler's Python front end, which traces a kernel into MLIR. A
    trace here is a simulated run of the kernel with the given inputs: every shape check, ``kernel_assert`` and
    hardware limit it meets is checked as the trace checks it, and no MLIR module is produced (``result.module`` is
    ``None``). nki-library's ``trace_only`` tests (``core/utils/test_tensor_view.py``) call it in simulation mode."""

    def compile(self, kernel, inputs: dict | None = None, target: str | None = None, lnc: int = 1, **options):
        run = frontend._run(kernel[lnc] if isinstance(kernel, frontend.Kernel) else frontend.Kernel(kernel)[lnc],
                            (), dict(inputs or {}))
        return types.SimpleNamespace(module=None, run=run, target=target, lnc=lnc)


compiler_frontend = _module("nki.compiler.frontend", ParserFrontend.__doc__, ParserFrontend=ParserFrontend,
                            NKIFrontend=ParserFrontend, TracerFrontend=ParserFrontend)
compiler.frontend = compiler_frontend
tensor = _module("nki.tensor", "nki.tensor: the NKI tensor type.", Tensor=language.NkiTensor,
                 NkiTensor=language.NkiTensor, tensor=language.NkiTensor)
builtin = _module("nki.builtin", "nki.builtin: the NKI builtins (the simulator's language and isa).",
                  language=language, isa=isa)

isa.constants = constants  # `from nki.isa import constants` as well as `import nki.isa.constants`
language.dtypes = dtypes
for _name, _value in (("language", language), ("isa", isa), ("typing", typing), ("compiler", compiler),
                      ("tensor", tensor), ("builtin", builtin), ("collectives", collectives)):
    setattr(frontend, _name, _value)

NKI: dict[str, types.ModuleType] = {
    "nki": frontend,
    "nki.language": language,
    "nki.language.dtypes": dtypes,
    "nki.isa": isa,
    "nki.isa.constants": constants,
    "nki.typing": typing,
    "nki.compiler": compiler,
    "nki.compiler.frontend": compiler_frontend,
    "nki.tensor": tensor,
    "nki.builtin": builtin,
    "nki.collectives": collectives,
    "nki.dtype": dtypes,  # nki-library's harness puts the dtypes module there
}


def _under(prefix: str, root: types.ModuleType) -> dict[str, types.ModuleType]:
    """The ``nki`` modules again under ``prefix`` (``prefix.nki``, ``prefix.nki.isa``, ...), ``root`` as ``prefix``."""
    return {prefix: root, **{f"{prefix}.{name}": module for name, module in NKI.items()}}


_simulator = _package("nki_cpu_simulator", "AWS's CPU-simulator package names, served by the nxd_moe simulator.",
                      nki=frontend)
_neuronxcc = _package("neuronxcc", "The legacy neuronxcc namespace (its nki modules only), served by the nxd_moe "
                      "simulator.", nki=frontend)
_starfish_dtype = neuron_dtypes  # neuronxcc.starfish.support.dtype: the same static_cast

FAMILIES: dict[str, dict[str, types.ModuleType]] = {
    "nki": NKI,
    "nki_cpu_simulator": _under("nki_cpu_simulator", _simulator),
    "neuronxcc": {**_under("neuronxcc", _neuronxcc),
                  "neuronxcc.starfish": _package("neuronxcc.starfish", "legacy neuronxcc.starfish (dtype only)"),
                  "neuronxcc.starfish.support": _package("neuronxcc.starfish.support", "legacy (dtype only)"),
                  "neuronxcc.starfish.support.dtype": _starfish_dtype,
                  "neuronxcc.nki._private_kernels": _package("neuronxcc.nki._private_kernels",
                                                             "neuronxcc's private kernels (blockwise_mm's names only)"),
                  "neuronxcc.nki._private_kernels.blockwise_mm": _module(
                      "neuronxcc.nki._private_kernels.blockwise_mm", "The blockwise-matmul kernels' SkipMode "
                      "(nxd_moe.config.SkipMode); the kernels are nxd_moe.nki_kernels'.", SkipMode=SkipMode)},
    "neuron_dtypes": {"neuron_dtypes": neuron_dtypes},
}
FAMILIES["neuronxcc"]["neuronxcc.starfish"].support = FAMILIES["neuronxcc"]["neuronxcc.starfish.support"]
FAMILIES["neuronxcc"]["neuronxcc.starfish.support"].dtype = _starfish_dtype
_neuronxcc.starfish = FAMILIES["neuronxcc"]["neuronxcc.starfish"]
