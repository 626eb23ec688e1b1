"""``nxd_moe.hf.patch_model`` on small random transformers models, one per family.

Judged against transformers itself: the unpatched model's logits and greedy tokens (its experts on the ``eager``
loop), its state dict, and its own ``save_pretrained`` / ``from_pretrained``; quantized models against an unpatched
model holding the dequantized weights, and stored checkpoints against transformers' dequantization (GPT-OSS MXFP4)
or the format's definition (DeepSeek-V3 FP8 ``weight_scale_inv`` tiles). Negative controls show each bound can fail.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import no_host_sync  # noqa: E402
from hf_helpers import LAYERS, MODELS, assert_parity, inputs, one_intra_op_thread, randomize_hf_  # noqa: E402,F401 (autouse fixture)

from nxd_moe.hf import from_hf_config, hf_to_nxd_state_dict, nxd_to_hf_state_dict, patch_model  # noqa: E402
from nxd_moe.models.patch import PatchedMoEBlock, PatchReport  # noqa: E402
from nxd_moe.quantization import dequantized  # noqa: E402
from nxd_moe.trace import static_backend  # noqa: E402

# Logits of the patched and the unpatched fp32 model differ only by fp32 rounding in a different summation order:
# unit roundoff 6e-8, over sums of at most a few hundred terms per layer and two layers, is ~1e-5 relative at
# worst (measured: ~4e-8). 1e-4 of the largest logit leaves a margin; a wrong semantics is far above it
# (test_a_broken_layer_fails_the_bound), and so is FP8 / MXFP4 rounding (2^-4 / up to 1/3 of a block's largest
# weight, per weight).
RTOL = 1e-4
PROMPT = torch.randint(0, LAYERS["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(11))
GENERATE = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(PROMPT).logits


def generate(model: torch.nn.Module, **kwargs) -> torch.Tensor:
    return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **GENERATE, **kwargs)


def original(name: str, seed: int = 0, **sizes) -> torch.nn.Module:
    return randomize_hf_(MODELS[name].make(**sizes), seed)


def patched(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    return patch_model(copy.deepcopy(model), **kwargs)


class Reference:
    """One random model per family and what it computes unpatched."""

    def __init__(self, name: str):
        self.name = name
        self.tiny = MODELS[name]
        self.model = original(name)
        self.logits = logits(self.model)
        self.tokens = generate(self.model)
        self.blocks = tuple(f"{self.tiny.layers}.{i}.{self.tiny.block_attr}" for i in self.tiny.moe_layers)


_REFERENCES: dict[str, Reference] = {}


def reference(name: str) -> Reference:
    """One per family for the whole module (the tests only read it)."""
    if name not in _REFERENCES:
        _REFERENCES[name] = Reference(name)
    return _REFERENCES[name]


@pytest.fixture(params=list(MODELS))
def ref(request) -> Reference:
    return reference(request.param)


def storage_bytes(model: torch.nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers())}
    return sum(storages.values())


# ----------------------------------------------------------------------------------------------
# the model computes what it computed


def test_logits_and_greedy_tokens_match_the_unpatched_model(ref):
    model = patched(ref.model)
    report = model.nxd_moe_patched
    assert isinstance(report, PatchReport) and report.patched == ref.blocks and report.backend == "torch"
    assert all(isinstance(model.get_submodule(path), PatchedMoEBlock) for path in ref.blocks)
    assert rel_err(logits(model), ref.logits) <= RTOL
    assert torch.equal(generate(model), ref.tokens)
    assert ref.tokens[:, PROMPT.shape[1]:].unique().numel() > 1  # the continuation is not one repeated token


# Each override removes one piece of the family's semantics from the patched layers.
BROKEN = {
    "mixtral": dict(normalize_top_k_affinities=False),
    "gpt_oss": dict(hidden_act_scaling_factor=1.0),  # alpha; the clamps are rarely reached inside this model
    "llama4_text": dict(early_expert_affinity_modulation=False),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_layer_fails_the_bound(name):
    """Negative control: the logits bound above rejects a patch that computes something else."""
    ref = reference(name)
    assert rel_err(logits(patched(ref.model, **BROKEN[name])), ref.logits) > 10 * RTOL


def test_each_block_returns_what_the_transformers_block_returned(ref):
    """Same type, shapes and dtypes (GPT-OSS: ``(out, router_scores (T, k))``; Llama 4: ``(out (T, H),
    router_logits (T, E))``), same values up to fp32 rounding, prefill and decode."""
    model = patched(ref.model)
    for path in ref.blocks:
        theirs, ours = ref.model.get_submodule(path), model.get_submodule(path)
        for x in (inputs(2, 5, seed=3), inputs(4, 1, seed=4)):
            with torch.no_grad():
                expected, actual = theirs(x), ours(x)
            assert type(actual) is type(expected)
            if isinstance(expected, torch.Tensor):
                expected, actual = (expected,), (actual,)
            assert len(actual) == len(expected)
            for a, e in zip(actual, expected):
                assert a.shape == e.shape and a.dtype == e.dtype
                assert_parity(a, e)


def test_decode_makes_no_host_sync(ref):
    model = patched(ref.model)
    block = model.get_submodule(ref.blocks[0])
    x = inputs(4, 1, seed=5)
    with torch.no_grad(), no_host_sync():
        block(x)


def test_static_cache_generate_compiles_to_one_graph():
    """``torch.compile(fullgraph=True)`` of the patched model's forward, with a check that rejects host syncs in
    the captured graphs (the aot_eager backend: Dynamo's capture is the one inductor compiles; the inductor run
    itself is the slow test below), through a static-cache ``generate``."""
    torch._dynamo.reset()
    ref = reference("qwen3_moe")
    model = patched(ref.model)
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=static_backend("aot_eager"))
    assert torch.equal(generate(model, cache_implementation="static"), ref.tokens)
    torch._dynamo.reset()


@pytest.mark.slow
def test_static_cache_generate_compiles_with_inductor():
    torch._dynamo.reset()
    ref = reference("qwen3_moe")
    model = patched(ref.model)
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    assert torch.equal(generate(model, cache_implementation="static"), ref.tokens)
    torch._dynamo.reset()


def test_llama4_multimodal_model():
    """``Llama4ForConditionalGeneration`` (model_type ``llama4``): the text model's blocks, nested one level deeper."""
    text = MODELS["llama4_text"].config(32, 24).to_dict()
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                                  vision_config=vision))
    model = randomize_hf_(model.eval(), seed=2)
    model.config._experts_implementation = "eager"
    patch = patched(model)
    assert patch.nxd_moe_patched.patched == ("language_model.model.layers.1.feed_forward",)
    assert patch.nxd_moe_patched.kept == (("language_model.model.layers.0.feed_forward",
                                           "Llama4TextMLP is not a sparse-MoE block"),)
    assert rel_err(logits(patch), logits(model)) <= RTOL
    assert list(patch.state_dict()) == list(model.state_dict())


