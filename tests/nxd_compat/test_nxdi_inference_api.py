"""NxD Inference's application API (``nxd_moe/nxd_compat/inference.py``) piece by piece, without building a model:
the config classes' defaults and fields, ``neuron_config.json``'s round trip, ``load_pretrained_config`` on a
transformers config object, the model class's choice of checkpoint and device, the generation adapter's arguments
as they reach the application's loop, and ``benchmark_sampling``'s report -- over stand-ins of the application
(tests/application/test_nxdi_front_door.py runs the same API end to end on real checkpoints, seconds each). Found by
mutation testing (benchmarks/mutation.py)."""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402

from nxd_moe.application import NxDIFieldWarning  # noqa: E402
from nxd_moe.application.artifacts import CONFIG_FILE, MANIFEST_FILE  # noqa: E402
from nxd_moe.nxd_compat import inference as inf  # noqa: E402


def _full(message: str) -> str:
    return "^" + re.escape(message) + "$"


# ----------------------------------------------------------------------------------------------------------
# neuron configs


def test_neuron_config_dtype_override_flag_and_unknown_fields():
    assert inf.NeuronConfig(torch_dtype="bfloat16").overrides_torch_dtype is True
    assert inf.NeuronConfig(batch_size=2).overrides_torch_dtype is False
    assert inf.NeuronConfig(overrides_torch_dtype=True).overrides_torch_dtype is True
    chosen = inf.NeuronConfig(torch_dtype="bfloat16", overrides_torch_dtype=False)
    assert chosen.overrides_torch_dtype is False and chosen.torch_dtype == torch.bfloat16
    with pytest.warns(NxDIFieldWarning, match="unexpected keyword arguments \\['bogus'\\]"):
        assert inf.NeuronConfig(bogus=3, batch_size=3).batch_size == 3  # warned, as NxDI does; not refused


@pytest.mark.filterwarnings("ignore::nxd_moe.application.NxDIFieldWarning")  # glu_mlp=False: ignored
def test_moe_neuron_config_defaults_and_fields():
    config = inf.MoENeuronConfig()
    assert (config.capacity_factor, config.glu_mlp) == (None, True)
    config = inf.MoENeuronConfig(None, False, batch_size=3)
    assert (config.capacity_factor, config.glu_mlp, config.batch_size) == (None, False, 3)
    with pytest.raises(ValueError, match="^capacity_factor=2.5: the application runs the experts dropless"):
        inf.MoENeuronConfig(2.5)  # passed on (and refused there)


def test_on_device_sampling_config():
    config = inf.OnDeviceSamplingConfig()
    assert vars(config) == {"do_sample": False, "top_k": 1, "top_p": 1.0, "temperature": 1.0, "dynamic": False,
                            "deterministic": False, "global_topk": 256, "on_device_sampling_config": True,
                            "top_k_kernel_enabled": False, "sampling_dp_degree": 1}
    config = inf.OnDeviceSamplingConfig(do_sample=True, top_k=7, top_p=0.5, temperature=0.75, dynamic=True,
                                        global_topk=64, deterministic=True, sampling_dp_degree=2)
    assert (config.do_sample, config.top_k, config.top_p, config.temperature, config.dynamic, config.global_topk,
            config.deterministic, config.sampling_dp_degree, config.top_k_kernel_enabled) == (
        True, 7, 0.5, 0.75, True, 64, True, 2, False)
    with pytest.raises(TypeError, match=_full(
            "OnDeviceSamplingConfig: unknown field(s) ['a_field', 'beams']; fields: ['deterministic', 'do_sample', "
            "'dynamic', 'global_topk', 'on_device_sampling_config', 'sampling_dp_degree', 'temperature', 'top_k', "
            "'top_k_kernel_enabled', 'top_p']")):
        inf.OnDeviceSamplingConfig(beams=2, a_field=1)
    with pytest.raises(ValueError, match="top_p"):  # the values are SamplingConfig's to check
        inf.OnDeviceSamplingConfig(top_p=1.5)


# ----------------------------------------------------------------------------------------------------------
# InferenceConfig


