"""``ExpertMLPsV2(..., backend="nki_sim")``: the expert algorithms run as NKI kernels on the tile simulator.

The front end's routing and block mapping are turned into the kernels' HBM inputs exactly as NxD prepares them
for the real kernels (``augment_inputs_for_padded_blockwise_matmul``: without token skipping, padding slots point
at an appended zero row ``T``; the affinities are flattened to ``(T_rows * E, 1)``; ``gate_up_proj (E, H, 2I)``
is viewed as ``(E, H, 2, I)``), the kernel the configuration selects is launched, and its output comes back as a
torch tensor. The last launch stays inspectable as :attr:`NkiSimBackend.last_run` (its accounting) and
:attr:`NkiSimBackend.last_kernel`.

Kernel selection (``BlockwiseMatmulConfig``): ``use_shard_on_intermediate_dynamic_while`` -> shard-on-I with the
hybrid dynamic loop; ``use_shard_on_block_dynamic_while`` -> shard-on-block (``block_sharding_strategy``) with the
dynamic loop; ``use_block_parallel`` -> shard-on-block, static; otherwise shard-on-H (NxD's default LNC2
sharding). Each runs on ``logical_nc_config`` cores; ``skip_dma_token`` / ``skip_dma_weight`` choose the skip
modes. Decode runs the selective-loading or all-experts kernel on ``decode_lnc`` cores.

Supported dtypes: float32, bfloat16, float16 (the Trainium types); float64 raises. Every weight format of
:mod:`nxd_moe.quantization`: the kernels read the stored bytes and scales from HBM and dequantize each weight tile
on chip (:func:`~nxd_moe.nki_kernels.isa.dequantize`) before the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from nxd_moe.checks import check_int
from nxd_moe.experts.backends import ExpertsBackend, TorchBackend
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.experts.routing_inputs import Routing
from nxd_moe.experts.token_mapping import num_static_blocks
from nxd_moe.moe_configs import BlockShardStrategy, BlockwiseMatmulConfig, default_logical_nc_config
from nxd_moe.nki_kernels import language as nl
from nxd_moe.nki_kernels.compat.frontend import Kernel
from nxd_moe.nki_kernels.compat.frontend import run as run_nki
from nxd_moe.nki_kernels.kernels import (
    ExpertAffinityScaleMode,
    bwmm_shard_on_block,
    bwmm_shard_on_H,
    bwmm_shard_on_I,
    moe_tkg_all_expert,
    moe_tkg_selective_expert,
    shard_conditions,
)
from nxd_moe.nki_kernels.lnc import KernelRun, simulate
from nxd_moe.quantization import QUANTIZATION_CHOICES

SUPPORTED_DTYPES = {torch.float32: nl.float32, torch.bfloat16: nl.bfloat16, torch.float16: nl.float16}


def to_numpy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """A CPU NumPy copy (bfloat16 as ``ml_dtypes.bfloat16``), cast to ``dtype`` first if given."""
    t = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(nl.bfloat16).copy()
    return t.numpy().copy()


def to_torch(array: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if array.dtype == nl.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device, dtype)


def _compute_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the nki_sim backend runs Trainium dtypes {sorted(str(d) for d in SUPPORTED_DTYPES)}; got "
                        f"{hidden_states.dtype} (use the torch backend for float64)")
    return hidden_states.dtype


@dataclass(frozen=True)
class KernelCall:
    """A kernel with its inputs, ready to launch on ``lnc`` cores."""

    name: str
    kernel: Callable
    lnc: int
    args: dict[str, Any]

    def run(self, numerics: bool = True) -> KernelRun:
        if isinstance(self.kernel, Kernel):  # an @nki.jit kernel written for the real compiler
            return run_nki(self.kernel, lnc=self.lnc, numerics=numerics, **self.args)
        return simulate(self.kernel, self.lnc, numerics)(**self.args)


def _stored_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A stored quantized tensor's bytes as NumPy (FP8 as ``ml_dtypes.float8_e4m3fn``)."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(nl.float8_e4m3fn).copy()
    return t.numpy().copy()


def weight_arrays(weights: ExpertWeights, dtype: torch.dtype) -> dict[str, Any]:
    """The kernels' weight inputs: ``gate_up_proj (E, H, 2I)`` viewed as ``(E, H, 2, I)``, biases likewise.

    Quantized weights go in as stored (``(E, H/v, 2I)`` / ``(E, I/v, H)`` bytes) with NxD's ``gate_up_proj_scale``
    / ``down_proj_scale`` and ``weight_format``: the kernels DMA them packed and dequantize on chip."""
    if weights.activation.gate_up_interleaved:
        raise ValueError("the nki_sim backend takes gate/up weights as [gate | up] column halves (NxD's layout); "
                         "interleaved gate/up columns (g0, u0, g1, u1, ...) run on the 'torch' and 'triton' backends")
    experts, hidden, width = weights.gate_up_proj.shape
    projections = 2 if weights.activation.glu_mlp else 1
    if weights.format == "bf16":
        args = {
            "gate_up_proj_weight": to_numpy(weights.gate_up_proj, dtype).reshape(experts, hidden, projections, -1),
            "down_proj_weight": to_numpy(weights.down_proj, dtype),
        }
    else:
        args = {
            "gate_up_proj_weight": _stored_numpy(weights.gate_up_proj.weight),
            "down_proj_weight": _stored_numpy(weights.down_proj.weight),
            "gate_up_proj_scale": _stored_numpy(weights.gate_up_proj.scale),
            "down_proj_scale": _stored_numpy(weights.down_proj.scale),
            "weight_format": weights.format,
        }
    args.update(gate_and_up_proj_bias=None, down_proj_bias=None)
    if weights.gate_up_bias is not None:
        args["gate_and_up_proj_bias"] = to_numpy(weights.gate_up_bias, dtype).reshape(experts, projections, -1)
    if weights.down_bias is not None:
        args["down_proj_bias"] = to_numpy(weights.down_bias, dtype)
    return args


def _scaling_mode(routing: Routing) -> ExpertAffinityScaleMode:
    return ExpertAffinityScaleMode.PRE_SCALE if routing.prescale else ExpertAffinityScaleMode.POST_SCALE


def pads_token_rows(config: BlockwiseMatmulConfig) -> bool:
    """Whether the BWMM inputs get the all-zero row ``T`` (``T_rows = T + 1``): always without token skipping,
    and with it when ``always_augment_inputs_for_blockwise_matmul`` asks."""
    return not config.skip_dma_token or config.always_augment_inputs_for_blockwise_matmul


def blockwise_call(arrays: dict[str, Any], token_position_to_id: np.ndarray, block_to_expert: np.ndarray,
                   conditions: np.ndarray, config: BlockwiseMatmulConfig, *, tokens: int, top_k: int,
                   activation, prescale: bool, accumulate: bool) -> KernelCall:
    """The BWMM kernel ``config`` selects, launched on ``config.logical_nc_config`` cores.

    ``arrays``: ``hidden_states``, ``expert_affinities_masked`` (with the zero row when :func:`pads_token_rows`) and
    the weight arrays of :func:`weight_arrays`. The mapping comes as the front end makes it (``-1`` padding
    slots, ``conditions (N,)``); here padding slots become ``T`` unless token skipping is on, and the blocks are
    padded to an even number for the two cores of shard-on-block.
    """
    lnc = config.logical_nc_config
    block_size = len(token_position_to_id) // len(block_to_expert)
    positions = np.asarray(token_position_to_id, dtype=np.int64)
    block_experts = np.asarray(block_to_expert, dtype=np.int64).reshape(-1)
    flags = np.asarray(conditions, dtype=np.int32).reshape(-1)
    block_parallel = config.use_shard_on_block_dynamic_while or config.use_block_parallel
    if block_parallel and len(block_experts) % lnc:
        # The two cores take equal shares: one more empty block, after the others, of the last block's expert.
        positions = np.concatenate([positions, np.full(block_size, -1)])
        block_experts = np.concatenate([block_experts, block_experts[-1:]])
        flags = np.concatenate([flags, np.zeros(1, dtype=np.int32)])
    if not config.skip_dma_token:
        positions = np.where(positions < 0, tokens, positions)
    args = {
        **arrays,
        "token_position_to_id": positions.astype(np.int32),
        "block_to_expert": block_experts.astype(np.int32).reshape(-1, 1),
        "block_size": block_size,
        "activation": activation,
        "skip_dma": config.skip_dma,
        "expert_affinities_scaling_mode": (ExpertAffinityScaleMode.PRE_SCALE if prescale
                                           else ExpertAffinityScaleMode.POST_SCALE),
        "is_tensor_update_accumulating": accumulate,
    }
    static = config.num_static_blocks
    if static is None:
        static = num_static_blocks(tokens, top_k, block_size)
    if config.use_shard_on_intermediate_dynamic_while:
        args.update(conditions=np.concatenate([flags, np.zeros(1, dtype=np.int32)]), num_static_block=static)
        return KernelCall("bwmm_shard_on_I[dynamic]", bwmm_shard_on_I, lnc, args)
    if block_parallel:
        strategy = BlockShardStrategy(config.block_sharding_strategy)
        args["block_sharding_strategy"] = strategy
        if config.use_shard_on_block_dynamic_while:
            args.update(conditions=shard_conditions(flags, lnc, strategy), num_static_blocks=static)
            return KernelCall(f"bwmm_shard_on_block[{strategy.value},dynamic]", bwmm_shard_on_block, lnc, args)
        return KernelCall(f"bwmm_shard_on_block[{strategy.value}]", bwmm_shard_on_block, lnc, args)
    return KernelCall("bwmm_shard_on_H", bwmm_shard_on_H, lnc, args)


def _decode_args(hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights) -> dict[str, Any]:
    dtype = _compute_dtype(hidden_states)
    args = {
        "hidden_states": to_numpy(hidden_states, dtype),
        "expert_affinities_masked": to_numpy(routing.affinities, dtype).reshape(-1, 1),
        "activation": weights.activation,
        "expert_affinities_scaling_mode": _scaling_mode(routing),
        "expert_mask": to_numpy(routing.expert_mask, dtype).reshape(-1, 1) if routing.prescale else None,
        **weight_arrays(weights, dtype),
    }
    return args


def selective_loading_call(hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights,
                           lnc: int = 1) -> KernelCall:
    args = _decode_args(hidden_states, routing, weights)
    args["expert_index"] = routing.expert_index.to(torch.int32).cpu().numpy()
    return KernelCall("moe_tkg_selective_expert", moe_tkg_selective_expert, lnc, args)


def all_experts_call(hidden_states: torch.Tensor, routing: Routing, weights: ExpertWeights,
                     lnc: int = 1) -> KernelCall:
    return KernelCall("moe_tkg_all_expert", moe_tkg_all_expert, lnc, _decode_args(hidden_states, routing, weights))


class NkiSimBackend(ExpertsBackend):
    """The ``nki_sim`` backend: blockwise, selective-loading and all-experts run as simulated NKI kernels.

    Capacity-factor dropping has no NKI kernel here (the NKI library's dropping kernel is a training kernel), so
    :meth:`capacity_factor` delegates to the torch backend. ``decode_lnc``: cores for the decode kernels (default:
    ``NEURON_LOGICAL_NC_CONFIG``, else 1).
    """

    name = "nki_sim"
    supported_formats = frozenset(QUANTIZATION_CHOICES)

    def __init__(self, decode_lnc: int | None = None):
        self.decode_lnc = default_logical_nc_config() if decode_lnc is None else check_int("decode_lnc", decode_lnc,
                                                                                           1, 2)
        self.last_run: KernelRun | None = None
        self.last_kernel: str | None = None

    def _launch(self, call: KernelCall) -> np.ndarray:
        run = call.run()
        self.last_run, self.last_kernel = run, call.name
        return run.outputs

    def blockwise(self, hidden_states, routing, mapping, weights, config):
        dtype = _compute_dtype(hidden_states)
        tokens, top_k = routing.expert_index.shape
        x = to_numpy(hidden_states, dtype)
        affinities = to_numpy(routing.affinities, dtype)
        if pads_token_rows(config):
            x = np.concatenate([x, np.zeros((1, x.shape[1]), dtype=x.dtype)])
            affinities = np.concatenate([affinities, np.zeros((1, affinities.shape[1]), dtype=affinities.dtype)])
        arrays = {"hidden_states": x, "expert_affinities_masked": affinities.reshape(-1, 1),
                  **weight_arrays(weights, dtype)}
        call = blockwise_call(arrays, mapping.token_position_to_id.cpu().numpy(), mapping.block_to_expert.cpu().numpy(),
                              mapping.conditions.cpu().numpy(), config, tokens=tokens, top_k=top_k,
                              activation=weights.activation, prescale=routing.prescale,
                              accumulate=top_k > 1 or routing.has_padding)
        out = self._launch(call)
        tokens = hidden_states.shape[0]
        out = out[:tokens, 0] if out.ndim == 3 else out[:tokens]
        return to_torch(out, hidden_states.dtype, hidden_states.device)

    def capacity_factor(self, hidden_states, routing, capacity, weights):
        return TorchBackend().capacity_factor(hidden_states, routing, capacity, weights)

    def selective_loading(self, hidden_states, routing, weights):
        out = self._launch(selective_loading_call(hidden_states, routing, weights, self.decode_lnc))
        return to_torch(out, hidden_states.dtype, hidden_states.device)

    def all_experts(self, hidden_states, routing, weights):
        out = self._launch(all_experts_call(hidden_states, routing, weights, self.decode_lnc))
        return to_torch(out, hidden_states.dtype, hidden_states.device)

    def __repr__(self) -> str:
        return f"NkiSimBackend(decode_lnc={self.decode_lnc})"
