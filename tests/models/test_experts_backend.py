"""transformers' experts interface served by nxd_moe (``experts_implementation="nxd_moe"``).

Whole tiny models of the five decorated families against transformers' own ``eager`` experts (logits and greedy
``generate``); the experts function alone against a float64 reference written here from the definitions (ties,
all tokens to one expert, empty experts, expert-parallel sentinels, a NaN token); the triton backend under Triton's
interpreter against the torch backend; no weight copies; the named errors; ``torch.compile(fullgraph=True)``; and
negative controls showing the tolerances reject a wrong gate/up interleave.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from hf_helpers import (  # noqa: E402,F401 (one_intra_op_thread: autouse fixture)
    DISPATCHING_FAMILIES,
    HIDDEN,
    LAYERS,
    LOGITS_RTOL,
    MODELS,
    ExpertsModeSpy,
    one_intra_op_thread,
    randomize_hf_,
    tiny_causal_lm,
    token_ids,
)
from transformers import AutoModelForCausalLM, DbrxConfig, GptOssConfig, Llama4TextConfig, MixtralConfig  # noqa: E402
from transformers.activations import ACT2FN as HF_ACT2FN  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

import nxd_moe.hf  # noqa: E402,F401 (registers the implementations)
import nxd_moe.models.experts_backend as backend_module  # noqa: E402
from nxd_moe.config import BlockwiseMatmulConfig  # noqa: E402
from nxd_moe.experts import ExpertsMode, TorchBackend  # noqa: E402
from nxd_moe.experts.pairs import experts_forward_pairs  # noqa: E402
from nxd_moe.hf import check_experts_support, set_experts_implementation  # noqa: E402
from nxd_moe.models import IMPLEMENTATIONS, UnsupportedExpertsError, experts_forward  # noqa: E402
from nxd_moe.models.experts_backend import experts_layout, nxd_moe_experts_forward  # noqa: E402

# The experts function alone, fp32 vs float64: H + I + k terms summed in fp32 (unit roundoff 2**-24), times 8 for
# the magnitudes of the intermediate activations relative to the output; ~3e-5 of the output scale here.
U32 = 2.0 ** -24


def fp32_tolerance(hidden: int, inter: int, top_k: int, scale: float) -> float:
    return 8 * (hidden + inter + top_k) * U32 * max(scale, 1.0)


tiny_model = functools.cache(tiny_causal_lm)


# ----------------------------------------------------------------------------------------------------------
# whole models against transformers' eager experts


@pytest.mark.parametrize("family", DISPATCHING_FAMILIES)
def test_whole_model_logits_and_greedy_generate_match_eager(family, monkeypatch):
    model = tiny_model(family)
    spy = ExpertsModeSpy(monkeypatch)
    # (1, 300): T*k >= 512 -> blockwise; (2, 20): all-experts (selective loading for a decode step of 2).
    prompts = [token_ids(1, 300, seed=1), token_ids(2, 20, seed=2)]
    with torch.no_grad():
        model.set_experts_implementation("eager")
        reference = [model(ids).logits for ids in prompts]
        greedy = model.generate(prompts[1][:, :6], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                attention_mask=torch.ones(2, 6, dtype=torch.long))
        assert not spy.modes
        model.set_experts_implementation("nxd_moe_torch")  # NxD's mode rules: every algorithm runs
        try:
            ours = [model(ids).logits for ids in prompts]
            ours_greedy = model.generate(prompts[1][:, :6], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                         attention_mask=torch.ones(2, 6, dtype=torch.long))
        finally:
            model.set_experts_implementation("eager")
    for got, want in zip(ours, reference):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= LOGITS_RTOL, f"{family}: logits relative error {err:.2e}"
    assert torch.equal(ours_greedy, greedy)
    assert {"blockwise", "all_experts", "selective_loading"} <= set(spy.modes)


# Families beyond the five whose experts transformers 5.23 also dispatches by name (patch_model does not take them):
# model_type -> their MoE sizes in the names of their config class.
OTHER_DISPATCHED = {
    "olmoe": dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2),
    "phimoe": dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2),
    "glm4_moe": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=1, topk_group=1, first_k_dense_replace=0, head_dim=16),
    "granitemoe": dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2),
    "ernie4_5_moe": dict(intermediate_size=24, moe_intermediate_size=24, moe_num_experts=8, moe_k=2),
    "hunyuan_v1_moe": dict(intermediate_size=24, num_experts=8, moe_topk=2, head_dim=16),
    "minimax": dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                        first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=8, kv_lora_rank=8,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4),
}


@pytest.mark.parametrize("model_type", list(OTHER_DISPATCHED))
def test_other_dispatched_families_match_their_eager_experts(model_type, monkeypatch):
    """docs/models.md's list: each of these runs its experts through nxd_moe (the spy sees every sparse layer) and
    gives transformers' eager logits within fp32 rounding; patch_model refuses them by name."""
    config = transformers.AutoConfig.for_model(model_type, hidden_size=HIDDEN, **OTHER_DISPATCHED[model_type],
                                               **{**LAYERS, "num_key_value_heads": 2})
    model = randomize_hf_(AutoModelForCausalLM.from_config(config, experts_implementation="eager"), seed=0).eval()
    ids = token_ids(2, 9, seed=4)
    with torch.no_grad():
        reference = model(ids).logits
        set_experts_implementation(model)
        spy = ExpertsModeSpy(monkeypatch)
        ours = model(ids).logits
    experts_modules = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts_modules and len(spy.modes) == len(experts_modules)  # every experts module called nxd_moe
    err = ((ours - reference).abs().max() / reference.abs().max()).item()
    assert err <= LOGITS_RTOL, f"{model_type}: logits relative error {err:.2e}"
    with pytest.raises(ValueError, match=rf"model_type '{model_type}'\) has no sparse-MoE block nxd_moe converts"):
        nxd_moe.hf.patch_model(model)