class _Config(inf.InferenceConfig):
    attribute_map = {"num_experts": "num_local_experts"}

    def get_required_attributes(self):
        return ["hidden_size", "num_local_experts"]


def test_inference_config_fields_hooks_and_aliases():
    neuron = inf.MoENeuronConfig()
    loaded = []

    def load_config(config):
        loaded.append(config)
        config.hidden_size = 8
        config.num_experts = 4  # an alias: stored under its transformers name

    config = _Config(neuron, None, load_config, {"run": 1}, vocab_size=32)
    assert loaded == [config] and config.neuron_config is neuron and config.fused_spec_config is None
    assert (config.hidden_size, config.num_local_experts, config.num_experts, config.vocab_size, config.metadata,
            config.num_cores_per_group) == (8, 4, 4, 32, {"run": 1}, 1)
    assert "num_experts" not in vars(config)
    assert config.get_text_config() is config
    config.text_config = SimpleNamespace(hidden_size=2)
    assert config.get_text_config() is config.text_config
    with pytest.raises(AttributeError, match=_full("_Config has no attribute 'missing'")):
        config.missing  # noqa: B018
    # a per-instance attribute map (load_pretrained_config sets the checkpoint's)
    config.attribute_map = {"n_embd": "hidden_size"}
    assert config.n_embd == 8
    config.n_embd = 12
    assert config.hidden_size == 12 and "n_embd" not in vars(config)
    assert inf.InferenceConfig(neuron).num_cores_per_group == 1  # no hook: load_config() of the class


def test_inference_config_refusals():
    with pytest.raises(TypeError, match=_full("neuron_config must be a (MoE)NeuronConfig, got dict")):
        inf.InferenceConfig({})
    with pytest.raises(ValueError, match=_full(
            "fused_spec_config: speculative decoding is not served by nxd_moe's application")):
        inf.InferenceConfig(inf.NeuronConfig(), fused_spec_config=object())
    with pytest.raises(ValueError, match=_full(
            "_Config: the model config lacks ['num_local_experts'] (give load_config=load_pretrained_config("
            "model_path), or the fields as keywords)")):
        _Config(inf.MoENeuronConfig(), hidden_size=8)


def test_neuron_config_json_round_trip(tmp_path):
    neuron = inf.MoENeuronConfig(batch_size=3, torch_dtype="bfloat16")
    config = _Config(neuron, hidden_size=8, num_local_experts=4, rope=SimpleNamespace(theta=5.0),
                     dtype=torch.float16)
    plain = config.to_json_dict()
    assert plain["rope"] == {"theta": 5.0} and plain["dtype"] == "float16" and plain["hidden_size"] == 8
    assert plain["neuron_config"] == neuron.to_dict() and "fused_spec_config" not in plain
    config.save(tmp_path / "out" / "deeper")
    text = (tmp_path / "out" / "deeper" / CONFIG_FILE).read_text()
    assert json.loads(text) == json.loads(json.dumps(plain)) and text.endswith("}\n")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the neuron config is rebuilt without warning again
        again = _Config.load(tmp_path / "out" / "deeper", vocab_size=64)
    assert type(again.neuron_config) is inf.NeuronConfig  # the class's get_neuron_config_cls
    assert (again.neuron_config.batch_size, again.neuron_config.torch_dtype) == (3, torch.bfloat16)
    assert (again.hidden_size, again.num_local_experts, again.vocab_size, again.rope) == (8, 4, 64, {"theta": 5.0})
    moe = inf.Qwen3MoeInferenceConfig.load(tmp_path / "out" / "deeper", num_attention_heads=2, num_hidden_layers=1,
                                           num_key_value_heads=1, vocab_size=64, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=8)
    assert type(moe.neuron_config) is inf.MoENeuronConfig
    given = _Config.load(tmp_path / "out" / "deeper", neuron_config=neuron)  # an object: kept as it is
    assert given.neuron_config is neuron
    with pytest.raises(FileNotFoundError, match=_full(
            f"{tmp_path}: no {CONFIG_FILE} (a directory written by compile(path))")):
        _Config.load(tmp_path)


