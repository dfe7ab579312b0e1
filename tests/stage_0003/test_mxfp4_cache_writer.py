# SPDX-License-Identifier: Apache-2.0
"""Stage 0003: the MXFP4 quantiser and paged K cache writer, bit-exact against
the ml_dtypes reference, for the layouts and block sizes the indexer uses.

Runs the Triton kernel through TRITON_INTERPRET=1 on CPU (and compiled on a
GPU when one is present, see test_mxfp4_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import mxfp4_reference as ref
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

from scripts.harness.mxfp4_writer import indexer_k_mxfp4_quant_and_cache  # noqa: E402
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmPagedMxfp4CacheLayout,
)

HEAD_DIM = 128
ROW = HEAD_DIM // 2 + HEAD_DIM // 32
# AITER's two gfx950 geometries first (n_per_tile 32 for 32 heads or more:
# GLM-5.x's 32, DeepSeek-V3.2's 64; 16 for fewer), then others the class can
# express, so a writer that hard-codes one tiling fails.
LAYOUTS = [
    RocmPagedMxfp4CacheLayout(32, 16, 2),
    RocmPagedMxfp4CacheLayout(16, 16, 4),
    RocmPagedMxfp4CacheLayout(32, 8, 2),
    RocmPagedMxfp4CacheLayout(64, 32, 1),
    RocmPagedMxfp4CacheLayout(16, 64, 4),
]


def _write(k, slots, layout, pages, entries):
    cache = torch.zeros(pages, entries, ROW, dtype=torch.uint8)
    indexer_k_mxfp4_quant_and_cache(k, slots, cache, layout)
    return cache


def _edge_rows() -> torch.Tensor:
    """One 32-value block per case, four cases to a key."""
    f32 = torch.finfo(torch.float32)
    blocks = {
        "all zero": torch.zeros(32),
        "negative zeros": -torch.zeros(32),
        "tiny amax (denormals)": torch.linspace(-1, 1, 32) * 2.0**-140,
        "smallest normal": torch.full((32,), f32.tiny),
        "huge amax": torch.linspace(-1, 1, 32) * f32.max,
        "exactly +-6": torch.tensor([6.0, -6.0] * 16),
        "amax 6 * 2^k": torch.tensor([6.0 * 2**10] + [1.0] * 31),
        "amax just above 1.5 * 2^k": torch.tensor([1.5000001] + [0.1] * 31),
        # at scale 1 (amax 6): every midpoint of the E2M1 grid, both signs
        "ties": torch.tensor(
            [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2
            + [-0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0] * 2
        ),
        "just off ties": torch.tensor(
            [0.2500001, 0.7499999, 1.2500001, 1.7499999, 2.5000002, 3.4999998]
            + [5.0000005, 6.0] * 13
        ),
        "NaN stored as +0": torch.tensor([float("nan"), 3.0] + [-1.0] * 30),
        "+inf": torch.tensor([float("inf"), 1e30] + [-1.0] * 30),
        "-inf": torch.tensor([float("-inf"), 2.0] + [1.0] * 30),
        "one outlier": torch.tensor([1000.0] + [0.01] * 31),
        "amax below 6 * 2^-126": torch.full((32,), 2.0**-126),
        "amax just at 6 * 2^-126": torch.full((32,), 6.0 * 2.0**-126),
        "amax just below 6 * 2^-126": torch.full((32,), 5.9 * 2.0**-126),
        "descending powers": torch.exp2(-torch.arange(32.0)),
    }
    rows = torch.stack(list(blocks.values()))
    pad = (-rows.shape[0]) % 4
    return torch.cat([rows, torch.zeros(pad, 32)]).reshape(-1, HEAD_DIM)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("entries", [64, 128])
def test_random_keys_bit_exact_across_pages(layout, entries):
    """Random keys over several magnitudes, written to shuffled slots on
    several pages (padding slots included): every byte equals the reference
    writer's, untouched bytes stay zero."""
    torch.manual_seed(entries + layout.n_per_tile)
    pages, tokens = 3, 96
    k = torch.randn(tokens, HEAD_DIM) * torch.exp2(torch.randint(-20, 20, (tokens, 1)))
    k = k.to(torch.bfloat16).float()
    slots = torch.randperm(pages * entries)[:tokens]
    slots[::17] = -1
    got = _write(k, slots, layout, pages, entries)
    want = torch.zeros_like(got)
    ref.write_cache(want, slots, k, layout)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=str)
