"""The application's programs under ``torch_xla`` (CPU client): every bucket of both phases is one static XLA
graph -- one compilation for three inputs that route differently (the first sends every token to the same experts)
and move the cache positions, no CPU fallback, no transfer mid-program -- equal to eager, tokens exactly;
``compile(path)`` writes one HLO per bucket and phase and the manifest that maps them. Negative control: a program
whose sampling reads a device value on the host is reported as not static."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")  # the SPMD programs' ranks (read when the XLA runtime starts)
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("transformers")

from nxd_moe.application import ApplicationConfig, CausalLMApplication, SamplingConfig  # noqa: E402
from nxd_moe.application.xla_programs import program_inputs, program_modules  # noqa: E402
from nxd_moe.models.hf_models import build_hf_model  # noqa: E402
from nxd_moe.trace import check_static  # noqa: E402


def application(name: str, sampling: bool = False) -> CausalLMApplication:
    config = ApplicationConfig(
        batch_size=2, seq_len=32, max_context_length=16, torch_dtype="float32", context_encoding_buckets=[8, 16],
        token_generation_buckets=[16, 32],
        on_device_sampling_config=SamplingConfig(do_sample=True, top_k=5) if sampling else None)
    return CausalLMApplication(build_hf_model(name, num_layers=1, scale=32, seed=2), config)


@pytest.mark.parametrize("name, sampling", [("qwen3-30b-a3b", False), ("gpt-oss-20b", True),
                                            ("llama4-scout", False), ("deepseek-v3", False)])
def test_every_bucket_of_both_phases_is_one_static_graph_equal_to_eager(name, sampling):
    app = application(name, sampling)
    for program, (module, phase, bucket) in program_modules(app).items():
        report = check_static(module, program_inputs(app, phase, bucket), n=3, atol=1e-4)
        assert report.static, (program, report.to_dict())
        assert report.matches_eager, (program, report.max_abs_diff)


def test_compile_writes_one_hlo_per_bucket_and_phase(tmp_path):
    app = application("qwen3-30b-a3b")
    manifest = app.compile(tmp_path / "app", xla=True)
    assert set(manifest["programs"]) == {"context_encoding_8", "context_encoding_16", "token_generation_16",
                                         "token_generation_32"}
    for name, program in manifest["programs"].items():
        assert program["static"] and program["matches_eager"], name
        assert (tmp_path / "app" / program["hlo"]["proto"]).stat().st_size > 0
        text = (tmp_path / "app" / program["hlo"]["text"]).read_text()
        assert "ENTRY" in text, name
    assert json.loads((tmp_path / "app" / "manifest.json").read_text()) == manifest
    # the KV cache (one layer: keys and values) goes in and comes out of each program
    cte = manifest["programs"]["context_encoding_16"]
    assert len([k for k in cte["inputs"] if k.startswith("cache.")]) == 2 == len(cte["aliases"])


def test_an_exported_program_fed_from_its_files_equals_eager(tmp_path):
    """What a runtime does with the compiled directory: feed each HLO its inputs (the KV cache among them, by the
    manifest's names) and the weights from its files; the token-generation program's tokens and cache equal eager."""
    from nxd_moe.trace import run_exported

    app = application("qwen3-30b-a3b")
    manifest = app.compile(tmp_path / "app", xla=True)
    program = manifest["programs"]["token_generation_32"]
    parameters = json.loads((tmp_path / "app" / "token_generation_32" / "parameters.json").read_text())
    assert {p["name"] for p in parameters if p["kind"] == "input"} <= set(program["inputs"])
    assert {"cache.keys_0", "cache.values_0"} <= {p["name"] for p in parameters if p["kind"] == "input"}
    module, phase, bucket = program_modules(app)["token_generation_32"]
    inputs = program_inputs(app, phase, bucket)(2)
    cache = {f"cache.{n}": torch.randn(b.shape, generator=torch.Generator().manual_seed(9)).to(b.dtype)
             for n, b in app.programs.cache.named_buffers()}
    names = ["tokens", "positions", "done", "eos_token_ids", "pad_token_id"]
    outputs = run_exported(tmp_path / "app" / "token_generation_32", {**dict(zip(names, inputs)), **cache})
    for name, value in cache.items():
        getattr(app.programs.cache, name.removeprefix("cache.")).copy_(value)
    with torch.no_grad():
        expected = module(*inputs)
    assert torch.equal(outputs[0], expected[0]) and torch.equal(outputs[1], expected[1])
    for got, want in zip(outputs[2:], expected[2:]):
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_a_host_read_inside_a_program_is_caught(monkeypatch):
    """Negative control: a sampler that reads the largest logit on the host (``.item()``) makes the program a
    device-to-host transfer mid-graph: check_static says it is not static."""
    import nxd_moe.application.programs as programs

    app = application("qwen3-30b-a3b")
    original = programs.sample_tokens

    def leaky(logits, params, global_topk):
        scale = float(logits.max().item())  # a host read
        return original(logits / scale, params, global_topk)

    monkeypatch.setattr(programs, "sample_tokens", leaky)
    module, phase, bucket = program_modules(app)["token_generation_16"]
    report = check_static(module, program_inputs(app, phase, bucket), n=2, atol=1e-4)
    assert not report.static


def spmd_config(tp: int, ep: int) -> ApplicationConfig:
    return ApplicationConfig(batch_size=2, seq_len=32, max_context_length=16, torch_dtype="float32",
                             context_encoding_buckets=[16], token_generation_buckets=[32], tp_degree=tp * ep,
                             moe_tp_degree=tp, moe_ep_degree=ep)


def test_tp2_ep2_compiles_to_one_spmd_program_per_bucket(tmp_path):
    """tp_degree 4 = MoE TP2 x EP2: each bucket of each phase is ONE program every rank traces alike, which run on
    four XLA CPU devices (each EP group its own sequences) gives every rank the single-device application's tokens
    and cache; the compiled directory holds its HLO, parameter map and the four ranks' shards."""
    # two layers: the second layer's cache depends on the first layer's MoE, so the comparison sees the experts
    app = CausalLMApplication.from_model_config("qwen3-30b-a3b", spmd_config(2, 2), num_layers=2, scale=32, seed=2)
    manifest = app.compile(tmp_path / "app", xla=True)
    for name, program in manifest["programs"].items():
        spmd = program["spmd"]
        assert spmd["world_size"] == 4 and spmd["tokens_equal"] and spmd["max_abs_diff"] < 1e-4, name
        assert {"all-gather", "all-reduce"} <= set(spmd["collectives"]), name
        assert all((tmp_path / "app" / shard).is_file() for shard in spmd["shards"])
        parameters = json.loads((tmp_path / "app" / name / "parameters.json").read_text())
        assert {"cache.keys_1", "cache.values_1"} <= {p["name"] for p in parameters if p["kind"] == "input"}
        ranks = [p for p in parameters if p["kind"] == "rank"]
        assert ranks, "the rank is an input of the program (SPMDRank)"
        shards = [torch.load(tmp_path / "app" / shard) for shard in spmd["shards"]]
        assert [int(s[ranks[0]["name"]]) for s in shards] == [0, 1, 2, 3]


def test_the_spmd_check_sees_a_wrong_shard():
    """Negative control: one rank's experts changed after it was built -- its program still traces alike, but its
    outputs no longer equal the single-device application's (a one-layer model would not show it: nothing the
    programs return but the tokens depends on its only MoE layer)."""
    from nxd_moe.application.spmd import check_programs, layout_of, rank_applications

    config = spmd_config(2, 2)

    def build(**kw):
        return CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=2, scale=32, seed=2), config, **kw)

    layout = layout_of(config)
    full, ranks = rank_applications(build, layout)
    moe = ranks[1].model.get_submodule(ranks[1].model.nxd_moe_patched.patched[0]).moe
    with torch.no_grad():
        for p in moe.expert_mlps.parameters():
            if p.is_floating_point():
                p.mul_(-3.0)
    checks = check_programs(full, ranks, layout)
    assert all(c["identical_across_ranks"] for c in checks.values())
    assert any(c["max_abs_diff"] > 1e-2 for c in checks.values())


def test_a_check_leaves_no_unexecuted_collective_in_the_ranks():
    """The KV cache a traced program updated in place gets its old value back: left holding the traced graph, a
    later sync on one device (any other test's) would run rank 0's collectives alone and abort the process."""
    import torch_xla

    from nxd_moe.application.spmd import check_programs, layout_of, rank_applications

    config = spmd_config(2, 2)

    def build(**kw):
        return CausalLMApplication(build_hf_model("qwen3-30b-a3b", num_layers=2, scale=32, seed=3), config, **kw)

    layout = layout_of(config)
    full, ranks = rank_applications(build, layout)
    check_programs(full, ranks, layout)
    for rank, app in enumerate(ranks):
        tensors = list(app.programs.cache.buffers())
        graph = torch_xla._XLAC._get_xla_tensors_text(tensors)
        assert "all_" not in graph and "reduce_scatter" not in graph, f"rank {rank}: {graph[:2000]}"
        assert graph.count("xla::device_data") == len(tensors), f"rank {rank}: {graph[:2000]}"
