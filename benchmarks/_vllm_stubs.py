"""Run vLLM's own ``fused_moe.py`` (its Triton ``fused_moe_kernel`` and tuned configs) without installing vLLM.

vLLM cannot be installed next to the benchmark's torch (its wheel pins another torch and ships compiled ops), but
the bf16 and FP8 W8A8 paths of ``fused_experts_impl`` need only Triton plus a few small compiled ops. This module
registers minimal stand-ins for the ``vllm.*`` modules that file imports, implements the three ops in device-side torch
(no host sync, so the whole call can be captured in a CUDA graph), and executes the *unmodified* file taken from
an unpacked vLLM wheel. Nothing of vLLM lives in this repository: ``load(src_dir)`` takes the directory that
holds ``vllm/model_executor/layers/fused_moe/fused_moe.py`` and ``configs/`` next to it (see benchmarks/README.md).

The stand-in ops (sort into BLOCK_M-aligned expert segments, sum over top-k, SiLU-and-multiply) are a few torch
kernels each where vLLM has one CUDA kernel: the GEMM kernels are vLLM's, the glue around them is slower than in
a real vLLM install. Reports say so (``GLUE_NOTE``). The FP8 path's dynamic activation quantization (per token,
or per token and 128-column group) is one Triton kernel written here, as vLLM's is one kernel.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import sys
import types

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FUSED_MOE = "vllm/model_executor/layers/fused_moe"
MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"
GLUE_NOTE = ("vLLM's Triton GEMM kernels and tuned configs, run from the wheel's fused_moe.py; its compiled "
             "moe_align_block_size / silu_and_mul / moe_sum are replaced by device-side torch here (a few more, "
             "smaller kernels per call than in a vLLM install)")


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_size: int, sorted_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_tokens_post_pad: torch.Tensor) -> None:
    """vLLM's ``moe_align_block_size`` contract, filling the given buffers.

    ``topk_ids (T, k)``: the flat pair ids ``t * k + j`` grouped by expert into segments whose lengths are the
    expert's count rounded up to ``block_size``; padding slots hold ``T * k``. ``expert_ids[b]`` is the expert
    of block ``b`` (-1 past the last used block); ``num_tokens_post_pad`` is the padded total.
    """
    pairs = topk_ids.reshape(-1).long()
    num_pairs = pairs.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=pairs.device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs))
    blocks = (counts + block_size - 1) // block_size
    block_end = torch.cumsum(blocks, 0)
    segment_start = (block_end - blocks) * block_size
    first_of_expert = torch.cumsum(counts, 0) - counts
    by_expert = torch.sort(pairs, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=pairs.device) - first_of_expert[by_expert.values]
    sorted_ids.fill_(num_pairs)
    sorted_ids.index_copy_(0, segment_start[by_expert.values] + rank_in_expert, by_expert.indices.to(sorted_ids.dtype))
    num_tokens_post_pad.copy_((block_end[-1:] * block_size).to(num_tokens_post_pad.dtype))
    block = torch.arange(expert_ids.numel(), device=pairs.device)
    owner = torch.bucketize(block, block_end, right=True)
    expert_ids.copy_(torch.where(owner < num_experts, owner, -1).to(expert_ids.dtype))


def _moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
                          ignore_invalid_experts=False):
    if expert_map is not None:
        raise NotImplementedError("the benchmark's stand-in for moe_align_block_size has no expert_map")
    slots = topk_ids.numel() + num_experts * (block_size - 1)
    if topk_ids.numel() < num_experts:
        slots = min(slots, topk_ids.numel() * block_size)
    device = topk_ids.device
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=device)
    expert_ids = torch.empty((slots + block_size - 1) // block_size, dtype=torch.int32, device=device)
    num_tokens_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    align_to_blocks(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad)
    return sorted_ids, expert_ids, num_tokens_post_pad


class _Activation(enum.Enum):
    SILU = "silu"

    @classmethod
    def from_str(cls, name: str) -> "_Activation":
        return cls(name)


def _silu_and_mul(activation, out: torch.Tensor, gate_up: torch.Tensor) -> None:
    if activation is not _Activation.SILU:
        raise NotImplementedError(f"the benchmark runs vLLM with SiLU only, got {activation}")
    gate, up = gate_up.chunk(2, dim=-1)
    torch.mul(F.silu(gate), up, out=out)


FP8_MAX = 448.0  # float8_e4m3fn


@triton.jit
def _quantize_groups_fp8(a_ptr, q_ptr, scale_ptr, row_length, group_length, groups_per_row,
                         BLOCK: tl.constexpr):
    """One program per (row, group): ``scale = max|a| / 448`` (fp32), ``q = a / scale`` in float8_e4m3fn."""
    group = tl.program_id(0)
    row = group // groups_per_row
    offsets = tl.arange(0, BLOCK)
    mask = offsets < group_length
    start = row.to(tl.int64) * row_length + (group % groups_per_row) * group_length
    a = tl.load(a_ptr + start + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(a)), 1e-12) / 448.0
    q = tl.clamp(a / scale, -448.0, 448.0)
    tl.store(q_ptr + start + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + group, scale)


def quantize_activations_fp8(a: torch.Tensor, group_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a (M, K)`` -> float8_e4m3fn ``(M, K)`` and fp32 scales ``(M, K / group_length)``, dynamic, per group."""
    a = a.contiguous()
    rows, row_length = a.shape
    if row_length % group_length:
        raise ValueError(f"group_length={group_length} must divide the row length {row_length}")
    q = torch.empty(a.shape, dtype=torch.float8_e4m3fn, device=a.device)
    groups_per_row = row_length // group_length
    scale = torch.empty(rows, groups_per_row, dtype=torch.float32, device=a.device)
    if rows:
        _quantize_groups_fp8[(rows * groups_per_row,)](a, q, scale, row_length, group_length, groups_per_row,
                                                      BLOCK=triton.next_power_of_2(group_length))
    return q, scale


