# SPDX-License-Identifier: Apache-2.0
"""Stage 0003: the 68-byte row through vLLM's real KV-cache spec, backend and
metadata builder (ROCm platform checks emulated). Who may turn the cache on
and the startup errors are unit-tested by the stage's PR test (tests/v1/
attention/test_rocm_dsa_mxfp4_indexer_config.py in vLLM's tree,
vllm_overlay/ here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.models.deepseek_v32.amd.rocm import (  # noqa: E402
    DeepseekV32ROCmIndexer,
    DeepseekV32ROCmIndexerCache,
)
from vllm.transformers_utils.config import (  # noqa: E402
    get_config,
    get_hf_text_config,
)
from vllm.v1.attention.backends.mla.indexer import (  # noqa: E402
    DeepseekV32IndexerBackend,
)
from vllm.v1.attention.backends.mla.rocm_dsa_mxfp4_config import (  # noqa: E402
    check_model_has_dsa_indexer,
)
from vllm.v1.attention.backends.mla.rocm_dsa_mxfp4_indexer import (  # noqa: E402
    DeepseekV32RocmMxfp4IndexerBackend,
)
from vllm.v1.attention.backends.mla.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmMxfp4IndexerMetadataBuilder,
)
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmPagedMxfp4CacheLayout,
)

HEAD_DIM = indexer_batch.HEAD_DIM


def _config(kv_dtype="mxfp4", block_size: int | None = 64, dcp=1, pcp=1):
    """vLLM's config of the harness's tiny DeepSeek-V3.2 checkpoint, as vLLM
    has it at model construction; ``block_size`` as given with
    --block-size, None for no --block-size (vLLM's default then, until
    update_block_size_for_backend picks one)."""
    # DeepSeek-V3.2's 64 indexer heads: the cache layout depends on them.
    config = indexer_batch.make_vllm_config(index_heads=64)
    assert config.model_config.hf_config.model_type == "deepseek_v32"
    config.attention_config.indexer_kv_dtype = kv_dtype
    if block_size is not None:
        config.cache_config.block_size = block_size
        config.cache_config.user_specified_block_size = True
    config.parallel_config.decode_context_parallel_size = dcp
    config.parallel_config.prefill_context_parallel_size = pcp
    return config


def _indexer_cache(config, prefix: str):
    """The model's indexer cache, sized by the model's own row rule."""
    indexer = DeepseekV32ROCmIndexer.__new__(DeepseekV32ROCmIndexer)
    torch.nn.Module.__init__(indexer)
    indexer.head_dim, indexer.quant_block_size = HEAD_DIM, 128
    with set_current_vllm_config(config):
        cache = DeepseekV32ROCmIndexerCache(
            head_dim=indexer.k_cache_row_bytes(config),
            dtype=torch.uint8,
            prefix=prefix,
            cache_config=config.cache_config,
        )
    # As DeepseekV32ROCmIndexer.__init__ does after building it.
    cache.mxfp4 = indexer.mxfp4
    return cache


@pytest.mark.parametrize("block_size", [64, 128])
def test_page_size_through_the_kv_cache_spec(block_size):
    """68 bytes a token with mxfp4, 132 with FP8: the KV-cache spec's page and
    the tokens a fixed budget holds."""
    with emulate_rocm("gfx950"):
        fp4 = _config(block_size=block_size)
        fp8 = _config(kv_dtype="fp8", block_size=block_size)
        fp4_cache = _indexer_cache(fp4, "model.layers.0.self_attn.indexer.k_cache")
        fp8_cache = _indexer_cache(fp8, "model.layers.0.self_attn.indexer.k_cache")
        fp4_page = fp4_cache.get_kv_cache_spec(fp4).page_size_bytes
        fp8_page = fp8_cache.get_kv_cache_spec(fp8).page_size_bytes
        assert fp4_cache.get_attn_backend() is DeepseekV32RocmMxfp4IndexerBackend
        assert fp8_cache.get_attn_backend() is DeepseekV32IndexerBackend
    assert fp4_page == block_size * 68
    assert fp8_page == block_size * 132
    budget = 1 << 30
    assert budget // fp4_page * block_size > 1.9 * (budget // fp8_page * block_size)


def test_backend_and_builder(monkeypatch):
    """The backend takes 64/128-token pages, refuses PCP, and its builder (the
    one DeepSeek-V4.1 uses) builds for a V3.2 model and reads the page order
    from aiter's cache_format."""
    backend = DeepseekV32RocmMxfp4IndexerBackend
    assert backend.get_supported_kernel_block_sizes() == [64, 128]
    assert not backend.supports_pcp()
    assert backend.get_builder_cls() is RocmMxfp4IndexerMetadataBuilder
    import vllm.v1.attention.backends.mla.indexer as indexer
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 256)
    config = _config(block_size=128)
    spec = MLAAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=68, dtype=torch.uint8
    )
    with emulate_rocm("gfx950"), set_current_vllm_config(config):
        builder = backend.get_builder_cls()(
            spec,
            [indexer_batch.LAYER],
            config,
            torch.device("cpu"),
            block_table_width=config.model_config.max_model_len // 128,
        )
    assert builder.page_entries == 128
    # 64 indexer heads: AITER's mfma_nonk_dim gives n_per_tile 32.
    assert builder.cache_layout == RocmPagedMxfp4CacheLayout(32, 16, 2)


# GLM-5.3-Flash's config.json shape: multimodal, its indexer's fields only
# in the text config (transformers' Glm5NextConfig fills in the rest).
GLM_5_3_FLASH = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "text_config": {
        "model_type": "glm5_next_text",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "pad_token_id": 0,
        "index_topk": 2048,
    },
}


def test_glm_5_3_flash_is_refused_by_name(tmp_path):
    """vLLM's startup check (RocmPlatform.check_and_update_config) on the
    config vLLM loads for GLM-5.3-Flash: its kpool indexer reads no MXFP4
    cache, so the option is refused, naming the model, not ignored. Its
    indexer's fields are in its text config alone, so a check that read the
    top-level config would call it a model without an indexer instead. (A
    whole VllmConfig would inspect the model class, which imports
    torchvision; the test environment has none.)"""
    (tmp_path / "config.json").write_text(json.dumps(GLM_5_3_FLASH))
    hf_config = get_config(str(tmp_path), trust_remote_code=False)
    text_config = get_hf_text_config(hf_config)
    assert text_config.index_topk == 2048 and not hasattr(hf_config, "index_topk")
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, hf_text_config=text_config)
    )
    with pytest.raises(
        ValueError, match=r"not supported for GLM-5\.3-Flash \(model_type 'glm5_next'\)"
    ):
        check_model_has_dsa_indexer(config)


def test_the_models_it_serves_pass_the_startup_check():
    """DeepSeek-V3.2 through vLLM's real config; GLM-5.x (glm_moe_dsa) and
    the MTP draft are covered by the PR test."""
    check_model_has_dsa_indexer(_config())
