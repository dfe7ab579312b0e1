# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plan of stage 0001's split, made once per step by the indexer
metadata builder from host integers, identically on every rank
(``CPIndexerPlanner.plan``): which prefill rows each TP rank scores
(``CPIndexerSplit``), and whether the split repays its merge over the TP
group's link at all (``split_repays``; a step that would not stays
replicated).

A row costs its causal key count, which the builder knows on the host: a
new chat turn over a long cached prefix costs 10-100x a fresh prompt's row.
By default (``ROW_LAYOUT`` "cost") each rank takes a contiguous range of
rows cut by modelled cost (``rocm_cp_indexer_cuts``), and requests with
long rows are key-split where that lowers the modelled step
(``_key_split_plan``). The "zigzag" layout balances by construction
(``zigzag_split``). The constants below were measured with Triton stand-ins
of AITER's kernels on H100 and H200 GPUs; MI355X's kernels move them, and
the host bench refits them there.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from vllm.v1.attention.ops.rocm_cp_indexer_calls import (
    joined,
    key_split_calls,
    shared_key_runs,
)
from vllm.v1.attention.ops.rocm_cp_indexer_cuts import RowPlanner

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillChunkMetadata,
    )


# Whether a step splits (``split_repays``): it must cost MIN_SPLIT_KEY_ROWS
# at least (below that a call is mostly host work), and save more than the
# merge and MIN_SPLIT_GAIN of the replicated op, each rank's share costing
# 1 + SPLIT_OVERHEAD of an even share (work every rank repeats, imbalance).
# The merge's milliseconds become key-rows at NS_PER_KEY_ROW.
MIN_SPLIT_KEY_ROWS = 7_000_000
MIN_SPLIT_GAIN = 0.075
SPLIT_OVERHEAD = 0.15
NS_PER_KEY_ROW = 0.072
# The merge gathers every row's top-k indices (2,048 for DeepSeek-V3.2 and
# GLM-5.x) into every rank: int32, or int16 where every row has fewer than
# NARROW_KEYS keys, so that each row-local index, and -1, fits.
TOPK = 2048
MERGED_ROW_BYTES = TOPK * 4
NARROW_ROW_BYTES = TOPK * 2
# A key-split row's candidates from one rank: k indices and k float32 scores.
CANDIDATE_ROW_BYTES = TOPK * 8
NARROW_KEYS = (1 << 16) - 1


@dataclass(frozen=True)
class MergeLink:
    """The TP group's link: a latency and a rate one way, through one port
    per GPU to a switch, or over one link per pair of GPUs (``switched``
    False: a rank receives each peer's rows on its own link, at once)."""

    latency_ms: float
    gb_per_s: float
    switched: bool

    def merge_ms(
        self, rank_rows: list[int], row_bytes: int = MERGED_ROW_BYTES
    ) -> float:
        """The all_gatherv of ranks holding ``rank_rows`` rows of
        ``row_bytes`` each."""
        received = sum(rank_rows) - min(rank_rows) if self.switched else max(rank_rows)
        return self.latency_ms + received * row_bytes / (self.gb_per_s * 1e6)

    def exchange_ms(self, owned_rows: list[int], row_bytes: int) -> float:
        """The all_to_all of every rank's ``row_bytes`` rows to their owners
        (``owned_rows`` each)."""
        most = max(owned_rows)
        received = most * (len(owned_rows) - 1) if self.switched else most
        return self.latency_ms + received * row_bytes / (self.gb_per_s * 1e6)


# The all_gather of the merge measured on 2x H200 over NVLink reached 58% of
# the link's 450 GB/s one way, after 0.10 ms (8K-64K rows). AMD's Instinct
# GPUs are joined pairwise, one xGMI link each: 76.8 GB/s one way on gfx950
# (MI350X, MI355X; AMD's 153.6 GB/s both ways), 64 on gfx942 (MI300X,
# MI325X; 128 both ways). Taken at the same share and latency, not measured.
# The planner prices its GPU's xGMI link; NVLINK is the bench's H200 model.
NVLINK = MergeLink(latency_ms=0.10, gb_per_s=0.58 * 450, switched=True)
XGMI_GFX950 = MergeLink(latency_ms=0.10, gb_per_s=0.58 * 76.8, switched=False)
XGMI_GFX942 = MergeLink(latency_ms=0.10, gb_per_s=0.58 * 64, switched=False)


