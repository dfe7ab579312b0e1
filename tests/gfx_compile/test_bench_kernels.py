# SPDX-License-Identifier: Apache-2.0
"""The bench's top-k stand-in (scripts/harness/fast_indexer_kernels.py)
compiled for gfx950 in each of its program shapes, for both index
conventions (vLLM's relative indices and AITER's chunk columns) and both
paths (one program a row, and AITER's multi-block rule's several). The
bench runs it on NVIDIA GPUs, but it stands in for AITER's kernel there and
is kept compiling for the target it models."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import fast_indexer_kernels as fast
from scripts.harness import gfx_compile
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

# The op whose top-k the stand-in replaces in stage 0001's bench.
KERNEL_CALLERS = ("vllm/v1/attention/ops/rocm_aiter_mla_sparse.py",)


@pytest.mark.parametrize("shape", sorted(fast.TOPK_SHAPES))
def test_the_topk_stand_in_compiles_in_each_shape(compile_matrix, shape, monkeypatch):
    monkeypatch.setattr(fast, "TOPK_SHAPE", shape)
    recorder = gfx_compile.Recorder()
    rows, width, k = 4, 6000, 2048
    logits = torch.randn(rows, width)
    starts = torch.zeros(rows, dtype=torch.int32)
    ends = torch.full((rows,), width, dtype=torch.int32)
    indices = torch.empty(rows, k, dtype=torch.int32)
    for multi_block in (False, True):
        monkeypatch.setattr(fast, "uses_multi_block", lambda r, w, m=multi_block: m)
        recorder.label = f"{shape} shape, multi-block {multi_block}"
        with gfx_compile.recording("gfx950", into=recorder, interpret=True):
            fast.top_k_per_row_prefill(logits, starts, ends, indices, rows, width, 1, k)
            fast.aiter_top_k_per_row_prefill(
                logits, starts, ends, indices, None, rows, width, 1, k
            )
    assert {v.name for v in recorder.variants} == {"_top_k_per_row_kernel"}
    failures = compile_matrix.compile("gfx950", recorder)
    assert not failures, "\n\n".join(failures)
