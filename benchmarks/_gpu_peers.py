"""The contenders of ``gpu_layer.py``: one MoE layer function per implementation, all over the same weights.

Every contender is a full MoE layer -- router, routed experts, top-k combine and (where the case has one) the
shared expert -- as a callable ``x (T, H) -> (T, H)``. The router and the shared expert of the peers are one
piece of torch code (:class:`Problem`), the same for every peer; the routed experts are each peer's own.

Weights (the layout vLLM, Liger, HF and ``grouped_mm`` read as is): ``gate_up (E, 2I, H)`` with rows
``[gate; up]``, ``down (E, H, I)``, router ``(E, H)`` in fp32, shared expert ``shared_gate_up (2I_s, H)``,
``shared_down (H, I_s)``. Ours stores ``(E, H, 2I)`` / ``(E, I, H)`` (NxD's layout) and gets a transposed copy.

Two layer functions exist (``Problem.function``):

- ``"softmax_glu"``: softmax over E, top-k on the logits, renormalised over the k; SiLU GLU experts. Every peer
  computes exactly this (it is what vLLM, Liger and HF's Mixtral/Qwen3 experts implement), so the dims of other
  models (GPT-OSS, DeepSeek-V3) are benchmarked with this function too.
- ``"llama4"``: Llama 4's router (sigmoid of the top-1 logit) with early affinity modulation (the expert input
  is ``w * x``) and a shared expert. With k = 1 this is the same as giving a peer ``w * x`` and weight 1; vLLM
  does the scaling in its first GEMM (``apply_router_weight_on_input``), as it does for Llama 4.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Layer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Contender:
    """One implementation ready to run: ``layer(x)`` on any of the case's inputs."""

    name: str
    kind: str  # "peer" | "ours"
    what: str
    layer: Layer
    graphable: bool = True
    note: str | None = None
    info: dict = dataclasses.field(default_factory=dict)
    parts: dict[str, Layer] = dataclasses.field(default_factory=dict)  # pieces of the layer, timed on their own


