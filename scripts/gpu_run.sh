#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run a command (a stage's GPU tests, a benchmark) against an applied tree on
# a machine without network, such as the lent H200s: vLLM's missing Python
# dependencies come as wheels, the tree as a tarball of its vllm/ package and
# egg-info (README, "GPU runs").
#   scripts/gpu_run.sh STAGE TREE_TGZ WHEEL_DIR COMMAND...
# COMMAND sees the tree in $DSA_VLLM_TREE and on PYTHONPATH.
set -euo pipefail
stage=$1 tree_tgz=$2 wheels=$3
shift 3
site=/tmp/dsa-site tree=/tmp/dsa-tree
if [ ! -d "$site" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" "$wheels"/*.whl
fi
rm -rf "$tree" && mkdir -p "$tree" && tar xzf "$tree_tgz" -C "$tree"
export PYTHONPATH="$tree:$PWD/tests:$PWD:$site" DSA_VLLM_TREE="$tree"
# The stages the tree holds, from patches/series.toml (the one list of them).
stages=$(python3 -c "import sys; from scripts.series.config import load_series
print(','.join(['base', *(s.id for s in load_series().stages_upto(sys.argv[1]))]))" "$stage")
export DSA_STAGES="$stages" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$@"