@pytest.mark.parametrize("entries", [64, 128])
def test_edge_cases_bit_exact(layout, entries):
    k = _edge_rows()
    slots = torch.arange(k.shape[0]) * 37 % (2 * entries)  # both pages
    got = _write(k, slots, layout, 2, entries)
    packed, scales = ref.read_cache(got, slots, layout, HEAD_DIM)
    want_packed, want_scales = ref.quantize(k)
    assert torch.equal(scales, want_scales)
    assert torch.equal(packed, want_packed)


def test_edge_cases_documented_values():
    """What the docstring promises for inputs without an obvious answer."""
    k = torch.zeros(1, HEAD_DIM)
    k[0, :32] = torch.tensor([float("nan"), 3.0] + [-1.0] * 30)
    k[0, 32:64] = torch.tensor([float("inf"), 1.0] + [-1.0] * 30)
    k[0, 96:128] = torch.tensor([-0.1] + [6.0] * 31)
    layout = LAYOUTS[0]
    cache = _write(k, torch.tensor([0]), layout, 1, 64)
    packed, scales = ref.read_cache(cache, torch.tensor([0]), layout, HEAD_DIM)
    # NaN -> +0 and ignored by amax (3.0 sets the scale 2^-1)
    assert packed[0, 0] & 0xF == 0x0
    assert scales[0, 0] == 127 - 1
    # inf -> scale byte 255 (E8M0 NaN) as AITER's writer stores; +6, and the
    # finite values become (signed) zeros
    assert scales[0, 1] == 255 and packed[0, 16] & 0xF == 0x7
    assert packed[0, 16] >> 4 == 0x0 and packed[0, 17] & 0xF == 0x8
    # all-zero block -> byte 1 (2^-126), as AITER's max(amax, 6 * 2^-126)
    assert scales[0, 2] == 1 and not packed[0, 32:48].any()
    # a negative value that rounds to zero keeps its sign: -0
    assert packed[0, 48] & 0xF == 0x8 and scales[0, 3] == 127


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=str)
def test_decoded_cache_matches_reference_values(layout):
    """Read back and dequantised, each key is its MXFP4 rounding: within half
    a grid step of the input, and equal to the reference's decoding."""
    torch.manual_seed(1)
    k = torch.randn(40, HEAD_DIM)
    slots = torch.randperm(128)[:40]
    cache = _write(k, slots, layout, 1, 128)
    decoded = ref.dequantize(*ref.read_cache(cache, slots, layout, HEAD_DIM))
    assert torch.equal(decoded, ref.dequantize(*ref.quantize(k)))
    scale = decoded.new_tensor(2.0).pow(
        torch.ceil(torch.log2(k.abs().unflatten(-1, (-1, 32)).amax(-1) / 6))
    )
    # E2M1's widest gap is 2 (between 4 and 6): error <= 1 * scale
    err = (decoded - k).abs().unflatten(-1, (-1, 32))
    assert bool((err <= scale[..., None]).all())


def test_writes_into_block_major_pool_stay_in_their_pages():
    """The indexer cache is a strided view into vLLM's block-major pool: the
    writer follows the page stride and touches nothing between pages."""
    layout, entries, pages = LAYOUTS[0], 64, 4
    stride = entries * ROW + 1000
    pool = torch.zeros(pages * stride, dtype=torch.uint8)
    cache = torch.as_strided(pool, (pages, entries, ROW), (stride, ROW, 1))
    torch.manual_seed(2)
    k = torch.randn(200, HEAD_DIM)
    slots = torch.randperm(pages * entries)[:200]
    indexer_k_mxfp4_quant_and_cache(k, slots, cache, layout)
    gaps = pool.view(pages, stride)[:, entries * ROW :]
    assert not gaps.any()
    want = torch.zeros(pages, entries, ROW, dtype=torch.uint8)
    ref.write_cache(want, slots, k, layout)
    assert torch.equal(cache, want)
