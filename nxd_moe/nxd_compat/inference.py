"""NxD Inference's application API, served by :mod:`nxd_moe.application`: what an NxDI MoE script imports.

- ``models.config``: :class:`NeuronConfig`, :class:`MoENeuronConfig` (NxDI's fields; see
  :class:`~nxd_moe.application.ApplicationConfig` for which are served, ignored with a warning, or refused),
  :class:`OnDeviceSamplingConfig`, :class:`InferenceConfig` (the model's transformers config fields plus
  ``neuron_config``; ``save`` / ``load`` of ``neuron_config.json``);
- per family, the ``...InferenceConfig`` and ``Neuron...ForCausalLM`` classes at NxDI's module paths
  (:data:`FAMILIES`): ``NeuronQwen3MoeForCausalLM(model_path, config)``, ``.compile(path)``, ``.load(path)``;
- ``utils.hf_adapter``: :class:`HuggingFaceGenerationAdapter` (``generate`` with transformers' arguments, run by the
  application's own loop: no host in the token loop) and :func:`load_pretrained_config`;
- ``utils.benchmark``: :func:`benchmark_sampling` (NxDI's latency report).

Where the model runs: the CPU, or the device named by the environment variable ``NXD_MOE_DEVICE`` (e.g. ``cuda``),
so NxDI's script runs unchanged on a GPU. Weights come from the checkpoint the config names (``_name_or_path``, as
NxDI reads it), else from ``model_path``, else from ``weights/`` of a compiled directory.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from nxd_moe.application import ApplicationConfig, CausalLMApplication, SamplingConfig
from nxd_moe.application.artifacts import CONFIG_FILE, MANIFEST_FILE
from nxd_moe.checks import to_torch_dtype

__all__ = ["FAMILIES", "HuggingFaceGenerationAdapter", "InferenceConfig", "MoENeuronConfig", "NeuronConfig",
           "OnDeviceSamplingConfig", "benchmark_sampling", "load_pretrained_config"]

DEVICE_VARIABLE = "NXD_MOE_DEVICE"


class NeuronConfig(ApplicationConfig):
    """NxDI's ``NeuronConfig(**kwargs)``: every NxDI field is an attribute; an unknown one is warned about, as NxDI
    does (:class:`~nxd_moe.application.ApplicationConfig` refuses it)."""

    def __init__(self, **kwargs: Any):
        overrides = kwargs.pop("overrides_torch_dtype", "torch_dtype" in kwargs)
        super().__init__(strict=False, **kwargs)
        self.overrides_torch_dtype = overrides  # load_pretrained_config leaves a dtype the user chose


class MoENeuronConfig(NeuronConfig):
    """NxDI's ``MoENeuronConfig(capacity_factor=None, glu_mlp=True, **kwargs)``."""

    def __init__(self, capacity_factor: float | None = None, glu_mlp: bool = True, **kwargs: Any):
        super().__init__(capacity_factor=capacity_factor, glu_mlp=glu_mlp, **kwargs)


class OnDeviceSamplingConfig:
    """NxDI's ``OnDeviceSamplingConfig(**kwargs)``: ``do_sample``, ``top_k``, ``top_p``, ``temperature``,
    ``dynamic``, ``global_topk`` are served; ``deterministic``, ``top_k_kernel_enabled``, ``sampling_dp_degree``,
    ``on_device_sampling_config`` choose Neuron kernels and are kept as attributes."""

    _DEFAULTS = {"do_sample": False, "top_k": 1, "top_p": 1.0, "temperature": 1.0, "dynamic": False,
                 "deterministic": False, "global_topk": 256, "on_device_sampling_config": True,
                 "top_k_kernel_enabled": False, "sampling_dp_degree": 1}

    def __init__(self, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(self._DEFAULTS))
        if unknown:
            raise TypeError(f"OnDeviceSamplingConfig: unknown field(s) {unknown}; fields: {sorted(self._DEFAULTS)}")
        for name, default in self._DEFAULTS.items():
            setattr(self, name, kwargs.get(name, default))
        SamplingConfig(**{k: getattr(self, k) for k in SamplingConfig.__dataclass_fields__})  # checks the values