def split_repays(
    total_key_rows: int,
    rank_rows: list[int],
    link: MergeLink = XGMI_GFX950,
    narrow: bool = False,
    key_split_owners: list[int] | None = None,
) -> bool:
    """Whether splitting a step of ``total_key_rows`` into ranks of
    ``rank_rows`` prefill rows saves more than its merge and exchange and
    MIN_SPLIT_GAIN of the replicated op besides."""
    if total_key_rows < MIN_SPLIT_KEY_ROWS:
        return False
    rank = total_key_rows * (1 + SPLIT_OVERHEAD) / len(rank_rows)
    links = links_key_rows(link, rank_rows, narrow, key_split_owners)
    return rank + links <= (1 - MIN_SPLIT_GAIN) * total_key_rows


def links_key_rows(
    link: MergeLink,
    rank_rows: list[int],
    narrow: bool,
    key_split_owners: list[int] | None = None,
) -> float:
    """The merge of ``rank_rows`` and the exchange of the key-split rows'
    candidates to their owners, as key-rows of the op."""
    ms = link.merge_ms(rank_rows, NARROW_ROW_BYTES if narrow else MERGED_ROW_BYTES)
    if key_split_owners and any(key_split_owners):
        ms += link.exchange_ms(key_split_owners, CANDIDATE_ROW_BYTES)
    return ms * 1e6 / NS_PER_KEY_ROW


# Where the prefill logits kernel fills the chunk's whole [rows, keys] output
# with -inf (gfx942), each row also costs its chunk's key width: on a fresh
# prompt the early rows, cheap by key count, are as wide as the last. One
# filled element is taken as 1/LOGITS_FILL_DIVISOR of a scored key-row, an
# estimate from MI355X's peak figures, not a measurement.
LOGITS_FILL_DIVISOR = 8
# Each row's fixed cost, in key-rows: what it costs besides its keys (its
# top-k's program and its k indices written).
ROW_COST_KEYS = 700
# Each logits and top-k call's fixed cost, in key-rows: a rank whose rows
# cross into another run of chunks pays a second call.
CALL_COST_KEYS = 2_600_000
# The logits' floor. AITER's gfx950 logits run one program per row
# (ROCm/aiter aiter/ops/triton/attention/fp8_mqa_logits.py at e4048607,
# L206 and L228: a grid of cdiv(rows, block_m), one or two rows a program,
# each walking its row's keys), so a call lasts at least as long as its
# longest row, however few rows it has: a rank holding a sliver of a long
# turn pays as if it held as many rows as the GPU scores at once,
# WAVE_ROWS_PER_CU per compute unit. The floor weighs on LOGITS_SHARE of a
# key-row's cost, which also stands for the top-k's own floor.
WAVE_ROWS_PER_CU = 1.8
LOGITS_SHARE = 0.48


# Key split. A request whose rows are long (a new turn over a long cached
# prefix) is scored by every rank over the r-th of tp equal parts of each
# row's keys; each rank sends its part's top-k with their scores to the
# row's owner (one all_to_all), which selects the row's top-k from them
# (``rocm_cp_indexer_merge``): no rank holds a sliver of a long row under
# its floor. Candidates: requests whose rows reach
# KEY_SPLIT_MIN_KEYS_PER_RANK keys a rank (``key_split_candidates``), in
# steps of KEY_SPLIT_MIN_STEP_KEY_ROWS at least (below that the key-split
# calls' host work does not repay). Their memory is bounded by the logits
# budget: what a rank sends, CANDIDATE_ROW_BYTES a row, while a call's
# logits are alive (``key_split_max_rows``), and what an owner receives
# after they are freed (``key_split_max_owned``); the profiling run
# reserves the first (``rocm_cp_indexer.profile_bytes``). Not where the
# logits fill their chunk (gfx942): every rank would fill every row. A
# candidate costs CANDIDATE_COST_KEYS of a key-row (an estimate).
KEY_SPLIT_MIN_KEYS_PER_RANK = 2 * TOPK
KEY_SPLIT_MIN_STEP_KEY_ROWS = 50_000_000
KEY_SPLIT_MAX_ROWS = 2048
KEY_SPLIT_MAX_REQUESTS = 8
CANDIDATE_COST_KEYS = 0.25
# Off: every candidate request is key-split (the host bench's --key-split-all).
KEY_SPLIT_BY_MODEL = True


