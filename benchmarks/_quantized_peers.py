"""GPU peers for quantized expert weights, run from an unpacked vLLM 0.33.0 wheel (``--vllm-src``), same weights.

- ``vllm_fp8_w8a8``: vLLM's Triton ``fused_moe_kernel`` on FP8 weights (``fused_experts_impl(use_fp8_w8a8=True)``)
  with its shipped ``fp8_w8a8`` tuned configs, through ``_vllm_stubs``. vLLM's Triton FP8 MoE path is W8A8: it
  quantizes the activations to FP8 too (per token for per-channel weights, per token and 128 columns for 128x128
  block weights) and multiplies FP8 x FP8 on the tensor cores -- a different, less exact computation than our
  W8A16 (bf16 activations), so its error against the bf16 layer is reported next to its time.
- ``oai_mxfp4``: OpenAI's ``triton_kernels`` (the copy vLLM vendors under ``vllm/third_party``), what vLLM runs for
  GPT-OSS's MXFP4 experts on Hopper: ``routing`` + two ``matmul_ogs`` (gather / scatter fused, SwiGLU fused into
  the first), weights in its Hopper-swizzled MX layouts, bf16 activations (W4A16, as ours).

- ``flashinfer_cutlass``: FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE runner, carried by
  ``flashinfer_carry.sh``) on the ``fp8_block`` weights through its DeepSeek-style block-scale path
  (``use_deepseek_fp8_block_scale``): 128x128 weight blocks, bf16 activations quantized to FP8 per token and 128
  columns inside the call (W8A8, as vLLM's block path). Its SM90 FP8 x FP8 per-tensor path takes one scale per
  expert, a format our quantizer does not store, so it is not run.

All take the bytes our quantizer stored (FP8 values and scales transposed to vLLM's ``(E, N, K)``; MxFP4 codes and
E8M0 scales as they are, made K-contiguous and swizzled), so they multiply the very same weights.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import _vllm_stubs
import torch
from _gpu_peers import flashinfer_output, up_first

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x (T, H), affinities (T, E), index


def _stored(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantized layer's stored ``(gate_up values, gate_up scales, down values, down scales)``."""
    op = layer.mlp_op
    return op.first_proj.weight, op.first_proj.scale, op.down_proj.weight, op.down_proj.scale