class InferenceConfig:
    """NxDI's ``InferenceConfig(neuron_config, fused_spec_config=None, load_config=None, metadata=None, **kwargs)``:
    the model's fields (from ``load_config``, e.g. :func:`load_pretrained_config`, then ``kwargs``) and
    ``neuron_config``."""

    attribute_map: dict[str, str] = {}

    def __init__(self, neuron_config: NeuronConfig, fused_spec_config=None, load_config: Callable | None = None,
                 metadata: dict | None = None, **kwargs: Any):
        if not isinstance(neuron_config, ApplicationConfig):
            raise TypeError(f"neuron_config must be a (MoE)NeuronConfig, got {type(neuron_config).__name__}")
        if fused_spec_config is not None:
            raise ValueError("fused_spec_config: speculative decoding is not served by nxd_moe's application")
        self.neuron_config = neuron_config
        self.fused_spec_config = None
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def __getattr__(self, name: str) -> Any:
        # the transformers config's aliases (Qwen3-MoE's num_experts is num_local_experts), as NxDI keeps them
        aliases = self.__dict__.get("attribute_map") or type(self).attribute_map
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        aliases = self.__dict__.get("attribute_map") or type(self).attribute_map
        super().__setattr__(aliases.get(name, name), value)

    def load_config(self) -> None:
        """Sets the model's fields (a subclass or ``load_config`` hook does)."""

    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1

    def get_required_attributes(self) -> list[str]:
        return []

    def validate_config(self) -> None:
        missing = [a for a in self.get_required_attributes() if not hasattr(self, a)]
        if missing:
            raise ValueError(f"{type(self).__name__}: the model config lacks {missing} (give load_config="
                             "load_pretrained_config(model_path), or the fields as keywords)")

    def get_text_config(self):
        return getattr(self, "text_config", None) or self

    # -- neuron_config.json --------------------------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        out = {k: _plain(v) for k, v in vars(self).items() if k not in ("neuron_config", "fused_spec_config")}
        out["neuron_config"] = self.neuron_config.to_dict()
        return out

    def save(self, model_path: str | os.PathLike) -> None:
        Path(model_path).mkdir(parents=True, exist_ok=True)
        (Path(model_path) / CONFIG_FILE).write_text(json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, model_path: str | os.PathLike, **kwargs: Any) -> "InferenceConfig":
        file = Path(model_path) / CONFIG_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{model_path}: no {CONFIG_FILE} (a directory written by compile(path))")
        fields = {**json.loads(file.read_text()), **kwargs}
        neuron = fields.pop("neuron_config")
        if isinstance(neuron, dict):
            with warnings.catch_warnings():  # warned about when it was first built
                warnings.simplefilter("ignore")
                neuron = cls.get_neuron_config_cls()(**neuron)
        return cls(neuron_config=neuron, **fields)

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig

    # -- the transformers config of the model -------------------------------------------------------------
    def to_transformers_config(self, model_type: str):
        from transformers import AutoConfig

        fields = {k: v for k, v in self.to_json_dict().items()
                  if k not in ("neuron_config", "metadata", "num_cores_per_group", "model_type", "attribute_map")}
        return AutoConfig.for_model(model_type, **fields)


def _plain(value: Any) -> Any:
    if isinstance(value, SimpleNamespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


class _MoEInferenceConfig(InferenceConfig):
    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig


def load_pretrained_config(model_path_or_name: str | os.PathLike | None = None, hf_config: Any = None):
    """NxDI's hook: ``InferenceConfig(..., load_config=load_pretrained_config(path))`` takes the model's fields from
    its transformers config (and its dtype, unless the neuron config set one)."""
    if (model_path_or_name is None) == (hf_config is None):
        raise ValueError('load_pretrained_config: give one of "model_path_or_name" or "hf_config"')

    def load_config(self: InferenceConfig) -> None:
        if hf_config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path_or_name)
        else:
            config = hf_config
        fields = config.to_dict()
        dtype = fields.pop("dtype", None) or fields.pop("torch_dtype", None)
        fields.pop("torch_dtype", None)
        if dtype is not None and not self.neuron_config.overrides_torch_dtype:
            self.neuron_config.torch_dtype = to_torch_dtype(dtype, "the checkpoint's dtype")
        import transformers

        base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
        for key, value in fields.items():
            if isinstance(getattr(config, key, None), base) and isinstance(value, dict):
                value = SimpleNamespace(**value)  # nested configs, as NxDI keeps them
            setattr(self, key, value)
        self.attribute_map = dict(getattr(config, "attribute_map", {}))
        if model_path_or_name is not None and os.path.isdir(model_path_or_name):
            self._name_or_path = str(model_path_or_name)

    return load_config


