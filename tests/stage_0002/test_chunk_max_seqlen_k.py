# SPDX-License-Identifier: Apache-2.0
"""Stage 0002: the longest sequence of a chunk's requests, carried as a host
int by vLLM's metadata builder. The dispatch table of the gate itself is
unit-tested by the stage's PR test (tests/v1/attention/
test_rocm_indexer_topk_gate.py in vLLM's tree, vllm_overlay/ here)."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0002")


@pytest.mark.parametrize(
    ("requests", "chunk_logits"),
    [
        ([(0, 90)], 4096),  # one sequence sliced into chunks
        ([(30, 1), (0, 20), (9, 14), (40, 16)], 4096),  # decode, then packed
        ([(100, 40), (0, 8), (2, 70)], 2000),
    ],
)
def test_chunks_carry_their_requests_longest_sequence(
    monkeypatch, requests, chunk_logits
):
    """Through vLLM's own builder: every chunk's max_seqlen_k is the longest
    full sequence (context + query) among the requests it holds rows of,
    computed here from the requests alone; it bounds every row's keys."""
    indexer_batch.shrink_logits_budget(monkeypatch, chunk_logits)
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config()
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(builder, requests)
    chunks = batch.metadata.prefill.chunks
    assert len(chunks) >= 2 or len(requests) == 1
    sliced = False
    for chunk in chunks:
        rows = batch.row_ends[chunk.token_start : chunk.token_end]
        held = batch.row_requests[chunk.token_start : chunk.token_end].unique()
        assert isinstance(chunk.max_seqlen_k, int)
        assert chunk.max_seqlen_k == max(sum(requests[r]) for r in held.tolist())
        assert chunk.max_seqlen_k >= int(rows.max())
        sliced |= chunk.max_seqlen_k > int(rows.max())
        assert torch.equal(chunk.cu_seqlen_ke - chunk.cu_seqlen_ks, rows.int())
    if len(requests) == 1:
        # A prompt split into query-row chunks: the first chunk's rows see
        # fewer keys than the prompt has, yet it carries the full length.
        assert sliced
