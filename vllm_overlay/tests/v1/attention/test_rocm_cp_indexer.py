# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The context-parallel split of the ROCm DSA indexer prefill: which TP rank
scores which prefill rows (cost-balanced ranges), when a step splits, which
chunks' keys a rank gathers, and the start-up settings.

The split is host-side planning, so these run on any machine; the ROCm
platform and AITER switches are patched the way vLLM's other ROCm policy
tests patch them. The real op over a TP group, split and merged against the
flag off, is tested in tests/distributed/test_rocm_cp_indexer_merge.py.
"""

import dataclasses
import functools
import signal
import threading
from bisect import bisect_left
from datetime import timedelta
from itertools import accumulate
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import vllm._aiter_ops as aiter_ops
import vllm.envs as envs
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import CUDAGraphMode, DeviceConfig, ParallelConfig, VllmConfig
from vllm.v1.attention.ops import (
    rocm_cp_indexer,
    rocm_cp_indexer_calls,
    rocm_cp_indexer_cuts,
    rocm_cp_indexer_plan,
    rocm_cp_indexer_startup,
)
from vllm.v1.attention.ops.rocm_cp_indexer import CPIndexerPrefill
from vllm.v1.attention.ops.rocm_cp_indexer_plan import (
    CPIndexerSplit,
    plan_cp_indexer_split,
)
from vllm.v1.attention.ops.rocm_cp_indexer_startup import (
    cp_indexer_at_startup,
    unsafe_config_reason,
)

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


@pytest.fixture
def rocm_aiter(monkeypatch: pytest.MonkeyPatch):
    """A ROCm platform where AITER is found, switched on (VLLM_ROCM_USE_AITER=1)."""
    monkeypatch.setattr(
        rocm_cp_indexer_startup.current_platform, "is_rocm", lambda: True
    )
    monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    rocm_aiter_ops.refresh_env_variables()
    yield monkeypatch
    monkeypatch.undo()
    rocm_aiter_ops.refresh_env_variables()


@pytest.fixture
def cp_on(rocm_aiter: pytest.MonkeyPatch):
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    rocm_aiter_ops.refresh_env_variables()
    return rocm_aiter


def _config(graphs: str | None = None, tp: int = 1) -> VllmConfig:
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    # Set after construction: VllmConfig adjusts the mode to the platform.
    config.compilation_config.cudagraph_mode = CUDAGraphMode[graphs] if graphs else None
    return config


def _at_startup(tp: int, dcp: int = 1, pcp: bool = False, graphs=None):
    """The planner made at startup, or None (no split)."""
    planner = cp_indexer_at_startup(_config(graphs, tp), dcp, pcp)
    assert planner is None or planner.tp_size == tp
    return planner


FILL = rocm_cp_indexer_plan.LOGITS_FILL_DIVISOR
ROW = rocm_cp_indexer_plan.ROW_COST_KEYS
SHARE = rocm_cp_indexer_plan.LOGITS_SHARE


def _one_chunk(requests, first_row: int = 0) -> list[SimpleNamespace]:
    """The builder's chunk for requests that fit one: every row, every key."""
    rows = sum(new for _, new in requests)
    width = sum(cached + new for cached, new in requests)
    return [SimpleNamespace(token_start=first_row, token_end=first_row + rows,
                            total_seq_lens=width, skip_kv_gather=False)]  # fmt: skip


def _plan(tp: int, requests, first_row: int = 0, force: bool = False):
    """The plan for prefill ``requests`` given as (cached tokens, new tokens),
    all in one chunk."""
    seq = torch.tensor([cached + new for cached, new in requests])
    query = torch.tensor([new for _, new in requests])
    chunks = _one_chunk(requests, first_row)
    with pytest.MonkeyPatch.context() as mp:
        if force:
            mp.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
        return plan_cp_indexer_split(tp, first_row, seq, query, 1, chunks)


def _row_costs(requests) -> list[int]:
    """Each prefill row's cost in one chunk, from the definitions: row t of
    a request with P cached tokens sees keys 0 .. P + t, pays the fixed
    row cost, and every row of the chunk is filled with -inf across all the
    chunk's keys."""
    width = sum(cached + new for cached, new in requests)
    return [
        cached + t + 1 + ROW + width // FILL
        for cached, new in requests
        for t in range(new)
    ]


def _rank_costs(split: CPIndexerSplit, requests, first_row: int = 0) -> list[int]:
    costs = _row_costs(requests)
    return [
        sum(costs[start - first_row : end - first_row])
        for start, end in zip(split.bounds, split.bounds[1:])
    ]


def test_key_counts_follow_the_causal_definition():
    requests = [(0, 5), (7, 3), (100, 1)]
    seq = torch.tensor([c + n for c, n in requests])
    query = torch.tensor([n for _, n in requests])
    counts = rocm_cp_indexer_plan.prefill_row_key_counts(seq, query, 1)
    assert counts.tolist() == [1, 2, 3, 4, 5, 8, 9, 10, 101]
    # A compressed cache (DeepSeek-V4's pools) counts compressed keys.
    assert rocm_cp_indexer_plan.prefill_row_key_counts(seq, query, 4).tolist() == [
        0, 0, 0, 1, 1, 2, 2, 2, 25
    ]  # fmt: skip


