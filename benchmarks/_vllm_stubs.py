"""Run vLLM's own ``fused_moe.py`` (its Triton ``fused_moe_kernel`` and tuned configs) without installing vLLM.

vLLM cannot be installed next to the benchmark's torch (its wheel pins another torch and ships compiled ops), but
the bf16 and FP8 W8A8 paths of ``fused_experts_impl`` need only Triton plus a few small compiled ops. This module
registers minimal stand-ins for the ``vllm.*`` modules that file imports, implements the compiled ops it calls (no
host sync, so the whole call can be captured in a CUDA graph), and executes the *unmodified* file taken from an
unpacked vLLM wheel. Nothing of vLLM lives in this repository: ``load(src_dir)`` takes the directory that holds
``vllm/model_executor/layers/fused_moe/fused_moe.py`` and ``configs/`` next to it (see benchmarks/README.md).

Each stand-in op is ONE kernel, as vLLM's compiled op is, so the stand-ins add no launches a vLLM install does not
have: the block alignment (sort the pairs into BLOCK_M-aligned expert segments: one Triton program), SiLU-and-
multiply (one Triton kernel), the FP8 path's dynamic activation quantization (per token, or per token and
128-column group: one Triton kernel), the top-k sum (one torch reduction). The alignment runs in a single program,
which is slower than vLLM's multi-block CUDA op at prefill sizes, so the benchmarks also time vLLM with the
alignment computed once outside the timed region (:class:`ReusedAlignment`): a lower bound on a vLLM install's
time, the number our ratios are quoted against where it is lower (``GLUE_NOTE``).
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import sys
import types

import torch
import triton
import triton.language as tl

FUSED_MOE = "vllm/model_executor/layers/fused_moe"
MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"
GLUE_NOTE = ("vLLM's Triton GEMM kernels and tuned configs, run from the wheel's fused_moe.py; its compiled "
             "moe_align_block_size / silu_and_mul / moe_sum are one stand-in kernel each here (the alignment in one "
             "program, slower than vLLM's at prefill sizes: see the kernels-only row, its lower bound)")
KERNELS_ONLY_NOTE = ("vLLM with its block alignment computed once, outside the timed region, and reused: its GEMM, "
                     "activation, quantization and sum kernels only -- a lower bound on a vLLM install's time "
                     "(results are right for the routing of the first call, which the correctness check uses)")


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, padded_ptr, num_pairs, num_slots, num_blocks, num_experts,
                  BLOCK_SIZE: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    """One program: count each expert's pairs, lay the experts' segments out in ``BLOCK_SIZE`` blocks, write each
    block's expert, fill the slots with the padding id, then put every pair at its slot (pairs of one expert in
    pair order: a one-hot prefix sum per chunk)."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pair = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_end = tl.cumsum(blocks, axis=0)
    seen = (block_end - blocks) * BLOCK_SIZE  # each expert's next free slot
    tl.store(padded_ptr, tl.sum(blocks, axis=0) * BLOCK_SIZE)
    for start in range(0, num_blocks, CHUNK):
        block = start + tl.arange(0, CHUNK)
        owner = tl.sum((block[:, None] >= block_end[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + block, tl.where(owner < num_experts, owner, -1), mask=block < num_blocks)
    for start in range(0, num_slots, CHUNK):
        slot = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slot, num_pairs, mask=slot < num_slots)
    tl.debug_barrier()  # the padding is written before any pair lands
    for start in range(0, num_pairs, CHUNK):
        pair = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        onehot = (expert[:, None] == experts[None, :]).to(tl.int32)
        slot = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + seen[None, :]), axis=1)
        tl.store(sorted_ptr + slot, pair, mask=pair < num_pairs)
        seen += tl.sum(onehot, axis=0)


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_size: int, sorted_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_tokens_post_pad: torch.Tensor) -> None:
    """vLLM's ``moe_align_block_size`` contract, filling the given buffers, in one kernel launch.

    ``topk_ids (T, k)``: the flat pair ids ``t * k + j`` grouped by expert into segments whose lengths are the
    expert's count rounded up to ``block_size``; padding slots hold ``T * k``. ``expert_ids[b]`` is the expert
    of block ``b`` (-1 past the last used block); ``num_tokens_post_pad`` is the padded total.
    """
    ids = topk_ids.reshape(-1).to(torch.int32)
    experts = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](ids, sorted_ids, expert_ids, num_tokens_post_pad, ids.numel(), sorted_ids.numel(),
                        expert_ids.numel(), num_experts, BLOCK_SIZE=block_size, EXPERTS=experts,
                        CHUNK=max(16, min(256, 8192 // experts)), num_warps=8)


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


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_out, BLOCK: tl.constexpr):
    """``out[r] = silu(x[r, :width]) * x[r, width:]`` in fp32, one rounding (vLLM's ``silu_and_mul``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def _silu_and_mul(activation, out: torch.Tensor, gate_up: torch.Tensor) -> None:
    if activation is not _Activation.SILU:
        raise NotImplementedError(f"the benchmark runs vLLM with SiLU only, got {activation}")
    rows, width = out.shape
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0),
                                                                 out.stride(0), BLOCK=block)


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


class ReusedAlignment:
    """Calls into the module with its block alignment computed on the first call and reused after
    (``KERNELS_ONLY_NOTE``): ``ReusedAlignment(module)(module.fused_experts_impl, *args, **kwargs)``."""

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.cache: dict = {}

    def __call__(self, fn, *args, **kwargs):
        real = self.module.moe_align_block_size

        def reused(topk_ids, block_size, num_experts, *more, **options):
            key = (block_size, num_experts)
            if key not in self.cache:
                self.cache[key] = real(topk_ids, block_size, num_experts, *more, **options)
            return self.cache[key]

        self.module.moe_align_block_size = reused
        try:
            return fn(*args, **kwargs)
        finally:
            self.module.moe_align_block_size = real


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
