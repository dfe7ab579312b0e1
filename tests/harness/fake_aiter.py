# SPDX-License-Identifier: Apache-2.0
"""A stand-in ``aiter`` package holding the functions the indexer calls.

Each function keeps AITER's documented contract (argument order, dtypes,
-1 padding, chunk-global prefill indices) and computes with the float64-keyed
references in ``topk_reference`` and vLLM's own torch logits reference. Only
the entry points a stage calls are present: calling anything else fails, as
it should, instead of silently succeeding.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from harness import topk_reference
from harness.indexer_k_cache import read_paged_k

MODULES = (
    "aiter",
    "aiter.ops",
    "aiter.ops.topk",
    "aiter.ops.triton",
    "aiter.ops.triton.fp8_mqa_logits",
    "aiter.ops.triton.pa_mqa_logits",
    "aiter.ops.triton.attention",
    "aiter.ops.triton.attention.pa_mqa_logits_mxfp4",
)
# AITER leaves logits past a row's end undefined; the stand-in fills them with
# a huge score so that a top-k reading past the end is caught.
POISON = 1e30


def _fp8_mqa_logits(
    q, k_fp8, scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True
):
    """AITER's fp8_mqa_logits(Q, KV, kv_scales, weights, ks, ke) -> fp32 [M, N].
    Newer AITER takes ``clean_logits``: False leaves columns outside each
    row's [ks, ke) undefined (here: POISON) instead of -inf."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

    logits = fp8_mqa_logits_torch(
        q, (k_fp8, scale), weights, cu_seqlen_ks, cu_seqlen_ke
    )
    if not clean_logits:
        cols = torch.arange(logits.shape[1], device=logits.device)
        outside = (cols < cu_seqlen_ks[:, None]) | (cols >= cu_seqlen_ke[:, None])
        logits = logits.masked_fill(outside, POISON)
    return logits


def _deepgemm_fp8_paged_mqa_logits(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    block_tables,
    max_model_len,
    ChunkK=256,
    Preshuffle=True,
    KVBlockSize=64,
    WavePerEU=2,
):
    """AITER's paged decode logits: row (b, j) of ``next_n`` scores keys
    ``[0, context_lens[b] - next_n + j + 1)``; the rest of the row is left
    undefined (here: POISON)."""

    batch, next_n, heads, head_dim = q_fp8.shape
    out_logits.fill_(POISON)
    for b in range(batch):
        seq_len = int(context_lens[b])
        keys = read_paged_k(kv_cache, block_tables[b], seq_len, head_dim)
        for j in range(next_n):
            end = seq_len - next_n + j + 1
            if end <= 0:
                continue
            row = b * next_n + j
            scores = torch.relu(keys[:end] @ q_fp8[b, j].to(torch.float32).T)
            out_logits[row, :end] = scores @ weights[row]


# The MXFP4 page geometry the stand-in's cache_format reports: runs of 16
# tokens in 16-byte chunks (the FP8 SHUFFLE tile), scale_lanes left to its
# default of 64 // n_per_tile. AITER on gfx950 reports its own; the writer
# takes whatever RocmPagedMxfp4CacheLayout can express.
MXFP4_CACHE_FORMAT = {"n_per_tile": 16, "d_per_tile": 16}


def _cache_format(num_heads: int, head_dim: int, page_entries: int) -> dict:
    """AITER's pa_mqa_logits_mxfp4.cache_format(): the K page geometry."""
    return dict(MXFP4_CACHE_FORMAT)


def _select_config(num_heads: int, head_dim: int, rows: int, page_entries: int):
    """AITER's decode launch config; the builder reads only ``target_wgs`` to
    size its schedule buffer (256 workgroups: one per gfx950 CU)."""
    return {"target_wgs": 256}


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def build_modules() -> dict[str, types.ModuleType]:
    topk = _module(
        "aiter.ops.topk",
        top_k_per_row_prefill=topk_reference.aiter_top_k_per_row_prefill,
        top_k_per_row_decode=topk_reference.aiter_top_k_per_row_decode,
    )
    logits = _module("aiter.ops.triton.fp8_mqa_logits", fp8_mqa_logits=_fp8_mqa_logits)
    paged = _module(
        "aiter.ops.triton.pa_mqa_logits",
        deepgemm_fp8_paged_mqa_logits=_deepgemm_fp8_paged_mqa_logits,
    )
    mxfp4 = _module(
        "aiter.ops.triton.attention.pa_mqa_logits_mxfp4",
        cache_format=_cache_format,
        select_config=_select_config,
        SCHED_SLOT_CAP=1024,
    )
    attention = _module("aiter.ops.triton.attention", pa_mqa_logits_mxfp4=mxfp4)
    triton = _module(
        "aiter.ops.triton",
        fp8_mqa_logits=logits,
        pa_mqa_logits=paged,
        attention=attention,
    )
    ops = _module("aiter.ops", topk=topk, triton=triton)
    return {
        "aiter": _module("aiter", ops=ops),
        "aiter.ops": ops,
        "aiter.ops.topk": topk,
        "aiter.ops.triton": triton,
        "aiter.ops.triton.fp8_mqa_logits": logits,
        "aiter.ops.triton.pa_mqa_logits": paged,
        "aiter.ops.triton.attention": attention,
        "aiter.ops.triton.attention.pa_mqa_logits_mxfp4": mxfp4,
    }


@contextmanager
def installed() -> Iterator[dict[str, types.ModuleType]]:
    """Put the stand-in in ``sys.modules`` for the duration, then restore."""
    saved = {name: sys.modules.get(name) for name in MODULES}
    modules = build_modules()
    sys.modules.update(modules)
    try:
        yield modules
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
