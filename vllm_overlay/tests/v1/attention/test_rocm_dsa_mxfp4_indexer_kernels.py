# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton numerics of the MXFP4 indexer K cache: the bytes the K cache
writer stores and the MXFP4 index query, against a reference written here
from AITER's own rules, and both compiled for gfx950.

The reference follows ROCm/aiter, not the kernels under test:
- the quantiser (``aiter/ops/triton/_triton_kernels/quant/quant.py``,
  ``_mxfp4_quant_op``, scaling mode 1): the E8M0 byte is
  ``(bits(max(amax, 6 * 2^-126) / 6) + 0x7FFFFF) >> 23`` over a 32-value
  block, amax ignores NaN, values round to the nearest E2M1 value (ties to
  the even code, saturated at 6), the even element in the low nibble;
- the page (``aiter/ops/triton/_gluon_kernels/gfx950/attention/
  pa_mqa_logits_mxfp4.py`` at 4934fe77, ``_shuffled_offsets``, and the
  writer ``_triton_kernels/fusions/k_norm_rope_mxfp4_cache.py`` at
  689b79d5): a page's values then its scales, each in runs of
  ``n_per_tile`` tokens, values ``[chunk, token, byte]`` and scales
  ``[scale % scale_lanes, token, scale // scale_lanes]``.
NaN elements store +0 (AITER leaves their code open).

The kernels run on a GPU, or through TRITON_INTERPRET=1 on a CPU. The
compile test builds them for gfx950 in a process of its own, without the
interpreter, on any machine whose Triton has the AMD backend.
"""

import os
import subprocess
import sys

import pytest
import torch

from vllm.models.deepseek_v32.common.mxfp4_indexer_cache import (
    mxfp4_index_k_cache_write,
    mxfp4_index_q_store,
    mxfp4_indexer_row_bytes,
)
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.rocm_dsa_mxfp4_cache import check_mxfp4_indexer_cache
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import RocmPagedMxfp4CacheLayout

pytestmark = pytest.mark.skip_global_cleanup

HEAD_DIM = 128
# AITER's gfx950 layouts (cache_format): n_per_tile 32 for 32 heads or more
# (GLM-5.x's 32, DeepSeek-V3.2's 64), 16 for fewer.
LAYOUTS = [RocmPagedMxfp4CacheLayout(32, 16, 2), RocmPagedMxfp4CacheLayout(16, 16, 4)]
# E2M1 magnitudes by code.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@triton.jit
def _write_keys_kernel(
    k_ptr,
    slot_ptr,
    cache_ptr,
    page_stride,
    page_entries,
    HEAD_DIM: tl.constexpr,
    N_PER_TILE: tl.constexpr,
    D_PER_TILE: tl.constexpr,
    SCALE_LANES: tl.constexpr,
):
    """One key per program, stored as fused_norm_rope stores it."""
    token = tl.program_id(0)
    key = tl.load(k_ptr + token * HEAD_DIM + tl.arange(0, HEAD_DIM))
    mxfp4_index_k_cache_write(
        key,
        tl.load(slot_ptr + token),
        cache_ptr,
        page_stride,
        page_entries,
        HEAD_DIM,
        N_PER_TILE,
        D_PER_TILE,
        SCALE_LANES,
    )


@triton.jit
def _store_query_kernel(q_ptr, values_ptr, scales_ptr, HEAD_DIM: tl.constexpr):
    """One query head per program, stored as fused_q stores it."""
    row = tl.program_id(0)
    head = tl.load(q_ptr + row * HEAD_DIM + tl.arange(0, HEAD_DIM))
    mxfp4_index_q_store(head, values_ptr, scales_ptr, row, HEAD_DIM)


def _device() -> torch.device:
    if current_platform.is_cuda_alike():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("runs Triton kernels: needs a GPU, or TRITON_INTERPRET=1 on a CPU")


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, D] float32 -> ([N, D // 2] uint8 E2M1 pairs, [N, D // 32] uint8
    E8M0 bytes), by AITER's rules (module docstring)."""
    blocks = x.float().unflatten(-1, (-1, 32))
    magnitude = torch.where(blocks.isnan(), 0.0, blocks.abs())
    amax = magnitude.amax(-1)
    ratio = torch.clamp(amax, min=6 * 2.0**-126) / 6
    scale_bytes = (ratio.view(torch.int32).to(torch.int64) + 0x7FFFFF) >> 23
    scale = torch.exp2(scale_bytes.double() - 127)
    # Past 6 (infinities too) the nearest is 6: saturated.
    y = torch.clamp(magnitude.double() / scale[..., None], max=6.0)
    distance = (y[..., None] - E2M1).abs()
    nearest = distance == distance.amin(-1, keepdim=True)
    # Of two equally near codes (neighbours), the even one.
    code = (nearest.int() * (2 - torch.arange(8) % 2)).argmax(-1)
    code = code | torch.signbit(blocks).int() * 8
    code = torch.where(blocks.isnan(), 0, code).flatten(-2)
    packed = code[..., 0::2] | code[..., 1::2] << 4
    return packed.to(torch.uint8), scale_bytes.to(torch.uint8)


def page_order(
    values: torch.Tensor, scales: torch.Tensor, layout: RocmPagedMxfp4CacheLayout
) -> torch.Tensor:
    """One page, flat: per-entry ``values`` [entries, D // 2] and ``scales``
    [entries, D // 32] in AITER's order."""
    npt, dpt, lanes = layout
    tiles = values.shape[0] // npt
    values = values.reshape(tiles, npt, -1, dpt).permute(0, 2, 1, 3)
    scales = scales.reshape(tiles, npt, -1, lanes).permute(0, 3, 1, 2)
    return torch.cat([values.flatten(), scales.flatten()])


def _edge_blocks() -> torch.Tensor:
    """Keys of 32-value blocks whose bytes are easy to get wrong."""
    f32 = torch.finfo(torch.float32)
    blocks = [
        torch.zeros(32),
        -torch.zeros(32),
        torch.linspace(-1, 1, 32) * 2.0**-140,  # denormal amax
        torch.full((32,), 5.9 * 2.0**-126),  # amax just below 6 * 2^-126
        torch.full((32,), 6.0 * 2.0**-126),
        torch.linspace(-1, 1, 32) * f32.max,
        torch.tensor([6.0 * 2**10] + [1.0] * 31),  # amax exactly 6 * 2^k
        torch.tensor([1.5000001] + [0.1] * 31),
        # Every midpoint of the E2M1 grid at scale 1, both signs.
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2),
        torch.tensor([float("nan"), 3.0] + [-1.0] * 30),
        torch.tensor([float("inf"), 1e30] + [-1.0] * 30),
        torch.tensor([-0.1] + [6.0] * 31),  # -0.1 rounds to -0
    ]
    ties = blocks[8]
    blocks[8] = torch.cat([ties, -ties])
    return torch.cat(blocks).view(-1, HEAD_DIM)


