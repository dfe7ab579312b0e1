# SPDX-License-Identifier: Apache-2.0
"""Fast GPU stand-ins for the indexer prefill's logits and top-k, for
benchmarks that must see host costs (stage 0001's whole-op benchmark and its
no-sync test).

The harness's reference stand-ins (vLLM's torch ``fp8_mqa_logits_torch``,
an fp32-keyed top-k with adversarial ties) are correct but 10-100x slower than
AITER, which hides every host cost behind GPU time. These are written for
speed, not for adversarial contracts:

- ``mqa_logits``: one Triton kernel for AITER's ``fp8_mqa_logits`` contract
  (ROCm/aiter ``aiter/ops/triton/attention/fp8_mqa_logits.py``, lines
  81-128 at e4048607; see docs/aiter_contracts.md): ``logits[i, j] = sum_h w[i, h] *
  relu(q[i, h] . k[j] * scale[j])`` for keys ``ks[i] <= j < ke[i]``, -inf
  elsewhere; fp8 e4m3 dot products, tiles of keys outside a row block's
  range skipped (the causal half of a fresh prompt).
- ``top_k_per_row_prefill``: ``_C.top_k_per_row_prefill``'s contract
  (indices relative to the row's start, -1 past a short row; csrc/sampler.cu)
  as one ``torch.topk`` over the chunk (sorted by score: the real kernels'
  order is unspecified, which these benchmarks do not need).
"""

from __future__ import annotations

import torch

from vllm.triton_utils import tl, triton

BLOCK_M = 4  # query rows per program (x heads: the MMA's M)
BLOCK_N = 128  # keys per program


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    w_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    num_rows,
    num_keys,
    out_stride,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    starts = tl.load(starts_ptr + rows, mask=row_ok, other=num_keys)
    ends = tl.load(ends_ptr + rows, mask=row_ok, other=0)
    first_key = pid_n * BLOCK_N
    if (first_key < tl.max(ends, axis=0)) & (
        first_key + BLOCK_N > tl.min(starts, axis=0)
    ):
        cols = first_key + tl.arange(0, BLOCK_N)
        col_ok = cols < num_keys
        heads = pid_m * BLOCK_M * H + tl.arange(0, BLOCK_M * H)
        head_ok = heads < num_rows * H
        dims = tl.arange(0, D)
        q = tl.load(
            q_ptr + heads[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0
        )
        k = tl.load(
            k_ptr + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0
        )
        scores = tl.dot(q, tl.trans(k))
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        weights = tl.load(w_ptr + heads, mask=head_ok, other=0.0)
        scores = tl.maximum(scores * scale[None, :], 0.0) * weights[:, None]
        logits = tl.sum(tl.reshape(scores, (BLOCK_M, H, BLOCK_N)), axis=1)
        valid = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
        tl.store(
            out_ptr + rows[:, None] * out_stride + cols[None, :],
            tl.where(valid, logits, float("-inf")),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
) -> torch.Tensor:
    """``rocm_fp8_mqa_logits``'s signature: fp32 ``[rows, keys]``."""
    k_fp8, k_scale = kv
    rows, heads, dim = q.shape
    keys = k_fp8.shape[0]
    # Tiles outside every row block's range are not written: -inf already.
    out = torch.full((rows, keys), float("-inf"), dtype=torch.float32, device=q.device)
    if rows == 0 or keys == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(keys, BLOCK_N))
    _mqa_logits_kernel[grid](
        q.contiguous(),
        k_fp8.contiguous(),
        k_scale.reshape(-1).contiguous(),
        weights.float().contiguous(),
        out,
        cu_seqlen_ks,
        cu_seqlen_ke,
        rows,
        keys,
        out.stride(0),
        H=heads,
        D=dim,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    return out


def top_k_per_row_prefill(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    indices: torch.Tensor,
    num_rows: int,
    stride0: int,
    stride1: int,
    k: int,
) -> None:
    """``torch.ops._C.top_k_per_row_prefill``'s signature and output."""
    take = min(k, logits.shape[1])
    # Sorted, so that a short row's valid columns come first (then -1).
    picked = torch.topk(logits[:num_rows], take, dim=1).indices
    lengths = (row_ends[:num_rows] - row_starts[:num_rows]).clamp(min=0, max=take)
    keep = torch.arange(take, device=logits.device)[None, :] < lengths[:, None]
    relative = (picked - row_starts[:num_rows, None]).to(indices.dtype)
    indices[:num_rows, :take] = torch.where(keep, relative, -1)
    if take < k:
        indices[:num_rows, take:] = -1
