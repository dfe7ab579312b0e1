# SPDX-License-Identifier: Apache-2.0
"""Stage 0003 compiled for a real GPU: the MXFP4 writer and fused_norm_rope's
MXFP4 store, bit-exact with the ml_dtypes reference. Runs on any CUDA/ROCm
GPU (an H200 in this project's runs); skipped without one."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import compiled_stub
from scripts.harness import mxfp4_reference as ref
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU to compile the Triton writer"
)
if torch.cuda.is_available():
    # The DeepSeek-V3.2 package imports its CUDA model otherwise.
    compiled_stub.use_generic_platform()

from scripts.harness.mxfp4_writer import indexer_k_mxfp4_quant_and_cache  # noqa: E402
from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import (  # noqa: E402
    RocmPagedMxfp4CacheLayout,
)

LAYOUTS = [RocmPagedMxfp4CacheLayout(16, 16, 4), RocmPagedMxfp4CacheLayout(32, 8, 2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("entries", [64, 128])
def test_compiled_writer_bit_exact(layout, entries):
    torch.manual_seed(0)
    pages, tokens = 64, 3000
    k = torch.randn(tokens, 128) * torch.exp2(torch.randint(-30, 30, (tokens, 1)))
    k[0, :32] = 0
    k[1, :32] = torch.linspace(-1, 1, 32) * 2.0**-140
    k[2, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    k[3, :2] = torch.tensor([float("nan"), float("inf")])
    slots = torch.randperm(pages * entries)[:tokens]
    slots[::97] = -1
    cache = torch.zeros(pages, entries, 68, dtype=torch.uint8, device="cuda")
    indexer_k_mxfp4_quant_and_cache(k.cuda(), slots.cuda(), cache, layout)
    want = torch.zeros(pages, entries, 68, dtype=torch.uint8)
    ref.write_cache(want, slots, k, layout)
    assert torch.equal(cache.cpu(), want)