def _top_k_weights(affinities: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    chosen = affinities.gather(1, index)
    return chosen / chosen.sum(dim=-1, keepdim=True)


def vllm_fp8_w8a8(layer, fmt: str, peers_src: str, tokens: int, kernels_only: bool = False) -> tuple[Forward, dict]:
    """vLLM's FP8 W8A8 fused MoE on ``layer``'s ``fp8`` (per channel) or ``fp8_block`` (128x128) weights;
    ``kernels_only``: with its block alignment computed on the first call and reused (a lower bound on its time)."""
    module = _vllm_stubs.load(peers_src)
    gate_up, gate_up_scale, down, down_scale = _stored(layer)
    # ours (E, K, N) with scales (E, 1 | K/128, N | N/128) -> vLLM's (E, N, K) with (E, N | N/128, 1 | K/128)
    # (a W8A8 layer stores its FP8 weights K-major already: then these are views of the same bytes)
    w1, w2 = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    w1_scale, w2_scale = gate_up_scale.transpose(1, 2).contiguous(), down_scale.transpose(1, 2).contiguous()
    block_shape = [128, 128] if fmt == "fp8_block" else None
    top_k = layer.routed_experts_mlp_config.top_k

    call = _vllm_stubs.ReusedAlignment(module) if kernels_only else (lambda fn, *args, **kwargs: fn(*args, **kwargs))

    def forward(x: torch.Tensor, affinities: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return call(module.fused_experts_impl, x, w1, w2, _top_k_weights(affinities, index), index.to(torch.int32),
                    use_fp8_w8a8=True, per_channel_quant=block_shape is None, w1_scale=w1_scale, w2_scale=w2_scale,
                    block_shape=block_shape)

    info = {"what": "vLLM 0.33.0 fused_moe Triton kernel, FP8 W8A8 (activations quantized dynamically), "
                    "shipped configs", "note": _vllm_stubs.KERNELS_ONLY_NOTE if kernels_only else _vllm_stubs.GLUE_NOTE,
            "vllm_config": _vllm_stubs.chosen_config(module, w1, w2, top_k, tokens, block_shape)}
    return forward, info


def flashinfer_fp8_block(layer) -> tuple[Forward, dict]:
    """FlashInfer's CUTLASS fused MoE, DeepSeek FP8 block-scale path, on ``layer``'s ``fp8_block`` weights (flashinfer
    must import: see ``_gpu_peers.flashinfer_unavailable``)."""
    import flashinfer
    from flashinfer.fused_moe import cutlass_fused_moe

    gate_up, gate_up_scale, down, down_scale = _stored(layer)
    # ours (E, K, N) with scales (E, K/128, N/128) -> its (E, N, K) with (E, N/128, K/128), fc1 rows [up; gate]
    w1, w1_scale = up_first(gate_up.transpose(1, 2).contiguous(), gate_up_scale.transpose(1, 2).float())
    w2, w2_scale = down.transpose(1, 2).contiguous(), down_scale.transpose(1, 2).float().contiguous()

    def forward(x: torch.Tensor, affinities: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return flashinfer_output(cutlass_fused_moe(x, index.to(torch.int32), _top_k_weights(affinities, index).float(),
                                                   w1, w2, x.dtype, quant_scales=[w1_scale, w2_scale],
                                                   use_deepseek_fp8_block_scale=True))

    return forward, {"what": f"FlashInfer {flashinfer.__version__} cutlass_fused_moe, DeepSeek FP8 block-scale path "
                             "(128x128 weight blocks, activations FP8 per token and 128 columns), default tactic"}


def oai_mxfp4(layer, peers_src: str) -> tuple[Forward, dict]:
    """OpenAI ``triton_kernels``' MXFP4 ``matmul_ogs`` on ``layer``'s ``mxfp4`` weights, as vLLM runs it on Hopper."""
    third_party = os.path.join(os.fspath(peers_src), "vllm", "third_party")
    if not os.path.isdir(os.path.join(third_party, "triton_kernels")):
        raise FileNotFoundError(f"--vllm-src: no vllm/third_party/triton_kernels under {peers_src}")
    if third_party not in sys.path:
        sys.path.insert(0, third_party)
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
    from triton_kernels.matmul_ogs_details import opt_flags
    from triton_kernels.routing import routing
    from triton_kernels.swiglu import swiglu_fn
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    if torch.cuda.get_device_capability() == (9, 0):
        opt_flags.update_opt_flags_constraints({"split_k": 1})  # what vLLM pins on Hopper for these kernels

    def k_contiguous(t: torch.Tensor) -> torch.Tensor:  # (E, K', N) with stride 1 along K', as the layouts expect
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def swizzled(codes: torch.Tensor, scales: torch.Tensor) -> tuple[object, PrecisionConfig]:
        value_layout, value_options = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_options = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        values = convert_layout(wrap_torch_tensor(k_contiguous(codes), dtype=FP4), value_layout, **value_options)
        scale = convert_layout(wrap_torch_tensor(k_contiguous(scales)), scale_layout, **scale_options)
        return values, PrecisionConfig(weight_scale=scale)

    gate_up, gate_up_scale, down, down_scale = _stored(layer)
    inter = down.shape[1] * 2
    # Its fused SwiGLU reads interleaved (gate, linear) columns and computes silu(gate) * (linear + 1) (GPT-OSS's
    # form; alpha = 1, no clamp here): interleave our [gate | up] columns and add -1 to the linear ones, so the
    # fused activation is exactly our silu(gate) * up.
    order = torch.stack([torch.arange(inter), torch.arange(inter, 2 * inter)], dim=1).reshape(-1).to(gate_up.device)
    w1, w1_precision = swizzled(gate_up.index_select(2, order), gate_up_scale.index_select(2, order))
    w2, w2_precision = swizzled(down, down_scale)
    experts = gate_up.shape[0]
    b1 = torch.zeros(experts, 2 * inter, dtype=torch.float32, device=gate_up.device)
    b1[:, 1::2] = -1.0
    top_k = layer.routed_experts_mlp_config.top_k
    activation = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (1.0, None), 2)

    def forward(x: torch.Tensor, affinities: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # its own top-k + softmax over the chosen logits: log-affinities give our normalized top-k weights
        routing_data, gather, scatter = routing(torch.log(affinities), top_k)
        hidden = matmul_ogs(x, w1, b1, routing_data, gather_indx=gather, precision_config=w1_precision,
                            fused_activation=activation)
        return matmul_ogs(hidden, w2, None, routing_data, scatter_indx=scatter, precision_config=w2_precision,
                          gammas=routing_data.gate_scal)

    return forward, {"what": "OpenAI triton_kernels matmul_ogs (vLLM 0.33.0's vendored copy), MXFP4 weights in "
                             "its Hopper layouts, bf16 activations; routing by its own top-k kernel"}
