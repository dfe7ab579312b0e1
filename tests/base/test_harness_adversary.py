# SPDX-License-Identifier: Apache-2.0
"""Guard the guard: the stand-ins make the choices AITER's contract leaves
open adversarially, so a stand-in made kind again fails here."""

import pytest
import torch

from scripts.harness import adversary, fake_aiter, topk_reference
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")
K = 16


def _prefill(logits, starts, ends, out=None, k=K, stable=False):
    rows = logits.shape[0]
    out = torch.empty((rows, k), dtype=torch.int32) if out is None else out
    topk_reference.aiter_top_k_per_row_prefill(
        logits, starts, ends, out, None, rows, logits.stride(0), 1, k=k, stable=stable
    )
    return out


def _rows(rows=8, width=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen)
    starts = torch.zeros(rows, dtype=torch.int32)
    return logits, starts, torch.full((rows,), width, dtype=torch.int32)


def _as_sets(t: torch.Tensor) -> list[set[int]]:
    return [set(row.tolist()) for row in t]


def test_two_ranks_order_the_same_rows_differently(monkeypatch):
    logits, starts, ends = _rows()
    outs = []
    for rank in (0, 1):
        monkeypatch.setattr(adversary, "_rank", lambda rank=rank: rank)
        adversary.restart()
        outs.append(_prefill(logits, starts, ends))
    assert _as_sets(outs[0]) == _as_sets(outs[1])
    assert not torch.equal(outs[0], outs[1])


def test_two_calls_order_the_same_rows_differently():
    logits, starts, ends = _rows()
    first, second = _prefill(logits, starts, ends), _prefill(logits, starts, ends)
    assert _as_sets(first) == _as_sets(second)
    assert not torch.equal(first, second)
    # Not sorted by score either.
    scores = logits.gather(1, first.long())
    assert not torch.equal(scores, scores.sort(dim=1, descending=True).values)


def test_ties_at_the_kth_value_keep_varying_columns():
    # 4 columns above, 40 tied at the k-th value: 12 of the 40 are kept.
    logits = torch.zeros(1, 60)
    logits[0, :4] = 5.0
    logits[0, 4:44] = 1.0
    starts, ends = torch.tensor([0], dtype=torch.int32), torch.tensor([60]).int()
    kept = [frozenset(_prefill(logits, starts, ends)[0].tolist()) for _ in range(6)]
    assert all({0, 1, 2, 3} <= s and all(c < 44 for c in s) for s in kept)
    assert len(set(kept)) > 1


def test_stable_and_the_debug_switch_are_deterministic(monkeypatch):
    logits, starts, ends = _rows()
    stable = _prefill(logits, starts, ends, stable=True)
    assert torch.equal(stable, _prefill(logits, starts, ends, stable=True))
    monkeypatch.setenv(adversary.KIND_ENV, "1")
    assert torch.equal(_prefill(logits, starts, ends), _prefill(logits, starts, ends))
    monkeypatch.setenv(adversary.KIND_ENV, "yes")
    with pytest.raises(ValueError, match="DSA_KIND_STANDINS must be 0 or 1"):
        adversary.generator()


def test_row_ends_are_not_clamped_to_the_logits_width():
    logits, starts, _ = _rows(rows=2, width=40)
    ends = torch.tensor([40, 60], dtype=torch.int32)
    out = _prefill(logits, starts, ends)
    assert out[0].max() < 40
    assert (out[1] >= 40).sum() == K, "past the width lies poison, ranked first"


def test_aiter_writes_rows_at_k_apart_whatever_the_strides():
    logits, starts, ends = _rows(rows=3)
    wide = torch.full((3, 2 * K), 7, dtype=torch.int32)
    _prefill(logits, starts, ends, out=wide[:, :K])
    # Row 1 went to the second half of row 0, not to row 1.
    assert set(wide[0, K:].tolist()) == _as_sets(_prefill(logits, starts, ends))[1]
    assert wide[2, K:].eq(7).all()


def test_logits_are_a_padded_view_with_garbage_outside_the_rows():
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import FP8_DTYPE

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 128, generator=gen).to(FP8_DTYPE)
    k = torch.randn(300, 128, generator=gen).to(FP8_DTYPE)
    scale = torch.ones(300)
    weights = torch.randn(5, 4, generator=gen)
    ks = torch.tensor([0, 10, 20, 0, 100], dtype=torch.int32)
    ke = torch.tensor([50, 60, 300, 1, 200], dtype=torch.int32)
    with fake_aiter.installed() as modules:
        mqa = modules["aiter.ops.triton.fp8_mqa_logits"].fp8_mqa_logits
        clean = mqa(q, k, scale, weights, ks, ke)
        dirty = mqa(q, k, scale, weights, ks, ke, clean_logits=False)
    assert clean.shape == (5, 300) and clean.stride(0) == 512
    padding = clean.as_strided((5, 212), (512, 1), 300)
    assert not torch.isfinite(padding).all() or padding.abs().max() >= adversary.POISON
    assert clean[0, 50:].eq(float("-inf")).all()
    outside = ~torch.isfinite(dirty[0, 50:]) | (dirty[0, 50:].abs() >= 1e29)
    assert outside.all(), "outside [ks, ke) must be garbage without clean_logits"
    assert torch.equal(dirty[0, :50], clean[0, :50])


def test_logits_need_power_of_two_heads_and_head_size():
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import FP8_DTYPE

    q = torch.zeros(2, 3, 128).to(FP8_DTYPE)
    k = torch.zeros(4, 128).to(FP8_DTYPE)
    ks, ke = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with fake_aiter.installed() as modules:
        mqa = modules["aiter.ops.triton.fp8_mqa_logits"].fp8_mqa_logits
        with pytest.raises(AssertionError, match="power-of-two heads"):
            mqa(q, k, torch.ones(4), torch.ones(2, 3), ks, ke)
        assert "aiter.ops.flydsl" in modules
