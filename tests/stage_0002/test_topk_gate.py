# SPDX-License-Identifier: Apache-2.0
"""Stage 0002: the top-k dispatch table through the real patched gate, and
the longest sequence of a chunk's requests carried as a host int by vLLM's
metadata builder."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0002")

from vllm.v1.attention.ops import rocm_indexer_topk_gate as gate  # noqa: E402

MAX_MODEL_LEN = 163840
PLATFORMS = ["gfx950", "gfx942", "cuda"]  # "cuda": not ROCm (no emulation)
PHASES = ["decode", "prefill 32767", "prefill 32768"]


def _platform(arch: str, aiter: bool):
    if arch == "cuda":
        return contextlib.nullcontext()
    return emulate_rocm(arch, aiter=aiter)


def _decide(phase: str, ratio: int, k: int, full_graph: bool) -> bool:
    if phase == "decode":
        # The op passes a replay-safe bound under FULL graphs (max_model_len),
        # the batch's longest context otherwise.
        bound = MAX_MODEL_LEN if full_graph else 4096 // ratio
        return gate.decode_uses_aiter_top_k(
            compress_ratio=ratio,
            topk_tokens=k,
            num_rows=8,
            num_columns=MAX_MODEL_LEN // ratio,
            max_valid_seq_len=bound,
        )
    longest = int(phase.split()[1])
    return gate.prefill_uses_aiter_top_k(
        compress_ratio=ratio, topk_tokens=k, num_rows=512, max_seqlen_k=longest
    )


def _base_rule(phase: str, ratio: int, k: int, full_graph: bool) -> bool:
    """What vLLM 0.32.0's op decided (rocm_aiter_ops is unchanged by the
    series): only compressed indexers ever took AITER's top-k."""
    from vllm._aiter_ops import rocm_aiter_ops

    if phase == "decode":
        bound = MAX_MODEL_LEN if full_graph else 4096 // ratio
        return bool(
            rocm_aiter_ops.is_indexer_top_k_supported(
                is_prefill=False,
                compress_ratio=ratio,
                num_rows=8,
                max_valid_seq_len=bound,
            )
        ) and not rocm_aiter_ops.dsv4_indexer_prefers_native_top_k(
            num_rows=8, num_columns=MAX_MODEL_LEN // ratio, topk_tokens=k
        )
    return bool(
        rocm_aiter_ops.is_indexer_top_k_supported(
            is_prefill=True, compress_ratio=ratio, num_rows=512
        )
    )


# AITER on/off is a ROCm switch: the non-ROCm rows take it as on.
TABLE = [
    row
    for row in itertools.product(
        PLATFORMS, [True, False], [1, 4], [2048, 512, 1024], PHASES, [True, False]
    )
    if row[0] != "cuda" or row[1]
]


@pytest.mark.parametrize(("arch", "aiter", "ratio", "k", "phase", "full_graph"), TABLE)
def test_dispatch_table(arch, aiter, ratio, k, phase, full_graph):
    with _platform(arch, aiter):
        got = _decide(phase, ratio, k, full_graph)
        base = _base_rule(phase, ratio, k, full_graph)
    if ratio == 1 and k == 2048 and arch == "gfx950" and aiter:
        assert got is (phase != "prefill 32767"), "decode always, prefill from 32K"
    else:
        assert got is base, "must behave exactly as on the base"
    if ratio == 1:
        assert base is False  # the base never sent the uncompressed indexer


def test_the_threshold_is_32k_keys():
    assert gate.AITER_PREFILL_MIN_KEYS == 32768
    assert gate.DSA_TOPK == 2048


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


def test_max_seqlen_k_is_the_longest_request_of_the_chunk():
    seq_lens = torch.tensor([9, 40000, 120, 7])
    assert gate.chunk_max_seqlen_k(seq_lens, 0, 2) == 40000
    assert gate.chunk_max_seqlen_k(seq_lens, 2, 4) == 120
    assert gate.chunk_max_seqlen_k(seq_lens, 3, 4) == 7
