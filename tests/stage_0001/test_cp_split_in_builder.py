# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the split planned through vLLM's own indexer metadata builder.
The plan's rules, the settings and their errors are unit-tested by the
stage's PR test (tests/v1/attention/test_rocm_cp_indexer.py in vLLM's tree,
vllm_overlay/ here)."""

from __future__ import annotations

import pytest

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.v1.attention.ops.rocm_cp_indexer import CPIndexerSplit  # noqa: E402


@pytest.fixture
def cp_on(monkeypatch):
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    with emulate_rocm("gfx950"):
        yield


def test_the_metadata_builder_plans_the_split(cp_on, monkeypatch):
    """Through vLLM's own builder: decode rows first, then the plan over the
    prefill rows only."""
    config = indexer_batch.make_vllm_config(tp_size=4)
    builder = indexer_batch.make_builder(config, monkeypatch)
    assert builder.cp_indexer_stripe == 512
    batch = indexer_batch.build_batch(builder, [(30, 1), (0, 200), (50, 90)])
    assert batch.metadata.prefill.cp_split == CPIndexerSplit(4, 36, 1, 290)
    single = indexer_batch.make_builder(indexer_batch.make_vllm_config(1), monkeypatch)
    batch = indexer_batch.build_batch(single, [(30, 1), (0, 200)])
    assert batch.metadata.prefill.cp_split is None
