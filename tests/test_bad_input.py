"""Bad input gets a clear ValueError/TypeError naming the argument; non-finite values stay contained."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    FP32_ATOL,
    MODES,
    ROUTER_KINDS,
    assert_close,
    make_config,
    make_experts,
    make_router,
    make_shared,
    randn,
    random_routing,
    randomize_,
    router_top_k,
)

from nxd_moe import (
    BlockwiseMatmulConfig,
    ExpertMLPsV2,
    GroupLimitedRouter,
    MoE,
    RoutedExpertsMLPOpsConfig,
    RouterSinkhorn,
    RouterTopK,
    SharedExperts,
)

T, E, K, H = 5, 4, 2, 16


@pytest.fixture(scope="module")
def experts():
    return make_experts(make_config(num_experts=E, top_k=K, hidden_size=H))


@pytest.fixture(scope="module")
def inputs():
    affinities, expert_index = random_routing(T, E, K, seed=0)
    return randn(T, H, seed=1), affinities, expert_index


@pytest.fixture(scope="module")
def moe():
    experts = make_experts(make_config(num_experts=E, top_k=K, hidden_size=H))
    return MoE(make_router("topk_softmax", E, K, H), experts, make_shared(H)).eval()


# ----------------------------------------------------------------------------------------------------------
# ExpertMLPsV2 forward arguments


EXPERT_CASES = {
    # name: (function of (x, affinities, expert_index) -> call args, error type, regex)
    "hidden_states_1d": (lambda x, a, i: (x[0], a, i), ValueError, "hidden_states"),
    "hidden_states_3d": (lambda x, a, i: (x[None], a, i), ValueError, "hidden_states"),
    "hidden_states_wrong_width": (lambda x, a, i: (x[:, :15], a, i), ValueError, "hidden_states.*16"),
    "hidden_states_no_tokens": (lambda x, a, i: (x[:0], a[:0], i[:0]), ValueError, "hidden_states"),
    "hidden_states_integer": (lambda x, a, i: (x.long(), a, i), TypeError, "hidden_states"),
    "hidden_states_not_tensor": (lambda x, a, i: (x.tolist(), a, i), TypeError, "hidden_states"),
    "hidden_states_dtype_vs_weights": (lambda x, a, i: (x.double(), a, i), TypeError, "hidden_states.*float64"),
    "hidden_states_bf16_vs_weights": (lambda x, a, i: (x.bfloat16(), a, i), TypeError, "hidden_states.*bfloat16"),
    "affinities_wrong_experts": (lambda x, a, i: (x, a[:, :3], i), ValueError, "expert_affinities"),
    "affinities_wrong_tokens": (lambda x, a, i: (x, a[:4], i), ValueError, "expert_affinities"),
    "affinities_integer": (lambda x, a, i: (x, (a > 0.2).long(), i), TypeError, "expert_affinities"),
    "affinities_not_tensor": (lambda x, a, i: (x, a.tolist(), i), TypeError, "expert_affinities"),
    "index_float": (lambda x, a, i: (x, a, i.float()), TypeError, "expert_index"),
    "index_bool": (lambda x, a, i: (x, a, i.bool()), TypeError, "expert_index"),
    "index_not_tensor": (lambda x, a, i: (x, a, i.tolist()), TypeError, "expert_index"),
    "index_wrong_k": (lambda x, a, i: (x, a, i[:, :1]), ValueError, "expert_index"),
    "index_wrong_tokens": (lambda x, a, i: (x, a, i[:3]), ValueError, "expert_index"),
    "index_1d": (lambda x, a, i: (x, a, i[:, 0]), ValueError, "expert_index"),
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_expert_mlps_rejects(experts, inputs, case):
    build, error, pattern = EXPERT_CASES[case]
    with pytest.raises(error, match=pattern):
        experts(*build(*inputs))


@pytest.mark.parametrize(
    "padding_mask, error, pattern",
    [
        (torch.ones(4), ValueError, "padding_mask"),
        (torch.ones(T, 2), ValueError, "padding_mask"),
        ([1] * T, (TypeError, ValueError), "padding_mask"),
        (torch.ones(T, dtype=torch.complex64), TypeError, "padding_mask"),
    ],
    ids=["too_short", "too_long", "list", "complex"],
)
def test_expert_mlps_rejects_padding_mask(experts, inputs, padding_mask, error, pattern):
    with pytest.raises(error, match=pattern):
        experts(*inputs, padding_mask=padding_mask)


def test_expert_mlps_rejects_seq_len_and_mode(experts, inputs):
    with pytest.raises(ValueError, match="seq_len"):
        experts(*inputs, seq_len=0)
    with pytest.raises(TypeError, match="seq_len"):
        experts(*inputs, seq_len=1.0)
    with pytest.raises(ValueError, match="mode"):
        experts(*inputs, mode="sparse")


def test_padding_mask_dtypes_accepted(experts, inputs):
    x, a, i = inputs
    reference = experts(x, a, i, padding_mask=torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool))
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.float32):
        out = experts(x, a, i, padding_mask=torch.tensor([1, 0, 1, 1, 0], dtype=dtype))
        assert torch.equal(out, reference)
    # a (B, S) mask works too
    assert torch.equal(experts(x, a, i, padding_mask=torch.tensor([[1, 0, 1, 1, 0]])), reference)


# ----------------------------------------------------------------------------------------------------------
# configuration


def cfg_kwargs(**overrides):
    kwargs = dict(num_experts=4, hidden_size=16, intermediate_size=8, top_k=2, hidden_act="silu", glu_mlp=True)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize(
    "overrides, error, pattern",
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(num_experts=0, top_k=1), ValueError, "num_experts"),
        (dict(hidden_size=0), ValueError, "hidden_size"),
        (dict(intermediate_size=-3), ValueError, "intermediate_size"),
        (dict(capacity_factor=0), ValueError, "capacity_factor"),
        (dict(capacity_factor=-0.5), ValueError, "capacity_factor"),
        (dict(capacity_factor=math.nan), ValueError, "capacity_factor"),
        (dict(capacity_factor=math.inf), ValueError, "capacity_factor"),
        (dict(capacity_factor="1.0"), TypeError, "capacity_factor"),
        (dict(selective_loading_threshold=0.0), ValueError, "selective_loading_threshold"),
        (dict(selective_loading_threshold=math.nan), ValueError, "selective_loading_threshold"),
        (dict(hidden_act="swiglu"), ValueError, "hidden_act.*glu_type='swiglu'.*sigmoid.*1.702"),
        (dict(hidden_act="quick_gelu"), ValueError, "hidden_act"),
        (dict(glu_type="swiglu", glu_mlp=False), ValueError, "glu_type.*glu_mlp"),
        (dict(glu_type="geglu"), ValueError, "glu_type"),
        (dict(gate_clamp_lower_limit=1.0, gate_clamp_upper_limit=0.5), ValueError, "gate_clamp_lower_limit"),
        (dict(up_clamp_lower_limit=7.0, up_clamp_upper_limit=-7.0), ValueError, "up_clamp_lower_limit"),
        (dict(up_clamp_upper_limit=math.inf), ValueError, "up_clamp_upper_limit"),
        (dict(glu_mlp=False, up_clamp_upper_limit=1.0), ValueError, "clamp.*glu_mlp"),
        (dict(hidden_act_scaling_factor=math.nan), ValueError, "hidden_act_scaling_factor"),
        (dict(hidden_act_bias=math.inf), ValueError, "hidden_act_bias"),
        (dict(hidden_size_actual=17), ValueError, "hidden_size_actual"),
        (dict(intermediate_size_actual=0), ValueError, "intermediate_size_actual"),
        (dict(glu_mlp=1), TypeError, "glu_mlp"),
        (dict(bias="yes"), TypeError, "bias"),
        (dict(normalize_top_k_affinities=None), TypeError, "normalize_top_k_affinities"),
        (dict(early_expert_affinity_modulation=0), TypeError, "early_expert_affinity_modulation"),
        (dict(input_layer_init_method=3), TypeError, "input_layer_init_method"),
    ],
)
def test_routed_experts_config_rejects(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        RoutedExpertsMLPOpsConfig(**cfg_kwargs(**overrides))


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=-4), ValueError, "block_size"),
        (dict(block_size=4.0), TypeError, "block_size"),
        (dict(logical_nc_config=3), ValueError, "logical_nc_config"),
        (dict(logical_nc_config=0), ValueError, "logical_nc_config"),
        (dict(use_shard_on_intermediate_dynamic_while=True, use_shard_on_block_dynamic_while=True), ValueError,
         "use_shard_on_intermediate_dynamic_while.*use_shard_on_block_dynamic_while.*mutually exclusive"),
        (dict(block_sharding_strategy="ZIG_ZAG"), ValueError, "block_sharding_strategy"),
        (dict(num_static_blocks=-1), ValueError, "num_static_blocks"),
        (dict(skip_dma_token="true"), TypeError, "skip_dma_token"),
    ],
)
def test_blockwise_config_rejects(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        BlockwiseMatmulConfig(**kwargs)
    with pytest.raises(error, match=pattern):
        BlockwiseMatmulConfig.from_kwargs(**kwargs)


def test_blockwise_from_kwargs_names_unknown_key():
    with pytest.raises(TypeError, match="early_expert_affinity_modulation"):
        BlockwiseMatmulConfig.from_kwargs(block_size=256, early_expert_affinity_modulation=True)
    with pytest.raises(TypeError, match="blok_size"):
        BlockwiseMatmulConfig.from_kwargs(blok_size=256)


def test_logical_nc_config_env(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert BlockwiseMatmulConfig().logical_nc_config == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG"):
        BlockwiseMatmulConfig()


def test_expert_mlps_constructor_rejects():
    with pytest.raises(TypeError, match="routed_experts_mlp_config"):
        ExpertMLPsV2(dict(num_experts=4))
    with pytest.raises(TypeError, match="blockwise_matmul_config"):
        ExpertMLPsV2(make_config(), dict(block_size=4))
    with pytest.raises(TypeError, match="dtype"):
        ExpertMLPsV2(make_config(), dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):
        ExpertMLPsV2(make_config(), backend="nki")


# ----------------------------------------------------------------------------------------------------------
# routers and MoE construction


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: RouterTopK(8, 0, 16), ValueError, "top_k"),
        (lambda: RouterTopK(8, 9, 16), ValueError, "top_k"),
        (lambda: RouterTopK(8, 2, 16, act_fn="relu"), ValueError, "act_fn"),
        (lambda: RouterTopK(8, 2, 16, jitter_eps=1.5), ValueError, "jitter_eps"),
        (lambda: RouterTopK(8, 2, 16, dtype=torch.int8), TypeError, "dtype"),
        (lambda: GroupLimitedRouter(8, 2, 16, n_group=3, topk_group=1), ValueError, "n_group.*divide"),
        (lambda: GroupLimitedRouter(8, 2, 16, n_group=16, topk_group=1), ValueError, "n_group"),
        (lambda: GroupLimitedRouter(8, 2, 16, n_group=4, topk_group=5), ValueError, "topk_group"),
        (lambda: GroupLimitedRouter(8, 2, 16, n_group=4, topk_group=0), ValueError, "topk_group"),
        (lambda: GroupLimitedRouter(8, 5, 16, n_group=4, topk_group=2), ValueError, "top_k"),
        (lambda: GroupLimitedRouter(8, 2, 16, n_group=4, topk_group=2, routed_scaling_factor=0.0), ValueError,
         "routed_scaling_factor"),
        (lambda: RouterSinkhorn(8, 2, 16), ValueError, "top_k"),
        (lambda: RouterSinkhorn(8, 1, 16, sinkhorn_iterations=0), ValueError, "sinkhorn_iterations"),
    ],
)
def test_router_constructors_reject(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


def test_router_forward_rejects():
    router = RouterTopK(4, 2, 16)
    with pytest.raises(ValueError, match="hidden_states"):
        router(torch.randn(3, 12))
    with pytest.raises(TypeError, match="hidden_states"):
        router(torch.ones(3, 16, dtype=torch.long))


def test_moe_constructor_rejects_inconsistent_parts():
    experts = make_experts(make_config(num_experts=4, top_k=2, hidden_size=16))
    with pytest.raises(ValueError, match="num_experts"):
        MoE(RouterTopK(5, 2, 16), experts)
    with pytest.raises(ValueError, match="top_k"):
        MoE(RouterTopK(4, 1, 16), experts)
    with pytest.raises(ValueError, match="hidden_size"):
        MoE(RouterTopK(4, 2, 12), experts)
    with pytest.raises(ValueError, match="hidden_size.*shared_experts"):
        MoE(RouterTopK(4, 2, 16), experts, SharedExperts(12, 8, 1, "silu"))
    with pytest.raises(TypeError, match="router"):
        MoE(torch.nn.Linear(16, 4), experts)
    with pytest.raises(TypeError, match="expert_mlps"):
        MoE(RouterTopK(4, 2, 16), torch.nn.Linear(16, 16))
    with pytest.raises(TypeError, match="shared_experts"):
        MoE(RouterTopK(4, 2, 16), experts, torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="sequence_parallel"):
        MoE(RouterTopK(4, 2, 16, sequence_parallel_enabled=True), experts)


def test_shared_experts_constructor_rejects():
    with pytest.raises(ValueError, match="num_shared_experts"):
        SharedExperts(16, 8, 0, "silu")
    with pytest.raises(ValueError, match="hidden_act"):
        SharedExperts(16, 8, 1, "swiglu")
    with pytest.raises(ValueError, match="hidden_states"):
        make_shared(16)(torch.randn(2, 8))


MOE_CASES = {
    "hidden_states_2d": (lambda x: dict(hidden_states=x[0]), ValueError, "hidden_states.*\\(B, S, H\\)"),
    "hidden_states_width": (lambda x: dict(hidden_states=x[..., :8]), ValueError, "hidden_states"),
    "hidden_states_empty": (lambda x: dict(hidden_states=x[:, :0]), ValueError, "hidden_states"),
    "hidden_states_integer": (lambda x: dict(hidden_states=x.long()), TypeError, "hidden_states"),
    "hidden_states_dtype_vs_weights": (lambda x: dict(hidden_states=x.double()), TypeError, "hidden_states"),
    "padding_mask_shape": (lambda x: dict(hidden_states=x, padding_mask=torch.ones(6)), ValueError, "padding_mask"),
    "padding_mask_transposed": (lambda x: dict(hidden_states=x, padding_mask=torch.ones(3, 2)), ValueError,
                                "padding_mask"),
    "padding_mask_complex": (lambda x: dict(hidden_states=x, padding_mask=torch.ones(2, 3, dtype=torch.complex64)),
                             TypeError, "padding_mask"),
    "residual_shape": (lambda x: dict(hidden_states=x, residual=torch.zeros(6, 16)), ValueError, "residual"),
    "residual_not_tensor": (lambda x: dict(hidden_states=x, residual=0.0), ValueError, "residual"),
    "residual_dtype": (lambda x: dict(hidden_states=x, residual=torch.zeros(2, 3, 16, dtype=torch.float64)),
                       TypeError, "residual"),
    "residual_integer": (lambda x: dict(hidden_states=x, residual=torch.zeros(2, 3, 16, dtype=torch.long)),
                         TypeError, "residual"),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_forward_rejects(moe, case):
    build, error, pattern = MOE_CASES[case]
    with pytest.raises(error, match=pattern):
        moe(**build(randn(2, 3, 16, seed=2)))


# ----------------------------------------------------------------------------------------------------------
# non-finite weights on load


def _poison(state_dict, key, value):
    state_dict = {k: v.clone() for k, v in state_dict.items()}
    state_dict[key].view(-1)[0] = value
    return state_dict


def _modules_and_keys():
    glu = make_experts(make_config(bias=True))
    plain = make_experts(make_config(activation="mlp_relu", bias=True))
    group = make_router("group_limited", 8, 2, 16)
    topk = make_router("topk_act_over_topk", 8, 2, 16)
    fused = make_shared(16, 8, 2, fused_gate_up_projection=True, shared_expert_gate=True)
    unfused = make_shared(16, 8, 1, transpose_weights=True)
    moe = MoE(make_router("topk_softmax", 4, 2, 16), make_experts(make_config(bias=True)), make_shared(16))
    return [
        ("router", topk, ["linear_router.weight", "linear_router.bias"]),
        ("group_router", group, ["linear_router.weight", "e_score_correction_bias"]),
        ("experts_glu", glu, ["mlp_op.gate_up_proj.weight", "mlp_op.gate_up_proj.bias", "mlp_op.down_proj.weight",
                              "mlp_op.down_proj.bias"]),
        ("experts_plain", plain, ["mlp_op.up_proj.weight", "mlp_op.up_proj.bias"]),
        ("shared_fused", fused, ["gate_up_proj.weight", "down_proj.weight", "shared_expert_gate.weight"]),
        ("shared_unfused", unfused, ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]),
        ("moe", moe, ["router.linear_router.weight", "expert_mlps.mlp_op.gate_up_proj.weight",
                      "expert_mlps.mlp_op.down_proj.bias", "shared_experts.up_proj.weight",
                      "shared_experts.down_proj.weight"]),
    ]


LOAD_CASES = [(name, key, value) for name, _, keys in _modules_and_keys() for key in keys
              for value in (math.nan, math.inf, -math.inf)]


@pytest.mark.parametrize("name, key, value", LOAD_CASES)
def test_load_state_dict_rejects_non_finite_weights(name, key, value):
    module = {n: m for n, m, _ in _modules_and_keys()}[name]
    good = module.state_dict()
    before = {k: v.clone() for k, v in good.items()}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        module.load_state_dict(_poison(good, key, value))
    module.load_state_dict(before)  # finite weights load fine
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k])


def test_load_state_dict_checks_moe_rmsnorm():
    moe = MoE(make_router("topk_softmax", 4, 2, 16), make_experts(make_config()), rmsnorm=torch.nn.RMSNorm(16))
    with pytest.raises(ValueError, match=r"rmsnorm\.weight"):
        moe.load_state_dict(_poison(moe.state_dict(), "rmsnorm.weight", math.nan))


# ----------------------------------------------------------------------------------------------------------
# validate_inputs=True: value checks


def test_validate_inputs_catches_bad_values(inputs):
    experts = make_experts(make_config(num_experts=E, top_k=K), validate_inputs=True)
    x, a, i = inputs
    for value in (math.nan, math.inf, -math.inf):
        bad = x.clone()
        bad[2, 3] = value
        with pytest.raises(ValueError, match="hidden_states.*NaN/Inf"):
            experts(bad, a, i)
    bad = a.clone()
    bad[1, 0] = math.nan
    with pytest.raises(ValueError, match="expert_affinities.*NaN"):
        experts(x, bad, i)
    for bad_index, pattern in ((torch.tensor([[0, 4]] * T), "expert_index.*range"),
                               (torch.tensor([[-1, 0]] * T), "expert_index.*range"),
                               (torch.tensor([[0, 1]] * (T - 1) + [[2, 2]]), "expert_index.*twice")):
        with pytest.raises(ValueError, match=pattern):
            experts(x, a, bad_index)
    # and the good inputs pass
    experts(x, a, i)


@pytest.mark.parametrize("backend", ["torch", "nki_sim", "triton"])
@pytest.mark.parametrize("bad", [E, -1, E + 5])
def test_expert_index_out_of_range_is_named_by_default(inputs, backend, bad):
    """Without validate_inputs an id outside [0, E) is still an error (an asynchronous assert, no host sync),
    not a token silently routed nowhere."""
    if backend == "triton":  # on a GPU machine the assert is asynchronous: tests/gpu/test_parallel_graphs.py
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the triton backend runs CPU tensors only under the interpreter (CPU-only machines)")
    experts = randomize_(ExpertMLPsV2(make_config(num_experts=E, top_k=K), BlockwiseMatmulConfig(block_size=4),
                                      backend=backend), seed=0)
    x, a, i = inputs
    bad_index = i.clone()
    bad_index[3, 1] = bad
    with pytest.raises(RuntimeError, match=rf"ExpertMLPsV2: expert_index values must be in \[0, {E - 1}\]"):
        experts(x, a, bad_index)
    experts(x, a, i)


def _package_of(path) -> list[str]:
    """The dotted package a Python file is in: its folders up to the first without an ``__init__.py``."""
    parts, folder = [], path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return parts


def imported_modules(paths) -> list[tuple[str, str]]:
    """``(file name, module)`` of every import statement in the Python files ``paths``. ``from a.b import c`` yields
    both ``a.b`` and ``a.b.c`` (``c`` may be a submodule); relative imports are resolved against the file's package."""
    import ast

    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = _package_of(path)
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [(path.name, n) for n in names]
    return found


