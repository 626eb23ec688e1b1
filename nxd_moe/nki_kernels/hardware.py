"""The simulated hardware: a Trn2 NeuronCore-v3's memories and fixed sizes, and the errors a kernel gets for asking
more of it than it has (or for an instruction only NeuronCore-v4 has).

A NeuronCore-v3 has 128 partitions of SBUF (224 KiB each) and of PSUM (8 banks of 2 KiB each); HBM is shared by
the two physical cores of a logical core. The sizes below are the ones ``nl.tile_size`` names.
"""

from __future__ import annotations

import enum

PMAX = 128  # nl.tile_size.pmax: partitions of SBUF/PSUM, and of any on-chip tile
SBUF_PARTITION_BYTES = 224 * 1024
PSUM_NUM_BANKS = 8
PSUM_BANK_BYTES = 2 * 1024
PSUM_FMAX = PSUM_BANK_BYTES // 4  # nl.tile_size.psum_fmax: fp32 elements of one bank, per partition
GEMM_STATIONARY_FMAX = 128  # nl.tile_size.gemm_stationary_fmax
GEMM_MOVING_FMAX = 512  # nl.tile_size.gemm_moving_fmax
BN_STATS_FMAX = 512  # nl.tile_size.bn_stats_fmax: elements per partition bn_stats reads


class Buffer(str, enum.Enum):
    """Where a tensor lives (NKI's memory regions)."""

    SHARED_HBM = "shared_hbm"
    PRIVATE_HBM = "private_hbm"
    SBUF = "sbuf"
    PSUM = "psum"

    @property
    def on_chip(self) -> bool:
        return self in (Buffer.SBUF, Buffer.PSUM)

    @property
    def kind(self) -> str:
        """``hbm`` | ``sbuf`` | ``psum``: how the accounting names a transfer's direction."""
        return "hbm" if not self.on_chip else self.value


class HardwareLimitError(ValueError):
    """An allocation or instruction broke a Trn2 limit; the message names the limit."""


class OutOfBoundsError(HardwareLimitError):
    """A dynamic DMA address fell outside its tensor with ``oob_mode=error``."""


class Trn3OnlyError(HardwareLimitError):
    """An instruction that exists only on NeuronCore-v4 (Trn3)."""
