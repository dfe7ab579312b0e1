# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The paged MXFP4 indexer K cache for DeepSeek-V3.2-style DSA models on ROCm.

DeepSeek-V3.2, GLM-5.x (``glm_moe_dsa``) and their MTP drafts write 68-byte
MXFP4 keys instead of 132-byte FP8 ones with
``--attention-config '{"indexer_kv_dtype": "mxfp4"}'`` on gfx950, and score
them in place with aiter's ``paged_mxfp4_mqa_logits`` through the metadata
builder DeepSeek-V4.1 already uses. What this path cannot run is rejected at
startup (``rocm_dsa_mxfp4_config``), not at the first forward.
"""

from typing import TYPE_CHECKING

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.mla.rocm_dsa_mxfp4_config import (
    DSA_MXFP4_BLOCK_SIZES,
)
from vllm.v1.attention.backends.mla.rocm_paged_mxfp4_indexer import (
    RocmMxfp4IndexerMetadataBuilder,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec


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