def importing(paths, packages: tuple[str, ...]) -> list[str]:
    return [f"{file}: {name}" for file, name in imported_modules(paths)
            if any(name == p or name.startswith(p + ".") for p in packages)]


def test_experts_do_not_import_the_parallel_layer():
    """The experts compute on the rows they are given; moving tokens between ranks is nxd_moe.parallel's job, so
    the arrows point one way: parallel -> experts, never back."""
    from pathlib import Path

    import nxd_moe.experts

    offenders = importing(Path(nxd_moe.experts.__file__).parent.glob("*.py"), ("nxd_moe.parallel",))
    assert not offenders, offenders


# The integration layers above the MoE layer, and the tools that drive them (tracing/decoder_command.py traces whole
# transformers decoders): they may import transformers and each other; nothing below them may.
INTEGRATION_MODULES = ("hf/", "nxdi.py", "models/", "application/", "nxd_compat/", "tracing/decoder_command.py")


def test_core_does_not_import_transformers_or_the_model_layer():
    """experts <- parallel <- moe.py <- models <- nxd_compat: core (experts, routing, parallel, the layer, kernels,
    tracing, CLI) never imports transformers or the integration layers above it."""
    from pathlib import Path

    import nxd_moe

    root = Path(nxd_moe.__file__).parent
    core = [p for p in root.rglob("*.py") if not p.relative_to(root).as_posix().startswith(INTEGRATION_MODULES)]
    forbidden = ("transformers", "nxd_moe.models", "nxd_moe.hf", "nxd_moe.nxd_compat", "nxd_moe.nxdi")
    assert not importing(core, forbidden), importing(core, forbidden)
    assert importing([root / "models" / "patch.py"], forbidden)  # the scan sees what the model layer imports