def test_to_transformers_config():
    config = _Config(inf.MoENeuronConfig(), hidden_size=8, num_local_experts=4, num_attention_heads=2,
                     model_type="ignored", rope_scaling=SimpleNamespace(rope_type="linear", factor=2.0),
                     metadata={"x": 1})
    config.attribute_map = {"n_embd": "hidden_size"}  # the checkpoint's aliases (load_pretrained_config's)
    hf = config.to_transformers_config("mixtral")
    assert type(hf).__name__ == "MixtralConfig" and (hf.hidden_size, hf.num_local_experts) == (8, 4)
    assert hf.rope_scaling["factor"] == 2.0 and hf.model_type == "mixtral"
    assert hf.attribute_map == {"num_experts": "num_local_experts"}  # transformers' own, not the instance's
    for dropped in ("neuron_config", "num_cores_per_group", "attribute_map", "metadata"):
        assert dropped not in hf.to_dict()


# ----------------------------------------------------------------------------------------------------------
# load_pretrained_config


def _hf_config(**kwargs):
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=4, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=1, vocab_size=32, **kwargs)


def test_load_pretrained_config_needs_exactly_one_source():
    message = _full('load_pretrained_config: give one of "model_path_or_name" or "hf_config"')
    with pytest.raises(ValueError, match=message):
        inf.load_pretrained_config()
    with pytest.raises(ValueError, match=message):
        inf.load_pretrained_config("a/path", _hf_config())


def test_load_pretrained_config_from_a_config_object():
    hf = _hf_config(torch_dtype="bfloat16")
    config = inf.MixtralInferenceConfig(inf.MoENeuronConfig(), load_config=inf.load_pretrained_config(hf_config=hf))
    assert (config.hidden_size, config.num_local_experts, config.vocab_size) == (8, 4, 32)
    assert config.neuron_config.torch_dtype == torch.bfloat16  # the checkpoint's dtype
    assert "torch_dtype" not in vars(config) and "dtype" not in vars(config)
    assert config.attribute_map == dict(hf.attribute_map) and config.attribute_map is not hf.attribute_map
    assert config.num_experts == 4  # transformers' alias, through the checkpoint's attribute map
    assert "_name_or_path" not in vars(config) or config._name_or_path == ""
    chosen = inf.MixtralInferenceConfig(inf.MoENeuronConfig(torch_dtype="float16"),
                                        load_config=inf.load_pretrained_config(hf_config=hf))
    assert chosen.neuron_config.torch_dtype == torch.float16  # the user's dtype stays


class _OldConfig:
    """A config object of an older transformers: ``torch_dtype`` (not ``dtype``) and no attribute map."""

    def __init__(self, **fields):
        self.fields = fields

    def to_dict(self):
        return dict(self.fields)


@pytest.mark.parametrize("fields", [dict(torch_dtype="float16"), dict(dtype="float16", torch_dtype="float16"),
                                    dict(dtype=None, torch_dtype="float16")])
def test_load_pretrained_config_from_other_config_objects(fields):
    config = inf.InferenceConfig(inf.MoENeuronConfig(), load_config=inf.load_pretrained_config(
        hf_config=_OldConfig(hidden_size=8, **fields)))
    assert config.neuron_config.torch_dtype == torch.float16 and config.hidden_size == 8
    assert "torch_dtype" not in vars(config) and "dtype" not in vars(config)
    assert config.attribute_map == {}


def test_load_pretrained_config_names_a_bad_checkpoint_dtype():
    with pytest.raises(TypeError, match="^the checkpoint's dtype must be a floating torch.dtype or one of"):
        inf.InferenceConfig(inf.MoENeuronConfig(), load_config=inf.load_pretrained_config(
            hf_config=_OldConfig(dtype="int8")))


def test_load_pretrained_config_keeps_nested_configs_as_namespaces():
    from transformers import Llama4Config

    hf = Llama4Config(text_config=dict(hidden_size=8, num_attention_heads=2, vocab_size=32))
    config = inf.InferenceConfig(inf.MoENeuronConfig(), load_config=inf.load_pretrained_config(hf_config=hf))
    assert isinstance(config.text_config, SimpleNamespace) and config.text_config.hidden_size == 8
    assert config.get_text_config() is config.text_config
    assert isinstance(config.boi_token_index, int)  # a plain field stays as it is


