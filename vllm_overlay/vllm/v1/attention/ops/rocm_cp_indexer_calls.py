# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The logits and top-k calls a TP rank makes for its share of a step's
prefill rows (``rocm_cp_indexer_plan.CPIndexerSplit``): per run of chunks
over the same keys, its whole rows in as few equal calls as the run's
largest chunk allows, then the key-split rows. The op makes exactly these
calls (``CPIndexerPrefill.windows``) and the planner prices them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillChunkMetadata,
    )


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
