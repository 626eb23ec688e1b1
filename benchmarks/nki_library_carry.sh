#!/usr/bin/env bash
# Makes .carry/nkilib (git-excluded), everything benchmarks/nki_library_remote.sh needs on a machine with Python
# 3.12, numpy, torch, pytest, pytest-xdist, scipy and pandas but no internet:
#
#   bash benchmarks/nki_library_carry.sh NKI_LIBRARY_CHECKOUT [BUNDLE]    # BUNDLE default: this repo's .carry/nkilib
#
# - wheels/: nki-library's harness dependencies that such a machine lacks (and theirs), for CPython 3.12 manylinux
#   x86-64, one version each (the ones the local runs used);
# - nki-library/: the checkout's HEAD without .git (git archive), and COMMIT, its short hash;
# - run.sh: benchmarks/nki_library_remote.sh.
set -euo pipefail
checkout=${1:?usage: $0 NKI_LIBRARY_CHECKOUT [BUNDLE]}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=${2:-$repo/.carry/nkilib}
mkdir -p "$bundle/wheels"
git -C "$bundle" check-ignore -q "$bundle" || {
  echo "$bundle is not ignored by git: add /.carry/ to .git/info/exclude (the bundle is never committed)" >&2
  exit 1
}
# Present there already (so not carried): aiohttp, jinja2, wrapt, python-dateutil, urllib3, pandas, scipy, filelock,
# execnet, pytest-xdist.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$bundle/wheels" \
  aws-embedded-metrics==3.5.0 boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 fabric2==3.2.3 \
  invoke==2.2.1 paramiko==5.1.0 bcrypt==5.0.0 cryptography==50.0.2 pynacl==1.6.2 cffi==2.1.1 pycparser==3.12 \
  decorator==5.3.1 deprecated==1.3.1 plotext==6.1.0 pytest-metadata==3.1.1 pytest-html==4.2.0 allpairspy==2.5.1
rm -rf "$bundle/nki-library"
mkdir "$bundle/nki-library"
git -C "$checkout" archive HEAD | tar -x -C "$bundle/nki-library"
git -C "$checkout" rev-parse --short HEAD > "$bundle/COMMIT"
cp "$repo/benchmarks/nki_library_remote.sh" "$bundle/run.sh"
du -sh "$bundle"