# How the ranks share a step's rows. "cost": one contiguous range each, cut
# by modelled cost (``rocm_cp_indexer_cuts``). "zigzag": each request's rows
# in 2 tp equal blocks, rank r taking blocks r and 2 tp - 1 - r (as SGLang's
# NSA context parallel splits a sequence), so each pair costs about the
# same, with no cost model; requests whose longest row binds are key-split.
ROW_LAYOUT = "cost"


@dataclass(frozen=True)
class CPIndexerSplit:
    """Each TP rank's share of one step's prefill rows, the same on every
    rank: rank r scores batch rows ``bounds[r]:bounds[r + 1]`` (with
    ``order``, the rows ``order`` lists at those places), but for the rows
    of ``key_split`` (batch row ranges), which every rank scores over its
    part of their keys and their owner selects (``owned_places``): the rank
    whose range holds the row, or with ``order`` rank r the r-th of tp equal
    blocks of them, at the end of its places."""

    bounds: tuple[int, ...]
    key_split: tuple[tuple[int, int], ...] = ()
    # The batch rows in the ranks' order, on the host; None: batch order.
    order: torch.Tensor | None = None

    @property
    def key_split_rows(self) -> int:
        return sum(end - start for start, end in self.key_split)

    def owned_key_split(self, rank: int) -> list[tuple[int, int]]:
        """The key-split rows in rank ``rank``'s range, which it selects and
        merges (batch row ranges)."""
        first, last = self.rows_of(rank)
        return [
            (max(start, first), min(end, last))
            for start, end in self.key_split
            if start < last and end > first
        ]

    @property
    def key_split_owners(self) -> list[int]:
        """Each rank's count of key-split rows it owns."""
        tp_size = len(self.bounds) - 1
        if self.order is not None:
            return even_blocks(self.key_split_rows, tp_size)
        return [
            sum(end - start for start, end in self.owned_key_split(rank))
            for rank in range(tp_size)
        ]

    def owned_places(self, rank: int) -> list[tuple[int, int]]:
        """The rows of the top-k buffer where rank ``rank`` selects its
        key-split rows, in their order: the rows themselves, or with
        ``order`` its last places."""
        if self.order is None:
            return joined(self.owned_key_split(rank))
        end = self.bounds[rank + 1]
        return [(end - self.key_split_owners[rank], end)]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def rows_of(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]


def prefill_row_key_counts(
    seq_lens_cpu: torch.Tensor, query_lens_cpu: torch.Tensor, compress_ratio: int
) -> torch.Tensor:
    """Each prefill row's causal key count, in batch row order: row t of a
    request with S tokens and Q new ones sees (S - Q + 1 + t) // ratio keys,
    the bound the builder gives its chunk's ``cu_seqlen_ke``."""
    query_lens = query_lens_cpu.to(torch.int64)
    request, place = _rows_of_requests(query_lens)
    first_key = seq_lens_cpu.to(torch.int64) - query_lens + 1
    return (first_key[request] + place) // compress_ratio


