"""NxD names the front door keeps importable but does not serve: training tools and Neuron-kernel plumbing.

NxD code (its MoE unit tests among it) imports them beside the MoE modules, so a module that lacked them would fail
at import -- before any of its inference code could run. Each such name is a :class:`NotServed`: importing it works,
and *using* it -- calling it, or reading an attribute (``ExpertAffinityScaleMode.POST_SCALE``) -- raises
:class:`NotServedError` saying what it is and why nxd_moe does not serve it. Never a silent stand-in.
"""

from __future__ import annotations

__all__ = ["NotServedError", "NotServed", "not_served", "TRAINING", "KERNELS", "QUANTIZATION"]

TRAINING = "training only: nxd_moe is an inference layer"
KERNELS = ("Neuron kernel plumbing: nxd_moe's kernels are its backends (backend='nki_sim' on the NKI tile "
           "simulator, 'triton' on GPUs), chosen by the backend rather than by NxD's eligibility rules")
QUANTIZATION = ("NxD's module-swapping quantization; nxd_moe quantizes expert weights through "
                "RoutedExpertsMLPOpsConfig(quantization=...) (docs/quantization.md)")


class NotServedError(NotImplementedError):
    """An NxD name that nxd_moe's front door keeps importable but does not serve."""


# Attributes introspection probes with getattr(obj, name, default), which only an AttributeError answers: dunders,
# and asyncio's coroutine markers (unittest.mock.patch asks whether what it replaces is a coroutine function).
_PROBES = ("_is_coroutine", "_is_coroutine_marker")


class NotServed:
    """Stands in for NxD's ``qualname`` (a function, class, constant or module attribute): using it -- calling it,
    or reading an attribute, NxD's private methods included -- raises :class:`NotServedError` with ``why``. Dunder
    attributes and asyncio's coroutine markers raise ``AttributeError`` as usual, so introspection (``hasattr``,
    ``unittest.mock.patch``, pytest's collection) sees an ordinary object."""

    def __init__(self, qualname: str, why: str):
        self._qualname = qualname
        self._why = why

    def _error(self) -> NotServedError:
        return NotServedError(f"{self._qualname} is not served by nxd_moe's NxD front door ({self._why}); "
                              "docs/nxd.md lists what is")

    def __call__(self, *args, **kwargs):
        raise self._error()

    def __getattr__(self, name: str):
        if (name.startswith("__") and name.endswith("__")) or name in _PROBES:
            raise AttributeError(name)
        raise self._error()

    def __repr__(self) -> str:
        return f"<{self._qualname}: not served ({self._why})>"


def not_served(module: str, why: str, *names: str) -> dict[str, NotServed]:
    """``{name: NotServed(f"{module}.{name}", why)}`` for each of ``names``."""
    return {name: NotServed(f"{module}.{name}", why) for name in names}
