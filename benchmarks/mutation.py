"""Mutation testing of nxd_moe's modules with mutmut (not in CI: minutes per module on 2 cores).

    pip install mutmut                       # 3.x; not a dependency of the package
    python benchmarks/mutation.py nxd_moe/nxd_compat/block_mapping.py [MODULE ...] [--out FILE] [--jobs N]

Per module: a scratch copy of the working tree (``nxd_moe/``, ``tests/``, ``configs/``, ``pyproject.toml``) gets a
``[tool.mutmut]`` section that mutates that module only and runs only the tests :data:`TESTS` maps it to; ``mutmut
run`` tries every mutant. mutmut runs each mutant in a forked worker, and torch's threads can hang a fork: a mutant
mutmut reports as a timeout (or suspicious) is run again here in a fresh process (``MUTANT_UNDER_TEST`` set, the same
tests) and counted killed if a test fails, survived if all pass. Writes JSON: per module the counts, the score
(killed / mutants) and every survivor with its diff. A survivor is either a missing test or an equivalent mutant (it
cannot change behaviour); docs/testing.md lists the equivalent ones with a reason each and the score over the others.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPIED = ("nxd_moe", "tests", "configs", "pyproject.toml")

# nxd_moe/hf/*: the conversions' own tests and the quantized checkpoints' (MXFP4, FP8 blocks, unsaved formats)
HF_TESTS = ["tests/test_hf_parity.py", "tests/test_hf_state_dict.py", "tests/test_hf_formats.py"] + [
    f"tests/test_quantization.py::{name}" for name in (
        "test_gpt_oss_mxfp4_checkpoint_matches_transformers_dequantization_and_exports_back",
        "test_deepseek_v3_fp8_block_checkpoint_key_by_key")] + [
    f"tests/models/test_patch_model.py::{name}" for name in (
        "test_a_format_without_a_checkpoint_form_refuses_to_save", "test_gpt_oss_mxfp4_checkpoint_loads_as_stored")]

# nxd_moe/parallel/{sharding,eplb,placement,payload}.py
PARALLEL_UNIT_TESTS = ["tests/parallel/test_parallel_units.py", "tests/parallel/test_layout.py",
                       "tests/parallel/test_parallel_settings.py"]

# nxd_moe/experts/{while_loop,dynamic_while}.py: test_dynamic_while.py's eager tests (not the compile test)
WHILE_LOOP_TESTS = ["tests/test_experts_algorithms_settings.py"] + [
    "tests/test_dynamic_while.py::" + name for name in (
        "test_matches_reference_and_counts_its_blocks", "test_counter_is_measured_not_assumed",
        "test_padding_mask_and_prescale", "test_every_activation_equals_plain_blockwise",
        "test_bf16_and_both_static_prefix_matmuls", "test_odd_block_count_with_two_blocks_per_iteration",
        "test_works_with_autograd_enabled", "test_moe_with_shared_experts_and_padding",
        "test_property_reference_and_schedule", "test_while_loop_eager_semantics",
        "test_while_loop_into_writes_rows_without_touching_the_buffer")]

# modules whose tests run in the XLA environment (.venv-xla, PJRT_DEVICE=CPU): mutmut runs its clean and statistics
# passes in its own process, which starts the XLA runtime, and a fork of that process hangs -- so these mutants run
# in workers started by a fork server (slower: each imports torch_xla)
XLA_MODULES = {"nxd_moe/parallel/xla_collectives.py", "nxd_moe/tracing/spmd_program.py"}

# module -> the tests that cover it (a run over one module stays within minutes)
TESTS: dict[str, list[str]] = {
    "nxd_moe/nxd_compat/block_mapping.py": ["tests/nxd_compat/test_nxd_unit_test_equivalents.py"],
    "nxd_moe/nxd_compat/testing.py": ["tests/nxd_compat/test_nxd_unit_test_equivalents.py",
                                      "tests/nxd_compat/test_nxd_utils_and_assert_close.py"],
    "nxd_moe/nxd_compat/utils.py": ["tests/nxd_compat/test_nxd_unit_test_equivalents.py",
                                    "tests/nxd_compat/test_nxd_utils_and_assert_close.py"],
    "nxd_moe/nxd_compat/adapters.py": ["tests/nxd_compat/test_nxd_modules.py", "tests/nxd_compat/test_nxd_configs.py",
                                       "tests/nxd_compat/test_nxd_adapters_details.py"],
    "nxd_moe/nxd_compat/parallel_state.py": [  # (test_nxd_worlds.py runs it on gloo worlds: seconds per run)
        "tests/nxd_compat/test_nxd_parallel_state_and_mappings.py",
        "tests/nxd_compat/test_nxd_modules.py::test_parallel_state_without_a_world",
        "tests/nxd_compat/test_nxd_unit_test_equivalents.py::test_parallel_state_token_shuffle_and_nxds_private_names"],
    "nxd_moe/nxd_compat/inference.py": [  # its unit tests, and the front door end to end on one family
        "tests/nxd_compat/test_nxdi_inference_api.py"] + [
        f"tests/application/test_nxdi_front_door.py::{name}" for name in (
            "test_nxdi_script_generates_transformers_tokens[mixtral-8x7b]",
            "test_adapter_streams_the_prompt_then_every_token_and_refuses_what_it_does_not_apply")],
    "nxd_moe/nxd_compat/mappings.py": ["tests/nxd_compat/test_nxd_parallel_state_and_mappings.py",
                                       "tests/nxd_compat/test_nxd_modules.py::test_parallel_state_without_a_world"],
    "nxd_moe/nxd_compat/not_served.py": [
        "tests/nxd_compat/test_nxd_parallel_state_and_mappings.py",
        "tests/nxd_compat/test_nxd_unit_test_equivalents.py::test_not_served_names_import_and_say_why_when_used",
        "tests/nxd_compat/test_nxd_unit_test_equivalents.py::test_served_blockwise_enums_and_expert_mlps_helpers"],
    "nxd_moe/nxdi.py": ["tests/nxd_compat/test_nxdi_entry_point.py"],
    "nxd_moe/quantization/formats.py": ["tests/test_quantization_formats.py"] + [  # not the compile/export tests:
        f"tests/test_quantization.py::{name}" for name in (  # dynamo cannot trace mutmut's trampolines
            "test_round_trip_within_the_format_bound", "test_quantizing_one_expert_at_a_time_stores_the_same_bytes",
            "test_mxfp4_rounds_to_nearest_even_and_packs_low_nibble_first",
            "test_fp8_scales_are_per_channel_and_per_tile",
            "test_quantized_weight_selects_and_dequantizes_only_the_chosen_experts",
            "test_quantized_layer_equals_layer_holding_dequantized_weights_in_every_mode",
            "test_quantized_dynamic_while",
            "test_quantized_layer_in_bfloat16", "test_state_dict_names_dtypes_and_reload",
            "test_build_moe_quantizes_only_the_routed_experts",
            "test_quantized_shared_experts_store_the_format_and_compute_its_values",
            "test_quantized_shared_experts_in_the_moe_every_backend", "test_quantize_shared_experts_alone",
            "test_shared_quantization_bad_input_is_named", "test_cli_run_reports_the_quantization_error",
            "test_bad_stored_tensors_are_named", "test_block_size_must_divide_and_format_names_are_checked",
            "test_backend_without_the_format_is_refused", "test_nki_sim_computes_with_every_format",
            "test_nki_sim_reads_exactly_the_packed_bytes", "test_plan_reports_quantized_decode",
            "test_gpt_oss_mxfp4_checkpoint_matches_transformers_dequantization_and_exports_back",
            "test_deepseek_v3_fp8_block_checkpoint_key_by_key", "test_nki_sim_blockwise_kernels_with_mxfp4",
            "test_nki_sim_refuses_tiles_that_split_a_scale_block")],
    "nxd_moe/hf/configs.py": HF_TESTS,
    "nxd_moe/hf/checkpoints.py": HF_TESTS,
    "nxd_moe/hf/families.py": HF_TESTS,
    "nxd_moe/hf/stored_formats.py": HF_TESTS,
    "nxd_moe/hf/blocks.py": HF_TESTS,
    "nxd_moe/parallel/layout.py": ["tests/parallel/test_layout.py", "tests/parallel/test_parallel_units.py"],
    # the parallel MoE's pure parts: their unit tests (no multi-process world, nothing compiled)
    "nxd_moe/parallel/sharding.py": PARALLEL_UNIT_TESTS,
    "nxd_moe/parallel/eplb.py": PARALLEL_UNIT_TESTS,
    "nxd_moe/parallel/placement.py": PARALLEL_UNIT_TESTS,
    "nxd_moe/parallel/payload.py": PARALLEL_UNIT_TESTS,
    "nxd_moe/routing/topk.py": ["tests/test_routing.py", "tests/test_layer_parts.py::"
                                "test_fused_parts_are_given_only_where_a_kernel_computes_exactly_the_router"],
    "nxd_moe/routing/group_limited.py": ["tests/test_routing.py"],
    "nxd_moe/routing/base.py": ["tests/test_routing.py", "tests/test_routing_settings.py"],
    "nxd_moe/routing/sinkhorn.py": ["tests/test_routing.py", "tests/test_routing_settings.py"],
    "nxd_moe/experts/token_mapping.py": ["tests/test_token_mapping.py"],
    "nxd_moe/experts/capacity.py": ["tests/test_experts_settings.py", "tests/test_experts_modes.py"],
    "nxd_moe/experts/mode.py": ["tests/test_experts_settings.py", "tests/test_experts_modes.py",
                                "tests/test_routed_pipeline.py"],
    "nxd_moe/experts/pairs.py": ["tests/test_experts_settings.py", "tests/test_routed_pipeline.py",
                                 "tests/test_experts_modes.py"],
    "nxd_moe/experts/activation.py": ["tests/test_experts_settings.py", "tests/test_experts_modes.py"],
    "nxd_moe/experts/routing_inputs.py": ["tests/test_experts_settings.py", "tests/test_experts_modes.py",
                                          "tests/test_token_mapping.py"],
    # the experts' small parts: their settings tests (float64 references, nothing compiled, no world)
    "nxd_moe/experts/shared.py": ["tests/test_experts_parts_settings.py"],
    "nxd_moe/experts/shard.py": ["tests/test_experts_parts_settings.py"],
    "nxd_moe/experts/decode.py": ["tests/test_experts_parts_settings.py"],
    "nxd_moe/experts/local_routing.py": ["tests/test_experts_parts_settings.py"],
    "nxd_moe/experts/blockwise.py": ["tests/test_experts_parts_settings.py"],
    "nxd_moe/application/sampling.py": ["tests/application/test_sampling.py"],
    "nxd_moe/triton_kernels/launch_configs.py": ["tests/gpu/test_launch_configs.py"] + [  # the rules, no kernel run
        f"tests/gpu/test_persistent_decode.py::{name}" for name in (
            "test_small_decode_rule", "test_fused_mlp_rule",
            "test_combine_items_load_at_most_their_share_of_partial_sums")],
    "nxd_moe/application/config.py": ["tests/application/test_application_config.py"],
    "nxd_moe/application/attention.py": ["tests/application/test_decode_attention.py"],
    "nxd_moe/application/fused_projections.py": [  # its fast tests (the file's last one compiles whole models)
        f"tests/application/test_fused_projections.py::{name}" for name in (
            "test_projections_of_one_input_become_one_gemm",
            "test_calls_fuse_in_the_order_of_their_rows_not_of_the_graph",
            "test_nothing_is_fused_where_weights_are_not_stacked_or_inputs_differ",
            "test_stacked_rows_takes_only_consecutive_contiguous_rows_of_one_width_and_dtype",
            "test_the_backend_gives_inductor_the_fused_graph")],
    # (not test_commands.py: its fixture writes checkpoints where a changed main writes one into the working directory,
    # which then fails every later test that names that config: false kills)
    "nxd_moe/models/checkpoint.py": ["tests/models/test_models_settings.py"],
    "nxd_moe/models/decoder_step.py": ["tests/models/test_decoder_step.py", "tests/models/test_models_settings.py"],
    "nxd_moe/models/generate.py": [
        "tests/models/test_generate_cli.py", "tests/models/test_models_settings.py",
        "tests/models/test_patch_model.py::test_shared_static_cache_is_for_compiled_generate_only"],
    "nxd_moe/models/patch.py": [  # test_patch_model.py's tests that compile nothing (and its settings tests)
        f"tests/models/test_patch_model.py::{name}" for name in (
            "test_logits_and_greedy_tokens_match_the_unpatched_model", "test_a_broken_layer_fails_the_bound",
            "test_each_block_returns_what_the_transformers_block_returned", "test_decode_makes_no_host_sync",
            "test_llama4_multimodal_model", "test_state_dict_is_unchanged",
            "test_state_dict_keeps_the_dtypes_of_a_bf16_model", "test_load_state_dict_of_the_transformers_checkpoint",
            "test_save_pretrained_round_trip", "test_the_transformers_blocks_are_released_and_no_bytes_added",
            "test_each_block_is_released_before_the_next_is_converted", "test_a_kept_block_is_detected",
            "test_bf16_model_grows_by_the_float32_router_only",
            "test_quantized_patch_matches_its_dequantized_reference",
            "test_quantized_state_dict_in_the_checkpoint_naming",
            "test_a_quantized_checkpoint_reloads_through_transformers",
            "test_the_saved_quantization_config_converts_exactly_the_quantized_modules",
            "test_a_format_without_a_checkpoint_form_refuses_to_save", "test_gpt_oss_mxfp4_checkpoint_loads_as_stored",
            "test_deepseek_v3_fp8_checkpoint_loads_as_stored", "test_dense_layers_stay", "test_report_and_repr",
            "test_unquantized_experts_are_reported_as_none_not_bf16",
            "test_on_a_cpu_the_default_backend_multiplies_the_pairs_and_backend_torch_keeps_nxds_rules",
            "test_a_model_on_the_meta_device_is_patched_there_and_loads_later", "test_bad_models_are_named",
            "test_bad_arguments_are_named_and_leave_the_model_as_it_was",
            "test_an_unknown_tensor_in_a_block_is_named_before_anything_changes",
            "test_a_checkpoint_of_another_shape_is_named")] + ["tests/models/test_models_patch_settings.py"],
    "nxd_moe/models/hf_models.py": ["tests/models/test_hf_models.py", "tests/models/test_models_patch_settings.py"],
    "nxd_moe/models/experts_backend.py": [  # its eager tests (not the compiled ones, nor interpreted Triton's)
        f"tests/models/test_experts_backend.py::{name}" for name in (
            "test_whole_model_logits_and_greedy_generate_match_eager",
            "test_other_dispatched_families_match_their_eager_experts",
            "test_automatic_implementation_on_a_cpu_multiplies_the_pairs_at_every_size",
            "test_from_pretrained_with_experts_implementation", "test_registration_is_class_wide_and_idempotent",
            "test_negative_control_wrong_interleave_breaks_model_logits",
            "test_experts_function_matches_float64_reference", "test_gather_matmul_takes_the_weight_views",
            "test_expert_parallel_sentinels_contribute_nothing", "test_no_host_sync_in_eager_calls",
            "test_modules_of_transformers_5_17", "test_non_finite_token_stays_in_its_row",
            "test_negative_control_wrong_interleave_is_rejected", "test_bf16_model_with_fp32_routing_weights",
            "test_the_module_weights_are_used_in_place", "test_unsupported_experts_are_refused_by_name",
            "test_set_experts_implementation_refuses_before_switching",
            "test_undecorated_families_are_refused_by_name", "test_bad_shapes_and_backends_are_named")] + [
        "tests/models/test_models_patch_settings.py"],
    "nxd_moe/tracing/spmd.py": ["tests/test_spmd_settings.py"],  # the XLA steps faked: no torch_xla needed
    "nxd_moe/tracing/spmd_command.py": ["tests/test_spmd_settings.py"],
    "nxd_moe/tracing/spmd_layout.py": ["tests/test_spmd_settings.py"],
    "nxd_moe/tracing/spmd_program.py": [  # in the XLA environment (.venv-xla, PJRT_DEVICE=CPU)
        "tests/test_spmd_settings.py", "tests/xla/test_spmd_settings_xla.py"],
    "nxd_moe/parallel/xla_collectives.py": ["tests/xla/test_spmd_settings_xla.py"],  # in the XLA environment
    "nxd_moe/experts/expert_mlps.py": ["tests/test_experts_algorithms_settings.py", "tests/test_experts_modes.py"],
    "nxd_moe/experts/mlp.py": ["tests/test_experts_algorithms_settings.py", "tests/test_experts_modes.py",
                               "tests/test_experts_parts_settings.py"],
    "nxd_moe/experts/grouped_matmul.py": ["tests/test_experts_algorithms_settings.py", "tests/test_experts_modes.py"],
    "nxd_moe/experts/while_loop.py": WHILE_LOOP_TESTS,
    "nxd_moe/experts/dynamic_while.py": WHILE_LOOP_TESTS,
    "nxd_moe/experts/backends.py": ["tests/test_experts_algorithms_settings.py", "tests/test_experts_modes.py",
                                    "tests/test_experts_settings.py"],
    "nxd_moe/parallel/dispatch.py": ["tests/test_routed_pipeline.py",
                                     "tests/parallel/test_parallel_dispatch_settings.py",
                                     "tests/parallel/test_parallel_units.py::test_world_of_one"],
    "nxd_moe/parallel/dispatches.py": ["tests/parallel/test_parallel_dispatch_settings.py",
                                       "tests/parallel/test_parallel_units.py::test_world_of_one"],
    "nxd_moe/parallel/all_to_all.py": [  # ranks as threads with collectives by definition, one gloo rank
        "tests/parallel/test_parallel_dispatch_settings.py",
        "tests/parallel/test_parallel_units.py::test_static_exchange_tables_are_keyed_by_their_sizes",
        "tests/parallel/test_parallel_units.py::test_world_of_one"],
    "nxd_moe/parallel/collectives.py": [
        "tests/parallel/test_parallel_dispatch_settings.py",
        "tests/parallel/test_parallel_units.py::test_collectives_on_one_rank_move_nothing",
        "tests/parallel/test_parallel_units.py::test_world_of_one"],
    # (simulated worlds of threads, in one process; the gloo worlds take minutes per run)
    "nxd_moe/parallel/expert_parallel.py": ["tests/parallel/test_parallel_ep_settings.py",
                                            "tests/parallel/test_overlap_rule.py",
                                            "tests/parallel/test_parallel_units.py::test_world_of_one"],
    "nxd_moe/parallel/overlap.py": ["tests/parallel/test_overlap_rule.py"],
    "nxd_moe/parallel/nvlink.py": ["tests/parallel/test_nvlink_transport.py"],
    "nxd_moe/parallel/token_layout.py": [
        "tests/parallel/test_layout.py", "tests/parallel/test_parallel_ep_settings.py",
        "tests/parallel/test_parallel_units.py::test_gathered_shards_in_token_order",
        "tests/parallel/test_parallel_units.py::test_token_layout_validates"],
    "nxd_moe/parallel/all_gather.py": ["tests/parallel/test_parallel_ep_settings.py",
                                       "tests/parallel/test_parallel_units.py::test_world_of_one"],
    "nxd_moe/parallel/shared_experts.py": ["tests/parallel/test_parallel_ep_settings.py",
                                           "tests/test_moe.py::test_shared_experts_formula"],
}
STATUS = re.compile(r"^\s*(\S+): (\w[\w ]*)$")


def mutmut() -> list[str]:
    found = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if found is None:
        raise SystemExit("mutmut is not installed here: pip install mutmut")
    return [found]


def scratch_copy(module: str, tests: list[str], jobs_dir: Path) -> Path:
    root = jobs_dir / module.replace("/", "_").removesuffix(".py")
    root.mkdir(parents=True)
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__", "_build", "*.so"))
        else:
            shutil.copy(source, root / name)
    config = (f'\n[tool.mutmut]\nsource_paths = ["{module}"]\n'
              f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
              'pytest_add_cli_args = ["-x", "-q", "-p", "no:cacheprovider"]\n'
              'also_copy = ["nxd_moe", "tests", "configs"]\n')
    if module in XLA_MODULES:  # the XLA runtime, started by mutmut's own test passes, must not be forked
        config += 'process_isolation = "forkserver"\n'
    with open(root / "pyproject.toml", "a") as f:
        f.write(config)
    return root


def rerun(root: Path, mutant: str, tests: list[str]) -> str:
    """``killed`` or ``survived``: the mutant's tests in a fresh process (no fork)."""
    env = {**os.environ, "MUTANT_UNDER_TEST": mutant, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=root / "mutants", env=env, capture_output=True, text=True, timeout=1800)
    return "survived" if done.returncode == 0 else "killed"


