# SPDX-License-Identifier: Apache-2.0
"""Stage 0001's merge kernels against their definitions: ``select_top_k``
keeps, of each key-split row's candidates from every rank, exactly the
row's top-k by score (valid indices first, -1 after a row of fewer than k
keys), and every rank the same ones; ``narrow_indices`` and
``widen_indices`` carry every index below 65,535 and -1 through int16.
Interpreted on the CPU with a small k, compiled on a GPU with serving's
k (2,048) and 8 ranks."""

from __future__ import annotations

import os

import pytest
import torch

from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.v1.attention.ops.rocm_cp_indexer_merge import (  # noqa: E402
    candidate_columns,
    narrow_indices,
    select_top_k,
    widen_indices,
)

ON_CPU = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors run through Triton's interpreter only",
)
CASES = [
    pytest.param("cpu", 16, 2, id="cpu-k16-tp2", marks=ON_CPU),
    pytest.param("cpu", 16, 8, id="cpu-k16-tp8", marks=ON_CPU),
    pytest.param(
        "cuda",
        2048,
        8,
        id="cuda-k2048-tp8",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a GPU (the device run)"
        ),
    ),
]


def _candidates(k: int, parts: int, rows: int, device: str):
    """Each rank's part: k distinct row-local indices (its own key range)
    with scores drawn from a few values, so that many tie at the k-th;
    row 0's parts are shorter than k (-1 after), row 1 has fewer than k
    valid candidates in all; negative zeros and infinities mixed in."""
    gen = torch.Generator().manual_seed(k + parts)
    scores = torch.randint(-4, 4, (parts, rows, k), generator=gen).float() / 2
    scores[:, 2, :3] = float("inf")
    scores[:, 3, :5] = -0.0
    indices = (torch.arange(parts * k).view(parts, 1, k) + 0).repeat(1, rows, 1)
    indices = indices.to(torch.int32)
    indices[:, 0, k // 2 :] = -1
    indices[:, 1, 1:] = -1  # one valid candidate a rank
    scores[indices < 0] = float("-inf")
    candidates = torch.cat([indices, scores.view(torch.int32)], dim=2)
    return candidates.contiguous().to(device), indices, scores


@pytest.mark.parametrize(("device", "k", "parts"), CASES)
def test_select_keeps_each_rows_top_k_by_score(device, k, parts):
    rows = 6
    candidates, indices, scores = _candidates(k, parts, rows, device)
    assert candidates.shape[2] == candidate_columns(k)
    out = torch.full((rows, k), 7, dtype=torch.int32, device=device)
    select_top_k(candidates, parts, out, k)
    again = torch.full_like(out, 7)
    select_top_k(candidates, parts, again, k)
    assert torch.equal(out, again), "the select must be the same every time"
    out = out.cpu()
    for row in range(rows):
        valid = indices[:, row].flatten() >= 0
        score_of = dict(
            zip(
                indices[:, row].flatten()[valid].tolist(),
                scores[:, row].flatten()[valid].tolist(),
                strict=True,
            )
        )
        n = min(len(score_of), k)
        got = out[row].tolist()
        assert got[n:] == [-1] * (k - n), f"row {row}: tail"
        assert len(set(got[:n])) == n and all(i in score_of for i in got[:n])
        want = sorted(score_of.values(), reverse=True)[:n]
        assert sorted((score_of[i] for i in got[:n]), reverse=True) == want, row


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_int16_rows_carry_every_index_below_65535(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU (the device run)")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run through Triton's interpreter only")
    rows = torch.tensor(
        [[0, 1, 32767, 32768, 65533, 65534, -1, -1]], dtype=torch.int32
    ).repeat(3, 1)
    rows = rows.to(device)
    narrow = torch.empty(rows.shape, dtype=torch.int16, device=device)
    narrow_indices(rows, narrow)
    wide = torch.full_like(rows, 7)
    widen_indices(narrow, wide)
    assert torch.equal(wide, rows)
