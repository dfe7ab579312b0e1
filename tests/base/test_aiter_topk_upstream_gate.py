# SPDX-License-Identifier: Apache-2.0
"""vLLM's AITER top-k gate for the uncompressed k=2048 DSA indexer (decode
always, prefill from 32K keys), stated as behaviour: which top-k kernel
vLLM's real indexer op takes, chunk by chunk, for the batches vLLM's own
metadata builder makes (no hand-set fields), on gfx950 with AITER.

This was stage 0002's upstream probe. Upstream merged the gate (#61943,
vLLM 0.33.0) and the stage left the series with the move to vLLM 0.34.0; the
probe stays so that a later release that changes the gate shows here. The
expected table (``upstream_gate_table.json``) was recorded on vLLM 0.33.0.

Only dispatch is observed here, so the work each kernel would do is skipped:
the K insert, the K gather, the logits and the top-k calls are recorded, not
computed, the cache and the step's inputs stay zero, and the builder's chunk
metadata comes from the torch equivalent of its kernel (checked against it
in tests/base). Recording the table anew: ``DSA_RECORD_GATE_TABLE=1`` writes
it instead of comparing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")

K = 2048
TABLE_FILE = Path(__file__).with_name("upstream_gate_table.json")
RECORD_ENV = "DSA_RECORD_GATE_TABLE"
# (context, query) per request, decode requests first.
BATCHES = {
    "fresh 32,767": [(0, 32767)],
    "fresh 32,768": [(0, 32768)],
    "fresh 40,000": [(0, 40000)],
    "fresh 131,072": [(0, 131072)],
    "decode + fresh 36,000": [(5000, 1), (0, 36000)],
    "extend 30,000 + 4,000": [(30000, 4000)],
    "packed prompts": [(0, 20000), (0, 12000), (0, 900), (31000, 2000)],
}
MAX_LEN = 133120  # GLM-5.2's serving length in the PR text


def _dispatch(monkeypatch: pytest.MonkeyPatch, builder, requests) -> list[str]:
    """Which top-k kernel each call of one indexer op took, in call order:
    ``prefill aiter`` / ``prefill in-tree`` per chunk, then the decode's."""
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op
    from vllm._aiter_ops import rocm_aiter_ops

    taken: list[str] = []

    def record(label):
        return lambda *args, **kwargs: taken.append(label)

    def no_logits(q, kv, weights, ks, ke):
        return torch.empty(q.shape[0], kv[0].shape[0])

    monkeypatch.setattr(op, "cp_gather_indexer_k_quant_cache_triton", record("gather"))
    monkeypatch.setattr(op, "rocm_fp8_mqa_logits", no_logits)
    monkeypatch.setattr(
        op, "_launch_aiter_top_k_per_row_prefill", record("prefill aiter")
    )
    monkeypatch.setattr(
        torch.ops._C, "top_k_per_row_prefill", record("prefill in-tree")
    )
    monkeypatch.setattr(rocm_aiter_ops, "indexer_top_k_decode", record("decode aiter"))
    monkeypatch.setattr(torch.ops._C, "top_k_per_row_decode", record("decode in-tree"))
    batch = indexer_batch.build_batch(
        builder, requests, write_cache=False, random_inputs=False, torch_context=True
    )
    indexer_batch.run_indexer(batch, K, skip_k_cache_insert=True)
    return [label for label in taken if label != "gather"]


@pytest.fixture(scope="module")
def table() -> dict[str, list[str]]:
    with pytest.MonkeyPatch.context() as monkeypatch, emulate_rocm("gfx950"):
        # One builder for every step, as vLLM keeps one per layer group (its
        # buffers for 133,120 tokens take seconds to allocate).
        config = indexer_batch.make_vllm_config(max_len=MAX_LEN, max_tokens=MAX_LEN)
        builder = indexer_batch.make_builder(config, monkeypatch)
        got = {
            name: indexer_batch.run_lengths(_dispatch(monkeypatch, builder, b))
            for name, b in BATCHES.items()
        }
    if os.environ.get(RECORD_ENV) == "1":
        TABLE_FILE.write_text(json.dumps(got, indent=2) + "\n")
    return got


@pytest.mark.parametrize("name", list(BATCHES))
def test_the_gate_chooses_as_upstream_merged_it(table, name):
    expected = json.loads(TABLE_FILE.read_text())
    assert table[name] == expected[name]


def test_the_table_covers_both_kernels_and_long_prompts_whole(table):
    """The recorded table is not vacuous: the 40,000-token prompt is split
    into several chunks, all on AITER; 32,767 tokens stay in-tree."""
    assert table["fresh 40,000"] == ["prefill aiter x12"]
    assert table["fresh 32,767"][0].startswith("prefill in-tree")
    assert table["decode + fresh 36,000"][-1] == "decode aiter x1"
