#!/usr/bin/env bash
# nki-library's core/moe suites on the simulator on a machine with no internet, from the bundle that
# benchmarks/nki_library_carry.sh makes (.carry/nkilib: the harness's missing dependencies as Python 3.12 wheels, an
# nki-library checkout without .git, its commit, this script as run.sh). Run from the nxd_moe repository root:
#
#   bash .carry/nkilib/run.sh [SUBSET] [more benchmark arguments, e.g. --sample 50]
#
# SUBSET, so that calls with a time limit can split the run:
#   tkg    core/moe/moe_tkg, one worker per core (its 2 tests over 8 GB get a second pass under 20 GB)
#   cte    core/moe/moe_cte but its 12 E=64 H=3072 cases, one worker per core
#   cte64  those 12 (nki-library's float64 inputs: an estimated 10-16 GB each), 6 at a time under 20 GB
#   moe    (default) both suites side by side, everything; may stop at the deadline with partial results
# Writes $OUT/nki_library_tests_<subset>_<N>core.json and .log (OUT defaults to /tmp/nkilib-out). The run ends within
# NKILIB_BUDGET_S seconds (default 530) of this script's start: no test starts after NKILIB_BUDGET_S - 60 s, tests
# still running are stopped and counted unfinished, and the JSON holds what finished. NKILIB_WORKERS overrides the
# worker count; NKILIB_SITE=DIR uses dependencies already installed there instead of the wheels.
set -uo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
grep -q -- '--workers' benchmarks/nki_library_tests.py 2>/dev/null \
  || { echo "run from the nxd_moe repository root, at a commit whose benchmarks/nki_library_tests.py has --workers" >&2
       exit 2; }
out=${OUT:-/tmp/nkilib-out}
mkdir -p "$out"
subset=${1:-moe}
[ $# -gt 0 ] && shift
workers=${NKILIB_WORKERS:-$(nproc)}
e64='3072-1024-64-'  # H-T-E- in the test ids of moe_cte's E=64 H=3072 cases
# --mem-gb 8: the cap every test got in the committed results (x 16 workers within 128 GB: few tests come near it);
# --big-mem-gb 20: the second pass, 6 at a time, for tests whose inputs need more.
caps=(--mem-gb 8 --big-mem-gb 20 --big-workers 6)
timeout=300  # per test
case $subset in
  tkg) suites=(--suite core/moe/moe_tkg) ;;
  cte) suites=(--suite core/moe/moe_cte -k "not $e64") ;;
  # nki-library's float64 uniform weights, (64, 3072, 2, I) = 6.4-9.7 GB, then bf16 and fp32 copies for the golden:
  # an estimated 10-16 GB each, so 6 at once; ~5x the arithmetic of the E=8 cases (40-55 s on one core): unmeasured.
  cte64) suites=(--suite core/moe/moe_cte -k "$e64"); workers=${NKILIB_WORKERS:-6}; caps=(--mem-gb 20)
         timeout=440 ;;
  # Both suites side by side (one's tail, the other's work); a first-pass cap of 6 GB, as 32 processes share 128 GB
  # and moe_cte's 12 E=64 cases, adjacent in its order, start at once and grow to the cap before failing.
  moe) suites=(--suite core/moe/moe_tkg --suite core/moe/moe_cte --jobs 2)
       caps=(--mem-gb 6 --big-mem-gb 20 --big-workers 6) ;;
  *) echo "usage: $0 [tkg|cte|cte64|moe] [benchmark arguments]" >&2; exit 2 ;;
esac

site=${NKILIB_SITE:-}
if [ -z "$site" ]; then
  site=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$bundle"/wheels/*.whl || { echo "installing the harness's wheels into $site failed" >&2; exit 1; }
fi

# The simulator's own needs (numpy, ml_dtypes with the float8 / float4 types, torch) come with that machine.
python3 -c "import nxd_moe.nki_kernels.compat, nxd_moe.nki_kernels.cost_model" \
  || { echo "the nxd_moe simulator does not import with this python3 (numpy / ml_dtypes / torch?)" >&2; exit 1; }

budget=${NKILIB_BUDGET_S:-530}
# The benchmark stops tests 60 s after its --deadline; the wheel install above has used $SECONDS already.
deadline=$((budget - 60 - SECONDS))
name=nki_library_tests_${subset}_${workers}core
echo "nki-library $(cat "$bundle/COMMIT") $subset: $workers workers, deadline ${deadline} s, $(nproc) cores," \
  "$(awk '/MemTotal/ {printf "%.0f GB", $2 / 1048576}' /proc/meminfo)" | tee "$out/$name.log"
PYTHONUNBUFFERED=1 python3 benchmarks/nki_library_tests.py "$bundle/nki-library" --commit "$(cat "$bundle/COMMIT")" \
  "${suites[@]}" --workers "$workers" "${caps[@]}" --timeout "$timeout" \
  --deadline "$deadline" --site "$site" --scratch /tmp/nkilib-scratch --out "$out/$name.json" "$@" \
  2>&1 | tee -a "$out/$name.log"
