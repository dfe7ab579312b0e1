# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The paged MXFP4 indexer K cache for DeepSeek-V3.2-style DSA models on ROCm.

DeepSeek-V3.2, GLM-5.x (``glm_moe_dsa``) and their MTP drafts write 68-byte
MXFP4 keys instead of 132-byte FP8 ones with
``--attention-config '{"indexer_kv_dtype": "mxfp4"}'`` on gfx950, and score
them in place with aiter's ``paged_mxfp4_mqa_logits`` through the metadata
builder DeepSeek-V4.1 already uses. What this path cannot run is rejected at
startup, not at the first forward.
"""

from typing import TYPE_CHECKING

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.mla.rocm_paged_mxfp4_indexer import (
    RocmMxfp4IndexerMetadataBuilder,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

DSA_MXFP4_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# Speculative decoding renames the draft's model_type to deepseek_mtp and
# keeps the DSA family in its architecture.
DSA_MXFP4_DRAFT_ARCHITECTURES = ("DeepseekV32MTPModel",)
DSA_MXFP4_BLOCK_SIZES = (64, 128)


def is_dsa_v32_style_model(vllm_config: "VllmConfig") -> bool:
    """Whether the model (or MTP draft) has DeepSeek-V3.2's uncompressed DSA
    indexer."""
    model_config = vllm_config.model_config
    if model_config is None:
        return False
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or []
    return hf_config.model_type in DSA_MXFP4_MODEL_TYPES or any(
        arch in DSA_MXFP4_DRAFT_ARCHITECTURES for arch in architectures
    )


def check_dsa_mxfp4_indexer_config(vllm_config: "VllmConfig") -> None:
    """Raise ValueError for an environment, parallel or cache config the
    MXFP4 indexer of a DeepSeek-V3.2-style model cannot serve."""
    # A module attribute, read late: vllm._aiter_ops imports the indexer
    # backend, which imports this module.
    import vllm._aiter_ops as aiter_ops

    if not aiter_ops.IS_AITER_FOUND:
        raise ValueError(
            "indexer_kv_dtype='mxfp4' on ROCm runs on AITER's paged MXFP4 "
            "kernels, but the aiter package is not installed in this Python "
            "environment; install AITER (vLLM's ROCm image ships it) or use "
            "the FP8 indexer cache (indexer_kv_dtype='fp8')."
        )
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    pcp = parallel.prefill_context_parallel_size
    if dcp > 1 or pcp > 1:
        raise ValueError(
            "indexer_kv_dtype='mxfp4' does not support context parallelism "
            f"(decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}); use the FP8 indexer cache "
            "(indexer_kv_dtype='fp8') with DCP/PCP."
        )
    # Without --block-size, vLLM picks a size every backend supports after
    # the model is built (update_block_size_for_backend), 64 or 128 here;
    # until then block_size holds the generic default.
    cache_config = vllm_config.cache_config
    block_size = cache_config.block_size
    if (
        cache_config.user_specified_block_size
        and block_size not in DSA_MXFP4_BLOCK_SIZES
    ):
        raise ValueError(
            f"indexer_kv_dtype='mxfp4' needs --block-size 64 or 128 (the "
            f"paged MXFP4 kernel's pages), got {block_size}."
        )


class DeepseekV32RocmMxfp4IndexerBackend(DeepseekV32IndexerBackend):
    """DeepSeek-V3.2's indexer on the paged MXFP4 cache (compress ratio 1)."""

    @classmethod
    def supports_pcp(cls) -> bool:
        return False

    @staticmethod
    def get_name() -> str:
        return "DEEPSEEK_V32_ROCM_MXFP4_INDEXER"

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: "KVCacheSpec | None" = None,
    ) -> list[int | MultipleOf]:
        return list(DSA_MXFP4_BLOCK_SIZES)

    @staticmethod
    def get_builder_cls() -> type[RocmMxfp4IndexerMetadataBuilder]:
        return RocmMxfp4IndexerMetadataBuilder
