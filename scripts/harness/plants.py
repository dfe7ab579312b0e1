# SPDX-License-Identifier: Apache-2.0
"""Bugs the tests plant, as a released version had them: a test that
passes on today's code and fails with one of these shows it would have
caught that bug."""

from __future__ import annotations


def e4a57df_rank_calls(monkeypatch) -> None:
    """Stage 0001's call walk at e4a57df: per run, the candidate rows of a
    joined range of key-split requests counted from where the range enters
    the run, so where next requests fall in different runs the second one's
    candidates land on the first one's rows."""
    from vllm.v1.attention.ops import rocm_cp_indexer
    from vllm.v1.attention.ops import rocm_cp_indexer_calls as calls

    def rank_calls(start, end, runs, key_split):
        holes = calls.joined(key_split)
        for index, (first, last, most) in enumerate(runs):
            yield from calls.whole_row_calls(index, runs, start, end, holes)
            place = 0
            for a, b in holes:
                lo, hi = max(a, first), min(b, last)
                for c, d in calls.equal_calls(lo, hi, most):
                    yield calls.PlannedCall(index, c, d, place + c - lo)
                place += b - a

    monkeypatch.setattr(rocm_cp_indexer, "rank_calls", rank_calls)