def test_hf_modules_do_not_import_the_model_layer():
    """nxd_moe.models builds on nxd_moe.hf's modules and imports them directly, never the facade
    (``nxd_moe/hf/__init__.py``); they import neither it nor nxd_moe.models back. The facade alone reaches up, to
    re-export patch_model and the experts interface."""
    from pathlib import Path

    import nxd_moe.hf

    root = Path(nxd_moe.hf.__file__).parent
    modules = sorted(p for p in root.glob("*.py") if p.name != "__init__.py")
    assert len(modules) >= 5
    below_and_above = modules + sorted((root.parent / "models").glob("*.py"))
    facade = [f"{file}: {name}" for file, name in imported_modules(below_and_above) if name == "nxd_moe.hf"]
    assert not facade, facade
    upward = importing(modules, ("nxd_moe.models",))
    assert not upward, upward
    assert importing([root / "__init__.py"], ("nxd_moe.models",))  # the scan sees the facade's upward edge


def instruction_layering_offenders(kernels_dir) -> list[str]:
    """Imports that break the rule for the simulator's instructions: ``nki_kernels/instructions/*.py`` are leaves
    (neither ``isa`` nor the ``instructions`` package or a sibling) and ``instruction_support.py``, which they and
    ``isa`` share, imports neither; ``isa`` alone gathers them into ``nki.isa``."""
    leaves = sorted((kernels_dir / "instructions").glob("*.py")) + [kernels_dir / "instruction_support.py"]
    return importing(leaves, ("nxd_moe.nki_kernels.isa", "nxd_moe.nki_kernels.instructions"))


