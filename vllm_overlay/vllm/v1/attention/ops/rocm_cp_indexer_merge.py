# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device side of stage 0001's merge: the exact top-k of a key-split
row from its ranks' candidates, and the narrow form of the rows the merge
gathers.

A key-split row is scored by every TP rank over its own range of the row's
keys; each rank keeps its range's top-k with their scores and sends them to
the row's owner (``candidate_columns(k)`` int32 a row: k row-local
indices, then k float32 scores as their bits). ``select_top_k`` takes the
row's top-k from the ``parts * k`` candidates: exactly k where the row has
k keys or more, its valid indices first and -1 after where it has fewer.
At a tie on the k-th score it keeps the first tied candidates in the
order of the parts (rank order, then position): the same candidates give
the same selection.

Rows whose keys are all below 65,535 travel narrow: their row-local
indices (and the -1 after a short row) fit in 16 bits
(``narrow_indices``, ``widen_indices``), half the bytes of int32.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import tl, triton


def candidate_columns(k: int) -> int:
    """One key-split row's candidates from one rank, in int32 columns: its
    k row-local indices, then their k scores' float32 bits."""
    return 2 * k


@triton.jit
def _ordered(bits):
    """A float32's bits (int32) as an int32 that orders as the float."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _candidate_keys(row_ptr, part_stride, at, K: tl.constexpr):
    """Candidates ``at`` (flat over the parts) of one row: their indices
    and ordered scores; a -1 candidate orders below every score."""
    part = at // K
    column = at % K
    where = row_ptr + part.to(tl.int64) * part_stride + column
    index = tl.load(where)
    key = _ordered(tl.load(where + K))
    return index, tl.where(index < 0, -2147483647 - 1, key)


@triton.jit
def _select_top_k_kernel(
    candidates_ptr,
    out_ptr,
    part_stride,
    row_stride,
    out_stride,
    parts,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = candidates_ptr + row.to(tl.int64) * row_stride
    total = parts * K
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    # The k-th largest key, one byte at a time from the top: ``prefix`` holds
    # its bytes found so far (under ``high``), ``wanted`` counts the keys
    # still to take among those that match them. The top byte's digit has
    # its sign bit flipped, so that digits order as the keys.
    prefix = tl.zeros((), dtype=tl.int32)
    high = tl.zeros((), dtype=tl.int32)
    wanted = K
    for byte in tl.static_range(4):
        shift = 24 - 8 * byte
        flip = 0x80 >> (8 * byte)
        counts = tl.zeros((256,), dtype=tl.int32)
        unmatched = 0
        for first in range(0, total, BLOCK):
            _, key = _candidate_keys(row_ptr, part_stride, first + lanes, K)
            matches = (key & high) == prefix
            digit = (((key >> shift) & 0xFF) ^ flip).to(tl.int32)
            counts += tl.histogram(tl.where(matches, digit, 0), 256)
            unmatched += tl.sum((~matches).to(tl.int32))
        counts = tl.where(bins == 0, counts - unmatched, counts)
        # Matching keys whose digit is at least each bin's.
        at_least = tl.sum(counts) - tl.cumsum(counts, 0) + counts
        chosen = tl.max(tl.where(at_least >= wanted, bins, 0))
        wanted -= tl.sum(tl.where(bins > chosen, counts, 0))
        prefix = prefix | ((chosen ^ flip) << shift)
        high = high | (tl.full((), 0xFF, tl.int32) << shift)
    threshold = prefix
    larger = K - wanted  # keys above the k-th: all taken, first
    taken_larger = 0
    taken_tied = 0
    out_row = out_ptr + row.to(tl.int64) * out_stride
    for first in range(0, total, BLOCK):
        index, key = _candidate_keys(row_ptr, part_stride, first + lanes, K)
        above = key > threshold
        tied = key == threshold
        at_above = taken_larger + tl.cumsum(above.to(tl.int32), 0) - 1
        tl.store(out_row + at_above, index, mask=above)
        at_tied = larger + taken_tied + tl.cumsum(tied.to(tl.int32), 0) - 1
        tl.store(out_row + at_tied, index, mask=tied & (at_tied < K))
        taken_larger += tl.sum(above.to(tl.int32))
        taken_tied += tl.sum(tied.to(tl.int32))


def select_top_k(
    candidates: torch.Tensor, parts: int, out: torch.Tensor, k: int
) -> None:
    """Each row's top-k from its ``parts`` ranks' candidates into ``out``
    ([rows, >= k] int32, row-local indices; a row's valid ones first, then
    -1). ``candidates`` is [parts, rows, candidate_columns(k)] int32 (any
    contiguous row layout within a part)."""
    rows = out.shape[0]
    if rows == 0:
        return
    assert candidates.shape[1] == rows and candidates.shape[0] == parts
    assert candidates.shape[2] == candidate_columns(k) and candidates.stride(2) == 1
    assert out.stride(1) == 1 and k & (k - 1) == 0, "k: a power of two"
    _select_top_k_kernel[(rows,)](
        candidates,
        out,
        candidates.stride(0),
        candidates.stride(1),
        out.stride(0),
        parts,
        K=k,
        # As many of a row's parts at a time as divide them (its candidates'
        # order kept), up to 1,024 candidates.
        BLOCK=min(k * (parts & -parts), 1024),
    )


@triton.jit
def _keep_candidates_kernel(
    logits_ptr,
    topk_ptr,
    part_starts_ptr,
    offsets_ptr,
    indices_ptr,
    scores_ptr,
    logits_stride,
    topk_stride,
    candidates_stride,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = at < K
    index = tl.load(topk_ptr + row.to(tl.int64) * topk_stride + at, mask=mask)
    valid = mask & (index >= 0)
    column = tl.load(part_starts_ptr + row) + index
    score = tl.load(
        logits_ptr + row.to(tl.int64) * logits_stride + column,
        mask=valid,
        other=float("-inf"),
    )
    local = tl.where(valid, index + tl.load(offsets_ptr + row), -1)
    out = row.to(tl.int64) * candidates_stride + at
    tl.store(indices_ptr + out, local, mask=mask)
    tl.store(scores_ptr + out, score, mask=mask)


def keep_candidates(
    logits: torch.Tensor,
    topk: torch.Tensor,
    part_starts: torch.Tensor,
    offsets: torch.Tensor,
    candidates: torch.Tensor,
) -> None:
    """A key-split call's candidates, one row each, into ``candidates``
    ([rows, candidate_columns(k)] int32): its top-k (``topk``, indices from
    each row's part start ``part_starts``, a column of ``logits``) as
    row-local indices (the part's ``offsets`` from the row's first key
    added; -1 stays), then their scores read from ``logits`` (-inf for
    -1), as float32 bits."""
    rows, k = topk.shape
    if rows == 0:
        return
    assert candidates.shape == (rows, candidate_columns(k))
    assert candidates.stride(1) == topk.stride(1) == logits.stride(1) == 1
    block = min(1024, triton.next_power_of_2(k))
    _keep_candidates_kernel[(rows, triton.cdiv(k, block))](
        logits,
        topk,
        part_starts,
        offsets,
        candidates,
        candidates[:, k:].view(torch.float32),
        logits.stride(0),
        topk.stride(0),
        candidates.stride(0),
        K=k,
        BLOCK=block,
    )


@triton.jit
def _narrow_kernel(src_ptr, dst_ptr, dst_rows_ptr, src_stride, dst_stride,
                   K: tl.constexpr, BLOCK: tl.constexpr, WIDEN: tl.constexpr,
                   TO_ROWS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = at < K
    value = tl.load(src_ptr + row.to(tl.int64) * src_stride + at, mask=mask)
    if WIDEN:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        # int16 back to the index: 0xFFFF (-1) stays -1, the rest unsigned.
        value = ((value.to(tl.int32) + 1) & 0xFFFF) - 1
    else:
        value = value.to(tl.int16)
    dst_row = row.to(tl.int64)
    if TO_ROWS:
        dst_row = tl.load(dst_rows_ptr + row)
    tl.store(dst_ptr + dst_row * dst_stride + at, value, mask=mask)


def _narrow_launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    widen: bool,
    dst_rows: torch.Tensor | None = None,
) -> None:
    rows, k = src.shape[0], dst.shape[1]
    if rows == 0:
        return
    assert dst_rows is not None or dst.shape[0] == rows
    assert dst_rows is None or dst_rows.shape == (rows,)
    assert src.stride(1) == dst.stride(1) == 1
    block = min(1024, triton.next_power_of_2(k))
    _narrow_kernel[(rows, triton.cdiv(k, block))](
        src,
        dst,
        dst if dst_rows is None else dst_rows,
        src.stride(0),
        dst.stride(0),
        K=k,
        BLOCK=block,
        WIDEN=widen,
        TO_ROWS=dst_rows is not None,
    )


def narrow_indices(rows: torch.Tensor, out: torch.Tensor) -> None:
    """Row-local int32 indices of rows below NARROW_KEYS keys (and -1) into
    ``out`` as int16 (indices from 32,768 wrap; ``widen_indices`` undoes
    it)."""
    assert out.dtype == torch.int16
    _narrow_launch(rows, out, widen=False)


def widen_indices(
    narrow: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor | None = None
) -> None:
    """``narrow_indices``'s rows back to int32 into ``out``: row i into row
    ``out_rows[i]`` (int64) where given, else into row i."""
    assert narrow.dtype == torch.int16
    _narrow_launch(narrow, out, widen=True, dst_rows=out_rows)
