# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the planner's cut bounds, exactly, on small cases worked out by
hand from the cost definition (``prefill_row_costs``) and the cut rules
(``plan_cp_indexer_split``). The balance tests allow a row of error at each
cut, which would hide the planner taking the wrong one of the two row
boundaries around a share; here every bound is the one the rules give.

A row's cost, in key-rows: row t of a request with S tokens, Q of them new,
sees (S - Q + 1 + t) // ratio keys, plus its chunk's -inf fill,
total_seq_lens // LOGITS_FILL_DIVISOR (8). Rank r's share is
r * total // tp; each cut goes to the row boundary whose cost before it is
nearest the share (no case here is a tie). A cut then moves to the nearest
multiple of the stripe size if that changes the cost before it by at most
total // (tp * ALIGN_SLACK), ALIGN_SLACK = 100. Last, every rank gets at
least one row (bounds pushed up, then down)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.v1.attention.ops import rocm_cp_indexer  # noqa: E402


def _chunk(token_start: int, token_end: int, total_seq_lens: int):
    """A prefill chunk as the planner reads it (batch rows and key width);
    vLLM's DeepseekV32IndexerPrefillChunkMetadata carries these and more."""
    return SimpleNamespace(
        token_start=token_start, token_end=token_end, total_seq_lens=total_seq_lens
    )


# name: (stripe, tp, decode rows, requests as (S, Q), ratio, chunks,
#        expected costs, expected bounds)
CASES = {
    # Two decode rows first. A fresh 12-token prompt (its own chunk, 12 keys:
    # fill 12 // 8 = 1), then 4 new tokens over 96 cached (their own chunk,
    # 100 keys: fill 100 // 8 = 12), compress ratio 4.
    #   prompt rows t = 0..11: (12 - 12 + 1 + t) // 4 = 0,0,0,1,1,1,1,2,2,2,2,3
    #     + 1 = 1,1,1,2,2,2,2,3,3,3,3,4 (sum 27)
    #   turn rows t = 0..3: (100 - 4 + 1 + t) // 4 = 24,24,24,25
    #     + 12 = 36,36,36,37 (sum 145)
    # total 172; cost before row j, j = 0..16:
    #   0,1,2,3,5,7,9,11,14,17,20,23,27,63,99,135,172
    # tp 4: shares 43, 86, 129.
    #   43: between 27 (j=12) and 63 (j=13): 16 below, 20 above -> 12
    #   86: between 63 (j=13) and 99 (j=14): 23 below, 13 above -> 14
    #   129: between 99 (j=14) and 135 (j=15): 30 below, 6 above -> 15
    # Stripe 4: 12 is on a boundary already; 14 and 15 would move to 16,
    # which changes the cost before them by 73 and 37, over 172 // 400 = 0.
    # Bounds 0,12,14,15,16, after the 2 decode rows: 2,14,16,17,18.
    # (One row off at the first cut, 13, would give rank 0 63 against 27.)
    "nearest boundary below or above": (
        4,
        4,
        2,
        [(12, 12), (100, 4)],
        4,
        [_chunk(2, 14, 12), _chunk(14, 18, 100)],
        [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 36, 36, 36, 37],
        (2, 14, 16, 17, 18),
    ),
    # One new token over 1,000 cached, a fresh 6-token prompt, one more new
    # token over 1,000: three chunks of 1,001, 6 and 1,001 keys (fill 125,
    # 0, 125), ratio 1.
    #   costs: 1001 + 125 = 1126; 1,2,3,4,5,6; 1126. Total 2273.
    #   cost before row j, j = 0..8: 0,1126,1127,1129,1132,1136,1141,1147,2273
    # tp 2: share 2273 // 2 = 1136, exactly the cost before row 5 -> 5.
    # Stripe 4: the nearest multiple is 4 (5 + 2 = 7, 7 // 4 * 4); moving
    # there changes the cost before the cut by 1136 - 1132 = 4, within
    # 2273 // 200 = 11: the cut moves to 4. Bounds 0,4,8.
    "a cut moved onto a stripe boundary": (
        4,
        2,
        0,
        [(1001, 1), (6, 6), (1001, 1)],
        1,
        [_chunk(0, 1, 1001), _chunk(1, 7, 6), _chunk(7, 8, 1001)],
        [1126, 1, 2, 3, 4, 5, 6, 1126],
        (0, 4, 8),
    ),
    # The same at stripe 512: the nearest multiple is 0 ((5 + 256) // 512),
    # 1136 away, so the cut stays at 5.
    "a cut too far from a stripe boundary": (
        512,
        2,
        0,
        [(1001, 1), (6, 6), (1001, 1)],
        1,
        [_chunk(0, 1, 1001), _chunk(1, 7, 6), _chunk(7, 8, 1001)],
        [1126, 1, 2, 3, 4, 5, 6, 1126],
        (0, 5, 8),
    ),
    # A fresh 4-token prompt and 2 new tokens over 102 cached, one chunk of
    # 108 keys (fill 13), ratio 1.
    #   costs: 1+13, 2+13, 3+13, 4+13 = 14,15,16,17; 103+13, 104+13 = 116,117
    #   total 295; cost before row j, j = 0..6: 0,14,29,45,62,178,295
    # tp 4: shares 73, 147, 221.
    #   73: 62 (j=4) / 178 (j=5): 11 below, 105 above -> 4
    #   147: 62 (j=4) / 178 (j=5): 85 below, 31 above -> 5
    #   221: 178 (j=5) / 295 (j=6): 43 below, 74 above -> 5
    # Stripe 512 moves none (the nearest multiple is 0, 62 and more away,
    # over 295 // 400 = 0). Cuts 4,5,5: bounds 0,4,5,5,6. One row per rank:
    # pushed up, rank 3's bound becomes 5 + 1 = 6 (0,4,5,6,6); pushed down,
    # 6 - 1 = 5, then 5 - 1 = 4, then 4 - 1 = 3: bounds 0,3,4,5,6.
    "one row per rank": (
        512,
        4,
        0,
        [(4, 4), (104, 2)],
        1,
        [_chunk(0, 6, 108)],
        [14, 15, 16, 17, 116, 117],
        (0, 3, 4, 5, 6),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_cut_bounds_are_exactly_the_hand_worked_ones(monkeypatch, name):
    stripe, tp, decodes, requests, ratio, chunks, costs, bounds = CASES[name]
    # The arithmetic above uses these.
    assert rocm_cp_indexer.LOGITS_FILL_DIVISOR == 8
    assert rocm_cp_indexer.ALIGN_SLACK == 100
    # Far below the work that repays a split in serving.
    monkeypatch.setattr(rocm_cp_indexer, "MIN_SPLIT_KEY_ROWS", 0)
    seq_lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    query_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    assert (
        rocm_cp_indexer.prefill_row_costs(
            seq_lens, query_lens, ratio, chunks, decodes
        ).tolist()
        == costs
    )
    split = rocm_cp_indexer.plan_cp_indexer_split(
        stripe, tp, decodes, seq_lens, query_lens, ratio, chunks
    )
    assert split is not None and split.bounds == bounds