def _keys(count: int, seed: int) -> torch.Tensor:
    """Random keys over 40 binary orders of magnitude, edge blocks first."""
    gen = torch.Generator().manual_seed(seed)
    edges = _edge_blocks()
    rand = torch.randn(count - edges.shape[0], HEAD_DIM, generator=gen)
    rand *= torch.exp2(torch.randint(-20, 20, (rand.shape[0], 1), generator=gen))
    return torch.cat([edges, rand.bfloat16().float()])


def test_the_reference_follows_aiters_rules():
    """Values of the reference itself, worked out by hand."""
    packed, scales = reference_quantize(_edge_blocks())
    packed, scales = packed.flatten(), scales.flatten()
    # 16 packed bytes and one scale byte per 32-value block.
    assert scales[0] == 1 and not packed[:16].any()  # zeros: 2^-126
    assert scales[6] == 127 + 10 and packed[96] == 0x07  # 6 * 2^10 -> 6, 1 -> 0
    # The midpoints at scale 1 take the even code: 0.25 -> 0, 0.75 -> 2,
    # 1.25 -> 2, 1.75 -> 4, 2.5 -> 4, 3.5 -> 6, 5 -> 6, 6 -> 7.
    assert scales[8] == 127
    assert packed[128:132].tolist() == [0x20, 0x42, 0x64, 0x76]
    assert packed[136:140].tolist() == [0xA8, 0xCA, 0xEC, 0xFE]
    assert scales[10] == 255 and packed[160:162].tolist() == [0x07, 0x88]  # inf
    assert scales[11] == 127 and packed[176] == 0x78  # -0.1 -> -0, then 6


# Bytes between two pages: vLLM's indexer cache is a view into a block-major
# pool, so a page's stride is larger than the page.
PAGE_GAP = 100