def test_load_pretrained_config_from_a_directory(tmp_path):
    _hf_config(torch_dtype="float16").save_pretrained(tmp_path)
    config = inf.MixtralInferenceConfig(inf.MoENeuronConfig(),
                                        load_config=inf.load_pretrained_config(tmp_path))
    assert config._name_or_path == str(tmp_path) and config.hidden_size == 8
    assert config.neuron_config.torch_dtype == torch.float16
    no_dtype = _hf_config()
    no_dtype.torch_dtype = None
    config = inf.MixtralInferenceConfig(inf.MoENeuronConfig(),
                                        load_config=inf.load_pretrained_config(hf_config=no_dtype))
    assert config.neuron_config.torch_dtype == inf.MoENeuronConfig().torch_dtype  # no dtype: the default stays


# ----------------------------------------------------------------------------------------------------------
# the model classes


class _App:
    """The application's stand-in: records how it was made and used."""

    made: list = []

    def __init__(self, how, *args, **kwargs):
        self.how, self.args, self.kwargs, self.calls = how, args, kwargs, []
        _App.made.append(self)

    @classmethod
    def from_compiled(cls, *args, **kwargs):
        return cls("from_compiled", *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls("from_pretrained", *args, **kwargs)

    def compile(self, path):
        self.calls.append(("compile", path))

    def load(self, *args):
        self.calls.append(("load", *args))

    def generate(self, *args, **kwargs):
        self.calls.append(("generate", args, kwargs))
        return "tokens"


@pytest.fixture
def app(monkeypatch):
    _App.made = []
    monkeypatch.setattr(inf, "CausalLMApplication", _App)
    monkeypatch.setenv(inf.DEVICE_VARIABLE, "unset")  # recorded, so that what to_cpu() sets is undone after the test
    monkeypatch.delenv(inf.DEVICE_VARIABLE)
    return _App


def _model_config(**fields):
    return inf.MixtralInferenceConfig(inf.MoENeuronConfig(), hidden_size=8, num_attention_heads=2,
                                      num_hidden_layers=1, num_key_value_heads=1, vocab_size=32,
                                      num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, **fields)


def test_the_model_builds_from_the_checkpoint_the_config_names(tmp_path, app, monkeypatch):
    named, given = tmp_path / "named", tmp_path / "given"
    for d in (named, given):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"")
    model = inf.NeuronMixtralForCausalLM(given, _model_config(_name_or_path=str(named)))
    assert model.model_path == str(given) and model.on_device_sampling is False
    built = model._build()
    assert (built.how, built.args, built.kwargs) == ("from_pretrained", (str(named), model.neuron_config),
                                                     {"device": torch.device("cpu")})
    assert model._build() is built and len(app.made) == 1  # built once
    monkeypatch.setenv(inf.DEVICE_VARIABLE, "meta")
    model = inf.NeuronMixtralForCausalLM(given, _model_config(_name_or_path=str(tmp_path / "empty")))
    assert model._build().args[0] == str(given) and model.application.kwargs["device"] == torch.device("meta")
    (named / "model.safetensors").unlink()
    model = inf.NeuronMixtralForCausalLM(given, _model_config(_name_or_path=str(named)))
    assert model._build().args[0] == str(given)  # the named directory has no checkpoint: model_path's
    with pytest.raises(FileNotFoundError, match=_full(
            f"no safetensors checkpoint at {str(named)!r} (or the config's _name_or_path {str(tmp_path)!r})")):
        inf.NeuronMixtralForCausalLM(named, _model_config(_name_or_path=str(tmp_path)))._build()
    with pytest.raises(FileNotFoundError, match=re.escape("(or the config's _name_or_path None)")):
        inf.NeuronMixtralForCausalLM(named, _model_config())._build()