# ----------------------------------------------------------------------------------------------
# the checkpoint is what it was


def assert_same_state_dict(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        got = actual[key]
        assert got.shape == value.shape and got.dtype == value.dtype, key
        same = torch.equal(got.view(torch.uint8), value.view(torch.uint8)) if value.element_size() == 1 else \
            torch.equal(got, value)
        assert same, key


def test_state_dict_is_unchanged(ref):
    assert_same_state_dict(patched(ref.model).state_dict(), ref.model.state_dict())


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_state_dict_keeps_the_dtypes_of_a_bf16_model(name):
    """The ``MoE`` routes in float32; the state dict gives the router back in the model's dtype (DeepSeek's
    correction bias in float32, as transformers keeps it)."""
    model = original(name).to(torch.bfloat16)
    if name == "deepseek_v3":
        for layer in MODELS[name].moe_layers:
            gate = model.model.layers[layer].mlp.gate
            gate.e_score_correction_bias = gate.e_score_correction_bias.float()
    patch = patched(model)
    router = patch.get_submodule(f"model.layers.{MODELS[name].moe_layers[0]}.mlp").moe.router.linear_router.weight
    assert router.dtype == torch.float32
    assert_same_state_dict(patch.state_dict(), model.state_dict())


def test_load_state_dict_of_the_transformers_checkpoint(ref):
    model = patch_model(original(ref.name, seed=1))
    assert rel_err(logits(model), ref.logits) > 10 * RTOL  # other weights before loading
    assert not any(model.load_state_dict(ref.model.state_dict(), strict=True))
    assert rel_err(logits(model), ref.logits) <= RTOL


def test_save_pretrained_round_trip(ref, tmp_path):
    """The patched model writes what the unpatched one writes (transformers' Hub layout included), and
    ``from_pretrained`` loads it unpatched."""
    patched(ref.model).save_pretrained(tmp_path / "patched")
    ref.model.save_pretrained(tmp_path / "original")
    written = safetensors_torch.load_file(str(tmp_path / "patched" / "model.safetensors"))
    expected = safetensors_torch.load_file(str(tmp_path / "original" / "model.safetensors"))
    assert sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
    reloaded = type(ref.model).from_pretrained(tmp_path / "patched", experts_implementation="eager").eval()
    assert not any(isinstance(m, PatchedMoEBlock) for m in reloaded.modules())
    assert rel_err(logits(reloaded), ref.logits) <= RTOL


# ----------------------------------------------------------------------------------------------
# memory


def test_the_transformers_blocks_are_released_and_no_bytes_added(ref):
    model = original(ref.name)
    before = storage_bytes(model)
    experts = [weakref.ref(t) for path in ref.blocks for t in model.get_submodule(path).parameters()]
    patch_model(model)
    assert all(w() is None for w in experts), "a transformers block's tensor is still alive after patching"
    assert storage_bytes(model) <= before  # float32 model: the float32 router is the block's own size


def test_each_block_is_released_before_the_next_is_converted(ref, monkeypatch):
    """Patching holds one extra block at most: when block i is converted, no tensor of blocks 0..i-1 is alive (a
    reference kept across the loop -- the first block's parameter read to pick the backend -- held block 0's
    gate/up weights through the whole patch: +2/3 of a block of GPU memory at the peak)."""
    import nxd_moe.models.patch as patch_module

    model = original(ref.name)
    tensors = [[weakref.ref(t) for t in model.get_submodule(path).parameters()] for path in ref.blocks]
    convert = patch_module.from_hf_moe_block
    alive_at_each = []

    def counting(block, *args, **kwargs):
        done = len(alive_at_each)
        alive_at_each.append(sum(w() is not None for refs in tensors[:done] for w in refs))
        return convert(block, *args, **kwargs)
    monkeypatch.setattr(patch_module, "from_hf_moe_block", counting)
    patch_model(model)
    assert len(alive_at_each) == len(ref.blocks)
    assert alive_at_each == [0] * len(ref.blocks)


def test_a_kept_block_is_detected():
    """Negative control of the release check: a block still referenced keeps its tensors."""
    model = original("mixtral")
    kept = model.model.layers[0].mlp
    alive = weakref.ref(kept.experts.gate_up_proj)
    patch_model(model)
    assert alive() is not None


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_bf16_model_grows_by_the_float32_router_only(name):
    model = original(name).to(torch.bfloat16)
    before = storage_bytes(model)
    patch_model(model)
    routers = [model.get_submodule(path).moe.router for path in model.nxd_moe_patched.patched]
    growth = sum(t.numel() * 2 for router in routers for t in router.state_dict().values())  # bf16 -> float32
    assert storage_bytes(model) == before + growth
    assert storage_bytes(model) <= 1.05 * before


# ----------------------------------------------------------------------------------------------
# quantized experts


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP MX FP4 magnitudes, codes 0-7


def dequantized_by_definition(stored) -> torch.Tensor:
    """The ``(E, K, N)`` float32 weight a quantized expert weight stands for, from each format's definition and the
    stored tensors alone -- not the package's ``dequantize`` (the code under test): FP8 values times one scale per
    output channel ``(E, 1, N)`` or per 128x128 tile ``(E, K/128, N/128)``; MXFP4 nibbles (along K, low first,
    sign bit 3) of E2M1 times ``2**(e8m0 - 127)`` per 32 values along K."""
    name, data, scale = stored.format.name, stored.weight, stored.scale
    if name == "fp8":
        return data.float() * scale.float()
    if name == "fp8_block":
        return data.float() * scale.float().repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert name == "mxfp4", name
    e, half_k, n = data.shape
    codes = torch.stack([data & 0xF, data >> 4], dim=2).reshape(e, 2 * half_k, n).long()
    values = E2M1[codes & 7] * (1 - 2 * (codes >> 3))
    return values * torch.exp2(scale.float() - 127).repeat_interleave(32, 1)


def dequantized_reference(quantized: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """An unpatched copy of ``model`` whose MoE blocks hold ``quantized``'s experts, dequantized from the formats'
    definitions."""
    nxd = {}
    for path in quantized.nxd_moe_patched.patched:
        moe = quantized.get_submodule(path).moe
        block = {k: v for k, v in moe.state_dict().items() if not k.endswith(".scale")}
        for proj in ("gate_up_proj", "down_proj"):
            stored = getattr(moe.expert_mlps.mlp_op, proj).stored_weight()
            block[f"expert_mlps.mlp_op.{proj}.weight"] = dequantized_by_definition(stored)
            assert torch.equal(block[f"expert_mlps.mlp_op.{proj}.weight"], dequantized(stored).float()), proj
        if moe.shared_experts is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                block[f"shared_experts.{proj}.weight"] = getattr(moe.shared_experts, proj).matrix()
        nxd.update({f"{path}.{k}": v for k, v in block.items()})
    state = model.state_dict()
    state.update(nxd_to_hf_state_dict(nxd, model.config))
    reference = copy.deepcopy(model)
    reference.load_state_dict(state, strict=True)
    return reference


# (name, quantization, shared_quantization, hidden, experts' width): fp8_block needs multiples of 128, mxfp4 of 32.
QUANTIZED = [
    ("mixtral", "fp8", None, 64, 64),
    ("qwen3_moe", "mxfp4", None, 64, 64),
    ("qwen2_moe", "fp8", "fp8", 64, 64),
    ("deepseek_v3", "fp8_block", "fp8_block", 128, 128),
    ("gpt_oss", "mxfp4", None, 64, 64),
    ("llama4_text", "fp8", None, 64, 64),
    ("dbrx", "mxfp4", None, 64, 64),
]


@pytest.mark.parametrize("name,quantization,shared,hidden,width", QUANTIZED, ids=[q[0] for q in QUANTIZED])
def test_quantized_patch_matches_its_dequantized_reference(name, quantization, shared, hidden, width):
    model = original(name, hidden=hidden, intermediate=width)
    quantized = patched(model, quantization=quantization, shared_quantization=shared)
    report = quantized.nxd_moe_patched
    has_shared = from_hf_config(model.config).shared_experts is not None
    assert (report.quantization, report.shared_quantization) == (quantization, (shared or "none") if has_shared
                                                                 else None)
    assert storage_bytes(quantized) < storage_bytes(model)
    # Identical weights on both sides: only fp32 rounding remains.
    assert rel_err(logits(quantized), logits(dequantized_reference(quantized, model))) <= RTOL
    # Negative control: the format's rounding is far above that bound, so the comparison above is not vacuous.
    assert rel_err(logits(quantized), logits(model)) > 10 * RTOL


def test_quantized_state_dict_in_the_checkpoint_naming():
    """GPT-OSS gives MXFP4 ``*_blocks``/``*_scales``, DeepSeek-V3 the Hub's per-expert FP8 ``weight_scale_inv``
    tensors; a format the family's checkpoints do not have is a named error."""
    gpt = patched(original("gpt_oss", hidden=64, intermediate=64), quantization="mxfp4").state_dict()
    assert {"model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.mlp.experts.down_proj_scales"} <= set(gpt)
    assert not any(k.endswith("experts.gate_up_proj") for k in gpt)
    ds = patched(original("deepseek_v3", hidden=128, intermediate=128), quantization="fp8_block",
                 shared_quantization="fp8_block").state_dict()
    assert ds["model.layers.1.mlp.experts.15.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert ds["model.layers.1.mlp.experts.15.down_proj.weight_scale_inv"].shape == (1, 1)
    assert ds["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert ds["model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"].shape == (2, 1)


# (name, quantization, shared_quantization): every format a family's checkpoints have in transformers (GPT-OSS's
# MXFP4; FP8 with 128x128 block scales wherever the Hub stores one Linear per expert, shared experts included).
SAVED = [("qwen3_moe", "fp8_block", None), ("deepseek_v3", "fp8_block", "fp8_block"),
         ("deepseek_v3", None, "fp8_block"), ("gpt_oss", "mxfp4", None), ("mixtral", "fp8_block", None),
         ("qwen2_moe", "fp8_block", None), ("llama4_text", None, "fp8_block")]


@pytest.mark.parametrize("name,quantization,shared", SAVED, ids=["-".join(map(str, c)) for c in SAVED])
def test_a_quantized_checkpoint_reloads_through_transformers(name, quantization, shared, tmp_path):
    """``save_pretrained`` of a model quantized on patch writes the quantized tensors and transformers'
    ``quantization_config``; plain ``from_pretrained`` loads every tensor (no key missing, none unexpected; on a CPU
    transformers dequantizes) and computes what the patched model computes: the stored values are dequantized
    exactly (an E4M3 or E2M1 value times a power-of-two or float32 scale), so only fp32 summation order remains."""
    pytest.importorskip("accelerate", reason="transformers loads quantized checkpoints with accelerate (hf extra)")
    model = original(name, hidden=128, intermediate=128)
    quantized = patched(model, quantization=quantization, **({} if shared is None else {"shared_quantization": shared}))
    quantized.save_pretrained(tmp_path)
    stored = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    narrow = {torch.float8_e4m3fn} if "fp8_block" in (quantization, shared) else {torch.uint8}
    assert {t.dtype for t in stored.values()} & narrow
    transformers.logging.set_verbosity_error()  # "no GPU: dequantizing": the CPU path of the same loader
    reloaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert rel_err(logits(reloaded), logits(quantized)) <= RTOL
    # Negative control: the quantization's rounding is far above that bound.
    assert rel_err(logits(reloaded), logits(model)) > 10 * RTOL


@pytest.mark.parametrize("name,quantization,shared", [c for c in SAVED if "fp8_block" in c[1:]],
                         ids=["-".join(map(str, c)) for c in SAVED if "fp8_block" in c[1:]])
def test_the_saved_quantization_config_converts_exactly_the_quantized_modules(name, quantization, shared):
    """Where transformers loads FP8 natively (a GPU), it replaces every nn.Linear and experts module not in
    modules_to_not_convert by an FP8 one before loading: the saved config must leave exactly the quantized ones
    (transformers' own replacement, run on the meta device, decides; a CPU load dequantizes and never checks it)."""
    pytest.importorskip("accelerate", reason="transformers' FP8 quantizer imports it")
    from transformers.quantizers.auto import AutoHfQuantizer

    model = original(name, hidden=128, intermediate=128)
    quantized = patched(model, quantization=quantization, **({} if shared is None else {"shared_quantization": shared}))
    config = copy.deepcopy(model.config)
    config.quantization_config = quantized.config.quantization_config
    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    with torch.device("meta"):
        fresh = type(model)(config)
    quantizer._process_model_before_weight_loading(fresh)
    converted = {path for path, module in fresh.named_modules() if type(module).__name__.startswith("FP8")}
    tiny = MODELS[name]
    blocks = [f"{tiny.layers}.{i}.{tiny.block_attr}" for i in tiny.moe_layers]
    shared_name = {"deepseek_v3": "shared_experts", "llama4_text": "shared_expert"}.get(name)
    expected = {f"{b}.experts" for b in blocks if quantization} | {
        f"{b}.{shared_name}.{proj}" for b in blocks if shared for proj in ("gate_proj", "up_proj", "down_proj")}
    assert converted == expected
    # Negative control: without the list transformers would convert attention and the LM head too.
    config.quantization_config = {**config.quantization_config, "modules_to_not_convert": None}
    with torch.device("meta"):
        fresh = type(model)(config)
    AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)._process_model_before_weight_loading(
        fresh)
    assert {path for path, module in fresh.named_modules() if type(module).__name__.startswith("FP8")} > expected


# (name, quantization, shared_quantization, the format to patch with instead)
UNSAVED = [("qwen3_moe", "fp8", None, "quantization='fp8_block'"),
           ("qwen3_moe", "mxfp4", None, "quantization='fp8_block'"),
           ("deepseek_v3", "fp8", None, "quantization='fp8_block'"),
           ("deepseek_v3", "fp8_block", "fp8", "shared_quantization='fp8_block'"),
           ("gpt_oss", "fp8", None, "quantization='mxfp4'"),
           ("gpt_oss", "fp8_block", None, "quantization='mxfp4'"),
           ("dbrx", "fp8", None, None), ("llama4_text", "mxfp4", None, None)]


@pytest.mark.parametrize("name,quantization,shared,instead", UNSAVED, ids=["-".join(c[:3]) if c[2] else
                                                                         "-".join(c[:2]) for c in UNSAVED])
def test_a_format_without_a_checkpoint_form_refuses_to_save(name, quantization, shared, instead, tmp_path):
    """Formats transformers cannot load for the family are refused by ``save_pretrained`` (before anything is
    written), naming the format and what to do -- never a checkpoint whose experts would load at random."""
    model = patched(original(name, hidden=128, intermediate=128), quantization=quantization,
                    **({} if shared is None else {"shared_quantization": shared}))
    what, fmt = ("shared", shared) if shared == "fp8" else ("routed", quantization)
    remedy = f"patch with {instead} to save them quantized, or " if instead else ""
    argument = "shared_quantization" if what == "shared" else "quantization"
    with pytest.raises(ValueError, match=rf"{what} experts stored as '{fmt}' have no checkpoint format that "
                                         rf"transformers loads for model_type '{name}' .*; {remedy}save the model "
                                         rf"before patching it with {argument}='{fmt}'"):
        model.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    assert getattr(model.config, "quantization_config", None) is None


def test_gpt_oss_mxfp4_checkpoint_loads_as_stored():
    """The Hub's MXFP4 tensors load into a model patched with ``quantization="mxfp4"`` and give transformers' own
    dequantization's logits; its state dict gives them back byte for byte."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = original("gpt_oss", hidden=64, intermediate=64)
    gen = torch.Generator().manual_seed(7)
    stored, dense = model.state_dict(), model.state_dict()
    for layer in MODELS["gpt_oss"].moe_layers:
        prefix = f"model.layers.{layer}.mlp.experts."
        for proj, rows, k in (("gate_up_proj", 2 * 64, 64), ("down_proj", 64, 64)):  # (E, rows, k/32, 16) bytes
            del stored[prefix + proj]
            blocks = torch.randint(0, 256, (8, rows, k // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(118, 124, (8, rows, k // 32), generator=gen).to(torch.uint8)  # 2^-9 .. 2^-4
            stored[prefix + proj + "_blocks"], stored[prefix + proj + "_scales"] = blocks, scales
            dense[prefix + proj] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    reference = copy.deepcopy(model)
    reference.load_state_dict(dense, strict=True)
    quantized = patch_model(copy.deepcopy(model), quantization="mxfp4")
    quantized.load_state_dict(stored, strict=True)
    assert rel_err(logits(quantized), logits(reference)) <= RTOL
    assert_same_state_dict(dict(sorted(quantized.state_dict().items())), dict(sorted(stored.items())))
    with pytest.raises(ValueError, match=r"load_state_dict: 'model\.layers\.0\.mlp\.''s routed experts are stored as "
                                         r"'mxfp4' in the checkpoint, the layer's as 'bf16': patch the model with "
                                         r"quantization='mxfp4'"):
        patched(model).load_state_dict(stored)


def fp8_tiles(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8 storage of ``weight (out, in)``: E4M3 values and one float32 ``weight_scale_inv`` per
    128x128 tile (the tile's max over 448), and the value they stand for (written from the definition)."""
    tiles = weight.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # (out/128, 128, in/128, 128)
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    values = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    restored = (values.float() * scale[:, None, :, None]).flatten(2).flatten(0, 1)
    return values.flatten(2).flatten(0, 1), scale, restored


def test_deepseek_v3_fp8_checkpoint_loads_as_stored():
    """The Hub's per-expert FP8 tensors with ``weight_scale_inv`` (routed and shared experts) load into a model
    patched with ``quantization="fp8_block", shared_quantization="fp8_block"``, compute what the tiles stand for,
    and come back byte for byte."""
    model = original("deepseek_v3", hidden=128, intermediate=128)
    stored, dense = model.state_dict(), model.state_dict()
    gen = torch.Generator().manual_seed(8)
    prefix = "model.layers.1.mlp."
    for key in ("experts.gate_up_proj", "experts.down_proj"):
        del stored[prefix + key]
    gate_up, down = [], []
    for e in range(16):
        restored = {}
        for proj, shape in (("gate_proj", (128, 128)), ("up_proj", (128, 128)), ("down_proj", (128, 128))):
            values, scale, restored[proj] = fp8_tiles(torch.randn(shape, generator=gen) * 0.2)
            stored[f"{prefix}experts.{e}.{proj}.weight"] = values
            stored[f"{prefix}experts.{e}.{proj}.weight_scale_inv"] = scale
        gate_up.append(torch.cat([restored["gate_proj"], restored["up_proj"]]))
        down.append(restored["down_proj"])
    dense[prefix + "experts.gate_up_proj"] = torch.stack(gate_up)
    dense[prefix + "experts.down_proj"] = torch.stack(down)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        key = f"{prefix}shared_experts.{proj}.weight"
        stored[key], stored[key + "_scale_inv"], dense[key] = fp8_tiles(stored[key])
    reference = copy.deepcopy(model)
    reference.load_state_dict(dense, strict=True)
    quantized = patch_model(copy.deepcopy(model), quantization="fp8_block", shared_quantization="fp8_block")
    quantized.load_state_dict(stored, strict=True)
    assert rel_err(logits(quantized), logits(reference)) <= RTOL
    assert_same_state_dict(dict(sorted(quantized.state_dict().items())), dict(sorted(stored.items())))


# ----------------------------------------------------------------------------------------------
# dense layers, reports, meta models


@pytest.mark.parametrize("name,kept_class", [("qwen3_moe", "Qwen3MoeMLP"), ("deepseek_v3", "DeepseekV3MLP"),
                                             ("llama4_text", "Llama4TextMLP")])
def test_dense_layers_stay(name, kept_class):
    model = original(name)
    tiny = MODELS[name]
    dense = f"{tiny.layers}.0.{tiny.block_attr}"
    kept = model.get_submodule(dense)
    patch_model(model)
    assert model.get_submodule(dense) is kept
    assert model.nxd_moe_patched.kept == ((dense, f"{kept_class} is not a sparse-MoE block"),)


def test_report_and_repr():
    model = patch_model(original("qwen2_moe", hidden=64, intermediate=64), quantization="fp8", block_size=8)
    report = model.nxd_moe_patched
    assert report == PatchReport(model_type="qwen2_moe", block_class="Qwen2MoeSparseMoeBlock", backend="torch",
                                 quantization="fp8", shared_quantization="none",
                                 patched=("model.layers.0.mlp", "model.layers.1.mlp"), kept=())
    block = model.model.layers[0].mlp
    assert block.moe.expert_mlps.blockwise_matmul_config.block_size == 8
    assert "in place of Qwen2MoeSparseMoeBlock, backend='torch', quantization='fp8', shared_quantization='none'" \
        in repr(block)


def test_unquantized_experts_are_reported_as_none_not_bf16():
    """A float32 model's experts are not bf16: the report and the repr say "none" (not quantized)."""
    model = patch_model(original("qwen2_moe"))
    assert (model.nxd_moe_patched.quantization, model.nxd_moe_patched.shared_quantization) == ("none", "none")
    assert "quantization='none', shared_quantization='none'" in repr(model.model.layers[0].mlp)
    assert model.model.layers[0].mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight.dtype == torch.float32


def test_on_a_cpu_the_default_backend_multiplies_the_pairs_and_backend_torch_keeps_nxds_rules():
    """patch_model's default on a CPU is TorchBackend(pairs=True): a prefill runs the T*k pairs (no 512-row blocks,
    which the shipped Qwen3 block size gives backend="torch": 16x the rows of this 300-token prompt); both give
    the unpatched model's logits."""
    ref = reference("qwen3_moe")
    prompt = torch.randint(0, LAYERS["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref.model(prompt).logits
    modes = {}
    for backend in (None, "torch"):
        model = patched(ref.model, backend=backend)
        moe = model.model.layers[1].mlp.moe
        with torch.no_grad():
            got = model(prompt).logits
            modes[backend] = moe.expert_mlps.resolve_mode(None, 300, 300).value
        assert rel_err(got, expected) <= RTOL
    assert modes == {None: "selective_loading", "torch": "blockwise"}
    assert patched(ref.model).model.layers[1].mlp.moe.expert_mlps.backend.pairs


def test_a_model_on_the_meta_device_is_patched_there_and_loads_later():
    """Patch before loading: the layers are built on the meta device and take the checkpoint with
    ``load_state_dict(assign=True)`` in their own dtypes (the float32 router), contiguous."""
    ref = reference("qwen3_moe")
    with torch.device("meta"):
        model = MODELS["qwen3_moe"].make()
    patch_model(model)
    moe = model.model.layers[1].mlp.moe
    assert moe.expert_mlps.mlp_op.gate_up_proj.weight.is_meta
    shapes = {k: v.shape for k, v in ref.model.state_dict().items()}
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    # strict=False: the rotary embedding's buffers are not in a state dict (from_pretrained computes them)
    model.load_state_dict(ref.model.state_dict(), assign=True, strict=False)
    weight = moe.expert_mlps.mlp_op.gate_up_proj.weight
    assert not weight.is_meta and weight.is_contiguous()
    assert moe.router.linear_router.weight.dtype == torch.float32
    assert torch.equal(weight, hf_to_nxd_state_dict(ref.model.state_dict(), ref.model.config)[
        "model.layers.1.mlp.expert_mlps.mlp_op.gate_up_proj.weight"])


# ----------------------------------------------------------------------------------------------
# bad input


def test_bad_models_are_named():
    with pytest.raises(TypeError, match="model must be a transformers model"):
        patch_model(torch.nn.Linear(2, 2))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                                                    **LAYERS))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'\) has no sparse-MoE block"):
        patch_model(llama)
    config = MODELS["qwen3_moe"].config(32, 24)
    config.mlp_only_layers = [0, 1]
    with pytest.raises(ValueError, match="has no Qwen3MoeSparseMoeBlock to replace; every layer is dense"):
        patch_model(transformers.Qwen3MoeForCausalLM(config))
    model = original("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits is True, but patched blocks do not record"):
        patch_model(model)
    model.config.output_router_logits = False
    patch_model(model)
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(quantization="int4"), ValueError, "patch_model: quantization must be one of"),
    (dict(shared_quantization="fp8"), ValueError, "shared_quantization='fp8', but model_type 'mixtral' has no shared"),
    (dict(dtype=torch.bfloat16), TypeError, "'dtype' is the model's own"),
    (dict(device="cpu"), TypeError, "'device' is the model's own"),
    (dict(scale=2), TypeError, "'scale' is the model's own"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(quantization="fp8_block"), ValueError, "128"),  # H = 32 is no multiple of fp8_block's 128
    (dict(quantisation="fp8"), TypeError, r"patch_model: unknown keyword argument 'quantisation' \(did you mean "
                                          r"'quantization'\?\)"),
    (dict(capacity_facter=1.0), TypeError, r"patch_model: unknown keyword argument 'capacity_facter' \(did you mean "
                                           r"'capacity_factor'\?\)"),
    (dict(block_sise=8), TypeError, r"unknown keyword argument 'block_sise' \(did you mean 'block_size'\?\)"),
])
def test_bad_arguments_are_named_and_leave_the_model_as_it_was(kwargs, error, match):
    model = original("mixtral")
    blocks = [layer.mlp for layer in model.model.layers]
    with pytest.raises(error, match=match):
        patch_model(model, **kwargs)
    assert [layer.mlp for layer in model.model.layers] == blocks and not hasattr(model, "nxd_moe_patched")


