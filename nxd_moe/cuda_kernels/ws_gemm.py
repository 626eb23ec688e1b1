"""The warp-specialised Hopper prefill GEMMs (``ws_grouped_gemm.cu``) over a
:class:`~nxd_moe.triton_kernels.routing_metadata.TileLayout`, with the contract of
:func:`~nxd_moe.triton_kernels.prefill_gemm.expert_rows`: ``(1, R, H)`` unweighted rows in tile order that the
Triton combine reads through ``pair_row``.

1. gate/up: ``(R, I)`` = SiLU-GLU of ``x[row_token] @ gate_up_proj[e]``; the token rows are gathered inside the
   kernel (``cp.async`` into the swizzled layout the tensor cores read), padding rows are read as zeros and not
   written.
2. down: ``(1, R, H)`` = ``activated @ down_proj[e]``; padding rows not written.

Each is one persistent launch (one CTA per multiprocessor over the device-side tile count: no host sync, one
launch shape for every routing, so CUDA graphs capture it). :func:`applies` says where the kernels run; the
Triton backend uses them only when asked (``TritonBackend(prefill_kernel="cuda_ws")``).
"""

from __future__ import annotations

import torch

from nxd_moe.cuda_kernels import build
from nxd_moe.experts.mlp import ExpertWeights
from nxd_moe.gpu_info import capability, multiprocessors
from nxd_moe.moe_configs import GLUType

# The kernels' row tile (TileLayout.block_m) and the multiple of H and I they handle (one 128-byte K step).
BLOCK_M = 128
K_MULTIPLE = 64


def _plain_silu_glu(activation, inter: int) -> bool:
    """``silu(gate) * up`` over ``[gate | up]`` columns, all ``inter`` of them real: the kernel's only epilogue."""
    actual = activation.intermediate_size_actual
    return (activation.hidden_act == "silu" and activation.glu_mlp and activation.glu_type is GLUType.GLU
            and not activation.gate_up_interleaved and activation.scaling_factor == 1.0
            and activation.act_bias == 0.0
            and all(v is None for v in (activation.gate_lower, activation.gate_upper, activation.up_lower,
                                        activation.up_upper))
            and (actual is None or (isinstance(actual, int) and actual >= inter)))


def applies(hidden_states: torch.Tensor, weights: ExpertWeights, block_m: int, prescale: bool) -> bool:
    """Whether the kernels can run this layer: a CUDA device of compute capability 9.0 exactly (the binary is
    ``sm_90a``: wgmma and setmaxnreg exist nowhere else), 128-row tiles, bf16 activations and unquantized bf16
    weights, no biases, no affinity applied before the activation, plain SiLU-GLU, ``H`` and ``I`` multiples of
    64, contiguous weights ``(E, H, 2I)`` / ``(E, I, H)`` with 16-byte-aligned bases (TMA)."""
    if hidden_states.device.type != "cuda" or capability(hidden_states.device) != (9, 0):
        return False
    gate_up, down = weights.gate_up_proj, weights.down_proj
    if not (block_m == BLOCK_M and not prescale and hidden_states.dtype == torch.bfloat16
            and all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_contiguous()
                    and w.data_ptr() % 16 == 0 for w in (gate_up, down))
            and weights.gate_up_bias is None and weights.down_bias is None
            and weights.activation_quantization is None):
        return False
    hidden, inter = hidden_states.shape[1], down.shape[1]
    return (hidden % K_MULTIPLE == 0 and inter % K_MULTIPLE == 0 and gate_up.shape[2] == 2 * inter
            and _plain_silu_glu(weights.activation, inter))


def _launch(name: str, *tensors: torch.Tensor, sizes: tuple[int, ...], device: torch.device) -> None:
    library = build.load()
    if library is None:
        raise RuntimeError("the CUDA kernels are not built (see the notice above): ask "
                           "nxd_moe.cuda_kernels.available() first")
    index = device.index if device.index is not None else torch.cuda.current_device()
    code = getattr(library, name)(*(t.data_ptr() for t in tensors), *sizes, multiprocessors(index), index,
                                  torch.cuda.current_stream(device).cuda_stream)
    if code != 0:
        raise RuntimeError(f"{name}: {library.nxd_ws_error_string(code).decode()} (code {code})")


def gate_up_rows(hidden_states: torch.Tensor, layout, gate_up_proj: torch.Tensor) -> torch.Tensor:
    """``hidden_states (T, H)`` -> ``(R, I)`` activated rows in tile order (padding rows unwritten)."""
    num_experts, hidden, width = gate_up_proj.shape
    out = torch.empty(layout.num_rows, width // 2, dtype=hidden_states.dtype, device=hidden_states.device)
    _launch("nxd_ws_gate_up", hidden_states.contiguous(), gate_up_proj, out, layout.row_token, layout.tile_expert,
            layout.num_tiles, sizes=(layout.num_rows, hidden, width // 2, num_experts), device=out.device)
    return out


def down_rows(activated: torch.Tensor, layout, down_proj: torch.Tensor) -> torch.Tensor:
    """``activated (R, I)`` in tile order -> ``(1, R, H)`` (padding rows unwritten)."""
    num_experts, inter, hidden = down_proj.shape
    out = torch.empty(1, layout.num_rows, hidden, dtype=activated.dtype, device=activated.device)
    _launch("nxd_ws_down", activated, down_proj, out, layout.row_token, layout.tile_expert, layout.num_tiles,
            sizes=(layout.num_rows, inter, hidden, num_experts), device=out.device)
    return out


def expert_rows(hidden_states: torch.Tensor, layout, weights: ExpertWeights) -> torch.Tensor:
    """gate/up then down over ``layout``: ``(1, R, H)`` rows for the combine (where :func:`applies`)."""
    activated = gate_up_rows(hidden_states, layout, weights.gate_up_proj)
    return down_rows(activated, layout, weights.down_proj)
