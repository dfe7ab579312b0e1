# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plan of stage 0001's split: each TP rank's contiguous range of a
step's prefill rows, cut where the rows' cumulative cost crosses each
rank's share, and whether the split repays its merge at all.

The ranges are balanced by cost, not by row count: a row costs its causal
key count, which the metadata builder knows on the host (sequence and query
lengths), and a new chat turn over a long cached prefix costs 10-100x a
fresh prompt's row. A row also costs a fixed part (``ROW_COST_KEYS``: its
top-k's own work and output), and on gfx942 its chunk's whole key width,
which the logits kernel fills with -inf (``LOGITS_FILL_DIVISOR``). A rank
whose rows span two runs of chunks pays a second call (``CALL_COST_KEYS``),
and a call's logits last at least as long as its costliest row (one program
per row), so they cost at least a wave of that row (``WAVE_ROWS_PER_CU``:
the rows the GPU scores at once). Where the cuts leave the ranks' calls
unlike, or a rank a call below that floor, such as a sliver of a long turn,
they are found again with calls and floors counted. A step whose split
would not repay its merge over the TP group's link (``split_repays``) stays
replicated and does not merge.

The plan is made once per step by the indexer metadata builder, from host
integers, identically on every rank (``CPIndexerPlanner.plan``).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillChunkMetadata,
    )


# Whether a step splits (``split_repays``): the split must save more than
# the merge costs and MIN_SPLIT_GAIN of the replicated op besides, on the
# TP group's link, and the step must cost MIN_SPLIT_KEY_ROWS at least. Below
# that a call is mostly host work, which the split does not shrink. Each
# rank's share costs 1 + SPLIT_OVERHEAD of an even share of the op (work
# every rank repeats and imbalance). All in key-rows, as
# ``prefill_row_costs`` counts them; the merge's milliseconds become
# key-rows at NS_PER_KEY_ROW, the op's time per key-row. Calibrated with
# Triton stand-ins of AITER's kernels on one H100 over 36 serving steps at
# tp 2, 4 and 8: a step of 5.9M key-rows lost split, one of 7.7M gained on
# every link and tp; the shares' GPU times summed to a median 1.05x, 1.11x
# and 1.26x the replicated op's at tp 2, 4 and 8; 0.068-0.085 ns a key-row.
# On 36 steps it was not fitted to, 101 of 108 step-tps came out right,
# none split slower than replicated: under about 8M key-rows the host's
# speed decides. MI355X's kernels move all of these (measure them there).
MIN_SPLIT_KEY_ROWS = 7_000_000
MIN_SPLIT_GAIN = 0.075
SPLIT_OVERHEAD = 0.15
NS_PER_KEY_ROW = 0.072
# The merge gathers every row's top-k indices (2,048 int32 for
# DeepSeek-V3.2 and GLM-5.x) into every rank; int16 where every row has
# fewer than NARROW_KEYS keys (``rocm_cp_indexer_merge``).
TOPK = 2048
MERGED_ROW_BYTES = TOPK * 4
NARROW_ROW_BYTES = TOPK * 2
# A key-split row's candidates from one rank: k indices and k float32 scores.
CANDIDATE_ROW_BYTES = TOPK * 8
# Rows whose keys are fewer than this travel narrow: each row-local index,
# and -1, fits in 16 bits.
NARROW_KEYS = (1 << 16) - 1


