# SPDX-License-Identifier: Apache-2.0
"""Stage 0002 through the real patched indexer op: AITER's top-k (the
contract-faithful stand-in) selects what the in-tree kernel selects, with
sequence-local prefill indices and exact decode row ends."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import indexer_batch, topk_reference
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0002")

from vllm._aiter_ops import rocm_aiter_ops  # noqa: E402
from vllm.v1.attention.ops import rocm_indexer_topk_gate as gate  # noqa: E402

K = 2048


def _assert_rows_valid(buffer: torch.Tensor, row_ends: torch.Tensor) -> None:
    """Every row: min(L, k) distinct indices in [0, L), then -1."""
    for row, end in enumerate(row_ends.tolist()):
        n = min(end, K)
        got = buffer[row].tolist()
        assert got[n:] == [-1] * (K - n), f"row {row}: tail"
        head = got[:n]
        assert len(set(head)) == n and min(head) >= 0 and max(head) < end, (
            f"row {row}: {n} distinct indices in [0, {end}) expected"
        )


class Calls:
    """Records the AITER top-k calls the op makes (and their logits)."""

    def __init__(self, monkeypatch):
        self.prefill: list = []
        self.decode: list = []
        real_prefill = rocm_aiter_ops.indexer_top_k_prefill
        real_decode = rocm_aiter_ops.indexer_top_k_decode

        def prefill(logits, starts, ends, indices, k):
            self.prefill.append((logits.clone(), starts.clone(), ends.clone()))
            return real_prefill(logits, starts, ends, indices, k)

        def decode(logits, next_n, seq_lens, indices, k):
            self.decode.append((logits.clone(), next_n, seq_lens.clone()))
            return real_decode(logits, next_n, seq_lens, indices, k)

        monkeypatch.setattr(rocm_aiter_ops, "indexer_top_k_prefill", prefill)
        monkeypatch.setattr(rocm_aiter_ops, "indexer_top_k_decode", decode)


@pytest.mark.parametrize("width", [133120, 1048576])
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_decode_takes_aiter_with_exact_row_ends(monkeypatch, width, next_n):
    """Decode rows reach AITER's top-k with each row's exact end; logits past
    the end are poison, so a wrong bound would select them."""
    requests = [(2500, next_n), (2100, next_n), (3000, next_n)]
    with emulate_rocm("gfx950"):
        calls = Calls(monkeypatch)
        config = indexer_batch.make_vllm_config(
            max_len=width, num_speculative_tokens=next_n - 1
        )
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(builder, requests, torch_context=True)
        assert batch.num_decode_tokens == 3 * next_n and batch.num_prefill_tokens == 0
        buffer = indexer_batch.run_indexer(batch, K)
    assert len(calls.decode) == 1
    logits, passed_next_n, seq_lens = calls.decode[0]
    assert logits.shape[1] == width
    # One row per token, each with its own end: next_n = 1, flat lengths.
    assert passed_next_n == 1 and seq_lens.dim() == 1
    assert torch.equal(seq_lens.long(), batch.row_ends)
    _assert_rows_valid(buffer, batch.row_ends)
    # The in-tree kernel on the same logits and the op's own decode bounds.
    decode = batch.metadata.decode
    rows = logits.shape[0]
    in_tree = torch.empty((rows, K), dtype=torch.int32)
    topk_reference.vllm_top_k_per_row_decode(
        logits,
        rows // decode.seq_lens.shape[0],
        decode.seq_lens,
        in_tree,
        rows,
        logits.stride(0),
        logits.stride(1),
        K,
    )
    topk_reference.assert_same_selection(
        logits, buffer[:rows], in_tree, batch.row_ends, K
    )


def _prefill(monkeypatch, min_keys: int):
    """Packed prefill, one chunk; AITER takes chunks whose longest request has
    at least ``min_keys`` keys (lowered so small chunks reach it)."""
    monkeypatch.setattr(gate, "AITER_PREFILL_MIN_KEYS", min_keys)
    requests = [(0, 30), (70, 25), (2, 40)]
    with emulate_rocm("gfx950"):
        calls = Calls(monkeypatch)
        config = indexer_batch.make_vllm_config()
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(builder, requests)
        return calls, batch, indexer_batch.run_indexer(batch, K)


def test_prefill_chunks_take_aiter_with_sequence_local_indices(monkeypatch):
    with pytest.MonkeyPatch.context() as in_tree_patch:
        in_tree_calls, batch, in_tree = _prefill(in_tree_patch, 96)
    chunk = batch.metadata.prefill.chunks[0]
    assert chunk.max_seqlen_k == 95  # below 96: the in-tree kernel
    assert in_tree_calls.prefill == []
    aiter_calls, _, via_aiter = _prefill(monkeypatch, 95)
    assert len(aiter_calls.prefill) == 1
    _, starts, _ = aiter_calls.prefill[0]
    assert int(starts.max()) > 0, "packed rows start past column 0"
    # Rows hold min(L, k) keys: the sets are all-of-row, so equal exactly.
    assert torch.equal(via_aiter.sort(dim=1).values, in_tree.sort(dim=1).values)
    _assert_rows_valid(via_aiter, batch.row_ends)


ON_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None,
    reason="compiles vLLM's Triton localisation for an NVIDIA GPU (H200 device)",
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_aiter_prefill_wrapper_matches_in_tree_on_long_packed_rows(device):
    """vLLM's AITER prefill wrapper (stand-in top-k, then vLLM's Triton
    localisation kernel: interpreted on the CPU, compiled on a GPU) on rows
    longer than k, packed as in a chunk."""
    with emulate_rocm("gfx950"):
        topk_reference.assert_prefill_paths_agree(
            [2600, 3100, 2049, 4000], K, device, seed=7
        )


def test_a_32k_prefill_takes_aiter_through_the_gate_and_selects_the_top_keys(
    monkeypatch,
):
    """Rows of 32,761-32,768 keys (an extend of 8 tokens on 32,760 cached):
    the real 32K gate sends the chunk to AITER's top-k, and each row holds
    its 2,048 best keys by vLLM's own torch logits, sequence-local (compared
    as sets, by score where scores tie)."""
    requests = [(32760, 8)]
    with emulate_rocm("gfx950"):
        calls = Calls(monkeypatch)
        config = indexer_batch.make_vllm_config(max_len=33024)
        builder = indexer_batch.make_builder(config, monkeypatch)
        batch = indexer_batch.build_batch(
            builder, requests, cache_new_keys=True, torch_context=True
        )
        got = indexer_batch.run_indexer(
            batch, K, skip_k_cache_insert=True, torch_gather=True
        )
    assert [c.max_seqlen_k for c in batch.metadata.prefill.chunks] == [32768]
    assert len(calls.prefill) == 1, "the 32K chunk must take AITER's top-k"
    logits = batch.reference_logits()
    expected = logits.topk(K, dim=1).indices.to(torch.int32)
    topk_reference.assert_same_selection(logits, got, expected, batch.row_ends, K)
    _assert_rows_valid(got, batch.row_ends)
