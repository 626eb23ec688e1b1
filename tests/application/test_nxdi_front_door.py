"""NxD Inference's application API through the front door: a script in NxDI's own shape -- ``MoENeuronConfig``,
the family's ``InferenceConfig`` with ``load_pretrained_config``, ``Neuron...ForCausalLM(path, config)``,
``compile``, a fresh model from the compiled directory, ``load``, ``HuggingFaceGenerationAdapter.generate``,
``benchmark_sampling`` -- on a local checkpoint of every family served, its tokens equal to transformers'
``generate`` on the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from nxd_moe.models.checkpoint import write_checkpoint  # noqa: E402
from nxd_moe.nxd_compat import installed  # noqa: E402

FAMILIES = {"qwen3-30b-a3b": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeInferenceConfig", "NeuronQwen3MoeForCausalLM"),
            "mixtral-8x7b": ("mixtral.modeling_mixtral", "MixtralInferenceConfig", "NeuronMixtralForCausalLM"),
            "gpt-oss-20b": ("gpt_oss.modeling_gpt_oss", "GptOssInferenceConfig", "NeuronGptOssForCausalLM"),
            "llama4-scout": ("llama4.modeling_llama4_text", "LlamaInferenceConfig", "NeuronLlama4TextForCausalLM"),
            "deepseek-v3": ("deepseek.modeling_deepseek", "DeepseekV3InferenceConfig", "NeuronDeepseekV3ForCausalLM"),
            "dbrx": ("dbrx.modeling_dbrx", "DbrxInferenceConfig", "NeuronDbrxForCausalLM")}


def nxdi_script(model_path: Path, traced: Path, family: tuple[str, str, str], ids, mask, max_length: int):
    """What an NxDI user writes (the config values differ from NxDI's defaults)."""
    import importlib

    from transformers import GenerationConfig

    with installed():
        config_module = importlib.import_module("neuronx_distributed_inference.models.config")
        module = importlib.import_module(f"neuronx_distributed_inference.models.{family[0]}")
        adapter_module = importlib.import_module("neuronx_distributed_inference.utils.hf_adapter")
        neuron_config = config_module.MoENeuronConfig(
            tp_degree=1, batch_size=4, ctx_batch_size=2, seq_len=48, max_context_length=16,
            torch_dtype=torch.float32, enable_bucketing=True, context_encoding_buckets=[8, 16],
            token_generation_buckets=[24, 48], fused_qkv=True,
            on_device_sampling_config=config_module.OnDeviceSamplingConfig(do_sample=False, top_k=1))
        config = getattr(module, family[1])(neuron_config,
                                            load_config=adapter_module.load_pretrained_config(model_path))
        model = getattr(module, family[2])(model_path, config)
        model.compile(traced)
        model = getattr(module, family[2])(traced)
        model.load(traced)
        out = adapter_module.HuggingFaceGenerationAdapter(model).generate(
            ids, generation_config=GenerationConfig.from_pretrained(model_path), attention_mask=mask,
            max_length=max_length)
        return out, model


@pytest.mark.filterwarnings("ignore::nxd_moe.application.NxDIFieldWarning")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_nxdi_script_generates_transformers_tokens(tmp_path, name):
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = write_checkpoint(tmp_path / "model", name, num_layers=1, scale=32, seed=6, max_new_tokens=None)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    lengths = [3, 7, 5]
    vocab = reference.config.get_text_config().vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    right = torch.zeros(3, 7, dtype=torch.long)
    right_mask = torch.zeros_like(right)
    left, left_mask = torch.zeros_like(right), torch.zeros_like(right)
    for b, p in enumerate(prompts):
        right[b, :len(p)], right_mask[b, :len(p)] = p, 1
        left[b, 7 - len(p):], left_mask[b, 7 - len(p):] = p, 1
    out, model = nxdi_script(path, tmp_path / "traced", FAMILIES[name], right, right_mask, max_length=30)
    with torch.no_grad():
        expected = reference.generate(left, attention_mask=left_mask, max_length=30,
                                      generation_config=GenerationConfig.from_pretrained(path))
    assert out.shape == expected.shape
    assert torch.equal(out[:, 7:], expected[:, 7:]), name
    compiled = json.loads((tmp_path / "traced" / "neuron_config.json").read_text())
    assert compiled["neuron_config"]["ctx_batch_size"] == 2 and compiled["model_type"] == model.model_type


@pytest.mark.filterwarnings("ignore::nxd_moe.application.NxDIFieldWarning")
def test_benchmark_sampling_writes_nxdis_report(tmp_path):
    path = write_checkpoint(tmp_path / "model", "qwen3-30b-a3b", num_layers=1, scale=16, max_new_tokens=None)
    ids = torch.ones(1, 3, dtype=torch.long)
    _, model = nxdi_script(path, tmp_path / "traced", FAMILIES["qwen3-30b-a3b"], ids, torch.ones_like(ids), 8)
    with installed():
        from neuronx_distributed_inference.utils.benchmark import benchmark_sampling

        report = benchmark_sampling(model, generation_config=None, num_runs=2,
                                    benchmark_report_path=str(tmp_path / "report.json"))
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert set(report) == {"e2e_model", "context_encoding_model", "token_generation_model"}
    assert report["e2e_model"]["latency_ms_p50"] > report["context_encoding_model"]["latency_ms_p50"] > 0


def test_a_compiled_directory_of_another_model_is_refused(tmp_path):
    from nxd_moe.application import ApplicationConfig, CausalLMApplication
    from nxd_moe.models.hf_models import build_hf_model

    config = ApplicationConfig(batch_size=1, seq_len=16, torch_dtype="float32")
    one = CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=1, scale=16), config)
    manifest = one.compile(tmp_path / "one", xla=False)
    assert manifest["hlo"] == "no HLO written: not asked for (compile(xla=False))"
    assert set(manifest["programs"]) == {"context_encoding_16", "token_generation_16"}
    assert manifest["programs"]["token_generation_16"]["aliases"]["cache.keys_0"] == "cache.keys_0"
    other = CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=2, scale=16), config)
    with pytest.raises(ValueError, match=r"compiled for another model \(differs in \['num_hidden_layers'"):
        other.load(tmp_path / "one")
    with pytest.raises(FileNotFoundError, match="not a compiled application directory"):
        other.load(tmp_path)


