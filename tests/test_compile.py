"""Static graphs: every mode compiles with ``fullgraph=True, dynamic=False`` and returns the eager output.

The no-host-sync proof is the compile itself plus a check of the captured graphs: ``fullgraph=True`` turns a
graph break (``bool(tensor)``, ``.tolist()``, data-dependent branches) into an error, and
:func:`nxd_moe.trace.assert_static_graph` rejects what recent Dynamo captures *without* breaking -- ``nonzero``,
boolean masks, ``unique`` and ``.item()`` (as ``_local_scalar_dense``) all trace into a fullgraph on PyTorch 2.13,
so fullgraph alone would not catch them. Every backend used here runs that check on the Dynamo graph (and the aten
graph for ``aot_eager``). Negative controls show each kind of host sync is rejected.

Inductor compiles are slow on CPU, so the default run compiles few, shared functions with inductor (numerics in
fp32 and bf16) and a wider matrix with the cheap ``aot_eager`` backend (same Dynamo capture); the full inductor
matrix is marked ``slow``. An eager guard (``no_host_sync`` in conftest) checks the same property without
compiling, including the ``grouped_mm`` path that compiled fp32 graphs do not take.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import (
    ACTIVATIONS,
    FP32_ATOL,
    MODES,
    ROUTER_KINDS,
    HostSyncError,
    assert_close,
    assert_compiled_close,
    make_config,
    make_experts,
    make_router,
    make_shared,
    no_host_sync,
    randn,
    random_routing,
    router_top_k,
)

from nxd_moe import MoE
from nxd_moe.trace import static_backend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")


# The longest sum in these layers: H = 16 (I = 8, k <= 2).
DEPTH = 16


def fullgraph(fn, backend="inductor"):
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=static_backend(backend))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def experts_and_inputs(dtype, matmul="auto", num_tokens=12, **overrides):
    kwargs = dict(num_experts=4, hidden_size=16, intermediate_size=8, top_k=2, capacity_factor=1.0,
                  activation="swiglu_gptoss", bias=True, normalize_top_k_affinities=True)
    kwargs.update(overrides)
    cfg = make_config(**kwargs)
    experts = make_experts(cfg, block_size=4, dtype=dtype, matmul=matmul, seed=1)
    x = randn(num_tokens, cfg.hidden_size_actual or cfg.hidden_size, seed=2, dtype=dtype)
    affinities, expert_index = random_routing(num_tokens, 4, cfg.top_k, seed=3, dtype=dtype)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[1] = False
    return experts, x, affinities, expert_index, mask


def small_moe(dtype):
    experts = make_experts(make_config(num_experts=4, top_k=2, activation="glu_silu"), block_size=4, dtype=dtype,
                           seed=4)
    router = make_router("topk_softmax", 4, 2, 16, seed=5)
    norm = torch.nn.RMSNorm(16, eps=1e-6, dtype=dtype)
    return MoE(router, experts, make_shared(16, dtype=dtype, shared_expert_gate=True), rmsnorm=norm).eval()


# ----------------------------------------------------------------------------------------------------------
# inductor: numerics of the compiled graphs (default run)


def test_compiled_bound_rejects_a_4_percent_error():
    """Negative control of assert_compiled_close in bf16: a result 4 % off eager fails (an absolute 6e-2 passed it)."""
    experts, x, affinities, expert_index, mask = experts_and_inputs(torch.bfloat16)
    with torch.no_grad():
        eager = experts(x, affinities, expert_index, padding_mask=mask, mode="blockwise")
    assert_compiled_close(eager, eager, DEPTH)
    with pytest.raises(AssertionError):
        assert_compiled_close(eager.double() * 1.04, eager, DEPTH)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_mode_compiles_and_matches_eager(dtype):
    experts, x, affinities, expert_index, mask = experts_and_inputs(dtype)

    def all_modes(x, affinities, expert_index, mask):
        return tuple(experts(x, affinities, expert_index, padding_mask=mask, mode=m) for m in MODES)

    with torch.no_grad():
        eager = all_modes(x, affinities, expert_index, mask)
        compiled = fullgraph(all_modes)(x, affinities, expert_index, mask)
    for mode, e, c in zip(MODES, eager, compiled):
        assert c.dtype == dtype
        assert_compiled_close(c, e, DEPTH, msg=mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_with_shared_experts_and_padding_compiles_prefill_and_decode(dtype):
    moe = small_moe(dtype)

    def prefill_and_decode(xp, mp, rp, xd, md, x1):
        out_p, res_p = moe(xp, padding_mask=mp, residual=rp)
        (out_d,) = moe(xd, padding_mask=md)
        (out_1,) = moe(x1)
        return out_p, res_p, out_d, out_1

    xp, rp = randn(2, 8, 16, seed=6, dtype=dtype), randn(2, 8, 16, seed=7, dtype=dtype)
    mp = torch.ones(2, 8, dtype=torch.bool)
    mp[1, 5:] = False
    xd = randn(3, 1, 16, seed=8, dtype=dtype)
    md = torch.tensor([[True], [False], [True]])
    x1 = randn(1, 1, 16, seed=9, dtype=dtype)
    # prefill T*k = 32 >= block 4: blockwise; decode 3 tokens: 6 >= E = 4: all-experts; 1 token: selective
    modes = [moe(*args, return_stats=True)[-1].mode.value for args in ((xp, mp), (xd, md), (x1,))]
    assert modes == ["blockwise", "all_experts", "selective_loading"]
    with torch.no_grad():
        eager = prefill_and_decode(xp, mp, rp, xd, md, x1)
        compiled = fullgraph(prefill_and_decode)(xp, mp, rp, xd, md, x1)
    for name, e, c in zip(("prefill", "residual", "decode", "decode_1"), eager, compiled):
        assert_compiled_close(c, e, DEPTH, msg=name)
    assert torch.equal(compiled[0][1, 5:], torch.zeros_like(compiled[0][1, 5:]))
    assert torch.equal(compiled[2][1], torch.zeros_like(compiled[2][1]))


# ----------------------------------------------------------------------------------------------------------
# aot_eager: the fullgraph proof over many more variants (cheap)


VARIANTS = {
    "plain": dict(normalize_top_k_affinities=False, bias=False, activation="glu_silu"),
    "swiglu_bias_normalize": dict(),
    "prescale_k1": dict(top_k=1, early_expert_affinity_modulation=True, normalize_top_k_affinities=False),
    "prescale_k2": dict(early_expert_affinity_modulation=True),
    "mlp_gelu": dict(activation="mlp_gelu"),
    "padded_sizes": dict(hidden_size=20, intermediate_size=12, hidden_size_actual=16, intermediate_size_actual=8),
}


# fp32 compiles take the gather matmul whatever the impl; bf16 "auto" takes grouped_mm (its compiled path)
DTYPE_MATMUL = [pytest.param(torch.float32, "gather", id="fp32-gather"),
                pytest.param(torch.bfloat16, "auto", id="bf16-auto"),
                pytest.param(torch.bfloat16, "gather", id="bf16-gather", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype, matmul", DTYPE_MATMUL)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", MODES)
def test_fullgraph_capture_matrix(mode, variant, dtype, matmul):
    experts, x, affinities, expert_index, mask = experts_and_inputs(dtype, matmul, **VARIANTS[variant])

    def forward(x, affinities, expert_index, mask):
        return experts(x, affinities, expert_index, padding_mask=mask, mode=mode)

    with torch.no_grad():
        compiled = fullgraph(forward, backend="aot_eager")(x, affinities, expert_index, mask)
        eager = forward(x, affinities, expert_index, mask)
    assert_compiled_close(compiled, eager, DEPTH)


@pytest.mark.parametrize("router_kind", ROUTER_KINDS)
def test_fullgraph_capture_every_router_in_moe(router_kind):
    top_k = router_top_k(router_kind, 2)
    experts = make_experts(make_config(num_experts=8, top_k=top_k), block_size=4, seed=9)
    moe = MoE(make_router(router_kind, 8, top_k, 16, seed=10), experts, make_shared(16)).eval()
    for shape in ((2, 8), (2, 1), (8, 1)):
        x = randn(*shape, 16, seed=11)
        with torch.no_grad():
            compiled = fullgraph(lambda x: moe(x)[0], backend="aot_eager")(x)
            assert_close(compiled, moe(x)[0], FP32_ATOL, msg=f"{router_kind} {shape}")


# ----------------------------------------------------------------------------------------------------------
# negative controls: the checks can fail


def _branch_on_item(x):
    return x + 1 if x.sum().item() > 0 else x - 1


def _branch_on_tensor(x):
    if x.sum() > 0:
        return x + 1
    return x - 1


HOST_SYNCING = {
    "item_in_branch": _branch_on_item,
    "item_as_size": lambda x: torch.zeros(int(x.sum().item())),
    "item_as_value": lambda x: torch.full((3,), x.sum().item()),
    "bool_of_tensor": _branch_on_tensor,
    "nonzero": lambda x: torch.nonzero(x > 0).sum(),
    "boolean_mask": lambda x: x[x > 0].sum(),
    "tolist": lambda x: torch.tensor(x.tolist()) * 2,
    "unique": lambda x: torch.unique(x).sum(),
}


@pytest.mark.parametrize("name", list(HOST_SYNCING))
def test_negative_control_host_sync_is_rejected(name):
    """A test-local function with a host sync: runs eagerly, but the fullgraph + static-graph check rejects it."""
    fn = HOST_SYNCING[name]
    x = torch.arange(-2.0, 6.0)
    fn(x)  # fine eagerly
    assert_rejected(fn, x)


def assert_rejected(fn, *args):
    with pytest.raises(Exception) as info:
        with torch.no_grad():
            fullgraph(fn, backend="aot_eager")(*args)
    message = str(info.value)
    assert re.search(r"host-sync op|data-dependent|Data-dependent|tolist", message), message[:500]


def test_negative_control_validate_inputs_breaks_fullgraph():
    """Our own value checks read data on the host: they are exactly what fullgraph rejects."""
    cfg = make_config()
    experts = make_experts(cfg, validate_inputs=True)
    affinities, expert_index = random_routing(6, 4, 2, seed=12)
    x = randn(6, 16, seed=13)
    experts(x, affinities, expert_index, mode="blockwise")  # fine eagerly
    assert_rejected(lambda x: experts(x, affinities, expert_index, mode="blockwise"), x)


# ----------------------------------------------------------------------------------------------------------
# eager guard


@pytest.mark.parametrize("matmul", ["gather", "grouped_mm"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", MODES)
def test_no_host_sync_in_any_mode_eager(mode, variant, matmul):
    experts, x, affinities, expert_index, mask = experts_and_inputs(torch.float32, matmul, **VARIANTS[variant])
    with torch.no_grad(), no_host_sync():
        out, stats = experts(x, affinities, expert_index, padding_mask=mask, mode=mode, return_stats=True)
    assert out.shape == x.shape and stats.mode.value == mode


@pytest.mark.parametrize("shape", [(2, 8), (2, 1), (8, 1)])
def test_no_host_sync_in_moe_eager(shape):
    moe = small_moe(torch.float32)
    x = randn(*shape, 16, seed=14)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, 0] = False
    with torch.no_grad(), no_host_sync():
        moe(x, padding_mask=mask, residual=torch.zeros_like(x), return_stats=True)


def test_no_host_sync_guard_negative_controls():
    x = torch.randn(6)
    for fn in (lambda: x.sum().item(), lambda: bool(x.sum() > 0), lambda: x.tolist(), lambda: torch.nonzero(x),
               lambda: x[x > 0], lambda: torch.unique(x), lambda: torch.repeat_interleave(torch.tensor([1, 2])),
               lambda: x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1])), lambda: int(x.argmax())):
        with pytest.raises(HostSyncError), no_host_sync():
            fn()
    experts = make_experts(make_config(), validate_inputs=True)
    affinities, expert_index = random_routing(6, 4, 2, seed=15)
    with pytest.raises(HostSyncError), no_host_sync():
        experts(randn(6, 16, seed=16), affinities, expert_index)
    # and the static ops we use pass
    with no_host_sync():
        torch.repeat_interleave(x, 2)
        torch.searchsorted(torch.arange(4), x)
        x.argsort(stable=True)


# ----------------------------------------------------------------------------------------------------------
# the full inductor matrix (slow)


@pytest.mark.slow
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("matmul", ["gather", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_inductor_matrix(mode, dtype, matmul, activation):
    experts, x, affinities, expert_index, mask = experts_and_inputs(
        dtype, matmul, activation=activation, early_expert_affinity_modulation=activation == "glu_silu")

    def forward(x, affinities, expert_index, mask):
        return experts(x, affinities, expert_index, padding_mask=mask, mode=mode)

    with torch.no_grad():
        compiled = fullgraph(forward)(x, affinities, expert_index, mask)
        eager = forward(x, affinities, expert_index, mask)
    assert_compiled_close(compiled, eager, DEPTH)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("router_kind", ROUTER_KINDS)
def test_inductor_moe_every_router(router_kind, dtype):
    top_k = router_top_k(router_kind, 2)
    experts = make_experts(make_config(num_experts=8, top_k=top_k), block_size=4, dtype=dtype, seed=17)
    moe = MoE(make_router(router_kind, 8, top_k, 16, seed=18), experts, make_shared(16, dtype=dtype)).eval()
    x = randn(2, 8, 16, seed=19, dtype=dtype)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3] = False
    with torch.no_grad():
        compiled = fullgraph(lambda x, m: moe(x, padding_mask=m)[0])(x, mask)
        assert_compiled_close(compiled, moe(x, padding_mask=mask)[0], DEPTH)


# ----------------------------------------------------------------------------------------------------------
# a whole model: transformers' compiled static-cache generate over our layer


@pytest.mark.parametrize("backend", [
    "aot_eager",  # the fullgraph capture of the whole decode step (cheap)
    pytest.param("inductor", marks=pytest.mark.slow),  # ~1 min of Inductor compiles on a 2-core CPU
])
def test_qwen3_moe_generate_compiled_equals_eager(backend):
    """A Qwen3-MoE whose sparse blocks are our layer (torch backend): ``generate(..., cache_implementation="static")``
    with every decode step under ``torch.compile(fullgraph=True)`` gives the eager tokens, and the compiled step
    traced our layer. Tokens are compared exactly: logits are fp32, and the negative control below shows that a
    layer off by much less than its outputs' scale already changes them."""
    from hf_helpers import generate_tokens, tiny_qwen3_moe

    model = tiny_qwen3_moe()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = generate_tokens(model, prompt, compiled=False)
    assert eager.shape == (2, 12) and len(set(eager.flatten().tolist())) > 6  # not one repeated token
    assert generate_tokens(model, prompt, compiled=True, backend=recording).tolist() == eager.tolist()
    # one graph for every decode step, and it holds both of our layers
    assert len(graphs) == 1
    layers = {path for node in graphs[0].graph.nodes for path, kind in node.meta.get("nn_module_stack", {}).values()
              if kind is MoE or getattr(kind, "__name__", kind) == "MoE" or str(kind).endswith(".MoE")}
    assert len(layers) == 2, layers


