# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MXFP4 indexer keys for DeepSeek-V3.2-style DSA models on the paged cache
aiter's ``paged_mxfp4_mqa_logits`` reads.

A key of D values becomes D // 2 bytes of E2M1 pairs (even element in the low
nibble) and D // 32 E8M0 scale bytes: 68 bytes at D = 128 instead of the
FP8 row's 132. The numerics, shared by the K cache writer and the query, are
those of AITER's own writer (``k_norm_rope_mxfp4_cache`` through its
``_mxfp4_quant_op``, scaling mode 1), so that for every finite key the cache
holds the bytes AITER's writer would store:

- scale: 2^e with e = ceil(log2(max(amax, 6 * 2^-126) / 6)), taken from
  amax's bits so it is exact; the byte is e + 127. A block whose amax is
  below 6 * 2^-126 (all-zero blocks included) stores byte 1 (2^-126) and is
  quantised with that scale. An infinite amax stores byte 255 (E8M0's NaN).
- values: x / 2^e rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3,
  4, 6), ties to the even code, saturated at +-6; the sign bit is kept, so a
  negative value that rounds to zero stores -0.
- NaN elements do not count towards amax (as in AITER) and are stored as
  +0; AITER leaves their code unspecified. In a block with an infinite
  element the infinities store +-6 and the finite elements +-0.