def test_the_model_from_a_compiled_directory(tmp_path, app, monkeypatch):
    compiled = tmp_path / "compiled"
    config = _model_config(on_device_sampling_config=None)
    config.save(compiled)
    (compiled / MANIFEST_FILE).write_text("{}")
    sampling = inf.MoENeuronConfig(on_device_sampling_config=inf.OnDeviceSamplingConfig())
    model = inf.NeuronMixtralForCausalLM(compiled, neuron_config=sampling)  # config read from the directory
    assert model.config.neuron_config is sampling and model.neuron_config is sampling
    assert model.on_device_sampling is True and model.config.hidden_size == 8
    assert type(model.config) is inf.MixtralInferenceConfig
    monkeypatch.setenv(inf.DEVICE_VARIABLE, "meta")
    built = model._build()
    assert (built.how, built.args, built.kwargs) == ("from_compiled", (str(compiled),),
                                                     {"device": torch.device("meta"), "load": False})
    model.load(tmp_path / "elsewhere")
    assert built.calls == [("load", tmp_path / "elsewhere")]
    assert model.device == torch.device("cpu") and model.reset() is None
    assert inf.NeuronMixtralForCausalLM.get_neuron_config_cls() is inf.MoENeuronConfig
    assert inf.NeuronMixtralForCausalLM.get_config_cls() is inf.MixtralInferenceConfig


def test_compile_writes_the_application_and_the_config(tmp_path, app):
    model = inf.NeuronMixtralForCausalLM(tmp_path, _model_config())
    model.application = _App("given")
    model.compile(tmp_path / "out")
    assert model.application.calls == [("compile", tmp_path / "out")]
    assert json.loads((tmp_path / "out" / CONFIG_FILE).read_text())["hidden_size"] == 8
    model.compile(tmp_path / "dry", dry_run=True)
    assert model.application.calls == [("compile", tmp_path / "out")] and (tmp_path / "dry" / CONFIG_FILE).is_file()


def test_to_cpu_and_generate(tmp_path, app, monkeypatch):
    model = inf.NeuronMixtralForCausalLM(tmp_path, _model_config())
    with pytest.raises(RuntimeError, match=_full(
            "NeuronMixtralForCausalLM: call load(compiled_path) (or to_cpu()) before generating")):
        model.generate(1)
    model.application = _App("given")
    model.to_cpu()
    assert model.application.calls == [("load",)]
    assert os.environ[inf.DEVICE_VARIABLE] == "cpu"
    monkeypatch.setenv(inf.DEVICE_VARIABLE, "meta")
    model.to_cpu()  # a device already chosen stays
    assert os.environ[inf.DEVICE_VARIABLE] == "meta"
    assert model.generate(1, 2, three=3) == "tokens"
    assert model.application.calls[-1] == ("generate", (1, 2), {"three": 3})


def test_the_families_classes():
    expected = {
        inf.NeuronQwen3MoeForCausalLM: ("qwen3_moe", inf.Qwen3MoeInferenceConfig, "Qwen3MoeInferenceConfig",
                                        ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]),
        inf.NeuronMixtralForCausalLM: ("mixtral", inf.MixtralInferenceConfig, "MixtralInferenceConfig",
                                       ["num_local_experts", "num_experts_per_tok", "intermediate_size"]),
        inf.NeuronDbrxForCausalLM: ("dbrx", inf.DbrxInferenceConfig, "DbrxInferenceConfig", None),
    }
    common = ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "vocab_size"]
    for model_cls, (model_type, config_cls, name, extra) in expected.items():
        assert (model_cls.model_type, model_cls.config_cls, config_cls.__name__) == (model_type, config_cls, name)
        assert issubclass(model_cls, inf.NeuronCausalLM) and config_cls.get_neuron_config_cls() is inf.MoENeuronConfig
        assert model_cls.__doc__ == f"NxDI's {model_cls.__name__}, on nxd_moe's application (see NeuronCausalLM)."
        assert config_cls.__doc__ == (f"NxDI's {name}: the {model_type} model's transformers fields and its "
                                      "MoENeuronConfig.")
        required = config_cls.get_required_attributes(None)
        assert required == (["d_model", "n_heads", "n_layers", "vocab_size"] if extra is None else common + extra)


