# SPDX-License-Identifier: Apache-2.0
"""Stage 0003's glue in DeepSeek-V3.2's ROCm attention layer, run for real:
with the MXFP4 cache the layer builds RocmSparseAttnIndexer, hands
fused_norm_rope the page order aiter reports for its cache, asks fused_q for
the MXFP4 query and passes (values, scales) to the indexer; with FP8 it
keeps SparseAttnIndexer and the FP8 calls.

The MLA machinery around the glue (the parent constructor, projections, the
attention kernel) cannot be built on CPU without weights and a TP group, so
the parent constructor sets only what the glue reads, and the two fused
kernels are recorded instead of run (their MXFP4 paths are tested in
test_mxfp4_fused_kernels.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.harness import indexer_batch
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
from vllm.models.deepseek_v32 import attention as v32_attention  # noqa: E402
from vllm.models.deepseek_v32.amd import rocm  # noqa: E402
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmPagedMxfp4CacheLayout,
)

HEAD_DIM, INDEX_HEADS, PAGE, TOKENS = 128, 8, 64, 3
LAYER = "model.layers.0.self_attn"


class Stop(Exception):
    """Raised by the recorded fused_q: the glue under test is done by then."""


def _config(kv_dtype: str):
    config = indexer_batch.make_vllm_config()
    hf = SimpleNamespace(
        model_type="deepseek_v32",
        architectures=["DeepseekV32ForCausalLM"],
        index_n_heads=INDEX_HEADS,
        index_head_dim=HEAD_DIM,
    )
    config.model_config.hf_config = config.model_config.hf_text_config = hf
    config.attention_config.indexer_kv_dtype = kv_dtype
    config.cache_config.block_size = PAGE
    return config


def _layer(monkeypatch, config):
    """DeepseekV32MLAAttention whose parent constructor sets only what the
    glue reads: the indexer with its real ROCm K cache."""
    row = 68 if config.attention_config.indexer_kv_dtype == "mxfp4" else 132
    cache = rocm.DeepseekV32ROCmIndexerCache(
        head_dim=row,
        dtype=torch.uint8,
        prefix=f"{LAYER}.indexer.k_cache",
        cache_config=config.cache_config,
    )
    cache.kv_cache = torch.zeros(4, PAGE, row, dtype=torch.uint8)
    indexer = SimpleNamespace(
        k_cache=cache,
        quant_block_size=128,
        scale_fmt="ue8m0",
        topk_tokens=2048,
        head_dim=HEAD_DIM,
        n_head=INDEX_HEADS,
        max_model_len=4096,
        max_total_seq_len=4096,
        softmax_scale=HEAD_DIM**-0.5,
        k_norm=SimpleNamespace(weight=torch.ones(HEAD_DIM), bias=None, eps=1e-6),
        wq_b=lambda q_c: (torch.zeros(q_c.shape[0], INDEX_HEADS * HEAD_DIM),),
    )

    def parent_init(self, *args, **kwargs):
        torch.nn.Module.__init__(self)
        self.indexer = indexer
        self.kv_cache_dtype = "auto"

    monkeypatch.setattr(v32_attention.DeepseekV32Attention, "__init__", parent_init)
    layer = rocm.DeepseekV32MLAAttention(config, None, LAYER)
    norm = SimpleNamespace(weight=torch.ones(1), variance_epsilon=1e-6)
    rope = SimpleNamespace(cos_sin_cache=torch.zeros(8, 64))
    for name, value in dict(
        layer_name=LAYER,
        skip_topk=False,
        q_a_layernorm=norm,
        kv_a_layernorm=norm,
        rotary_emb=rope,
        indexer_rope_emb=rope,
        kv_cache=torch.zeros(1),
        _k_scale=torch.ones(1),
        _k_scale_float=1.0,  # read by vLLM 0.33.0's layer
        _q_scale=torch.ones(1),
        topk_indices_buffer=torch.zeros(TOKENS, 2048, dtype=torch.int32),
        _index_rope_interleave=False,
    ).items():
        object.__setattr__(layer, name, value)
    return layer


def _run(monkeypatch, layer):
    """The layer's _fused_attention up to fused_q; returns both calls."""
    calls: dict = {}

    def norm_rope(*args, **kwargs):
        calls["fused_norm_rope"] = kwargs
        return args[1]

    def q(*args, **kwargs):
        calls["fused_q"] = kwargs
        raise Stop

    monkeypatch.setattr(rocm, "fused_norm_rope", norm_rope)
    monkeypatch.setattr(rocm, "fused_q", q)
    monkeypatch.setattr(
        rocm,
        "get_forward_context",
        lambda: SimpleNamespace(
            attn_metadata={LAYER: object()}, slot_mapping={LAYER: torch.arange(3)}
        ),
    )
    monkeypatch.setattr(layer, "_use_sparse_mha", lambda metadata: False)
    monkeypatch.setattr(
        layer, "_compute_ql_nope", lambda q_c: (torch.zeros(1), torch.zeros(1))
    )
    x = torch.zeros(TOKENS, 4)
    with pytest.raises(Stop):
        layer._fused_attention(
            torch.arange(TOKENS), x, x, x, x, torch.zeros(TOKENS, INDEX_HEADS), x
        )
    return calls


def test_mxfp4_layer_glue(monkeypatch):
    config = _config("mxfp4")
    with emulate_rocm("gfx950"), set_current_vllm_config(config):
        layer = _layer(monkeypatch, config)
        calls = _run(monkeypatch, layer)
    assert type(layer.indexer_op) is RocmSparseAttnIndexer
    assert layer.indexer_op.skip_k_cache_insert
    norm_rope = calls["fused_norm_rope"]
    assert norm_rope["indexer_k_cache"] is layer.indexer.k_cache.kv_cache
    # the page order the stand-in AITER's cache_format reports for 64 entries
    assert norm_rope["indexer_cache_mxfp4_layout"] == RocmPagedMxfp4CacheLayout(
        16, 16, 4
    )
    assert calls["fused_q"]["index_q_mxfp4"] is True


def test_fp8_layer_keeps_the_fp8_calls(monkeypatch):
    config = _config("fp8")
    with emulate_rocm("gfx950"), set_current_vllm_config(config):
        layer = _layer(monkeypatch, config)
        calls = _run(monkeypatch, layer)
    assert type(layer.indexer_op) is SparseAttnIndexer
    assert calls["fused_norm_rope"]["indexer_cache_mxfp4_layout"] is None
    assert calls["fused_q"]["index_q_mxfp4"] is False


def test_mxfp4_query_reaches_the_indexer_as_values_and_scales(monkeypatch):
    """_run_indexer hands fused_q's (values, scales) pair to forward_hip."""
    config = _config("mxfp4")
    with emulate_rocm("gfx950"), set_current_vllm_config(config):
        layer = _layer(monkeypatch, config)
    seen = []
    monkeypatch.setattr(
        RocmSparseAttnIndexer, "forward_hip", lambda self, *args: seen.append(args)
    )
    pair = (torch.zeros(TOKENS, INDEX_HEADS, 64), torch.zeros(TOKENS, INDEX_HEADS, 4))
    weights = torch.ones(TOKENS, INDEX_HEADS)
    layer._run_indexer(torch.zeros(TOKENS, 4), pair, weights)
    assert seen and seen[0][1] is pair and seen[0][3] is weights