def run_module(module: str, jobs_dir: Path, jobs: int) -> dict:
    tests = TESTS.get(module)
    if tests is None:
        raise SystemExit(f"{module}: no tests mapped in benchmarks/mutation.py's TESTS")
    root = scratch_copy(module, tests, jobs_dir)
    start = time.monotonic()
    # One intra-op thread: mutmut forks its workers from a process that has already run torch, and a fork of a process
    # whose OpenMP pool is up can hang in the child (most mutants of torch-heavy modules then ended as timeouts).
    single = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run([*mutmut(), "run", "--max-children", str(jobs)], cwd=root, capture_output=True, text=True,
                   env=single)
    listed = subprocess.run([*mutmut(), "results", "--all", "true"], cwd=root, capture_output=True,
                            text=True).stdout
    statuses = {m.group(1): m.group(2) for m in map(STATUS.match, listed.splitlines()) if m}
    result: dict = {"module": module, "tests": tests, "mutants": len(statuses), "rerun": {}, "survivors": []}
    for name, status in statuses.items():
        if status in ("timeout", "suspicious"):
            statuses[name] = result["rerun"][name] = rerun(root, name, tests)
    for name, status in sorted(statuses.items()):
        if status in ("survived", "no tests"):
            diff = subprocess.run([*mutmut(), "show", name], cwd=root, capture_output=True, text=True).stdout
            result["survivors"].append({"mutant": name, "status": status,
                                        "diff": "\n".join(line for line in diff.splitlines()
                                                          if line.startswith(("-", "+")) and line[1:2] == " ")})
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    result["counts"] = counts
    result["score"] = round(counts.get("killed", 0) / max(len(statuses), 1), 4)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help=f"paths under nxd_moe/ (mapped: {', '.join(TESTS)})")
    parser.add_argument("--jobs", type=int, default=2, help="mutmut's parallel workers (default 2)")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in TESTS]
    if unknown:
        parser.error(f"no tests mapped for {unknown}; add them to TESTS")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="nxd_moe_mutation_") as jobs_dir:
        results = []
        for module in args.modules:
            print(f"{module} ...", file=sys.stderr, flush=True)
            results.append(run_module(module, Path(jobs_dir), args.jobs))
            r = results[-1]
            print(f"  {r['mutants']} mutants, {r['counts']}, score {r['score']:.1%}, {r['seconds']:.0f} s",
                  file=sys.stderr, flush=True)
    text = json.dumps({"commit": commit, "date": time.strftime("%Y-%m-%d"), "modules": results}, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
