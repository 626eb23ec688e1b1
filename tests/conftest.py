"""Shared helpers for the nxd_moe test suite.

Core-suite helpers (configs, deterministic weights, routings, reference comparisons, a host-sync guard) live
in the section below. Everything here is deterministic: weights and routings come from explicit seeds, and
hypothesis runs derandomized without a database so CI is reproducible.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from nxd_moe import (
    BlockwiseMatmulConfig,
    ExpertMLPsV2,
    GroupLimitedRouter,
    RoutedExpertsMLPOpsConfig,
    RouterSinkhorn,
    RouterTopK,
    SharedExperts,
    TorchBackend,
)
from nxd_moe.experts.expert_mlps import ExpertLinear
from nxd_moe.experts.shared import DenseProjection
from nxd_moe.routing.base import RouterBase

# ----------------------------------------------------------------------------------------------------------
# core suite: hypothesis profile

settings.register_profile(
    "nxd_moe_ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=30,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nxd_moe_ci"))

# Without a GPU the triton backend's kernels run in Triton's interpreter (on CPU tensors). Triton reads this when
# a kernel is defined, so it is set before any test imports nxd_moe.triton_kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker would start one intra-op thread per core: N workers x N threads on N cores, and
# every small op then waits on oversubscribed thread pools: measured on a CPU, six processes on two cores took 60 s
# each for a 2051-token float64 reference with two threads, 4 s with one (on the 16-core GPU host the
# prefill-sized tests, whose reference then looped per token, never finished in 9 minutes). Each worker takes its
# share of the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Tests behind the `slow` marker by their measured time (tests/slow_tests.txt says how they were chosen): the
# default suite stays near 8 minutes on CI's 2 cores, and CI runs these in its `pytest -m slow`.
SLOW_TESTS_FILE = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def slow_tests() -> set[str]:
    """The node ids and test files listed in tests/slow_tests.txt."""
    with open(SLOW_TESTS_FILE) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    listed = slow_tests()
    for item in items:
        if item.nodeid in listed or item.nodeid.split("::")[0] in listed:
            item.add_marker(pytest.mark.slow)


# Absolute tolerances of the core suite's fp32 / float64 layers, whose weights (randomize_ below) make outputs
# O(0.1-1) -- tests that compare against a reference refuse a near-zero one. fp32: u = 2**-24 = 6e-8; a layer
# of depth n <= 256 (H, I, k) rounds a few times and accumulates errors of ~sqrt(n) u each (Higham & Mary's
# probabilistic bound), ~1e-6 at scale 1: 1e-5 leaves a factor 10 and still rejects any relative error above 1e-5
# at scale 1 (a 4 % one by 4000x). float64 (u = 1.1e-16): 1e-10 is the same rule with a wide margin. 16-bit
# layers are compared relative to the reference's scale: rounding_tolerance and assert_rounding_close below.
FP32_ATOL = 1e-5
FP64_ATOL = 1e-10

MODES = ("blockwise", "capacity_factor", "selective_loading", "all_experts")
DROPLESS_MODES = ("blockwise", "selective_loading", "all_experts")

# The expert activations the issue asks for, as RoutedExpertsMLPOpsConfig keyword sets.
ACTIVATIONS = {
    "glu_silu": dict(hidden_act="silu", glu_mlp=True),
    "swiglu_gptoss": dict(
        hidden_act="sigmoid",
        glu_mlp=True,
        glu_type="swiglu",
        hidden_act_scaling_factor=1.702,
        hidden_act_bias=1.0,
        gate_clamp_upper_limit=7.0,
        up_clamp_lower_limit=-7.0,
        up_clamp_upper_limit=7.0,
    ),
    "mlp_relu": dict(hidden_act="relu", glu_mlp=False),
    "mlp_gelu": dict(hidden_act="gelu", glu_mlp=False),
}

ROUTER_KINDS = ("topk_softmax", "topk_sigmoid", "topk_act_over_topk", "group_limited", "sinkhorn")


def make_config(
    num_experts: int = 4,
    hidden_size: int = 16,
    intermediate_size: int = 8,
    top_k: int = 2,
    activation: str = "glu_silu",
    **overrides,
) -> RoutedExpertsMLPOpsConfig:
    """A small ``RoutedExpertsMLPOpsConfig``; ``activation`` names an entry of :data:`ACTIVATIONS`."""
    kwargs = dict(num_experts=num_experts, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  top_k=top_k, **ACTIVATIONS[activation])
    kwargs.update(overrides)
    return RoutedExpertsMLPOpsConfig(**kwargs)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator(seed), dtype=torch.float64) * scale).to(dtype)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0, scale: float = 1.0, bias_scale: float = 0.3):
    """Re-initialise every weight of ``module`` deterministically with ``N(0, scale^2 / fan_in)`` (biases
    ``N(0, bias_scale^2)``), so a layer's outputs are O(1) for O(1) inputs. Works on routers, experts, shared
    experts and whole MoE layers. Returns the module."""
    gen = generator(seed)

    def fill(p: torch.Tensor, fan_in: int, s: float):
        p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * s / math.sqrt(fan_in)).to(p.dtype))

    for sub in module.modules():
        if isinstance(sub, ExpertLinear):
            fill(sub.weight, sub.weight.shape[1], scale)
            if sub.bias is not None:
                fill(sub.bias, 1, bias_scale)
        elif isinstance(sub, DenseProjection):
            fan_in = sub.weight.shape[0] if sub.transposed else sub.weight.shape[1]
            fill(sub.weight, fan_in, scale)
        elif isinstance(sub, torch.nn.Linear):
            fill(sub.weight, sub.weight.shape[1], scale)
            if sub.bias is not None:
                fill(sub.bias, 1, bias_scale)
    return module


def make_experts(
    config: RoutedExpertsMLPOpsConfig | None = None,
    *,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    matmul: str = "auto",
    seed: int = 0,
    scale: float = 1.0,
    validate_inputs: bool = False,
    blockwise: dict | None = None,
    **config_kwargs,
) -> ExpertMLPsV2:
    """An ``ExpertMLPsV2`` with deterministic O(1) weights (``config`` or ``make_config(**config_kwargs)``)."""
    if config is None:
        config = make_config(**config_kwargs)
    bcfg = BlockwiseMatmulConfig(block_size=block_size, **(blockwise or {}))
    experts = ExpertMLPsV2(config, bcfg, dtype=dtype, backend=TorchBackend(matmul=matmul),
                           validate_inputs=validate_inputs)
    return randomize_(experts, seed=seed, scale=scale)


def quantized_pair(config: RoutedExpertsMLPOpsConfig, fmt: str, dtype: torch.dtype, backend, device, seed: int = 1,
                   edit=None) -> tuple[ExpertMLPsV2, ExpertMLPsV2]:
    """``(experts with fmt-quantized weights on backend, torch-backend experts holding their dequantized weights)``,
    both on ``device``; ``edit(quantized)`` may rewrite the stored weights or scales first."""
    from nxd_moe.quantization.quantizer import quantize_experts
    from nxd_moe.quantization.weight import dequantized

    quantized = make_experts(config, block_size=16, dtype=dtype, seed=seed)
    quantize_experts(quantized, fmt)
    if edit is not None:
        with torch.no_grad():
            edit(quantized)
    holding = make_experts(config, block_size=16, dtype=dtype, seed=seed)
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            getattr(holding.mlp_op, proj).weight.copy_(dequantized(getattr(quantized.mlp_op, proj).stored_weight()))
    quantized = quantized.to(device)
    quantized.backend = backend
    return quantized, holding.to(device)


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int, dtype=torch.float32,
                   act: str = "softmax", skew: float = 0.0):
    """``(affinities (T, E), expert_index (T, k))`` from random logits; ``skew`` > 0 biases towards low
    expert ids (load imbalance)."""
    logits = randn(num_tokens, num_experts, seed=seed, dtype=torch.float64)
    logits = logits - skew * torch.arange(num_experts, dtype=torch.float64)
    expert_index = logits.topk(top_k, dim=-1).indices
    affinities = torch.softmax(logits, dim=-1) if act == "softmax" else torch.sigmoid(logits)
    return affinities.to(dtype), expert_index


def make_router(kind: str, num_experts: int, top_k: int, hidden_size: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> RouterBase:
    """One of :data:`ROUTER_KINDS`, deterministic weights, eval mode."""
    if kind == "topk_softmax":
        router = RouterTopK(num_experts, top_k, hidden_size, act_fn="softmax", dtype=dtype)
    elif kind == "topk_sigmoid":
        router = RouterTopK(num_experts, top_k, hidden_size, act_fn="sigmoid", dtype=dtype)
    elif kind == "topk_act_over_topk":
        router = RouterTopK(num_experts, top_k, hidden_size, act_fn="softmax", apply_act_fn_over_topk=True,
                            bias=True, dtype=dtype)
    elif kind == "group_limited":
        router = GroupLimitedRouter(num_experts, top_k, hidden_size, n_group=4, topk_group=2, normalize=True,
                                    routed_scaling_factor=2.5, dtype=dtype)
        router.e_score_correction_bias.copy_(randn(num_experts, seed=seed + 17, scale=0.1))
    elif kind == "sinkhorn":
        router = RouterSinkhorn(num_experts, 1, hidden_size, dtype=dtype)
    else:
        raise ValueError(kind)
    return randomize_(router, seed=seed, scale=2.0).eval()


def router_top_k(kind: str, top_k: int) -> int:
    return 1 if kind == "sinkhorn" else top_k


def make_shared(hidden_size: int = 16, intermediate_size: int = 8, num_shared_experts: int = 1,
                hidden_act: str = "silu", seed: int = 5, dtype=torch.float32, **kwargs) -> SharedExperts:
    shared = SharedExperts(hidden_size, intermediate_size, num_shared_experts, hidden_act, dtype=dtype, **kwargs)
    return randomize_(shared, seed=seed)


def expert_count_dropped(expert_index: torch.Tensor, num_experts: int, capacity: int,
                         token_is_real: torch.Tensor | None = None) -> int:
    """Dropped (token, expert) assignments under capacity ``capacity``: per expert, everything beyond C.

    Independent of token order (any admission order drops the same number per expert)."""
    index = expert_index.tolist()
    counts = [0] * num_experts
    for t, row in enumerate(index):
        if token_is_real is not None and not bool(token_is_real[t]):
            continue
        for e in row:
            counts[e] += 1
    return sum(max(0, c - capacity) for c in counts)


# ----------------------------------------------------------------------------------------------------------
# tolerances derived from the rounding of the dtypes involved (docs/gpu.md, "How the GPU tests bound errors")

# Unit roundoff u = 2**-p of a format with a p-bit significand (the implicit bit included): the largest relative
# error of one rounding to nearest.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# A sum of n terms of random signs, accumulated with unit roundoff u: its i-th addition rounds a partial sum of
# size ~sqrt(i) terms by <= u, so the errors (independent, random signs) add up to ~sqrt(n / 2) u of the result --
# the probabilistic bound of Higham & Mary (2019), not the worst case n u. lambda = 4 is four such deviations.
ACCUMULATION_LAMBDA = 4.0
# How often a value on its way to an MoE layer's output is stored in the layer's dtype. Triton kernels: the
# activated intermediate, each expert's output row, the combined output (accumulators and the activation are fp32).
# The torch backend: the gate/up product, the activation, the GLU product, each expert's output, the combined
# output. Each rounding moves the values it rounds by <= u of their size, which linear maps and the activations
# (relative condition number ~1 where their outputs matter) carry to ~u of the output's scale.
TRITON_ROUNDINGS = 3
TORCH_ROUNDINGS = 5
# The GPU router's logits come from tf32x3 products: each fp32 operand split into two tf32 parts (11-bit
# significands), the low x low product dropped, <= 2**-22 = 4 u(fp32) relative per product: 4 more fp32 roundings.
TF32X3_ROUNDINGS = 4
# A bf16 parallel layer (dispatch, local experts, shared experts over TP) against the single-device one: both round
# (each: its backend's roundings, the shared expert's 4 in torch, the fp32 combine's one) -- 8-10 u a side, 6-8 %
# for both. These GPU comparisons always met 2 % of the reference's scale, which stays (it is not loosened).
PARALLEL_BF16_TOLERANCE = 2e-2
# Triton's interpreter (3.7, checked here) converts fp32 to bfloat16 by truncation (round towards zero): up to one ulp
# (2u) per conversion, every error of the same sign, so they add up instead of averaging out (a bf16 layer's
# kernels emulated both ways: 2.3u against 0.74u in norm). On a GPU, and for fp16 in the interpreter, conversions
# round to nearest.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_rounding_unit(dtype: torch.dtype) -> float:
    """The largest relative error of one fp32 -> ``dtype`` conversion inside a Triton kernel here."""
    return UNIT_ROUNDOFF[dtype] * (2 if INTERPRETED and dtype == torch.bfloat16 else 1)


def rounding_tolerance(dtype: torch.dtype, depth: int = 1, *, triton_roundings: int = 0,
                       torch_roundings: int = 0) -> float:
    """Relative error bound of a result whose values were stored in ``dtype`` ``triton_roundings`` times by Triton
    kernels and ``torch_roundings`` times by torch ops, and whose longest sum has ``depth`` terms accumulated in
    fp32 (tensor cores, Triton's interpreter, torch's CPU matmuls): ``triton_roundings * triton_rounding_unit +
    torch_roundings * u(dtype) + ACCUMULATION_LAMBDA * sqrt(depth) * u(fp32)``. For two results that both round
    (one backend against another, compiled against eager), count both sides' roundings."""
    return (triton_roundings * triton_rounding_unit(dtype) + torch_roundings * UNIT_ROUNDOFF[dtype]
            + ACCUMULATION_LAMBDA * math.sqrt(depth) * UNIT_ROUNDOFF[torch.float32])


