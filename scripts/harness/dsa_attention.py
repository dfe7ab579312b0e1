# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V3.2's ROCm attention layer (``vllm/models/deepseek_v32/amd/
rocm.py``) built as a served model builds it, for each kind of layer a DSA
model serves, and run through its fused kernels.

The MLA machinery around the glue (the parent constructor, the projections,
the attention kernel) cannot be built on a CPU without weights and a TP
group, so the parent constructor sets only what the layer's own code reads,
with the shapes of the published model: the indexer with its real ROCm K
cache (sized by the layer's own ``k_cache_row_bytes``), vLLM's own norms
(made under the model dtype, as a served model makes them), the rotary
tables, the MLA KV cache in the layer's shape, the projections (their
outputs, random, in the model dtype). ``run_attention`` then runs the
layer's real ``forward``: ``fused_norm_rope`` and ``fused_q`` with the
arguments (views, strides, dtypes) the layer computes, up to the indexer
call (recorded, not run) and the MLA kernel (not reached).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from scripts.harness import indexer_batch


@dataclass(frozen=True)
class DsaModel:
    """The attention shapes of a DSA model's published config."""

    name: str
    model_type: str
    architecture: str
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    indexer_rope_interleave: bool
    # The dtype of the rotary tables the fused kernels read (see below).
    rope_cache_dtype: torch.dtype = torch.float32


# transformers 5.19.0, models/deepseek_v32/configuration_deepseek_v32.py
# lines 88-124 (the defaults are deepseek-ai/DeepSeek-V3.2's config) and
# models/glm_moe_dsa/configuration_glm_moe_dsa.py lines 93-129 (GLM-5's:
# index_n_heads 32). DeepSeek-V3.2 rotates its index query NeoX-style (no
# indexer_rope_interleave in its config); GLM-5.2 sets indexer_rope_interleave
# (vLLM 0.32.0, deepseek_v32/common/kernels.py, "interleaved for GLM-5.2");
# whether every GLM-5.x release does is an assumption, so both are covered.
# Rotary tables: DeepSeek-V3.2's deepseek_yarn RoPE keeps an fp32 table
# (vLLM 0.32.0, rotary_embedding/deepseek_scaling_rope.py line 242); a plain
# RoPE casts its table to the model dtype (rotary_embedding/base.py line 61),
# bf16. Which one a GLM-5.x checkpoint uses depends on its rope_parameters,
# so the two GLM-5.x entries take one each.
DEEPSEEK_V32 = DsaModel(
    "DeepSeek-V3.2", "deepseek_v32", "DeepseekV32ForCausalLM",
    128, 1536, 512, 128, 64, 128, 64, 128, False, torch.float32,
)  # fmt: skip
GLM5 = DsaModel(
    "GLM-5.x", "glm_moe_dsa", "GlmMoeDsaForCausalLM",
    64, 2048, 512, 192, 64, 256, 32, 128, True, torch.bfloat16,
)  # fmt: skip
GLM5_NEOX = replace(
    GLM5,
    name="GLM-5.x (NeoX index RoPE, fp32 rotary table)",
    indexer_rope_interleave=False,
    rope_cache_dtype=torch.float32,
)
MODELS = (DEEPSEEK_V32, GLM5, GLM5_NEOX)

# What a layer does with the indexer, by where it sits in the model:
# "target": a model layer with its own indexer; "target-shared": a model
# layer that reuses an earlier layer's top-k (index_topk_freq > 1), built
# without an indexer; "mtp": an MTP draft layer scoring with its own
# indexer; "mtp-reuse": an MTP draft layer reusing the target's top-k
# (index_share_for_mtp_iteration: deepseek_v32/amd/mtp.py set_skip_topk),
# which keeps its indexer but skips it. ("mtp" runs the same glue as
# "target": an MTP layer always builds its indexer, attention.py line 194;
# it is listed so that each layer kind a model serves is named.)
LAYER_KINDS = ("target", "target-shared", "mtp", "mtp-reuse")
LAYER = "model.layers.0.self_attn"
MAX_POSITIONS = 4096


class StopAttention(Exception):
    """Raised where the layer would start the MLA kernel: the glue is done."""