def test_rows_pay_for_their_chunks_key_width():
    """Each row's cost adds its chunk's width, whatever its own key count.
    On a fresh 16K prompt over 8 ranks, rank 0's rows are the cheapest by
    key count but as wide as the last: it gets fewer rows than key counts
    alone would give it (row 5,793), as many as the costs say."""
    seq, query = torch.tensor([7, 30, 12]), torch.tensor([2, 30, 4])
    chunks = [
        SimpleNamespace(token_start=5, token_end=7, total_seq_lens=7),
        SimpleNamespace(token_start=7, token_end=23, total_seq_lens=37),
        SimpleNamespace(token_start=23, token_end=37, total_seq_lens=300),
        SimpleNamespace(token_start=37, token_end=41, total_seq_lens=12),
    ]
    costs = rocm_cp_indexer_plan.prefill_row_costs(seq, query, 1, chunks, 5).tolist()
    keys = [6, 7] + list(range(1, 31)) + [9, 10, 11, 12]
    widths = [7] * 2 + [37] * 16 + [300] * 14 + [12] * 4
    assert costs == [k + ROW + w // FILL for k, w in zip(keys, widths, strict=True)]

    split = _plan(8, [(0, 16384)], force=True)
    assert split is not None
    cumulative = list(accumulate(_row_costs([(0, 16384)])))
    row = bisect_left(cumulative, cumulative[-1] / 8)  # where 1/8 is reached
    assert abs(split.bounds[1] - row) <= 1 and split.bounds[1] < 5793 - 500


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize(
    "requests",
    [
        [(0, 16384)],  # a fresh prompt: the cost ramps along the rows
        [(200 * 1024, 4096)],  # a new turn over a long cached prefix
        [(15 * 1024, 64), (0, 1024)],  # a short turn next to a fresh prompt
        [(p * 1024, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)],
        [(32 * 1024, 4096), (0, 12288)],
    ],
)
def test_ranks_get_equal_shares_of_the_cost(tp, requests):
    """Each rank's cost is its share of the total to within one row on
    either side of each cut, and so within 5% when no row is dearer than a
    fortieth of a share."""
    split = _plan(tp, requests, first_row=3, force=True)
    assert split is not None
    costs = _rank_costs(split, requests, first_row=3)
    share, dearest = sum(costs) / tp, max(_row_costs(requests))
    for cost in costs:
        assert abs(cost - share) <= 2 * dearest, (costs, share)
    if dearest <= share / 40:
        assert max(costs) / share <= 1.05, costs


def test_contiguous_ranges_cover_the_prefill_rows_after_the_decodes():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        tp = int(torch.randint(2, 9, (1,), generator=gen))
        first = int(torch.randint(0, 6, (1,), generator=gen))
        requests = [
            (int(torch.randint(0, 3000, (1,), generator=gen)),
             int(torch.randint(1, 300, (1,), generator=gen)))
            for _ in range(int(torch.randint(1, 5, (1,), generator=gen)))
        ]  # fmt: skip
        split = _plan(tp, requests, first, force=True)
        rows = sum(new for _, new in requests)
        if rows < tp:
            assert split is None
            continue
        assert split is not None and len(split.bounds) == tp + 1
        assert split.bounds[0] == first and split.bounds[-1] == first + rows
        assert all(size >= 1 for size in split.sizes), split


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize(
    "requests",
    [
        [(0, 16384)],
        [(200 * 1024, 4096)],
        [(p * 1024, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)],
        [(32 * 1024, 4096), (0, 12288), (15 * 1024, 64)],
    ],
)
def test_a_zigzag_split_balances_each_request_by_construction(tp, requests):
    """Each request's rows in 2 tp blocks, rank r taking blocks r and
    2 tp - 1 - r: every rank holds a tp-th of every request's rows and of
    its causal keys, to within two rows of it, with no cost model."""
    first_row = 3
    split = rocm_cp_indexer_plan.zigzag_split(
        tp, first_row, torch.tensor([new for _, new in requests])
    )
    assert split.order is not None and not split.key_split
    assert sorted(split.order.tolist()) == list(
        range(first_row, first_row + sum(new for _, new in requests))
    )
    costs = _row_costs(requests)
    start = first_row
    for _, new in requests:
        rows = range(start, start + new)
        for rank in range(tp):
            lo, hi = (b - first_row for b in split.bounds[rank : rank + 2])
            places = split.order[lo:hi].tolist()
            mine = [row for row in places if row in rows]
            assert mine == sorted(mine)  # a rank's rows in batch order
            assert abs(len(mine) - new / tp) <= 1
            keys = sum(costs[row - first_row] for row in mine)
            share = sum(costs[row - first_row] for row in rows) / tp
            dearest = max(costs[row - first_row] for row in rows)
            assert abs(keys - share) <= 2 * dearest, (rank, keys, share)
        start += new


def test_short_requests_zigzag_across_the_ranks():
    """A request shorter than 2 tp leaves some blocks empty: turned by its
    index, the next request fills other ranks; where no turn gives every
    rank a row, the rows go round the ranks one by one."""
    split = rocm_cp_indexer_plan.zigzag_split(4, 0, torch.tensor([2] * 8 + [16]))
    assert split.sizes == [8, 8, 8, 8]  # not turned: 12, 4, 4, 12
    # Two requests of 4 rows at tp 8 would leave two ranks empty.
    split = rocm_cp_indexer_plan.zigzag_split(8, 5, torch.tensor([4, 4]))
    assert split.sizes == [1] * 8
    assert split.order is not None and split.order.tolist() == list(range(5, 13))
    # There no row is key-split: an owner's block could be a rank's only
    # rows, or none.
    split = rocm_cp_indexer_plan.zigzag_split(8, 5, torch.tensor([4, 4]), ((0, 4),))
    assert split.sizes == [1] * 8 and split.key_split == ()
    # A zero-length request has no rows and takes no block.
    split = rocm_cp_indexer_plan.zigzag_split(2, 0, torch.tensor([4, 0, 4]))
    assert split.sizes == [4, 4] and split.order is not None
    assert split.order.tolist() == [0, 3, 4, 7, 1, 2, 5, 6]


def test_zigzag_owners_hold_equal_blocks_of_the_key_split_rows():
    """Key-split rows in the zigzag layout: rank r owns the r-th of tp equal
    blocks of them (13 rows over 4 ranks: 3, 3, 3, 4), at the end of its
    places, in row order, after its other rows; the exchange counts the
    same blocks, and each owner selects into its last places."""
    query = torch.tensor([8, 5, 8, 8])  # rows 0-7, 8-12, 13-20, 21-28
    key_split = ((8, 13), (21, 29))
    split = rocm_cp_indexer_plan.zigzag_split(4, 2, query, key_split)
    assert split.key_split == ((10, 15), (23, 31))
    assert split.key_split_owners == [3, 3, 3, 4]
    assert split.order is not None
    owned_rows = [*range(10, 15), *range(23, 31)]
    blocks = [owned_rows[0:3], owned_rows[3:6], owned_rows[6:9], owned_rows[9:]]
    for rank in range(4):
        lo, hi = (b - 2 for b in split.bounds[rank : rank + 2])
        places = split.order[lo:hi].tolist()
        owned = split.key_split_owners[rank]
        assert places[hi - lo - owned :] == blocks[rank]
        assert not set(places[: hi - lo - owned]) & set(owned_rows)
        assert places[: hi - lo - owned] == sorted(places[: hi - lo - owned])
        end = split.bounds[rank + 1]
        assert split.owned_places(rank) == [(end - owned, end)]
    # Each rank's places sum to every row once.
    assert sorted(split.order.tolist()) == list(range(2, 31))


def test_zigzag_key_splits_only_requests_whose_row_binds():
    """A request is key-split where a wave of its longest row outlasts a
    rank's even share of the rows left whole: the long turns among many
    short ones at tp 8, not a long prompt's rows or a long turn with rows
    enough for every rank."""
    wave = 460  # 1.8 rows a compute unit on 256 of them

    def chosen(tp, requests):
        seq = torch.tensor([c + n for c, n in requests])
        query = torch.tensor([n for _, n in requests])
        keys = rocm_cp_indexer_plan.prefill_row_key_counts(seq, query, 1)
        return rocm_cp_indexer_plan.binding_requests(keys, query, tp, wave, 2048, 2048)

    turns = [(p * 1024, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)]
    # The longest first, while their wave outlasts the share of what is
    # left: the 200K turn's wave outlasts an eighth of the step; with it
    # key-split, the 150K turn's outlasts an eighth of the rest; and so on
    # down to the 32K turn's, whose wave an eighth of the 4K-16K turns'
    # keys outlasts.
    assert chosen(8, turns) == tuple((256 * i, 256 * (i + 1)) for i in range(3, 8))
    # A request's longest row (its last) decides: a turn of 2,048 rows over
    # 64K beside a fresh 14,592-row chunk binds by its last row's keys (by
    # its first row's, 2,047 fewer, it would not).
    assert chosen(8, [(65536, 2048), (0, 14592)]) == ((0, 2048),)
    assert chosen(8, [(0, 16384)]) == ()
    assert chosen(8, [(200 * 1024, 4096)]) == ()
    assert chosen(2, [(200 * 1024, 4096)]) == ()
    # No wave (the fill on gfx942, or no compute units known): none.
    seq, query = torch.tensor([200 * 1024 + 256]), torch.tensor([256])
    keys = rocm_cp_indexer_plan.prefill_row_key_counts(seq, query, 1)
    assert rocm_cp_indexer_plan.binding_requests(keys, query, 8, 0, 2048, 2048) == ()
    assert rocm_cp_indexer_plan.binding_requests(keys, query, 8, wave, 2048, 2048)
    # Within the owners' cap: 256 rows over 8 ranks is 32 each.
    assert rocm_cp_indexer_plan.binding_requests(keys, query, 8, wave, 2048, 31) == ()


def test_rows_pay_a_fixed_cost_besides_their_keys():
    """Without the fill (gfx950), a row costs its keys and ROW_COST_KEYS: on
    a fresh 16K prompt over 8 ranks, rank 0's many cheap rows weigh more
    than by keys alone, so it gets fewer rows than the keys-only cut."""
    assert ROW > 0
    seq, query = torch.tensor([16384]), torch.tensor([16384])
    chunks = _one_chunk([(0, 16384)])
    costs = rocm_cp_indexer_plan.prefill_row_costs(seq, query, 1, chunks, 0, None)
    assert costs.tolist() == [r + 1 + ROW for r in range(16384)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
        keys_only = plan_cp_indexer_split(8, 0, seq, query, 1, chunks, None, 0)
        weighed = plan_cp_indexer_split(8, 0, seq, query, 1, chunks, None)
    assert keys_only is not None and weighed is not None
    cumulative = list(accumulate(costs.tolist()))
    row = bisect_left(cumulative, cumulative[-1] / 8)
    assert abs(weighed.bounds[1] - row) <= 1
    assert weighed.bounds[1] < keys_only.bounds[1] - 200


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_rank_that_pays_a_second_call_takes_less_of_the_rows(tp):
    """A 512-row turn over 100K cached keys and a fresh 8K prompt, one chunk
    each: the rank whose rows cross from the turn into the prompt makes two
    calls. Priced at CALL_COST_KEYS, the costliest rank (rows and calls)
    costs less than with calls unpriced, and at most one row's cost above
    the mean."""
    call = rocm_cp_indexer_plan.CALL_COST_KEYS
    assert call > 0
    seq, query = torch.tensor([100 * 1024 + 512, 8192]), torch.tensor([512, 8192])
    chunks = [
        SimpleNamespace(token_start=0, token_end=512, skip_kv_gather=False),
        SimpleNamespace(token_start=512, token_end=8704, skip_kv_gather=False),
    ]
    costs = [100 * 1024 + t + 1 + ROW for t in range(512)]
    costs += [t + 1 + ROW for t in range(8192)]

    def totals(split) -> list[int]:
        """Each rank's rows' cost plus a call per chunk its rows touch."""
        return [
            sum(costs[a:b]) + call * sum(a < c.token_end and b > c.token_start
                                         for c in chunks)
            for a, b in zip(split.bounds, split.bounds[1:])
        ]  # fmt: skip

    unpriced = plan_cp_indexer_split(tp, 0, seq, query, 1, chunks, None, ROW, 0)
    priced = plan_cp_indexer_split(tp, 0, seq, query, 1, chunks, None, ROW)
    assert max(totals(priced)) < max(totals(unpriced))
    assert max(totals(priced)) - sum(totals(priced)) / tp <= max(costs)


def _cached(gen: torch.Generator, most: int) -> int:
    """A request's cached tokens: none (a fresh prompt) or up to ``most``."""
    if torch.randint(0, 2, (1,), generator=gen):
        return int(torch.randint(0, most, (1,), generator=gen))
    return 0


def _laid_out(query_lens: list[int], layout: int) -> list[Any]:
    """Chunks over requests of ``query_lens`` new rows, as vLLM's builder
    lays them out: one per request (layout 2), requests sharing a chunk
    (layout 0), or each request of two rows or more sliced into two chunks
    over the same keys (layout 1)."""
    chunks: list[Any] = []
    start = 0
    for new in query_lens:
        if layout == 0 and chunks:
            chunks[-1] = _chunk_of(chunks[-1].token_start, start + new)
        elif layout == 1 and new > 1:
            chunks.append(_chunk_of(start, start + new // 2))
            chunks.append(_chunk_of(start + new // 2, start + new, skip=True))
        else:
            chunks.append(_chunk_of(start, start + new))
        start += new
    return chunks


def _scored(monkeypatch, split, chunks, row_costs, wave: int) -> list[int]:
    """Each rank's cost from the definition, over the calls the op makes
    (``CPIndexerPrefill.windows``): its rows' costs, CALL_COST_KEYS a call,
    and where a call's rows cost less than ``wave`` times its costliest row,
    the logits' share (LOGITS_SHARE) of the difference (one program per row:
    the logits last at least as long as the costliest row, however few rows
    the call has)."""
    ranks = []
    for rank in range(len(split.bounds) - 1):
        monkeypatch.setattr(
            rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
        )
        cost, first = 0, split.bounds[0]
        for window in CPIndexerPrefill(split, False).windows(chunks):
            rows = row_costs[window.start - first : window.end - first]
            short = max(0, wave * max(rows) - sum(rows))
            cost += sum(rows) + int(SHARE * short) + rocm_cp_indexer_plan.CALL_COST_KEYS
        ranks.append(cost)
    return ranks


@pytest.mark.parametrize("tp", [4, 8])
def test_a_rank_is_not_left_a_sliver_of_a_long_turn(monkeypatch, tp):
    """A 512-row turn over 100K cached keys and a fresh 8K prompt, on a GPU
    that scores 240 rows at once: cut by cost alone, a rank holds a sliver
    of the turn beside its share of the prompt, and its logits last as long
    as the turn's other ranks'. Planned with the wave, the costliest rank
    (scored from the definition over the op's own calls) costs at least a
    tenth less."""
    seq, query = torch.tensor([100 * 1024 + 512, 8192]), torch.tensor([512, 8192])
    chunks = [_chunk_of(0, 512), _chunk_of(512, 8704)]
    costs = [100 * 1024 + t + 1 + ROW for t in range(512)]
    costs += [t + 1 + ROW for t in range(8192)]

    def plan(wave: int) -> CPIndexerSplit:
        split = plan_cp_indexer_split(
            tp, 0, seq, query, 1, chunks, None, wave_rows=wave,
            key_split_max_rows=0,
        )  # fmt: skip
        assert split is not None
        return split

    floored = _scored(monkeypatch, plan(240), chunks, costs, 240)
    unfloored = _scored(monkeypatch, plan(0), chunks, costs, 240)
    assert max(floored) < 0.9 * max(unfloored)


def test_the_search_for_the_cheapest_cuts_ends_on_the_smallest_steps(
    monkeypatch,
):
    """A two-row step of rows that cost 1 and 2: the bisection over the
    costliest rank's cost (here under 4,096 key-rows, where 1/4096 of it
    rounds to 0) still ends, with one row a rank."""
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    seq, query = torch.tensor([2]), torch.tensor([2])
    stop = signal.signal(
        signal.SIGALRM, lambda *_: pytest.fail("the search did not end")
    )
    signal.alarm(10)
    try:
        split = plan_cp_indexer_split(
            2, 0, seq, query, 1, [_chunk_of(0, 2)], None, 0, 0, wave_rows=10
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, stop)
    assert split is not None and split.bounds == (0, 1, 2)


def test_the_wave_floor_never_makes_the_costliest_rank_costlier(monkeypatch):
    """Over generated steps of several requests, turns and fresh prompts,
    and waves of 0 to 300 rows: the plan made with the wave is a valid
    split (contiguous, every row once, at least one row a rank) and its
    costliest rank, scored with the wave from the definition over the op's
    own calls, costs no more than the plan made without it, within the
    precision of the planner's search. The planner keeps only plans that
    beat the first one by its own count, so this checks that its count
    agrees with the definition."""
    gen = torch.Generator().manual_seed(1)
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    for case in range(200):
        tp = int(torch.randint(2, 9, (1,), generator=gen))
        count = int(torch.randint(1, 6, (1,), generator=gen))
        requests = [
            (_cached(gen, 10**5), int(torch.randint(1, 300, (1,), generator=gen)))
            for _ in range(count)
        ]
        if sum(new for _, new in requests) < tp:
            continue
        seq = torch.tensor([cached + new for cached, new in requests])
        query = torch.tensor([new for _, new in requests])
        chunks = _laid_out(query.tolist(), case % 3)
        costs = [c + t + 1 + ROW for c, new in requests for t in range(new)]
        wave = int(torch.randint(0, 300, (1,), generator=gen))

        def plan(wave: int, tp=tp, seq=seq, query=query, chunks=chunks):
            split = plan_cp_indexer_split(
                tp, 0, seq, query, 1, chunks, None, wave_rows=wave,
                key_split_max_rows=0,
            )  # fmt: skip
            assert split is not None
            return split

        floored = plan(wave)
        bounds = floored.bounds
        assert bounds[0] == 0 and bounds[-1] == len(costs), f"case {case}"
        assert all(a < b for a, b in zip(bounds, bounds[1:])), f"case {case}"
        scored = max(_scored(monkeypatch, floored, chunks, costs, wave))
        unfloored = max(_scored(monkeypatch, plan(0), chunks, costs, wave))
        # Both plans are searched to within 1/4096 of their least.
        assert scored <= unfloored * (1 + 1 / 4096), f"case {case}"


def _cheapest(cost, ranks: int, rows: int) -> int:
    """The least costliest-rank cost over every contiguous split of rows
    ``0:rows`` into ``ranks`` ranges, given each range's ``cost(first,
    last)`` (dynamic programming)."""
    best = [cost(0, end) if end else 0 for end in range(rows + 1)]
    for rank in range(1, ranks):
        best = [0] * (rank + 1) + [
            min(max(best[cut], cost(cut, end)) for cut in range(rank, end))
            for end in range(rank + 1, rows + 1)
        ]
    return best[rows]


@pytest.mark.parametrize(
    ("call_cost", "waves"),
    [(3000, (2, 41)), (60000, (0, 1))],
    ids=["waves", "calls-only"],
)
def test_the_costliest_rank_costs_the_least_it_can(monkeypatch, call_cost, waves):
    """On small generated steps (turns and fresh prompts, some sharing a
    chunk, some sliced): the planned split's costliest rank, scored from the
    definition, is within 1% of the cheapest over every contiguous split
    (found by dynamic programming). With waves of 2 to 40 rows; and with no
    wave but calls that cost as much as a few rows, where the rank whose
    rows cross into another chunk pays for a second call."""
    gen = torch.Generator().manual_seed(2)
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    monkeypatch.setattr(rocm_cp_indexer_plan, "CALL_COST_KEYS", call_cost)
    for case in range(60):
        tp = int(torch.randint(2, 5, (1,), generator=gen))
        requests = [
            (_cached(gen, 50000), int(torch.randint(1, 16, (1,), generator=gen)))
            for _ in range(int(torch.randint(1, 5, (1,), generator=gen)))
        ]
        query = [new for _, new in requests]
        if sum(query) < tp:
            continue
        chunks = _laid_out(query, case % 3)
        costs = [c + t + 1 + ROW for c, new in requests for t in range(new)]
        wave = int(torch.randint(*waves, (1,), generator=gen))
        split = plan_cp_indexer_split(
            tp,
            0,
            torch.tensor([c + n for c, n in requests]),
            torch.tensor(query),
            1,
            chunks,
            None,
            call_cost_keys=rocm_cp_indexer_plan.CALL_COST_KEYS,
            wave_rows=wave,
            key_split_max_rows=0,
        )
        assert split is not None
        cost = functools.cache(
            lambda first, last, c=chunks, r=costs, w=wave: _scored(
                monkeypatch, CPIndexerSplit((first, last)), c, r[first:], w
            )[0]
        )
        planned = max(cost(a, b) for a, b in zip(split.bounds, split.bounds[1:]))
        cheapest = _cheapest(cost, tp, len(costs))
        # Where every rank is priced alike the cuts fall at the row nearest
        # each share: off by up to a row, which on steps this small is
        # more than 1%.
        assert planned <= max(1.01 * cheapest, cheapest + max(costs)), f"case {case}"


@pytest.mark.parametrize(
    ("tp", "requests", "splits"),
    [
        (4, [(10**6, 3)], False),  # fewer prefill rows than ranks
        (8, [(15 * 1024, 64), (0, 1024)], False),  # 4.5M key-rows: too little
        # At the minimum, where each row's fixed cost and its chunk's -inf
        # fill count (without either, 2,833 rows cost 4.0M key-rows):
        (8, [(0, 2833)], True),  # 7,000,343 key-rows
        (8, [(0, 2832)], False),  # just under 7,000,000
        # A fresh 4K prompt (13.4M): at tp 2 one xGMI link carries the 2,638
        # rows of rank 0's top-k (0.59 ms, more than the split saves); at
        # tp 8 the largest rank's 980 (0.28 ms).
        (2, [(0, 4096)], False),
        (8, [(0, 4096)], True),
        (2, [(0, 16384)], True),  # a fresh 16K prompt
        (2, [(150 * 1024, 200), (90 * 1024, 235)], True),  # few rows, long
        (8, [(100 * 1024, 512), (0, 8192)], True),  # a turn and a prompt
        (8, [(200 * 1024, 4096)], True),  # a long turn
    ],
)
def test_steps_that_would_not_repay_the_merge_stay_replicated(tp, requests, splits):
    seq = torch.tensor([c + n for c, n in requests])
    query = torch.tensor([n for _, n in requests])
    plan = plan_cp_indexer_split(tp, 0, seq, query, 1, _one_chunk(requests))
    assert (plan is not None) is splits


def test_the_minimum_split_size_is_the_least_that_splits():
    """At exactly MIN_SPLIT_KEY_ROWS a step may split, one key-row less it
    may not (eight one-row ranks: the merge and the shares fit easily)."""
    minimum = rocm_cp_indexer_plan.MIN_SPLIT_KEY_ROWS
    assert rocm_cp_indexer_plan.split_repays(minimum, [1] * 8)
    assert not rocm_cp_indexer_plan.split_repays(minimum - 1, [1] * 8)


@pytest.mark.parametrize(
    ("requests", "splits"),
    [
        ([(0, 4160)], False),
        ([(0, 4170)], True),
        # A turn over a cached prefix, a request with no new token, a prompt.
        ([(3000, 64), (700, 0), (0, 3480)], False),
        ([(3000, 64), (700, 0), (0, 3490)], True),
    ],
)
def test_the_plans_own_rows_decide_where_even_shares_would_repay(requests, splits):
    """At tp 2, even shares of a step's rows would repay their merge (int16
    rows: every row is short), but the cuts by cost give rank 0 about two
    thirds of the rows (a fresh prompt's early rows are cheap), and one
    xGMI link carries them: only the gate on the plan's own rows tells the
    steps apart. (At tp 4 and 8 the rows a rank holds merge quickly: the
    minimum decides first.)"""
    rows = sum(new for _, new in requests)
    total = sum(_row_costs(requests))
    half = [rows // 2, rows - rows // 2]
    assert rocm_cp_indexer_plan.split_repays(total, half, narrow=True)
    assert (_plan(2, requests) is not None) is splits


def test_the_merge_is_priced_per_link():
    """The merge of a plan's rows: NVLink's switch brings every other rank's
    rows through one port; xGMI joins each pair of GPUs with its own link,
    so the largest rank's rows set the time."""
    nvlink, xgmi = rocm_cp_indexer_plan.NVLINK, rocm_cp_indexer_plan.XGMI_GFX950
    sizes = [3000, 1000, 500, 500]
    # 8 KiB a row; NVLink 261 GB/s one way, an xGMI link 44.5 (gfx950) or
    # 37.1 (gfx942), after 0.1 ms: 4,500 rows through rank 3's port, 3,000
    # over rank 0's links.
    assert nvlink.merge_ms(sizes) == pytest.approx(0.241, abs=1e-3)
    assert xgmi.merge_ms(sizes) == pytest.approx(0.652, abs=1e-3)
    # Exactly: GB/s are bytes per ms over 10^6.
    assert nvlink.merge_ms(sizes) == pytest.approx(
        0.1 + 4500 * 8192 / (0.58 * 450 * 1e6), rel=1e-12
    )
    assert rocm_cp_indexer_plan.XGMI_GFX942.merge_ms(sizes) == pytest.approx(
        0.762, abs=1e-3
    )
    # A fresh 4K prompt's plan at tp 2 (13.4M key-rows): split over NVLink
    # (0.18 ms), not over xGMI (0.59 ms).
    requests = [(0, 4096)]
    total = sum(_row_costs(requests))
    split = _plan(2, requests, force=True)
    assert split is not None
    assert rocm_cp_indexer_plan.split_repays(total, split.sizes, nvlink)
    assert not rocm_cp_indexer_plan.split_repays(total, split.sizes, xgmi)


@pytest.mark.parametrize(
    ("tp", "decodes", "requests", "bounds"),
    [
        # 19.6M key-rows (a row: its keys and 700), 4,000 rows a rank; a rank
        # 11.3M (1.15x half), the merge of 4,000 int16 rows 6.5M key-rows
        # over gfx950's xGMI and 7.5M over gfx942's, against 18.1M allowed.
        (2, 0, [(1500, 500)] * 16, (0, 4000, 8000)),
        # After 3 decode rows, the same with a request with no new token
        # among them.
        (2, 3, [(1500, 500)] * 8 + [(700, 0)] + [(1500, 500)] * 8,
         (3, 4003, 8003)),
    ],
)  # fmt: skip
def test_the_planner_decides_on_its_own_link(tp, decodes, requests, bounds):
    """A step the planner splits over gfx950's xGMI and leaves replicated
    over gfx942's slower links. (At tp 8 a row's fixed cost alone outweighs
    its share of the merge on either link, so there the link decides only
    where the ranks' rows are unequal.)"""
    seq = torch.tensor([c + n for c, n in requests])
    query = torch.tensor([n for _, n in requests])
    chunks = _one_chunk(requests, decodes)
    plans = {
        link: rocm_cp_indexer_plan.CPIndexerPlanner(tp, link=link).plan(
            decodes, seq, query, 1, chunks
        )
        for link in (rocm_cp_indexer_plan.XGMI_GFX950, rocm_cp_indexer_plan.XGMI_GFX942)
    }
    assert plans[rocm_cp_indexer_plan.XGMI_GFX950] == CPIndexerSplit(bounds)
    assert plans[rocm_cp_indexer_plan.XGMI_GFX942] is None


def _chunks(gen: torch.Generator, first_row: int, rows: int) -> list[Any]:
    """A random chunk layout over ``rows`` prefill rows: some chunks are
    later query slices of the previous chunk's request (skip_kv_gather);
    ``keys`` names the request group whose keys a chunk needs gathered.
    Each row's key range is marked with its batch row (``cu_seqlen_ks``)."""
    chunks: list[SimpleNamespace] = []
    start, group = first_row, 0
    while start < first_row + rows:
        size = int(torch.randint(1, 40, (1,), generator=gen))
        end = min(start + size, first_row + rows)
        continues = bool(chunks) and bool(torch.randint(0, 2, (1,), generator=gen))
        group += 0 if continues else 1
        chunks.append(
            SimpleNamespace(
                token_start=start,
                token_end=end,
                skip_kv_gather=continues,
                keys=group,
                cu_seqlen_ks=torch.arange(start, end),
                cu_seqlen_ke=torch.arange(start, end) + 1,
                max_seqlen_k=int(torch.randint(1, 10**6, (1,), generator=gen)),
            )
        )
        start = end
    return chunks


def _keys_of(chunks, chunk) -> int:
    """The request group whose keys ``chunk`` (one of ``chunks``) scores."""
    return next(c.keys for c in chunks if c is chunk)


def test_one_writer_per_merged_row_and_the_same_collectives(monkeypatch):
    """Over many generated batches: once split, every prefill row is scored
    by exactly one rank; decode and padding rows by none; every rank makes
    the same collective calls (one merge, or none); a rank scores rows only
    with their keys in its workspace, gathered once per run of chunks that
    share them; and its calls over a run are as few as the run's largest
    chunk allows (the logits budget), of equal size, with each row's own
    key range."""
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    for case in range(300):
        tp = int(torch.randint(2, 9, (1,), generator=gen))
        decode = int(torch.randint(0, 5, (1,), generator=gen))
        rows = int(torch.randint(1, 200, (1,), generator=gen))
        padding = int(torch.randint(0, 8, (1,), generator=gen))
        chunks = _chunks(gen, decode, rows)
        cached = int(torch.randint(0, 500, (1,), generator=gen))
        for chunk in chunks:  # query slices of one request: all its keys
            chunk.total_seq_lens = cached + rows
        split = plan_cp_indexer_split(
            tp,
            decode,
            torch.tensor([cached + rows]),
            torch.tensor([rows]),
            1,
            chunks,
        )
        writers = torch.zeros(decode + rows + padding, dtype=torch.int64)
        merges, gathers = [], 0
        for rank in range(tp):
            monkeypatch.setattr(
                rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
            )
            prefill = CPIndexerPrefill(split, has_candidate_blocks=False)
            workspace = None  # the request group whose keys it holds
            calls: dict[int, list[int]] = {}  # per key group: each call's rows
            for window in prefill.windows(chunks):
                if window.gather_keys:
                    workspace = _keys_of(chunks, window.chunk)
                    gathers += 1
                covered = [
                    c
                    for c in chunks
                    if c.token_start < window.end and c.token_end > window.start
                ]
                assert {c.keys for c in covered} == {workspace}, f"case {case}"
                assert window.ks.tolist() == list(range(window.start, window.end))
                assert window.ke.tolist() == [k + 1 for k in window.ks.tolist()]
                assert window.max_seqlen_k == max(c.max_seqlen_k for c in covered)
                group = _keys_of(chunks, window.chunk)
                run = [c for c in chunks if c.keys == group]
                most = max(c.token_end - c.token_start for c in run)
                assert 0 < window.end - window.start <= most, f"case {case}"
                calls.setdefault(group, []).append(window.end - window.start)
                writers[window.batch_rows] += 1
            merges.append(prefill.split is not None)
            for key_group, sizes in calls.items():
                if split is None:
                    continue
                run = [c for c in chunks if c.keys == key_group]
                most = max(c.token_end - c.token_start for c in run)
                assert len(sizes) == -(-sum(sizes) // most), f"case {case}"
                assert max(sizes) - min(sizes) <= 1, f"case {case}: {sizes}"
        expected = 1 if split is not None else tp
        assert writers[decode : decode + rows].eq(expected).all(), case
        assert writers[:decode].eq(0).all() and writers[decode + rows :].eq(0).all()
        assert len(set(merges)) == 1, f"case {case}: ranks disagree on the merge"
        if split is not None:
            # Each rank gathers once per key group its rows span.
            spans = sum(
                len({c.keys for c in chunks if c.token_start < b and c.token_end > a})
                for a, b in zip(split.bounds, split.bounds[1:])
            )
            assert gathers == spans, f"case {case}: {gathers} gathers, {spans} groups"


def _chunk_of(start: int, end: int, skip: bool = False) -> Any:
    return SimpleNamespace(
        token_start=start,
        token_end=end,
        skip_kv_gather=skip,
        cu_seqlen_ks=torch.zeros(end - start, dtype=torch.int32),
        cu_seqlen_ke=torch.arange(start, end, dtype=torch.int32),
        max_seqlen_k=end,
    )


def test_without_a_split_every_chunk_is_gathered_and_scored_whole():
    chunks = [_chunk_of(4, 9), _chunk_of(9, 12, skip=True)]
    prefill = CPIndexerPrefill(None, has_candidate_blocks=False)
    windows = list(prefill.windows(chunks))
    assert [w.chunk for w in windows] == chunks
    assert all(w.gather_keys for w in windows)
    assert [w.batch_rows for w in windows] == [slice(4, 9), slice(9, 12)]
    assert windows[1].ks is chunks[1].cu_seqlen_ks


def test_candidate_blocks_keep_the_prefill_replicated():
    split = CPIndexerSplit((0, 8, 16))
    prefill = CPIndexerPrefill(split, has_candidate_blocks=True)
    assert prefill.split is None
    (window,) = prefill.windows([_chunk_of(0, 16)])
    assert window.batch_rows == slice(0, 16)


def test_a_ranks_rows_over_slices_of_one_request_take_fewer_equal_calls(
    monkeypatch,
):
    """A long turn sliced into chunks of 585 rows (the logits budget), split
    into ranges of 512: rank 1's 73 + 439 rows take one call of 512, not
    two; rank 3's 1,536-2,048 take one of 512. A rank whose rows exceed one
    chunk's takes equal calls under it."""
    chunks = [_chunk_of(0, 585)] + [
        _chunk_of(a, min(a + 585, 4096), skip=True) for a in range(585, 4096, 585)
    ]
    split = CPIndexerSplit(tuple(range(0, 4097, 512)))
    for rank in range(8):
        monkeypatch.setattr(
            rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
        )
        (window,) = CPIndexerPrefill(split, False).windows(chunks)
        assert window.batch_rows == slice(512 * rank, 512 * rank + 512)
        assert window.gather_keys and window.chunk is chunks[0]
        assert window.ke.tolist() == list(range(512 * rank, 512 * rank + 512))
    monkeypatch.setattr(rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda: 0)
    wide = CPIndexerSplit((0, 1300, 4096))
    windows = list(CPIndexerPrefill(wide, False).windows(chunks))
    assert [(w.start, w.end) for w in windows] == [(0, 433), (433, 866), (866, 1300)]
    assert [w.gather_keys for w in windows] == [True, False, False]


@pytest.mark.parametrize("gfx942", [True, False])
def test_rows_pay_for_the_logits_fill_only_where_the_kernel_fills(cp_on, gfx942):
    """gfx942's FlyDSL logits write -inf over the chunk's whole output (vLLM
    calls it with clean_logits left True), gfx950's do not (vLLM passes
    clean_logits=False): only there does a row also cost its chunk's width.
    The cuts are checked without the wave, which so small a step would
    bind."""
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op

    cp_on.setattr(op, "_ON_GFX942", gfx942)
    # The fill alone: no fixed row cost.
    cp_on.setattr(rocm_cp_indexer_plan, "ROW_COST_KEYS", 0)
    planner = cp_indexer_at_startup(_config(tp=2), 1, False, compute_units=256)
    assert planner is not None
    assert planner.fill_divisor == (FILL if gfx942 else None)
    # The wave is gfx950's logits grid; FlyDSL's filling kernel has none.
    assert (planner.wave_rows == 0) is gfx942
    # The merge is priced on the GPU's own xGMI link (MI300X's is slower).
    link = (
        rocm_cp_indexer_plan.XGMI_GFX942 if gfx942 else rocm_cp_indexer_plan.XGMI_GFX950
    )
    assert planner.link == link
    planner = dataclasses.replace(planner, wave_rows=0)
    # A fresh 64-row prompt in one 64-key chunk (row r has r + 1 keys). No
    # fill: rows 0-44 hold 1035 of 2080 key-rows, the nearest cut to half.
    # Fill: each row also pays 64 // 8 = 8, and rows 0-42 hold 1290 of 2592.
    cp_on.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    seq, query = torch.tensor([64]), torch.tensor([64])
    chunks = _one_chunk([(0, 64)])
    split = planner.plan(0, seq, query, 1, chunks)
    assert split is not None and split.bounds == (0, 43 if gfx942 else 45, 64)
    costs = rocm_cp_indexer_plan.prefill_row_costs(
        seq, query, 1, chunks, 0, planner.fill_divisor, planner.row_cost_keys
    )
    fill = 64 // FILL if gfx942 else 0
    assert costs.tolist() == [r + 1 + fill for r in range(64)]


def test_one_rank_never_splits(cp_on):
    assert _at_startup(1) is None


@pytest.mark.parametrize("stripe", ["1024", "0", "rows"])
def test_the_deprecated_stripe_size_is_accepted_and_ignored(cp_on, stripe):
    """Deployments that set it keep starting, with the same plan, and are
    told once that it no longer does anything."""
    warned = []
    cp_on.setattr(
        rocm_cp_indexer_startup.logger,
        "warning_once",
        lambda msg, *args: warned.append(msg % args),
    )
    planner = _at_startup(4)
    assert planner is not None and warned == []
    cp_on.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE", stripe)
    assert _at_startup(4) == planner
    assert len(warned) == 1 and "deprecated and ignored" in warned[0]


def test_every_rank_publishes_its_flag_and_compares_only_with_it_on(rocm_aiter):
    """In a TP group, every rank publishes its flag once per builder; only
    with the flag on does it publish the decision and plan settings too,
    and compare them with the other ranks'."""
    asked = []
    rocm_aiter.setattr(
        rocm_cp_indexer_startup, "model_parallel_is_initialized", lambda: True
    )
    rocm_aiter.setattr(rocm_cp_indexer_startup, "_pynccl_missing", lambda: False)
    rocm_aiter.setattr(
        rocm_cp_indexer_startup,
        "_publish_and_compare",
        lambda settings, compare: asked.append((settings, compare)),
    )
    assert _at_startup(2) is None
    assert asked == [({"VLLM_ROCM_USE_AITER_CP_INDEXER": False}, False)]
    asked.clear()
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    rocm_aiter_ops.refresh_env_variables()
    # The builder passes its GPU's compute units: they size the wave (on
    # gfx950, whose logits do not fill their chunk) and shape the plan, so
    # they are compared too.
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op

    rocm_aiter.setattr(op, "_ON_GFX942", False)
    planner = cp_indexer_at_startup(_config(tp=2), 1, False, compute_units=256)
    assert planner is not None
    assert planner.wave_rows == int(rocm_cp_indexer_plan.WAVE_ROWS_PER_CU * 256) > 0
    [(settings, compare)] = asked
    assert compare and settings["VLLM_ROCM_USE_AITER_CP_INDEXER"] is True
    assert settings["the CP indexer's decision"] == "split"
    assert settings["the GPU's compute units"] == 256


def _publish_on_ranks(monkeypatch, settings: list[dict], calls: int = 1) -> list:
    """``_publish_and_compare`` on one thread per rank over one real torch
    store, each rank comparing when its flag is on, ``calls`` times (one
    per builder); each rank's outcome of its last call: None, or the
    error's message."""
    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=30))
    local = threading.local()
    monkeypatch.setattr(rocm_cp_indexer_startup, "get_tp_group", lambda: local.group)
    outcomes: list = ["never ran"] * len(settings)

    def rank_main(rank: int) -> None:
        local.group = SimpleNamespace(
            cpu_group=SimpleNamespace(get_group_store=lambda: store),
            rank_in_group=rank,
            world_size=len(settings),
        )
        mine = settings[rank]
        for _ in range(calls):
            try:
                rocm_cp_indexer_startup._publish_and_compare(
                    mine, compare=mine["VLLM_ROCM_USE_AITER_CP_INDEXER"]
                )
                outcomes[rank] = None
            except ValueError as error:
                outcomes[rank] = str(error)
            except Exception as error:  # a timeout or a crash: not agreement
                outcomes[rank] = repr(error)

    threads = [
        threading.Thread(target=rank_main, args=(r,)) for r in range(len(settings))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    return outcomes


def test_ranks_that_agree_start_builder_after_builder(monkeypatch):
    on = {"VLLM_ROCM_USE_AITER_CP_INDEXER": True, "budget": 512}
    assert _publish_on_ranks(monkeypatch, [on] * 4, calls=3) == [None] * 4


def test_a_rank_with_the_flag_off_fails_the_others_without_waiting(monkeypatch):
    on = {"VLLM_ROCM_USE_AITER_CP_INDEXER": True, "budget": 512}
    off = {"VLLM_ROCM_USE_AITER_CP_INDEXER": False}
    outcomes = _publish_on_ranks(monkeypatch, [on, off, on, on])
    assert outcomes[1] is None
    for rank in (0, 2, 3):
        assert outcomes[rank] == (
            "VLLM_ROCM_USE_AITER_CP_INDEXER differs across the TP ranks (rank 0: "
            "True, rank 1: False, rank 2: True, rank 3: True); the CP indexer "
            "needs the same on every rank"
        )


class _WaitRecordingStore:
    """A store that keeps the timeout of every wait asked of it."""

    def __init__(self) -> None:
        self.store = torch.distributed.HashStore()
        self.waits: list[timedelta] = []

    def wait(self, keys, timeout):
        self.waits.append(timeout)
        return self.store.wait(keys, timeout)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_rank_that_never_publishes_is_named_not_waited_for(monkeypatch):
    """Ranks 1-3 never reach the check: rank 0 stops after one wait, not one
    per missing rank, and names them, rather than waiting as long as the
    store would."""
    wait = timedelta(seconds=0.5)
    monkeypatch.setattr(rocm_cp_indexer_startup, "_STARTUP_WAIT", wait)
    store = _WaitRecordingStore()
    group = SimpleNamespace(
        cpu_group=SimpleNamespace(get_group_store=lambda: store),
        rank_in_group=0,
        world_size=4,
    )
    monkeypatch.setattr(rocm_cp_indexer_startup, "get_tp_group", lambda: group)
    with pytest.raises(RuntimeError, match=r"TP ranks \[1, 2, 3\] published no"):
        rocm_cp_indexer_startup._publish_and_compare(
            {"VLLM_ROCM_USE_AITER_CP_INDEXER": True}, compare=True
        )
    # One wait, for the whole time: not one per rank, and not none (a rank
    # still starting would be named missing).
    assert store.waits == [wait]


def test_a_store_that_fails_does_not_stop_a_rank_with_the_flag_off(monkeypatch):
    def broken():
        raise RuntimeError("store down")

    group = SimpleNamespace(
        cpu_group=SimpleNamespace(get_group_store=broken), rank_in_group=0
    )
    monkeypatch.setattr(rocm_cp_indexer_startup, "get_tp_group", lambda: group)
    warned = []
    monkeypatch.setattr(
        rocm_cp_indexer_startup.logger,
        "warning_once",
        lambda msg, *a: warned.append(msg % a),
    )
    off = {"VLLM_ROCM_USE_AITER_CP_INDEXER": False}
    rocm_cp_indexer_startup._publish_and_compare(off, compare=False)
    assert warned == ["CP indexer: could not publish its flag: store down"]
    with pytest.raises(RuntimeError, match="store down"):
        rocm_cp_indexer_startup._publish_and_compare(
            {"VLLM_ROCM_USE_AITER_CP_INDEXER": True}, compare=True
        )


def test_a_tp_group_without_pynccl_keeps_the_split_off(cp_on):
    """The merge runs on the TP group's PyNccl: without a working one (a
    library that did not load, not only VLLM_DISABLE_PYNCCL) the split
    stays off, and the decision goes through the ranks' check."""
    asked = []
    cp_on.setattr(
        rocm_cp_indexer_startup, "model_parallel_is_initialized", lambda: True
    )
    cp_on.setattr(
        rocm_cp_indexer_startup,
        "_publish_and_compare",
        lambda settings, compare: asked.append(settings),
    )
    for pynccl in (None, SimpleNamespace(disabled=True)):
        group = SimpleNamespace(device_communicator=SimpleNamespace(pynccl_comm=pynccl))
        cp_on.setattr(rocm_cp_indexer_startup, "get_tp_group", lambda g=group: g)
        assert _at_startup(2) is None
        assert "PyNccl" in asked[-1]["the CP indexer's decision"]
    group = SimpleNamespace(
        device_communicator=SimpleNamespace(pynccl_comm=SimpleNamespace(disabled=False))
    )
    cp_on.setattr(rocm_cp_indexer_startup, "get_tp_group", lambda: group)
    assert _at_startup(2) is not None


@pytest.mark.parametrize("rank, own", [(0, (3, 5)), (1, (5, 8))])
def test_the_merge_sends_this_ranks_rows_after_the_decodes(monkeypatch, rank, own):
    """A step of 3 decode rows, then prefill rows 3:5 (rank 0) and 5:8
    (rank 1), as int32: one all_gatherv over the prefill rows of the
    buffer, in place, with this rank's rows as its input."""
    sent = []
    pynccl = SimpleNamespace(
        disabled=False, all_gatherv=lambda *args: sent.append(args)
    )
    group = SimpleNamespace(device_communicator=SimpleNamespace(pynccl_comm=pynccl))
    monkeypatch.setattr(rocm_cp_indexer, "get_tp_group", lambda: group)
    monkeypatch.setattr(rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda: rank)
    buffer = torch.zeros(10, 4, dtype=torch.int32)
    CPIndexerPrefill(CPIndexerSplit((3, 5, 8)), has_candidate_blocks=False).merge(
        buffer
    )
    [(rows, input_, sizes)] = sent
    assert (rows.data_ptr(), rows.shape) == (buffer[3].data_ptr(), (5, 4))
    first, last = own
    assert (input_.data_ptr(), input_.shape) == (
        buffer[first].data_ptr(),
        (last - first, 4),
    )
    assert sizes == [2, 3]


def test_the_merge_refuses_without_pynccl_or_a_contiguous_buffer(monkeypatch):
    """The merge sends raw memory on PyNccl: where the TP group has none
    (no such attribute, None, disabled) or the top-k buffer is not
    contiguous, it stops with the reason before any collective."""
    sent = []
    working = SimpleNamespace(disabled=False, all_gatherv=lambda *a: sent.append(a))
    buffer = torch.zeros(8, 4, dtype=torch.int32)
    strided = torch.zeros(4, 8, dtype=torch.int32).t()
    monkeypatch.setattr(rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda: 0)
    prefill = CPIndexerPrefill(CPIndexerSplit((0, 4, 8)), has_candidate_blocks=False)
    for communicator, topk in (
        (SimpleNamespace(), buffer),
        (SimpleNamespace(pynccl_comm=None), buffer),
        (SimpleNamespace(pynccl_comm=SimpleNamespace(disabled=True)), buffer),
        (SimpleNamespace(pynccl_comm=working), strided),
    ):
        group = SimpleNamespace(device_communicator=communicator)
        monkeypatch.setattr(rocm_cp_indexer, "get_tp_group", lambda g=group: g)
        with pytest.raises(
            RuntimeError,
            match="^the CP indexer's merge needs PyNccl and a contiguous top-k buffer$",
        ):
            prefill.merge(topk)
    assert sent == []


def test_a_plan_setting_that_differs_is_an_error_on_every_rank(monkeypatch):
    on = {"VLLM_ROCM_USE_AITER_CP_INDEXER": True, "budget": 512}
    outcomes = _publish_on_ranks(monkeypatch, [on, on, on, {**on, "budget": 256}])
    assert all(
        "budget differs across the TP ranks (rank 0: 512, rank 1: 512, "
        "rank 2: 512, rank 3: 256)" in outcome
        for outcome in outcomes
    )


def test_flag_off_aiter_off_or_not_rocm_means_no_split(rocm_aiter):
    assert _at_startup(2) is None  # flag off
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER", "0")
    rocm_aiter_ops.refresh_env_variables()
    assert _at_startup(2) is None
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER", "1")
    rocm_aiter_ops.refresh_env_variables()
    assert _at_startup(2) is not None
    rocm_aiter.setattr(
        rocm_cp_indexer_startup.current_platform, "is_rocm", lambda: False
    )
    assert _at_startup(2) is None


@pytest.mark.parametrize(
    ("dcp", "pcp", "graphs", "invariant", "reason"),
    [
        (2, False, None, False, "decode context parallelism"),
        (1, True, None, False, "prefill context parallelism"),
        (1, False, "FULL", False, "FULL CUDA graphs"),
        (1, False, None, True, "batch invariance"),
        (1, False, None, "VLLM_DISABLE_PYNCCL", "runs on PyNccl"),
    ],
)
def test_unsafe_configurations_stay_off_with_a_startup_log_line(
    cp_on, dcp, pcp, graphs, invariant, reason
):
    """``invariant``: True for batch invariance, or another switch to set."""
    cp_on.setattr(envs, "VLLM_BATCH_INVARIANT", invariant is True, raising=False)
    cp_on.setattr(
        envs, "VLLM_DISABLE_PYNCCL", invariant == "VLLM_DISABLE_PYNCCL", raising=False
    )
    logged = []
    cp_on.setattr(
        rocm_cp_indexer_startup.logger,
        "info_once",
        lambda msg, *args: logged.append(msg % args),
    )
    assert _at_startup(2, dcp, pcp, graphs) is None
    assert len(logged) == 1 and reason in logged[0] and "stays off" in logged[0]


def test_an_fp4_indexer_cache_keeps_the_prefill_replicated_and_says_so(cp_on):
    """The MXFP4 cache's op (rocm_mxfp4_sparse_attn_indexer) scores every
    prefill row on every rank: the startup log must not claim a split."""
    logged = []
    cp_on.setattr(
        rocm_cp_indexer_startup.logger,
        "info_once",
        lambda msg, *args: logged.append(msg % args),
    )
    assert cp_indexer_at_startup(_config(tp=4), 1, False, fp4_cache=True) is None
    assert logged == [
        (
            "CP indexer stays off (replicated prefill): the MXFP4 indexer cache's "
            "op does not split prefill rows."
        )
    ]
    logged.clear()
    assert _at_startup(4) is not None
    # Where the logits fill their chunk (gfx942) nothing is key-split.
    fill = rocm_cp_indexer_startup._logits_fill_their_chunk()
    key_split = "" if fill else ", long rows key-split"
    assert logged == [
        f"CP indexer on: 4 TP ranks, cost-balanced row ranges{key_split}."
    ]


@pytest.mark.parametrize(
    "graphs", ["PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]
)
def test_graphs_that_leave_mixed_batches_eager_or_piecewise_are_safe(cp_on, graphs):
    assert unsafe_config_reason(_config(graphs), 1, False) is None
    assert _at_startup(2, graphs=graphs) is not None


def test_env_vars_are_registered_and_mirrored(rocm_aiter):
    assert envs.VLLM_ROCM_USE_AITER_CP_INDEXER is False
    assert envs.VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE is None
    assert "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE" in envs.environment_variables
    assert not rocm_aiter_ops.is_cp_indexer_enabled()
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "true")
    rocm_aiter_ops.refresh_env_variables()
    assert rocm_aiter_ops.is_cp_indexer_enabled()


# Key split: the rows of a long turn are scored by every rank over its part
# of their keys, and selected by the rank whose range holds them.
TURN_BESIDE_A_PROMPT = [(100 * 1024, 512), (0, 8192)]


def _plan_turn_beside_a_prompt(tp: int, **settings) -> CPIndexerSplit | None:
    """A 512-row turn over 100K cached keys beside a fresh 8K prompt (92M
    key-rows), on gfx950 (no fill), on a GPU that scores 240 rows at once."""
    seq = torch.tensor([c + n for c, n in TURN_BESIDE_A_PROMPT])
    query = torch.tensor([n for _, n in TURN_BESIDE_A_PROMPT])
    chunks = [_chunk_of(0, 512), _chunk_of(512, 8704)]
    for chunk, (cached, new) in zip(chunks, TURN_BESIDE_A_PROMPT, strict=True):
        chunk.total_seq_lens = chunk.max_seqlen_k = cached + new
    settings = {"fill_divisor": None, "wave_rows": 240, **settings}
    return plan_cp_indexer_split(tp, 0, seq, query, 1, chunks, **settings)


def test_the_key_split_search_cuts_only_plans_that_could_win(monkeypatch):
    """Eight turns of 256 rows over 200K cached keys at tp 8: every turn may
    be key-split. The rows are cut once without a key split, and then only
    for the counts whose even share and key-split cost stay under the best
    plan's cost (no rank costs less than an even share): half of them."""
    requests = [(200 * 1024, 256)] * 8
    seq = torch.tensor([cached + new for cached, new in requests])
    query = torch.tensor([new for _, new in requests])
    chunks = [_chunk_of(0, 2048)]
    chunks[0].total_seq_lens = chunks[0].max_seqlen_k = 200 * 1024 + 256
    keys = rocm_cp_indexer_plan.prefill_row_key_counts(seq, query, 1)
    candidates = rocm_cp_indexer_plan.key_split_candidates(keys, query, 8, 2048)
    assert len(candidates) == 8
    cuts = []
    bounds = rocm_cp_indexer_cuts.RowPlanner.bounds

    def counted(self, *args):
        cuts.append(args)
        return bounds(self, *args)

    monkeypatch.setattr(rocm_cp_indexer_cuts.RowPlanner, "bounds", counted)
    split = plan_cp_indexer_split(
        8, 0, seq, query, 1, chunks, fill_divisor=None, wave_rows=240
    )
    assert split is not None and split.key_split == ()
    assert len(cuts) <= 1 + len(candidates) // 2, len(cuts)


@pytest.mark.parametrize("tp", [4, 8])
def test_a_long_turn_is_key_split_where_its_rows_are_few(tp):
    """In whole rows each rank would hold a sliver of the turn's 100K-key
    rows; key-split, every rank scores the turn's 512 rows over a tp-th of
    their keys, and the prompt's rows are cut by cost."""
    split = _plan_turn_beside_a_prompt(tp)
    assert split is not None and split.key_split == ((0, 512),)
    assert sum(split.key_split_owners) == 512
    assert split.bounds[0] == 0 and split.bounds[-1] == 8704


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_key_split_rows_owner_pays_only_its_select(tp):
    """The rank whose range holds the turn's key-split rows selects each
    one's top-k from every rank's candidates (tp x 2048 at a quarter of a
    key-row each) and takes that much less of the prompt's rows: every
    rank's modelled work comes out within 1% of the others'."""
    split = _plan_turn_beside_a_prompt(tp)
    assert split is not None and split.key_split == ((0, 512),)
    select = tp * 2048 // 4
    # Row t of a request with P cached tokens: P + t + 1 keys and the fixed
    # row cost (gfx950: no fill).
    costs = [p + t + 1 + ROW for p, new in TURN_BESIDE_A_PROMPT for t in range(new)]
    work = [
        sum(costs[max(start, 512) : end]) + owned * select
        for (start, end), owned in zip(
            zip(split.bounds, split.bounds[1:]), split.key_split_owners
        )
    ]
    assert split.key_split_owners[0] == 512
    assert max(work) <= 1.01 * min(work), work


def test_no_key_split_where_it_is_not_allowed(monkeypatch):
    """Below the step's minimum, where the logits fill their chunk (gfx942),
    or with fewer rows allowed than the turn has: whole rows only."""
    shipped = _plan_turn_beside_a_prompt(8)
    assert shipped is not None and shipped.key_split
    filled = _plan_turn_beside_a_prompt(8, fill_divisor=8)
    assert filled is not None and filled.key_split == ()
    capped = _plan_turn_beside_a_prompt(8, key_split_max_rows=511)
    assert capped is not None and capped.key_split == ()
    monkeypatch.setattr(rocm_cp_indexer_plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 10**9)
    small = _plan_turn_beside_a_prompt(8)
    assert small is not None and small.key_split == ()


# Two turns over long prefixes beside a fresh prompt: at tp 4 the model
# key-splits only the longer turn, though both are candidates.
TWO_TURNS_BESIDE_A_PROMPT = [(100 * 1024, 256), (40 * 1024, 256), (0, 8192)]


def _plan_requests(requests, tp: int, planner=None, **settings):
    """The plan for ``requests`` ((cached, new)), one chunk each, on gfx950
    (no fill) with 240 rows a wave unless ``settings`` say otherwise; with
    ``planner``, its own ``plan``."""
    seq = torch.tensor([c + n for c, n in requests])
    query = torch.tensor([n for _, n in requests])
    chunks, row = [], 0
    for cached, new in requests:
        chunks.append(_chunk_of(row, row + new))
        chunks[-1].total_seq_lens = chunks[-1].max_seqlen_k = cached + new
        row += new
    if planner is not None:
        return planner.plan(0, seq, query, 1, chunks)
    settings = {"fill_divisor": None, "wave_rows": 240, **settings}
    return plan_cp_indexer_split(tp, 0, seq, query, 1, chunks, **settings)


def test_a_key_split_request_after_others_and_the_decodes_keeps_its_rows():
    """The prompt first, then the turn, after three decode rows: the turn's
    rows are key-split at their batch rows, past the decodes and the
    prompt."""
    requests = [(0, 8192), (100 * 1024, 512)]
    seq = torch.tensor([c + n for c, n in requests])
    query = torch.tensor([n for _, n in requests])
    chunks = [_chunk_of(3, 8195), _chunk_of(8195, 8707)]
    for chunk, (cached, new) in zip(chunks, requests, strict=True):
        chunk.total_seq_lens = chunk.max_seqlen_k = cached + new
    split = plan_cp_indexer_split(
        8, 3, seq, query, 1, chunks, fill_divisor=None, wave_rows=240
    )
    assert split is not None and split.key_split == ((8195, 8707),)
    assert split.bounds[0] == 3 and split.bounds[-1] == 8707


def test_a_step_of_exactly_the_minimum_may_key_split(monkeypatch):
    """KEY_SPLIT_MIN_STEP_KEY_ROWS is the least a step may key-split at."""
    costs = rocm_cp_indexer_plan.prefill_row_costs(
        torch.tensor([c + n for c, n in TURN_BESIDE_A_PROMPT]),
        torch.tensor([n for _, n in TURN_BESIDE_A_PROMPT]),
        1,
        [],
        0,
        fill_divisor=None,
    )
    total = int(costs.sum())
    plan = rocm_cp_indexer_plan
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", total)
    at = _plan_turn_beside_a_prompt(8)
    assert at is not None and at.key_split == ((0, 512),)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", total + 1)
    above = _plan_turn_beside_a_prompt(8)
    assert above is not None and above.key_split == ()


def test_with_the_model_off_every_candidate_is_key_split(monkeypatch):
    """KEY_SPLIT_BY_MODEL off: every candidate request is key-split, not
    the model's choice, unless that plan passes the owners' cap: then none."""
    steps = TWO_TURNS_BESIDE_A_PROMPT
    by_model = _plan_requests(steps, 4)
    assert by_model is not None and by_model.key_split == ((0, 256),)
    monkeypatch.setattr(rocm_cp_indexer_plan, "KEY_SPLIT_BY_MODEL", False)
    every = _plan_requests(steps, 4)
    assert every is not None and every.key_split == ((0, 256), (256, 512))
    most = max(every.key_split_owners)
    assert _plan_requests(steps, 4, key_split_max_owned=most) == every
    capped = _plan_requests(steps, 4, key_split_max_owned=most - 1)
    assert capped is not None and capped.key_split == ()


@pytest.mark.parametrize(
    "setting",
    [
        {"wave_rows": 0},
        {"key_split_max_rows": 255},
        {"key_split_max_owned": 200},
        {"link": rocm_cp_indexer_plan.NVLINK},
        {"call_cost_keys": 0},
        {"row_cost_keys": 20_000},
        {"fill_divisor": FILL},
    ],
    ids=lambda setting: next(iter(setting)),
)
def test_the_startup_planner_plans_with_its_own_settings(setting):
    """Each setting of the planner made at startup reaches every step's
    plan: the same split as planning with that setting, which differs from
    planning without it."""
    steps = TWO_TURNS_BESIDE_A_PROMPT
    settings = {"fill_divisor": None, "wave_rows": 240, **setting}
    planner = rocm_cp_indexer_plan.CPIndexerPlanner(4, **settings)
    planned = _plan_requests(steps, 4, planner)
    assert planned == _plan_requests(steps, 4, **setting)
    assert planned != _plan_requests(steps, 4)


def test_the_gate_prices_the_merge_and_the_exchange():
    """A split repays where the costliest rank (an even share and
    SPLIT_OVERHEAD) and the links stay within (1 - MIN_SPLIT_GAIN) of the
    replicated op. At tp 2 with 1,000 rows a rank on xGMI: 10M key-rows
    repay an int16 merge but not the default int32 one; 20M repay the
    int16 merge, but not with 2,000 key-split rows' candidates sent to one
    owner."""
    repays = rocm_cp_indexer_plan.split_repays
    xgmi = rocm_cp_indexer_plan.XGMI_GFX950
    assert repays(10_000_000, [1000, 1000], xgmi, narrow=True)
    assert not repays(10_000_000, [1000, 1000], xgmi)
    assert repays(20_000_000, [1000, 1000], xgmi, True)
    assert repays(20_000_000, [1000, 1000], xgmi, True, [0, 0])
    assert not repays(20_000_000, [1000, 1000], xgmi, True, [2000, 0])


def test_a_key_split_row_is_owned_by_the_rank_whose_range_holds_it():
    # One request across a cut, one starting at a cut, one inside a range.
    split = CPIndexerSplit((0, 10, 20, 30), key_split=((5, 12), (20, 25), (28, 30)))
    assert [split.owned_key_split(r) for r in range(3)] == [
        [(5, 10)],
        [(10, 12)],
        [(20, 25), (28, 30)],
    ]
    assert split.key_split_owners == [5, 2, 7]
    assert split.key_split_rows == 14


def test_the_exchange_is_priced_per_link():
    """Each owner receives its rows' candidates (16 KiB a row) from every
    other rank: through NVLink's one port all of them, over xGMI's link per
    pair one rank's at a time."""
    owners = [100, 300, 0, 50]
    row = rocm_cp_indexer_plan.CANDIDATE_ROW_BYTES
    nvlink, xgmi = rocm_cp_indexer_plan.NVLINK, rocm_cp_indexer_plan.XGMI_GFX950
    assert nvlink.exchange_ms(owners, row) == pytest.approx(
        0.1 + 3 * 300 * row / (nvlink.gb_per_s * 1e6), rel=1e-12
    )
    assert xgmi.exchange_ms(owners, row) == pytest.approx(
        0.1 + 300 * row / (xgmi.gb_per_s * 1e6), rel=1e-12
    )
    # The gate adds it to the merge's price.
    merge_only = rocm_cp_indexer_plan.links_key_rows(xgmi, [1000, 1000], True)
    with_exchange = rocm_cp_indexer_plan.links_key_rows(
        xgmi, [1000, 1000], True, [300, 0]
    )
    assert with_exchange - merge_only == pytest.approx(
        xgmi.exchange_ms([300, 0], row) * 1e6 / rocm_cp_indexer_plan.NS_PER_KEY_ROW,
        rel=1e-9,
    )


@pytest.mark.parametrize(("longest", "narrow"), [(65534, True), (65535, False)])
def test_rows_merge_as_int16_below_65535_keys(longest, narrow):
    chunks = [_chunk_of(0, 4), _chunk_of(4, 8)]
    chunks[1].max_seqlen_k = longest
    assert rocm_cp_indexer_plan.travels_narrow(chunks) is narrow


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_the_ranks_parts_of_a_key_split_row_cover_its_keys_once(monkeypatch, tp):
    """Every rank's part of each key-split row, over a run of two chunks of
    the same keys and rows of 1 to 60 keys (shorter than tp too): the parts
    are disjoint and cover the row's keys, and the offsets say where each
    part starts in the row."""
    chunks = [_chunk_of(0, 30), _chunk_of(30, 60, skip=True)]
    split = CPIndexerSplit(
        tuple(r * 60 // tp for r in range(tp + 1)), key_split=((0, 60),)
    )
    covered = torch.zeros(60, 61, dtype=torch.int32)
    for rank in range(tp):
        monkeypatch.setattr(
            rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
        )
        rocm_cp_indexer._STEP_WINDOWS[:] = [None, None, (None, [])]
        for window in CPIndexerPrefill(split, False).windows(chunks):
            if window.key_offset is None:
                continue
            for i, row in enumerate(range(window.start, window.end)):
                ks, ke = int(window.ks[i]), int(window.ke[i])
                start = int(chunks[row // 30].cu_seqlen_ks[row % 30])
                assert ks - start == int(window.key_offset[i])
                covered[row, ks:ke] += 1
    ends = torch.arange(60)
    for row in range(60):
        assert covered[row, : ends[row]].eq(1).all(), f"row {row}"
        assert covered[row, ends[row] :].eq(0).all(), f"row {row}"


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_each_key_split_request_is_cut_from_its_own_first_key(monkeypatch, tp):
    """Two key-split requests with a request of whole rows between them, the
    later one's keys after the others' in its chunk's gathered keys: each
    rank's part of a row lies in that row's keys, the parts cover them
    once, each offset counts from the row's own first key, and each row's
    candidates go to its place among the step's key-split rows."""
    first = _chunk_of(0, 24)
    second = _chunk_of(24, 60)
    # Rows 24-33: a request over keys 0-13; rows 34-59: one over keys 50-81.
    second.cu_seqlen_ks = torch.tensor([0] * 10 + [50] * 26, dtype=torch.int32)
    second.cu_seqlen_ke = torch.tensor(
        [5 + i for i in range(10)] + [57 + i for i in range(26)], dtype=torch.int32
    )
    second.max_seqlen_k = 83
    chunks = [first, second]
    key_split = ((0, 24), (34, 60))
    split = CPIndexerSplit(
        tuple(r * 60 // tp for r in range(tp + 1)), key_split=key_split
    )
    place = {row: i for i, row in enumerate([*range(0, 24), *range(34, 60)])}

    def keys_of(row: int) -> tuple[int, int]:
        chunk = first if row < 24 else second
        at = row - chunk.token_start
        return int(chunk.cu_seqlen_ks[at]), int(chunk.cu_seqlen_ke[at])

    covered = torch.zeros(60, 83, dtype=torch.int32)
    for rank in range(tp):
        monkeypatch.setattr(
            rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
        )
        rocm_cp_indexer._STEP_WINDOWS[:] = [None, None, (None, [])]
        gathered = set()
        for window in CPIndexerPrefill(split, False).windows(chunks):
            # Each run's keys are gathered by its first call, once.
            assert window.gather_keys is (id(window.chunk) not in gathered)
            gathered.add(id(window.chunk))
            if window.key_offset is None:
                assert place.keys().isdisjoint(range(window.start, window.end))
                continue
            chunk = first if window.start < 24 else second
            assert window.chunk is chunk
            # A part holds at most a tp-th of the longest row's keys.
            assert window.max_seqlen_k == -(-chunk.max_seqlen_k // tp)
            assert window.ks.dtype == window.ke.dtype == torch.int32
            assert window.key_offset.dtype == torch.int32
            for i, row in enumerate(range(window.start, window.end)):
                row_ks, row_ke = keys_of(row)
                ks, ke = int(window.ks[i]), int(window.ke[i])
                assert row_ks <= ks <= ke <= row_ke, f"rank {rank}, row {row}"
                assert ks - row_ks == int(window.key_offset[i])
                assert window.candidate_row + i == place[row]
                covered[row, ks:ke] += 1
    for row in place:
        row_ks, row_ke = keys_of(row)
        assert covered[row, row_ks:row_ke].eq(1).all(), f"row {row}"
        assert int(covered[row].sum()) == row_ke - row_ks, f"row {row}"


def test_a_steps_windows_are_made_once_for_all_its_layers(monkeypatch):
    """Every indexer layer of a step makes the same calls: the second
    layer's op reuses the first's windows; the next step's chunks get new
    ones. The merge's row width follows the step's longest sequence."""
    monkeypatch.setattr(rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda: 0)
    rocm_cp_indexer._STEP_WINDOWS[:] = [None, None, (None, [])]
    split = CPIndexerSplit((0, 30, 60), key_split=((0, 24),))
    chunks = [_chunk_of(0, 30), _chunk_of(30, 60)]
    layer = CPIndexerPrefill(split, False)
    made = list(layer.windows(chunks))
    assert layer.narrow is True
    again = list(CPIndexerPrefill(split, False).windows(chunks))
    assert len(again) == len(made) and all(
        a is b for a, b in zip(again, made, strict=True)
    )
    step = [_chunk_of(0, 30), _chunk_of(30, 60)]
    step[1].max_seqlen_k = 70_000
    later = CPIndexerPrefill(split, False)
    fresh = list(later.windows(step))
    assert fresh[0] is not made[0] and fresh[0].chunk is step[0]
    assert later.narrow is False
    replicated = CPIndexerPrefill(None, False)
    list(replicated.windows(chunks))
    assert replicated.narrow is False


def test_touching_key_split_requests_are_scored_in_one_call():
    """Next requests' key-split rows are joined: one call scores them
    together where the run's chunk allows; a gap keeps them apart."""
    joined = rocm_cp_indexer_calls.joined
    assert joined([(5, 9), (0, 5), (12, 14)]) == [(0, 9), (12, 14)]
    assert joined([(0, 5), (6, 9)]) == [(0, 5), (6, 9)]
    runs = [(0, 20, 20)]
    calls = rocm_cp_indexer_calls.key_split_calls(runs, ((0, 5), (5, 9), (12, 14)))
    assert [(c.first, c.last, c.candidate_row) for c in calls] == [
        (0, 9, 0),
        (12, 14, 9),
    ]


def test_runs_are_counted_in_prefill_rows_after_the_decodes():
    """Three decode rows, then a request sliced into a run of two chunks
    over the same keys, then another chunk: the runs' rows, counted from
    the first prefill row, and each run's largest chunk."""
    chunks = [_chunk_of(3, 10), _chunk_of(10, 14, skip=True), _chunk_of(14, 20)]
    assert rocm_cp_indexer_calls.shared_key_runs(chunks, 3) == [
        (0, 11, 7),
        (11, 17, 6),
    ]


@pytest.mark.parametrize("longest", [65534, 65535])
def test_the_planner_prices_the_merge_the_op_makes(monkeypatch, longest):
    """At the int16 bound the planner prices the merge the op will make:
    int16 rows below 65535 keys, int32 from it."""
    priced = []
    repays = rocm_cp_indexer_plan.split_repays

    def recording(total, sizes, link, narrow, *owners):
        priced.append(narrow)
        return repays(total, sizes, link, narrow, *owners)

    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", recording)
    chunk = _chunk_of(0, 64)
    chunk.total_seq_lens = chunk.max_seqlen_k = longest
    plan_cp_indexer_split(2, 0, torch.tensor([longest]), torch.tensor([64]), 1, [chunk])
    op = rocm_cp_indexer_plan.travels_narrow([chunk])
    assert op is (longest < 65535)
    assert priced and set(priced) == {op}


@pytest.mark.parametrize("tp", [4, 8])
def test_the_last_gate_prices_the_plans_own_exchange(monkeypatch, tp):
    """The split is judged with what it sends: its merge (int32: the turn's
    rows have over 65,535 keys) and the exchange of its key-split rows'
    candidates to their owners."""
    judged = []
    repays = rocm_cp_indexer_plan.split_repays

    def recording(total, sizes, link, narrow=False, owners=None):
        judged.append((list(sizes), narrow, owners))
        return repays(total, sizes, link, narrow, owners)

    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", recording)
    split = _plan_turn_beside_a_prompt(tp)
    assert split is not None and split.key_split
    assert judged[-1] == (split.sizes, False, split.key_split_owners)


def test_the_candidates_are_the_longest_rows_first_within_the_caps(monkeypatch):
    """Which requests a step may key-split: those whose last row has at
    least tp x KEY_SPLIT_MIN_KEYS_PER_RANK keys (exactly that is enough),
    longest first, at most KEY_SPLIT_MAX_REQUESTS, and no further than the
    first that would pass the rows allowed (a shorter one is not taken past
    a longer one); zero-length requests hold no rows."""
    plan = rocm_cp_indexer_plan
    least = 2 * plan.KEY_SPLIT_MIN_KEYS_PER_RANK

    def candidates(requests, max_rows):
        """``requests``: (rows, last row's keys); their row ranges chosen."""
        query = torch.tensor([rows for rows, _ in requests])
        keys = torch.cat([torch.full((rows,), last) for rows, last in requests])
        chosen = plan.key_split_candidates(keys, query, 2, max_rows)
        ends = list(accumulate(rows for rows, _ in requests))
        names = {(end - rows, end): i for i, ((rows, _), end)
                 in enumerate(zip(requests, ends)) if rows}  # fmt: skip
        return [names[r] for r in chosen]

    at_least = [(2, least + 800), (0, 0), (3, least), (1, least - 1)]
    assert candidates(at_least, 100) == [0, 2]
    many = [(1, least + k * 1000) for k in range(10)]
    many[3] = (4, least + 3000)
    assert candidates(many, 100) == [9, 8, 7, 6, 5, 4, 3, 2]
    assert candidates(many, 1 + 1 + 1 + 1 + 1 + 1 + 4) == [9, 8, 7, 6, 5, 4, 3]
    assert candidates(many, 9) == [9, 8, 7, 6, 5, 4]


def _requests_in_chunks(gen: torch.Generator, first_row: int, budget: int):
    """Requests of 1-40 rows laid out as vLLM's builder lays them out: whole
    requests packed into chunks of at most ``budget`` rows, and a request
    longer than that sliced into a run of chunks over the same keys
    (skip_kv_gather). Returns the requests' row ranges and the chunks."""
    requests, chunks, row = [], [], first_row
    for _ in range(int(torch.randint(1, 12, (1,), generator=gen))):
        rows = int(torch.randint(1, 41, (1,), generator=gen))
        requests.append((row, row + rows))
        if rows > budget:
            for start in range(row, row + rows, budget):
                end = min(start + budget, row + rows)
                chunks.append(_chunk_of(start, end, skip=start > row))
        elif (
            chunks
            and not chunks[-1].skip_kv_gather
            and (row + rows - chunks[-1].token_start <= budget)
        ):
            chunks[-1] = _chunk_of(chunks[-1].token_start, row + rows)
        else:
            chunks.append(_chunk_of(row, row + rows))
        row += rows
    return requests, chunks


def test_the_op_makes_the_calls_the_planner_prices(monkeypatch):
    """Over generated steps and key splits (none, one, next requests in one
    chunk or in different runs, all): each rank's calls are the planner's
    (``rank_calls``: whole rows as ``RankCost`` prices them, key-split rows
    as ``key_split_calls`` does); every rank scores every key-split row
    once and puts its candidates in that row's place among the key-split
    rows, so the candidates it sends are in row order, each once; every
    other prefill row is scored once, by the rank whose range holds it."""
    gen = torch.Generator().manual_seed(1)
    plan = rocm_cp_indexer_plan
    for case in range(200):
        tp = int(torch.randint(2, 9, (1,), generator=gen))
        decode = int(torch.randint(0, 4, (1,), generator=gen))
        budget = int(torch.randint(4, 48, (1,), generator=gen))
        requests, chunks = _requests_in_chunks(gen, decode, budget)
        rows = requests[-1][1] - decode
        if rows < tp:
            continue
        picked = torch.randint(0, 2, (len(requests),), generator=gen).tolist()
        if case % 4 == 0:
            picked = [1] * len(requests)
        key_split = tuple(r for r, p in zip(requests, picked, strict=True) if p)
        cuts = sorted(torch.randperm(rows - 1, generator=gen)[: tp - 1].tolist())
        bounds = tuple(decode + b for b in [0, *(c + 1 for c in cuts), rows])
        split = CPIndexerSplit(bounds, key_split)
        runs = rocm_cp_indexer_calls.shared_key_runs(chunks, 0)
        place = {
            r: i for i, r in enumerate(r for a, b in key_split for r in range(a, b))
        }
        scored = torch.zeros(decode + rows, dtype=torch.int64)
        for rank in range(tp):
            monkeypatch.setattr(
                rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
            )
            rocm_cp_indexer._STEP_WINDOWS[:] = [None, None, (None, [])]
            windows = list(CPIndexerPrefill(split, False).windows(chunks))
            start, end = split.rows_of(rank)
            made = [(w.start, w.end, w.candidate_row if w.key_offset is not None
                     else None) for w in windows]  # fmt: skip
            planned = list(
                rocm_cp_indexer_calls.rank_calls(start, end, runs, key_split)
            )
            assert made == [(c.first, c.last, c.candidate_row) for c in planned]
            priced = rocm_cp_indexer_cuts.RankCost(
                torch.arange(decode + rows + 1), None, runs, 1, 0, key_split,
                logits_share=plan.LOGITS_SHARE,
            )  # fmt: skip
            whole = [(c.first, c.last) for c in priced.calls(start, end)]
            assert whole == [(a, b) for a, b, row in made if row is None], case
            shared = [
                (c.first, c.last)
                for c in rocm_cp_indexer_calls.key_split_calls(runs, key_split)
            ]
            assert shared == [(a, b) for a, b, row in made if row is not None]
            sent = torch.zeros(split.key_split_rows, dtype=torch.int64)
            for first, last, row in made:
                if row is None:
                    assert place.keys().isdisjoint(range(first, last))
                    assert start <= first and last <= end, case
                    scored[first:last] += 1
                else:
                    assert [place[r] for r in range(first, last)] == list(
                        range(row, row + last - first)
                    ), f"case {case}: rows {first}:{last} sent to place {row}"
                    sent[row : row + last - first] += 1
            assert sent.eq(1).all(), f"case {case}"
        for row in range(decode, decode + rows):
            assert scored[row] == (0 if row in place else 1), f"case {case}"


@pytest.mark.parametrize("tp", [4, 8])
def test_no_rank_owns_more_key_split_rows_than_its_cap(tp):
    """What a rank receives in the exchange grows with the key-split rows it
    owns: the planner keeps every owner within ``key_split_max_owned``,
    taking the same plan at the cap and none that passes it."""
    free = _plan_turn_beside_a_prompt(tp)
    assert free is not None and free.key_split
    most = max(free.key_split_owners)
    at_cap = _plan_turn_beside_a_prompt(tp, key_split_max_owned=most)
    assert at_cap == free
    below = _plan_turn_beside_a_prompt(tp, key_split_max_owned=most - 1)
    assert below is not None
    assert max(below.key_split_owners) <= most - 1


def test_the_caps_in_rows_for_a_logits_budget():
    """Whole rows: a sixteenth of the budget in 16 KiB candidate rows a rank
    sends, the budget over tp such rows for what an owner receives, and
    KEY_SPLIT_MAX_ROWS at most."""
    plan = rocm_cp_indexer_plan
    budget = (1 << 20) + 1
    assert plan.key_split_max_rows(budget) == 4
    assert plan.key_split_max_owned(budget, 8) == 8
    assert plan.key_split_max_owned(budget, 3) == 21
    assert plan.key_split_max_rows(64 << 30) == plan.KEY_SPLIT_MAX_ROWS
    assert plan.key_split_max_owned(64 << 30, 8) == plan.KEY_SPLIT_MAX_ROWS


def test_the_key_split_rows_cost_every_rank_as_the_model_says():
    """Two key-split requests in two runs of chunks, at tp 4: each call
    costs a tp-th of its rows' keys, each row its fixed cost and its 2048
    candidates at a quarter key-row, the call its fixed cost, and where its
    rows fill less than a wave of its longest row (6 rows here), the logits'
    share of the difference."""
    plan = rocm_cp_indexer_plan
    keys = torch.tensor([10000, 10001, 10002, 10003, 5, 6, 20000, 20001, 20002])
    runs = [(0, 6, 6), (6, 9, 3)]
    share = plan.LOGITS_SHARE
    planned = rocm_cp_indexer_cuts.RowPlanner(
        keys + 700, torch.tensor([4, 2, 3]), runs, 4, 1000, 6, logits_share=share
    )
    per_row = 700 + 2048 / 4
    first = 40006 / 4 + 4 * per_row + 1000 + share * (6 * 10003 / 4 - 40006 / 4)
    second = 60003 / 4 + 3 * per_row + 1000 + share * (6 * 20002 / 4 - 60003 / 4)
    cost = plan._key_split_cost([(0, 4), (6, 9)], keys, planned, 700)
    assert cost == pytest.approx(first + second, rel=1e-12)
    # A wave of one row: every call fills it, nothing is added.
    planned.wave_rows = 1
    cost = plan._key_split_cost([(0, 4), (6, 9)], keys, planned, 700)
    assert cost == pytest.approx((40006 + 60003) / 4 + 7 * per_row + 2000, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("heavy", ["first", "last"])
def test_every_rank_gets_a_row_when_one_row_outweighs_the_rest(tp, heavy):
    """Where one row costs more than all the others (the first or the
    last), the cuts nearest the cost shares would give ranks no rows: each
    rank still gets at least one, in order."""
    costs = [100] + [1] * tp if heavy == "first" else [1] * tp + [100]
    before = torch.tensor([0, *accumulate(costs)])
    total = int(before[-1])
    shares = torch.arange(1, tp) * total // tp
    bounds = rocm_cp_indexer_cuts._cut_at(before, shares)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == tp + 1
    assert min(sizes) >= 1, bounds
    # The heavy row's rank takes it alone.
    assert (sizes[0] if heavy == "first" else sizes[-1]) == 1, bounds


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("logits_mb", [1, 64, 512])
def test_the_caps_keep_the_exchange_within_the_reservation(
    cp_on, monkeypatch, tp, logits_mb
):
    """At the caps, a call's logits beside the candidates a rank sends (and
    a key-split call's top-k), and
    those beside everything an owner receives once the logits are freed,
    stay within what the profiling run reserves (``profile_bytes``, the
    split on), whatever the step's rows (its int16 merge only adds)."""
    monkeypatch.setattr(rocm_cp_indexer, "_tp_size", lambda: tp)
    budget = logits_mb << 20
    row = rocm_cp_indexer_plan.CANDIDATE_ROW_BYTES
    sent = rocm_cp_indexer_plan.key_split_max_rows(budget) * row
    topk = rocm_cp_indexer_plan.key_split_max_rows(budget) * 2048 * 4
    received = tp * rocm_cp_indexer_plan.key_split_max_owned(budget, tp) * row
    reserved = rocm_cp_indexer.profile_bytes(budget, 256, 2048)
    assert budget + sent + topk <= reserved
    assert sent + received <= reserved


def test_the_profiling_run_reserves_what_the_split_holds(cp_on, monkeypatch):
    """With the switch off or at TP 1, the logits budget as vLLM reserves
    it; with the split on, also the candidates a rank sends and a key-split
    call's top-k (up to 48 MiB), or the merge's int16 rows where a step's
    rows take more."""
    budget, k = 512 << 20, 2048
    sent = 2048 * (rocm_cp_indexer_plan.CANDIDATE_ROW_BYTES + k * 4)
    profile = rocm_cp_indexer.profile_bytes
    monkeypatch.setattr(rocm_cp_indexer, "_tp_size", lambda: 8)
    assert profile(budget, 16384, k) == budget + sent
    assert profile(budget, 1 << 20, k) == (1 << 20) * k * 2
    monkeypatch.setattr(rocm_cp_indexer, "_tp_size", lambda: 1)
    assert profile(budget, 16384, k) == budget
    monkeypatch.setattr(rocm_cp_indexer, "_tp_size", lambda: 8)
    cp_on.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "0")
    rocm_aiter_ops.refresh_env_variables()
    assert profile(budget, 1 << 20, k) == budget


def test_a_zigzag_layout_reserves_the_merges_int32_copy(cp_on, monkeypatch):
    """The zigzag merge puts the rows back in batch order from an int32
    copy of them: the reservation holds it where a step's rows take more
    than the logits and the candidates."""
    budget, k = 512 << 20, 2048
    monkeypatch.setattr(rocm_cp_indexer, "_tp_size", lambda: 8)
    monkeypatch.setattr(rocm_cp_indexer_plan, "ROW_LAYOUT", "zigzag")
    assert rocm_cp_indexer.profile_bytes(budget, 1 << 20, k) == (1 << 20) * k * 4


def test_the_profiling_run_asks_the_tp_group_its_size(cp_on, monkeypatch):
    """Before vLLM's model parallel state is made there is no TP group: one
    rank, the logits budget alone; after, the group's size decides."""
    budget, k = 512 << 20, 2048
    sent = 2048 * (rocm_cp_indexer_plan.CANDIDATE_ROW_BYTES + k * 4)
    monkeypatch.setattr(rocm_cp_indexer, "model_parallel_is_initialized", lambda: False)
    assert rocm_cp_indexer.profile_bytes(budget, 16384, k) == budget
    monkeypatch.setattr(rocm_cp_indexer, "model_parallel_is_initialized", lambda: True)
    for tp, reserved in ((1, budget), (2, budget + sent)):
        monkeypatch.setattr(
            rocm_cp_indexer, "get_tensor_model_parallel_world_size", lambda t=tp: t
        )
        assert rocm_cp_indexer.profile_bytes(budget, 16384, k) == reserved
