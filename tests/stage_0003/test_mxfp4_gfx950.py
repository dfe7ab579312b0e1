# SPDX-License-Identifier: Apache-2.0
"""Stage 0003 on gfx950 with the real AITER: the MXFP4 cache this stage
writes is the one AITER writes and reads. Skipped elsewhere.

- Layout: AITER's own K cache op fills a natural-order cache and a cache in
  the page order its ``cache_format`` reports; decoding both, and this
  stage's writer fed the same (already MXFP4) values, gives the same keys.
- Reading: ``paged_mxfp4_mqa_logits`` over this stage's cache picks what the
  FP8 indexer picks (same data through the FP8 cache and vLLM's torch
  logits), up to MXFP4 rounding, needles included.
"""

from __future__ import annotations

import pytest
import torch

from scripts.harness import mxfp4_reference as ref
from scripts.harness.rocm_platform import gfx950_aiter_mxfp4_skip_reason
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

SKIP_REASON = gfx950_aiter_mxfp4_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
HEAD_DIM, ROW, PAGE = 128, 68, 64
# DeepSeek-V3.2's 64 index heads and GLM-5.x's 32: AITER's kernels take other
# paths at 32 heads (rows per workgroup, the relaxed store).
HEAD_COUNTS = pytest.mark.parametrize("heads", [64, 32], ids=["64-heads", "32-heads"])


def _layout(heads: int):
    from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (
        rocm_paged_mxfp4_cache_layout,
    )

    return rocm_paged_mxfp4_cache_layout(heads, HEAD_DIM, PAGE)


@HEAD_COUNTS
def test_writer_layout_matches_aiter(heads):
    from aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache import (
        k_norm_rope_mxfp4_cache,
    )

    from scripts.harness.mxfp4_writer import indexer_k_mxfp4_quant_and_cache

    torch.manual_seed(0)
    tokens, pages = 300, 8
    layout = _layout(heads)
    k_pre = torch.randn(tokens, HEAD_DIM, device="cuda").bfloat16()
    pos = torch.arange(tokens, device="cuda")
    cos_sin = torch.randn(4096, 64, device="cuda")
    norm = torch.rand(HEAD_DIM, device="cuda") + 0.5
    slots = torch.randperm(pages * PAGE, device="cuda")[:tokens]
    natural = torch.zeros(tokens, 1, ROW, dtype=torch.uint8, device="cuda")
    theirs = torch.zeros(pages, PAGE, ROW, dtype=torch.uint8, device="cuda")
    args = (k_pre, pos, cos_sin, norm, 1e-6)
    k_norm_rope_mxfp4_cache(*args, natural, torch.arange(tokens, device="cuda"), 1)
    k_norm_rope_mxfp4_cache(*args, theirs, slots, 1, shuffle=layout)
    keys = ref.dequantize(
        natural[:, 0, : HEAD_DIM // 2], natural[:, 0, HEAD_DIM // 2 :]
    )
    ours = torch.zeros_like(theirs)
    indexer_k_mxfp4_quant_and_cache(keys.cuda(), slots, ours, layout)
    for cache in (theirs, ours):
        decoded = ref.dequantize(*ref.read_cache(cache, slots, layout, HEAD_DIM))
        assert torch.equal(decoded, keys)


@HEAD_COUNTS
def test_aiter_reads_our_cache_like_the_fp8_indexer(heads):
    from scripts.harness.mxfp4_writer import indexer_k_mxfp4_quant_and_cache
    from vllm.models.deepseek_v32.common.kernels import fused_q
    from vllm.v1.attention.ops import rocm_paged_mxfp4_indexer as ops

    torch.manual_seed(1)
    context, rows, topk = 8192, 4, 512
    layout = _layout(heads)
    keys = torch.randn(context, HEAD_DIM, device="cuda").bfloat16()
    q = torch.randn(rows, heads, HEAD_DIM, device="cuda").bfloat16()
    w = torch.rand(rows, heads, device="cuda")
    # needles: keys along each row's weighted query
    direction = (q.float() * w[..., None]).sum(1)
    needles = torch.arange(rows, device="cuda") * 1000 + 17
    keys[needles] = (direction / direction.norm(dim=-1, keepdim=True) * 40).bfloat16()
    pages = context // PAGE
    cache = torch.zeros(pages, PAGE, ROW, dtype=torch.uint8, device="cuda")
    block_table = torch.randperm(pages, device="cuda", dtype=torch.int32)
    slots = block_table.long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")
    indexer_k_mxfp4_quant_and_cache(keys, slots.flatten(), cache, layout)
    cos_sin = torch.cat([torch.ones(4096, 32), torch.zeros(4096, 32)], -1).cuda()
    (q_values, q_scales), weights, _ = fused_q(
        torch.full((rows,), 5, dtype=torch.int64, device="cuda"),
        torch.randn(rows, 2, 64, device="cuda").bfloat16(),
        cos_sin,
        q,
        cos_sin,
        torch.randn(rows, 2, 32, device="cuda").bfloat16(),
        torch.ones(1, device="cuda"),
        w,
        1.0,
        1.0,
        quantize_mqa=False,
        index_q_mxfp4=True,
    )
    logits = torch.full((rows, context), float("-inf"), device="cuda")
    ops._aiter().paged_mxfp4_mqa_logits(
        q_values[:, None],
        q_scales[:, None],
        cache[:, :, None],
        weights,
        torch.full((rows,), context, dtype=torch.int32, device="cuda"),
        block_table[None].expand(rows, -1).contiguous(),
        context,
        out_logits=logits,
    )
    mxfp4 = logits.topk(topk).indices
    amax = keys.float().abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    k_fp8 = (keys.float() / scale).to(torch.float8_e4m3fn).float() * scale
    fp8 = (torch.einsum("rhd,kd->rhk", q.float(), k_fp8).relu() * w[..., None]).sum(1)
    fp8 = fp8.topk(topk).indices
    assert bool((needles[:, None] == mxfp4).any(-1).all())
    overlap = (mxfp4[:, :, None] == fp8[:, None, :]).any(-1).float().mean()
    assert overlap >= 0.75, overlap