def test_negative_control_generate_tokens_see_a_wrong_layer():
    """Swapping two experts' weights in one layer (a routing bug's effect) changes the greedy tokens."""
    from hf_helpers import generate_tokens, tiny_qwen3_moe

    model = tiny_qwen3_moe()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = generate_tokens(model, prompt, compiled=False)
    weight = model.model.layers[1].mlp.moe.expert_mlps.mlp_op.down_proj.weight
    with torch.no_grad():
        weight[[0, 1]] = weight[[1, 0]].clone()
    assert generate_tokens(model, prompt, compiled=False).tolist() != eager.tolist()


# ----------------------------------------------------------------------------------------------------------
# quantized experts and W8A8 through Inductor (torch backend)


# Inductor compiles of these layers take about a minute each on a 2-core CPU; aot_eager captures the same graph.
QUANTIZED = [pytest.param(fmt, w8a8, compiler, id=f"{fmt}{'-w8a8' if w8a8 else ''}-{compiler}",
                          marks=[pytest.mark.slow] if compiler == "inductor" else [])
             for fmt, w8a8 in (("fp8", False), ("fp8_block", False), ("mxfp4", False), ("fp8_block", True))
             for compiler in ("aot_eager", "inductor") if compiler == "inductor" or w8a8]


@pytest.mark.parametrize("quantization, w8a8, compiler", QUANTIZED)
def test_quantized_moe_compiles(quantization, w8a8, compiler):
    """A bf16 layer with quantized routed and shared experts, prefill and decode, compiled: equal to eager within
    the rounding of its lowest-precision step. Inductor fuses what eager rounds to bf16 step by step (a few bf16
    ulps, u = 2^-8, relative to the outputs' scale: assert_compiled_close); with FP8 activations (W8A8) such a
    difference can move an input to the neighbouring FP8 E4M3 value, up to 2^-3 of its magnitude (3 mantissa bits),
    and with weights N(0, 1/fan_in) the output by at most that fraction of its scale."""
    from nxd_moe.quantization.quantizer import quantize_experts

    experts = make_experts(make_config(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128),
                           block_size=4, dtype=torch.bfloat16, seed=20)
    moe = MoE(make_router("topk_softmax", 4, 2, 128, seed=21), experts,
              make_shared(128, 128, dtype=torch.bfloat16)).eval()
    quantize_experts(moe, quantization, shared_experts=True, activation_quantization="fp8" if w8a8 else "none")
    xp, xd = randn(2, 8, 128, seed=22, dtype=torch.bfloat16), randn(3, 1, 128, seed=23, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled = fullgraph(lambda xp, xd: (moe(xp)[0], moe(xd)[0]), compiler)(xp, xd)
        for name, c, x in zip(("prefill", "decode"), compiled, (xp, xd)):
            eager = moe(x)[0]
            if w8a8:
                assert_close(c, eager, 2 ** -3 * max(1.0, eager.abs().max().item()), msg=name)
            else:  # the longest sum: H = I = 128 terms
                assert_compiled_close(c, eager, 128, msg=name)
