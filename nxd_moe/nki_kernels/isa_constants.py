"""NKI's instruction constants (``nki.isa.constants``): the engines, the accumulator commands, what a DMA does out of
bounds, how its descriptors are made, the matmul performance modes, the DMA engines and the NeuronCore versions.
The instructions take them as arguments; :mod:`~nxd_moe.nki_kernels.isa` serves them as ``nisa.*``."""

from __future__ import annotations

import enum


class engine(enum.IntEnum):  # noqa: N801 -- NKI's name
    """The engine an instruction runs on (``unknown``: the compiler picks; here the op's default engine)."""

    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.IntEnum):  # noqa: N801 -- NKI's name
    """The Vector/Scalar Engine accumulator registers: ``idle`` leaves them, ``reset_reduce`` starts a reduction,
    ``reduce`` continues one, ``load_reduce`` starts from given values."""

    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class oob_mode:  # noqa: N801 -- NKI's name
    """What a DMA does with a dynamic address outside its tensor: raise (``error``) or drop that row (``skip``)."""

    error = "error"
    skip = "skip"


class dge_mode(enum.IntEnum):  # noqa: N801 -- NKI's name
    """How DMA descriptors are generated: before the run (``none``), by GpSimd (``swdge``) or by the DGE hardware
    (``hwdge``). Descriptor generation is not timed here; the mode is checked and recorded only."""

    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class nc_version(enum.IntEnum):  # noqa: N801 -- NKI's name
    gen2 = 2
    gen3 = 3
    gen4 = 4


class matmul_perf_mode(str, enum.Enum):  # noqa: N801 -- NKI's name
    none = "none"
    double_row = "double_row"


class dma_engine(enum.IntEnum):  # noqa: N801 -- NKI's name
    dma = 1
    gpsimd_dma = 2
