# SPDX-License-Identifier: Apache-2.0
"""Fast GPU stand-ins for the indexer prefill's logits and top-k, for
benchmarks that must see host costs (stage 0001's whole-op benchmark and its
no-sync test).

The harness's reference stand-ins (vLLM's torch ``fp8_mqa_logits_torch``,
an fp32-keyed top-k with adversarial ties) are correct but 10-100x slower than
AITER, which hides every host cost behind GPU time. These are written for
speed, not for adversarial contracts:

- ``mqa_logits``: one Triton kernel for AITER's ``fp8_mqa_logits`` contract
  (ROCm/aiter ``aiter/ops/triton/attention/fp8_mqa_logits.py``, lines
  81-128 at e4048607; see docs/aiter_contracts.md): ``logits[i, j] = sum_h w[i, h] *
  relu(q[i, h] . k[j] * scale[j])`` for keys ``ks[i] <= j < ke[i]``, -inf
  elsewhere; fp8 e4m3 dot products, tiles of keys outside a row block's
  range skipped (the causal half of a fresh prompt); one program per row
  (two for many rows of few heads), looping over the row's keys, as AITER's
  gfx950 kernel does (``logits_rows_per_program``).
- ``top_k_per_row_prefill``: ``_C.top_k_per_row_prefill``'s contract
  (indices relative to the row's start, -1 past a short row; csrc/sampler.cu)
  as one Triton program per row that reads only the row's own key range
  ``[ks, ke)``, as AITER's per-row radix top-k does. Radix passes over the
  row's keys find the k-th largest score, one more pass writes the indices;
  indices come in no particular order, as the real kernels' do. Its shape
  (``TOPK_SHAPES``) follows AITER's one-block prefill kernel: ``aiter`` has
  its 1,024 threads a row and 12-bit digits, so three counting passes and
  the writing one, each reading the whole row (ROCm/aiter
  ``csrc/kernels/topk_per_row_kernels.cu`` at e4048607: L2819 and L2903,
  ``top_k_per_row_prefill`` launches ``dispatch_topk_oneblock`` with a
  block of 1,024; L2573-2599, 12 bits a digit on a GPU of 128 compute units
  or more; L2146 and L2241, each pass scans the whole row, compaction being
  off). The ``narrow`` shape (128 threads, 8-bit digits: four counting
  passes), which the bench ran first, is kept to compare the one-row floor
  with, and ``wide`` has AITER's threads with 8-bit digits. ``wide`` is the
  default: Triton lowers a 4,096-bin ``tl.histogram`` far slower than
  AITER's shared-memory counts (on an H100, 8-23x ``wide``'s time).

On gfx950 vLLM 0.34.0 asks AITER's prefill logits for no -inf fill
(``clean_logits=False``), so ``mqa_logits`` leaves every position outside a
row's range unwritten (``torch.empty``) and the top-k must not read it.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import tl, triton

BLOCK_N = 128  # keys per tile


def logits_rows_per_program(rows: int, heads: int) -> int:
    """The query rows one program of AITER's gfx950 prefill logits kernel
    walks, each over its own key range, tile after tile (no program splits
    a row's keys): 2 with 32 heads or fewer and more than 4,096 rows, else 1
    (ROCm/aiter ``aiter/ops/triton/attention/fp8_mqa_logits.py`` at
    e4048607: L130, the gluon kernel from Triton 3.6; L206, gfx950's
    ``block_m``; L228, the grid ``cdiv(rows, block_m)``; the plain Triton
    kernel, L169, runs one program per row). A few long rows thus leave
    most of the GPU idle, as they do there."""
    return 2 if heads <= 32 and rows > 4096 else 1


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    w_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    num_rows,
    num_keys,
    out_stride,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    starts = tl.load(starts_ptr + rows, mask=row_ok, other=num_keys)
    ends = tl.load(ends_ptr + rows, mask=row_ok, other=0)
    heads = pid_m * BLOCK_M * H + tl.arange(0, BLOCK_M * H)
    head_ok = heads < num_rows * H
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + heads[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0
    )
    weights = tl.load(w_ptr + heads, mask=head_ok, other=0.0)
    first_tile = tl.min(starts, axis=0) // BLOCK_N
    end_tile = tl.cdiv(tl.max(ends, axis=0), BLOCK_N)
    for tile in range(first_tile, end_tile):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < num_keys
        k = tl.load(
            k_ptr + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0
        )
        scores = tl.dot(q, tl.trans(k))
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        scores = tl.maximum(scores * scale[None, :], 0.0) * weights[:, None]
        logits = tl.sum(tl.reshape(scores, (BLOCK_M, H, BLOCK_N)), axis=1)
        valid = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
        tl.store(
            out_ptr + rows[:, None] * out_stride + cols[None, :],
            logits,
            mask=row_ok[:, None] & valid,
        )


def mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
) -> torch.Tensor:
    """``rocm_fp8_mqa_logits``'s signature: fp32 ``[rows, keys]``."""
    k_fp8, k_scale = kv
    rows, heads, dim = q.shape
    keys = k_fp8.shape[0]
    # Positions outside a row's range stay unwritten, as with AITER's
    # clean_logits=False.
    out = torch.empty((rows, keys), dtype=torch.float32, device=q.device)
    if rows == 0 or keys == 0:
        return out
    block_m = logits_rows_per_program(rows, heads)
    _mqa_logits_kernel[(triton.cdiv(rows, block_m),)](
        q.contiguous(),
        k_fp8.contiguous(),
        k_scale.reshape(-1).contiguous(),
        weights.float().contiguous(),
        out,
        cu_seqlen_ks,
        cu_seqlen_ke,
        rows,
        keys,
        out.stride(0),
        H=heads,
        D=dim,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
    )
    return out


# A top-k program's shape: threads (warps of 32 on the H200), bits of the
# radix digit, and keys read per iteration.
# "wide" has AITER's threads with 8-bit digits: Triton's tl.histogram over
# 4,096 bins may cost the H200 more than AITER's shared-memory atomics cost
# MI355X (not measured); the two tell that apart.
TOPK_SHAPES = {
    "aiter": {"num_warps": 32, "bits": 12, "block": 8192},
    "wide": {"num_warps": 32, "bits": 8, "block": 8192},
    "narrow": {"num_warps": 4, "bits": 8, "block": 1024},
}
TOPK_SHAPE = "wide"  # the bench sets it (cp_indexer_host.TOPK_SHAPE)


@triton.jit
def _ordered(x):
    """fp32 scores as uint32 keys in the same order (larger score, larger key)."""
    bits = x.to(tl.uint32, bitcast=True)
    negative = (bits >> 31) == 1
    return tl.where(negative, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _top_k_per_row_kernel(
    logits_ptr,
    starts_ptr,
    ends_ptr,
    out_ptr,
    stride0,
    stride1,
    out_stride,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    RELATIVE: tl.constexpr,
):
    # Program (row, segment) of (rows, segments): the segment-th equal part
    # of the row's range, its k written at column segment * K of the output.
    row = tl.program_id(0)
    segment = tl.program_id(1)
    segments = tl.num_programs(1)
    row_start = tl.load(starts_ptr + row)
    row_length = tl.load(ends_ptr + row) - row_start
    ks = row_start + (row_length.to(tl.int64) * segment // segments).to(tl.int32)
    ke = row_start + (row_length.to(tl.int64) * (segment + 1) // segments).to(tl.int32)
    length = ke - ks
    row_logits = logits_ptr + row.to(tl.int64) * stride0
    row_out = out_ptr + row.to(tl.int64) * out_stride + segment * K
    lanes = tl.arange(0, BLOCK)
    if length <= K:
        # Every key of the row, then -1.
        origin = 0 if RELATIVE else ks
        for first in range(0, K, BLOCK):
            at = first + lanes
            tl.store(row_out + at, tl.where(at < length, at + origin, -1), mask=at < K)
    else:
        bins = tl.arange(0, 1 << BITS)
        prefix = tl.zeros((), dtype=tl.uint32)
        remaining = K  # still to take among the keys that match the prefix
        # Digits from the top bit down; the last one takes the bits left.
        for digit_pass in tl.static_range((32 + BITS - 1) // BITS):
            high = 32 - digit_pass * BITS
            shift = high - BITS if high > BITS else 0
            digit_mask = (1 << (high - shift)) - 1
            hist = tl.zeros((1 << BITS,), dtype=tl.int32)
            for first in range(ks, ke, BLOCK):
                cols = first + lanes
                valid = cols < ke
                key = _ordered(tl.load(row_logits + cols * stride1, mask=valid))
                if digit_pass == 0:
                    match = valid
                else:
                    match = valid & ((key >> high) == (prefix >> high))
                digit = tl.where(match, (key >> shift) & digit_mask, 0).to(tl.int32)
                # Non-matching lanes were counted in bin 0: take them out.
                unmatched = BLOCK - tl.sum(match.to(tl.int32), axis=0)
                hist += tl.histogram(digit, 1 << BITS) - tl.where(
                    bins == 0, unmatched, 0
                )
            # at_or_above[b]: matching keys whose digit is b or more.
            at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
            above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
            remaining -= above
            prefix = prefix | (chosen.to(tl.uint32) << shift)
        # prefix is the k-th largest key; take every key above it and the first
        # `remaining` keys equal to it.
        taken_above = 0
        taken_equal = 0
        for first in range(ks, ke, BLOCK):
            cols = first + lanes
            valid = cols < ke
            key = _ordered(tl.load(row_logits + cols * stride1, mask=valid))
            is_above = (valid & (key > prefix)).to(tl.int32)
            is_equal = (valid & (key == prefix)).to(tl.int32)
            at_above = taken_above + tl.cumsum(is_above, axis=0) - 1
            at_equal = K - remaining + taken_equal + tl.cumsum(is_equal, axis=0) - 1
            picked = cols - ks if RELATIVE else cols
            tl.store(row_out + at_above, picked, mask=is_above == 1)
            tl.store(
                row_out + at_equal,
                picked,
                mask=(is_equal == 1) & (at_equal < K),
            )
            taken_above += tl.sum(is_above, axis=0)
            taken_equal += tl.sum(is_equal, axis=0)


def top_k_per_row_prefill(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    indices: torch.Tensor,
    num_rows: int,
    stride0: int,
    stride1: int,
    k: int,
) -> None:
    """``torch.ops._C.top_k_per_row_prefill``'s signature and output, each
    row's scores read only within ``[row_starts, row_ends)``."""
    _top_k(logits, row_starts, row_ends, indices, num_rows, stride0, stride1, k, True)


def aiter_top_k_per_row_prefill(
    logits: torch.Tensor,
    rowStarts: torch.Tensor,  # noqa: N803 - AITER's names
    rowEnds: torch.Tensor,  # noqa: N803
    indices: torch.Tensor,
    values: torch.Tensor | None,
    numRows: int,  # noqa: N803
    stride0: int,
    stride1: int,
    k: int = 2048,
    workspace: torch.Tensor | None = None,
    stable: bool = False,
) -> None:
    """AITER's ``top_k_per_row_prefill`` (``aiter/ops/topk.py``): the same
    selection, indices as columns of the chunk (not relative to the row's
    start), -1 past a short row; ``values`` is not filled (vLLM passes
    None)."""
    assert values is None
    _top_k(logits, rowStarts, rowEnds, indices, numRows, stride0, stride1, k, False)


def uses_multi_block(rows: int, stride0: int) -> bool:
    """Whether AITER's prefill top-k takes its multi-block kernel for a call
    of ``rows`` rows over logits ``stride0`` wide, on a GPU of 128 compute
    units or more (MI355X; the H200 has 132): ROCm/aiter
    ``csrc/kernels/topk_per_row_kernels.cu`` L2624-2665 at e4048607
    (``should_use_mulblocks``, its ``num_cu >= 128`` branch)."""
    if rows <= 2:
        return stride0 >= 65536
    if rows <= 32:
        return stride0 >= 98304
    if rows <= 64:
        return stride0 >= 131072
    return rows <= 128 and stride0 >= rows * 2048


def _top_k(logits, starts, ends, indices, rows, stride0, stride1, k, relative):
    if rows == 0:
        return
    assert indices.stride(1) == 1
    if not uses_multi_block(rows, stride0):
        _launch(logits, starts, ends, indices, rows, 1, stride0, stride1, k, relative)
        return
    # As AITER's multi-block kernel, several programs share a row: each takes
    # the top k of an equal part of the row's range, then one program per row
    # takes the top k of those candidates. Two passes and a gather, with no
    # host sync; the number of parts fills the GPU about twice over.
    units = (
        torch.cuda.get_device_properties(logits.device).multi_processor_count
        if logits.is_cuda
        else 8
    )
    segments = max(2, min(2 * units // rows, stride0 // (4 * k)))
    candidates = torch.empty(
        (rows, segments * k), dtype=torch.int32, device=logits.device
    )
    _launch(
        logits, starts, ends, candidates, rows, segments, stride0, stride1, k, False
    )
    valid = candidates >= 0
    scores = logits[:rows].gather(1, candidates.clamp(min=0).long())
    scores = scores.masked_fill_(~valid, float("-inf"))
    zeros = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    width = torch.full_like(zeros, segments * k)
    picked = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    _launch(scores, zeros, width, picked, rows, 1, segments * k, 1, k, True)
    chosen = candidates.gather(1, picked.long())
    # A row no longer than k: all its columns in order, then -1, as the
    # one-block path writes it.
    length = (ends[:rows] - starts[:rows]).to(torch.int32)
    column = torch.arange(k, dtype=torch.int32, device=logits.device)
    whole = torch.where(
        column < length[:, None], column + starts[:rows, None].to(torch.int32), -1
    )
    chosen = torch.where((length <= k)[:, None], whole, chosen)
    if relative:
        chosen = torch.where(chosen >= 0, chosen - starts[:rows, None], -1)
    indices[:rows, :k] = chosen


def _launch(logits, starts, ends, out, rows, segments, stride0, stride1, k, relative):
    shape = TOPK_SHAPES[TOPK_SHAPE]
    _top_k_per_row_kernel[(rows, segments)](
        logits,
        starts,
        ends,
        out,
        stride0,
        stride1,
        out.stride(0),
        K=k,
        BLOCK=shape["block"],
        BITS=shape["bits"],
        RELATIVE=relative,
        num_warps=shape["num_warps"],
    )