def test_instruction_modules_are_leaves():
    from pathlib import Path

    import nxd_moe.nki_kernels

    kernels_dir = Path(nxd_moe.nki_kernels.__file__).parent
    assert len(list((kernels_dir / "instructions").glob("*.py"))) >= 7  # __init__ and the six families
    offenders = instruction_layering_offenders(kernels_dir)
    assert not offenders, offenders


@pytest.mark.parametrize("statement", ["from nxd_moe.nki_kernels import isa", "import nxd_moe.nki_kernels.isa",
                                       "from nxd_moe.nki_kernels.isa import _tile",
                                       "from nxd_moe.nki_kernels.instructions.scan import _scan",
                                       "from .scan import _scan", "from . import scan", "from .. import isa"])
def test_instruction_layering_rejects_an_upward_or_sibling_import(tmp_path, statement):
    """Negative control: each way of importing isa or a sibling, planted in a copy of the layout, is reported."""
    kernels_dir = tmp_path / "nxd_moe" / "nki_kernels"
    (kernels_dir / "instructions").mkdir(parents=True)
    for package in (tmp_path / "nxd_moe", kernels_dir, kernels_dir / "instructions"):
        (package / "__init__.py").write_text("")
    (kernels_dir / "instruction_support.py").write_text("import numpy as np\n")
    (kernels_dir / "instructions" / "gather.py").write_text(
        "from nxd_moe.nki_kernels import language as nl\nfrom nxd_moe.nki_kernels.instruction_support import _tile\n")
    assert instruction_layering_offenders(kernels_dir) == []
    (kernels_dir / "instructions" / "gather.py").write_text(statement + "\n")
    assert instruction_layering_offenders(kernels_dir), statement