def test_automatic_implementation_on_a_cpu_multiplies_the_pairs_at_every_size(monkeypatch):
    """"nxd_moe" on a CPU runs the T*k pairs sorted by expert (grouped_mm, no padding) for prefill and decode sizes
    alike -- NxD's Trainium rules padded each expert to 512-row blocks (a 300-token prefill of this model: 16x the
    rows) and computed every expert for a decode batch -- with eager's logits; "nxd_moe_torch" keeps NxD's rules."""
    model = tiny_model("qwen3_moe")
    spy = ExpertsModeSpy(monkeypatch)
    prompts = [token_ids(1, 300, seed=1), token_ids(8, 1, seed=2), token_ids(2, 20, seed=3)]
    with torch.no_grad():
        model.set_experts_implementation("eager")
        reference = [model(ids).logits for ids in prompts]
        model.set_experts_implementation("nxd_moe")
        try:
            ours = [model(ids).logits for ids in prompts]
        finally:
            model.set_experts_implementation("eager")
    assert spy.modes and set(spy.modes) == {"selective_loading"}
    for got, want in zip(ours, reference):
        assert ((got - want).abs().max() / want.abs().max()).item() <= LOGITS_RTOL


def test_from_pretrained_with_experts_implementation(tmp_path, monkeypatch):
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="nxd_moe").eval()
    assert loaded.config._experts_implementation == "nxd_moe"
    ids = token_ids(2, 9, seed=3)
    spy = ExpertsModeSpy(monkeypatch)
    with torch.no_grad():
        ours = loaded(ids).logits
        assert len(spy.modes) == len(MODELS["qwen3_moe"].moe_layers)  # every sparse layer's experts
        loaded.set_experts_implementation("eager")
        reference = loaded(ids).logits
    assert ((ours - reference).abs().max() / reference.abs().max()).item() <= LOGITS_RTOL


def test_registration_is_class_wide_and_idempotent():
    assert {name: ALL_EXPERTS_FUNCTIONS[name] for name in IMPLEMENTATIONS} == IMPLEMENTATIONS
    before = dict(ExpertsInterface._global_mapping)
    nxd_moe.hf.register_experts_implementations()
    assert ExpertsInterface._global_mapping == before
    assert "nxd_moe" in ExpertsInterface()  # a fresh instance sees the names too