def test_the_family_factory():
    """The families' classes are made at import; the factory, called here, makes them the same way."""
    config_cls, model_cls = inf._family("a_type", "AConfig", "NeuronAForCausalLM", ("width", "depth"))
    assert (config_cls.__name__, model_cls.__name__) == ("AConfig", "NeuronAForCausalLM")
    assert issubclass(config_cls, inf._MoEInferenceConfig) and issubclass(model_cls, inf.NeuronCausalLM)
    assert (model_cls.model_type, model_cls.config_cls) == ("a_type", config_cls)
    assert config_cls.__doc__ == "NxDI's AConfig: the a_type model's transformers fields and its MoENeuronConfig."
    assert model_cls.__doc__ == "NxDI's NeuronAForCausalLM, on nxd_moe's application (see NeuronCausalLM)."
    with pytest.raises(ValueError, match=re.escape("AConfig: the model config lacks ['depth']")):
        config_cls(inf.MoENeuronConfig(), width=2)
    assert config_cls(inf.MoENeuronConfig(), width=2, depth=3).get_required_attributes() == ["width", "depth"]


# ----------------------------------------------------------------------------------------------------------
# HuggingFaceGenerationAdapter


class _Model:
    """A NeuronCausalLM stand-in: records generate's arguments and returns the prompt and 3 new tokens."""

    def __init__(self):
        self.neuron_config, self.config, self.calls = object(), object(), []

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls.append((input_ids, attention_mask, kwargs))
        new = torch.arange(3).expand(input_ids.shape[0], 3) + 100
        if kwargs["on_tokens"] is not None:
            kwargs["on_tokens"](new[:, :2])
            kwargs["on_tokens"](new[:, 2:])
        return SimpleNamespace(sequences=torch.cat([input_ids, new], dim=1))


def test_the_adapter_holds_the_model_and_a_default_generation_config():
    model = _Model()
    adapter = inf.HuggingFaceGenerationAdapter(model)
    assert (adapter.neuron_model, adapter.neuron_config, adapter.config) == (model, model.neuron_config,
                                                                              model.config)
    assert adapter.generation_config.to_dict() == GenerationConfig().to_dict()
    with pytest.raises(ValueError, match=_full("input_start_offsets is not served (prompts start at position 0)")):
        inf.HuggingFaceGenerationAdapter(model, input_start_offsets=[0])


def test_generate_passes_transformers_settings_to_the_loop():
    model = _Model()
    adapter = inf.HuggingFaceGenerationAdapter(model)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 0]])
    out = adapter.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=1, top_k=7, top_p=0.5,
                           temperature=0.75, eos_token_id=[2, 9], pad_token_id=4, sampling_params=object())
    assert torch.equal(out, torch.tensor([[5, 6, 7, 100, 101, 102]]))
    got_ids, got_mask, kwargs = model.calls[-1]
    assert got_ids is ids and got_mask is mask
    assert kwargs == dict(max_new_tokens=3, do_sample=True, top_k=7, top_p=0.5, temperature=0.75,
                          eos_token_id=[2, 9], pad_token_id=4, on_tokens=None)
    assert adapter.generation_config.to_dict() == GenerationConfig().to_dict()  # a copy was updated


def test_generate_from_a_generation_config_and_inputs():
    model = _Model()
    adapter = inf.HuggingFaceGenerationAdapter(model)
    config = GenerationConfig(max_length=9, do_sample=False, top_k=3, eos_token_id=None, pad_token_id=None)
    before = config.to_dict()
    out = adapter.generate(inputs=torch.tensor([[5, 6]]), generation_config=config, return_dict_in_generate=True)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput" and out.sequences.tolist() == [[5, 6, 100, 101, 102]]
    _, mask, kwargs = model.calls[-1]
    assert mask is None and kwargs["max_new_tokens"] == 7 and kwargs["eos_token_id"] == [] and kwargs["top_k"] == 3
    assert kwargs["do_sample"] is False and kwargs["pad_token_id"] is None
    assert config.to_dict() == before  # the caller's config is not changed
    config = GenerationConfig(max_length=9, return_dict_in_generate=True)
    assert type(adapter.generate(torch.tensor([[5]]), config)).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.is_tensor(adapter.generate(torch.tensor([[5]]), config, return_dict_in_generate=False))
    with pytest.raises(ValueError, match=_full("generate: input_ids is required")):
        adapter.generate()