def make_config(model: DsaModel, kv_dtype: str, page: int):
    """A VllmConfig for ``model`` with the indexer cache ``kv_dtype``."""
    from transformers import AutoConfig

    config = indexer_batch.make_vllm_config()
    # The model type's own transformers config (its defaults are the
    # published checkpoint's), with the shapes above.
    hf = AutoConfig.for_model(
        model.model_type,
        architectures=[model.architecture],
        num_attention_heads=model.num_attention_heads,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        index_n_heads=model.index_n_heads,
        index_head_dim=model.index_head_dim,
        index_topk=2048,
    )
    config.model_config.hf_config = config.model_config.hf_text_config = hf
    config.attention_config.indexer_kv_dtype = kv_dtype
    config.cache_config.block_size = page
    return config


@dataclass
class AttentionCall:
    """What one ``_fused_attention`` call handed on: the indexer's inputs
    (None when the layer skips its indexer) and the MLA query; and the
    cache slots of its tokens."""

    slots: torch.Tensor
    indexer_args: tuple | None = None
    mqa_q: Any = None


def build_layer(monkeypatch, config, model: DsaModel, kind: str, *, tp: int = 1):
    """``DeepseekV32MLAAttention`` for one layer kind of ``model`` at TP
    size ``tp``, its indexer cache allocated with 4 pages."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v32 import attention as v32_attention
    from vllm.models.deepseek_v32.amd import rocm
    from vllm.utils.torch_utils import set_default_torch_dtype

    if kind not in LAYER_KINDS:
        raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
    page = config.cache_config.block_size
    # vLLM's own norms, made as a served bf16 model makes them (under the
    # model dtype, which gives RMSNorm its weight dtype), so that the fused
    # kernels see the dtypes a release gives them.
    with set_default_torch_dtype(torch.bfloat16), set_current_vllm_config(config):
        eps = config.model_config.hf_config.rms_norm_eps
        q_a_layernorm = v32_attention.RMSNorm(model.q_lora_rank, eps=eps)
        kv_a_layernorm = v32_attention.RMSNorm(model.kv_lora_rank, eps=eps)
        # The indexer's, in fp32 whatever the model dtype (attention.py).
        k_norm = v32_attention.LayerNorm(
            model.index_head_dim, eps=1e-6, dtype=torch.float32
        )
    indexer = None
    if kind != "target-shared":
        # The indexer's own row size, from an indexer holding only its shape.
        shape = object.__new__(rocm.DeepseekV32ROCmIndexer)
        object.__setattr__(shape, "head_dim", model.index_head_dim)
        object.__setattr__(shape, "quant_block_size", 128)
        row = shape.k_cache_row_bytes(config)
        cache = rocm.DeepseekV32ROCmIndexerCache(
            head_dim=row,
            dtype=torch.uint8,
            prefix=f"{LAYER}.indexer.k_cache",
            cache_config=config.cache_config,
        )
        # As DeepseekV32ROCmIndexer.__init__ does: the cache takes the
        # indexer's one MXFP4 decision (made by k_cache_row_bytes).
        cache.mxfp4 = shape.mxfp4
        cache.kv_cache = torch.zeros(4, page, row, dtype=torch.uint8)
        heads, dim = model.index_n_heads, model.index_head_dim
        indexer = SimpleNamespace(
            k_cache=cache,
            quant_block_size=128,
            scale_fmt="ue8m0",
            topk_tokens=2048,
            head_dim=dim,
            n_head=heads,
            max_model_len=MAX_POSITIONS,
            max_total_seq_len=MAX_POSITIONS,
            softmax_scale=dim**-0.5,
            k_norm=k_norm,
            # The projections' outputs, in the model dtype (bf16).
            wq_b=lambda q_c: (_bf16(q_c.shape[0], heads * dim),),
            wk_weights_proj=lambda hidden: (_bf16(hidden.shape[0], dim + heads),),
        )

    def parent_init(self, *args, **kwargs):
        torch.nn.Module.__init__(self)
        self.indexer = indexer
        self.kv_cache_dtype = "fp8"

    with monkeypatch.context() as patch:
        patch.setattr(v32_attention.DeepseekV32Attention, "__init__", parent_init)
        layer = rocm.DeepseekV32MLAAttention(config, None, LAYER)
    local_heads = model.num_attention_heads // tp
    rope = model.qk_rope_head_dim
    qk_head_dim = model.qk_nope_head_dim + rope
    qkv_width = model.q_lora_rank + model.kv_lora_rank + rope
    # The fp8 MLA cache as the layer binds it: [blocks, page, latent + rope].
    mla_shape = (4, page, model.kv_lora_rank + rope)
    tables = model.rope_cache_dtype
    for name, value in dict(
        layer_name=LAYER,
        skip_topk=kind == "mtp-reuse",
        num_local_heads=local_heads,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=rope,
        qk_head_dim=qk_head_dim,
        v_head_dim=model.v_head_dim,
        fused_qkv_a_proj=lambda hidden: (_bf16(hidden.shape[0], qkv_width),),
        q_b_proj=lambda q_c: (_bf16(q_c.shape[0], local_heads * qk_head_dim),),
        # torch.bmm's path (the seeds serve with VLLM_ROCM_USE_AITER_FP8BMM=0).
        is_aiter_triton_fp4_bmm_enabled=False,
        is_aiter_triton_fp8_bmm_enabled=False,
        W_UK_T=_weight(local_heads, model.qk_nope_head_dim, model.kv_lora_rank),
        q_a_layernorm=q_a_layernorm,
        kv_a_layernorm=kv_a_layernorm,
        rotary_emb=SimpleNamespace(
            cos_sin_cache=torch.randn(MAX_POSITIONS, rope).to(tables)
        ),
        indexer_rope_emb=SimpleNamespace(
            cos_sin_cache=torch.randn(MAX_POSITIONS, rope).to(tables)
        ),
        kv_cache=torch.zeros(mla_shape, dtype=torch.uint8),
        _k_scale=torch.ones(1),
        _k_scale_float=1.0,  # read by vLLM 0.33.0's layer
        _q_scale=torch.ones(1),
        topk_indices_buffer=torch.full((64, 2048), -1, dtype=torch.int32),
        _index_rope_interleave=model.indexer_rope_interleave,
    ).items():
        object.__setattr__(layer, name, value)
    object.__setattr__(layer, "dsa_model", model)
    return layer


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


@cache
def _weight(*shape: int) -> torch.Tensor:
    """One random bf16 weight per shape, made once: the layer reads its
    weights and never writes them, and the compile matrix builds hundreds of
    layers (W_UK_T at TP 1 is 8M values)."""
    return _bf16(*shape)


def run_attention(monkeypatch, layer, tokens: int) -> AttentionCall:
    """The layer's real ``forward`` over ``tokens`` new tokens (a step's
    decode or prefill rows, slots on the cache's pages): its own splits of
    the projections (so the fused kernels get the strided views a served
    model gives them), ``_compute_ql_nope``, ``fused_norm_rope`` and
    ``fused_q``, up to the indexer call (recorded) and the MLA kernel (not
    reached)."""
    from vllm.models.deepseek_v32.amd import rocm

    page = layer.kv_cache.shape[1]
    call = AttentionCall(torch.randperm(4 * page)[:tokens])

    def run_indexer(q_c, index_q, index_weights):
        call.indexer_args = (q_c, index_q, index_weights)

    def build_q_for_attn(ql_nope, mqa_q, num_actual):
        call.mqa_q = mqa_q
        raise StopAttention

    metadata = SimpleNamespace(num_actual_tokens=tokens)
    monkeypatch.setattr(
        rocm,
        "get_forward_context",
        lambda: SimpleNamespace(
            attn_metadata={LAYER: metadata}, slot_mapping={LAYER: call.slots}
        ),
    )
    monkeypatch.setattr(layer, "_use_sparse_mha", lambda metadata: False)
    monkeypatch.setattr(layer, "_run_indexer", run_indexer)
    monkeypatch.setattr(layer, "_build_q_for_attn", build_q_for_attn)
    with pytest.raises(StopAttention):
        layer.forward(torch.randint(0, MAX_POSITIONS, (tokens,)), _bf16(tokens, 8))
    return call
