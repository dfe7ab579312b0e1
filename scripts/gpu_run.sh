#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run a command (a stage's GPU tests, a benchmark) against an applied tree on
# a machine without network, such as the lent H200s: vLLM's missing Python
# dependencies come as wheels, the tree as a tarball of its vllm/ package and
# egg-info (README, "GPU runs").
#   scripts/gpu_run.sh STAGE TREE_TGZ WHEEL_DIR COMMAND...
# COMMAND sees the tree on PYTHONPATH and the test contract's variables.
set -euo pipefail
stage=$1 tree_tgz=$2 wheels=$3
shift 3
site=/tmp/dsa-site tree=/tmp/dsa-tree
if [ ! -d "$site" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" "$wheels"/*.whl
fi
rm -rf "$tree" && mkdir -p "$tree" && tar xzf "$tree_tgz" -C "$tree"
export PYTHONPATH="$tree:$PWD:$site" PYTHONUNBUFFERED=1
# Benchmarks state the command that produced their results.
export DSA_GPU_RUN="bash scripts/gpu_run.sh $stage $tree_tgz $wheels"
# The test contract for this tree (scripts/series/contract.py).
eval "$(python3 -m scripts.series env "$stage" --tree "$tree" --gpu)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$@"