def test_negative_control_wrong_interleave_breaks_model_logits(monkeypatch):
    """GPT-OSS's experts read as [gate | up] halves instead of interleaved columns: far outside the bound."""
    model = tiny_model("gpt_oss")
    check_experts_support(model)
    for module in model.modules():
        layout = getattr(module, backend_module._LAYOUT, None)
        if layout is not None:
            wrong = dataclasses.replace(layout, activation=dataclasses.replace(layout.activation,
                                                                               gate_up_interleaved=False))
            monkeypatch.setattr(module, backend_module._LAYOUT, wrong)
    ids = token_ids(2, 20, seed=4)
    with torch.no_grad():
        reference = model(ids).logits
        model.set_experts_implementation("nxd_moe")
        try:
            ours = model(ids).logits
        finally:
            model.set_experts_implementation("eager")
    assert ((ours - reference).abs().max() / reference.abs().max()).item() > 100 * LOGITS_RTOL


# ----------------------------------------------------------------------------------------------------------
# the experts function alone, against float64


@use_experts_implementation(is_transposed=True, has_bias=True)
class TransposedBiasExperts(nn.Module):
    """Stored (E, H, 2I) / (E, I, H) with biases, [gate | up] halves, GELU: a combination none of the five families
    tested on whole models has."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.act_fn = HF_ACT2FN["gelu"]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("only the registered implementations run this class")


@use_experts_implementation(has_gate=False)
class UngatedExperts(nn.Module):
    """``down(act(up(x)))`` stored (E, I, H) / (E, H, I)."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act_fn = nn.ReLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("only the registered implementations run this class")


EXPERTS = {"mixtral": MixtralExperts, "gpt_oss": GptOssExperts, "transposed_bias": TransposedBiasExperts,
           "ungated": UngatedExperts}
NUM_EXPERTS, TOP_K, INTER = 8, 2, 24


def make_experts(kind: str, seed: int = 0, **config_overrides) -> nn.Module:
    config_cls = GptOssConfig if kind == "gpt_oss" else MixtralConfig
    config = config_cls(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=NUM_EXPERTS,
                        num_experts_per_tok=TOP_K, **({"swiglu_limit": 1.0} if kind == "gpt_oss" else {}),
                        **config_overrides)
    config._experts_implementation = "nxd_moe"
    return randomize_hf_(EXPERTS[kind](config), seed)


