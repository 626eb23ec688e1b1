#!/usr/bin/env bash
# nki-library's core/moe suites on the simulator on a machine with no internet, from the bundle that
# benchmarks/nki_library_carry.sh makes (.carry/nkilib: the harness's missing dependencies as Python 3.12 wheels, an
# nki-library checkout without .git, its commit, this script as run.sh). Run from the nxd_moe repository root:
#
#   bash .carry/nkilib/run.sh [moe|tkg|cte] [more benchmark arguments, e.g. --sample 50 --workers 2]
#
# moe (default): core/moe/moe_tkg and core/moe/moe_cte side by side, N workers each; tkg or cte: one of them, so that two calls can split the
# run where one call's time limit is too short. Writes $OUT/nki_library_tests_<subset>_<N>core.json and .log (OUT
# defaults to /tmp/nkilib-out). The whole run ends within NKILIB_BUDGET_S seconds (default 530) of this script's
# start: no test starts after NKILIB_BUDGET_S - 60 s, tests still running are stopped and counted unfinished, and
# the JSON holds what finished. NKILIB_SITE=DIR uses dependencies already installed there instead of the wheels.
set -uo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
grep -q -- '--workers' benchmarks/nki_library_tests.py 2>/dev/null \
  || { echo "run from the nxd_moe repository root, at a commit whose benchmarks/nki_library_tests.py has --workers" >&2
       exit 2; }
out=${OUT:-/tmp/nkilib-out}
mkdir -p "$out"
subset=${1:-moe}
[ $# -gt 0 ] && shift
case $subset in
  moe) suites=(--suite core/moe/moe_tkg --suite core/moe/moe_cte --jobs 2) ;;  # both at once: one's tail, the other's work
  tkg) suites=(--suite core/moe/moe_tkg) ;;
  cte) suites=(--suite core/moe/moe_cte) ;;
  *) echo "usage: $0 [moe|tkg|cte] [benchmark arguments]" >&2; exit 2 ;;
esac

site=${NKILIB_SITE:-}
if [ -z "$site" ]; then
  site=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$bundle"/wheels/*.whl || { echo "installing the harness's wheels into $site failed" >&2; exit 1; }
fi

workers=${NKILIB_WORKERS:-$(nproc)}
budget=${NKILIB_BUDGET_S:-530}
# The benchmark stops tests 60 s after its --deadline; the wheel install above has used $SECONDS already.
deadline=$((budget - 60 - SECONDS))
name=nki_library_tests_${subset}_${workers}core
echo "nki-library $(cat "$bundle/COMMIT") $subset: $workers workers, deadline ${deadline} s, $(nproc) cores," \
  "$(awk '/MemTotal/ {printf "%.0f GB", $2 / 1048576}' /proc/meminfo)" | tee "$out/$name.log"
# --mem-gb 8: the cap every test got in the committed results (x 16 workers within 128 GB: few tests come near it);
# --big-mem-gb 20: a second pass, 6 at a time, for the tests nki-library's float64 inputs put over 8 GB.
PYTHONUNBUFFERED=1 python3 benchmarks/nki_library_tests.py "$bundle/nki-library" --commit "$(cat "$bundle/COMMIT")" \
  "${suites[@]}" --workers "$workers" --mem-gb 8 --big-mem-gb 20 --big-workers 6 --timeout 300 \
  --deadline "$deadline" --site "$site" --scratch /tmp/nkilib-scratch --out "$out/$name.json" "$@" \
  2>&1 | tee -a "$out/$name.log"
