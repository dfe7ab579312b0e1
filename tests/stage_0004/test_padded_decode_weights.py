# SPDX-License-Identifier: Apache-2.0
"""Stage 0004's behaviour, stated without any module of its own (so it is
part of the stage's upstream probe): when the ROCm indexer op pads its decode
rows (``requires_padding``), each packed row is scored with its own token's
head weights, so a step selects what the same tokens select without the
zero-length requests that made the builder pad.

vLLM's own metadata builder makes each step twice: with the zero-length
requests and without them, the same tokens, keys and weights otherwise. The
real ``rocm_aiter_sparse_attn_indexer`` runs on the emulated gfx950 with the
AITER stand-ins. Top-k is below every row's key count, so which keys a row
selects depends on its weights. Where scores tie at the k-th place, the
selections may differ only in keys of the same score (checked with vLLM's
torch reference logits, row by row)."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import indexer_batch, topk_reference
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")

TOPK = 64

# (next_n, requests, padded): (context, query) per request, decodes first,
# as vLLM orders them, and whether vLLM's builder pads the step's decode rows.
# Every row has more keys than TOPK. A (context, 0) request is a zero-length
# decode; the step without it is the reference. The builder pads on the
# native path (next_n 1 and 2 here) when decode lengths differ; next_n 3 and
# 4 are flattened to one row per token, which never pads. A zero-length
# request first makes the batch split put it alone in the decode group: no
# decode rows, and the other requests are scored as prefills.
STEPS = {
    "one zero-length decode in the middle, then a prefill": (
        2,
        [(248, 2), (140, 0), (120, 2), (90, 2), (70, 24)],
        True,
    ),
    "two zero-length decodes in a row, then prefills": (
        2,
        [(300, 2), (80, 0), (150, 0), (120, 2), (80, 20), (70, 12)],
        True,
    ),
    "a zero-length decode first, then a prefill": (
        2,
        [(140, 0), (200, 2), (96, 2), (70, 24)],
        False,
    ),
    "a zero-length decode last among the decodes, then a prefill": (
        2,
        [(180, 2), (120, 2), (140, 0), (65, 20)],
        True,
    ),
    "decodes only, a gap in the middle": (
        2,
        [(250, 2), (100, 0), (130, 2), (77, 2)],
        True,
    ),
    "next_n 3, a gap after a short request": (
        3,
        [(220, 3), (160, 2), (90, 0), (300, 3), (90, 20)],
        False,
    ),
    "next_n 4, decodes only, a gap first": (
        4,
        [(70, 0), (200, 4), (120, 3), (150, 4)],
        False,
    ),
    "next_n 4, two gaps, then a prefill": (
        4,
        [(200, 4), (90, 0), (100, 0), (130, 4), (111, 1), (64, 16)],
        False,
    ),
    "no speculative decoding: decode lengths 1 and 0, then a prefill": (
        1,
        [(200, 1), (90, 0), (150, 1), (180, 1), (66, 20)],
        True,
    ),
    "no speculative decoding, decodes only, a gap first": (
        1,
        [(90, 0), (200, 1), (150, 1)],
        True,
    ),
}


def _without_gaps(requests):
    return [(c, q) for c, q in requests if q]


def _copy_cache(source, target) -> None:
    """Put the source step's cached keys of each request that has tokens
    into the target step's pages (the target has no zero-length requests)."""
    page = source.kv_cache.shape[1]
    kept = torch.nonzero(torch.bincount(source.row_requests)).flatten().tolist()
    for target_req, source_req in enumerate(kept):
        seq = int(source.row_ends[source.row_requests == source_req].max())
        pages = -(-seq // page)
        target.kv_cache[target.block_table[target_req, :pages].long()] = (
            source.kv_cache[source.block_table[source_req, :pages].long()]
        )


@pytest.mark.parametrize("name", list(STEPS))
def test_padded_decode_rows_select_what_unpadded_ones_do(name, monkeypatch):
    next_n, requests, padded_layout = STEPS[name]
    # Every row, the first of each prompt included, has more keys than TOPK.
    assert all(c + 1 > TOPK for c, q in requests if q)
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(num_speculative_tokens=next_n - 1)
        builder = indexer_batch.make_builder(config, monkeypatch)
        padded = indexer_batch.build_batch(builder, requests, cache_new_keys=True)
        assert padded.metadata.decode.requires_padding == padded_layout
        # Run before the next build: the builder's buffers hold the metadata.
        got = indexer_batch.run_indexer(padded, TOPK, skip_k_cache_insert=True)
        plain = indexer_batch.build_batch(
            builder, _without_gaps(requests), cache_new_keys=True
        )
        # The same tokens (a request's context draws from the random stream).
        plain.q_fp8.copy_(padded.q_fp8)
        plain.weights.copy_(padded.weights)
        _copy_cache(padded, plain)
        assert torch.equal(plain.row_ends, padded.row_ends)
        want = indexer_batch.run_indexer(plain, TOPK, skip_k_cache_insert=True)
    logits = padded.reference_logits()
    topk_reference.assert_same_selection(logits, got, want, padded.row_ends, TOPK)
