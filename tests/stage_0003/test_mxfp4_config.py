# SPDX-License-Identifier: Apache-2.0
"""Stage 0003: who may turn the MXFP4 indexer cache on, the errors everyone
else gets at startup, and the 68-byte row through vLLM's real KV-cache spec,
backend and metadata builder (ROCm platform checks emulated)."""

from __future__ import annotations

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
from vllm.v1.attention.backends.mla.indexer import (  # noqa: E402
    DeepseekV32IndexerBackend,
    dsa_indexer_uses_fp4,
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

HEAD_DIM, INDEX_HEADS = 128, 64
# (model_type, architectures) as vLLM sees the targets and, after
# SpeculativeConfig.hf_config_override, their MTP drafts.
DEEPSEEK_V32 = ("deepseek_v32", ["DeepseekV32ForCausalLM"])
GLM5 = ("glm_moe_dsa", ["GlmMoeDsaForCausalLM"])
DSA_DRAFT = ("deepseek_mtp", ["DeepseekV32MTPModel"])
DEEPSEEK_V41 = ("deepseek_v41", ["DeepseekV41ForCausalLM"])
NOT_DSA = [
    ("deepseek_v3", ["DeepseekV3ForCausalLM"]),
    ("deepseek_mtp", ["DeepSeekMTPModel"]),  # DeepSeek-V3's draft: no DSA
    ("llama", ["LlamaForCausalLM"]),
]


def _config(
    model=DEEPSEEK_V32,
    kv_dtype="mxfp4",
    block_size: int | None = 64,
    dcp=1,
    pcp=1,
):
    """A config as vLLM has it at model construction; ``block_size`` as
    given with --block-size, None for no --block-size (vLLM's default then,
    until update_block_size_for_backend picks one)."""
    config = indexer_batch.make_vllm_config()
    model_type, architectures = model
    hf_config = SimpleNamespace(
        model_type=model_type,
        architectures=architectures,
        index_n_heads=INDEX_HEADS,
        index_head_dim=HEAD_DIM,
    )
    config.model_config.hf_config = hf_config
    config.model_config.hf_text_config = hf_config
    config.attention_config.indexer_kv_dtype = kv_dtype
    if block_size is not None:
        config.cache_config.block_size = block_size
        config.cache_config.user_specified_block_size = True
    config.parallel_config.decode_context_parallel_size = dcp
    config.parallel_config.prefill_context_parallel_size = pcp
    return config


@pytest.mark.parametrize("model", [DEEPSEEK_V32, GLM5, DSA_DRAFT, DEEPSEEK_V41])
@pytest.mark.parametrize("block_size", [64, 128])
def test_allowed_models_on_gfx950(model, block_size):
    with emulate_rocm("gfx950"):
        assert dsa_indexer_uses_fp4(_config(model, block_size=block_size))


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_fp8_stays_the_default(kv_dtype):
    with emulate_rocm("gfx950"):
        assert not dsa_indexer_uses_fp4(_config(kv_dtype=kv_dtype))


@pytest.mark.parametrize(
    "platform, overrides, match",
    [
        ("gfx950", {"model": NOT_DSA[0]}, "only supported for"),
        ("gfx950", {"model": NOT_DSA[1]}, "only supported for"),
        ("gfx950", {"model": NOT_DSA[2]}, "only supported for"),
        ("gfx942", {}, "requires CDNA4"),
        ("gfx950 without AITER", {}, "the aiter package is not installed"),
        ("gfx950", {"dcp": 2}, "context parallelism"),
        ("gfx950", {"pcp": 2}, "context parallelism"),
        ("gfx950", {"block_size": 16}, "--block-size 64 or 128"),
        ("gfx950", {"block_size": 32}, "--block-size 64 or 128"),
        ("gfx950", {"block_size": 256}, "--block-size 64 or 128"),
        ("gfx950", {"model": GLM5, "block_size": 1}, "--block-size 64 or 128"),
        ("gfx950", {"kv_dtype": "nvfp4"}, "not supported by the DeepSeek"),
    ],
)
def test_startup_errors(platform, overrides, match):
    arch, _, rest = platform.partition(" ")
    with emulate_rocm(arch, aiter=not rest), pytest.raises(ValueError, match=match):
        dsa_indexer_uses_fp4(_config(**overrides))


def test_aiter_installed_but_switched_off_says_how_to_switch_it_on(monkeypatch):
    from vllm._aiter_ops import rocm_aiter_ops

    with emulate_rocm("gfx950"):
        monkeypatch.setenv("VLLM_ROCM_USE_AITER", "0")
        rocm_aiter_ops.refresh_env_variables()
        with pytest.raises(ValueError, match="enable aiter with VLLM_ROCM_USE_AITER=1"):
            dsa_indexer_uses_fp4(_config())


def test_v41_keeps_its_own_rules():
    """DeepSeek-V4.1 keeps the builder's own DCP/PCP check and block sizes."""
    with emulate_rocm("gfx950"):
        assert dsa_indexer_uses_fp4(_config(DEEPSEEK_V41, block_size=256))


def test_non_rocm_rules_unchanged():
    """Off ROCm mxfp4 still needs Blackwell; the CPU platform is refused."""
    with pytest.raises(ValueError, match="Blackwell"):
        dsa_indexer_uses_fp4(_config())


def _indexer_cache(config, prefix: str):
    """The model's indexer cache, sized by the model's own row rule."""
    indexer = DeepseekV32ROCmIndexer.__new__(DeepseekV32ROCmIndexer)
    torch.nn.Module.__init__(indexer)
    indexer.head_dim, indexer.quant_block_size = HEAD_DIM, 128
    with set_current_vllm_config(config):
        return DeepseekV32ROCmIndexerCache(
            head_dim=indexer.k_cache_row_bytes(config),
            dtype=torch.uint8,
            prefix=prefix,
            cache_config=config.cache_config,
        )


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