def assert_nan_stays_in_its_row(run, x: torch.Tensor, row: int) -> None:
    """``run(x)`` with token ``row`` of ``x`` set to NaN: that token's output holds a NaN and every other token's
    output is bitwise what ``run`` gives on the clean ``x`` (one NaN token never touches the others)."""
    poisoned = x.clone()
    poisoned[row] = float("nan")
    with torch.no_grad():
        clean, bad = run(x), run(poisoned)
    others = torch.arange(x.shape[0], device=x.device) != row
    assert torch.isnan(bad[row]).any()
    assert torch.equal(bad[others], clean[others])


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, msg: str = "",
                          max_tolerance: float | None = None):
    """``actual`` within ``tolerance`` of ``expected`` relative to the reference's own scale, never an absolute
    one: ``||actual - expected||_2 <= tolerance * ||expected||_2`` (a systematic relative error shows in full:
    a wrong scale, a dropped or misplaced row) and ``max |actual - expected| <= tolerance * max |expected|`` (one
    wrong element; ``max_tolerance`` if that one differs). NaN or Inf fails; so does a zero reference (the bound
    would be empty)."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert a.shape == e.shape, f"{msg} shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert bool(torch.isfinite(a).all()), f"{msg}: non-finite values"
    scale, peak = e.norm().item(), e.abs().max().item()
    assert peak > 0, f"{msg}: the reference is zero, the comparison would be empty"
    err = a - e
    norm, worst = err.norm().item() / scale, err.abs().max().item() / peak
    max_tolerance = tolerance if max_tolerance is None else max_tolerance
    assert norm <= tolerance and worst <= max_tolerance, (
        f"{msg}: relative error {norm:.3g} (norm; tolerance {tolerance:.3g}), {worst:.3g} (max, of max |ref| "
        f"{peak:.3g}; tolerance {max_tolerance:.3g})")


def assert_backends_close(triton_out: torch.Tensor, torch_out: torch.Tensor, reference: torch.Tensor,
                          dtype: torch.dtype, depth: int, msg: str = ""):
    """A Triton layer's result and the torch backend's for the same weights, each against the float64 reference
    with its own roundings: in 16 bits this bounds them more tightly than one bound for their difference (which
    would have to hold both sides' roundings)."""
    assert_rounding_close(triton_out, reference, rounding_tolerance(dtype, depth, triton_roundings=TRITON_ROUNDINGS),
                          msg)
    assert_rounding_close(torch_out, reference, rounding_tolerance(dtype, depth, torch_roundings=TORCH_ROUNDINGS),
                          f"{msg}: the torch backend")


def assert_compiled_close(compiled: torch.Tensor, eager: torch.Tensor, depth: int, msg: str = ""):
    """A compiled layer's result against eager: fp32 within ``FP32_ATOL``; 16 bits relative to eager's scale with
    both sides' roundings (eager: the torch backend's; compiled: no more, its fused pointwise ops round once)."""
    if eager.dtype == torch.float32:
        assert_close(compiled, eager, FP32_ATOL, msg=msg)
    else:
        assert_rounding_close(compiled, eager, rounding_tolerance(eager.dtype, depth,
                                                                  torch_roundings=2 * TORCH_ROUNDINGS), msg)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0, msg: str = ""):
    """Compare in float64 with an absolute tolerance; reports the worst row (token) on failure."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert a.shape == e.shape, f"{msg} shape {tuple(a.shape)} != {tuple(e.shape)}"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    if not bool((err <= bound).all()):
        flat = (err - bound).reshape(err.shape[0], -1) if err.dim() > 1 else (err - bound).reshape(-1, 1)
        worst = int(flat.max(dim=1).values.argmax())
        raise AssertionError(
            f"{msg} max abs err {err.max().item():.3e} > atol {atol:.1e} (rtol {rtol}); worst row {worst}: "
            f"got {a.reshape(a.shape[0], -1)[worst][:6].tolist()} "
            f"expected {e.reshape(e.shape[0], -1)[worst][:6].tolist()}"
        )


@torch.no_grad()
def pad_experts_like(small: ExpertMLPsV2, hidden: int, inter: int, block_size: int = 4,
                     matmul: str = "auto") -> ExpertMLPsV2:
    """A module stored at the padded sizes (H, I) holding ``small``'s weights zero-padded, with
    ``hidden_size_actual``/``intermediate_size_actual`` set to ``small``'s sizes."""
    scfg = small.routed_experts_mlp_config
    h0, i0 = scfg.hidden_size, scfg.intermediate_size
    cfg = scfg.replace(hidden_size=hidden, intermediate_size=inter, hidden_size_actual=h0,
                       intermediate_size_actual=i0)
    big = ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=block_size), dtype=small.dtype,
                       backend=TorchBackend(matmul=matmul))
    src, dst = small.mlp_op, big.mlp_op
    for p in big.parameters():
        p.zero_()
    first_src, first_dst = src.first_proj, dst.first_proj
    if scfg.glu_mlp:  # [gate | up] on the last dim: each half padded separately
        first_dst.weight[:, :h0, :i0] = first_src.weight[:, :, :i0]
        first_dst.weight[:, :h0, inter:inter + i0] = first_src.weight[:, :, i0:]
    else:
        first_dst.weight[:, :h0, :i0] = first_src.weight
    dst.down_proj.weight[:, :i0, :h0] = src.down_proj.weight
    if scfg.bias:
        if scfg.glu_mlp:
            first_dst.bias[:, :i0] = first_src.bias[:, :i0]
            first_dst.bias[:, inter:inter + i0] = first_src.bias[:, i0:]
        else:
            first_dst.bias[:, :i0] = first_src.bias
        dst.down_proj.bias[:, :h0] = src.down_proj.bias
    return big