def test_generate_one_token_past_max_length():
    model = _Model()
    adapter = inf.HuggingFaceGenerationAdapter(model)
    with pytest.warns(UserWarning, match=_full(
            "generate: max_length (3) <= the input's 3 positions; generating one token")) as warned:
        adapter.generate(torch.tensor([[5, 6, 7]]), max_length=3)
    assert model.calls[-1][2]["max_new_tokens"] == 1
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames: the stacklevel is not seen there
        assert warned[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter.generate(torch.tensor([[5, 6, 7]]), max_length=4)  # one position left: one token, no warning
    assert model.calls[-1][2]["max_new_tokens"] == 1


def test_generate_streams_the_prompt_then_each_token():
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], 0

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended += 1

    streamer = Recorder()
    inf.HuggingFaceGenerationAdapter(_Model()).generate(torch.tensor([[5, 6]]), max_new_tokens=3, streamer=streamer)
    assert streamer.puts == [[[5, 6]], [100], [101], [102]] and streamer.ended == 1


@pytest.mark.parametrize("name,value", [("num_beams", 2), ("num_return_sequences", 3), ("repetition_penalty", 1.25),
                                        ("no_repeat_ngram_size", 2), ("min_new_tokens", 2), ("min_length", 4),
                                        ("min_new_tokens", 0), ("min_length", 1),
                                        ("output_scores", True), ("output_logits", True)])
def test_generate_refuses_settings_the_loop_does_not_apply(name, value):
    adapter = inf.HuggingFaceGenerationAdapter(_Model())
    with pytest.raises(ValueError, match=_full(
            f"generate: {name}={value!r} is not served by nxd_moe's device loop (greedy or top-k / top-p / "
            "temperature sampling, EOS, max_length / max_new_tokens)")):
        # (transformers refuses several sequences of a greedy search itself: sampling on)
        adapter.generate(torch.tensor([[5]]), max_new_tokens=2, do_sample=True, **{name: value})


def test_generate_accepts_the_unserved_settings_at_their_defaults_and_refuses_unknown_arguments():
    model = _Model()
    adapter = inf.HuggingFaceGenerationAdapter(model)
    adapter.generate(torch.tensor([[5]]), max_new_tokens=2, num_beams=1, min_length=0, repetition_penalty=1.0,
                     min_new_tokens=None, output_scores=False)
    assert len(model.calls) == 1
    with pytest.raises(TypeError, match=_full("generate: unexpected argument(s) ['a_width', 'z_width']")):
        adapter.generate(torch.tensor([[5]]), max_new_tokens=2, z_width=2, a_width=1)


# ----------------------------------------------------------------------------------------------------------
# benchmark_sampling


class _BenchModel:
    def __init__(self, **neuron):
        self.neuron_config = SimpleNamespace(**{**dict(batch_size=2, max_context_length=4, max_length=10,
                                                       max_new_tokens=None), **neuron})
        self.config = object()
        self.calls = []
        self.application = SimpleNamespace(last_timings=None)
        self.step = 0

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls.append((input_ids, attention_mask, kwargs))
        self.step += 1
        self.application.last_timings = {"context_encoding_s": 0.001 * self.step,
                                         "token_generation_s": 0.004 * self.step, "steps": 5}
        return SimpleNamespace(sequences=input_ids)


