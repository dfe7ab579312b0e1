# SPDX-License-Identifier: Apache-2.0
"""Stage 0003: DeepSeek-V3.2's fused kernels on the MXFP4 indexer path.

``fused_norm_rope`` writes the key after its LayerNorm and RoPE into the
paged MXFP4 cache, and ``fused_q`` emits the index query as MXFP4 values and
e8m0 scales with the weights the MXFP4 logits expect. Both through the real
patched kernels: Triton's interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from scripts.harness import compiled_stub
from scripts.harness import mxfp4_reference as ref
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")
if torch.cuda.is_available():
    # The DeepSeek-V3.2 package imports its CUDA model otherwise.
    compiled_stub.use_generic_platform()

from vllm.models.deepseek_v32.common.kernels import (  # noqa: E402
    fused_norm_rope,
    fused_q,
)
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmPagedMxfp4CacheLayout,
)

HEAD_DIM, ROPE_DIM, INDEX_HEADS = 128, 64, 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(
    autouse=True,
    params=[
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not INTERPRETED, reason="CPU runs need TRITON_INTERPRET=1"
            ),
        ),
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                INTERPRETED or not torch.cuda.is_available(),
                reason="compiles the kernels for a GPU (H200 device)",
            ),
        ),
    ],
)
def device(request):
    """Every tensor the test makes lives on this device."""
    torch.set_default_device(request.param)
    yield request.param
    torch.set_default_device("cpu")


# AITER's gfx950 layouts: n_per_tile 32 (32 heads or more: GLM-5.x's 32 and
# DeepSeek-V3.2's 64) and 16 (fewer than 32 heads).
LAYOUTS = [RocmPagedMxfp4CacheLayout(32, 16, 2), RocmPagedMxfp4CacheLayout(16, 16, 4)]
MAX_POS = 512


def _cos_sin(identity: bool = False) -> torch.Tensor:
    if identity:
        return torch.cat(
            [torch.ones(MAX_POS, ROPE_DIM // 2), torch.zeros(MAX_POS, ROPE_DIM // 2)],
            -1,
        )
    angles = torch.rand(MAX_POS, ROPE_DIM // 2) * 6.3
    return torch.cat([angles.cos(), angles.sin()], -1)


def _norm_rope(tokens, cache, slots, interleave, index_k_out, layout):
    torch.manual_seed(0)
    q_dim, kv_dim = 64, 64
    positions = torch.randint(0, MAX_POS, (tokens,))
    index_k = torch.randn(tokens, HEAD_DIM).to(torch.bfloat16)
    fused_norm_rope(
        positions,
        torch.randn(tokens, q_dim).to(torch.bfloat16),
        torch.ones(q_dim),
        1e-6,
        torch.randn(tokens, kv_dim).to(torch.bfloat16),
        torch.ones(kv_dim),
        1e-6,
        torch.randn(tokens, ROPE_DIM).to(torch.bfloat16),
        _cos_sin(),
        index_k,
        torch.rand(HEAD_DIM) + 0.5,
        torch.randn(HEAD_DIM) * 0.1,
        1e-6,
        _cos_sin(),
        torch.zeros(tokens, 64, dtype=torch.int32),
        slot_mapping=slots,
        indexer_k_cache=cache,
        indexer_cache_mxfp4_layout=layout,
        index_rope_interleave=interleave,
        index_k_out=index_k_out,
    )


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("entries", [64, 128])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_fused_norm_rope_writes_mxfp4_cache(interleave, entries, layout):
    """The bytes in the cache are the reference's quantisation of the very key
    the kernel computed (its fp32 LayerNorm + RoPE output), at its slot, where
    AITER's reader reads them."""
    tokens = 24
    cache = torch.zeros(2, entries, 68, dtype=torch.uint8)
    slots = torch.randperm(2 * entries)[:tokens]
    slots[5] = -1  # a padded token writes nothing
    index_k_out = torch.empty(tokens, HEAD_DIM)
    _norm_rope(tokens, cache, slots, interleave, index_k_out, layout)
    cache, slots, index_k_out = cache.cpu(), slots.cpu(), index_k_out.cpu()
    want = torch.zeros_like(cache)
    ref.write_cache(want, slots, index_k_out, layout)
    assert torch.equal(cache, want)
    assert cache.any()


