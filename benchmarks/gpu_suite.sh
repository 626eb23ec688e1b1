#!/usr/bin/env bash
# The GPU tests (they skip without CUDA; on a CPU, CI runs them under Triton's interpreter) on a CUDA machine, in
# shards sized for ~5 minutes each with 4 xdist workers (the suite is compile-bound; `decode` measured ~3 min on
# an H100, the others estimated). From the repository
# root:
#
#   OUT=DIR bash benchmarks/gpu_suite.sh SHARD...      SHARD: decode | quantized | backend | graphs | all
#
# Each shard writes DIR/gpu_tests_<shard>.log (pytest -rf: failures named at the end) and prints its summary line;
# a shard is stopped after GPU_SUITE_TIMEOUT_S seconds (default 300), keeping its log.
set -uo pipefail
out=${OUT:-/tmp/gpu-suite}
mkdir -p "$out"
[ $# -gt 0 ] || set -- all
[ "$1" = all ] && set -- decode quantized backend graphs
for shard in "$@"; do
  case $shard in
    decode) tests=(tests/gpu/test_persistent_decode.py tests/gpu/test_triton_repacked.py); workers=4 ;;
    quantized) tests=(tests/gpu/test_triton_quantized.py tests/gpu/test_triton_w8a8.py tests/gpu/test_launch_configs.py
                      tests/gpu/test_dispatch_kernels.py); workers=4 ;;
    backend) tests=(tests/gpu/test_triton_backend.py tests/gpu/test_prefill_gemm.py tests/test_cuda.py
                    tests/test_device_and_backend.py
                    tests/test_cli.py::test_run_on_a_gpu_defaults_to_bf16_and_reports_graph_replays); workers=4 ;;
    # NCCL process groups and CUDA-graph captures: one process
    graphs) tests=(tests/gpu/test_parallel_graphs.py); workers=0 ;;
    *) echo "unknown shard $shard (decode | quantized | backend | graphs | all)" >&2; exit 2 ;;
  esac
  parallel=()
  [ "$workers" -gt 0 ] && parallel=(-n "$workers")
  NCCL_NVLS_ENABLE=0 timeout "${GPU_SUITE_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
    "${parallel[@]}" "${tests[@]}" > "$out/gpu_tests_$shard.log" 2>&1
  echo "$shard: rc=$? $(grep -E '(passed|failed|error)' "$out/gpu_tests_$shard.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$out/gpu_tests_$shard.log" | head -20
done