# ----------------------------------------------------------------------------------------------------------
# host-sync guard (eager complement of the fullgraph compile proof)


class HostSyncError(RuntimeError):
    pass


_SYNC_ATEN = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
              "bincount", "histc", "equal", "is_nonzero"}


def capture_cuda_graph(fn):
    """``(graph, output)``: ``fn()`` warmed up on a side stream, then captured in a CUDA graph (replay it after
    changing ``fn``'s static inputs in place)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def without_device_sync(call):
    """``call()`` under ``torch.cuda.set_sync_debug_mode("error")``: anything that waits for the device (a host read
    of a device value) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def no_host_sync():
    """Raise :class:`HostSyncError` if the enclosed code reads tensor data on the host or runs an op whose
    output shape depends on tensor values (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``, boolean-mask
    indexing, ``unique``, ``repeat_interleave`` with tensor repeats...)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class FunctionGuard(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("tolist", "numpy", "__array__"):
                raise HostSyncError(f"host sync: Tensor.{name}")
            return func(*args, **(kwargs or {}))

    class DispatchGuard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket.__name__
            if op in _SYNC_ATEN:
                raise HostSyncError(f"host sync: aten.{op}")
            if op == "repeat_interleave" and (kwargs or {}).get("output_size") is None and (
                    len(args) == 1 or isinstance(args[1], torch.Tensor)):
                raise HostSyncError("host sync: repeat_interleave with tensor repeats")
            if op in ("index", "index_put", "index_put_"):
                indices = args[1] if len(args) > 1 else ()
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                    raise HostSyncError(f"host sync: aten.{op} with a boolean mask")
            return func(*args, **(kwargs or {}))

    with FunctionGuard(), DispatchGuard():
        yield


# ----------------------------------------------------------------------------------------------------------
# negative controls of the static-graph checks (torch.export, torch.compile, torch_xla): deliberately
# data-dependent expert steps, ``forward(x (T, 16), expert_index (T, k))``


class NonzeroExperts(torch.nn.Module):
    """Only the tokens routed to expert 0, found with ``nonzero``."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(randn(16, 16, seed=3))

    def forward(self, x, expert_index):
        rows = torch.nonzero(expert_index[:, 0] == 0).squeeze(1)
        return torch.zeros_like(x).index_add(0, rows, x.index_select(0, rows) @ self.weight)