def _moe_kernel_quantize_input(A, A_scale, quant_dtype, per_act_token_quant, block_shape=None, **options):
    """vLLM's contract for dynamic activation quantization, FP8 only: per 128-column group when the weights are
    block-scaled, per token when they are per channel (``per_act_token_quant``)."""
    if quant_dtype is None:
        return A, A_scale
    if quant_dtype != torch.float8_e4m3fn or A_scale is not None:
        raise NotImplementedError(f"the benchmark's stand-in quantizes activations to dynamic FP8 only, "
                                  f"got quant_dtype={quant_dtype}, static scale={A_scale is not None}")
    if block_shape is not None:
        return quantize_activations_fp8(A, block_shape[1])
    if not per_act_token_quant:
        raise NotImplementedError("the benchmark's stand-in has no per-tensor activation scale")
    return quantize_activations_fp8(A, A.shape[-1])


def _config_dtype_str(dtype, use_fp8_w8a8=False, **flags):
    if use_fp8_w8a8:
        return "fp8_w8a8"
    return None if dtype in (torch.bfloat16, torch.float16) else "float32"


def _enable_swap_ab(block_m: int, block_n: int) -> bool:
    """vLLM 0.33's rule for its FP8 kernel: on Hopper, small M tiles run with the operands swapped."""
    return torch.cuda.get_device_capability() == (9, 0) and block_m < 64 and block_n >= 64


class _Logger(logging.LoggerAdapter):
    """vLLM's logger has ``*_once`` variants; the benchmark records the config choice itself."""

    def info_once(self, *args, **kwargs):
        pass

    def warning_once(self, *args, **kwargs):
        pass

    def debug_once(self, *args, **kwargs):
        pass


class _Platform:
    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn


class _Unquantized:
    use_fp8_w8a8 = use_int8_w8a8 = use_int8_w8a16 = use_int4_w4a16 = False


class _ModularKernel:
    class FusedMoEExpertsModular:
        @staticmethod
        def adjust_N_for_activation(n: int, activation) -> int:
            return n // 2  # gated activations halve the width


def device_name_as_file_name() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return name.replace(" ", "_")