def _write(keys, slots, layout, pages, entries, device):
    """The pages after the writer ran, and the pool's bytes between pages."""
    row = mxfp4_indexer_row_bytes(HEAD_DIM)
    stride = entries * row + PAGE_GAP
    pool = torch.zeros(pages * stride, dtype=torch.uint8, device=device)
    cache = pool.as_strided((pages, entries, row), (stride, row, 1))
    check_mxfp4_indexer_cache(cache, HEAD_DIM)
    _write_keys_kernel[(keys.shape[0],)](
        keys.to(device),
        slots.to(device),
        cache,
        cache.stride(0),
        entries,
        HEAD_DIM,
        *layout,
    )
    gaps = pool.view(pages, stride)[:, entries * row :]
    return cache.cpu(), gaps.cpu()


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("entries", [64, 128])
def test_the_k_cache_writer_stores_aiters_bytes(layout, entries):
    """Keys written to shuffled slots over three pages of a strided pool
    (some slots -1, which write nothing): every byte of every page is the
    reference's, and nothing between the pages is written."""
    device = _device()
    pages, count = 3, 48
    keys = _keys(count, seed=entries + layout.n_per_tile)
    gen = torch.Generator().manual_seed(entries)
    slots = torch.randperm(pages * entries, generator=gen)[:count]
    slots[5::17] = -1
    got, gaps = _write(keys, slots, layout, pages, entries, device)
    assert not gaps.any(), "the writer wrote between pages"

    # Each page as the reference stores it; bytes of slots never written
    # stay zero.
    page_keys = torch.zeros(pages * entries, HEAD_DIM)
    written = torch.zeros(pages * entries, dtype=torch.bool)
    page_keys[slots[slots >= 0]] = keys[slots >= 0]
    written[slots[slots >= 0]] = True
    for page in range(pages):
        mine = slice(page * entries, (page + 1) * entries)
        want = page_order(*reference_quantize(page_keys[mine]), layout)
        kept = page_order(
            written[mine, None].expand(-1, HEAD_DIM // 2),
            written[mine, None].expand(-1, HEAD_DIM // 32),
            layout,
        )
        want = torch.where(kept, want, 0)
        assert torch.equal(got[page].flatten(), want), f"page {page}"


@pytest.mark.parametrize("heads", [32, 64])
def test_the_index_query_is_stored_as_aiters_bytes(heads):
    """The MXFP4 index query ([tokens, heads, D]) in its two contiguous
    buffers, as the logits kernel reads it."""
    device = _device()
    q = _keys(heads * 2, seed=heads).view(2, heads, HEAD_DIM)
    values = torch.zeros(2, heads, HEAD_DIM // 2, dtype=torch.uint8, device=device)
    scales = torch.zeros(2, heads, HEAD_DIM // 32, dtype=torch.uint8, device=device)
    _store_query_kernel[(2 * heads,)](q.to(device), values, scales, HEAD_DIM)
    want_values, want_scales = reference_quantize(q.view(-1, HEAD_DIM))
    assert torch.equal(values.cpu().view(-1, HEAD_DIM // 2), want_values)
    assert torch.equal(scales.cpu().view(-1, HEAD_DIM // 32), want_scales)


# Compiles both kernels for gfx950 in every layout, then prints "compiled".
_COMPILE = """
import runpy, sys
from vllm.triton_utils import HAS_TRITON, triton
if not HAS_TRITON or "amd" not in triton.backends.backends:
    print("unavailable: vLLM found no Triton, or Triton has no AMD backend")
    sys.exit()
ASTSource = triton.compiler.ASTSource
test = runpy.run_path(sys.argv[1])
target = triton.backends.compiler.GPUTarget("hip", "gfx950", 64)
writer = {"k_ptr": "*fp32", "slot_ptr": "*i64", "cache_ptr": "*u8",
          "page_stride": "i64", "page_entries": "i32"}
consts = ("HEAD_DIM", "N_PER_TILE", "D_PER_TILE", "SCALE_LANES")
for layout in test["LAYOUTS"]:
    values = dict(zip(consts, (test["HEAD_DIM"], *layout)))
    source = ASTSource(test["_write_keys_kernel"],
                       {**writer, **dict.fromkeys(consts, "constexpr")}, values)
    assert "hsaco" in triton.compile(source, target=target).asm, layout
query = {"q_ptr": "*fp32", "values_ptr": "*u8", "scales_ptr": "*u8",
         "HEAD_DIM": "constexpr"}
source = ASTSource(test["_store_query_kernel"], query, {"HEAD_DIM": test["HEAD_DIM"]})
assert "hsaco" in triton.compile(source, target=target).asm
print("compiled")
"""


def test_the_kernels_compile_for_gfx950():
    """Triton's compiler, not its interpreter: a process of its own without
    TRITON_INTERPRET, compiling for gfx950 on whatever machine runs this."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = done.stdout.strip().splitlines()[-1]
    if result.startswith("unavailable"):
        pytest.skip(result)
    assert result == "compiled"