@dataclass(frozen=True)
class MergeLink:
    """The TP group's link, as the merge's all_gatherv uses it: a latency
    and a rate one way, either through one port per GPU to a switch (a rank
    receives all other ranks' rows through it) or over one link per pair of
    GPUs (a rank receives each peer's rows on its own link, at once)."""

    latency_ms: float
    gb_per_s: float
    switched: bool

    def merge_ms(
        self, rank_rows: list[int], row_bytes: int = MERGED_ROW_BYTES
    ) -> float:
        """The all_gatherv of ranks holding ``rank_rows`` rows of
        ``row_bytes`` each: the rank that receives the most through its
        port, or the link that carries the largest rank's rows."""
        received = sum(rank_rows) - min(rank_rows) if self.switched else max(rank_rows)
        return self.latency_ms + received * row_bytes / (self.gb_per_s * 1e6)

    def exchange_ms(self, owned_rows: list[int], row_bytes: int) -> float:
        """The all_to_all of every rank's ``row_bytes`` rows to their owners
        (``owned_rows`` each): the owner that receives the most through its
        port, or the link that carries the most rows to one owner."""
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
    """Whether a split of a step costing ``total_key_rows`` in all, whose
    ranks hold ``rank_rows`` prefill rows each, saves more than its merge
    and exchange cost and MIN_SPLIT_GAIN of the replicated op besides (the
    costliest rank taken as ``1 + SPLIT_OVERHEAD`` times an even share)."""
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
    """The merge of ``rank_rows`` (``narrow`` or not) and the exchange of
    the key-split rows' candidates to the ranks that own them
    (``key_split_owners`` rows each), as key-rows of the op
    (``NS_PER_KEY_ROW``)."""
    ms = link.merge_ms(rank_rows, NARROW_ROW_BYTES if narrow else MERGED_ROW_BYTES)
    if key_split_owners and any(key_split_owners):
        ms += link.exchange_ms(key_split_owners, CANDIDATE_ROW_BYTES)
    return ms * 1e6 / NS_PER_KEY_ROW


# Where the prefill logits kernel fills the chunk's whole [rows, keys] output
# with -inf (``_logits_fill_their_chunk``: gfx942), each row also costs its
# chunk's key width, not only its own key range: on a fresh prompt the early
# rows, cheap by key count, are as wide as the last. On gfx950 vLLM asks for
# no fill, and a row costs its keys.
# One filled element is taken as 1/LOGITS_FILL_DIVISOR of a scored key-row:
# an estimate from MI355X's peak figures (a 4-byte store at ~6 TB/s against
# 32 heads x 128 dims of fp8 MFMA, the logits store and the top-k's read per
# key-row; GLM-5.x's 32 heads, where the fill weighs most: about 1/13 at
# DeepSeek-V3.2's 64), not a measurement.
LOGITS_FILL_DIVISOR = 8
# Each row's fixed cost, in key-rows: what it costs besides its keys (its
# top-k's program and its k indices written). Fitted on one H200 with Triton
# stand-ins of AITER's prefill logits and per-row top-k (time = a key-rows +
# b rows + c per call; b / a from 591 to 839 in four runs). With the logits
# stand-in on AITER's grid (one program per row) the fit gives 129, yet 700
# still balances a fresh 16K prompt better on the whole op (1.02 against
# 1.05 at tp 2). Not fitted on MI355X: AITER's top-k on many short rows, or
# a faster logits kernel, would raise it there.
ROW_COST_KEYS = 700
# Each logits and top-k call's fixed cost, in key-rows: a rank whose rows
# cross into another run of chunks pays a second call
# (``CPIndexerPrefill.windows``). Fitted with ``ROW_COST_KEYS``, as c / a
# (130-180 us a call against 0.06-0.07 ns a key-row: 2.2M-3.0M in four runs);
# the same caveats.
CALL_COST_KEYS = 2_600_000
# The logits' floor. AITER's gfx950 logits run one program per row
# (ROCm/aiter aiter/ops/triton/attention/fp8_mqa_logits.py at e4048607,
# L206 and L228: a grid of cdiv(rows, block_m), one or two rows a program,
# each walking its row's keys), so they last at least as long as their
# call's longest row, however few rows it has: a rank holding a sliver of a
# long turn pays as if it held as many rows as the GPU scores at once. That
# is WAVE_ROWS_PER_CU rows per compute unit: one row's time over a row's
# time at full occupancy (on one H200 with the stand-ins, 1.6 ms for 33 to
# 132 rows of 200K keys alike, against 0.033 ns a key-row: 1.8). The floor
# weighs on LOGITS_SHARE of a key-row's cost, the logits' share of it
# (0.47-0.48). AITER's one-block top-k, which it takes for every call of
# over 128 rows and for narrower ones (should_use_mulblocks), has a floor
# of its own (on the H200, 103 rows of 100K keys: 0.82 ms of top-k beside
# 0.74 ms of logits); yet fitted to the whole op's per-rank times on the
# host bench, the floor weighs about 0.5 of a key-row's cost, so this one
# share stands for both. Neither is measured on MI355X, where AITER's
# kernels set them; on the H200 a wave twice too large did worse than none
# on some steps, half of it about as well as this one.
WAVE_ROWS_PER_CU = 1.8
LOGITS_SHARE = 0.48


