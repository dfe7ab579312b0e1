# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MXFP4 indexer K cache of DeepSeek-V3.2-style DSA models on ROCm:
whether a layer has it, and the page layout the layer writes it in.

The page layout is AITER's: `rocm_paged_mxfp4_cache_layout` asks AITER's
``cache_format`` for the layer's head count and page size, and refuses an
order `RocmPagedMxfp4CacheLayout` cannot express or that does not tile the
page. What that lookup cannot see is the cache tensor itself; this module
checks it (68-byte rows, contiguous pages) once per cache tensor, not on
every forward. The quantiser and the store the model's kernels run are
platform-neutral: ``vllm/models/deepseek_v32/common/mxfp4_indexer_cache.py``.
"""

import weakref

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.models.deepseek_v32.common.mxfp4_indexer_cache import (
    mxfp4_indexer_row_bytes,
)
from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (
    RocmPagedMxfp4CacheLayout,
    rocm_paged_mxfp4_cache_layout,
)

logger = init_logger(__name__)


def indexer_uses_mxfp4_cache(vllm_config: VllmConfig, head_dim: int) -> bool:
    """Whether a DeepSeek-V3.2-style indexer layer keeps the MXFP4 K cache
    (``dsa_indexer_uses_fp4``, whose checks raise for a config it cannot
    serve). Ask it once per layer; the first layer that has it says so."""
    if not dsa_indexer_uses_fp4(vllm_config):
        return False
    logger.info_once(
        "DSA indexer: MXFP4 K cache on (indexer_kv_dtype='mxfp4'), %d bytes per "
        "token, scored in place by aiter's paged MXFP4 MQA-logits kernel.",
        mxfp4_indexer_row_bytes(head_dim),
    )
    return True


def check_mxfp4_indexer_cache(kv_cache: torch.Tensor, head_dim: int) -> None:
    """Raise ValueError unless ``kv_cache`` is uint8 [pages, entries, row]
    with ``head_dim``-value MXFP4 rows and contiguous pages (the page
    layout's own fit is `rocm_paged_mxfp4_cache_layout`'s to check)."""
    row = mxfp4_indexer_row_bytes(head_dim)
    if (
        kv_cache.dtype != torch.uint8
        or kv_cache.ndim != 3
        or kv_cache.shape[2] != row
        or kv_cache.stride(1) != row
        or kv_cache.stride(2) != 1
    ):
        raise ValueError(
            f"the MXFP4 indexer cache must be uint8 [pages, entries, {row}] with "
            f"contiguous pages, got {kv_cache.dtype} {tuple(kv_cache.shape)} "
            f"strides {kv_cache.stride()}"
        )


class LayerMxfp4CacheLayout:
    """One attention layer's MXFP4 indexer cache layout, from aiter's
    ``cache_format`` for the layer's head count, looked up and checked
    against the cache once per cache tensor instead of on every forward."""

    def __init__(self, num_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.head_dim = head_dim
        self._cache: weakref.ref[torch.Tensor] | None = None
        self._layout: RocmPagedMxfp4CacheLayout | None = None

    def of(self, kv_cache: torch.Tensor) -> RocmPagedMxfp4CacheLayout:
        """The page layout for ``kv_cache`` (ValueError if it cannot hold it)."""
        if self._layout is None or self._cache is None or self._cache() is not kv_cache:
            check_mxfp4_indexer_cache(kv_cache, self.head_dim)
            layout = rocm_paged_mxfp4_cache_layout(
                self.num_heads, self.head_dim, kv_cache.shape[1]
            )
            self._cache, self._layout = weakref.ref(kv_cache), layout
        return self._layout
