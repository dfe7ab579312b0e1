# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MXFP4 indexer K cache of DeepSeek-V3.2-style DSA models on ROCm: its
68-byte row, who may turn it on with ``indexer_kv_dtype='mxfp4'`` (and the
one line that says it is on), the startup error everyone else gets, and the
caches and AITER page layouts a layer refuses.

The rules are host-side, so they run on any machine with the ROCm platform,
the CDNA generation and AITER's presence patched the way vLLM's other ROCm
policy tests patch them. The last test asks the real platform and runs only
on ROCm.
"""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

import vllm._aiter_ops as aiter_ops
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import AttentionConfig
from vllm.models.deepseek_v32.common.mxfp4_indexer_cache import (
    mxfp4_indexer_row_bytes,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
from vllm.v1.attention.backends.mla.rocm_dsa_mxfp4_config import (
    check_model_has_dsa_indexer,
)
from vllm.v1.attention.ops import rocm_dsa_mxfp4_cache, rocm_paged_mxfp4_indexer
from vllm.v1.attention.ops.rocm_dsa_mxfp4_cache import (
    LayerMxfp4CacheLayout,
    check_mxfp4_indexer_cache,
    indexer_uses_mxfp4_cache,
)
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import RocmPagedMxfp4CacheLayout

HEAD_DIM = 128
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
# AITER's gfx950 page layout for 64 indexer heads (cache_format).
LAYOUT = RocmPagedMxfp4CacheLayout(32, 16, 2)


def _config(model=DEEPSEEK_V32, kv_dtype="mxfp4", block_size=64, dcp=1, pcp=1):
    """The parts of a VllmConfig the checks read; ``block_size`` as given with
    --block-size, None for no --block-size (vLLM's default until
    update_block_size_for_backend picks one)."""
    model_type, architectures = model
    hf_config = SimpleNamespace(
        model_type=model_type,
        architectures=architectures,
        index_n_heads=64,
        index_head_dim=HEAD_DIM,
        index_topk=2048,
    )
    attention = AttentionConfig()
    attention.indexer_kv_dtype = kv_dtype
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config),
        attention_config=attention,
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
        cache_config=SimpleNamespace(
            block_size=16 if block_size is None else block_size,
            user_specified_block_size=block_size is not None,
        ),
    )


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch):
    """``rocm(cdna=4, aiter_found=True, aiter_on=True)``: a ROCm platform.
    vllm.platforms.rocm cannot be imported without a ROCm torch; the checks
    reach it only through get_cdna_version() (dsa_indexer_uses_fp4)."""

    def platform(cdna: int = 4, aiter_found: bool = True, aiter_on: bool = True):
        module = types.ModuleType("vllm.platforms.rocm")
        module.get_cdna_version = lambda: cdna  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "vllm.platforms.rocm", module)
        monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
        monkeypatch.setattr(aiter_ops, "IS_AITER_FOUND", aiter_found)
        monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1" if aiter_on else "0")
        rocm_aiter_ops.refresh_env_variables()

    yield platform
    monkeypatch.undo()
    rocm_aiter_ops.refresh_env_variables()


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_the_row_is_68_bytes():
    # 64 bytes of E2M1 pairs and 4 E8M0 scales; the FP8 row is 128 + 4 = 132.
    assert mxfp4_indexer_row_bytes(HEAD_DIM) == 68
    assert mxfp4_indexer_row_bytes(256) == 136


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("model", [DEEPSEEK_V32, GLM5, DSA_DRAFT, DEEPSEEK_V41])
@pytest.mark.parametrize("block_size", [64, 128, None])
def test_dsa_models_may_use_it_on_cdna4(rocm, model, block_size):
    rocm()
    assert dsa_indexer_uses_fp4(_config(model, block_size=block_size))


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_fp8_stays_the_default(rocm, kv_dtype):
    rocm()
    assert not dsa_indexer_uses_fp4(_config(kv_dtype=kv_dtype))


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize(
    "platform, overrides, match",
    [
        ({}, {"model": NOT_DSA[0]}, "only supported for"),
        ({}, {"model": NOT_DSA[1]}, "only supported for"),
        ({}, {"model": NOT_DSA[2]}, "only supported for"),
        ({"cdna": 3}, {}, "requires CDNA4"),
        ({"aiter_found": False}, {}, "the aiter package is not installed"),
        ({"aiter_on": False}, {}, "enable aiter with VLLM_ROCM_USE_AITER=1"),
        ({}, {"dcp": 2}, "context parallelism"),
        ({}, {"pcp": 2}, "context parallelism"),
        ({}, {"block_size": 16}, "--block-size 64 or 128"),
        ({}, {"block_size": 32}, "--block-size 64 or 128"),
        ({}, {"block_size": 256}, "--block-size 64 or 128"),
        ({}, {"model": GLM5, "block_size": 1}, "--block-size 64 or 128"),
        ({}, {"kv_dtype": "nvfp4"}, "not supported by the DeepSeek"),
    ],
)
def test_startup_errors(rocm, platform, overrides, match):
    rocm(**platform)
    with pytest.raises(ValueError, match=match):
        dsa_indexer_uses_fp4(_config(**overrides))


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_glm_5_3_flash_is_refused_by_name():
    """GLM-5.3-Flash's config is multimodal: only its text config has the
    indexer's fields, and its kpool indexer reads no MXFP4 cache."""
    glm5next = pytest.importorskip("transformers.models.glm5_next")
    hf_config = glm5next.Glm5NextConfig()
    text_config = hf_config.get_text_config()
    assert text_config.index_topk and not hasattr(hf_config, "index_topk")
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, hf_text_config=text_config)
    )
    with pytest.raises(ValueError, match="not supported for GLM-5.3-Flash"):
        check_model_has_dsa_indexer(config)


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_deepseek_v41_keeps_its_own_rules(rocm):
    """DeepSeek-V4.1 keeps its builder's own DCP/PCP check and block sizes."""
    rocm()
    assert dsa_indexer_uses_fp4(_config(DEEPSEEK_V41, block_size=256, dcp=2))


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_off_rocm_the_rules_are_unchanged(monkeypatch):
    """Off ROCm mxfp4 still needs Blackwell: a platform that is neither ROCm
    nor sm_10x (patched so, whatever machine runs this) is refused."""
    monkeypatch.setattr(current_platform, "is_rocm", lambda: False)
    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda *args, **kw: False
    )
    with pytest.raises(ValueError, match="Blackwell"):
        dsa_indexer_uses_fp4(_config())


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("kv_dtype, logged", [("mxfp4", True), ("fp8", False)])
def test_a_layer_asks_once_and_says_when_the_cache_is_on(
    rocm, monkeypatch, kv_dtype, logged
):
    rocm()
    lines = []
    monkeypatch.setattr(
        rocm_dsa_mxfp4_cache.logger,
        "info_once",
        lambda msg, *args, **kwargs: lines.append(msg % args),
    )
    config = _config(kv_dtype=kv_dtype)
    assert indexer_uses_mxfp4_cache(config, HEAD_DIM) is logged
    said = (
        "DSA indexer: MXFP4 K cache on (indexer_kv_dtype='mxfp4'), 68 bytes "
        "per token, scored in place by aiter's paged MXFP4 MQA-logits kernel."
    )
    assert lines == ([said] if logged else [])


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize(
    "cache, match",
    [
        (torch.zeros(2, 64, 132, dtype=torch.uint8), "uint8 \\[pages, entries, 68\\]"),
        (torch.zeros(2, 64, 68, dtype=torch.int8), "uint8"),
        (torch.zeros(2, 68, 64, dtype=torch.uint8).transpose(1, 2), "contiguous"),
    ],
)
def test_cache_shape_errors(cache, match):
    with pytest.raises(ValueError, match=match):
        check_mxfp4_indexer_cache(cache, HEAD_DIM)
    check_mxfp4_indexer_cache(torch.zeros(2, 64, 68, dtype=torch.uint8), HEAD_DIM)


