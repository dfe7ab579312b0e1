# SPDX-License-Identifier: Apache-2.0
"""An independent MXFP4 reference for the indexer K cache, built on
``ml_dtypes`` (``float4_e2m1fn``, ``float8_e8m0fnu``) and numpy.

Nothing here shares code with the Triton writer: the scale comes from float64
``ceil(log2(amax / 6))``, the rounding from ml_dtypes' own cast, and the page
layout from explicit index arrays. The only choices layered on top are the
ones the writer documents for inputs ml_dtypes has no answer for (NaN, and
all-zero blocks).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

BLOCK = 32


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] floats -> ([..., D // 2] uint8 E2M1 pairs, even element in
    the low nibble; [..., D // 32] uint8 E8M0 scales)."""
    v = x.detach().cpu().float().numpy()
    blocks = v.reshape(*v.shape[:-1], -1, BLOCK)
    blocks = np.where(np.isnan(blocks), np.float32(0.0), blocks)
    amax = np.abs(blocks).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        exp = np.ceil(np.log2(amax / 6.0))
    exp = np.where(amax == 0, -127.0, exp)
    exp = np.clip(exp, -127, 127)
    scaled = blocks.astype(np.float64) / np.exp2(exp)[..., None]
    # ml_dtypes saturates at +-6 (inf included) and keeps the sign of zero.
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    codes = codes.reshape(*v.shape[:-1], -1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = np.exp2(exp).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(scales))


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
    page_entries: int, head_dim: int, n_per_tile: int, d_per_tile: int, lanes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets in a page of every (entry, value byte) and (entry, scale),
    as ``RocmPagedMxfp4CacheLayout`` describes the page: built by laying the
    page out as nested arrays and reading back where each byte went."""
    value_bytes, num_scales = head_dim // 2, head_dim // BLOCK
    # values: runs of n_per_tile tokens, each run [chunk, token, byte]
    runs = np.arange(page_entries * value_bytes).reshape(
        page_entries // n_per_tile, value_bytes // d_per_tile, n_per_tile, d_per_tile
    )
    value_off = runs.transpose(0, 2, 1, 3).reshape(page_entries, value_bytes)
    # scales after all values: [scale % lanes, token, scale // lanes]
    grid = page_entries * value_bytes + np.arange(page_entries * num_scales).reshape(
        lanes, page_entries, num_scales // lanes
    )
    scale_off = grid.transpose(1, 2, 0).reshape(page_entries, num_scales)
    return value_off, scale_off


def read_cache(
    cache: torch.Tensor, slots: torch.Tensor, layout, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (packed, scales) stored at ``slots`` of a [pages, entries, row]
    uint8 cache."""
    entries = cache.shape[1]
    value_off, scale_off = page_offsets(entries, head_dim, *layout)
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
    value_off, scale_off = page_offsets(entries, head_dim, *layout)
    s = slots[keep].cpu().numpy()
    page, entry = s // entries, s % entries
    flat = cache.view(cache.shape[0], -1)
    flat[page[:, None], value_off[entry]] = packed
    flat[page[:, None], scale_off[entry]] = scales