# Key split. A request whose rows are long (a new turn over a long cached
# prefix) is scored by every rank over its own part of each row's keys, the
# r-th of tp equal parts; each rank keeps its part's top-k with their
# scores, sends each row's to the rank whose range holds the row (one
# all_to_all), and that rank selects the row's top-k from them
# (``rocm_cp_indexer_merge``), which the merge then carries as its own. A
# rank's calls then hold all such rows, each a tp-th as long: no floor of
# one long row, no wave of few long rows, the same work on every rank. Each
# rank pays their fixed row cost and a call per run; their candidates
# travel once, and each key-split call adds host work (its key ranges, its
# candidates), which steps under KEY_SPLIT_MIN_STEP_KEY_ROWS do not repay
# (on one H100 with the stand-ins, steps of 12-19M key-rows took 1.2-1.7 ms
# of host time key-split, against 0.5-0.9 ms replicated). Candidates:
# requests whose rows reach KEY_SPLIT_MIN_KEYS_PER_RANK keys a rank
# (``key_split_candidates``), at most KEY_SPLIT_MAX_ROWS rows in all. Their
# memory is bounded by the logits budget: the candidates a rank sends,
# CANDIDATE_ROW_BYTES a row, are kept while one call's logits are alive, at
# most a sixteenth of the budget (``key_split_max_rows``: 32 MiB); what an
# owner receives, that much from every rank for each row it owns, comes
# after the logits are freed, within the budget (``key_split_max_owned``);
# the profiling run reserves the first beside the logits
# (``rocm_cp_indexer.profile_bytes``). The planner key-splits as many of
# them, longest rows first, as lower its modelled step and keep every
# owner within its cap (``_key_split_plan``). Not where
# the logits fill their chunk (gfx942): every rank would fill every row. A
# candidate costs CANDIDATE_COST_KEYS of a key-row (an estimate; the host
# bench times the select and the scores).
KEY_SPLIT_MIN_KEYS_PER_RANK = 2 * TOPK
KEY_SPLIT_MIN_STEP_KEY_ROWS = 50_000_000
KEY_SPLIT_MAX_ROWS = 2048
KEY_SPLIT_MAX_REQUESTS = 8
CANDIDATE_COST_KEYS = 0.25
# Off: every candidate request is key-split, model or not (the host bench's
# --key-split-all, which measured that policy worse).
KEY_SPLIT_BY_MODEL = True


# How the ranks share a step's rows. "cost": one contiguous range each, cut
# where the rows' modelled cost crosses each rank's share (``RowPlanner``).
# "zigzag": each request's rows in 2 tp equal blocks, rank r taking blocks r
# and 2 tp - 1 - r (as SGLang's NSA context parallel splits a sequence): a
# causal row costs its prefix and its place in the request, so each pair
# costs about the same, with no cost model. There the requests whose
# longest row binds (``binding_requests``: a wave of it outlasts a rank's
# even share of the rows left whole) are key-split, and their rows owned in
# tp equal blocks. The host bench's --zigzag times both on the same steps.
ROW_LAYOUT = "cost"


