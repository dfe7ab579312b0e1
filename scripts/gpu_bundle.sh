#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepare what a GPU run carries to a machine without network (README, "GPU
# runs"): the stage's applied tree as .devcarry/vllm-STAGE.tgz and the wheels
# of scripts/gpu_wheels.txt in .whl/ (CPython 3.12, x86-64 manylinux).
#   scripts/gpu_bundle.sh STAGE
set -euo pipefail
stage=$1
cd "$(dirname "$0")/.."
tree=$(python -m scripts.series tree "$stage")
mkdir -p .devcarry .whl
tar czf ".devcarry/vllm-$stage.tgz" --exclude=__pycache__ -C "$tree" vllm vllm.egg-info
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
    manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
grep -v '^#' scripts/gpu_wheels.txt | xargs python -m pip download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl
du -sh .devcarry .whl