def test_check_finite_counts_exactly():
    """Finite values whose sum overflows are fine; each NaN and Inf is counted, in every slice of a large tensor."""
    from nxd_moe.validation import check_finite

    check_finite(torch.full((4,), 3e38), "big")
    large = torch.zeros(3, 1 << 25)  # two slices of 2^26 elements at most
    large[0, 0], large[2, 5], large[2, 6] = math.nan, math.inf, -math.inf
    with pytest.raises(ValueError, match=r"large contains 3 NaN/Inf value\(s\)"):
        check_finite(large, "large")
    with pytest.raises(ValueError, match=r"fp8 contains 1 NaN/Inf"):
        check_finite(torch.tensor([1.0, math.nan]).to(torch.float8_e4m3fn), "fp8")


def test_moe_validate_inputs():
    moe = MoE(make_router("topk_softmax", E, K, H), make_experts(make_config(num_experts=E, top_k=K)),
              validate_inputs=True).eval()
    x = randn(2, 3, H, seed=3)
    moe(x)
    bad = x.clone()
    bad[1, 2, 0] = math.nan
    with pytest.raises(ValueError, match="hidden_states.*NaN/Inf"):
        moe(bad)
    with pytest.raises(ValueError, match="hidden_states.*NaN/Inf"):
        moe(x, residual=torch.full_like(x, math.inf))
    with torch.no_grad():
        moe.router.linear_router.weight[0, 0] = math.nan  # bypasses load_state_dict on purpose
    with pytest.raises(ValueError, match="expert_affinities.*NaN"):
        moe(x)


