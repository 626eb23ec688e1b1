#!/usr/bin/env bash
# Carries FlashInfer's CUTLASS fused MoE (the `flashinfer_cutlass` peers) to an offline GPU machine in parts that
# each fit one device call, and installs it there without pip or internet. Nothing of FlashInfer is committed: all
# of it lives under the git-ignored .peers/flashinfer/.
#
#   bash benchmarks/flashinfer_carry.sh pack [PREBUILT_SO]    # build machine (internet): .peers/flashinfer/parts/
#   bash benchmarks/flashinfer_carry.sh install               # GPU machine: parts/ -> .peers/flashinfer/site/
#   bash benchmarks/flashinfer_carry.sh split FILE DIR BYTES  # the pieces of both, exposed for the tests
#   bash benchmarks/flashinfer_carry.sh join DIR FILE
#
# pack: downloads (pip download, once, into $WHEELS, default /tmp/flashinfer-wheels) flashinfer-python 0.7.2.post1
# and the few packages its import and build need for CPython 3.12 x86-64: apache-tvm-ffi (its binding layer and
# headers) with typing-extensions, requests and its four dependencies, nvidia-ml-py, ninja; and the cuBLAS, NVRTC
# and cuRAND headers its TensorRT-LLM sources include (from the nvidia-cublas, -cuda-nvrtc and -curand wheels: the
# CUDA toolkits of both machines lack them). The rest of FlashInfer's declared dependencies (cuda-python, cutlass-dsl, cudnn frontend,
# nccl4py, ... ~200 MB) serve other kernels and are left out. It stages one site-packages folder: FlashInfer without
# the parts of its 330 MB data/ that the SM90 fused MoE does not compile (kept: TensorRT-LLM's MoE sources, CUTLASS,
# CCCL, spdlog, FlashInfer's headers; the DeepGEMM headers among them are also compiled at run time, by nvcc, on
# the FP8 block-scale path) and PREBUILT_SO (benchmarks/flashinfer_prebuild.py's output) where FlashInfer loads
# prebuilt modules from (flashinfer/data/aot/fused_moe_90/fused_moe_90.so). Without PREBUILT_SO the module is built
# on the GPU machine (benchmarks/README.md). The stage is packed as one tar.xz cut into parts of $PART_BYTES
# (default 48 MiB: a part plus this repository stays under a device call's 64 MiB), with the SHA-256 of the whole.
#
# install: joins the parts, checks the SHA-256, unpacks into .peers/flashinfer/ (site/, cuda-extra/include), links
# cuda-extra/lib/libnvrtc.so and libcuda.so to the machine's libraries (for a build there) and checks that
# `import flashinfer.fused_moe` works.
set -euo pipefail
PYTHON=${PYTHON:-python3}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=$repo/.peers/flashinfer
PART_BYTES=${PART_BYTES:-$((48 * 1024 * 1024))}
FLASHINFER_VERSION=0.7.2.post1
# exact versions (the ones the CPU import check used)
IMPORT_DEPS=(apache-tvm-ffi==0.1.15.post2 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
             charset-normalizer==3.5.3 nvidia-ml-py==13.615.71 ninja==1.13.0 typing-extensions==4.16.0)
HEADER_WHEELS=("nvidia-cublas>=13.0,<13.2" "nvidia-cuda-nvrtc>=13.0,<13.1" "nvidia-curand>=10.4.0,<10.4.1")  # CUDA 13.0

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
  local prebuilt=${1:-} wheels=${WHEELS:-/tmp/flashinfer-wheels}
  git -C "$repo" check-ignore -q "$root" || { echo "$root is not ignored by git" >&2; exit 1; }
  mkdir -p "$wheels/headers"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux_2_5_x86_64 \
    -d "$wheels" "flashinfer-python==$FLASHINFER_VERSION" "${IMPORT_DEPS[@]}"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_12_x86_64 -d "$wheels/headers" "${HEADER_WHEELS[@]}"
  local stage=$root/stage
  rm -rf "$stage"
  mkdir -p "$stage/site" "$stage/cuda-extra/include"
  "$PYTHON" "$repo/benchmarks/flashinfer_stage.py" "$wheels" "$stage"
  if [[ -n $prebuilt ]]; then
    mkdir -p "$stage/site/flashinfer/data/aot/fused_moe_90"
    cp "$prebuilt" "$stage/site/flashinfer/data/aot/fused_moe_90/fused_moe_90.so"
  fi
  tar -C "$stage" -cf - site cuda-extra | xz -T2 -6 > "$root/payload.tar.xz"
  split_file "$root/payload.tar.xz" "$root/parts" "$PART_BYTES"
  (cd "$root" && sha256sum payload.tar.xz > parts/SHA256SUMS)
  rm -rf "$stage" "$root/payload.tar.xz"
  du -b "$root"/parts/part-* | awk '{printf "%s %.1f MiB\n", $2, $1 / 1048576}'
}

cuda_extra_libs() {  # link names for a build here: libnvrtc.so (torch's wheel or the toolkit), libcuda.so (driver)
  local lib=$root/cuda-extra/lib nvrtc cuda
  mkdir -p "$lib"
  nvrtc=$("$PYTHON" -c '
import glob, os, torch
roots = [os.path.join(os.path.dirname(torch.__file__), "..", "nvidia"), "/usr/local/cuda"]
found = [p for r in roots for p in sorted(glob.glob(os.path.join(r, "**", "libnvrtc.so.1*"), recursive=True))]
print(os.path.realpath(found[0]) if found else "")')
  cuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  if [[ -n $nvrtc ]]; then ln -sf "$nvrtc" "$lib/libnvrtc.so"; fi
  if [[ -n $cuda ]]; then ln -sf "$cuda" "$lib/libcuda.so"; fi
  echo "cuda-extra/lib: libnvrtc.so -> ${nvrtc:-none found}, libcuda.so -> ${cuda:-none found}"
}

install() {
  local tmp
  tmp=$(mktemp -d)
  join_parts "$root/parts" "$tmp/payload.tar.xz"
  (cd "$tmp" && sha256sum -c --quiet "$root/parts/SHA256SUMS") || {
    echo "payload checksum mismatch: are all parts of $root/parts there?" >&2; exit 1; }
  rm -rf "$root/site" "$root/cuda-extra"
  tar -C "$root" -xJf "$tmp/payload.tar.xz"
  rm -rf "$tmp"
  cuda_extra_libs
  PYTHONPATH=$root/site "$PYTHON" -c "import flashinfer, flashinfer.fused_moe; print('flashinfer', flashinfer.__version__)"
  if [[ -f $root/site/flashinfer/data/aot/fused_moe_90/fused_moe_90.so ]]; then
    echo "prebuilt fused_moe_90.so installed"
  else
    echo "no prebuilt fused_moe_90.so: build it here with benchmarks/flashinfer_prebuild.py (benchmarks/README.md)"
  fi
  du -sh "$root/site"
}

case ${1:-} in
  pack) shift; pack "${1:-}" ;;
  install) install ;;
  split) split_file "${2:?FILE}" "${3:?DIR}" "${4:?BYTES}" ;;
  join) join_parts "${2:?DIR}" "${3:?FILE}" ;;
  *) echo "usage: $0 pack [PREBUILT_SO] | install | split FILE DIR BYTES | join DIR FILE" >&2; exit 2 ;;
esac
