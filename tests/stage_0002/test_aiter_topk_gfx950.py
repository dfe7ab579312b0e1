# SPDX-License-Identifier: Apache-2.0
"""Stage 0002 on gfx950 with the real AITER: vLLM's wrappers around
``aiter.ops.topk`` select what the in-tree kernels select, for packed
prefill rows and for decode rows of next_n 1, 2 and 4. Skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from scripts.harness import topk_reference
from scripts.harness.rocm_platform import real_gfx950_with_aiter
from scripts.harness.tree import applied_tree

TREE = applied_tree("0002")


pytestmark = pytest.mark.skipif(
    not real_gfx950_with_aiter(), reason="needs a gfx950 GPU (MI355X) with AITER"
)
K = 2048


def test_real_aiter_prefill_matches_in_tree():
    topk_reference.assert_prefill_paths_agree(
        [40000, 2600, 33000, 100], K, "cuda", seed=0
    )


@pytest.mark.parametrize("width", [133120, 1048576])
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_real_aiter_decode_matches_in_tree(width, next_n):
    from vllm._aiter_ops import rocm_aiter_ops

    torch.manual_seed(1)
    seq_lens = torch.tensor([4096, 40000, 131000], dtype=torch.int32).cuda()
    rows = seq_lens.numel() * next_n
    ends = topk_reference.decode_row_ends(seq_lens, next_n, rows).to(torch.int32)
    logits = torch.randn(rows, width, device="cuda")
    via_aiter = torch.empty((rows, K), dtype=torch.int32, device="cuda")
    in_tree = torch.empty_like(via_aiter)
    rocm_aiter_ops.indexer_top_k_decode(logits, 1, ends, via_aiter, K)
    torch.ops._C.top_k_per_row_decode(
        logits,
        next_n,
        seq_lens,
        in_tree,
        rows,
        logits.stride(0),
        logits.stride(1),
        K,
    )
    topk_reference.assert_same_selection(
        logits.cpu(), via_aiter.cpu(), in_tree.cpu(), ends.cpu(), K
    )
