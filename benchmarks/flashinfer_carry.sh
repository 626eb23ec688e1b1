#!/usr/bin/env bash
# Carries FlashInfer's CUTLASS fused MoE (the `flashinfer_cutlass` peers) to an offline GPU machine in parts that
# each fit one device call, and installs it there without pip or internet. Nothing of FlashInfer is committed: all
# of it lives under the git-ignored .peers/flashinfer/.
#
#   bash benchmarks/flashinfer_carry.sh pack PREBUILT_SO [WHEELS]   # build machine (internet): parts/ + SHA256SUMS
#   bash benchmarks/flashinfer_carry.sh install                      # GPU machine: parts/ -> site/ (on PYTHONPATH)
#   bash benchmarks/flashinfer_carry.sh split FILE DIR BYTES         # the pieces of both, exposed for the tests
#   bash benchmarks/flashinfer_carry.sh join DIR FILE
#
# pack: downloads (pip download, once, into WHEELS, default /tmp/flashinfer-wheels) flashinfer-python 0.7.2.post1
# and the few packages its import needs for CPython 3.12 x86-64: apache-tvm-ffi (its binding layer), requests and
# its four dependencies, nvidia-ml-py. The rest of its declared dependencies (cuda-python, cutlass-dsl, cudnn
# frontend, nccl4py, ... ~200 MB) serve other FlashInfer kernels and are left out. It stages them as one
# site-packages folder -- FlashInfer without its 330 MB data/ (CUDA sources and headers for JIT builds), except the
# DeepGEMM headers its FP8 block-scale path compiles at run time with NVRTC -- puts PREBUILT_SO (made by
# benchmarks/flashinfer_prebuild.py) where FlashInfer loads prebuilt modules from
# (flashinfer/data/aot/fused_moe_90/fused_moe_90.so), packs it as one tar.xz and cuts that into parts of
# PART_BYTES (default 48 MiB: a part plus this repository stays under a device call's 64 MiB).
#
# install: joins the parts, checks the SHA-256 of the whole, unpacks it into .peers/flashinfer/site and checks
# that `import flashinfer.fused_moe` works. Run it in the same call as the benchmark or any later one.
set -euo pipefail
PYTHON=${PYTHON:-python3}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=$repo/.peers/flashinfer
PART_BYTES=${PART_BYTES:-$((48 * 1024 * 1024))}
FLASHINFER_VERSION=0.7.2.post1
# exact versions (the ones the CPU import check used)
IMPORT_DEPS=(apache-tvm-ffi==0.1.15.post2 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
             charset-normalizer==3.5.3 nvidia-ml-py==13.615.71)

split_file() {  # FILE DIR BYTES: DIR/part-000, part-001, ... of at most BYTES each
  local file=$1 dir=$2 bytes=$3
  mkdir -p "$dir"
  rm -f "$dir"/part-*
  split -b "$bytes" -d -a 3 "$file" "$dir/part-"
}

join_parts() {  # DIR FILE: the parts in order, concatenated
  local dir=$1 file=$2
  compgen -G "$dir/part-*" > /dev/null || { echo "no $dir/part-* to join" >&2; return 1; }
  cat "$dir"/part-* > "$file"
}

pack() {
  local prebuilt=${1:?usage: $0 pack PREBUILT_SO [WHEELS]} wheels=${2:-/tmp/flashinfer-wheels}
  git -C "$repo" check-ignore -q "$root" || { echo "$root is not ignored by git" >&2; exit 1; }
  mkdir -p "$wheels"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" "flashinfer-python==$FLASHINFER_VERSION" "${IMPORT_DEPS[@]}"
  local stage=$root/stage
  rm -rf "$stage" && mkdir -p "$stage/site"
  for wheel in "$wheels"/*.whl; do
    case $(basename "$wheel") in
      flashinfer_python-*) ;;
      *) "$PYTHON" -m zipfile -e "$wheel" "$stage/site" ;;
    esac
  done
  local fi_wheel
  fi_wheel=$(ls "$wheels"/flashinfer_python-"$FLASHINFER_VERSION"-*.whl)
  # FlashInfer minus data/ (JIT build inputs), plus the DeepGEMM headers the FP8 block-scale GEMMs JIT-compile
  "$PYTHON" - "$fi_wheel" "$stage/site" <<'EOF'
import sys, zipfile
keep_data = "flashinfer/data/csrc/nv_internal/tensorrt_llm/deep_gemm/"
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = [n for n in wheel.namelist() if n.startswith("flashinfer/")
             and (not n.startswith("flashinfer/data/") or n.startswith(keep_data))]
    wheel.extractall(sys.argv[2], names)
EOF
  mkdir -p "$stage/site/flashinfer/data/aot/fused_moe_90"
  cp "$prebuilt" "$stage/site/flashinfer/data/aot/fused_moe_90/fused_moe_90.so"
  tar -C "$stage" -cf - site | xz -T2 -6 > "$root/payload.tar.xz"
  split_file "$root/payload.tar.xz" "$root/parts" "$PART_BYTES"
  (cd "$root" && sha256sum payload.tar.xz > parts/SHA256SUMS)
  rm -rf "$stage" "$root/payload.tar.xz"
  du -b "$root"/parts/part-* | awk '{printf "%s %.1f MiB\n", $2, $1 / 1048576}'
}

install() {
  local tmp
  tmp=$(mktemp -d)
  join_parts "$root/parts" "$tmp/payload.tar.xz"
  (cd "$tmp" && sha256sum -c --quiet "$root/parts/SHA256SUMS") || {
    echo "payload checksum mismatch: are all parts of $root/parts there?" >&2; exit 1; }
  rm -rf "$root/site"
  tar -C "$root" -xJf "$tmp/payload.tar.xz"
  rm -rf "$tmp"
  PYTHONPATH=$root/site "$PYTHON" -c "import flashinfer.fused_moe as m; print('flashinfer', m.__name__, 'imports')"
  du -sh "$root/site"
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  install) install ;;
  split) split_file "${2:?FILE}" "${3:?DIR}" "${4:?BYTES}" ;;
  join) join_parts "${2:?DIR}" "${3:?FILE}" ;;
  *) echo "usage: $0 pack PREBUILT_SO [WHEELS] | install | split FILE DIR BYTES | join DIR FILE" >&2; exit 2 ;;
esac