class NeuronCausalLM:
    """NxDI's ``Neuron...ForCausalLM(model_path, config=None, neuron_config=None)`` of one family: ``compile(path)``,
    ``load(path)`` (or ``to_cpu()``), then :class:`HuggingFaceGenerationAdapter` or :meth:`generate`.

    ``model_path``: the checkpoint directory, or a compiled directory (``config`` None: read from its
    ``neuron_config.json``)."""

    model_type = ""
    config_cls: type[InferenceConfig] = _MoEInferenceConfig

    def __init__(self, model_path: str | os.PathLike, config: InferenceConfig | None = None,
                 neuron_config: NeuronConfig | None = None):
        if config is None:
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_path = str(model_path)
        self.on_device_sampling = self.neuron_config.on_device_sampling_config is not None
        self.application: CausalLMApplication | None = None

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return cls.config_cls

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig

    def _build(self) -> CausalLMApplication:
        """The application: from a compiled directory (``model_path`` holds a manifest) or from the checkpoint the
        config names (``_name_or_path``, else ``model_path``), on the CPU or ``$NXD_MOE_DEVICE``."""
        if self.application is not None:
            return self.application
        device = torch.device(os.environ.get(DEVICE_VARIABLE, "cpu"))
        if (Path(self.model_path) / MANIFEST_FILE).is_file():
            self.application = CausalLMApplication.from_compiled(self.model_path, device=device, load=False)
        else:
            checkpoint = next((c for c in (getattr(self.config, "_name_or_path", None), self.model_path)
                               if c and any(Path(c).glob("*.safetensors"))), None)
            if checkpoint is None:
                raise FileNotFoundError(f"no safetensors checkpoint at {self.model_path!r} (or the config's "
                                        f"_name_or_path {getattr(self.config, '_name_or_path', None)!r})")
            self.application = CausalLMApplication.from_pretrained(checkpoint, self.neuron_config, device=device)
        return self.application

    def compile(self, compiled_model_path: str | os.PathLike, debug: bool = False, pre_shard_weights_hook=None,
                dry_run: bool = False, disable_fail_fast: bool = False) -> None:
        """Write the compiled application (see :meth:`CausalLMApplication.compile`) and this config's
        ``neuron_config.json`` to ``compiled_model_path``."""
        app = self._build()
        if not dry_run:
            app.compile(compiled_model_path)
        self.config.save(compiled_model_path)

    def load(self, compiled_model_path: str | os.PathLike, start_rank_id=None, local_ranks_size=None,
             skip_warmup: bool = False) -> None:
        app = self._build()
        app.load(compiled_model_path)

    def to_cpu(self) -> None:
        """NxDI's CPU mode: the model on the CPU, no compiled directory."""
        os.environ.setdefault(DEVICE_VARIABLE, "cpu")
        self._build().load()

    def reset(self) -> None:
        """Nothing to reset: every generate starts from its own prompts."""

    def generate(self, *args, **kwargs):
        if self.application is None:
            raise RuntimeError(f"{type(self).__name__}: call load(compiled_path) (or to_cpu()) before generating")
        return self.application.generate(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


# transformers generation settings the device loop does not apply: a non-default value is refused by name
_UNSERVED_GENERATION = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
                        "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0,
                        "output_scores": False, "output_logits": False, "assistant_model": None}


