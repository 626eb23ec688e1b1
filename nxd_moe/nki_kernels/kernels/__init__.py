"""MoE kernels written on the tile machine, with the NKI library's names and input contract.

Prefill (blockwise matmul): :func:`bwmm_shard_on_H`, :func:`bwmm_shard_on_I` (hybrid static + dynamic-while),
:func:`bwmm_shard_on_block` (HI_LO / PING_PONG, optional dynamic loop). Decode: :func:`moe_tkg_all_expert`,
:func:`moe_tkg_selective_expert`. Each runs on one core or, launched with ``lnc=2``, on both cores of a logical
NeuronCore.
"""

from nxd_moe.nki_kernels.kernels.bwmm_shard_on_block import bwmm_shard_on_block, core_blocks, shard_conditions
from nxd_moe.nki_kernels.kernels.bwmm_shard_on_H import bwmm_shard_on_H
from nxd_moe.nki_kernels.kernels.bwmm_shard_on_I import bwmm_shard_on_I
from nxd_moe.nki_kernels.kernels.expert_mlp import ExpertAffinityScaleMode
from nxd_moe.nki_kernels.kernels.moe_tkg import moe_tkg_all_expert, moe_tkg_selective_expert

__all__ = [
    "ExpertAffinityScaleMode",
    "bwmm_shard_on_H",
    "bwmm_shard_on_I",
    "bwmm_shard_on_block",
    "core_blocks",
    "moe_tkg_all_expert",
    "moe_tkg_selective_expert",
    "shard_conditions",
]
