# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Who may use ``indexer_kv_dtype='mxfp4'`` on ROCm, and the configs the
MXFP4 indexer cache of a DeepSeek-V3.2-style model cannot serve. (Which DSA
models are wired to an MXFP4 cache is decided in ``dsa_indexer_uses_fp4``.)

Nothing from vLLM is imported at module level, so the ROCm platform's
config check (``RocmPlatform.check_and_update_config``, at startup for every
model) and the indexer backend can both import this module.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# DeepSeek-V3.2 and GLM-5, GLM-5.1 and GLM-5.2 (glm_moe_dsa).
DSA_MXFP4_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# Speculative decoding renames the draft's model_type to deepseek_mtp and
# keeps the DSA family in its architecture.
DSA_MXFP4_DRAFT_ARCHITECTURES = ("DeepseekV32MTPModel",)
# DeepSeek-V4 and V4.1 have vLLM's own ROCm MXFP4 indexer cache.
DSV4_MXFP4_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
# DSA models whose indexer reads no MXFP4 cache on ROCm, by name: GLM-5.3-Flash's
# kpool indexer (vllm/models/glm5next) keeps its FP8 cache whatever is asked.
DSA_MODELS_WITHOUT_MXFP4 = {"glm5_next": "GLM-5.3-Flash"}
# The KV-cache block sizes (indexer pages) the DSA MXFP4 indexer backend
# takes; its get_supported_kernel_block_sizes and the startup check read it.
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


def check_model_has_dsa_indexer(vllm_config: "VllmConfig") -> None:
    """Raise ValueError for ``indexer_kv_dtype='mxfp4'`` on a model whose
    indexer would not read an MXFP4 cache: one without a DSA (sparse-attention)
    indexer, such as Llama or DeepSeek-V3, or a DSA model wired to none, such
    as GLM-5.3-Flash. The model would otherwise start as if it were unset."""
    model_config = vllm_config.model_config
    if model_config is None:
        return
    model_type = model_config.hf_config.model_type
    # A multimodal model keeps its indexer's fields in its text config.
    if getattr(model_config.hf_text_config, "index_topk", None) is None:
        raise ValueError(
            f"indexer_kv_dtype='mxfp4' has no effect on model_type {model_type!r}: "
            "it has no sparse-attention (DSA) indexer; remove the option."
        )
    if not is_dsa_v32_style_model(vllm_config) and (
        model_type not in DSV4_MXFP4_MODEL_TYPES
    ):
        name = DSA_MODELS_WITHOUT_MXFP4.get(model_type, "this model")
        raise ValueError(
            f"indexer_kv_dtype='mxfp4' on ROCm is not supported for {name} "
            f"(model_type {model_type!r}): its DSA indexer keeps its FP8 cache. "
            "It serves DeepSeek-V3.2, GLM-5, GLM-5.1 and GLM-5.2 (glm_moe_dsa), "
            "their MTP drafts, and DeepSeek-V4 and V4.1; remove the option."
        )


def check_dsa_mxfp4_indexer_config(vllm_config: "VllmConfig") -> None:
    """Raise ValueError for an environment, parallel or cache config the
    MXFP4 indexer of a DeepSeek-V3.2-style model cannot serve."""
    # Imported late: vllm._aiter_ops imports the indexer backend, which
    # imports this module.
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
        sizes = " or ".join(map(str, DSA_MXFP4_BLOCK_SIZES))
        raise ValueError(
            f"indexer_kv_dtype='mxfp4' needs --block-size {sizes} (the paged "
            f"MXFP4 kernel's pages), got {block_size}."
        )
