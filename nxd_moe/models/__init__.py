"""Whole models: nxd_moe inside ``transformers`` models, built, patched, generated with and traced.

- :mod:`~nxd_moe.models.experts_backend`: the experts implementations ``"nxd_moe"``, ``"nxd_moe_torch"`` and
  ``"nxd_moe_triton"`` of transformers' experts interface (``from_pretrained(..., experts_implementation="nxd_moe")``),
  registered by ``import nxd_moe.hf``.
- :mod:`~nxd_moe.models.patch`: ``patch_model`` (also ``nxd_moe.hf.patch_model``) replaces every sparse-MoE block
  with nxd_moe's ``MoE``, keeping the model's checkpoint keys.
- :mod:`~nxd_moe.models.hf_models`: ``build_hf_model``, the transformers model of a shipped config.
"""

from nxd_moe.models.experts_backend import (
    IMPLEMENTATIONS,
    UnsupportedExpertsError,
    check_experts_support,
    experts_forward,
    nxd_moe_experts_forward,
    register_experts_implementations,
    set_experts_implementation,
)

__all__ = [
    "IMPLEMENTATIONS",
    "UnsupportedExpertsError",
    "check_experts_support",
    "experts_forward",
    "nxd_moe_experts_forward",
    "register_experts_implementations",
    "set_experts_implementation",
]