@dataclass
class Problem:
    """A case's weights and function (see the module docstring)."""

    function: str
    top_k: int
    gate_up: torch.Tensor
    down: torch.Tensor
    router: torch.Tensor
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def early_modulation(self) -> bool:
        return self.function == "llama4"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights fp32 (T, k), expert ids int64 (T, k))``, computed in fp32 like nxd_moe's routers."""
        logits = F.linear(x.float(), self.router)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        if self.function == "llama4":
            return torch.sigmoid(top), ids
        weights = torch.softmax(logits, dim=-1).gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def expert_input(self, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input to the experts, combine weights)``: early modulation moves the weight onto the input."""
        if not self.early_modulation:
            return x, weights
        return (x.float() * weights).to(x.dtype), torch.ones_like(weights)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_gate_up is None:
            return None
        gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.shared_down)

    def with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        return routed if shared is None else routed + shared


# ---------------------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------------------

@torch.no_grad()
def reference(problem: Problem, x: torch.Tensor) -> torch.Tensor:
    """The case's function in float64 on ``x``'s device, one expert at a time (only that expert's weights are
    ever held in float64), with the routing of :meth:`Problem.route`."""
    weights, ids = problem.route(x)
    x64 = x.double()
    out = torch.zeros_like(x64)
    for expert in torch.unique(ids).tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        w = weights[token, slot].double().unsqueeze(1)
        rows = x64[token] * w if problem.early_modulation else x64[token]
        gate, up = (rows @ problem.gate_up[expert].double().t()).chunk(2, dim=-1)
        y = (gate * torch.sigmoid(gate) * up) @ problem.down[expert].double().t()
        out.index_add_(0, token, y if problem.early_modulation else y * w)
    if problem.shared_gate_up is not None:
        gate, up = (x64 @ problem.shared_gate_up.double().t()).chunk(2, dim=-1)
        out += (gate * torch.sigmoid(gate) * up) @ problem.shared_down.double().t()
    return out


# ---------------------------------------------------------------------------------------------------------
# torch grouped_mm, torchtitan style
# ---------------------------------------------------------------------------------------------------------

def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    op = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return op(a, b, offs=offs)


def grouped_mm_contender(problem: Problem) -> Contender:
    """Sort the (token, expert) pairs by expert, two ``grouped_mm`` calls over the whole weight tensors, unsort
    and sum the k rows per token (torchtitan's ``GroupedExperts`` recipe; no host sync, so graph-capturable)."""
    num_experts, k = problem.num_experts, problem.top_k
    gate_up_t, down_t = problem.gate_up.transpose(-2, -1), problem.down.transpose(-2, -1)

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = problem.route(x)
        x_in, weights = problem.expert_input(x, weights)
        pairs = ids.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, pairs, torch.ones_like(pairs))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = _grouped_mm(x_in.index_select(0, order // k), gate_up_t, offs).chunk(2, dim=-1)
        rows = _grouped_mm(F.silu(gate) * up, down_t, offs)
        by_pair = torch.empty_like(rows).index_copy_(0, order, rows).view(x.shape[0], k, -1)
        routed = (by_pair.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        return problem.with_shared(x, routed)

    sorted_rows = {}  # per input, made on its first (untimed, warm-up) call

    def gemms_only(x: torch.Tensor) -> torch.Tensor:
        """GEMM13, SiLU-and-mul, GEMM2 on rows already sorted by expert: what a GroupedGEMM table times."""
        if x.data_ptr() not in sorted_rows:
            ids = problem.route(x)[1].reshape(-1)
            counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(
                0, ids, torch.ones_like(ids))
            rows = x.index_select(0, torch.argsort(ids, stable=True) // k)
            sorted_rows[x.data_ptr()] = rows, torch.cumsum(counts, 0).to(torch.int32)
        rows, offs = sorted_rows[x.data_ptr()]
        gate, up = _grouped_mm(rows, gate_up_t, offs).chunk(2, dim=-1)
        return _grouped_mm(F.silu(gate) * up, down_t, offs)

    return Contender("torch_grouped_mm", "peer", "torch grouped_mm, torchtitan-style layer written here", layer,
                     parts={"grouped_gemms_only": gemms_only})


# ---------------------------------------------------------------------------------------------------------
# HuggingFace transformers' experts implementations
# ---------------------------------------------------------------------------------------------------------

HF_IMPLS = ("grouped_mm", "batched_mm", "eager")


def hf_contenders(problem: Problem, tokens: int, decode: bool, batched_mm_limit_bytes: int) -> list[Contender]:
    """transformers' ``MixtralExperts`` (the same experts class Qwen3-MoE uses), sharing our weight tensors, once
    per ``config._experts_implementation``. ``eager`` loops over hit experts with a host sync (not capturable);
    ``batched_mm`` gathers one weight matrix per (token, expert) pair, so it only runs where that fits."""
    import transformers
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts, two_i, hidden = problem.gate_up.shape
    config = MixtralConfig(hidden_size=hidden, intermediate_size=two_i // 2, num_local_experts=experts,
                           num_experts_per_tok=problem.top_k, hidden_act="silu")
    with torch.device("meta"):
        module = MixtralExperts(config)
    module.gate_up_proj = nn.Parameter(problem.gate_up, requires_grad=False)
    module.down_proj = nn.Parameter(problem.down, requires_grad=False)
    expert_bytes = (problem.gate_up[0].numel() + problem.down[0].numel()) * problem.gate_up.element_size()
    gathered = tokens * problem.top_k * expert_bytes

    def make(impl: str) -> Layer:
        def layer(x: torch.Tensor) -> torch.Tensor:
            module.config._experts_implementation = impl
            weights, ids = problem.route(x)
            x_in, weights = problem.expert_input(x, weights)
            return problem.with_shared(x, module(x_in, ids, weights.to(x.dtype)))
        return layer

    out = []
    for impl in HF_IMPLS:
        contender = Contender(f"hf_{impl}", "peer", f"transformers {transformers.__version__} MixtralExperts, "
                              f"experts_implementation={impl!r}", make(impl), graphable=impl != "eager")
        if impl == "eager":
            contender.note = "host sync (nonzero) per call: eager timing only"
        if impl == "batched_mm" and (not decode or gathered > batched_mm_limit_bytes):
            contender.note = (f"skipped: gathers {gathered / 2**30:.1f} GiB of expert weights per call"
                              if decode else "skipped: decode-only (HF uses it only in generate's decode)")
            contender.layer = None
        out.append(contender)
    return out


# ---------------------------------------------------------------------------------------------------------
# Liger-Kernel and vLLM (from unpacked wheels, never committed)
# ---------------------------------------------------------------------------------------------------------

def liger_contender(problem: Problem, liger_src: str | None, autotune: bool) -> Contender:
    """Liger-Kernel's ``LigerFusedMoEFunction`` (one ``.item()`` per call: eager timing only)."""
    if not autotune:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    if liger_src and liger_src not in sys.path:
        sys.path.insert(0, liger_src)
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = problem.route(x)
        x_in, weights = problem.expert_input(x, weights)
        routed = LigerFusedMoEFunction.apply(x_in, problem.gate_up, problem.down, ids.to(torch.int32),
                                             weights.to(x.dtype))
        return problem.with_shared(x, routed)

    tuned = os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() not in ("0", "false", "no")
    return Contender("liger", "peer", f"Liger-Kernel {_version_of('liger_kernel')} fused MoE "
                     f"({'autotuned' if tuned else 'LIGER_FUSED_MOE_AUTOTUNE=0: its one pinned config'})", layer,
                     graphable=False, note="host sync (.item()) per call: eager timing only")


def vllm_contender(problem: Problem, vllm_src: str, tokens: int) -> Contender:
    """vLLM's ``fused_experts_impl`` (Triton ``fused_moe_kernel``, shipped tuned configs) via ``_vllm_stubs``."""
    import _vllm_stubs

    module = _vllm_stubs.load(vllm_src)

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = problem.route(x)
        routed = module.fused_experts_impl(x, problem.gate_up, problem.down, weights, ids.to(torch.int32),
                                           apply_router_weight_on_input=problem.early_modulation)
        return problem.with_shared(x, routed)

    info = _vllm_stubs.chosen_config(module, problem.gate_up, problem.down, problem.top_k, tokens)
    block_m = info["config"]["BLOCK_SIZE_M"]

    def router_and_align(x: torch.Tensor):
        ids = problem.route(x)[1].to(torch.int32)
        return _vllm_stubs._moe_align_block_size(ids, block_m, problem.num_experts)

    # What the stand-in alignment costs (one program, slower than vLLM's multi-block op at prefill sizes).
    # (At small batches vLLM skips the align altogether: then the difference of these two is not in its time.)
    parts = {"router": lambda x: problem.route(x), "router+align_standin": router_and_align}
    return Contender("vllm_triton", "peer", "vLLM 0.33.0 fused_moe Triton kernel with its shipped configs", layer,
                     note=_vllm_stubs.GLUE_NOTE, info={"vllm_config": info}, parts=parts)


def vllm_kernels_only_contender(problem: Problem, vllm_src: str, tokens: int) -> Contender:
    """:func:`vllm_contender` with the block alignment of the first call reused (``_vllm_stubs.ReusedAlignment``):
    the time of vLLM's kernels without its alignment op, a lower bound on a vLLM install's time."""
    import _vllm_stubs

    module = _vllm_stubs.load(vllm_src)
    reuse = _vllm_stubs.ReusedAlignment(module)

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = problem.route(x)
        routed = reuse(module.fused_experts_impl, x, problem.gate_up, problem.down, weights, ids.to(torch.int32),
                       apply_router_weight_on_input=problem.early_modulation)
        return problem.with_shared(x, routed)

    info = _vllm_stubs.chosen_config(module, problem.gate_up, problem.down, problem.top_k, tokens)
    return Contender("vllm_triton_kernels_only", "peer", "vLLM 0.33.0 fused_moe, alignment outside the timed region",
                     layer, note=_vllm_stubs.KERNELS_ONLY_NOTE, info={"vllm_config": info})


# ---------------------------------------------------------------------------------------------------------
# FlashInfer's CUTLASS fused MoE (TensorRT-LLM's kernels; carried by flashinfer_carry.sh, never committed)
# ---------------------------------------------------------------------------------------------------------

def up_first(gate_up: torch.Tensor, scale: torch.Tensor | None = None):
    """FlashInfer's ``fc1`` from gate/up weights laid out ``(E, 2I, H)`` with rows ``[gate; up]``: the same rows as
    ``[up; gate]`` (TensorRT-LLM's ``w3_w1``: its SwiGLU takes the linear half from the first I rows and the gated
    half from the next I). With ``scale`` (block scales ``(E, 2I / 128, H / 128)`` of FP8 ``gate_up``): the pair
    ``(values, scales)``, each reordered the same way, which needs whole scale blocks per half (I a multiple of
    128). Returns new contiguous tensors."""
    rows = gate_up.shape[1]
    if gate_up.dim() != 3 or rows % 2:
        raise ValueError(f"gate_up must be (E, 2I, H) with an even row count, got {tuple(gate_up.shape)}")

    def swapped(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[1] // 2
        return torch.cat([t[:, half:], t[:, :half]], dim=1).contiguous()

    if scale is None:
        return swapped(gate_up)
    blocks = scale.shape[1] if scale.dim() == 3 else 0
    if not blocks or rows % blocks or blocks % 2:
        raise ValueError(f"scale must be (E, 2I / block, H / block) with I a multiple of the block, got scale "
                         f"{tuple(scale.shape)} for gate_up {tuple(gate_up.shape)}")
    return swapped(gate_up), swapped(scale)


def flashinfer_unavailable(site: str | None) -> str | None:
    """None if FlashInfer's fused MoE imports (``site`` first on ``sys.path`` when it is a folder), else why not."""
    if site and os.path.isdir(site) and site not in sys.path:
        sys.path.insert(0, site)
    # The prebuilt module needs libnvrtc.so.13, which torch's wheel holds off the loader's path: loading the link
    # flashinfer_carry.sh made to it satisfies that dependency by its soname.
    nvrtc = os.path.join(os.path.dirname(os.path.abspath(site)), "cuda-extra", "lib", "libnvrtc.so") if site else ""
    try:
        if os.path.exists(nvrtc):
            ctypes.CDLL(nvrtc, mode=ctypes.RTLD_GLOBAL)
        importlib.import_module("flashinfer.fused_moe")
    except Exception as error:  # ImportError, or a shared library that does not load (OSError)
        first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return (f"flashinfer does not import ({type(error).__name__}: {first_line}); carry it with "
                f"benchmarks/flashinfer_carry.sh (site folder looked at: {site!r})")
    return None


def flashinfer_output(result) -> torch.Tensor:
    """``cutlass_fused_moe``'s output tensor (some versions return ``[output, ...]``)."""
    return result[0] if isinstance(result, (list, tuple)) else result


def flashinfer_contender(problem: Problem, autotune: bool) -> Contender:
    """FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE runner: expanding permutation, grouped GEMM1
    with SwiGLU, grouped GEMM2 with the top-k combine fused into its epilogue) on a ``[up; gate]`` copy of
    ``gate_up`` and ``down`` as is, our routing passed as ``(ids int32, weights fp32)``. ``autotune``: FlashInfer's
    autotuner profiles its tactics on the first call (untimed); else its default tactic."""
    import flashinfer
    from flashinfer.fused_moe import cutlass_fused_moe

    fc1 = up_first(problem.gate_up)
    tuned = set()

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = problem.route(x)
        x_in, weights = problem.expert_input(x, weights)

        def call():
            return flashinfer_output(cutlass_fused_moe(x_in.contiguous(), ids.to(torch.int32), weights.float(), fc1,
                                                       problem.down, x.dtype, quant_scales=[]))

        if autotune and x.shape not in tuned:
            tuned.add(x.shape)
            with flashinfer.autotune(True):
                call()
        return problem.with_shared(x, call())

    return Contender("flashinfer_cutlass", "peer", f"FlashInfer {flashinfer.__version__} cutlass_fused_moe "
                     f"(TensorRT-LLM CUTLASS MoE, {'autotuned' if autotune else 'default tactic'})", layer,
                     note="fc1 is a [up; gate] copy of gate_up (TensorRT-LLM's w3_w1 order)")


def _version_of(package: str) -> str:
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:
        module = sys.modules.get(package)
        path = getattr(module, "__file__", "") or ""
        return f"(from {os.path.dirname(os.path.dirname(path))})" if path else "(unknown version)"


# ---------------------------------------------------------------------------------------------------------
# nxd_moe
# ---------------------------------------------------------------------------------------------------------

def _materialize(layer: nn.Module, device, source: nn.Module | None = None) -> None:
    """Replace ``layer``'s meta tensors: by ``source``'s same-named parameters (shared, not copied) where
    ``source`` is given, else by uninitialised ones on ``device``."""
    for path, module in layer.named_modules():
        twin = source.get_submodule(path) if source is not None else None
        for table in ("_parameters", "_buffers"):
            tensors = getattr(module, table)
            for name, tensor in list(tensors.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if twin is not None:
                    tensors[name] = getattr(twin, table)[name]
                elif table == "_parameters":
                    tensors[name] = nn.Parameter(torch.empty_like(tensor, device=device), requires_grad=False)
                else:
                    tensors[name] = torch.empty_like(tensor, device=device)


def _dense_weight(projection) -> torch.Tensor:
    """A ``DenseProjection``'s weight as ``(out, in)`` (a view)."""
    return projection.weight.t() if projection.transposed else projection.weight


@torch.no_grad()
def _load(moe, problem: Problem) -> None:
    moe.router.linear_router.weight.copy_(problem.router)
    op = moe.expert_mlps.mlp_op
    op.gate_up_proj.weight.copy_(problem.gate_up.transpose(1, 2))
    op.down_proj.weight.copy_(problem.down.transpose(1, 2))
    shared = moe.shared_experts
    if shared is not None:
        if shared.fused_gate_up_projection:
            _dense_weight(shared.gate_up_proj).copy_(problem.shared_gate_up)
        else:
            gate, up = problem.shared_gate_up.chunk(2, dim=0)
            _dense_weight(shared.gate_proj).copy_(gate)
            _dense_weight(shared.up_proj).copy_(up)
        _dense_weight(shared.down_proj).copy_(problem.shared_down)


def build_ours(problem: Problem, backend: str, block_size: int | None, dtype: torch.dtype, device,
               share_with=None):
    """nxd_moe's ``MoE`` for the problem on ``backend``: built on the meta device, then given the problem's
    weights, or ``share_with``'s tensors (another backend's layer: one copy of the weights for both)."""
    from nxd_moe import (
        BlockwiseMatmulConfig,
        ExpertMLPsV2,
        MoE,
        RoutedExpertsMLPOpsConfig,
        RouterTopK,
        build_moe,
        load_model_config,
    )

    experts, two_i, hidden = problem.gate_up.shape
    if problem.function == "llama4":
        model = dataclasses.replace(load_model_config("llama4-scout"), num_experts=experts, top_k=problem.top_k,
                                    hidden_size=hidden, intermediate_size=two_i // 2)
        if problem.shared_gate_up is not None:
            shared_width = problem.shared_gate_up.shape[0] // 2
            model = dataclasses.replace(model, shared_experts=dataclasses.replace(
                model.shared_experts, intermediate_size=shared_width))
        else:
            model = dataclasses.replace(model, shared_experts=None)
        overrides = {} if block_size is None else {"block_size": block_size}
        moe = build_moe(model, dtype=dtype, device="meta", backend=backend, **overrides)
    else:
        cfg = RoutedExpertsMLPOpsConfig(num_experts=experts, top_k=problem.top_k, hidden_size=hidden,
                                        intermediate_size=two_i // 2, hidden_act="silu", glu_mlp=True,
                                        normalize_top_k_affinities=True)
        blockwise = (BlockwiseMatmulConfig() if block_size is None
                     else BlockwiseMatmulConfig.from_kwargs(block_size=block_size))
        router = RouterTopK(num_experts=experts, top_k=problem.top_k, hidden_size=hidden, act_fn="softmax",
                            device="meta")
        moe = MoE(router, ExpertMLPsV2(cfg, blockwise, dtype=dtype, device="meta", backend=backend)).eval()
    _materialize(moe, device, share_with)
    if share_with is None:
        _load(moe, problem)
    return moe


def ours_contender(moe, name: str, decode: bool, mode: str | None = None) -> Contender:
    """``moe`` as a layer over ``(T, H)`` tokens: decode as ``(T, 1, H)``, prefill as one ``(1, T, H)``
    sequence. ``mode`` forces the experts' algorithm (router and shared expert still run)."""

    def shaped(x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 1, -1) if decode else x.view(1, x.shape[0], -1)

    if mode is None:
        def layer(x: torch.Tensor) -> torch.Tensor:
            return moe(shaped(x))[0].view(x.shape)
    else:
        def layer(x: torch.Tensor) -> torch.Tensor:
            _, affinities, index = moe.router(x)
            out = moe.expert_mlps(x, affinities, index, seq_len=1 if decode else x.shape[0], mode=mode)
            if moe.shared_experts is not None:
                out = out + moe.shared_experts(x, 1 if decode else x.shape[0])
            return out

    backend = type(moe.expert_mlps.backend).__name__
    block = moe.expert_mlps.blockwise_matmul_config.block_size
    what = f"nxd_moe MoE, {backend}" + (f", mode {mode} forced" if mode else ", mode chosen by the layer") + (
        "" if decode else f", block_size {block}")
    contender = Contender(name, "ours", what, layer)

    def chosen_mode(x: torch.Tensor) -> dict:
        with torch.no_grad():
            stats = moe(shaped(x), return_stats=True)[-1]
        return {"mode": stats.mode.value, "block_size": block}

    contender.info["describe"] = chosen_mode if mode is None else (lambda x: {"mode": mode, "block_size": block})
    return contender


def backend_available(name: str) -> str | None:
    """None if nxd_moe's backend ``name`` is registered and importable, else why not."""
    from nxd_moe.experts.backends import BACKENDS

    if name not in BACKENDS:
        return f"backend {name!r} is not registered in nxd_moe.experts.backends.BACKENDS"
    module_name = BACKENDS[name].split(":")[0]
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        return f"backend {name!r} does not import: {error}"
    return None
