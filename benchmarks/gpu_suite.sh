#!/usr/bin/env bash
# The GPU tests (they skip without CUDA; on a CPU, CI runs them under Triton's interpreter) on a CUDA machine. The
# suite is bound by Triton compiles on the host, and a few tests compile much more than the rest, so shards of
# fixed size leave workers idle behind their slowest tests: `all` runs every parallel shard in ONE pytest with
# work stealing, and the one-process `graphs` shard beside it. From the repository root:
#
#   OUT=DIR bash benchmarks/gpu_suite.sh SHARD...      SHARD: decode | quantized | backend | other | graphs | all
#
# `other` is every tests/gpu file that no named shard lists (computed, so a new test file is never left out).
#
# Each run writes DIR/gpu_tests_<shard>.log (pytest -v: one line per finished test, so a log cut off by the time
# limit still says what passed; failures and the slowest tests at the end) and prints its summary line. A run is
# stopped after GPU_SUITE_TIMEOUT_S seconds (default 300), keeping its log. GPU_SUITE_WORKERS sets the xdist worker
# count (default: host cores - 2, at most 14). Where pytest-timeout is installed, one test running longer than
# GPU_SUITE_TEST_TIMEOUT_S (default 240) ends its worker with every thread's stack in the log, so a test stuck in a
# kernel (a stack in a CUDA synchronize) tells itself apart from one still compiling (a stack in Triton's compiler)
# and stops starving the others of the GPU.
set -uo pipefail
out=${OUT:-/tmp/gpu-suite}
mkdir -p "$out"
[ $# -gt 0 ] || set -- all
cores=$(nproc)
workers=${GPU_SUITE_WORKERS:-$(( cores > 16 ? 14 : (cores > 3 ? cores - 2 : 1) ))}

tests_of() {
  case $1 in
    decode) echo tests/gpu/test_persistent_decode.py tests/gpu/test_triton_repacked.py ;;
    quantized) echo tests/gpu/test_triton_quantized.py tests/gpu/test_triton_w8a8.py tests/gpu/test_launch_configs.py \
                    tests/gpu/test_dispatch_kernels.py ;;
    backend) echo tests/gpu/test_triton_backend.py tests/gpu/test_prefill_gemm.py tests/gpu/test_router_kernel.py \
                  tests/gpu/test_hf_experts_backend.py tests/gpu/test_patch_model_gpu.py tests/gpu/test_compiled_models.py \
                  tests/test_cuda.py tests/test_device_and_backend.py \
                  tests/test_cli.py::test_run_on_a_gpu_defaults_to_bf16_and_reports_graph_replays ;;
    # NCCL process groups and CUDA-graph captures: one process
    graphs) echo tests/gpu/test_parallel_graphs.py ;;
    other) other_files ;;
    *) echo "unknown shard $1 (decode | quantized | backend | other | graphs | all)" >&2; return 2 ;;
  esac
}

other_files() {
  local listed f
  listed=" $(for shard in decode quantized backend graphs; do tests_of "$shard"; done | tr '\n' ' ') "
  for f in tests/gpu/test_*.py; do
    case "$listed" in *" $f "*) ;; *) printf '%s ' "$f" ;; esac
  done
}

# run NAME XDIST_WORKERS TEST...: one pytest under the time limit, its log in $out, its summary on stdout
run() {
  local name=$1 n=$2
  shift 2
  local parallel=()
  [ "$n" -gt 0 ] && parallel=(-n "$n" --dist worksteal)
  python3 -c "import pytest_timeout" 2>/dev/null &&
    parallel+=(--timeout "${GPU_SUITE_TEST_TIMEOUT_S:-240}" --timeout-method thread)
  NCCL_NVLS_ENABLE=0 timeout "${GPU_SUITE_TIMEOUT_S:-300}" python3 -m pytest -v -p no:cacheprovider -rf --tb=short \
    --durations=25 "${parallel[@]}" "$@" > "$out/gpu_tests_$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -cE ' PASSED' "$out/gpu_tests_$name.log") passed;" \
    "$(grep -E '^=+ .*(passed|failed|error|skipped)' "$out/gpu_tests_$name.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$out/gpu_tests_$name.log" | head -20
}

if [ "$1" = all ]; then
  # shellcheck disable=SC2046
  run graphs 0 $(tests_of graphs) &
  # shellcheck disable=SC2046
  run parallel "$workers" $(tests_of decode) $(tests_of quantized) $(tests_of backend) $(tests_of other)
  wait
  exit 0
fi
for shard in "$@"; do
  files=$(tests_of "$shard") || exit 2
  n=$workers
  [ "$shard" = graphs ] && n=0
  # shellcheck disable=SC2086
  run "$shard" "$n" $files
done
