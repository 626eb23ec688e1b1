"""An engine-sequencer register (``nisa.register_alloc``): what dynamic loop bounds, ``while`` conditions and DMA
``scalar_offset`` values are held in on the device."""

from __future__ import annotations

from typing import Any


class VirtualRegister:
    """An engine-sequencer register (``nisa.register_alloc``): a dynamic loop bound or ``while`` condition.

    ``while reg:`` reads it on the device; each read is counted as a branch.
    """

    def __init__(self, core: Any, value: int = 0):
        # core: the machine.Core that owns it (its accounting counts the branches; its trace fences them)
        self.core = core
        self.value = int(value)

    def __bool__(self) -> bool:
        self.core.accounting.branches += 1
        if self.core.trace is not None:  # a branch on the device: nothing is scheduled across it
            self.core.trace.begin(fence=True)
        return self.value != 0

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"