class HuggingFaceGenerationAdapter:
    """NxDI's adapter: ``generate`` with transformers' arguments (``input_ids``, ``attention_mask``,
    ``generation_config``, ``max_length`` / ``max_new_tokens``, ``do_sample``, ``top_k``, ``top_p``,
    ``temperature``, ``eos_token_id``, ``pad_token_id``, ``streamer``, ``return_dict_in_generate``), run by the
    application's loop. Returns what transformers' ``generate`` returns: the input ids followed by the new tokens."""

    def __init__(self, model: NeuronCausalLM, input_start_offsets=None, capture_draft_logits: bool = False):
        if input_start_offsets is not None:
            raise ValueError("input_start_offsets is not served (prompts start at position 0)")
        self.neuron_model = model
        self.neuron_config = model.neuron_config
        self.config = model.config
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig()

    def generate(self, input_ids: torch.Tensor | None = None, generation_config=None, **kwargs: Any):
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if input_ids is None:
            raise ValueError("generate: input_ids is required")
        config = copy.deepcopy(generation_config or self.generation_config)
        attention_mask = kwargs.pop("attention_mask", None)
        streamer = kwargs.pop("streamer", None)
        return_dict = kwargs.pop("return_dict_in_generate", config.return_dict_in_generate)
        kwargs.pop("sampling_params", None)  # NxDI's benchmark passes them; generation_config holds the same values
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        unknown = sorted(k for k in kwargs if not hasattr(config, k))
        if unknown:
            raise TypeError(f"generate: unexpected argument(s) {unknown}")
        for name, default in _UNSERVED_GENERATION.items():
            value = getattr(config, name, default)
            if value not in (default, None) and not (name == "min_length" and value == 0):
                raise ValueError(f"generate: {name}={value!r} is not served by nxd_moe's device loop (greedy or "
                                 "top-k / top-p / temperature sampling, EOS, max_length / max_new_tokens)")
        width = input_ids.shape[1]
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = config.max_length - width
            if max_new < 1:  # transformers warns and still generates one token
                warnings.warn(f"generate: max_length ({config.max_length}) <= the input's {width} positions; "
                              "generating one token", stacklevel=2)
                max_new = 1
        on_tokens = None
        if streamer is not None:
            streamer.put(input_ids.cpu())

            def on_tokens(block: torch.Tensor) -> None:
                for i in range(block.shape[1]):
                    streamer.put(block[:, i])
        eos = config.eos_token_id
        out = self.neuron_model.generate(
            input_ids, attention_mask, max_new_tokens=max_new, do_sample=bool(config.do_sample),
            top_k=config.top_k, top_p=config.top_p, temperature=config.temperature,
            eos_token_id=[] if eos is None else eos, pad_token_id=config.pad_token_id, on_tokens=on_tokens)
        if streamer is not None:
            streamer.end()
        if return_dict:
            from transformers.generation import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=out.sequences)
        return out.sequences


def benchmark_sampling(model: NeuronCausalLM, draft_model=None, generation_config=None, target: str | None = None,
                       image: bool = False, num_runs: int = 20,
                       benchmark_report_path: str = "./benchmark_report.json") -> dict:
    """NxDI's end-to-end latency report: ``num_runs`` generations of ``batch_size`` random prompts of
    ``max_context_length`` tokens (half of it when that is ``max_length``) to ``max_length`` (EOS off), after one
    warm-up; latency percentiles and throughput (``max_length * batch_size`` tokens per run, NxDI's count), and the
    context-encoding and token-generation parts of each run, written to ``benchmark_report_path``."""
    if draft_model is not None or image:
        raise ValueError("benchmark_sampling: draft models and images are not served")
    from transformers import GenerationConfig

    torch.manual_seed(0)
    nc = model.neuron_config
    length = nc.max_context_length if nc.max_context_length < nc.max_length else nc.max_context_length // 2
    ids = torch.randint(0, 100, (nc.batch_size, length))
    config = copy.deepcopy(generation_config or GenerationConfig())
    config.eos_token_id = []
    adapter = HuggingFaceGenerationAdapter(model)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=nc.max_new_tokens,
                  max_length=nc.max_length if nc.max_new_tokens is None else None)
    adapter.generate(ids, generation_config=config, **kwargs)
    e2e, cte, tkg = [], [], []
    for _ in range(num_runs):
        start = time.perf_counter()
        adapter.generate(ids, generation_config=config, **kwargs)
        e2e.append(time.perf_counter() - start)
        timings = model.application.last_timings
        cte.append(timings["context_encoding_s"])
        tkg.append(timings["token_generation_s"] / max(timings["steps"] - 1, 1))

    def report(latencies: list[float], tokens: int) -> dict:
        a = np.array(latencies)
        out = {f"latency_ms_p{p}": float(np.percentile(a, p) * 1e3) for p in (50, 90, 95, 99, 100)}
        out.update(latency_ms_avg=float(a.mean() * 1e3), throughput=float(num_runs * tokens / a.sum()))
        return out

    result = {"e2e_model": report(e2e, nc.max_length * nc.batch_size),
              "context_encoding_model": report(cte, length * nc.batch_size),
              "token_generation_model": report(tkg, nc.batch_size)}
    Path(benchmark_report_path).write_text(json.dumps(result, indent=4) + "\n")
    print(json.dumps(result, indent=4))
    return result


# --------------------------------------------------------------------------------------------------------------
# the families NxDI's releases ship, at its module paths: (module, config class, neuron config class, model class)

def _family(model_type: str, config_name: str, model_name: str, required: tuple[str, ...]):
    config_cls = type(config_name, (_MoEInferenceConfig,), {
        "get_required_attributes": lambda self: list(required),
        "__doc__": f"NxDI's {config_name}: the {model_type} model's transformers fields and its MoENeuronConfig."})
    model_cls = type(model_name, (NeuronCausalLM,), {
        "model_type": model_type, "config_cls": config_cls,
        "__doc__": f"NxDI's {model_name}, on nxd_moe's application (see NeuronCausalLM)."})
    return config_cls, model_cls


