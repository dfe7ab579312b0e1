# SPDX-License-Identifier: Apache-2.0
"""A stand-in ``aiter`` package holding the functions the indexer calls.

Each function keeps AITER's documented contract (argument order, dtypes,
-1 padding, chunk-global prefill indices) and computes with the fp32-keyed
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

from scripts.harness import adversary, topk_reference
from scripts.harness.indexer_k_cache import read_paged_k

MODULES = (
    "aiter",
    "aiter.ops",
    "aiter.ops.topk",
    "aiter.ops.flydsl",
    "aiter.ops.triton",
    "aiter.ops.triton.fp8_mqa_logits",
    "aiter.ops.triton.pa_mqa_logits",
    "aiter.ops.triton.attention",
    "aiter.ops.triton.attention.pa_mqa_logits_mxfp4",
)
POISON = adversary.POISON
# fp8_mqa_logits pads each logits row to a multiple of this many columns
# and returns a view (ROCm/aiter e4048607 aiter/ops/triton/attention/
# fp8_mqa_logits.py L114-128; docs/aiter_contracts.md): stride(0) != N.
LOGITS_ROW_ALIGN = 256


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fp8_mqa_logits(
    q, k_fp8, scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True
):
    """AITER's fp8_mqa_logits(Q, KV, kv_scales, weights, ks, ke) -> fp32
    ``[M, N]``: a view into rows padded to a multiple of 256 columns, with
    garbage in the padding. ``clean_logits=False`` leaves columns outside
    each row's ``[ks, ke)`` undefined (garbage here) instead of -inf. AITER
    asserts power-of-two head count and head size (same wrapper)."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

    _, heads, head_dim = q.shape
    assert _is_power_of_two(heads), f"AITER needs power-of-two heads, got {heads}"
    assert _is_power_of_two(head_dim), f"AITER needs power-of-two D, got {head_dim}"
    logits = fp8_mqa_logits_torch(
        q, (k_fp8, scale), weights, cu_seqlen_ks, cu_seqlen_ke
    )
    rows, width = logits.shape
    gen = adversary.generator(logits.device)
    pitch = -(-width // LOGITS_ROW_ALIGN) * LOGITS_ROW_ALIGN
    padded = torch.empty((rows, pitch), device=logits.device)
    padded[:, :width] = logits
    padded[:, width:] = adversary.garbage((rows, pitch - width), gen, logits.device)
    if not clean_logits:
        cols = torch.arange(width, device=logits.device)
        outside = (cols < cu_seqlen_ks[:, None]) | (cols >= cu_seqlen_ke[:, None])
        filler = adversary.garbage((rows, width), gen, logits.device)
        padded[:, :width] = torch.where(outside, filler, logits)
    return padded[:, :width]


def _flydsl_fp8_mqa_logits(q, k_fp8, scale, weights, cu_seqlen_ks, cu_seqlen_ke):
    """gfx942's entry point (vLLM calls ``aiter.ops.flydsl`` there).
    Assumption: the same contract as fp8_mqa_logits with clean logits."""
    return _fp8_mqa_logits(q, k_fp8, scale, weights, cu_seqlen_ks, cu_seqlen_ke)


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
    ``[0, context_lens[b] - next_n + j + 1)`` with the head weights of row
    ``b * next_n + j`` (gluon/pa_mqa_logits.py L195 at e4048607); the rest of
    the row is left undefined (here: garbage). Weights with fewer rows are
    read past their end there; here that raises. AITER asserts the cache's
    block size equals ``KVBlockSize`` (pa_mqa_logits.py L500 at e4048607;
    docs/aiter_contracts.md)."""

    batch, next_n, heads, head_dim = q_fp8.shape
    # AITER splits the keys by TotalCuCount // (batch_size * next_n) before
    # launching (pa_mqa_logits.py L490-492 at e4048607): no rows divide by 0.
    if batch * next_n == 0:
        raise ZeroDivisionError("integer division or modulo by zero")
    assert kv_cache.shape[1] == KVBlockSize, (
        f"cache block size {kv_cache.shape[1]} != KVBlockSize {KVBlockSize}"
    )
    gen = adversary.generator(out_logits.device)
    out_logits.copy_(adversary.garbage(tuple(out_logits.shape), gen, out_logits.device))
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


# ROCm/aiter aiter/ops/triton/attention/pa_mqa_logits_mxfp4.py at commit
# 4934fe77: K_WIDTH (the bytes of a value tile along D), IDEAL_PAGE_SIZE (the
# kv_tile cap).
K_WIDTH = 16
IDEAL_PAGE_SIZE = 64


def _flash_attn_varlen_func(*args, **kwargs):
    """MLA prefill attention: vLLM imports it when it builds an MLA layer
    (``from aiter import flash_attn_varlen_func``, vllm-project/vllm v0.32.0
    vllm/v1/attention/backends/mla/prefill/aiter_flash_attn.py line 80).
    AITER defines it in aiter/ops/mha.py (ROCm/aiter commit 00472f7d) and
    exports it with ``from .ops.mha import *`` in aiter/__init__.py (commit
    0302bf1b). No test runs attention; the stand-in only exists to be
    imported."""
    raise NotImplementedError("the AITER stand-in does not run MLA attention")


def _mfma_nonk_dim(num_heads: int, head_size: int) -> int:
    """The launcher's ``mfma_nonk_dim`` (same file): 32x32 MFMA tiles for
    small heads or >= 32 heads (DeepSeek-V3.2 has 64, GLM-5.x 32)."""
    return 32 if (head_size <= 64 or num_heads >= 32) else 16


def _cache_format(num_heads: int, head_dim: int, page_entries: int) -> dict:
    """AITER's ``cache_format`` (same file): n_per_tile from the head count,
    d_per_tile K_WIDTH, block_kv min(64, page); a page must hold whole tiles.
    It does not report ``scale_lanes`` (vLLM derives 64 // n_per_tile)."""
    npt = _mfma_nonk_dim(num_heads, head_dim)
    block_kv = min(IDEAL_PAGE_SIZE, page_entries)
    if page_entries % npt or page_entries % block_kv:
        raise ValueError(
            f"page_size {page_entries} must be a multiple of the MFMA N ({npt})"
        )
    return {"n_per_tile": npt, "d_per_tile": K_WIDTH, "block_kv": block_kv}


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
    flydsl = _module("aiter.ops.flydsl", flydsl_fp8_mqa_logits=_flydsl_fp8_mqa_logits)
    ops = _module("aiter.ops", topk=topk, triton=triton, flydsl=flydsl)
    return {
        "aiter": _module(
            "aiter", ops=ops, flash_attn_varlen_func=_flash_attn_varlen_func
        ),
        "aiter.ops": ops,
        "aiter.ops.topk": topk,
        "aiter.ops.flydsl": flydsl,
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