def test_fused_norm_rope_refuses_an_mxfp4_head_dim_that_is_no_power_of_two():
    """The MXFP4 store's tl.arange extents (D // 2 values, D // 32 scales)
    must be powers of two: a 96-value index key stops at an assert naming the
    head dim, not at a Triton compile error."""
    tokens, dim = 2, 96
    with pytest.raises(AssertionError, match="power-of-two head dim, got 96"):
        fused_norm_rope(
            torch.zeros(tokens, dtype=torch.int64),
            torch.randn(tokens, 64).to(torch.bfloat16),
            torch.ones(64),
            1e-6,
            torch.randn(tokens, 64).to(torch.bfloat16),
            torch.ones(64),
            1e-6,
            torch.randn(tokens, ROPE_DIM).to(torch.bfloat16),
            _cos_sin(),
            torch.randn(tokens, dim).to(torch.bfloat16),
            torch.ones(dim),
            torch.zeros(dim),
            1e-6,
            _cos_sin(),
            torch.zeros(tokens, 64, dtype=torch.int32),
            slot_mapping=torch.arange(tokens),
            indexer_k_cache=torch.zeros(1, 64, dim // 2 + dim // 32, dtype=torch.uint8),
            indexer_cache_mxfp4_layout=LAYOUTS[0],
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_fused_norm_rope_follows_the_page_stride_of_vllms_pool(layout):
    """vLLM hands the indexer cache as a strided view into its block-major
    pool: the store follows the page stride and touches nothing between
    pages."""
    entries, pages, tokens = 64, 3, 40
    stride = entries * 68 + 4096
    pool = torch.zeros(pages * stride, dtype=torch.uint8)
    cache = torch.as_strided(pool, (pages, entries, 68), (stride, 68, 1))
    slots = torch.randperm(pages * entries)[:tokens]
    index_k_out = torch.empty(tokens, HEAD_DIM)
    _norm_rope(tokens, cache, slots, False, index_k_out, layout)
    assert not pool.view(pages, stride)[:, entries * 68 :].any().item()
    want = torch.zeros(pages, entries, 68, dtype=torch.uint8, device="cpu")
    ref.write_cache(want, slots.cpu(), index_k_out.cpu(), layout)
    assert torch.equal(cache.cpu(), want)


def _fused_q(index_q, weights, cos_sin, mxfp4: bool):
    tokens, heads = index_q.shape[:2]
    q_heads = 2
    return fused_q(
        torch.arange(tokens, dtype=torch.int64),
        torch.randn(tokens, q_heads, ROPE_DIM).to(torch.bfloat16),
        _cos_sin(),
        index_q,
        cos_sin,
        torch.randn(tokens, q_heads, 32).to(torch.bfloat16),
        torch.ones(1),
        weights,
        HEAD_DIM**-0.5,
        heads**-0.5,
        quantize_mqa=False,
        index_q_mxfp4=mxfp4,
    )


@pytest.mark.parametrize("heads", [INDEX_HEADS, 32, 64])
def test_fused_q_mxfp4_values_scales_and_weights(heads):
    """With RoPE at the identity the query reaches the quantiser unchanged:
    values and scales are bit-exact with the reference, shaped as
    paged_mxfp4_mqa_logits takes them ([T, H, D/2] and [T, H, D/32] uint8),
    and the weights carry the softmax and head scales but no query scale.
    GLM-5.x has 32 index heads, DeepSeek-V3.2 64."""
    torch.manual_seed(3)
    tokens = 6 if heads == INDEX_HEADS else 2
    index_q = (torch.randn(tokens, heads, HEAD_DIM) * 7).to(torch.bfloat16)
    weights = torch.randn(tokens, heads)
    index_q_out, weights_out, _ = _fused_q(
        index_q, weights, _cos_sin(identity=True), mxfp4=True
    )
    values, scales = index_q_out.values, index_q_out.scales
    want_values, want_scales = ref.quantize(index_q.float())
    assert values.dtype == scales.dtype == torch.uint8
    assert values.shape == (tokens, heads, HEAD_DIM // 2)
    assert scales.shape == (tokens, heads, HEAD_DIM // 32)
    assert torch.equal(values.cpu(), want_values)
    assert torch.equal(scales.cpu(), want_scales)
    assert torch.equal(weights_out, weights * HEAD_DIM**-0.5 * heads**-0.5)


def test_fused_q_mxfp4_with_rope_decodes_to_the_rotated_query():
    """With a real rotation the decoded query is the rotated one within one
    E2M1 step of its block scale (rounding of the rotation may move a tie)."""
    torch.manual_seed(4)
    tokens = 5
    index_q = torch.randn(tokens, INDEX_HEADS, HEAD_DIM).to(torch.bfloat16)
    cos_sin = _cos_sin()
    (values, scales), _, _ = _fused_q(
        index_q, torch.ones(tokens, INDEX_HEADS), cos_sin, True
    )
    # NeoX rotation of the first ROPE_DIM dims, in fp32
    q = index_q.float().cpu()
    cos, sin = cos_sin[:tokens, None].cpu().chunk(2, -1)
    x1, x2 = q[..., : ROPE_DIM // 2], q[..., ROPE_DIM // 2 : ROPE_DIM]
    rotated = torch.cat(
        [x1 * cos - x2 * sin, x2 * cos + x1 * sin, q[..., ROPE_DIM:]], -1
    )
    decoded = ref.dequantize(values, scales)
    scale = torch.pow(2.0, scales.cpu().float() - 127).repeat_interleave(32, -1)
    assert bool(((decoded - rotated).abs() <= scale).all())


def test_fused_q_fp8_path_unchanged():
    """Without index_q_mxfp4 the FP8 query keeps its contract: an fp8 tensor
    of the query's shape and the query scale folded into the weights."""
    torch.manual_seed(5)
    tokens = 4
    index_q = torch.randn(tokens, INDEX_HEADS, HEAD_DIM).to(torch.bfloat16)
    weights = torch.randn(tokens, INDEX_HEADS)
    q_fp8, weights_out, _ = _fused_q(index_q, weights, _cos_sin(identity=True), False)
    assert isinstance(q_fp8, torch.Tensor) and q_fp8.shape == index_q.shape
    assert q_fp8.element_size() == 1
    amax = index_q.float().abs().amax(-1)
    fp8_max = torch.finfo(q_fp8.dtype).max
    fp8_max = 224.0 if fp8_max == 240.0 else fp8_max
    q_scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-4) / fp8_max)))
    want = weights * q_scale * HEAD_DIM**-0.5 * INDEX_HEADS**-0.5
    torch.testing.assert_close(weights_out, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        q_fp8.float() * q_scale[..., None], index_q.float(), rtol=0.07, atol=1e-3
    )


def test_fused_q_of_a_layer_that_skips_its_mxfp4_indexer():
    """An MTP draft layer reusing the target's top-k keeps its MXFP4 indexer
    but skips it (has_indexer=False): fused_q makes the MLA query and no
    index query. Compiled (cuda), the MXFP4 store was traced for the
    1-element dummy index query and failed to compile; the interpreter never
    saw it."""
    torch.manual_seed(6)
    tokens, q_heads = 3, 2
    q_pe = torch.randn(tokens, q_heads, ROPE_DIM).to(torch.bfloat16)
    index_q, weights_out, q_pe_out = fused_q(
        torch.arange(tokens, dtype=torch.int64),
        q_pe,
        _cos_sin(identity=True),
        None,
        None,
        torch.randn(tokens, q_heads, 32).to(torch.bfloat16),
        torch.ones(1),
        None,
        0.0,
        0.0,
        has_indexer=False,
        quantize_mqa=False,
        index_q_mxfp4=True,
    )
    assert isinstance(index_q, torch.Tensor), "no MXFP4 index query is made"
    torch.testing.assert_close(q_pe_out, q_pe)  # RoPE at the identity