def _stub(name: str, **attrs) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    module.__dict__.update(attrs)
    return module


def _install_stubs() -> None:
    for package in ("vllm", "vllm.utils", "vllm.model_executor", "vllm.model_executor.layers"):
        _stub(package)
    _stub("vllm.model_executor.layers.fused_moe", get_config=lambda: None)
    _stub("vllm.envs", VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None, VLLM_TRITON_USE_TD=None)
    _stub("vllm._custom_ops", moe_sum=lambda x, out: torch.sum(x, dim=1, out=out))
    _stub("vllm.logger", init_logger=lambda name: _Logger(logging.getLogger(name), {}))
    _stub("vllm.platforms", current_platform=_Platform())
    _stub("vllm.triton_utils", tl=tl, triton=triton)
    _stub("vllm.triton_utils.allocation", set_triton_allocator=lambda device: None)
    _stub("vllm.utils.math_utils", next_power_of_2=triton.next_power_of_2)
    _stub("vllm.utils.platform_utils", get_device_name_as_file_name=device_name_as_file_name)
    _stub("vllm.utils.torch_utils", direct_register_custom_op=lambda **kwargs: None)
    _stub("vllm.model_executor.layers.fused_moe.activation", MoEActivation=_Activation,
          apply_moe_activation=_silu_and_mul)
    _stub("vllm.model_executor.layers.fused_moe.config", FUSED_MOE_UNQUANTIZED_CONFIG=_Unquantized(),
          FusedMoEQuantConfig=_Unquantized,
          _get_config_dtype_str=_config_dtype_str)
    _stub("vllm.model_executor.layers.fused_moe.modular_kernel",
          FusedMoEExpertsModular=_ModularKernel.FusedMoEExpertsModular)
    _stub("vllm.model_executor.layers.fused_moe.moe_align_block_size", moe_align_block_size=_moe_align_block_size)
    _stub("vllm.model_executor.layers.fused_moe.utils", enable_swap_ab=_enable_swap_ab,
          moe_kernel_quantize_input=_moe_kernel_quantize_input,
          resolve_moe_use_td=lambda: False, warn_if_moe_use_td_ineffective=lambda *args, **kwargs: None)


def load(src_dir: str | os.PathLike) -> types.ModuleType:
    """vLLM's ``fused_moe`` module, executed from ``src_dir`` (an unpacked wheel's root).

    Use ``module.fused_experts_impl(x (T, H), w1 (E, 2I, H), w2 (E, H, I), topk_weights fp32 (T, k),
    topk_ids int32 (T, k), apply_router_weight_on_input=False)``.
    """
    path = os.path.join(os.fspath(src_dir), FUSED_MOE, "fused_moe.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--vllm-src: no {FUSED_MOE}/fused_moe.py under {src_dir}")
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    _install_stubs()
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return module


def chosen_config(module: types.ModuleType, w1: torch.Tensor, w2: torch.Tensor, top_k: int, tokens: int,
                  block_shape: list[int] | None = None) -> dict:
    """Which launch config vLLM uses for this call and where it came from (a shipped tuned file or its default).
    FP8 weights (``w1.dtype``) select vLLM's ``fp8_w8a8`` tables, ``block_shape`` its block-scaled ones."""
    experts, _, width = w2.shape
    dtype = _config_dtype_str(w1.dtype, use_fp8_w8a8=w1.dtype == torch.float8_e4m3fn)
    file_name = module.get_config_file_name(experts, width, dtype, block_shape)
    tuned = os.path.isfile(os.path.join(os.path.dirname(module.__file__), "configs", file_name))
    config = module.try_get_optimal_moe_config(tuple(w1.shape), tuple(w2.shape), top_k, dtype, tokens,
                                               block_shape=block_shape)
    # vLLM 0.33's rule (no expert map, bf16): few pairs per expert -> one block per pair, no align op at all
    naive = tokens * top_k * 4 <= experts
    return {"file": file_name, "tuned_file_found": tuned, "config": dict(config), "align_skipped": naive}
