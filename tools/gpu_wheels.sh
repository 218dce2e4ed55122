#!/usr/bin/env bash
# Download, on a machine with network, every wheel `make gpu-smoke` needs beyond a lent GPU machine's image
# (Python 3.12, a CUDA torch, transformers): tools/gpu_smoke.py's NEEDS, as cp312 manylinux x86_64 wheels (or
# pure-Python ones), without their dependencies (NEEDS is the complete list: tests/test_gpu_path.py checks it
# against what a run of the smoke's config imports). Never downloads torch. Prints the folder's size.
#   bash tools/gpu_wheels.sh DIR      then on the GPU machine: pip install --no-index --no-deps DIR/*.whl
set -euo pipefail
DIR=${1:?usage: bash tools/gpu_wheels.sh DIR}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-python3}
mapfile -t REQS < <("$PY" "$HERE/tools/gpu_smoke.py" --requirements)
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$DIR" "${REQS[@]}"
ls -1 "$DIR"
du -sh "$DIR"
