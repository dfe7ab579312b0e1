# SPDX-License-Identifier: Apache-2.0
"""An independent MXFP4 reference for the indexer K cache, built on
``ml_dtypes`` (``float4_e2m1fn``, ``float8_e8m0fnu``) and numpy, and a
reader of the paged cache that replays the address arithmetic of AITER's
reader.

Nothing here shares code with the Triton writer.

Quantiser (ROCm/aiter quant.py ``_mxfp4_quant_op``, scaling mode 1, as
``k_norm_rope_mxfp4_cache`` at commit 689b79d5 calls it; docs/aiter_contracts.md,
"The MXFP4 quantiser the cache must match"): ``ratio = max(amax,
6 * 2^-126) / 6`` in float32, scale byte ``(bits(ratio) + 0x7FFFFF) >> 23``;
values ``x / 2^(byte - 127)`` rounded by ml_dtypes' own cast (nearest, ties
to even, saturating at +-6). amax ignores NaN (AITER), and NaN elements are
stored as +0 (the series' documented choice: AITER's code for them is
unspecified).

Page layout, from the reader's side (ROCm/aiter commit 4934fe77):
the launcher's ``_split_cache`` (``aiter/ops/triton/attention/
pa_mqa_logits_mxfp4.py``) puts a page's scales after its P * D/2 value
bytes; the Gluon kernel (``_gluon_kernels/gfx950/attention/
pa_mqa_logits_mxfp4.py``) reads a tile of BLOCK_KV = min(64, P) tokens at
``tile_ptr`` = page + (tile_pos % P) * per-token bytes, values at
``_shuffled_offsets`` and scales with ``_load_scales_wide``: offsets
``b0 * (NPT * NS) + (b2 + b1 * NPT) * S_HI + b3`` over [N_HI, S_LO, NPT,
S_HI], permuted (0, 2, 3, 1) into [BLOCK_KV, NS]. S_LO = 64 // NPT (the
wavefront), NPT from the launcher's ``mfma_nonk_dim``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

# A stated test requirement (tests/requirements-cpu.txt, README "On an
# MI355X"): without it the tests that need this reference skip with the reason.
ml_dtypes = pytest.importorskip(
    "ml_dtypes", reason="the MXFP4 reference needs ml_dtypes: pip install ml_dtypes"
)

BLOCK = 32
WAVEFRONT = 64
IDEAL_PAGE_SIZE = 64  # the launcher's kv_tile cap


def n_per_tile(num_heads: int, head_dim: int) -> int:
    """AITER's ``mfma_nonk_dim``: 32 for head_dim <= 64 or >= 32 heads."""
    return 32 if (head_dim <= 64 or num_heads >= 32) else 16


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] floats -> ([..., D // 2] uint8 E2M1 pairs, even element in
    the low nibble; [..., D // 32] uint8 E8M0 scales)."""
    v = x.detach().cpu().float().numpy()
    blocks = v.reshape(*v.shape[:-1], -1, BLOCK)
    blocks = np.where(np.isnan(blocks), np.float32(0.0), blocks)
    amax = np.abs(blocks).max(-1)
    floor = np.float32(6.0 * 2.0**-126)
    ratio = (np.maximum(amax, floor) / np.float32(6.0)).astype(np.float32)
    scale_bytes = (ratio.view(np.uint32).astype(np.int64) + 0x7FFFFF) >> 23
    scale = np.exp2(scale_bytes.astype(np.float64) - 127.0)
    scaled = blocks.astype(np.float64) / scale[..., None]
    # ml_dtypes saturates at +-6 (inf included) and keeps the sign of zero.
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    codes = codes.reshape(*v.shape[:-1], -1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = np.ascontiguousarray(scale_bytes.astype(np.uint8))
    return torch.from_numpy(packed), torch.from_numpy(scales)


E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of ``quantize``: [..., D] float32."""
    p = packed.cpu().numpy()
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], -1)
    vals = E2M1_VALUES[codes].astype(np.float32)
    scale = scales.cpu().numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    blocks = vals.reshape(*vals.shape[:-1], -1, BLOCK) * scale[..., None]
    return torch.from_numpy(blocks.reshape(vals.shape))


def page_offsets(
    page_entries: int, head_dim: int, n_per_tile: int, d_per_tile: int
) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets in a page of every (entry, value byte) and (entry, scale),
    found by replaying the reader's loads tile by tile (module docstring)."""
    head_bytes, num_scales = head_dim // 2, head_dim // BLOCK
    block_kv = min(IDEAL_PAGE_SIZE, page_entries)
    s_lo = WAVEFRONT // n_per_tile
    s_hi = num_scales // s_lo
    n_hi = block_kv // n_per_tile
    value_off = np.empty((page_entries, head_bytes), dtype=np.int64)
    scale_off = np.empty((page_entries, num_scales), dtype=np.int64)
    d = np.arange(head_bytes)[:, None]  # the reader's offs_d x offs_n tile
    n = np.arange(block_kv)[None, :]
    shuffled = (
        d % d_per_tile
        + d // d_per_tile * (n_per_tile * d_per_tile)
        + n % n_per_tile * d_per_tile
        + n // n_per_tile * (n_per_tile * head_bytes)
    )
    b0, b1, b2, b3 = np.ix_(
        np.arange(n_hi), np.arange(s_lo), np.arange(n_per_tile), np.arange(s_hi)
    )
    wide = b0 * (n_per_tile * num_scales) + (b2 + b1 * n_per_tile) * s_hi + b3
    wide = wide.transpose(0, 2, 3, 1).reshape(block_kv, num_scales)
    scale_region = page_entries * head_bytes
    for tile_pos in range(0, page_entries, block_kv):
        rows = slice(tile_pos, tile_pos + block_kv)
        value_off[rows] = tile_pos * head_bytes + shuffled.T
        scale_off[rows] = scale_region + tile_pos * num_scales + wide
    return value_off, scale_off


def _tiles(layout) -> tuple[int, int]:
    """(n_per_tile, d_per_tile) of a ``RocmPagedMxfp4CacheLayout``; the
    reader derives the scale lanes from n_per_tile, so the layout's must
    agree."""
    n, d, lanes = layout
    assert lanes == WAVEFRONT // n, f"{layout}: the reader uses {WAVEFRONT // n} lanes"
    return n, d


def read_cache(
    cache: torch.Tensor, slots: torch.Tensor, layout, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (packed, scales) stored at ``slots`` of a [pages, entries, row]
    uint8 cache."""
    entries = cache.shape[1]
    value_off, scale_off = page_offsets(entries, head_dim, *_tiles(layout))
    flat = cache.cpu().reshape(cache.shape[0], -1).numpy()
    s = slots.cpu().numpy()
    page, entry = s // entries, s % entries
    packed = flat[page[:, None], value_off[entry]]
    scales = flat[page[:, None], scale_off[entry]]
    return torch.from_numpy(packed), torch.from_numpy(scales)


def write_cache(
    cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, layout
) -> None:
    """Quantise ``x`` [T, D] and store it at ``slots`` (negative ones skipped)."""
    head_dim = x.shape[-1]
    entries = cache.shape[1]
    keep = slots >= 0
    packed, scales = quantize(x[keep])
    value_off, scale_off = page_offsets(entries, head_dim, *_tiles(layout))
    s = slots[keep].cpu().numpy()
    page, entry = s // entries, s % entries
    flat = cache.view(cache.shape[0], -1)
    flat[page[:, None], value_off[entry]] = packed
    flat[page[:, None], scale_off[entry]] = scales
