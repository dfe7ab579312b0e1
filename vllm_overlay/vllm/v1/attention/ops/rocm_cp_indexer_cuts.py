# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cost cuts of stage 0001's default row layout: each TP rank's
contiguous range of a step's prefill rows, cut where the rows' cumulative
cost crosses each rank's share (``RowPlanner``), then, where the ranks'
calls differ or a call costs less than its floor, found again with calls
and floors counted (``_least_costly``). The costs and the floor's weight
are ``rocm_cp_indexer_plan``'s."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from itertools import accumulate, pairwise

import torch

from vllm.v1.attention.ops.rocm_cp_indexer_calls import (
    PlannedCall,
    joined,
    whole_row_calls,
)


class RowPlanner:
    """The cuts of whole rows among the ranks (``_cut_at``, then
    ``_least_costly``) for rows of the given costs, and what the costliest
    rank then costs (``RankCost``)."""

    def __init__(
        self,
        costs: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        runs: list[tuple[int, int, int]],
        tp_size: int,
        call_cost_keys: int,
        wave_rows: int,
        *,
        logits_share: float,
    ):
        self.costs = costs
        self.query_lens_cpu = query_lens_cpu
        self.runs = runs
        self.tp_size = tp_size
        self.call_cost_keys = call_cost_keys
        self.wave_rows = wave_rows
        self.logits_share = logits_share

    def rank_cost(self, costs: torch.Tensor, key_split=()) -> RankCost:
        # before[j]: the cost of the rows before row j.
        before = torch.zeros(costs.numel() + 1, dtype=torch.int64)
        torch.cumsum(costs, 0, out=before[1:])
        return RankCost(
            before,
            self.query_lens_cpu,
            self.runs,
            self.call_cost_keys,
            self.wave_rows,
            key_split,
            logits_share=self.logits_share,
        )

    def bounds(self, costs: torch.Tensor | None = None, key_split=()) -> list[int]:
        """The cuts of rows of ``costs`` (default: the step's own), with the
        rows of ``key_split`` scored in calls of their own."""
        costs = self.costs if costs is None else costs
        rank_cost = self.rank_cost(costs, key_split)
        total = rank_cost.before[-1]
        shares = (
            torch.arange(1, self.tp_size, dtype=torch.int64) * total // self.tp_size
        )
        bounds = _cut_at(torch.tensor(rank_cost.before), shares)
        if self.call_cost_keys or self.wave_rows:
            bounds = _least_costly(bounds, rank_cost)
        return bounds


def _cut_at(before: torch.Tensor, shares: torch.Tensor) -> list[int]:
    """Each rank's bounds: the row boundary whose cost before it is nearest
    each share (cumulative), at least one row per rank, in order."""
    num_rows = before.numel() - 1
    tp_size = shares.numel() + 1
    above = torch.searchsorted(before, shares).clamp_(1, num_rows)
    below = above - 1
    cuts = torch.where(shares - before[below] < before[above] - shares, below, above)
    bounds = [0, *cuts.tolist(), num_rows]
    for rank in range(1, tp_size):
        bounds[rank] = max(bounds[rank], bounds[rank - 1] + 1)
    for rank in range(tp_size - 1, 0, -1):
        bounds[rank] = min(bounds[rank], bounds[rank + 1] - 1)
    return bounds


