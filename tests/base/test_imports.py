# SPDX-License-Identifier: Apache-2.0
"""The applied tree imports on CPU, from the tree itself, with Triton on."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.harness.tree import applied_tree
from scripts.series.rebase.checks import package_modules

TREE = applied_tree("base")

INDEXER_MODULES = [
    "vllm.envs",
    "vllm._aiter_ops",
    "vllm.v1.attention.ops.rocm_aiter_mla_sparse",
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.v1.attention.backends.mla.indexer",
]


@pytest.mark.parametrize("name", INDEXER_MODULES)
def test_indexer_module_imports_from_tree(name):
    module = importlib.import_module(name)
    origin = Path(module.__file__).resolve()
    assert TREE.path.resolve() in origin.parents, f"{name} came from {origin}"


def test_version_and_triton_are_available():
    """Without vllm/_version.py and the egg-info (force-added to the base
    commit), vLLM cannot read its version and replaces Triton with a stub."""
    import vllm
    from vllm.triton_utils import HAS_TRITON

    assert vllm.__version__ not in ("", "dev", "0.0.0")
    assert HAS_TRITON, "vLLM disabled Triton; CUDA_VISIBLE_DEVICES must be ''"


def _stage_modules() -> list[str]:
    """The vLLM modules the tree's stages add or change (its commits since
    the base: the trees are work trees of the series' repo)."""
    changed = subprocess.run(
        ["git", "-C", str(TREE.path), "diff", "--name-only", "refs/tags/base", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    kept = [path for path in changed if (TREE.path / path).is_file()]
    return package_modules("vllm", kept)


def test_stage_modules_import_as_the_rebase_checks_them():
    """A rebase imports each vLLM module a stage touches on its target with
    scripts/harness/import_check.py, on the platform the tests emulate; here
    every such module of this tree must pass it, so a stage cannot add one
    the rebase would stop on. vllm.platforms.rocm, which asks the GPU for its
    arch at import, is among them from stage 0003 on."""
    modules = _stage_modules()
    if not modules:
        pytest.skip("the base tree: no stage module to import")
    project = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "scripts.harness.import_check", *modules],
        env={**os.environ, "PYTHONPATH": f"{TREE.path}:{project}"},
        cwd=project,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