@dataclass(frozen=True)
class CPIndexerSplit:
    """Each TP rank's share of one step's prefill rows (the same on every
    rank): rank r scores batch rows ``bounds[r]:bounds[r + 1]``, or with
    ``order`` (a zigzag layout) the batch rows ``order`` lists at those
    places, counted from ``bounds[0]``; but for the rows of ``key_split``
    (batch row ranges, one per request): every rank scores those over its
    part of their keys, and the rank that owns such a row selects its top-k
    (``owned_places``), which the merge then carries as that rank's own.
    The owner is the rank whose range holds the row, or with ``order`` the
    r-th of tp equal blocks of the key-split rows, at the end of rank r's
    places."""

    bounds: tuple[int, ...]
    key_split: tuple[tuple[int, int], ...] = ()
    # The prefill's batch rows in the ranks' order (rank 0's, then rank
    # 1's, each rank's in batch order), on the host; None: in batch order.
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
    """Each prefill row's cost in key-rows, in batch row order after the
    decodes: its key count, its fixed cost (``row_cost_keys``) and, where the
    logits are filled (``fill_divisor``), its part of its chunk's -inf fill
    (a row in no chunk, which has no compressed key, has no fill)."""
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
    """This step's split of the prefill rows (the requests' sequence and
    query lengths, on the host, after the decodes; the builder's chunks of
    them), or None to score them replicated, when the split would not repay
    its merge over ``link`` (``split_repays``). In a step of at least
    KEY_SPLIT_MIN_STEP_KEY_ROWS, requests with long rows are key-split
    where that lowers the modelled step (``_key_split_plan``; none with
    ``key_split_max_rows`` 0), no rank owning more than
    ``key_split_max_owned`` of their rows.

    Called by the indexer metadata builder on every rank with the same host
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
        costs, query_lens_cpu, runs, tp_size, call_cost_keys, wave_rows
    )
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
    """Each request's rows (``query_lens_cpu``, after the ``num_decode_tokens``
    decodes) in 2 tp blocks of equal size (to a row), block b going to rank
    b, or 2 tp - 1 - b for the second half, turned by the request's index so
    that short requests' rows spread over the ranks. The rows of
    ``key_split`` (prefill row ranges, sorted) are owned in tp equal blocks
    of them, rank r's after its other rows. Where that leaves a rank no row
    (a step of few short requests), the rows go round the ranks one by one,
    none key-split."""
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
    """The requests a zigzag split key-splits (prefill row ranges, sorted):
    of ``key_split_candidates``, longest rows first, each whose longest row
    binds: a wave of it (``wave_rows`` times its keys) outlasts a rank's
    even share of the keys of the rows left whole, where a rank's call of
    those rows would last as long as that floor. No rank owns more than
    ``max_owned`` of their rows."""
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
    """Whether the merge sends the step's rows as int16: every chunk's rows
    have fewer than NARROW_KEYS keys (its longest sequence, a host bound)."""
    return max(chunk.max_seqlen_k for chunk in chunks) < NARROW_KEYS


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
    ):
        self.costs = costs
        self.query_lens_cpu = query_lens_cpu
        self.runs = runs
        self.tp_size = tp_size
        self.call_cost_keys = call_cost_keys
        self.wave_rows = wave_rows

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
    """The cuts and key-split requests (prefill row ranges) of the least
    costly plan, modelled per rank in key-rows: the cuts of the rows
    (``RowPlanner``; a key-split row costs its owner only its select,
    ``owned_row_cost``), every rank's part of the key-split rows
    (``_key_split_cost``), and the merge and exchange on ``link``. Tried:
    none (the cuts ``whole_rows``), then the requests with the longest rows,
    one more each time; with KEY_SPLIT_BY_MODEL off, all of them
    (``key_split_candidates``). A plan where a rank would own more than
    ``max_owned`` key-split rows is not taken."""
    tp_size = planned.tp_size
    eligible = key_split_candidates(keys, query_lens_cpu, tp_size, max_rows)
    owned = owned_row_cost(tp_size)

    def plan_of(
        chosen: list[tuple[int, int]], below: float = float("inf"), bounds=None
    ) -> tuple[float, list[int]]:
        """The modelled cost (infinite past the owners' cap) and cuts; not
        made (an infinite cost) where an even share of the rows' own cost
        and the key-split rows' cost are ``below`` already: the costliest
        rank costs at least that share, so the plan could not beat it."""
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
    """What each rank's part of the key-split rows ``chosen`` (prefill row
    ranges) costs, in key-rows: a tp-th of each row's keys, each row's
    fixed cost and its candidates (``CANDIDATE_COST_KEYS``, the select's
    and the exchange's device work), and each call of a run
    (``key_split_calls``), at least its floor (``RankCost``)."""
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
class PlannedCall:
    """One logits and top-k call of a rank: rows ``first:last`` of the
    step's run of chunks number ``run`` (``runs_of_shared_keys``). Whole
    rows, or with ``candidate_row`` set, key-split rows over the rank's part
    of their keys, whose candidates go to rows ``candidate_row`` on of the
    rank's candidates (one row per key-split row of the step, in row
    order)."""

    run: int
    first: int
    last: int
    candidate_row: int | None = None


def rank_calls(
    start: int,
    end: int,
    runs: list[tuple[int, int, int]],
    key_split: tuple[tuple[int, int], ...] | list[tuple[int, int]],
) -> Iterator[PlannedCall]:
    """The calls of the rank whose range is rows ``start:end``, in the order
    it makes them: per run of chunks (``runs``: its first row, end and
    largest chunk's rows), its own rows of the run less the key-split rows
    (``whole_row_calls``), then every key-split row of the run
    (``key_split_calls``). The op makes exactly these calls
    (``CPIndexerPrefill.windows``) and the planner prices them."""
    holes = joined(key_split)
    for index in range(len(runs)):
        yield from whole_row_calls(index, runs, start, end, holes)
        yield from run_key_split_calls(index, runs, holes)


def whole_row_calls(
    index: int,
    runs: list[tuple[int, int, int]],
    start: int,
    end: int,
    holes: list[tuple[int, int]],
) -> Iterator[PlannedCall]:
    """The calls that score rows ``start:end`` of run ``index`` whole, less
    the key-split rows (``holes``, joined): each stretch between them in as
    few equal calls as the run's largest chunk allows."""
    first, last, most = runs[index]
    for a, b in _without(max(start, first), min(end, last), holes):
        for call_first, call_last in equal_calls(a, b, most):
            yield PlannedCall(index, call_first, call_last)


def key_split_calls(
    runs: list[tuple[int, int, int]],
    key_split: tuple[tuple[int, int], ...] | list[tuple[int, int]],
) -> Iterator[PlannedCall]:
    """The calls that score the key-split rows, the same on every rank."""
    holes = joined(key_split)
    for index in range(len(runs)):
        yield from run_key_split_calls(index, runs, holes)


def run_key_split_calls(
    index: int, runs: list[tuple[int, int, int]], holes: list[tuple[int, int]]
) -> Iterator[PlannedCall]:
    """Run ``index``'s key-split rows (``holes``, joined: next requests'
    together) in as few equal calls as its largest chunk allows, each with
    its first row's place among the step's key-split rows."""
    first, last, most = runs[index]
    for start, end in holes:
        for a, b in equal_calls(max(start, first), min(end, last), most):
            yield PlannedCall(index, a, b, _rows_before(holes, a))


def _rows_before(ranges: list[tuple[int, int]], row: int) -> int:
    """How many rows of ``ranges`` come before row ``row``."""
    return sum(min(end, row) - start for start, end in ranges if start < row)


def _without(start: int, end: int, holes) -> Iterator[tuple[int, int]]:
    """Rows ``start:end`` less the (sorted, disjoint) row ranges ``holes``."""
    for hole_start, hole_end in holes:
        if hole_start >= end:
            break
        if hole_end > start:
            if hole_start > start:
                yield start, hole_start
            start = max(start, hole_end)
    if start < end:
        yield start, end


def joined(ranges) -> list[tuple[int, int]]:
    """Row ranges, sorted, with the ones that touch joined: one call can
    score them together."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


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


def shared_key_runs(
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata], num_decode_tokens: int
) -> list[tuple[int, int, int]]:
    """Per run of chunks over the same keys (``runs_of_shared_keys``), in
    prefill rows: its first and last row and its largest chunk's rows, which
    bound each call's rows."""
    return [
        (run[0].token_start - num_decode_tokens,
         run[-1].token_end - num_decode_tokens,
         max(c.token_end - c.token_start for c in run))
        for run in runs_of_shared_keys(chunks)
    ]  # fmt: skip


def equal_calls(start: int, end: int, most: int) -> Iterator[tuple[int, int]]:
    """Rows ``start:end`` of one run in as few calls as ``most`` rows a call
    allows, of equal size."""
    rows = end - start
    calls = -(-rows // most)
    for call in range(calls):
        yield start + call * rows // calls, start + (call + 1) * rows // calls


class RankCost:
    """What a rank's rows cost as the planner counts it, in key-rows: each
    row's cost, each call the rank makes for its whole rows
    (``whole_row_calls``: not for its rows of ``key_split``, which every
    rank scores in calls of their own) at ``call_cost_keys``, and, where a
    call's rows cost less than one wave of its costliest row (``wave_rows``
    times it; 0: not counted), the logits' share of the difference
    (``LOGITS_SHARE``): with one program per row, the logits last at least
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
    ):
        # Host ints: a tensor index per call is slow.
        self.before = before.tolist()
        self.holes = joined(key_split)
        self.call_cost_keys = call_cost_keys
        self.wave_rows = wave_rows
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
                added += int(LOGITS_SHARE * max(0, floor - work))
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


@dataclass(frozen=True)
class CPIndexerPlanner:
    """The settings every step's split is planned with, fixed at startup."""

    tp_size: int
    # LOGITS_FILL_DIVISOR where the logits kernel fills its chunk, else None.
    fill_divisor: int | None = None
    row_cost_keys: int = ROW_COST_KEYS
    call_cost_keys: int = CALL_COST_KEYS
    # The rows the GPU scores at once (WAVE_ROWS_PER_CU per compute unit).
    wave_rows: int = 0
    # The TP group's link, which prices the merge.
    link: MergeLink = XGMI_GFX950
    # The most rows a step key-splits (``key_split_max_rows``; 0: none),
    # and one rank owns (``key_split_max_owned``).
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
    """KEY_SPLIT_MAX_ROWS, or fewer where the candidates a rank sends
    (CANDIDATE_ROW_BYTES a row, kept while a call's logits are alive) would
    pass a sixteenth of the logits budget ``logits_bytes``."""
    return min(KEY_SPLIT_MAX_ROWS, logits_bytes // (16 * CANDIDATE_ROW_BYTES))


def key_split_max_owned(logits_bytes: int, tp_size: int) -> int:
    """The most key-split rows one rank may own: it receives every rank's
    candidates of each (CANDIDATE_ROW_BYTES a row from each), after the
    logits are freed, within the logits budget ``logits_bytes``."""
    return min(KEY_SPLIT_MAX_ROWS, logits_bytes // (tp_size * CANDIDATE_ROW_BYTES))


def runs_of_shared_keys(
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
) -> list[list[DeepseekV32IndexerPrefillChunkMetadata]]:
    """The chunks grouped into runs that score the same keys: a chunk with
    ``skip_kv_gather`` is a later query slice of the previous chunk's
    requests (vLLM's builder slices requests too long for the logits
    budget), with the same keys laid out the same way."""
    runs: list[list[DeepseekV32IndexerPrefillChunkMetadata]] = []
    for chunk in chunks:
        if runs and chunk.skip_kv_gather:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs
