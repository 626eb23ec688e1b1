"""``nxd_moe.hf`` checkpoint conversion: whole transformers state dicts to nxd layout and back.

Checkpoints come from small random transformers models: their in-memory ``state_dict()`` and, for the Hub layout,
what transformers' own ``save_pretrained`` writes (it undoes its load-time conversion, e.g. splitting
``experts.gate_up_proj`` into per-expert ``gate_proj``/``up_proj``). Correctness is judged against transformers:
exact round trips, converted layers that reproduce the transformers block's output, and converted-back weights
that transformers' strict ``load_state_dict`` accepts and computes the same function with.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_helpers import MODELS, assert_parity, inputs, one_intra_op_thread, randomize_hf_  # noqa: E402,F401 (autouse fixture)
from transformers import MixtralConfig  # noqa: E402

from nxd_moe import build_moe  # noqa: E402
from nxd_moe.hf import from_hf_config, hf_to_nxd_state_dict, load_hf_layer, nxd_to_hf_state_dict  # noqa: E402


class Checkpoint:
    """A random transformers model of one type, its in-memory state dict and its Hub (``save_pretrained``) one."""

    def __init__(self, name: str, directory):
        tiny = MODELS[name]
        layers, block_attr, self.moe_layers, self.hub_differs = (tiny.layers, tiny.block_attr, tiny.moe_layers,
                                                                 tiny.hub_differs)
        self.name = name
        self.model = randomize_hf_(tiny.make(), seed=0)
        self.config = self.model.config
        self.memory = self.model.state_dict()
        self.model.save_pretrained(directory)
        self.hub = safetensors_torch.load_file(str(directory / "model.safetensors"))
        self.layers = self.model.get_submodule(layers)
        self.block_attr = block_attr
        self.prefix = {i: f"{layers}.{i}.{block_attr}." for i in range(len(self.layers))}

    def block(self, layer: int) -> torch.nn.Module:
        return getattr(self.layers[layer], self.block_attr)

    def block_output(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.block(layer)(x)
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)

    def outline(self, state_dict) -> list[str]:
        """The keys in order, each MoE block's run of keys collapsed into its layer's prefix."""
        out: list[str] = []
        for key in state_dict:
            block = next((self.prefix[i] for i in self.moe_layers if key.startswith(self.prefix[i])), key)
            if not out or out[-1] != block:
                out.append(block)
        return out

    def moe_keys(self, state_dict) -> set[str]:
        """Keys of ``state_dict`` inside the transformers MoE blocks (by module path, Hub renames included)."""
        prefixes = tuple(self.prefix[i] for i in self.moe_layers)
        hub_prefixes = tuple(p.replace(".mlp.", ".block_sparse_moe.") for p in prefixes) if self.name == "mixtral" \
            else ()
        return {k for k in state_dict if k.startswith(prefixes + hub_prefixes)}


_CACHE: dict[str, Checkpoint] = {}


def checkpoint(name: str, tmp_path_factory) -> Checkpoint:
    """One checkpoint per model type for the whole session (the tests only read it)."""
    if name not in _CACHE:
        _CACHE[name] = Checkpoint(name, tmp_path_factory.mktemp(name))
    return _CACHE[name]


@pytest.fixture(params=list(MODELS))
def ckpt(request, tmp_path_factory) -> Checkpoint:
    return checkpoint(request.param, tmp_path_factory)



def assert_same_state_dict(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected), (
        f"missing {sorted(set(expected) - set(actual))[:5]}, unexpected {sorted(set(actual) - set(expected))[:5]}")
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key



def nxd_block(nxd: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in nxd.items() if k.startswith(prefix)}


# ----------------------------------------------------------------------------------------------


def test_hub_layout_is_what_transformers_writes(ckpt):
    """The premise of the layout tests: transformers splits the fused experts on save exactly for these types."""
    moe_hub = ckpt.moe_keys(ckpt.hub)
    per_expert = [k for k in moe_hub if ".experts.0." in k]
    assert bool(per_expert) == ckpt.hub_differs
    if not ckpt.hub_differs:
        assert set(ckpt.hub) == set(ckpt.memory)


def test_transformers_layout_round_trip_is_exact(ckpt):
    nxd = hf_to_nxd_state_dict(ckpt.memory, ckpt.config)
    moe_keys = ckpt.moe_keys(ckpt.memory)
    assert moe_keys
    for key, value in ckpt.memory.items():
        if key not in moe_keys:
            assert nxd[key] is value, f"{key} did not pass through"
    back = nxd_to_hf_state_dict(nxd, ckpt.config)
    assert_same_state_dict(back, ckpt.memory)
    # Each block stays where it was among the other keys (the order inside a block is the converter's).
    assert ckpt.outline(back) == ckpt.outline(nxd) == ckpt.outline(ckpt.memory)


def test_hub_layout_converts_like_the_transformers_layout(ckpt):
    from_memory = hf_to_nxd_state_dict(ckpt.memory, ckpt.config)
    from_hub = hf_to_nxd_state_dict(ckpt.hub, ckpt.config)
    moe = {k for k in from_memory if any(k.startswith(ckpt.prefix[i]) for i in ckpt.moe_layers)}
    assert moe == {k for k in from_hub if any(k.startswith(ckpt.prefix[i]) for i in ckpt.moe_layers)}
    assert_same_state_dict({k: from_hub[k] for k in moe}, {k: from_memory[k] for k in moe})
    assert_same_state_dict(nxd_to_hf_state_dict(from_hub, ckpt.config, layout="hub"), ckpt.hub)


@pytest.mark.parametrize("source", ["memory", "hub"])
def test_converted_layer_reproduces_the_transformers_block(ckpt, source):
    state_dict = getattr(ckpt, source)
    nxd = hf_to_nxd_state_dict(state_dict, ckpt.config)
    cfg = from_hf_config(ckpt.config)
    x = inputs(2, 24)
    for layer in ckpt.moe_layers:
        ref = ckpt.block_output(layer, x)
        moe = build_moe(cfg, block_size=8)
        moe.load_state_dict(nxd_block(nxd, ckpt.prefix[layer]), strict=True)
        assert_parity(moe(x)[0], ref)
        loaded = load_hf_layer(build_moe(cfg, block_size=8), state_dict, ckpt.config, layer)
        assert_parity(loaded(x)[0], ref)


def test_nxd_weights_convert_into_a_transformers_model(ckpt):
    """Random nxd weights -> transformers layout -> strict load into the HF model -> same function."""
    cfg = from_hf_config(ckpt.config)
    layer = ckpt.moe_layers[-1]
    moe = randomize_hf_(build_moe(cfg, block_size=8), seed=3)
    nxd = hf_to_nxd_state_dict(ckpt.memory, ckpt.config)
    nxd.update({ckpt.prefix[layer] + k: v for k, v in moe.state_dict().items()})
    model = MODELS[ckpt.name].make()
    model.load_state_dict(nxd_to_hf_state_dict(nxd, ckpt.config), strict=True)
    x = inputs(2, 24, seed=2)
    with torch.no_grad():
        ref = getattr(model.get_submodule(MODELS[ckpt.name].layers)[layer], ckpt.block_attr)(x)
    ref = (ref[0] if isinstance(ref, tuple) else ref).reshape(x.shape)
    with torch.no_grad():
        assert_parity(moe(x)[0], ref)


def test_dense_layers_pass_through(ckpt):
    nxd = hf_to_nxd_state_dict(ckpt.hub, ckpt.config)
    for layer in set(range(len(ckpt.layers))) - set(ckpt.moe_layers):
        dense = [k for k in ckpt.hub if k.startswith(ckpt.prefix[layer])]
        assert dense and all(nxd[k] is ckpt.hub[k] for k in dense)
        assert not any(k.startswith(ckpt.prefix[layer] + p) for k in nxd
                       for p in ("router.", "expert_mlps.", "shared_experts."))
        with pytest.raises(ValueError, match=f"layer {layer} has no MoE weights"):
            load_hf_layer(build_moe(from_hf_config(ckpt.config)), ckpt.hub, ckpt.config, layer)


@pytest.mark.parametrize("source", ["memory", "hub"])
def test_nxd_keys_are_the_moe_state_dict(ckpt, source):
    """Under each MoE block there is exactly our MoE's state dict: no HF key is left behind."""
    nxd = hf_to_nxd_state_dict(getattr(ckpt, source), ckpt.config)
    expected = set(build_moe(from_hf_config(ckpt.config), device="meta").state_dict())
    for layer in ckpt.moe_layers:
        assert set(nxd_block(nxd, ckpt.prefix[layer])) == expected


# ----------------------------------------------------------------------------------------------
# specific layouts and errors


@pytest.fixture
def mixtral(tmp_path_factory) -> Checkpoint:
    return checkpoint("mixtral", tmp_path_factory)


def test_mixtral_hub_block_is_renamed_to_mlp(mixtral):
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral.hub
    nxd = hf_to_nxd_state_dict(mixtral.hub, mixtral.config)
    assert "model.layers.0.mlp.router.linear_router.weight" in nxd
    assert not any("block_sparse_moe" in k for k in nxd)


def test_nested_module_path_converts(tmp_path_factory):
    """Llama 4's multimodal model nests the text model (``language_model.model.layers...``)."""
    ckpt = checkpoint("llama4_text", tmp_path_factory)
    nested = {f"language_model.{k}": v for k, v in ckpt.memory.items()}
    nxd = hf_to_nxd_state_dict(nested, ckpt.config)
    assert "language_model.model.layers.1.feed_forward.router.linear_router.weight" in nxd
    assert "language_model.model.layers.0.feed_forward.gate_proj.weight" in nxd
    assert_same_state_dict(nxd_to_hf_state_dict(nxd, ckpt.config), nested)


def test_missing_expert_is_named(mixtral):
    hub = dict(mixtral.hub)
    del hub["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    with pytest.raises(ValueError, match=r"missing 'model\.layers\.1\.block_sparse_moe\.experts\.5\.w2\.weight'"):
        hf_to_nxd_state_dict(hub, mixtral.config)


def test_unknown_key_inside_an_moe_block_is_rejected(tmp_path_factory):
    ckpt = checkpoint("gpt_oss", tmp_path_factory)
    extra = dict(ckpt.memory)  # (MXFP4 *_blocks / *_scales are known: tests/test_quantization.py)
    extra["model.layers.0.mlp.experts.gate_up_proj_lora"] = torch.zeros(8, 48, 16)
    with pytest.raises(ValueError, match=r"unexpected '.*\.experts\.gate_up_proj_lora'.*not converted"):
        hf_to_nxd_state_dict(extra, ckpt.config)


def test_shape_mismatch_is_named(mixtral):
    wider = MixtralConfig(**{**mixtral.config.to_dict(), "intermediate_size": 32})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \(8, 48, 32\)"):
        hf_to_nxd_state_dict(mixtral.memory, wider)
    nxd = hf_to_nxd_state_dict(mixtral.memory, mixtral.config)
    with pytest.raises(ValueError, match=r"expert_mlps\.mlp_op\.gate_up_proj\.weight' has shape"):
        nxd_to_hf_state_dict(nxd, wider)


def test_both_layouts_of_one_block_is_an_error(mixtral):
    both = {**mixtral.memory, **{k: v for k, v in mixtral.hub.items() if "layers.0.block_sparse_moe" in k}}
    with pytest.raises(ValueError, match="two source keys"):
        hf_to_nxd_state_dict(both, mixtral.config)


def test_incomplete_nxd_block_is_named(mixtral):
    nxd = hf_to_nxd_state_dict(mixtral.memory, mixtral.config)
    del nxd["model.layers.0.mlp.router.linear_router.weight"]
    with pytest.raises(ValueError, match=r"nxd MoE block 'model\.layers\.0\.mlp\.' is missing"):
        nxd_to_hf_state_dict(nxd, mixtral.config)


def test_argument_errors(mixtral):
    with pytest.raises(ValueError, match="layout must be one of"):
        nxd_to_hf_state_dict({}, mixtral.config, layout="megatron")
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        hf_to_nxd_state_dict([("a", torch.zeros(1))], mixtral.config)
    with pytest.raises(ValueError, match="not supported"):
        hf_to_nxd_state_dict(mixtral.memory, transformers.LlamaConfig())
    moe = build_moe(from_hf_config(mixtral.config))
    with pytest.raises(TypeError, match="moe must be an nxd_moe MoE"):
        load_hf_layer(torch.nn.Linear(2, 2), mixtral.memory, mixtral.config, 0)
    with pytest.raises(TypeError, match="layer must be an int"):
        load_hf_layer(moe, mixtral.memory, mixtral.config, "0")
    with pytest.raises(ValueError, match="layer 7 has no MoE weights"):
        load_hf_layer(moe, mixtral.memory, mixtral.config, 7)


def test_non_finite_weights_are_rejected_on_load(mixtral):
    hub = dict(mixtral.hub)
    bad = hub["model.layers.0.block_sparse_moe.experts.2.w1.weight"].clone()
    bad[0, 0] = float("inf")
    hub["model.layers.0.block_sparse_moe.experts.2.w1.weight"] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        load_hf_layer(build_moe(from_hf_config(mixtral.config)), hub, mixtral.config, 0)