def _rows_of_requests(query_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prefill row's request (its index) and its place in it, in batch
    row order, for requests of ``query_lens`` rows (int64)."""
    request = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    return request, torch.arange(request.numel()) - starts[request]


def prefill_row_costs(
    seq_lens_cpu: torch.Tensor,
    query_lens_cpu: torch.Tensor,
    compress_ratio: int,
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
    num_decode_tokens: int,
    fill_divisor: int | None = LOGITS_FILL_DIVISOR,
    row_cost_keys: int = ROW_COST_KEYS,
) -> torch.Tensor:
    """Each prefill row's cost in key-rows after the decodes: its key count,
    its fixed cost and, where the logits are filled, its chunk's fill."""
    costs = (
        prefill_row_key_counts(seq_lens_cpu, query_lens_cpu, compress_ratio)
        + row_cost_keys
    )
    if fill_divisor is None:
        return costs
    for chunk in chunks:
        first = chunk.token_start - num_decode_tokens
        last = chunk.token_end - num_decode_tokens
        costs[first:last] += chunk.total_seq_lens // fill_divisor
    return costs


def plan_cp_indexer_split(
    tp_size: int,
    num_decode_tokens: int,
    seq_lens_cpu: torch.Tensor,
    query_lens_cpu: torch.Tensor,
    compress_ratio: int,
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
    fill_divisor: int | None = LOGITS_FILL_DIVISOR,
    row_cost_keys: int = ROW_COST_KEYS,
    call_cost_keys: int = CALL_COST_KEYS,
    wave_rows: int = 0,
    link: MergeLink = XGMI_GFX950,
    key_split_max_rows: int = KEY_SPLIT_MAX_ROWS,
    key_split_max_owned: int = KEY_SPLIT_MAX_ROWS,
) -> CPIndexerSplit | None:
    """This step's split of the prefill rows after the decodes, or None to
    score them replicated where the split would not repay its merge over
    ``link`` (``split_repays``). Every rank calls it with the same host
    inputs, so every rank takes the same decision and the merge matches."""
    costs = prefill_row_costs(
        seq_lens_cpu,
        query_lens_cpu,
        compress_ratio,
        chunks,
        num_decode_tokens,
        fill_divisor,
        row_cost_keys,
    )
    num_rows = costs.numel()
    if num_rows < tp_size:
        return None
    total = int(costs.sum())
    keys = prefill_row_key_counts(seq_lens_cpu, query_lens_cpu, compress_ratio)
    # As ``travels_narrow`` decides it from the chunks' longest sequences.
    narrow = int(keys.max()) < NARROW_KEYS
    # No split merges less than an even one: a step that would not repay
    # that is left before it is planned.
    if not split_repays(total, [num_rows // tp_size] * tp_size, link, narrow):
        return None
    key_splits = (
        fill_divisor is None
        and key_split_max_rows
        and total >= KEY_SPLIT_MIN_STEP_KEY_ROWS
    )
    if ROW_LAYOUT == "zigzag":
        key_split: tuple[tuple[int, int], ...] = ()
        if key_splits:
            key_split = binding_requests(
                keys, query_lens_cpu, tp_size, wave_rows,
                key_split_max_rows, key_split_max_owned,
            )  # fmt: skip
        split = zigzag_split(tp_size, num_decode_tokens, query_lens_cpu, key_split)
        owners = split.key_split_owners
        return split if split_repays(total, split.sizes, link, narrow, owners) else None
    runs = shared_key_runs(chunks, num_decode_tokens)
    planned = RowPlanner(
        costs, query_lens_cpu, runs, tp_size, call_cost_keys, wave_rows,
        logits_share=LOGITS_SHARE,
    )  # fmt: skip
    bounds = planned.bounds()
    key_split = ()
    if key_splits:
        bounds, key_split = _key_split_plan(
            planned, keys, query_lens_cpu, row_cost_keys, link, narrow,
            key_split_max_rows, key_split_max_owned, bounds,
        )  # fmt: skip
    split = CPIndexerSplit(
        tuple(num_decode_tokens + b for b in bounds),
        tuple((num_decode_tokens + a, num_decode_tokens + b) for a, b in key_split),
    )
    repays = split_repays(total, split.sizes, link, narrow, split.key_split_owners)
    return split if repays else None


def zigzag_split(
    tp_size: int,
    num_decode_tokens: int,
    query_lens_cpu: torch.Tensor,
    key_split: tuple[tuple[int, int], ...] = (),
) -> CPIndexerSplit:
    """Each request's rows in 2 tp equal blocks, block b going to rank b, or
    2 tp - 1 - b in the second half, turned by the request's index so that
    short requests spread. The rows of ``key_split`` (prefill row ranges)
    are owned in tp equal blocks, each rank's after its other rows. Where a
    rank would get no row, the rows go round the ranks, none key-split."""
    query_lens = query_lens_cpu.to(torch.int64)
    request, place = _rows_of_requests(query_lens)
    num_rows = request.numel()
    row = torch.arange(num_rows)
    block = place * (2 * tp_size) // query_lens[request]
    pair = torch.where(block < tp_size, block, 2 * tp_size - 1 - block)
    rank = (pair + request) % tp_size
    owned = torch.zeros(num_rows, dtype=torch.int64)
    for start, end in key_split:
        owned[start:end] = 1
    blocks = torch.tensor(even_blocks(int(owned.sum()), tp_size))
    rank[owned == 1] = torch.repeat_interleave(torch.arange(tp_size), blocks)
    counts = torch.bincount(rank, minlength=tp_size)
    if int(counts.min()) == 0:
        rank, key_split = row % tp_size, ()
        owned.zero_()
        counts = torch.bincount(rank, minlength=tp_size)
    order = torch.argsort((2 * rank + owned) * num_rows + row) + num_decode_tokens
    bounds = [
        num_decode_tokens,
        *(num_decode_tokens + torch.cumsum(counts, 0)).tolist(),
    ]
    return CPIndexerSplit(
        tuple(bounds),
        tuple((num_decode_tokens + a, num_decode_tokens + b) for a, b in key_split),
        order=order,
    )


def even_blocks(rows: int, tp_size: int) -> list[int]:
    """``rows`` in tp blocks of equal size, to a row: each block's rows."""
    return [rows * (r + 1) // tp_size - rows * r // tp_size for r in range(tp_size)]


def binding_requests(
    keys: torch.Tensor,
    query_lens_cpu: torch.Tensor,
    tp_size: int,
    wave_rows: int,
    max_rows: int,
    max_owned: int,
) -> tuple[tuple[int, int], ...]:
    """The requests a zigzag split key-splits (prefill row ranges): of
    ``key_split_candidates``, longest first, each whose longest row binds (a
    wave of it outlasts a rank's even share of the keys of the rows left
    whole), no rank owning more than ``max_owned`` of their rows."""
    whole = int(keys.sum())
    chosen: list[tuple[int, int]] = []
    rows = 0
    for start, end in key_split_candidates(keys, query_lens_cpu, tp_size, max_rows):
        if wave_rows * int(keys[end - 1]) <= whole / tp_size:
            break
        if -(-(rows + end - start) // tp_size) > max_owned:
            break
        chosen.append((start, end))
        rows += end - start
        whole -= int(keys[start:end].sum())
    return tuple(sorted(chosen))


def travels_narrow(chunks: list[DeepseekV32IndexerPrefillChunkMetadata]) -> bool:
    """Whether the merge sends the step's rows as int16 (a host bound)."""
    return max(chunk.max_seqlen_k for chunk in chunks) < NARROW_KEYS


def _key_split_plan(
    planned: RowPlanner,
    keys: torch.Tensor,
    query_lens_cpu: torch.Tensor,
    row_cost_keys: int,
    link: MergeLink,
    narrow: bool,
    max_rows: int,
    max_owned: int,
    whole_rows: list[int],
) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The cuts and key-split requests of the least costly plan, in key-rows
    per rank: the cuts (a key-split row costs its owner its select), every
    rank's part of the key-split rows, and the merge and exchange on
    ``link``. Tried: none (``whole_rows``), then the candidates one more at
    a time (all of them with KEY_SPLIT_BY_MODEL off), none whose owner would
    pass ``max_owned``."""
    tp_size = planned.tp_size
    eligible = key_split_candidates(keys, query_lens_cpu, tp_size, max_rows)
    owned = owned_row_cost(tp_size)

    def plan_of(
        chosen: list[tuple[int, int]], below: float = float("inf"), bounds=None
    ) -> tuple[float, list[int]]:
        """The modelled cost and cuts; infinite past the owners' cap, or where
        an even share already reaches ``below``, which no rank costs less."""
        costs = planned.costs.clone()
        for start, end in chosen:
            costs[start:end] = owned
        key_split_cost = _key_split_cost(chosen, keys, planned, row_cost_keys)
        if int(costs.sum()) / tp_size + key_split_cost >= below:
            return float("inf"), []
        key_split = tuple(sorted(chosen))
        if bounds is None:
            bounds = planned.bounds(costs, key_split)
        split = CPIndexerSplit(tuple(bounds), key_split)
        cost = (
            max(planned.rank_cost(costs, key_split).of(bounds))
            + key_split_cost
            + links_key_rows(link, split.sizes, narrow, split.key_split_owners)
        )
        if max(split.key_split_owners) > max_owned:
            cost = float("inf")
        return cost, bounds

    best, best_bounds = plan_of([], bounds=whole_rows)
    if not KEY_SPLIT_BY_MODEL:
        cost, bounds = plan_of(eligible)
        if cost < float("inf"):
            return bounds, tuple(sorted(eligible))
        return best_bounds, ()
    best_split: list[tuple[int, int]] = []
    for count in range(1, len(eligible) + 1):
        cost, bounds = plan_of(eligible[:count], below=best)
        if cost < best:
            best, best_bounds, best_split = cost, bounds, eligible[:count]
    return best_bounds, tuple(sorted(best_split))


def key_split_candidates(
    keys: torch.Tensor, query_lens_cpu: torch.Tensor, tp_size: int, max_rows: int
) -> list[tuple[int, int]]:
    """The requests a step may key-split (prefill row ranges), longest rows
    first: those whose rows reach KEY_SPLIT_MIN_KEYS_PER_RANK keys a rank,
    KEY_SPLIT_MAX_REQUESTS at most, within ``max_rows`` rows in all."""
    ends = torch.cumsum(query_lens_cpu.to(torch.int64), 0).tolist()
    requests = [(end - q, end) for end, q in zip(ends, query_lens_cpu.tolist()) if q]
    longest_first = sorted(
        (r for r in requests
         if int(keys[r[1] - 1]) >= tp_size * KEY_SPLIT_MIN_KEYS_PER_RANK),
        key=lambda r: -int(keys[r[1] - 1]),
    )  # fmt: skip
    chosen: list[tuple[int, int]] = []
    for start, end in longest_first[:KEY_SPLIT_MAX_REQUESTS]:
        if sum(b - a for a, b in chosen) + end - start > max_rows:
            break
        chosen.append((start, end))
    return chosen


def owned_row_cost(tp_size: int) -> int:
    """What a key-split row costs the rank that owns it, in key-rows: the
    select over every rank's candidates (``CANDIDATE_COST_KEYS`` each)."""
    return int(tp_size * TOPK * CANDIDATE_COST_KEYS)


def _key_split_cost(
    chosen: list[tuple[int, int]],
    keys: torch.Tensor,
    planned: RowPlanner,
    row_cost_keys: int,
) -> float:
    """What each rank's part of the key-split rows ``chosen`` costs, in
    key-rows: a tp-th of each row's keys, each row's fixed cost and its
    candidates, and each call, at least its floor."""
    tp_size = planned.tp_size
    before = [0, *accumulate(keys.tolist())]
    # Its top-k and the scores it keeps; the owner's select is in its cuts.
    per_row = row_cost_keys + TOPK * CANDIDATE_COST_KEYS
    cost = 0.0
    for call in key_split_calls(planned.runs, chosen):
        first, last = call.first, call.last
        work = (before[last] - before[first]) / tp_size
        cost += work + (last - first) * per_row + planned.call_cost_keys
        if planned.wave_rows:
            floor = planned.wave_rows * int(keys[last - 1]) / tp_size
            cost += LOGITS_SHARE * max(0.0, floor - work)
    return cost


@dataclass(frozen=True)
class CPIndexerPlanner:
    """The settings every step's split is planned with, fixed at startup."""

    tp_size: int
    # None where the logits kernel does not fill its chunk.
    fill_divisor: int | None = None
    row_cost_keys: int = ROW_COST_KEYS
    call_cost_keys: int = CALL_COST_KEYS
    # The rows the GPU scores at once (WAVE_ROWS_PER_CU per compute unit).
    wave_rows: int = 0
    link: MergeLink = XGMI_GFX950
    # The most rows a step key-splits (0: none), and one rank owns.
    key_split_max_rows: int = KEY_SPLIT_MAX_ROWS
    key_split_max_owned: int = KEY_SPLIT_MAX_ROWS

    def plan(
        self,
        num_decode_tokens: int,
        seq_lens_cpu: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        compress_ratio: int,
        chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
    ) -> CPIndexerSplit | None:
        """This step's split (``plan_cp_indexer_split``)."""
        return plan_cp_indexer_split(
            self.tp_size,
            num_decode_tokens,
            seq_lens_cpu,
            query_lens_cpu,
            compress_ratio,
            chunks,
            self.fill_divisor,
            self.row_cost_keys,
            self.call_cost_keys,
            self.wave_rows,
            self.link,
            self.key_split_max_rows,
            self.key_split_max_owned,
        )


def key_split_max_rows(logits_bytes: int) -> int:
    """KEY_SPLIT_MAX_ROWS, or fewer where the candidates a rank sends, kept
    while a call's logits are alive, would pass a sixteenth of the budget."""
    return min(KEY_SPLIT_MAX_ROWS, logits_bytes // (16 * CANDIDATE_ROW_BYTES))


def key_split_max_owned(logits_bytes: int, tp_size: int) -> int:
    """The most key-split rows one rank may own: every rank's candidates of
    each, received after the logits are freed, within the logits budget."""
    return min(KEY_SPLIT_MAX_ROWS, logits_bytes // (tp_size * CANDIDATE_ROW_BYTES))
