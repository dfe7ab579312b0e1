# SPDX-License-Identifier: Apache-2.0
"""The applied tree imports on CPU, from the tree itself, with Triton on."""

import importlib
from pathlib import Path

import pytest

from scripts.harness.tree import applied_tree

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
