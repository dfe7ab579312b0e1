# SPDX-License-Identifier: Apache-2.0
"""Stage 0004's guard: the padded decode path packs each decode request's
rows to next_n, while a layer's candidate blocks are listed per decode
token, so the two cannot meet. The op refuses padded decodes with
candidate blocks, by name, before scoring anything; the same step's decodes
unpadded (next_n 2 decodes of equal length) still take candidate blocks.

vLLM's own metadata builder makes each step and the real
``rocm_aiter_sparse_attn_indexer`` runs on the emulated gfx950 with the
AITER stand-ins. Not one of the stage's upstream probes: upstream may fix
the padded layout without this guard."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0004")

TOPK = 64
BLOCK = 64  # candidate block size, in keys
GUARD = "candidate blocks are listed per decode token, not per packed row"


def _run(requests, monkeypatch) -> list[tuple[int, int]]:
    """The step's (logits rows, candidate rows) of each decode candidate
    mask; the mask's Triton kernel itself uses inline assembly, which the
    interpreter cannot run, so it is recorded instead."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse

    masked: list[tuple[int, int]] = []

    def mask(logits, starts, ends, candidates, block_size, row_repeat):
        masked.append((logits.shape[0], candidates.shape[0]))

    monkeypatch.setattr(rocm_aiter_mla_sparse, "_apply_candidate_mask_strided", mask)
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(num_speculative_tokens=1)
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(builder, requests, cache_new_keys=True)
        rows = batch.hidden_states.shape[0]
        # Every token's candidates: its first blocks (enough to cover it).
        candidates = torch.arange(8, dtype=torch.int32).repeat(rows, 1)
        indexer_batch.run_indexer(
            batch,
            TOPK,
            candidate_blocks=candidates,
            candidate_block_size=BLOCK,
            skip_k_cache_insert=True,
        )
        decode = batch.metadata.decode
        assert decode is not None and decode.requires_padding is (
            len({new for _, new in requests}) > 1
        )
    return masked


def test_padded_decodes_with_candidate_blocks_are_refused(monkeypatch):
    # A zero-length request among next_n 2 decodes: the builder pads them.
    requests = [(248, 2), (40, 0), (120, 2)]
    with pytest.raises(AssertionError, match=GUARD):
        _run(requests, monkeypatch)


def test_unpadded_decodes_take_candidate_blocks(monkeypatch):
    # Two next_n 2 decodes: four rows, one per token, candidates per token.
    assert _run([(248, 2), (120, 2)], monkeypatch) == [(4, 4)]
