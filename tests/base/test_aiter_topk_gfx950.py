# SPDX-License-Identifier: Apache-2.0
"""vLLM's k=2048 top-k gate (upstream since 0.33.0; once stage 0002) on
gfx950 with the real AITER: vLLM's wrappers around
``aiter.ops.topk`` select what the in-tree kernels select, for packed
prefill rows and for decode rows of next_n 1, 2 and 4; and through the gate,
vLLM's real indexer op takes the kernels upstream's table says, chunk by
chunk, and every row it returns is a valid top-k. Skipped elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.harness import indexer_batch, topk_reference
from scripts.harness.rocm_platform import real_gfx950_with_aiter
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")


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


# Batches of the upstream table (test_aiter_topk_behaviour.py) on both sides
# of 32K keys; the table says which kernel each chunk takes.
GATE_BATCHES = {
    "fresh 32,767": [(0, 32767)],
    "fresh 40,000": [(0, 40000)],
    "decode + fresh 36,000": [(5000, 1), (0, 36000)],
}
UPSTREAM_TABLE = Path(__file__).with_name("upstream_gate_table.json")


def _through_the_gate(monkeypatch, requests) -> tuple[list[str], torch.Tensor, object]:
    """Run vLLM's real indexer op with the real kernels, recording which
    top-k kernel each call takes (the calls go through unchanged)."""
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op
    from vllm._aiter_ops import rocm_aiter_ops

    taken: list[str] = []

    def recorded(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def call(*args, **kwargs):
            taken.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    recorded(op, "_launch_aiter_top_k_per_row_prefill", "prefill aiter")
    recorded(torch.ops._C, "top_k_per_row_prefill", "prefill in-tree")
    recorded(rocm_aiter_ops, "indexer_top_k_decode", "decode aiter")
    recorded(torch.ops._C, "top_k_per_row_decode", "decode in-tree")
    longest = max(c + q for c, q in requests)
    config = indexer_batch.make_vllm_config(
        device="cuda", max_len=longest + 1024, max_tokens=longest + 1024
    )
    builder = indexer_batch.make_builder(config, monkeypatch, "cuda")
    batch = indexer_batch.build_batch(builder, requests, torch_context=True)
    return taken, indexer_batch.run_indexer(batch, K).cpu(), batch


@pytest.mark.parametrize("name", list(GATE_BATCHES))
def test_real_aiter_through_the_gate(monkeypatch, name):
    taken, out, batch = _through_the_gate(monkeypatch, GATE_BATCHES[name])
    assert (
        indexer_batch.run_lengths(taken) == json.loads(UPSTREAM_TABLE.read_text())[name]
    )
    # Each real row: min(L, K) distinct keys of its own sequence, -1 after.
    for row, end in enumerate(batch.row_ends.tolist()):
        picked = out[row][out[row] >= 0]
        assert picked.numel() == min(end, K), row
        assert picked.unique().numel() == picked.numel(), row
        assert int(picked.max()) < end, row