def reference64(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t, j] * expert_{index[t, j]}(x[t])`` in float64, one pair at a time, from transformers' layout
    definitions: ``is_transposed=False`` stores ``(E, 2I, H)`` / ``(E, H, I)`` (out x in); the default gate is
    ``act(gate) * up`` on ``[gate | up]`` halves; GPT-OSS's gate reads ``g0, u0, g1, u1, ...`` and computes
    ``(clamp(u, -l, l) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, l)``; ids ``>= E`` under expert
    parallelism are sentinels."""
    first = (module.gate_up_proj if module.has_gate else module.up_proj).double()
    down = module.down_proj.double()
    if not module.is_transposed:
        first, down = first.transpose(1, 2), down.transpose(1, 2)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if e >= module.num_experts:
                assert getattr(module, "_is_expert_parallel", True)
                continue
            h = x[t].double() @ first[e]
            if module.has_bias:
                h = h + (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[e].double()
            if not module.has_gate:
                a = torch.relu(h)
            elif isinstance(module, GptOssExperts):
                g, u = h[0::2].clamp(max=module.limit), h[1::2].clamp(-module.limit, module.limit)
                a = (u + 1) * g * torch.sigmoid(module.alpha * g)
            else:
                g, u = h[:INTER], h[INTER:]
                a = (torch.nn.functional.gelu(g) if isinstance(module, TransposedBiasExperts)
                     else torch.nn.functional.silu(g)) * u
            y = a @ down[e]
            if module.has_bias:
                y = y + module.down_proj_bias[e].double()
            out[t] += weight[t, j].double() * y
    return out


def routing(num_tokens: int, seed: int, case: str = "random"):
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weight = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    if case == "one_expert":  # every token to experts 3 and 5: six experts get nothing
        index = torch.tensor([[3, 5]]).expand(num_tokens, TOP_K).contiguous()
    elif case == "ties":  # equal weights and repeated rows (stable sorting must not matter)
        weight = torch.full((num_tokens, TOP_K), 0.5)
        index[1::2] = index[0::2][: index[1::2].shape[0]]
    return index, weight


# blockwise from T*k >= 16, so small T reaches all three modes: 3 tokens selective loading, 6 all-experts, 40
# blockwise (E = 8, k = 2).
SMALL_BLOCKS = BlockwiseMatmulConfig(block_size=16)
MODE_TOKENS = {"selective_loading": 3, "all_experts": 6, "blockwise": 40}


def run(module, x, index, weight, **kwargs):
    with torch.no_grad():
        return experts_forward(module, x, index, weight, blockwise_matmul_config=SMALL_BLOCKS, **kwargs)


def assert_matches64(out, ref, what, rows=slice(None)):
    tol = fp32_tolerance(HIDDEN, INTER, TOP_K, ref[rows].abs().max().item())
    err = (out[rows].double() - ref[rows]).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", ["random", "one_expert", "ties"])
@pytest.mark.parametrize("mode", list(MODE_TOKENS))
@pytest.mark.parametrize("kind", list(EXPERTS))
def test_experts_function_matches_float64_reference(kind, mode, case, monkeypatch):
    module = make_experts(kind)
    num_tokens = MODE_TOKENS[mode]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(7))
    index, weight = routing(num_tokens, seed=8, case=case)
    spy = ExpertsModeSpy(monkeypatch)
    out = run(module, x, index, weight, backend="torch")
    assert spy.modes == [mode] and out.dtype == x.dtype and out.shape == x.shape
    assert_matches64(out, reference64(module, x, index, weight), f"{kind} {mode} {case}")


@pytest.mark.parametrize("mode", list(MODE_TOKENS))
@pytest.mark.parametrize("kind", ["mixtral", "transposed_bias"])
def test_gather_matmul_takes_the_weight_views(kind, mode):
    """The torch backend's other grouped matmul (per-group weights gathered, what XLA and fp32 compiles run) on
    transposed views (Mixtral) and on weights as stored."""
    module = make_experts(kind)
    num_tokens = MODE_TOKENS[mode]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(30))
    index, weight = routing(num_tokens, seed=31)
    out = run(module, x, index, weight, backend=TorchBackend(matmul="gather"))
    assert_matches64(out, reference64(module, x, index, weight), f"{kind} {mode} gather")


@pytest.mark.parametrize("mode", list(MODE_TOKENS))
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_expert_parallel_sentinels_contribute_nothing(kind, mode):
    """Ids >= num_experts (other ranks' experts) with nonzero weights: nothing of theirs reaches the output."""
    module = make_experts(kind)
    module._is_expert_parallel = True
    num_tokens = MODE_TOKENS[mode]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(9))
    index, weight = routing(num_tokens, seed=10)
    index[::2, 1] = NUM_EXPERTS + torch.arange(0, num_tokens, 2) % 5  # sentinels, weights left nonzero
    index[1, :] = NUM_EXPERTS  # a token with no local expert at all
    out = run(module, x, index, weight, backend="torch")
    ref = reference64(module, x, index, weight)
    assert out[1].abs().max().item() == 0.0
    assert_matches64(out, ref, f"{kind} {mode} sentinels")


@pytest.mark.parametrize("mode", list(MODE_TOKENS))
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_no_host_sync_in_eager_calls(kind, mode, monkeypatch):
    """Eager, first call included (the grouped_mm path, which compiled fp32 graphs do not take): nothing reads a
    tensor on the host or makes a shape from values."""
    from conftest import no_host_sync

    module = make_experts(kind)
    num_tokens = MODE_TOKENS[mode]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(28))
    index, weight = routing(num_tokens, seed=29)
    spy = ExpertsModeSpy(monkeypatch)
    with no_host_sync():
        run(module, x, index, weight, backend="torch")  # NxD's rules: each mode in turn
        run(module, x, index, weight)  # the automatic choice on a CPU: the pairs at every size
    assert spy.modes == [mode, "selective_loading"]


def test_modules_of_transformers_5_17():
    """transformers 5.17's decorator sets neither ``has_post_expert_norm`` nor ``_is_expert_parallel``: such a
    module is served with the decorator's defaults, and ids >= E are sentinels regardless."""
    module = make_experts("gpt_oss")
    for flag in ("has_post_expert_norm", "_is_expert_parallel"):
        module.__dict__.pop(flag, None)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(26))
    index, weight = routing(6, seed=27)
    index[::3, 0] = NUM_EXPERTS
    check_experts_support(nn.ModuleDict({"experts": module}))
    assert_matches64(run(module, x, index, weight, backend="torch"), reference64(module, x, index, weight),
                     "5.17 flags")


