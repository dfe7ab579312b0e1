# SPDX-License-Identifier: Apache-2.0
"""Stage 0004's behaviour, stated without any module of its own (so it is
also the stage's upstream probe): when the ROCm indexer op pads its decode
rows (``requires_padding``: MTP decodes of unequal length on the native
next_n path), the prefill rows that follow the decodes in
``topk_indices_buffer`` keep their own top-k.

vLLM's own metadata builder makes each step (MTP, next_n 2 and 3), and the
real ``rocm_aiter_sparse_attn_indexer`` runs on the emulated gfx950 with the
AITER stand-ins. Every row here has fewer keys than k, so its top-k is all
of its causal keys whatever order or tie choice a kernel makes: row r of a
request must hold exactly the key indices 0 .. end_r - 1, and -1 after."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")

TOPK = 2048

# (context, query) per request, decodes first as vLLM orders them, and
# whether vLLM's builder pads this step's decode rows. A zero-length request
# among next_n 2 decodes makes the packed rows (3 x 2) outnumber the decode
# tokens (4). The other steps take unpadded paths (a one-token request is
# split off as a prefill; next_n 3 has no native kernel and flattens) and
# keep every row either way.
STEPS = {
    "a zero-length decode between next_n 2 decodes, then a prefill": (
        2,
        [(248, 2), (40, 0), (120, 2), (0, 101)],
        True,
    ),
    "a zero-length decode last among the decodes, then two prefills": (
        2,
        [(50, 2), (120, 2), (40, 0), (0, 60), (10, 30)],
        True,
    ),
    "a one-token request among next_n 2 decodes": (
        2,
        [(300, 2), (77, 1), (0, 64)],
        False,
    ),
    "next_n 3 decodes of 3, 1 and 2 tokens, then two prefills": (
        3,
        [(90, 3), (150, 1), (61, 2), (0, 40), (33, 25)],
        False,
    ),
}


def _rows_hold_their_causal_keys(buffer: torch.Tensor, batch) -> list[str]:
    wrong = []
    for row in range(batch.row_ends.numel()):
        end = int(batch.row_ends[row])
        got = buffer[row]
        valid = got[got >= 0]
        if sorted(valid.tolist()) != list(range(end)) or (got[end:] != -1).any():
            req = int(batch.row_requests[row])
            wrong.append(
                f"row {row} (request {req}, {end} keys) holds {valid.numel()} "
                f"indices, up to {int(valid.max()) if valid.numel() else -1}"
            )
    return wrong


@pytest.mark.parametrize("name", list(STEPS))
def test_prefill_rows_after_padded_decodes_keep_their_top_k(name, monkeypatch):
    next_n, requests, padded = STEPS[name]
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(num_speculative_tokens=next_n - 1)
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(builder, requests, cache_new_keys=True)
        decode = batch.metadata.decode
        assert decode is not None and decode.requires_padding == padded
        assert batch.num_prefill_tokens > 0
        buffer = indexer_batch.run_indexer(batch, TOPK, skip_k_cache_insert=True)
    assert _rows_hold_their_causal_keys(buffer, batch) == []