class RankCost:
    """What a rank's rows cost as the planner counts it, in key-rows: each
    row's cost, each call the rank makes for its whole rows
    (``whole_row_calls``: not for its rows of ``key_split``, which every
    rank scores in calls of their own) at ``call_cost_keys``, and, where a
    call's rows cost less than one wave of its costliest row (``wave_rows``
    times it; 0: not counted), the logits' share of the difference
    (``logits_share``): with one program per row, the logits last at least
    as long as the costliest row.

    A rank's cost grows with its rows: vLLM's builder slices only a single
    request into a run of several chunks, so adding a row to a run adds to
    its calls' costs. ``_least_costly`` relies on it."""

    def __init__(
        self,
        before: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        runs: list[tuple[int, int, int]],
        call_cost_keys: int,
        wave_rows: int,
        key_split: tuple[tuple[int, int], ...] | list[tuple[int, int]] = (),
        *,
        logits_share: float,
    ):
        # Host ints: a tensor index per call is slow.
        self.before = before.tolist()
        self.holes = joined(key_split)
        self.call_cost_keys = call_cost_keys
        self.wave_rows = wave_rows
        self.logits_share = logits_share
        self.runs = runs
        self.run_firsts = [first for first, _, _ in runs]
        self.run_ends = [last for _, last, _ in runs]
        if wave_rows:
            # A row's cost grows with its index within its request (a
            # request's chunks share one key width), so a range's costliest
            # row is its last one or the last of a request ending inside it.
            self.ends = torch.cumsum(query_lens_cpu.to(torch.int64), 0).tolist()
            self.last_of = [self.before[e] - self.before[e - 1] for e in self.ends]
        # What each whole run adds to its rows' cost (its calls, and with
        # ``floors`` their floors), summed over the runs before it: a rank's
        # whole runs then cost one subtraction.
        self.whole = {
            floors: [
                0,
                *accumulate(
                    self._added(index, first, last, floors)
                    for index, (first, last, _) in enumerate(runs)
                ),
            ]
            for floors in (False, True)
        }

    def calls(self, start: int, end: int) -> Iterator[PlannedCall]:
        """The calls that score rows ``start:end`` whole."""
        for index in range(bisect_right(self.run_ends, start), len(self.runs)):
            if self.run_firsts[index] >= end:
                return
            yield from whole_row_calls(index, self.runs, start, end, self.holes)

    def _costliest(self, first: int, last: int) -> int:
        inside = self.last_of[
            bisect_right(self.ends, first) : bisect_left(self.ends, last)
        ]
        return max(self.before[last] - self.before[last - 1], max(inside, default=0))

    def _added(self, index: int, start: int, end: int, floors: bool) -> int:
        """What the calls of rows ``start:end`` of run ``index`` add to the
        rows' own cost."""
        added = 0
        for call in whole_row_calls(index, self.runs, start, end, self.holes):
            first, last = call.first, call.last
            added += self.call_cost_keys
            if floors and self.wave_rows:
                work = self.before[last] - self.before[first]
                floor = self.wave_rows * self._costliest(first, last)
                added += int(self.logits_share * max(0, floor - work))
        return added

    def __call__(self, start: int, end: int, floors: bool = True) -> int:
        cost = self.before[end] - self.before[start]
        # The runs rows start:end touch: i to j - 1, whole but for the ends.
        i = bisect_right(self.run_ends, start)
        j = bisect_left(self.run_firsts, end)
        for k in (i, j - 1)[: min(j - i, 2)]:
            cost += self._added(k, start, end, floors)
        if j - 1 > i + 1:
            whole = self.whole[floors]
            cost += whole[j - 1] - whole[i + 1]
        return cost

    def of(self, bounds: list[int], floors: bool = True) -> list[int]:
        return [self(a, b, floors) for a, b in zip(bounds, bounds[1:])]


def _least_costly(bounds: list[int], rank_cost: RankCost) -> list[int]:
    """The cost-share cuts price every rank alike. Where the ranks' calls
    differ (a rank whose rows cross into another run of chunks makes a
    second call) or a call costs less than its floor (``RankCost``), the
    least costly plan again, with both counted: the smallest cost every
    rank keeps within, found by bisection, each rank taking as many rows as
    fit within it (as a rank's cost grows with its rows, no other plan has a
    costliest rank cheaper by more than 1/4096). Kept only if it beats
    ``bounds``."""
    costs = rank_cost.of(bounds)
    calls = {len(list(rank_cost.calls(a, b))) for a, b in pairwise(bounds)}
    if len(calls) == 1 and costs == rank_cost.of(bounds, floors=False):
        return bounds  # every rank priced alike: the cuts stand
    tp_size, num_rows = len(bounds) - 1, len(rank_cost.before) - 1
    best, high = bounds, max(costs)
    low = rank_cost.before[-1] // tp_size
    # Within 1/4096 of the least (finer than a row of the costly steps it
    # decides); a step of at least 1, so that it ends.
    while high - low > max(1, high // 4096):
        limit = (low + high) // 2
        plan = _plan_within(limit, tp_size, num_rows, rank_cost)
        if plan is None:
            low = limit
        else:
            best, high = plan, limit
    return best


def _plan_within(
    limit: int, tp_size: int, num_rows: int, rank_cost: RankCost
) -> list[int] | None:
    """Cuts that keep every rank's cost within ``limit``, each rank taking
    as many rows as fit (at least one, and one left for each later rank),
    or None if there are none."""
    bounds = [0]
    for rank in range(tp_size - 1):
        start = bounds[-1]
        # A rank's cost is at least its rows' own cost: no further than this.
        high = bisect_right(rank_cost.before, rank_cost.before[start] + limit) - 1
        high = min(high, num_rows - (tp_size - 1 - rank))
        if high <= start or rank_cost(start, start + 1) > limit:
            return None
        low = start + 1  # within the limit
        while low < high:
            middle = (low + high + 1) // 2
            if rank_cost(start, middle) <= limit:
                low = middle
            else:
                high = middle - 1
        bounds.append(low)
    if rank_cost(bounds[-1], num_rows) > limit:
        return None
    return [*bounds, num_rows]
