# SPDX-License-Identifier: Apache-2.0
"""Stage 0003's glue in DeepSeek-V3.2's ROCm attention layer, run for real
with the published models' shapes (DeepSeek-V3.2: 64 index heads, GLM-5.x:
32): with the MXFP4 cache the layer builds RocmSparseAttnIndexer, hands
fused_norm_rope the page order AITER reports for its head count, asks
fused_q for the MXFP4 query and passes (values, scales) to the indexer;
with FP8 it keeps SparseAttnIndexer and the FP8 calls. An MTP draft layer
that reuses the target's top-k (index_share_for_mtp_iteration) keeps its
MXFP4 indexer but skips it: it runs through both fused kernels without an
index query and writes no index key.

The layer is built and run by scripts/harness/dsa_attention.py (the parent
constructor sets only what the glue reads); the fused kernels run for real
(interpreted on the CPU; tests/gfx_compile compiles them for gfx950 in every
layer kind)."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import dsa_attention
from scripts.harness import mxfp4_reference as ref
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmSparseAttnIndexer,
)
from vllm.model_executor.layers.sparse_attn_indexer import (  # noqa: E402
    SparseAttnIndexer,
)
from vllm.models.deepseek_v32.amd import rocm  # noqa: E402
from vllm.models.deepseek_v32.common.mxfp4_indexer_cache import (  # noqa: E402
    Mxfp4IndexQuery,
)
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmPagedMxfp4CacheLayout,
)

TOKENS, PAGE, TP = 2, 64, 8
LAYOUT = RocmPagedMxfp4CacheLayout(32, 16, 2)
MODELS = [
    pytest.param(dsa_attention.DEEPSEEK_V32, id="deepseek-v32-64-heads"),
    pytest.param(dsa_attention.GLM5, id="glm5-32-heads"),
]


def _assert_keys_cached(layer, handed_on) -> None:
    """Each token's 68-byte key is on the cache at its slot (read where
    AITER's reader reads it) and nothing else is written."""
    cache = layer.indexer.k_cache.kv_cache
    _, scales = ref.read_cache(cache, handed_on.slots, LAYOUT, 128)
    assert bool((scales != 0).all()), "every key has its e8m0 scales"
    assert int(cache.count_nonzero()) <= TOKENS * 68


def _run(monkeypatch, model, kv_dtype: str, kind: str):
    """Build the layer and run its _fused_attention; returns the layer, the
    fused kernels' keyword arguments and what the layer handed on."""
    calls: dict = {}

    def recorded(name, kernel):
        def call(*args, **kwargs):
            calls[name] = kwargs
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(
        rocm, "fused_norm_rope", recorded("fused_norm_rope", rocm.fused_norm_rope)
    )
    monkeypatch.setattr(rocm, "fused_q", recorded("fused_q", rocm.fused_q))
    config = dsa_attention.make_config(model, kv_dtype, PAGE)
    with emulate_rocm("gfx950"), set_current_vllm_config(config):
        layer = dsa_attention.build_layer(monkeypatch, config, model, kind, tp=TP)
        handed_on = dsa_attention.run_attention(monkeypatch, layer, TOKENS)
    return layer, calls, handed_on


@pytest.mark.parametrize("model", MODELS)
def test_mxfp4_layer_glue(monkeypatch, model):
    layer, calls, handed_on = _run(monkeypatch, model, "mxfp4", "target")
    assert type(layer.indexer_op) is RocmSparseAttnIndexer
    assert layer.indexer_op.skip_k_cache_insert
    norm_rope = calls["fused_norm_rope"]
    assert norm_rope["indexer_k_cache"] is layer.indexer.k_cache.kv_cache
    # AITER's cache_format: n_per_tile 32 for 32 heads and for 64 (its
    # mfma_nonk_dim; the stand-in cites it).
    assert norm_rope["indexer_cache_mxfp4_layout"] == LAYOUT
    assert calls["fused_q"]["index_q_mxfp4"] is True
    # The query reaches the indexer as (values, scales), one row per head.
    _, index_q, weights = handed_on.indexer_args
    assert isinstance(index_q, Mxfp4IndexQuery)
    heads, dim = model.index_n_heads, model.index_head_dim
    assert index_q.values.shape == (TOKENS, heads, dim // 2)
    assert index_q.scales.shape == (TOKENS, heads, dim // 32)
    assert weights.shape == (TOKENS, heads)
    _assert_keys_cached(layer, handed_on)


@pytest.mark.parametrize("model", MODELS)
def test_fp8_layer_keeps_the_fp8_calls(monkeypatch, model):
    layer, calls, handed_on = _run(monkeypatch, model, "fp8", "target")
    assert type(layer.indexer_op) is SparseAttnIndexer
    assert calls["fused_norm_rope"]["indexer_cache_mxfp4_layout"] is None
    assert calls["fused_q"]["index_q_mxfp4"] is False
    _, index_q, _ = handed_on.indexer_args
    assert isinstance(index_q, torch.Tensor) and index_q.element_size() == 1


@pytest.mark.parametrize("model", MODELS)
def test_mtp_draft_reusing_the_targets_topk_serves_on_the_mxfp4_cache(
    monkeypatch, model
):
    """index_share_for_mtp_iteration: the draft layer keeps its MXFP4
    indexer (and cache) but skips it; both fused kernels run without an
    index query or key, and the MLA query is made as usual."""
    layer, calls, handed_on = _run(monkeypatch, model, "mxfp4", "mtp-reuse")
    assert layer.indexer is not None and layer.indexer_mxfp4 and layer.skip_topk
    assert calls["fused_norm_rope"]["has_indexer"] is False
    assert calls["fused_q"]["has_indexer"] is False
    assert handed_on.indexer_args is None, "the shared top-k is not recomputed"
    assert not layer.indexer.k_cache.kv_cache.any(), "no index key is written"
    local_heads = model.num_attention_heads // TP
    assert handed_on.mqa_q.shape == (
        TOKENS,
        local_heads,
        model.kv_lora_rank + model.qk_rope_head_dim,
    )


@pytest.mark.parametrize("model", MODELS)
def test_mtp_draft_with_its_own_indexer_scores_on_the_mxfp4_cache(monkeypatch, model):
    layer, calls, handed_on = _run(monkeypatch, model, "mxfp4", "mtp")
    assert calls["fused_q"]["has_indexer"] is True
    assert isinstance(handed_on.indexer_args[1], Mxfp4IndexQuery)
    _assert_keys_cached(layer, handed_on)


def test_mxfp4_query_reaches_the_indexer_as_values_and_scales(monkeypatch):
    """_run_indexer hands fused_q's (values, scales) pair to forward_hip."""
    model = dsa_attention.GLM5
    config = dsa_attention.make_config(model, "mxfp4", PAGE)
    with emulate_rocm("gfx950"), set_current_vllm_config(config):
        layer = dsa_attention.build_layer(monkeypatch, config, model, "target")
    seen = []
    monkeypatch.setattr(
        RocmSparseAttnIndexer, "forward_hip", lambda self, *args: seen.append(args)
    )
    heads = model.index_n_heads
    pair = (torch.zeros(TOKENS, heads, 64), torch.zeros(TOKENS, heads, 4))
    weights = torch.ones(TOKENS, heads)
    layer._run_indexer(torch.zeros(TOKENS, 4), pair, weights)
    assert seen and seen[0][1] is pair and seen[0][3] is weights