@pytest.fixture
def aiter_cache_format(monkeypatch: pytest.MonkeyPatch):
    """``aiter_cache_format(fmt)``: AITER's cache_format answers ``fmt``."""
    cached = rocm_paged_mxfp4_indexer.rocm_paged_mxfp4_cache_layout

    def answer(fmt: dict):
        module = SimpleNamespace(cache_format=lambda *args: fmt)
        monkeypatch.setattr(rocm_paged_mxfp4_indexer, "_aiter", lambda: module)
        cached.cache_clear()

    yield answer
    cached.cache_clear()


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize(
    "fmt, head_dim, entries",
    [
        ({"n_per_tile": 32, "d_per_tile": 16}, HEAD_DIM, 40),  # page of 40
        ({"n_per_tile": 16, "d_per_tile": 48}, HEAD_DIM, 64),  # 64 bytes in 48s
        ({"n_per_tile": 16, "d_per_tile": 16, "scale_lanes": 3}, HEAD_DIM, 64),
        ({"n_per_tile": 32, "d_per_tile": 16, "scale_mode": 0}, HEAD_DIM, 64),
        ({"n_per_tile": 32, "d_per_tile": 16}, 96, 64),  # 3 scales in 2 lanes
    ],
)
def test_a_layer_refuses_a_page_layout_that_does_not_tile(
    aiter_cache_format, fmt, head_dim, entries
):
    """What AITER's cache_format reports is checked once, by
    rocm_paged_mxfp4_cache_layout; the layer's own check adds the tensor's."""
    aiter_cache_format(fmt)
    row = mxfp4_indexer_row_bytes(head_dim)
    with pytest.raises(ValueError, match="cannot express"):
        LayerMxfp4CacheLayout(32, head_dim).of(
            torch.zeros(2, entries, row, dtype=torch.uint8)
        )


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_a_layer_looks_up_and_checks_its_cache_layout_once_per_cache(monkeypatch):
    """The layer asks aiter's cache_format (stood in here) and checks the
    cache on its first forward, then again only for another cache tensor."""
    lookups = []

    def cache_layout(num_heads, head_dim, page_entries):
        lookups.append((num_heads, head_dim, page_entries))
        return LAYOUT

    monkeypatch.setattr(
        rocm_dsa_mxfp4_cache, "rocm_paged_mxfp4_cache_layout", cache_layout
    )
    layer = LayerMxfp4CacheLayout(32, HEAD_DIM)
    cache = torch.zeros(2, 64, 68, dtype=torch.uint8)
    assert layer.of(cache) == LAYOUT and layer.of(cache) == LAYOUT
    assert lookups == [(32, HEAD_DIM, 64)]
    assert layer.of(torch.zeros(3, 128, 68, dtype=torch.uint8)) == LAYOUT
    assert lookups[1:] == [(32, HEAD_DIM, 128)]
    with pytest.raises(ValueError, match="uint8 \\[pages, entries, 68\\]"):
        layer.of(torch.zeros(2, 64, 132, dtype=torch.uint8))


@pytest.mark.skip_global_cleanup
@pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm-only")
def test_mi355x_with_aiter_may_use_it(monkeypatch):
    """On the real platform: with VLLM_ROCM_USE_AITER=1 a CDNA4 GPU serves a
    DeepSeek-V3.2 indexer from the MXFP4 cache; other GPUs are refused."""
    from vllm.platforms.rocm import get_cdna_version

    if not aiter_ops.IS_AITER_FOUND:
        pytest.skip("AITER is not installed")
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    rocm_aiter_ops.refresh_env_variables()
    try:
        if get_cdna_version() == 4:
            assert dsa_indexer_uses_fp4(_config())
        else:
            with pytest.raises(ValueError, match="requires CDNA4"):
                dsa_indexer_uses_fp4(_config())
    finally:
        monkeypatch.undo()
        rocm_aiter_ops.refresh_env_variables()