def test_benchmark_sampling_report(tmp_path, capsys):
    model = _BenchModel()
    config = GenerationConfig(top_k=5, eos_token_id=7)
    report = inf.benchmark_sampling(model, generation_config=config, num_runs=3,
                                    benchmark_report_path=str(tmp_path / "report.json"))
    assert config.eos_token_id == 7  # a copy gets EOS off
    assert len(model.calls) == 4  # a warm-up, then the runs
    ids = torch.tensor([[44, 39, 33, 60], [63, 79, 27, 3]])  # torch.randint(0, 100) after seed 0, as NxDI's
    for got_ids, mask, kwargs in model.calls:
        assert torch.equal(got_ids, ids) and torch.equal(mask, torch.ones_like(ids))
        assert (kwargs["max_new_tokens"], kwargs["eos_token_id"], kwargs["top_k"]) == (6, [], 5)
    assert set(report) == {"e2e_model", "context_encoding_model", "token_generation_model"}
    cte = report["context_encoding_model"]  # the runs' timings: 2, 3, 4 ms (the warm-up's 1 ms is not counted)
    assert cte["latency_ms_p50"] == pytest.approx(3.0) and cte["latency_ms_p100"] == pytest.approx(4.0)
    assert cte["latency_ms_avg"] == pytest.approx(3.0)
    assert cte["throughput"] == pytest.approx(3 * 4 * 2 / 0.009)  # context tokens per run: length * batch
    assert set(cte) == {"latency_ms_p50", "latency_ms_p90", "latency_ms_p95", "latency_ms_p99", "latency_ms_p100",
                        "latency_ms_avg", "throughput"}
    assert cte["latency_ms_p90"] == pytest.approx(3.8) and cte["latency_ms_p95"] == pytest.approx(3.9)
    assert cte["latency_ms_p99"] == pytest.approx(3.98)
    tkg = report["token_generation_model"]  # per step: 0.004 * step / (5 - 1) s
    assert tkg["latency_ms_p50"] == pytest.approx(3.0) and tkg["throughput"] == pytest.approx(3 * 2 / 0.009)
    e2e = report["e2e_model"]
    assert e2e["throughput"] == pytest.approx(3 * 10 * 2 / (e2e["latency_ms_avg"] * 3e-3))
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert (tmp_path / "report.json").read_text() == json.dumps(report, indent=4) + "\n"
    assert json.loads(capsys.readouterr().out) == report


def test_benchmark_sampling_prompt_length_and_new_tokens(tmp_path):
    model = _BenchModel(max_context_length=10, max_length=10, max_new_tokens=3)  # context = max_length: half
    inf.benchmark_sampling(model, num_runs=1, benchmark_report_path=str(tmp_path / "r.json"))
    ids, _, kwargs = model.calls[0]
    assert ids.tolist() == [[44, 39, 33, 60, 63], [79, 27, 3, 97, 83]]
    assert (kwargs["max_new_tokens"], kwargs["eos_token_id"]) == (3, [])
    one = _BenchModel()
    one.application.last_timings = None

    def one_step(input_ids, attention_mask, **kwargs):
        one.application.last_timings = {"context_encoding_s": 0.5, "token_generation_s": 0.25, "steps": 1}
        return SimpleNamespace(sequences=input_ids)

    one.generate = one_step
    report = inf.benchmark_sampling(one, num_runs=1, benchmark_report_path=str(tmp_path / "one.json"))
    assert report["token_generation_model"]["latency_ms_avg"] == pytest.approx(250.0)  # 1 step: divided by 1


def test_benchmark_sampling_defaults(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = _BenchModel()
    report = inf.benchmark_sampling(model)
    assert len(model.calls) == 21  # a warm-up and NxDI's 20 runs
    assert json.loads((tmp_path / "benchmark_report.json").read_text()) == report
    assert capsys.readouterr().out == json.dumps(report, indent=4) + "\n"
    # the stand-in's runs take microseconds: the latencies are differences of the clock, not sums
    assert 0 < report["e2e_model"]["latency_ms_p100"] < 1000


def test_benchmark_sampling_refusals(tmp_path):
    message = _full("benchmark_sampling: draft models and images are not served")
    with pytest.raises(ValueError, match=message):
        inf.benchmark_sampling(_BenchModel(), draft_model=object())
    with pytest.raises(ValueError, match=message):
        inf.benchmark_sampling(_BenchModel(), image=True)


def test_the_served_module_paths():
    assert inf.FAMILIES["neuronx_distributed_inference.utils.benchmark"] == {
        "benchmark_sampling": inf.benchmark_sampling}
    assert copy.copy(inf.FAMILIES["neuronx_distributed_inference.models.config"]) == dict(
        NeuronConfig=inf.NeuronConfig, MoENeuronConfig=inf.MoENeuronConfig,
        OnDeviceSamplingConfig=inf.OnDeviceSamplingConfig, InferenceConfig=inf.InferenceConfig)
    assert Path(inf.__file__).name == "inference.py"
