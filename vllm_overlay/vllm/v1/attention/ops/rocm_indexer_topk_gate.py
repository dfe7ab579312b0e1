# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which top-k kernel the ROCm DSA indexer uses: AITER's or the in-tree one.

Compressed indexers (DeepSeek-V4, compress ratio > 1) keep their own rule
(``rocm_aiter_ops.is_indexer_top_k_supported``). The uncompressed indexer of
DeepSeek-V3.2 and GLM-5.x at index_topk 2048 has no gfx950 policy in the
in-tree kernel, whose cost grows with context while AITER's stays near flat:

- decode always takes AITER's top-k. A FULL CUDA graph replays one kernel
  for every context length, so the choice cannot depend on it;
- a prefill chunk takes it once the longest sequence among its requests
  reaches 32K keys (measured on MI355X: 757 -> 680 us per 16K-row chunk at
  32K, 4026 -> 2635 at 128K; slower below ~24K). Prefill runs eagerly, so a
  host int decides: ``chunk.max_seqlen_k``, the requests' full length, which
  is what upstream vLLM (0.33.0) passes, so every query-row chunk of one long
  prompt takes the same kernel.
"""

from __future__ import annotations

import torch

DSA_TOPK = 2048
AITER_PREFILL_MIN_KEYS = 32768

# rocm_aiter_ops is imported where it is used, as rocm_aiter_mla_sparse does:
# vllm._aiter_ops imports that module, which imports this one.


def _uncompressed_dsa_on_aiter(compress_ratio: int, topk_tokens: int) -> bool:
    from vllm._aiter_ops import rocm_aiter_ops

    return (
        compress_ratio == 1
        and topk_tokens == DSA_TOPK
        and bool(rocm_aiter_ops.is_indexer_top_k_enabled())
    )


def prefill_uses_aiter_top_k(
    *, compress_ratio: int, topk_tokens: int, num_rows: int, max_seqlen_k: int
) -> bool:
    """AITER's top-k for a prefill chunk whose longest request has
    ``max_seqlen_k`` keys (``chunk_max_seqlen_k``, a host int)."""
    from vllm._aiter_ops import rocm_aiter_ops

    if _uncompressed_dsa_on_aiter(compress_ratio, topk_tokens):
        return max_seqlen_k >= AITER_PREFILL_MIN_KEYS
    return rocm_aiter_ops.is_indexer_top_k_supported(
        is_prefill=True, compress_ratio=compress_ratio, num_rows=num_rows
    )


def decode_uses_aiter_top_k(
    *,
    compress_ratio: int,
    topk_tokens: int,
    num_rows: int,
    num_columns: int,
    max_valid_seq_len: int,
) -> bool:
    """AITER's top-k for the decode rows; ``max_valid_seq_len`` is the
    replay-safe bound the compressed rule needs under FULL graphs."""
    from vllm._aiter_ops import rocm_aiter_ops

    if _uncompressed_dsa_on_aiter(compress_ratio, topk_tokens):
        return True
    return rocm_aiter_ops.is_indexer_top_k_supported(
        is_prefill=False,
        compress_ratio=compress_ratio,
        num_rows=num_rows,
        max_valid_seq_len=max_valid_seq_len,
    ) and not rocm_aiter_ops.dsv4_indexer_prefers_native_top_k(
        num_rows=num_rows, num_columns=num_columns, topk_tokens=topk_tokens
    )


def chunk_max_seqlen_k(seq_lens_cpu: torch.Tensor, start_idx: int, end_idx: int) -> int:
    """``max_seqlen_k`` of a prefill chunk over requests ``[start_idx,
    end_idx)``: the longest of their (compressed) sequence lengths, from the
    host copy. Upstream's meaning: the requests' full length, not the key
    count of the longest row inside this chunk's query slice."""
    return int(seq_lens_cpu[start_idx:end_idx].max())