class ItemExperts(NonzeroExperts):
    """Reads a count on the host and slices with it."""

    def forward(self, x, expert_index):
        count = int((expert_index[:, 0] == 0).sum().item())
        return x[:count] @ self.weight



# ----------------------------------------------------------------------------------------------------------
# "scaling" experts: expert e computes exactly scale[e] * x, so every token's output names the experts it went
# through (a lost or duplicated (token, expert) contribution changes that token's row, and only that row).


def expert_scales(num_experts: int, top_k: int) -> list[float]:
    """``(k+1)^e``: a sum of at most k chosen scales (with multiplicity) identifies the chosen multiset."""
    return [float((top_k + 1) ** e) for e in range(num_experts)]


@torch.no_grad()
def make_scaling_experts(num_experts: int, hidden_size: int, top_k: int, *, block_size: int = 4,
                         dtype: torch.dtype = torch.float64, matmul: str = "auto", scales=None,
                         **config_overrides) -> ExpertMLPsV2:
    """Plain relu MLP experts with ``up = [I, -I]`` and ``down = scale_e * [I; -I]``: expert e is
    ``x -> scale_e * (relu(x) - relu(-x)) = scale_e * x``."""
    config = RoutedExpertsMLPOpsConfig(num_experts=num_experts, hidden_size=hidden_size,
                                       intermediate_size=2 * hidden_size, top_k=top_k, hidden_act="relu",
                                       glu_mlp=False, **config_overrides)
    experts = ExpertMLPsV2(config, BlockwiseMatmulConfig(block_size=block_size), dtype=dtype,
                           backend=TorchBackend(matmul=matmul))
    eye = torch.eye(hidden_size, dtype=dtype)
    scales = expert_scales(num_experts, top_k) if scales is None else scales
    experts.mlp_op.up_proj.weight.copy_(torch.cat([eye, -eye], dim=1).expand(num_experts, -1, -1))
    down = torch.cat([eye, -eye], dim=0)
    experts.mlp_op.down_proj.weight.copy_(torch.stack([s * down for s in scales]))
    return experts


def scaling_expected(x: torch.Tensor, pair_weights: torch.Tensor, expert_index: torch.Tensor, scales,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = (sum_j w[t, j] * scale[idx[t, j]]) * x[t]`` over kept pairs, in float64."""
    coeff = pair_weights.double() * torch.tensor(scales, dtype=torch.float64)[expert_index]
    if keep is not None:
        coeff = coeff * keep.double()
    return coeff.sum(dim=1, keepdim=True) * x.double()


def zero_router(router: RouterBase) -> RouterBase:
    """All weights and biases zero: every logit ties, the hardest case for top-k."""
    with torch.no_grad():
        for tensor in list(router.parameters()) + list(router.buffers()):
            tensor.zero_()
    return router
