# SPDX-License-Identifier: Apache-2.0
"""The environment a test process of one stage's tree gets (set by ``test``
and the rebase probe, printed by ``env``; read by scripts/harness/tree.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

TREE_ENV = "DSA_VLLM_TREE"  # the applied vLLM tree under test
STAGES_ENV = "DSA_STAGES"  # what it holds: "base,0001,..."
# The base's tree, for tests that compare a stage with the base it patches.
BASE_TREE_ENV = "DSA_BASE_TREE"
# {plugin module: [test files it applies to]} for vLLM's own tests.
PLUGIN_FILES_ENV = "DSA_PLUGIN_FILES"
# Where the compile matrix (tests/gfx_compile) writes its per-kernel counts.
COMPILE_SUMMARY_ENV = "DSA_COMPILE_SUMMARY"
# The stages' test folders ("stage_0001,...") that ran on their own trees
# in this test run: the top tree's run leaves out their tests marked
# ``own_tree`` (scripts/harness/own_tree.py).
OWN_TREE_RAN_ENV = "DSA_OWN_TREE_RAN"

# CPU platform: no GPU (an empty CUDA_VISIBLE_DEVICES keeps vLLM's Triton on),
# Triton kernels through the interpreter, bytecode written so a tree is
# compiled once rather than on every import, and one OpenMP thread per test
# process: the tool runs one process per CPU side by side, and more threads
# only contend for the same CPUs (stage 0002's and 0003's tests alone: 11 %
# less CPU time at one thread, at the same wall time).
CPU_ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "TRITON_INTERPRET": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "PYTHONWARNINGS": "ignore:`torch.jit.script_method` is deprecated",
}


def tree_env(
    tree: Path, stages: Sequence[str], base_tree: Path | None, *, cpu: bool = True
) -> dict[str, str]:
    """The variables for testing ``tree`` (holding ``stages``); ``cpu``
    adds the CPU platform's. Without a base tree, the tests that compare
    with the base skip."""
    env = {
        **(CPU_ENV if cpu else {}),
        TREE_ENV: str(tree),
        STAGES_ENV: ",".join(stages),
    }
    if base_tree is not None:
        env[BASE_TREE_ENV] = str(base_tree)
    return env