@pytest.mark.parametrize("mode", list(MODE_TOKENS))
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_token_stays_in_its_row(value, mode):
    module = make_experts("gpt_oss")
    num_tokens = MODE_TOKENS[mode]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(11))
    x[1, 3] = value
    index, weight = routing(num_tokens, seed=12, case="one_expert")  # the bad token shares both experts
    out = run(module, x, index, weight, backend="torch")
    others = torch.arange(num_tokens) != 1
    assert torch.isfinite(out[others]).all()
    assert_matches64(out, reference64(module, x, index, weight), f"{mode} next to a {value} token", others)


def test_negative_control_wrong_interleave_is_rejected():
    """The float64 bound fails when GPT-OSS's columns are read as [gate | up] halves."""
    module = make_experts("gpt_oss")
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(13))
    index, weight = routing(6, seed=14)
    layout = experts_layout(module)
    wrong = dataclasses.replace(layout, activation=dataclasses.replace(layout.activation, gate_up_interleaved=False))
    setattr(module, backend_module._LAYOUT, wrong)
    with pytest.raises(AssertionError, match="max error"):
        assert_matches64(run(module, x, index, weight, backend="torch"), reference64(module, x, index, weight),
                         "wrong interleave")


@pytest.mark.parametrize("mode", list(MODE_TOKENS))
def test_bf16_model_with_fp32_routing_weights(mode):
    """bf16 weights and activations with fp32 routing weights (Mixtral's router): the output is bf16 and within
    bf16 rounding of float64 on the same bf16 values: about four roundings to bf16 (unit roundoff 2**-8) of
    intermediates up to ~4x the output's scale -- 16 * 2**-8 of it."""
    module = make_experts("mixtral").to(torch.bfloat16)
    num_tokens = MODE_TOKENS[mode]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    index, weight = routing(num_tokens, seed=16)
    out = run(module, x, index, weight, backend="torch")
    assert out.dtype == torch.bfloat16
    ref = reference64(module, x, index, weight)
    assert (out.double() - ref).abs().max().item() <= 16 * 2.0 ** -8 * ref.abs().max().item()


# ----------------------------------------------------------------------------------------------------------
# no copies


class WeightsSpy(TorchBackend):
    def __init__(self):
        super().__init__()
        self.seen = []

    def all_experts(self, hidden_states, routing, weights):
        self.seen.append(weights)
        return super().all_experts(hidden_states, routing, weights)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_the_module_weights_are_used_in_place(kind):
    module = make_experts(kind)
    spy = WeightsSpy()
    run(module, torch.randn(6, HIDDEN), *routing(6, seed=17), backend=spy)
    (weights,) = spy.seen
    for ours, theirs in ((weights.gate_up_proj, module.gate_up_proj), (weights.down_proj, module.down_proj)):
        assert ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
        assert ours.data_ptr() == theirs.data_ptr()
    if module.has_bias:
        assert weights.gate_up_bias is module.gate_up_proj_bias and weights.down_bias is module.down_proj_bias
    # What stays on the module between calls: metadata and an (E,) id table, no weight-sized tensor.
    kept = [t for t in vars(getattr(module, backend_module._LAYOUT)).values() if isinstance(t, dict)]
    kept_bytes = sum(v.numel() * v.element_size() for d in kept for v in d.values())
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert kept_bytes <= 0.05 * weight_bytes and kept_bytes == NUM_EXPERTS * 8


# ----------------------------------------------------------------------------------------------------------
# the triton backend under Triton's interpreter (CPU CI; on a GPU machine tests/gpu has the CUDA runs)


@pytest.fixture
def interpreted_triton():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the triton backend runs CPU tensors only under the interpreter (CPU-only machines)")
    from nxd_moe.triton_kernels.backend import TritonBackend

    return TritonBackend


# Separate decode kernels with the gate/up GEMM split in two along H (16-deep K tiles of HIDDEN = 32): the partial
# sums kernel, reached only by a launch setting.
SPLIT_GATE_UP = {"block_m": 16, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2, "num_warps": 4,
                                            "num_stages": 2},
                 "down": {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}}


