# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the planner's cut bounds, exactly, on small cases worked out by
hand from the cost definition (``prefill_row_costs``) and the cut rules
(``plan_cp_indexer_split``). The balance tests allow a row of error at each
cut, which would hide the planner taking the wrong one of the two row
boundaries around a share; here every bound is the one the rules give.

A row's cost, in key-rows: row t of a request with S tokens, Q of them new,
sees (S - Q + 1 + t) // ratio keys, plus its fixed row cost (the case's,
``ROW_COST_KEYS`` in serving) and its chunk's -inf fill,
total_seq_lens // LOGITS_FILL_DIVISOR (8). Rank r's share is
r * total // tp; each cut goes to the row boundary whose cost before it is
nearest the share (no case here is a tie). Last, every rank gets at least
one row (bounds pushed up, then down)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.v1.attention.ops import rocm_cp_indexer_plan  # noqa: E402


def _chunk(token_start: int, token_end: int, total_seq_lens: int):
    """A prefill chunk as the planner reads it (batch rows and key width);
    vLLM's DeepseekV32IndexerPrefillChunkMetadata carries these and more."""
    return SimpleNamespace(
        token_start=token_start,
        token_end=token_end,
        total_seq_lens=total_seq_lens,
        skip_kv_gather=False,
    )


# name: (tp, decode rows, requests as (S, Q), ratio, chunks, row cost,
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
    # Bounds 0,12,14,15,16, after the 2 decode rows: 2,14,16,17,18.
    # (One row off at the first cut, 13, would give rank 0 63 against 27.)
    "nearest boundary below or above": (
        4,
        2,
        [(12, 12), (100, 4)],
        4,
        [_chunk(2, 14, 12), _chunk(14, 18, 100)],
        0,
        [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 36, 36, 36, 37],
        (2, 14, 16, 17, 18),
    ),
    # One new token over 1,000 cached, a fresh 6-token prompt, one more new
    # token over 1,000: three chunks of 1,001, 6 and 1,001 keys (fill 125,
    # 0, 125), ratio 1.
    #   costs: 1001 + 125 = 1126; 1,2,3,4,5,6; 1126. Total 2273.
    #   cost before row j, j = 0..8: 0,1126,1127,1129,1132,1136,1141,1147,2273
    # tp 2: share 2273 // 2 = 1136, exactly the cost before row 5 -> 5.
    "a share exactly at a row boundary": (
        2,
        0,
        [(1001, 1), (6, 6), (1001, 1)],
        1,
        [_chunk(0, 1, 1001), _chunk(1, 7, 6), _chunk(7, 8, 1001)],
        0,
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
    # Cuts 4,5,5: bounds 0,4,5,5,6. One row per rank:
    # pushed up, rank 3's bound becomes 5 + 1 = 6 (0,4,5,6,6); pushed down,
    # 6 - 1 = 5, then 5 - 1 = 4, then 4 - 1 = 3: bounds 0,3,4,5,6.
    "one row per rank": (
        4,
        0,
        [(4, 4), (104, 2)],
        1,
        [_chunk(0, 6, 108)],
        0,
        [14, 15, 16, 17, 116, 117],
        (0, 3, 4, 5, 6),
    ),
    # The same rows over tp 2 with a row cost of 100: costs 114, 115, 116,
    # 117, 216, 217, total 895; cost before row j: 0,114,229,345,462,678,895.
    # Share 447: 345 (j=3) / 462 (j=4): 102 below, 15 above -> 4. Without
    # the row cost the share is 147 and the cut 5 (62 / 178: 85 and 31).
    "a fixed row cost moves the cut": (
        2,
        0,
        [(4, 4), (104, 2)],
        1,
        [_chunk(0, 6, 108)],
        100,
        [114, 115, 116, 117, 216, 217],
        (0, 4, 6),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_cut_bounds_are_exactly_the_hand_worked_ones(monkeypatch, name):
    tp, decodes, requests, ratio, chunks, row_cost, costs, bounds = CASES[name]
    # The arithmetic above uses it.
    assert rocm_cp_indexer_plan.LOGITS_FILL_DIVISOR == 8
    # Far below the work that repays a split in serving.
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    seq_lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    query_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    assert (
        rocm_cp_indexer_plan.prefill_row_costs(
            seq_lens, query_lens, ratio, chunks, decodes, row_cost_keys=row_cost
        ).tolist()
        == costs
    )
    # Calls unpriced: these are the cuts before CALL_COST_KEYS moves them
    # (tested in the stage's PR test).
    split = rocm_cp_indexer_plan.plan_cp_indexer_split(
        tp,
        decodes,
        seq_lens,
        query_lens,
        ratio,
        chunks,
        row_cost_keys=row_cost,
        call_cost_keys=0,
    )
    assert split is not None and split.bounds == bounds
