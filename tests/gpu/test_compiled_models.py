"""The triton backend under ``torch.compile(fullgraph=True)``: each seam step one opaque op
(``triton_kernels/compiled.py``), no graph break, the compiled layer equal to the eager one.

Without a GPU the ops run their kernels in Triton's interpreter, on CPU tensors, inside graphs compiled with the
``aot_eager`` and Inductor backends. On a GPU the same tests run on CUDA, plus ``mode="reduce-overhead"`` (Inductor's
CUDA-graph trees) for the triton and torch backends: the compiled layer equals eager in bfloat16 and its graph replays
new routings without running Python; and a small Qwen3-MoE transformers model whose sparse blocks are our layer
generates the same tokens with ``generate(..., cache_implementation="static")`` compiled and eager.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import FP32_ATOL, assert_close, make_config, make_shared, randn, randomize_

from nxd_moe import BlockwiseMatmulConfig, ExpertMLPsV2, MoE, RouterTopK
from nxd_moe.experts.activation import ExpertActivation
from nxd_moe.quantization.quantizer import quantize_experts
from nxd_moe.trace import static_backend

triton = pytest.importorskip("triton")
from nxd_moe.triton_kernels import (  # noqa: E402
    compiled,
    compiled_graph_call,
    in_compiled_graph_call,
    persistent_decode,
    plain_compiled_graphs,
    repack,
)
from nxd_moe.triton_kernels.backend import TritonBackend  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer(num_experts=8, top_k=2, hidden=32, inter=16, dtype=torch.float32, shared=False, quantization=None,
          w8a8=False, seed=3, **options) -> MoE:
    """A triton-backend ``MoE`` with a top-k router (the one the kernels fuse); ``options`` go to
    ``TritonBackend``, and ``capacity_factor`` / ``block_size`` to the experts."""
    cfg = make_config(num_experts, hidden, inter, top_k, "glu_silu", normalize_top_k_affinities=True,
                      capacity_factor=options.pop("capacity_factor", None))
    experts = ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=options.pop("block_size", 4)),
                           backend=TritonBackend(**options), dtype=dtype)
    moe = MoE(RouterTopK(num_experts, top_k, hidden), experts,
              make_shared(hidden, 24, dtype=dtype) if shared else None)
    moe = randomize_(moe, seed=seed).eval()
    if quantization is not None:
        quantize_experts(moe, quantization, activation_quantization="fp8" if w8a8 else "none")
    return moe.to(DEVICE)


class Recorder:
    """A Dynamo backend that keeps the nxd_moe ops of each captured graph, then runs it with ``inner`` -- through
    ``static_backend`` (the graph is checked for host syncs and data-dependent sizes) unless ``static`` is False (a
    graph with symbolic sizes)."""

    def __init__(self, inner="aot_eager", static=True):
        self.backend = static_backend(inner) if static else torch._dynamo.lookup_backend(inner)
        self.ops: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        self.ops.append([str(node.target).split(".")[1] for node in gm.graph.nodes
                         if node.op == "call_function" and str(node.target).startswith("nxd_moe.")])
        return self.backend(gm, example_inputs)


def compile_layer(moe, recorder, dynamic=False):
    return torch.compile(lambda x: moe(x)[0], fullgraph=True, dynamic=dynamic, backend=recorder)


# ----------------------------------------------------------------------------------------------------------------
# graph capture: every path is its ops, the compiled layer equals eager bitwise (the ops run the eager kernels; the
# torch code around them -- reshapes, the padding select -- runs as the same aten ops under aot_eager)

ROUTED = ["triton_routing", "triton_experts"]
# A prefill the GPU rule runs blockwise: more than 1024 (token, expert) pairs (2 x 264 tokens x top-2); shorter ones
# run as the decode of that size.
BLOCKWISE_PREFILL = (2, 264)
CASES = {
    # name: (layer options, input shape, the nxd_moe ops of the graph)
    "prefill_blockwise": (dict(fuse_router=True), BLOCKWISE_PREFILL,
                          ["triton_router_top_k", "triton_routing", "triton_block_mapping", "triton_experts"]),
    "prefill_router_in_torch": (dict(fuse_router=False, shared=True), BLOCKWISE_PREFILL,
                                ["triton_routing", "triton_block_mapping", "triton_experts"]),
    "prefill_decode_sized": (dict(fuse_router=True), (2, 8), ["triton_router_top_k", *ROUTED]),
    "prefill_capacity_factor": (dict(capacity_factor=1.0), (2, 8), ROUTED),
    "decode_one_launch": (dict(shared=True), (3, 1), ["triton_moe_decode"]),
    "decode_separate_kernels": (dict(one_launch=False, fuse_router=True), (3, 1), ["triton_router_top_k", *ROUTED]),
    "decode_mxfp4": (dict(quantization="mxfp4", hidden=64, inter=32), (3, 1), ROUTED),
    "decode_fp8_one_launch": (dict(quantization="fp8", one_launch=True, hidden=64, inter=32), (3, 1),
                              ["triton_moe_decode"]),
    "prefill_fp8_block_w8a8": (dict(quantization="fp8_block", w8a8=True, hidden=128, inter=128, num_experts=4,
                                    shared=True), BLOCKWISE_PREFILL,
                               ["triton_routing", "triton_block_mapping", "triton_experts"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_path_is_one_graph_of_its_ops_equal_to_eager(case):
    options, shape, ops = CASES[case]
    options = dict(options)
    moe = layer(**options)
    x = randn(*shape, moe.hidden_size, seed=5).to(DEVICE)
    recorder = Recorder()
    with torch.no_grad():
        eager = moe(x)[0]
        out = compile_layer(moe, recorder)(x)
    assert recorder.ops == [ops]
    assert torch.equal(out, eager), (out - eager).abs().max()


def test_all_experts_and_explain_finds_no_graph_break():
    """``ExpertMLPsV2`` alone, all-experts forced (the mode only a caller picks), with the router's output as inputs;
    ``torch._dynamo.explain`` of a whole layer reports one graph and no break."""
    moe = layer()
    x = randn(5, 32, seed=6).to(DEVICE)
    logits, affinities, index = moe.router(x)
    recorder = Recorder()

    def forward(x, affinities, index):
        return moe.expert_mlps(x, affinities, index, mode="all_experts")

    with torch.no_grad():
        out = torch.compile(forward, fullgraph=True, backend=recorder)(x, affinities, index)
        assert torch.equal(out, forward(x, affinities, index))
        explained = torch._dynamo.explain(lambda x: moe(x)[0])(x.reshape(1, 5, 32))
    assert recorder.ops == [ROUTED]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_local_routing_is_one_op():
    """``build_local_routing`` (the pairs a module holding some experts computes: expert-parallel ranks, and on one
    device the transformers experts seam's pairs) compiles to its op, equal to eager."""
    backend = TritonBackend()
    pair_expert = torch.tensor([[3, -1], [0, 5], [5, 3], [-1, -1]], device=DEVICE)
    pair_weight = randn(4, 2, seed=10).to(DEVICE)
    local_slot = torch.tensor([-1, -1, -1, 0, -1, 1, -1, -1], device=DEVICE)  # this module holds experts 3 and 5
    recorder = Recorder()

    def local(pair_expert, pair_weight):
        routing = backend.build_local_routing(pair_expert, pair_weight, local_slot, 2, False)
        return routing.expert_index, routing.expert_mask, routing.affinities

    with torch.no_grad():
        compiled_out = torch.compile(local, fullgraph=True, backend=recorder)(pair_expert, pair_weight)
    assert recorder.ops == [["triton_local_routing"]]
    for c, e in zip(compiled_out, local(pair_expert, pair_weight), strict=True):
        assert torch.equal(c, e)


def test_inductor_compiles_the_graph_around_the_ops():
    """Inductor (the default backend) lowers the ops as opaque calls and compiles the rest; prefill and decode
    equal eager bitwise (everything the layer computes is inside the ops)."""
    moe = layer(fuse_router=True)
    recorder = Recorder("inductor")
    compiled_layer = compile_layer(moe, recorder)
    with torch.no_grad():
        for shape in ((2, 8), (3, 1)):
            x = randn(*shape, 32, seed=7).to(DEVICE)
            assert torch.equal(compiled_layer(x), moe(x)[0]), shape
    assert len(recorder.ops) == 2 and recorder.ops[1] == ["triton_moe_decode"]


# Three blockwise prefills of 528-600 tokens and two compiles: ~45 s under Triton's interpreter (CPU CI: slow there),
# seconds on a GPU (where it stays in the default run).
@(pytest.mark.slow if not CUDA else pytest.mark.usefixtures())
def test_dynamic_token_count_specializes_the_launch_configuration():
    """``dynamic=True``: a blockwise prefill's launch configuration follows the token count, so the graph is
    specialised on it (``TritonBackend._config``) and a new count compiles again rather than reusing another count's
    tile sizes."""
    moe = layer(fuse_router=True)
    recorder = Recorder(static=False)
    compiled_layer = compile_layer(moe, recorder, dynamic=True)
    graphs = []
    with torch.no_grad():
        for tokens in (264, 300, 264):
            x = randn(2, tokens, 32, seed=tokens).to(DEVICE)
            assert torch.equal(compiled_layer(x), moe(x)[0]), tokens
            graphs.append(len(recorder.ops))
    assert graphs[0] < graphs[1] == graphs[2]  # T = 600 compiled again; T = 528 again reused its graph


def test_negative_control_a_different_layer_is_caught():
    """The bitwise checks above can fail: the compiled graph of a layer whose one expert differs by one rounding-level
    change does not equal eager."""
    moe = layer()
    x = randn(2, 8, 32, seed=8).to(DEVICE)
    with torch.no_grad():
        eager = moe(x)[0]
        moe.expert_mlps.mlp_op.down_proj.weight[int(moe.router(x.reshape(16, 32))[2][0, 0])] *= 1 + 2 ** -20
        assert not torch.equal(compile_layer(moe, Recorder())(x), eager)


# ----------------------------------------------------------------------------------------------------------------
# the op arguments, the backend handle, memory inside a compiled graph


def test_activation_fields_cover_expert_activation():
    """The ops carry every field of ExpertActivation (a new field must be added to compiled.ACTIVATION_FIELDS)."""
    import dataclasses

    assert [name for name, _ in compiled.ACTIVATION_FIELDS] == [f.name for f in dataclasses.fields(ExpertActivation)]


@pytest.mark.parametrize("quantization, w8a8", [(None, False), ("fp8", False), ("fp8_block", True), ("mxfp4", False)])
def test_weights_round_trip_through_op_arguments(quantization, w8a8):
    from nxd_moe.config import GLUType

    moe = layer(hidden=128, inter=128, quantization=quantization, w8a8=w8a8)
    weights = moe.expert_mlps.expert_weights()
    weights = weights._replace(activation=ExpertActivation("sigmoid", True, GLUType.SWIGLU, 1.702, 1.0, None, 7.0,
                                                           -7.0, 7.0, 128, 120))
    rebuilt = compiled.weights_from_arguments(*compiled.weights_arguments(weights))
    tensors, layout = weights.flatten()
    rebuilt_tensors, rebuilt_layout = rebuilt.flatten()
    assert rebuilt_layout == layout and all(a is b for a, b in zip(rebuilt_tensors, tensors, strict=True))


def test_each_backend_has_its_own_handle():
    backend = TritonBackend()
    clone = copy.deepcopy(backend)
    assert clone.handle != backend.handle and compiled._backend(clone.handle) is clone
    handle = clone.handle
    del clone
    gc.collect()
    with pytest.raises(RuntimeError, match=f"backend handle {handle} belongs to no living TritonBackend"):
        compiled._backend(handle)


def _mxfp4_decode(tokens: int, seed: int):
    """An MxFP4 layer on the one-launch decode, an input of ``tokens`` tokens, its stored gate/up weight (whose
    repacked copy the kernels may cache) and the decode plans made so far."""
    moe = layer(quantization="mxfp4", one_launch=True, hidden=64, inter=32, seed=seed)
    x = randn(tokens, 1, 64, seed=seed + 6).to(DEVICE)
    return moe, x, moe.expert_mlps.expert_weights().gate_up_proj, dict(persistent_decode._PLANS)


def test_inside_a_compiled_graph_no_buffer_outlives_the_call():
    """Inside an op (``compiled_graph_call``) the one-launch decode takes fresh counters and scratch per call and
    keeps none, and no repacked weight copy is built -- what CUDA-graph trees' memory pool requires; outside, the
    plan keeps its buffers and the copy is built and cached."""
    moe, x, weight, before = _mxfp4_decode(3, seed=3)
    with torch.no_grad(), compiled_graph_call():
        inside = moe(x)[0]
        assert repack.repacked(weight) is None
    plans = set(persistent_decode._PLANS) - set(before)
    assert plans and all(persistent_decode._PLANS[key].scratch is None for key in plans)
    with torch.no_grad():
        outside = moe(x)[0]
        assert repack.repacked(weight) is not None
    plans = set(persistent_decode._PLANS) - set(before) - plans  # the repacked copy's plan
    assert plans and all(persistent_decode._PLANS[key].scratch is not None for key in plans)
    # the stored layout (inside) and the repacked copy (outside) hold the same values, summed over K in tiles of
    # other depths: fp32 sums of O(1) terms, reordered (FP32_ATOL: outputs O(0.1-1), ~100 ulps of 2^-24)
    assert_close(inside, outside, FP32_ATOL)


def test_ops_of_graphs_declared_plain_keep_their_memory():
    """Under ``plain_compiled_graphs`` (a compiled graph with no CUDA-graph trees, captured by its caller: the
    application's token step) an op keeps memory as an eager launch does -- the one-launch decode's plan keeps its
    scratch, the repacked copy is cached -- and the outputs are the per-call ones'; the declaration nests and ends
    with its block."""
    moe, x, weight, before = _mxfp4_decode(2, seed=5)
    with torch.no_grad(), compiled_graph_call():
        per_call = moe(x)[0]
        assert repack.repacked(weight) is None
        with plain_compiled_graphs():
            assert not in_compiled_graph_call()
            kept = moe(x)[0]
            assert repack.repacked(weight) is not None
        assert in_compiled_graph_call()
    assert not in_compiled_graph_call()
    plans = set(persistent_decode._PLANS) - set(before)
    assert any(persistent_decode._PLANS[key].scratch is not None for key in plans)
    assert_close(kept, per_call, FP32_ATOL)  # stored vs repacked weights: fp32 sums reordered, as above


# ----------------------------------------------------------------------------------------------------------------
# on a GPU: mode="reduce-overhead" (CUDA-graph trees), bfloat16

BF16_U = 2.0 ** -8  # bf16 unit roundoff (8 significant bits)


def bf16_tolerance(expected: torch.Tensor) -> float:
    """Compiled and eager run the same kernels on the same inputs inside the ops; they can differ only where Inductor
    fuses the torch code around them (the router's softmax and top-k, shared experts, the norm): an elementwise
    chain eager rounds to bf16 after each op is rounded once, i.e. at most 4 roundings of u = 2^-8 relative per
    value entering the next GEMM. With weights N(0, 1/fan_in) a GEMM's output is a random-sign sum whose error stays
    within 4 RMS of the inputs' error, so 4 roundings x gain 4 = 16u of the output's scale (max |y|, at least 1)."""
    return 16 * BF16_U * max(1.0, expected.abs().max().item())


def assert_bf16_close(actual, expected, what=""):
    err = (actual.double() - expected.double()).abs().max().item()
    tol = bf16_tolerance(expected)
    assert err <= tol, f"{what}: max |compiled - eager| {err:.3g} > {tol:.3g}"


def cuda_layer(backend, num_experts=64, top_k=8, hidden=256, inter=192, shared=True, quantization=None, w8a8=False,
               **config):
    cfg = make_config(num_experts, hidden, inter, top_k, "glu_silu", normalize_top_k_affinities=True, **config)
    experts = ExpertMLPsV2(cfg, BlockwiseMatmulConfig(block_size=128), backend=backend, dtype=torch.bfloat16)
    moe = MoE(RouterTopK(num_experts, top_k, hidden), experts,
              make_shared(hidden, inter, dtype=torch.bfloat16) if shared else None)
    moe = randomize_(moe, seed=13).eval()
    if quantization is not None:
        quantize_experts(moe, quantization, activation_quantization="fp8" if w8a8 else "none")
    return moe.to(DEVICE)


def routings(moe, shape):
    """Inputs of ``shape`` that route differently: three random ones, then every token to experts 5..5+k (feature 0
    dominates every logit; the router weight is restored after)."""
    top_k = moe.router.top_k
    weight = moe.router.linear_router.weight
    saved = weight.detach().clone()
    for seed in range(3):
        yield f"random {seed}", randn(*shape, moe.hidden_size, seed=100 + seed).to(DEVICE, torch.bfloat16)
    x = randn(*shape, moe.hidden_size, seed=200).to(DEVICE, torch.bfloat16)
    x[..., 0] = 4.0
    with torch.no_grad():
        weight[:, 0] = -1.0
        weight[5:5 + top_k, 0] = torch.arange(10.0, 10.0 + top_k)
    yield "all tokens to experts 5..5+k", x
    with torch.no_grad():
        weight.copy_(saved)


class LaunchCount:
    """Counts the runs of an op's implementation (its eager backend method) -- the Python a replayed CUDA graph does
    not run."""

    def __init__(self, monkeypatch, name):
        self.calls = 0
        method = getattr(TritonBackend, name)

        def counted(backend, *args, **kwargs):
            if not torch.compiler.is_compiling():
                self.calls += 1
            return method(backend, *args, **kwargs)

        monkeypatch.setattr(TritonBackend, name, counted)


# the eager backend method each phase's op runs
OP_METHODS = {"prefill": "blockwise", "decode": "moe_decode", "prefill_capacity_factor": "capacity_factor"}


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("phase", list(OP_METHODS))
def test_reduce_overhead_equals_eager_and_replays_new_routings(backend, phase, monkeypatch):
    """Every call equals eager on its own input; on the triton backend the op's Python ran only for the CUDA-graph
    trees' warm-up and recording, and every later call -- new routings, all tokens to one expert -- was a replay."""
    from torch._dynamo.utils import counters

    moe = cuda_layer(backend, capacity_factor=1.0 if phase == "prefill_capacity_factor" else None)
    shape = (16, 1) if phase == "decode" else (2, 150)
    count = LaunchCount(monkeypatch, OP_METHODS[phase])
    compiled_layer = torch.compile(lambda x: moe(x)[0], fullgraph=True, mode="reduce-overhead")
    counters.clear()
    compiled_runs = calls = 0
    with torch.no_grad():
        for what, x in routings(moe, shape):
            for _ in range(2):
                before = count.calls
                torch.compiler.cudagraph_mark_step_begin()
                out = compiled_layer(x).clone()
                compiled_runs += count.calls - before
                calls += 1
            assert_bf16_close(out, moe(x)[0], f"{backend} {phase} {what}")
    assert counters["inductor"]["cudagraph_skips"] == 0
    if backend == "triton":
        # the CUDA-graph trees' warm-up and recording ran the op's Python (2); an op outside the graph would run it on
        # every one of the 8 calls
        assert 1 <= compiled_runs <= 3 and calls == 8, (compiled_runs, calls)


@needs_cuda
@pytest.mark.parametrize("quantization, w8a8", [("fp8", False), ("fp8_block", False), ("mxfp4", False),
                                                ("fp8_block", True)])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_reduce_overhead_quantized_triton(quantization, w8a8, tokens):
    """Quantized weights (and W8A8) through the ops, decode sizes in one launch and as separate kernels. The graph,
    recorded before any eager call, reads the stored layout (no repacked copy is built inside a compiled graph);
    eager reads the copy its first call built: the same values, equal within bf16 rounding."""
    moe = cuda_layer("triton", num_experts=16, top_k=4, hidden=256, inter=256, quantization=quantization, w8a8=w8a8)
    compiled_layer = torch.compile(lambda x: moe(x)[0], fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for what, x in routings(moe, (tokens, 1)):
            for _ in range(2):
                torch.compiler.cudagraph_mark_step_begin()
                out = compiled_layer(x).clone()
            assert_bf16_close(out, moe(x)[0], f"{quantization} w8a8={w8a8} T={tokens} {what}")


@needs_cuda
def test_negative_control_bf16_tolerance_rejects_broken_layers():
    """The bf16 bound sees real errors: a replay of the previous input (a stale CUDA graph) and an expert whose tiles
    were skipped (its down projection zeroed: on this layer 2-3x the bound) both fail it."""
    moe = cuda_layer("triton")
    x = randn(16, 1, moe.hidden_size, seed=300).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        eager = moe(x)[0]
        stale = moe(randn(16, 1, moe.hidden_size, seed=301).to(DEVICE, torch.bfloat16))[0]
        expert = int(moe.router(x.reshape(16, -1))[2][0, 0])
        moe.expert_mlps.mlp_op.down_proj.weight[expert] = 0
        skipped = moe(x)[0]
    for broken in (stale, skipped):
        with pytest.raises(AssertionError, match="max"):
            assert_bf16_close(broken, eager)


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_eager_decode_never_waits_for_the_gpu(backend, tokens):
    """An eager decode step (what uncompiled ``generate`` runs) makes no synchronizing CUDA call after its first
    call (which compiles kernels and builds device tables): ``torch.cuda.set_sync_debug_mode("error")`` raises on
    any -- as it does on the ``.item()`` of the negative control."""
    moe = cuda_layer(backend)
    x = randn(tokens, 1, moe.hidden_size, seed=400).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        moe(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe(x)
            with pytest.raises(RuntimeError, match="synchroniz"):
                x.sum().item()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qwen3_moe_generate_compiled_equals_eager(backend, monkeypatch):
    """``generate(..., cache_implementation="static")`` with transformers' compiled decode (fullgraph,
    reduce-overhead) over a Qwen3-MoE whose sparse blocks are our layer: the same 12 greedy tokens as eager
    (fp32, so that a near-tie cannot flip a token), and with the triton backend every compiled decode step ran the
    one-launch decode (its op recorded once, then replayed)."""
    from hf_helpers import generate_tokens, tiny_qwen3_moe

    model = tiny_qwen3_moe(backend, hidden=256, num_experts=16, top_k=4, moe_intermediate=128, vocab=512,
                           device=DEVICE)
    prompt = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    count = LaunchCount(monkeypatch, "moe_decode")
    eager = generate_tokens(model, prompt, compiled=False)
    eager_decodes = count.calls
    assert eager_decodes == (2 * 11 if backend == "triton" else 0)  # 2 layers x 11 decode steps
    tokens = generate_tokens(model, prompt, compiled=True, mode="reduce-overhead")
    assert tokens.tolist() == eager.tolist()
    assert hasattr(model, "_compiled_call")
    if backend == "triton":
        # 2 layers x (warm-up + recording) of the decode graph, whatever recompiles add: far below the 22 launches of
        # decode steps that were not replayed
        assert 0 < count.calls - eager_decodes <= 8


@pytest.mark.slow  # ~70 s: every decode step's kernels in Triton's interpreter, eager and compiled
@pytest.mark.skipif(CUDA, reason="the CUDA run is test_qwen3_moe_generate_compiled_equals_eager")
def test_qwen3_moe_generate_compiled_equals_eager_interpreted():
    from hf_helpers import generate_tokens, tiny_qwen3_moe

    model = tiny_qwen3_moe("triton")
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = generate_tokens(model, prompt, compiled=False)
    assert generate_tokens(model, prompt, compiled=True, backend="aot_eager").tolist() == eager.tolist()
