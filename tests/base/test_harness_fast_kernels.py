# SPDX-License-Identifier: Apache-2.0
"""The benchmarks' fast stand-ins (Triton kernels: on the CPU through
Triton's interpreter, compiled on a GPU) keep their contracts. The top-k
(vLLM's ``_C`` and AITER's index conventions) picks the k largest scores of
each row and reads them only within ``[row_starts, row_ends)``: positions
outside hold +inf and NaN, which would be picked if they were read. The
logits match vLLM's torch reference within each row's range."""

import os

import pytest
import torch

from scripts.harness.tree import applied_tree

TREE = applied_tree("base")

from scripts.harness import fast_indexer_kernels  # noqa: E402
from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (  # noqa: E402
    fp8_mqa_logits_torch,
)

K = 300


def test_the_multi_block_rule_is_aiters_for_128_or_more_compute_units():
    use = fast_indexer_kernels.uses_multi_block
    assert use(2, 65536) and not use(2, 65535)
    assert use(32, 98304) and not use(33, 98304) and use(33, 131072)
    assert use(100, 204800) and not use(100, 204799)
    assert not use(129, 1 << 30)


DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1",
            reason="Triton runs CPU tensors only in its interpreter",
        ),
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
            reason="needs a GPU and Triton's compiler",
        ),
    ),
]


def _rows(seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 8, 9000
    scores = torch.randn(rows, width, generator=gen)
    # Few distinct values: the k-th largest is tied many times over.
    scores[1] = torch.randint(0, 4, (width,), generator=gen).float()
    scores[2] = 0.5  # every key ties
    # Scores that differ only in their low bits: the last digit decides.
    scores[7] = 1.0 + torch.randint(0, 1 << 10, (width,), generator=gen) * 2**-23
    # Rows longer than the AITER shape's 8,192 keys an iteration, and short.
    starts = torch.tensor([0, 100, 7, 2400, 10, 1200, 0, 0], dtype=torch.int32)
    ends = torch.tensor([9000, 8900, 2000, 2600, 250, 9000, 0, 8500], dtype=torch.int32)
    poisoned = scores.clone()
    for r in range(rows):
        poisoned[r, : starts[r]] = float("inf")
        poisoned[r, ends[r] :] = float("nan")
    return scores, poisoned, starts, ends


def _vllm_topk(logits, starts, ends, out, k):
    fast_indexer_kernels.top_k_per_row_prefill(
        logits, starts, ends, out, logits.shape[0], logits.stride(0), 1, k
    )


def _aiter_topk(logits, starts, ends, out, k):
    fast_indexer_kernels.aiter_top_k_per_row_prefill(
        logits, starts, ends, out, None, logits.shape[0], logits.stride(0), 1, k=k
    )
    # AITER's indices are the chunk's columns: made relative as vLLM does.
    out[:, :k] = torch.where(out[:, :k] >= 0, out[:, :k] - starts[:, None], -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", [_vllm_topk, _aiter_topk], ids=["vllm", "aiter"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("multi_block", [False, True], ids=["one-block", "multi-block"])
@pytest.mark.parametrize("shape", sorted(fast_indexer_kernels.TOPK_SHAPES))
def test_fast_topk_picks_the_k_largest_of_each_rows_range(
    seed, entry, device, multi_block, shape, monkeypatch
):
    """Both paths, the multi-block one forced (AITER takes it only for wide
    calls of few rows, ``uses_multi_block``), in both program shapes."""
    monkeypatch.setattr(
        fast_indexer_kernels, "uses_multi_block", lambda rows, width: multi_block
    )
    monkeypatch.setattr(fast_indexer_kernels, "TOPK_SHAPE", shape)
    scores, poisoned, starts, ends = _rows(seed)
    rows = scores.shape[0]
    out = torch.full((rows, K + 5), -7, dtype=torch.int32, device=device)
    entry(poisoned.to(device), starts.to(device), ends.to(device), out, K)
    indices = out.cpu()
    assert (indices[:, K:] == -7).all(), "wrote past k"
    for r in range(rows):
        length = int(ends[r] - starts[r])
        got = indices[r, :K]
        if length <= K:
            assert got[:length].tolist() == list(range(length))
            assert (got[length:] == -1).all()
            continue
        assert ((got >= 0) & (got < length)).all(), f"row {r}: outside its range"
        assert len(set(got.tolist())) == K, f"row {r}: a key picked twice"
        row = scores[r, starts[r] : ends[r]]
        picked = torch.sort(row[got.long()]).values
        assert torch.equal(picked, torch.sort(torch.topk(row, K).values).values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows_per_program", [1, 2])
def test_fast_logits_match_vllms_reference_within_each_rows_range(
    device, rows_per_program, monkeypatch
):
    """One row a program, and two (AITER's choice for many rows of few
    heads), over an odd row count."""
    monkeypatch.setattr(
        fast_indexer_kernels,
        "logits_rows_per_program",
        lambda rows, heads: rows_per_program,
    )
    gen = torch.Generator().manual_seed(0)
    rows, keys, heads = 9, 700, 32
    q = torch.randn(rows, heads, 128, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(keys, 128, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(keys, generator=gen) + 0.5
    weights = torch.randn(rows, heads, generator=gen)
    # Empty rows, one key, ranges that start and end mid-tile.
    starts = torch.tensor([0, 0, 5, 100, 300, 0, 650, 10, 0], dtype=torch.int32)
    ends = torch.tensor([1, 130, 260, 400, 700, 700, 700, 10, 0], dtype=torch.int32)
    got = fast_indexer_kernels.mqa_logits(
        q.to(device),
        (k.to(device), scale.to(device)),
        weights.to(device),
        starts.to(device),
        ends.to(device),
    ).cpu()
    want = fp8_mqa_logits_torch(q, (k, scale), weights, starts, ends)
    for r in range(rows):
        s, e = int(starts[r]), int(ends[r])
        if s == e:
            continue
        # The reference rounds q and k to bf16 and sums in bf16.
        error = (got[r, s:e] - want[r, s:e]).norm() / want[r, s:e].norm()
        assert error < 2e-2, f"row {r}: relative error {error:.3g}"
