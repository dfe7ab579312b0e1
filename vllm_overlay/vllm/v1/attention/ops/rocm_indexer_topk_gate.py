# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which top-k kernel the ROCm DSA indexer uses: AITER's or the in-tree one.

Compressed indexers (DeepSeek-V4, compress ratio > 1) keep their own rule
(``rocm_aiter_ops.is_indexer_top_k_supported``). The uncompressed indexer of
DeepSeek-V3.2 and GLM-5.x at index_topk 2048 has no gfx950 policy in the
in-tree kernel, whose cost grows with context while AITER's stays near flat:

- decode always takes AITER's top-k. A FULL CUDA graph replays one kernel
  for every context length, so the choice cannot depend on it;
- a prefill chunk takes it once its longest row reaches 32K keys (measured
  on MI355X: 757 -> 680 us per 16K-row chunk at 32K, 4026 -> 2635 at 128K;
  slower below ~24K). Prefill runs eagerly, so a host int decides.
"""

from __future__ import annotations

import torch

DSA_TOPK = 2048
AITER_PREFILL_MIN_KEYS = 32768


def _uncompressed_dsa_on_aiter(compress_ratio: int, topk_tokens: int) -> bool:
    from vllm._aiter_ops import rocm_aiter_ops

    return (
        compress_ratio == 1
        and topk_tokens == DSA_TOPK
        and bool(rocm_aiter_ops.is_indexer_top_k_enabled())
    )


def prefill_uses_aiter_top_k(
    *, compress_ratio: int, topk_tokens: int, num_rows: int, longest_row: int
) -> bool:
    """AITER's top-k for a prefill chunk whose longest row has
    ``longest_row`` keys (a host int from the chunk metadata)."""
    from vllm._aiter_ops import rocm_aiter_ops

    if _uncompressed_dsa_on_aiter(compress_ratio, topk_tokens):
        return longest_row >= AITER_PREFILL_MIN_KEYS
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


def chunk_longest_row(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    start_idx: int,
    end_idx: int,
    query_start: int,
    query_stop: int,
) -> int:
    """Keys of the longest causal row among requests ``[start_idx, end_idx)``
    restricted to chunk query rows ``[query_start, query_stop)``.

    Row j of a request with L keys and q query rows sees L - q + j + 1 keys,
    so each request's longest row is its last row inside the slice."""
    offsets = query_start_loc_cpu[start_idx : end_idx + 1].to(torch.int64)
    offsets = offsets - offsets[0]
    starts, ends = offsets[:-1], offsets[1:]
    last = torch.clamp(ends, max=query_stop)
    inside = last > torch.clamp(starts, min=query_start)
    if not bool(inside.any()):
        return 0
    keys = seq_lens_cpu[start_idx:end_idx].to(torch.int64) - (ends - last)
    return int(keys[inside].max())
