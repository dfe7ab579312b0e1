# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""aiter's per-row top-k on the MXFP4 indexer of DeepSeek-V3.2-style
(uncompressed, compress ratio 1) DSA layers: which prefill chunks take it,
and the scratch it allocates, which the memory profiling run reserves.

Which chunks: the FP8 indexer's gate, `rocm_aiter_ops.is_indexer_top_k_supported`
with ``is_prefill=True``, asked as the FP8 op asks it (the chunk's longest
row, k): aiter's kernel only once rows reach 32K keys, vLLM's below.

The scratch: the MXFP4 op ranks decode rows and prefill chunks alike with
aiter's ``top_k_per_row_decode``, which always runs aiter's one-block radix
kernel and allocates that kernel's workspace for each call, after the logits
it ranks are allocated (ROCm/aiter ``aiter/ops/topk.py``,
``csrc/kernels/topk_per_row_kernels.cu``). Its size depends only on the row
count and the logits' row stride: per row, two buffers of ``stride // 32``
entries (rounded down to a multiple of 64) of an fp32 value and an int32
index, 256-byte aligned, plus 255 bytes for the alignment. About 1/8 of the
fp32 logits it ranks.
"""

import torch

import vllm.envs as envs

# aiter's one-block top-k workspace (ROCm/aiter at e4048607,
# csrc/kernels/topk_per_row_kernels.cu: topk_ob_workspace_size L2733-2742,
# calc_buf_len L984-995 with float values and int32 indices,
# calc_aligned_size L2350-2359; allocated per call by aiter/ops/topk.py
# L364-375).
_OB_BUF_DIVISOR = 32  # calc_buf_len: len / ((2 + 2 * 4 / 4) * 8)
_OB_BUF_ALIGN = 64  # calc_buf_len: 256 / min(4, 4) entries
_OB_BYTES_PER_ENTRY = 2 * (4 + 4)  # two buffers of (fp32 value, int32 index)
_ALIGN = 256


def aiter_topk_scratch_bytes(rows: int, row_stride: int) -> int:
    """Bytes aiter's one-block top-k allocates for ``rows`` logits rows
    ``row_stride`` elements apart (``topk_ob_workspace_size``)."""
    buf_len = (row_stride // _OB_BUF_DIVISOR) & ~(_OB_BUF_ALIGN - 1)
    size = buf_len * _OB_BYTES_PER_ENTRY * rows
    return -(-size // _ALIGN) * _ALIGN + _ALIGN - 1


def aiter_topk_scratch_bound(logits_elements: int) -> int:
    """An upper bound on the scratch for any logits of at most
    ``logits_elements`` elements, whatever their shape: at most half a byte
    per element, aligned."""
    return -(-(logits_elements // 2) // _ALIGN) * _ALIGN + _ALIGN - 1


def prefill_takes_aiter_topk(rows: int, max_seqlen_k: int, topk_tokens: int) -> bool:
    """Whether a prefill chunk of an uncompressed DSA layer ranks with
    aiter's top-k: the FP8 indexer's gate, upstream's, not a copy."""
    # Imported late: vllm._aiter_ops imports the sparse MLA ops at load.
    from vllm._aiter_ops import rocm_aiter_ops

    return rocm_aiter_ops.is_indexer_top_k_supported(
        is_prefill=True,
        compress_ratio=1,
        num_rows=rows,
        max_valid_seq_len=max_seqlen_k,
        topk_tokens=topk_tokens,
    )


def reserve_aiter_topk_scratch(
    hidden_states: torch.Tensor, logits_width: int, decode_rows: int
) -> int:
    """Profiling run: claim, for a moment, the most an indexer layer's step
    holds beside its persistent workspace: a prefill chunk's logits (at most
    VLLM_SPARSE_INDEXER_MAX_LOGITS_MB, or one row of ``logits_width``) with
    aiter's top-k scratch for them, or the scratch for ``decode_rows`` rows
    of ``logits_width`` (the decode logits are the workspace's). Returns the
    bytes claimed."""
    budget = envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024
    logits = max(budget, 4 * logits_width)
    prefill = logits + aiter_topk_scratch_bound(logits // 4)
    decode = aiter_topk_scratch_bytes(decode_rows, logits_width)
    peak = max(prefill, decode)
    torch.empty(peak, dtype=torch.uint8, device=hidden_states.device)
    return peak
