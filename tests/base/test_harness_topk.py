# SPDX-License-Identifier: Apache-2.0
"""The top-k stand-ins keep the kernels' contracts and select what torch.topk
and a float64 brute-force reference select."""

import pytest
import torch

from scripts.harness import fake_aiter, topk_reference
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")
K = 16


def _brute_force(row: torch.Tensor, start: int, end: int, k: int) -> set[int]:
    """Indices of the k largest values of row[start:end], in float64, by sort."""
    values = [(float(row[c].double()), c) for c in range(start, end)]
    values.sort(key=lambda vc: (-vc[0], vc[1]))
    return {c for _, c in values[:k]}


def _random_rows(rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen)
    starts = torch.randint(0, width // 2, (rows,), generator=gen, dtype=torch.int32)
    lengths = torch.randint(0, width // 2, (rows,), generator=gen, dtype=torch.int32)
    return logits, starts, starts + lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_reference_matches_brute_force(seed):
    logits, starts, ends = _random_rows(24, 80, seed)
    local = topk_reference.select_topk(logits, starts, ends, K, relative_to_start=True)
    chunk = topk_reference.select_topk(logits, starts, ends, K, relative_to_start=False)
    for r in range(logits.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        n = min(e - s, K)
        want = _brute_force(logits[r], s, e, K)
        assert set(chunk[r, :n].tolist()) == want
        assert {i + s for i in local[r, :n].tolist()} == want
        assert local[r, n:].tolist() == [-1] * (K - n)
        assert chunk[r, n:].tolist() == [-1] * (K - n)


def test_reference_matches_torch_topk_on_full_rows():
    logits = torch.randn(8, 300)
    got = topk_reference.select_topk(
        logits,
        torch.zeros(8, dtype=torch.int32),
        torch.full((8,), 300),
        K,
        relative_to_start=True,
    )
    want = logits.topk(K, dim=1).indices
    for r in range(8):
        assert set(got[r].tolist()) == set(want[r].tolist())


def test_short_rows_return_every_column_even_at_minus_inf():
    logits = torch.full((1, 10), float("-inf"))
    got = topk_reference.select_topk(
        logits, torch.tensor([2]), torch.tensor([5]), K, relative_to_start=True
    )
    assert sorted(got[0, :3].tolist()) == [0, 1, 2]
    assert got[0, 3:].tolist() == [-1] * (K - 3)


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("two_d", [False, True])
def test_decode_row_ends_follow_the_kernel(next_n, two_d):
    seq_lens = torch.tensor([5, 40, 17], dtype=torch.int32)
    rows = seq_lens.numel() * next_n
    r = torch.arange(rows)
    expected = seq_lens[r // next_n] - next_n + r % next_n + 1
    if two_d:
        per_row = expected.to(torch.int32).reshape(-1, next_n)
        assert torch.equal(
            topk_reference.decode_row_ends(per_row, next_n, rows), expected
        )
    else:
        assert torch.equal(
            topk_reference.decode_row_ends(seq_lens, next_n, rows), expected
        )


def _brute_force_rows(logits, starts, ends, k) -> torch.Tensor:
    """[rows, k] sequence-local indices from ``_brute_force``, then -1."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        picked = sorted(_brute_force(logits[r], s, e, k))
        out[r, : len(picked)] = torch.tensor(picked, dtype=torch.int32) - s
    return out


def test_c_ops_are_registered_with_vllm_signatures():
    topk_reference.register_vllm_c_ops()
    logits, starts, ends = _random_rows(6, 64, 3)
    indices = torch.full((6, K), 99, dtype=torch.int32)
    torch.ops._C.top_k_per_row_prefill(
        logits, starts, ends, indices, 6, logits.stride(0), logits.stride(1), K
    )
    topk_reference.assert_same_selection(
        logits,
        indices,
        _brute_force_rows(logits, starts, ends, K),
        ends - starts,
        K,
        offsets=starts,
    )
    seq_lens = torch.tensor([30, 64, 3], dtype=torch.int32)
    out = torch.empty((6, K), dtype=torch.int32)
    torch.ops._C.top_k_per_row_decode(
        logits, 2, seq_lens, out, 6, logits.stride(0), logits.stride(1), K
    )
    ends = topk_reference.decode_row_ends(seq_lens, 2, 6)
    zeros = torch.zeros_like(ends)
    topk_reference.assert_same_selection(
        logits, out, _brute_force_rows(logits, zeros, ends, K), ends, K
    )


def test_aiter_stand_in_rejects_wrong_dtypes():
    logits, starts, ends = _random_rows(2, 32, 4)
    indices = torch.empty((2, K), dtype=torch.int64)
    with pytest.raises(TypeError, match="int32"):
        topk_reference.aiter_top_k_per_row_prefill(
            logits, starts, ends, indices, None, 2, 32, 1, k=K
        )
    with pytest.raises(TypeError, match="float32"):
        topk_reference.aiter_top_k_per_row_prefill(
            logits.double(), starts, ends, indices.int(), None, 2, 32, 1, k=K
        )


def test_vllm_aiter_prefill_path_localizes_to_the_in_tree_result():
    """Drive vLLM's own AITER prefill wrapper (the stand-in top-k, then vLLM's
    Triton localisation kernel): it must equal the in-tree op's result."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        _launch_aiter_top_k_per_row_prefill,
    )

    logits, starts, ends = _random_rows(12, 96, 5)
    via_aiter = torch.empty((12, K), dtype=torch.int32)
    with emulate_rocm("gfx950"):
        _launch_aiter_top_k_per_row_prefill(logits, starts, ends, via_aiter, K)
        in_tree = torch.empty((12, K), dtype=torch.int32)
        torch.ops._C.top_k_per_row_prefill(
            logits, starts, ends, in_tree, 12, logits.stride(0), logits.stride(1), K
        )
    topk_reference.assert_same_selection(
        logits, via_aiter, in_tree, ends - starts, K, offsets=starts
    )


def test_fake_aiter_is_removed_after_use():
    import sys

    with fake_aiter.installed():
        assert "aiter.ops.topk" in sys.modules
    assert "aiter" not in sys.modules


def test_assert_same_selection_catches_a_wrong_row():
    logits = torch.arange(20, dtype=torch.float32).reshape(1, 20)
    good = torch.tensor([[19, 18, 17, -1]], dtype=torch.int32)
    bad = torch.tensor([[19, 18, 0, -1]], dtype=torch.int32)
    lengths = torch.tensor([3])
    topk_reference.assert_same_selection(logits, good, good, lengths, 4)
    with pytest.raises(AssertionError, match="different selection"):
        topk_reference.assert_same_selection(logits, bad, good, lengths, 4)