NXDI_DEMO = "examples/generation_qwen3_moe_demo.py"


@pytest.mark.slow
def test_nxdis_own_demo_script_runs_unchanged(tmp_path):
    """NxDI's Qwen3-MoE demo (from a checkout named by NXDI_CHECKOUT, not committed here) with only its model path
    pointing at a local checkpoint, run through ``python -m nxd_moe.nxd_compat``."""
    checkout = os.environ.get("NXDI_CHECKOUT")
    if not checkout or not (Path(checkout) / NXDI_DEMO).is_file():
        pytest.skip("set NXDI_CHECKOUT to a checkout of aws-neuron/neuronx-distributed-inference")
    path = write_checkpoint(tmp_path / "qwen3", "qwen3-30b-a3b", num_layers=2, scale=16)
    script = (Path(checkout) / NXDI_DEMO).read_text().replace("/shared/cache/checkpoints/qwen/qwen-3-235b", str(path))
    (tmp_path / "demo.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "nxd_moe.nxd_compat", str(tmp_path / "demo.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=7200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Generated outputs:" in done.stdout and (tmp_path / "benchmark_report.json").is_file()


@pytest.mark.filterwarnings("ignore::nxd_moe.application.NxDIFieldWarning")
def test_adapter_streams_the_prompt_then_every_token_and_refuses_what_it_does_not_apply(tmp_path):
    """transformers' streamer protocol: the prompt first, then each new token, then end(); settings the device loop
    does not apply (beams, repetition penalty) are refused by name."""
    path = write_checkpoint(tmp_path / "model", "qwen3-30b-a3b", num_layers=1, scale=16, max_new_tokens=None)
    ids = torch.tensor([[5, 6, 7]])
    _, model = nxdi_script(path, tmp_path / "traced", FAMILIES["qwen3-30b-a3b"], ids, torch.ones_like(ids), 8)

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    with installed():
        from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter

        adapter = HuggingFaceGenerationAdapter(model)
        streamer = Recorder()
        out = adapter.generate(ids, max_new_tokens=6, eos_token_id=None, streamer=streamer)
        assert streamer.puts[0] == [[5, 6, 7]] and streamer.ended
        assert [p[0] for p in streamer.puts[1:]] == out[0, 3:].tolist() and len(streamer.puts) == 7
        with pytest.raises(ValueError, match="num_beams=4 is not served"):
            adapter.generate(ids, max_new_tokens=6, num_beams=4)
        with pytest.raises(ValueError, match="repetition_penalty=1.3 is not served"):
            adapter.generate(ids, max_new_tokens=6, repetition_penalty=1.3)
        with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['beam_width'\]"):
            adapter.generate(ids, max_new_tokens=6, beam_width=2)