@pytest.mark.parametrize("path", ["one_launch", "separate_kernels", "split_gate_up", "blockwise"])
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_triton_backend_matches_torch_backend(kind, path, interpreted_triton, monkeypatch):
    """Interleaved gate/up (GPT-OSS) and transposed views of (E, 2I, H) weights (Mixtral) through the one-launch
    decode, the separate kernels' selective loading (whole and split along H), and blockwise."""
    module = make_experts(kind)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(18))
    index, weight = routing(5, seed=19, case="one_expert" if path == "blockwise" else "random")
    expected = run(module, x, index, weight, backend="torch")
    if path == "blockwise":  # the triton rule decodes every T*k <= 1024 in one launch: force blockwise here
        layout = experts_layout(module)
        with torch.no_grad():
            got = experts_forward_pairs(interpreted_triton(), x, index, weight, layout.weights(module),
                                        layout.local_slot(x.device), ExpertsMode.BLOCKWISE, SMALL_BLOCKS).output
    else:
        from nxd_moe.triton_kernels import grouped_gemm

        partial_launches = []
        partial_kernel = grouped_gemm._gate_up_partial_kernel
        monkeypatch.setattr(grouped_gemm, "_gate_up_partial_kernel",
                            type("Spy", (), {"__getitem__": lambda _, grid: partial_launches.append(grid)
                                             or partial_kernel[grid]})())
        spy = ExpertsModeSpy(monkeypatch)
        backend = interpreted_triton(one_launch=path == "one_launch",
                                     configs=SPLIT_GATE_UP if path == "split_gate_up" else None)
        got = run(module, x, index, weight, backend=backend)
        assert spy.modes == ["selective_loading"]
        assert [grid[1] for grid in partial_launches] == ([2] if path == "split_gate_up" else [])
    tol = fp32_tolerance(HIDDEN, INTER, TOP_K, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tol


def test_triton_backend_expert_parallel_sentinels(interpreted_triton):
    module = make_experts("gpt_oss")
    module._is_expert_parallel = True
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(20))
    index, weight = routing(4, seed=21)
    index[:, 1] = NUM_EXPERTS + 2
    got = run(module, x, index, weight, backend=interpreted_triton())
    assert_matches64(got, reference64(module, x, index, weight), "triton sentinels")


# ----------------------------------------------------------------------------------------------------------
# torch.compile: one graph, no host sync (torch backend)


# Dynamo 2.9 cannot build the layout's frozen dataclasses inside a graph (measured); 2.13 can (2.10-2.12 unchecked).
COLD_COMPILE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind,num_tokens,cold", [
    ("mixtral", 3, False), ("gpt_oss", 40, False), ("gpt_oss", 300, False),
    pytest.param("gpt_oss", 40, True, marks=pytest.mark.skipif(not COLD_COMPILE, reason="Dynamo < 2.13"))])
def test_compiles_to_one_graph(kind, num_tokens, cold):
    """The module's own forward (transformers' dispatch to ``"nxd_moe"``) under ``fullgraph=True`` with a backend
    that rejects host syncs: 3 tokens selective loading, 40 all-experts, 300 blockwise. ``cold``: the first call is
    the compiled one (the layout is derived while tracing); else ``check_experts_support`` derived it."""
    from nxd_moe.trace import static_backend

    module = make_experts(kind)
    if not cold:
        check_experts_support(nn.ModuleDict({"experts": module}))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(22))
    index, weight = routing(num_tokens, seed=23)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, fullgraph=True, dynamic=False, backend=static_backend("aot_eager"))
        with torch.no_grad():
            got = compiled(x, index, weight)
            expected = nxd_moe_experts_forward(module, x, index, weight)
    finally:
        torch._dynamo.reset()
    assert (got - expected).abs().max().item() <= fp32_tolerance(HIDDEN, INTER, TOP_K, expected.abs().max().item())


# ----------------------------------------------------------------------------------------------------------
# named errors


