# SPDX-License-Identifier: Apache-2.0
"""A stand-alone MXFP4 K cache writer for tests and the benchmark: the
applied tree's own ``mxfp4_quantize`` and ``mxfp4_paged_cache_store`` (the
Triton helpers ``fused_norm_rope`` stores with) in a kernel of their own, so
the quantiser and the page layout can be checked over many keys and layouts
without the rest of ``fused_norm_rope``. vLLM itself has no such kernel."""

from __future__ import annotations

import torch

from vllm.models.deepseek_v32.common.mxfp4_indexer_cache import (
    MXFP4_BLOCK_SIZE,
    mxfp4_paged_cache_store,
    mxfp4_quantize,
)
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.rocm_dsa_mxfp4_cache import check_mxfp4_indexer_cache
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import RocmPagedMxfp4CacheLayout

# Keys per program and warps: the fastest of 1-128 keys x 1-8 warps on an
# H200 (docs/mxfp4_indexer_cache_bench.md).
TOKENS = 16
NUM_WARPS = 2


@triton.jit
def _indexer_k_mxfp4_quant_and_cache_kernel(
    k_ptr,
    k_stride,
    slot_mapping_ptr,
    num_tokens,
    cache_ptr,
    page_stride,
    page_entries,
    HEAD_DIM: tl.constexpr,
    N_PER_TILE: tl.constexpr,
    D_PER_TILE: tl.constexpr,
    SCALE_LANES: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * TOKENS_PER_PROGRAM + tl.arange(
        0, TOKENS_PER_PROGRAM
    )
    in_range = tokens < num_tokens
    k = tl.load(
        k_ptr + tokens[:, None] * k_stride + tl.arange(0, HEAD_DIM)[None, :],
        mask=in_range[:, None],
        other=0.0,
    )
    packed, scales = mxfp4_quantize(k, TOKENS_PER_PROGRAM, HEAD_DIM)
    mxfp4_paged_cache_store(
        packed,
        scales,
        tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1),
        cache_ptr,
        page_stride,
        page_entries,
        HEAD_DIM,
        N_PER_TILE,
        D_PER_TILE,
        SCALE_LANES,
    )


def indexer_k_mxfp4_quant_and_cache(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: RocmPagedMxfp4CacheLayout,
) -> None:
    """Quantise ``k`` [T, D] to MXFP4 and write token t at ``slot_mapping[t]``
    (skipped when negative). The same store ``fused_norm_rope`` makes after
    the key's LayerNorm and RoPE, as a kernel of its own."""
    num_tokens, head_dim = k.shape
    assert k.stride(1) == 1 and slot_mapping.shape == (num_tokens,)
    check_mxfp4_indexer_cache(kv_cache, head_dim)
    # The layout is the test's own here, not one rocm_paged_mxfp4_cache_layout
    # checked against AITER's cache_format: check that it tiles the page.
    npt, dpt, lanes = layout
    assert not (kv_cache.shape[1] % npt or (head_dim // 2) % dpt), layout
    assert not (head_dim // MXFP4_BLOCK_SIZE) % lanes, layout
    if num_tokens == 0:
        return
    _indexer_k_mxfp4_quant_and_cache_kernel[(triton.cdiv(num_tokens, TOKENS),)](
        k,
        k.stride(0),
        slot_mapping,
        num_tokens,
        kv_cache,
        kv_cache.stride(0),
        kv_cache.shape[1],
        head_dim,
        layout.n_per_tile,
        layout.d_per_tile,
        layout.scale_lanes,
        TOKENS,
        num_warps=NUM_WARPS,
    )