# ----------------------------------------------------------------------------------------------------------
# without validate_inputs: a non-finite token stays in its own row


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("matmul", ["gather", "grouped_mm"])
@pytest.mark.parametrize("prescale", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_token_does_not_leak(mode, prescale, matmul, value):
    num_tokens, bad_token = 12, 5
    cfg = make_config(num_experts=4, top_k=2, capacity_factor=1.5, bias=True,
                      early_expert_affinity_modulation=prescale, normalize_top_k_affinities=True)
    experts = make_experts(cfg, block_size=4, matmul=matmul, seed=4)
    x = randn(num_tokens, 16, seed=5)
    affinities, expert_index = random_routing(num_tokens, 4, 2, seed=6)
    expert_index[:, 0] = 1  # every token shares expert 1 (and its blocks) with the bad token
    expert_index[:, 1] = torch.where(torch.arange(num_tokens) % 2 == 0, 0, 3)
    clean = experts(x, affinities, expert_index, mode=mode)
    bad_x = x.clone()
    bad_x[bad_token, 7] = value
    out = experts(bad_x, affinities, expert_index, mode=mode)
    others = torch.arange(num_tokens) != bad_token
    assert torch.isfinite(out[others]).all()
    assert_close(out[others], clean[others], FP32_ATOL)
    # the same for a NaN affinity on the bad token
    bad_a = affinities.clone()
    bad_a[bad_token] = value
    out = experts(x, bad_a, expert_index, mode=mode)
    assert torch.isfinite(out[others]).all()
    assert_close(out[others], clean[others], FP32_ATOL)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("shape", [(1, 1), (8, 1), (2, 3), (2, 12)], ids=lambda s: f"B{s[0]}xS{s[1]}")
@pytest.mark.parametrize("router_kind", ROUTER_KINDS)
def test_non_finite_token_does_not_leak_through_moe(router_kind, shape, value):
    """Router, experts (mode chosen by shape) and shared experts together, with a padded token too."""
    top_k = router_top_k(router_kind, 2)
    experts = make_experts(make_config(num_experts=8, top_k=top_k), block_size=4, seed=7)
    moe = MoE(make_router(router_kind, 8, top_k, 16, seed=8), experts, make_shared(16)).eval()
    x = randn(*shape, 16, seed=9)
    mask = torch.ones(shape, dtype=torch.bool)
    mask.view(-1)[-1] = False
    clean, stats = moe(x, padding_mask=mask, return_stats=True)
    bad = x.clone()
    bad.view(-1, 16)[0, 3] = value
    if bad.numel() // 16 == 1:
        out, _ = moe(bad, return_stats=True)
        assert not torch.isfinite(out).all()  # the only token is the bad one: nothing else to protect
        return
    out, _ = moe(bad, padding_mask=mask, return_stats=True)
    rows = out.view(-1, 16)[1:]
    assert torch.isfinite(rows).all(), stats.mode
    assert_close(rows, clean.view(-1, 16)[1:], FP32_ATOL)