def test_an_unknown_tensor_in_a_block_is_named_before_anything_changes():
    model = original("mixtral")
    model.model.layers[1].mlp.experts.lora_A = torch.nn.Parameter(torch.zeros(8, 4))
    first = model.model.layers[0].mlp
    with pytest.raises(ValueError, match=r"unexpected 'model\.layers\.1\.mlp\.experts\.lora_A'.*not converted"):
        patch_model(model)
    assert model.model.layers[0].mlp is first


def test_a_checkpoint_of_another_shape_is_named():
    model = patched(original("mixtral"))
    state = original("mixtral").state_dict()
    state["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 32, 16)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj' has shape \(8, 32, 16\)"):
        model.load_state_dict(state)


def test_compiled_generate_shares_one_static_cache():  # ~20 s on 2 cores: CI runs it
    """Compiled ``generate`` calls sharing one StaticCache (what hf_generate.py times): each call resets it in
    place, so its tensors keep their addresses (the CUDA-graph step is recorded once), and the tokens equal eager
    ``generate``'s, also for a shorter prompt after a longer one."""
    from nxd_moe.models.generate import generate_tokens, static_cache

    torch._dynamo.reset()
    ref = reference("qwen3_moe")
    model = patched(ref.model)
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = static_cache(model, 7 + 5)
    first = generate_tokens(model, prompt, 5, True, cache)
    addresses = [layer.keys.data_ptr() for layer in cache.layers]
    second = generate_tokens(model, prompt[:, :4], 3, True, cache)
    assert [layer.keys.data_ptr() for layer in cache.layers] == addresses
    assert torch.equal(first, generate_tokens(model, prompt, 5, False))
    assert torch.equal(second, generate_tokens(model, prompt[:, :4], 3, False))
    torch._dynamo.reset()


def test_shared_static_cache_is_for_compiled_generate_only():
    from nxd_moe.models.generate import generate_tokens, static_cache

    ref = reference("qwen3_moe")
    with pytest.raises(ValueError, match="cache: a shared StaticCache is for compiled=True only"):
        generate_tokens(ref.model, torch.zeros(1, 3, dtype=torch.long), 2, False, static_cache(ref.model, 5))
    with pytest.raises(ValueError, match="max_cache_len"):
        static_cache(ref.model, 0)
