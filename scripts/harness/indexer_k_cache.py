# SPDX-License-Identifier: Apache-2.0
"""The ROCm indexer's paged FP8 K cache, in torch: read it, and write it the
way vLLM's ``indexer_k_quant_and_cache_triton`` does (for long test contexts,
where the interpreted kernel takes ~7 ms a token). A base test checks the
writer byte for byte against that kernel.

A page holds ``block_size`` keys: their FP8 values in 16x16 SHUFFLE tiles
(``block_size * head_dim`` bytes), then one fp32 scale per key.
"""

from __future__ import annotations

import torch

TILE = 16


def _value_offsets(slot: torch.Tensor, head_dim: int) -> torch.Tensor:
    dims = torch.arange(head_dim, device=slot.device)
    return (
        (slot // TILE * TILE * head_dim)[:, None]
        + (dims // TILE * TILE * TILE)[None, :]
        + (slot % TILE * TILE)[:, None]
        + (dims % TILE)[None, :]
    )


def read_paged_k(
    kv_cache: torch.Tensor, blocks: torch.Tensor, count: int, head_dim: int
) -> torch.Tensor:
    """Dequantised fp32 keys ``[count, head_dim]`` of one sequence."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import FP8_DTYPE

    pages = kv_cache.reshape(kv_cache.shape[0], -1)
    block_size = pages.shape[1] // (head_dim + 4)
    tokens = torch.arange(count, device=kv_cache.device)
    page_of = blocks.to(torch.int64)[tokens // block_size]
    values, scale_bytes = _token_bytes(pages, page_of, tokens, head_dim)
    scales = scale_bytes.contiguous().view(torch.float32)
    return values.view(FP8_DTYPE).to(torch.float32) * scales


def _token_bytes(
    pages: torch.Tensor, page_of: torch.Tensor, positions: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 value bytes [n, head_dim] and scale bytes [n, 4] of the keys
    at sequence ``positions``, on pages ``page_of`` (one per key), indexed
    in the flat cache (copying whole pages per key costs 66x the bytes)."""
    page_bytes = pages.shape[1]
    block_size = page_bytes // (head_dim + 4)
    base = (page_of * page_bytes)[:, None]
    slot = positions % block_size
    flat = pages.reshape(-1)
    values = flat[base + _value_offsets(slot, head_dim)]
    scale_at = block_size * head_dim + slot[:, None] * 4 + torch.arange(4)[None, :]
    return values, flat[base + scale_at]


def write_paged_k(
    kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor
) -> None:
    """Quantise ``keys`` [n, head_dim] and store them at ``slots``: a
    power-of-two scale (ue8m0) of max(amax, 1e-4) / 448 per key."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import FP8_DTYPE

    head_dim = keys.shape[1]
    pages = kv_cache.view(kv_cache.shape[0], -1)
    block_size = pages.shape[1] // (head_dim + 4)
    keys = keys.to(torch.float32)
    fp8_max = 224.0 if torch.float8_e4m3fnuz == FP8_DTYPE else 448.0
    scale = torch.clamp(keys.abs().amax(dim=1), min=1e-4) / fp8_max
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (keys / scale[:, None]).to(FP8_DTYPE).view(torch.uint8)
    block = (slots // block_size).to(torch.int64)
    slot = slots % block_size
    flat = block[:, None] * pages.shape[1] + _value_offsets(slot, head_dim)
    pages.view(-1)[flat.reshape(-1)] = values.reshape(-1)
    scale_at = block * pages.shape[1] + block_size * head_dim + slot * 4
    scale_bytes = scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4)
    pages.view(-1)[
        (scale_at[:, None] + torch.arange(4, device=slots.device)).reshape(-1)
    ] = scale_bytes.reshape(-1)


def gather_paged_k(
    k_cache: torch.Tensor,
    k_fp8: torch.Tensor,
    k_fp8_scale: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlen: torch.Tensor,
    token_to_seq: torch.Tensor,
    cache_layout: str | None = None,
) -> None:
    """vLLM's ``cp_gather_indexer_k_quant_cache_triton`` (SHUFFLE layout) in
    torch, for long test contexts: token ``t`` of the chunk is position
    ``t - cu_seqlen[seq]`` of sequence ``token_to_seq[t]``; its FP8 values go
    to ``k_fp8[t]`` and its scale bytes to ``k_fp8_scale[t]``. A base test
    checks it byte for byte against the kernel."""
    if cache_layout not in (None, "SHUFFLE"):
        raise NotImplementedError(f"cache layout {cache_layout}")
    head_dim = k_fp8.shape[-1]
    pages = k_cache.reshape(k_cache.shape[0], -1)
    block_size = pages.shape[1] // (head_dim + 4)
    tokens = torch.arange(k_fp8.shape[0], device=k_cache.device)
    seq = token_to_seq.to(torch.int64)
    pos = tokens - cu_seqlen.to(torch.int64)[seq]
    blocks = block_table.to(torch.int64)[seq, pos // block_size]
    values, scale_bytes = _token_bytes(pages, blocks, pos, head_dim)
    k_fp8.view(torch.uint8).copy_(values)
    k_fp8_scale.view(torch.uint8).reshape(-1, 4).copy_(scale_bytes)