# One line per NxD Inference model family (a table: each family's config and model class names).
_COMMON = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "vocab_size")
Qwen3MoeInferenceConfig, NeuronQwen3MoeForCausalLM = _family(
    "qwen3_moe", "Qwen3MoeInferenceConfig", "NeuronQwen3MoeForCausalLM",
    _COMMON + ("num_experts", "num_experts_per_tok", "moe_intermediate_size"))
MixtralInferenceConfig, NeuronMixtralForCausalLM = _family(
    "mixtral", "MixtralInferenceConfig", "NeuronMixtralForCausalLM",
    _COMMON + ("num_local_experts", "num_experts_per_tok", "intermediate_size"))
GptOssInferenceConfig, NeuronGptOssForCausalLM = _family(
    "gpt_oss", "GptOssInferenceConfig", "NeuronGptOssForCausalLM",
    _COMMON + ("num_local_experts", "num_experts_per_tok", "intermediate_size"))
LlamaInferenceConfig, NeuronLlama4TextForCausalLM = _family(
    "llama4_text", "LlamaInferenceConfig", "NeuronLlama4TextForCausalLM",
    _COMMON + ("num_local_experts", "num_experts_per_tok", "intermediate_size"))
DeepseekV3InferenceConfig, NeuronDeepseekV3ForCausalLM = _family(
    "deepseek_v3", "DeepseekV3InferenceConfig", "NeuronDeepseekV3ForCausalLM",
    ("hidden_size", "num_attention_heads", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
     "moe_intermediate_size", "vocab_size"))
DbrxInferenceConfig, NeuronDbrxForCausalLM = _family(
    "dbrx", "DbrxInferenceConfig", "NeuronDbrxForCausalLM", ("d_model", "n_heads", "n_layers", "vocab_size"))


class GptOssNeuronConfig(MoENeuronConfig):
    """NxDI's GPT-OSS neuron config (its architecture fields come from the checkpoint here)."""


class NeuronDbrxConfig(MoENeuronConfig):
    """NxDI's DBRX neuron config."""


INFERENCE = "neuronx_distributed_inference"
# module path -> names it serves
FAMILIES: dict[str, dict[str, Any]] = {
    f"{INFERENCE}.models.qwen3_moe.modeling_qwen3_moe": dict(
        Qwen3MoeInferenceConfig=Qwen3MoeInferenceConfig, NeuronQwen3MoeForCausalLM=NeuronQwen3MoeForCausalLM),
    f"{INFERENCE}.models.mixtral.modeling_mixtral": dict(
        MixtralInferenceConfig=MixtralInferenceConfig, NeuronMixtralForCausalLM=NeuronMixtralForCausalLM),
    f"{INFERENCE}.models.gpt_oss.modeling_gpt_oss": dict(
        GptOssInferenceConfig=GptOssInferenceConfig, GptOssNeuronConfig=GptOssNeuronConfig,
        NeuronGptOssForCausalLM=NeuronGptOssForCausalLM),
    f"{INFERENCE}.models.llama4.modeling_llama4_text": dict(
        LlamaInferenceConfig=LlamaInferenceConfig, NeuronLlama4TextForCausalLM=NeuronLlama4TextForCausalLM),
    f"{INFERENCE}.models.deepseek.modeling_deepseek": dict(
        DeepseekV3InferenceConfig=DeepseekV3InferenceConfig, NeuronDeepseekV3ForCausalLM=NeuronDeepseekV3ForCausalLM),
    f"{INFERENCE}.models.dbrx.modeling_dbrx": dict(
        DbrxInferenceConfig=DbrxInferenceConfig, NeuronDbrxConfig=NeuronDbrxConfig,
        NeuronDbrxForCausalLM=NeuronDbrxForCausalLM),
    f"{INFERENCE}.models.config": dict(
        NeuronConfig=NeuronConfig, MoENeuronConfig=MoENeuronConfig, OnDeviceSamplingConfig=OnDeviceSamplingConfig,
        InferenceConfig=InferenceConfig),
    f"{INFERENCE}.utils.hf_adapter": dict(
        HuggingFaceGenerationAdapter=HuggingFaceGenerationAdapter, load_pretrained_config=load_pretrained_config),
    f"{INFERENCE}.utils.benchmark": dict(benchmark_sampling=benchmark_sampling),
}