The store takes a page order as three tile sizes (a page's values, then
its scales, both grouped in runs of ``n_per_tile`` tokens); which order a
cache uses, and checking a cache against it, is the platform's: on ROCm,
AITER's ``cache_format`` (``vllm/v1/attention/ops/rocm_dsa_mxfp4_cache.py``).
This module is platform-neutral: the NVIDIA model imports it through
kernels.py.
"""

from typing import NamedTuple

import torch

from vllm.model_executor.layers.quantization.utils.ocp_mx_utils import (
    OCP_MX_BLOCK_SIZE,
)
from vllm.triton_utils import tl, triton

# Values per E8M0 scale: the one MXFP4 block size the indexer cache uses.
MXFP4_BLOCK_SIZE = OCP_MX_BLOCK_SIZE


def mxfp4_indexer_row_bytes(head_dim: int) -> int:
    """Bytes of one MXFP4 indexer key, the cache's row: packed values, then
    e8m0 scales (68 at head_dim 128; FP8's row is 132)."""
    return head_dim // 2 + head_dim // MXFP4_BLOCK_SIZE


class Mxfp4IndexQuery(NamedTuple):
    """The index query as MXFP4, both buffers contiguous: [T, H, D // 2]
    uint8 E2M1 pairs and [T, H, D // 32] uint8 E8M0 scales."""

    values: torch.Tensor
    scales: torch.Tensor


def empty_mxfp4_index_query(index_q: torch.Tensor) -> Mxfp4IndexQuery:
    """Uninitialised MXFP4 buffers for ``index_q`` [T, H, D]."""
    tokens, heads, head_dim = index_q.shape
    return Mxfp4IndexQuery(
        index_q.new_empty((tokens, heads, head_dim // 2), dtype=torch.uint8),
        index_q.new_empty(
            (tokens, heads, head_dim // MXFP4_BLOCK_SIZE), dtype=torch.uint8
        ),
    )


@triton.jit
def _pow2(e):
    """2^e as float32 for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_quantize(vals, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, HEAD_DIM] floats -> ([ROWS, HEAD_DIM // 2] uint8 E2M1 pairs,
    [ROWS, HEAD_DIM // 32] uint8 E8M0 scales), as the module docstring
    specifies."""
    x = tl.reshape(vals.to(tl.float32), (ROWS, HEAD_DIM // 32, 32))
    x = tl.where(x != x, 0.0, x)
    amax = tl.max(tl.abs(x), axis=2)

    # 6 * 2^e >= amax = m * 2^E (m in [1, 2)) gives e = E - 1, or E - 2 when
    # m <= 1.5. Below 6 * 2^-126 (zero and denormal amax too) e is -126; an
    # infinite amax gives 128, the byte 255.
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    exp = biased - 128 - ((bits & 0x7FFFFF) <= 0x400000).to(tl.int32)
    exp = tl.where(biased == 255, 128, tl.maximum(exp, -126))

    # x / 2^exp, exact: two power-of-two factors built from their bits, so
    # each stays a normal float.
    half = -exp // 2
    y = x * _pow2(half)[:, :, None] * _pow2(-exp - half)[:, :, None]

    # Round to the E2M1 grid with ties to the even code: the thresholds are
    # the midpoints, inclusive where the upper neighbour has the even code.
    ay = tl.abs(y)
    code = (
        (ay > 0.25).to(tl.int32)
        + (ay >= 0.75).to(tl.int32)
        + (ay > 1.25).to(tl.int32)
        + (ay >= 1.75).to(tl.int32)
        + (ay > 2.5).to(tl.int32)
        + (ay >= 3.5).to(tl.int32)
        + (ay > 5.0).to(tl.int32)
    )
    code = code | ((x.to(tl.int32, bitcast=True) >> 28) & 0x8)
    even, odd = tl.split(tl.reshape(code, (ROWS, HEAD_DIM // 2, 2)))
    packed = (even | (odd << 4)).to(tl.uint8)
    return packed, (exp + 127).to(tl.uint8)


@triton.jit
def mxfp4_paged_cache_store(
    packed,
    scales,
    slots,
    cache_ptr,
    page_stride,
    page_entries,
    HEAD_DIM: tl.constexpr,
    N_PER_TILE: tl.constexpr,
    D_PER_TILE: tl.constexpr,
    SCALE_LANES: tl.constexpr,
):
    """Store keys ([ROWS] ``slots``, ``mxfp4_quantize`` output) in
    `RocmPagedMxfp4CacheLayout` order: a page's values, in runs of N_PER_TILE
    tokens stored [chunk, token, byte], then its scales, in runs of
    N_PER_TILE tokens stored [scale % SCALE_LANES, token, scale //
    SCALE_LANES]. Negative (padding) slots are skipped."""
    VALUE_BYTES: tl.constexpr = HEAD_DIM // 2
    NUM_SCALES: tl.constexpr = HEAD_DIM // 32
    SCALES_PER_LANE: tl.constexpr = NUM_SCALES // SCALE_LANES
    slots = slots.to(tl.int64)[:, None]
    valid = slots >= 0
    page = tl.where(valid, slots // page_entries, 0)
    entry = tl.where(valid, slots % page_entries, 0)
    page_ptr = cache_ptr + page * page_stride

    b = tl.arange(0, VALUE_BYTES)[None, :]
    value_off = (
        entry // N_PER_TILE * (N_PER_TILE * VALUE_BYTES)
        + b // D_PER_TILE * (N_PER_TILE * D_PER_TILE)
        + entry % N_PER_TILE * D_PER_TILE
        + b % D_PER_TILE
    )
    tl.store(page_ptr + value_off, packed, mask=valid & (b >= 0))

    s = tl.arange(0, NUM_SCALES)[None, :]
    scale_off = (
        page_entries * VALUE_BYTES
        + entry // N_PER_TILE * (N_PER_TILE * NUM_SCALES)
        + s % SCALE_LANES * (N_PER_TILE * SCALES_PER_LANE)
        + entry % N_PER_TILE * SCALES_PER_LANE
        + s // SCALE_LANES
    )
    tl.store(page_ptr + scale_off, scales, mask=valid & (s >= 0))


@triton.jit
def mxfp4_index_k_cache_write(
    index_k,
    slot,
    cache_ptr,
    page_stride,
    page_entries,
    HEAD_DIM: tl.constexpr,
    N_PER_TILE: tl.constexpr,
    D_PER_TILE: tl.constexpr,
    SCALE_LANES: tl.constexpr,
):
    """Quantise one index key ([HEAD_DIM] floats) and store it at ``slot``
    of the paged cache (``mxfp4_paged_cache_store``)."""
    packed, scales = mxfp4_quantize(tl.reshape(index_k, (1, HEAD_DIM)), 1, HEAD_DIM)
    mxfp4_paged_cache_store(
        packed,
        scales,
        tl.zeros((1,), tl.int64) + slot,
        cache_ptr,
        page_stride,
        page_entries,
        HEAD_DIM,
        N_PER_TILE,
        D_PER_TILE,
        SCALE_LANES,
    )


@triton.jit
def mxfp4_index_q_store(index_q, values_ptr, scales_ptr, row, HEAD_DIM: tl.constexpr):
    """Quantise one query head ([HEAD_DIM] floats) into row ``row`` (token *
    heads + head) of the ``Mxfp4IndexQuery`` buffers. Returns the scale the
    head's index weight takes: 1, since the per-32 scales go to the logits
    kernel with the values."""
    packed, scales = mxfp4_quantize(tl.reshape(index_q, (1, HEAD_DIM)), 1, HEAD_DIM)
    row = row.to(tl.int64)
    values = tl.arange(0, HEAD_DIM // 2)[None, :]
    tl.store(values_ptr + row * (HEAD_DIM // 2) + values, packed)
    scale_idx = tl.arange(0, HEAD_DIM // 32)[None, :]
    tl.store(scales_ptr + row * (HEAD_DIM // 32) + scale_idx, scales)
    return 1.0