class GatedExperts(nn.Module):
    """Mixtral's storage, not decorated: the unsupported variants below decorate subclasses of it."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("only the registered implementations run this class")


def post_norm_experts():
    """What ``use_experts_implementation(has_post_expert_norm=True)`` makes (transformers 5.17's decorator has no
    such argument: the flag is set here)."""
    module = make_experts_of(DefaultGateExperts)
    module.has_post_expert_norm = True
    return module


@use_experts_implementation
class DefaultGateExperts(GatedExperts):
    pass


@use_experts_implementation
class ClampedGate(GatedExperts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=1.0)) * up


@use_experts_implementation(is_concatenated=False)
class InterleavedFlagDefaultGateExperts(GatedExperts):
    pass


def _with_act(name):
    module = make_experts("mixtral")
    module.act_fn = HF_ACT2FN[name]
    return module


UNSUPPORTED = {
    "post_expert_norm": (post_norm_experts, "has_post_expert_norm=True"),
    "custom_gate": (lambda: make_experts_of(ClampedGate),
                    r"ClampedGate\)?: its _apply_gate \(from .*test_experts_backend\)"),
    "tanh_gelu": (lambda: _with_act("gelu_pytorch_tanh"), "act_fn GELUTanh"),
    "relu2": (lambda: _with_act("relu2"), "act_fn ReLUSquaredActivation"),
    "ambiguous_interleave": (lambda: make_experts_of(InterleavedFlagDefaultGateExperts),
                             "is_concatenated=False .* ambiguous"),
    "shape": (lambda: _resized(make_experts("mixtral")), r"down_proj \(8, 32, 20\) must be"),
}


def make_experts_of(cls):
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=NUM_EXPERTS,
                           num_experts_per_tok=TOP_K)
    config._experts_implementation = "nxd_moe"
    return cls(config)


def _resized(module):
    module.down_proj = nn.Parameter(torch.zeros(NUM_EXPERTS, HIDDEN, 20))
    return module


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_experts_are_refused_by_name(case):
    make, message = UNSUPPORTED[case]
    with pytest.raises(UnsupportedExpertsError, match=message):
        check_experts_support(nn.ModuleDict({"experts": make()}))
    with pytest.raises(UnsupportedExpertsError, match=message):  # and on the first call, without the check
        run(make(), torch.randn(3, HIDDEN), *routing(3, seed=24))


def test_set_experts_implementation_refuses_before_switching():
    model = tiny_model("mixtral")
    first = model.model.layers[0].mlp.experts
    first.act_fn = HF_ACT2FN["gelu_pytorch_tanh"]
    try:
        with pytest.raises(UnsupportedExpertsError, match=r"model\.layers\.0\.mlp\.experts .*act_fn GELUTanh"):
            set_experts_implementation(model, "nxd_moe")
        assert model.config._experts_implementation == "eager"
    finally:
        first.act_fn = HF_ACT2FN["silu"]
    with pytest.raises(ValueError, match=r"implementation must be one of \['nxd_moe', 'nxd_moe_torch', "):
        set_experts_implementation(model, "nxd")
    served = set_experts_implementation(model, "nxd_moe_torch")
    try:
        assert served == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert model.config._experts_implementation == "nxd_moe_torch"
    finally:
        model.set_experts_implementation("eager")


@pytest.mark.parametrize("config", [
    lambda: Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4,
                             num_experts_per_tok=1, head_dim=16, **LAYERS),
    lambda: DbrxConfig(d_model=HIDDEN, n_layers=1, n_heads=2, vocab_size=64,
                       attn_config=dict(kv_n_heads=1, rope_theta=10000.0),
                       ffn_config=dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2)),
], ids=["llama4", "dbrx"])
def test_undecorated_families_are_refused_by_name(config):
    model = AutoModelForCausalLM.from_config(config())
    family = "Llama 4" if "llama4" in model.config.model_type else "DBRX"
    with pytest.raises(UnsupportedExpertsError, match=f"{family}'s experts are not decorated .*patch_model"):
        set_experts_implementation(model)


def test_bad_shapes_and_backends_are_named(monkeypatch):
    module = make_experts("gpt_oss")
    index, weight = routing(3, seed=25)
    with pytest.raises(ValueError, match=r"hidden_states must be \(T, H\) with H = 32"):
        run(module, torch.randn(3, HIDDEN + 1), index, weight)
    with pytest.raises(ValueError, match="nki_sim backend takes gate/up weights as \\[gate \\| up\\]"):
        run(module, torch.randn(3, HIDDEN), index, weight, backend="nki_sim")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        # Imported first: Triton reads TRITON_INTERPRET when the kernels are defined.
        from nxd_moe.triton_kernels.backend import TritonBackend

        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="the triton backend runs on CUDA tensors"):
            run(module, torch.randn(3, HIDDEN), index, weight, backend=TritonBackend())
