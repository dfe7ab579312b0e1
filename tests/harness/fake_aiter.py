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

from harness import topk_reference

MODULES = (
    "aiter",
    "aiter.ops",
    "aiter.ops.topk",
    "aiter.ops.triton",
    "aiter.ops.triton.fp8_mqa_logits",
)


def _fp8_mqa_logits(q, k_fp8, scale, weights, cu_seqlen_ks, cu_seqlen_ke):
    """AITER's fp8_mqa_logits(Q, KV, kv_scales, weights, ks, ke) -> fp32 [M, N]."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

    return fp8_mqa_logits_torch(q, (k_fp8, scale), weights, cu_seqlen_ks, cu_seqlen_ke)


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
    triton = _module("aiter.ops.triton", fp8_mqa_logits=logits)
    ops = _module("aiter.ops", topk=topk, triton=triton)
    return {
        "aiter": _module("aiter", ops=ops),
        "aiter.ops": ops,
        "aiter.ops.topk": topk,
        "aiter.ops.triton": triton,
        "aiter.ops.triton.fp8_mqa_logits": logits,
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
