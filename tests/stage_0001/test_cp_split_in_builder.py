# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the split planned through vLLM's own indexer metadata builder.
The plan's rules, the settings and their errors are unit-tested by the
stage's PR test (tests/v1/attention/test_rocm_cp_indexer.py in vLLM's tree,
vllm_overlay/ here)."""

from __future__ import annotations

import dataclasses

import pytest

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.v1.attention.ops import rocm_cp_indexer_plan  # noqa: E402


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_the_metadata_builder_plans_the_split(monkeypatch, arch):
    """Through vLLM's own builder: decode rows first, then the plan over the
    prefill rows only. On gfx942 (logits filled with -inf over the chunk) a
    row also pays for its chunk's width; on gfx950 (no fill) it does not."""
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    with emulate_rocm(arch):
        _plans_the_split(monkeypatch, arch)


def _plans_the_split(monkeypatch, arch: str) -> None:
    config = indexer_batch.make_vllm_config(tp_size=4)
    builder = indexer_batch.make_builder(config, monkeypatch)
    filled = arch == "gfx942"
    divisor = rocm_cp_indexer_plan.LOGITS_FILL_DIVISOR if filled else None
    # The wave in rows: the builder's GPU's compute units (the harness
    # stands in MI355X's 256); none where the logits fill their chunk.
    wave = 0 if filled else int(rocm_cp_indexer_plan.WAVE_ROWS_PER_CU * 256)
    assert filled or wave > 0
    # The merge is priced on the GPU's own xGMI link (MI300X's is slower).
    link = (
        rocm_cp_indexer_plan.XGMI_GFX942 if filled else rocm_cp_indexer_plan.XGMI_GFX950
    )
    assert builder.cp_indexer == rocm_cp_indexer_plan.CPIndexerPlanner(
        4, divisor, rocm_cp_indexer_plan.ROW_COST_KEYS, wave_rows=wave, link=link
    )
    # So small a step has every call below its wave; the cuts by the rows'
    # costs are checked here, the wave in the planner's own tests.
    builder.cp_indexer = dataclasses.replace(builder.cp_indexer, wave_rows=0)
    # Decode row 0; prefill rows 1-290: a fresh 200-token prompt, then 90
    # new tokens over 50 cached ones.
    requests = [(30, 1), (0, 200), (50, 90)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
        prefill = indexer_batch.build_batch(builder, requests).metadata.prefill
    split, batch_chunks = prefill.cp_split, prefill.chunks
    assert split is not None and split.bounds[0] == 1 and split.bounds[-1] == 291
    # Key counts and the fixed row cost, plus (gfx942) one chunk's -inf fill
    # over all 340 keys a row.
    assert [c.total_seq_lens for c in batch_chunks] == [340]
    fill = 340 // rocm_cp_indexer_plan.LOGITS_FILL_DIVISOR if filled else 0
    fixed = fill + rocm_cp_indexer_plan.ROW_COST_KEYS
    costs = [t + 1 + fixed for t in range(200)] + [
        50 + t + 1 + fixed for t in range(90)
    ]
    bounds = zip(split.bounds, split.bounds[1:], strict=False)
    per_rank = [sum(costs[a - 1 : b - 1]) for a, b in bounds]
    assert max(per_rank) - min(per_rank) <= 2 * max(costs), per_rank
    # Each cut at the row boundary nearest its share of these costs.
    before = [sum(costs[:j]) for j in range(len(costs) + 1)]
    for rank, cut in enumerate(split.bounds[1:-1], start=1):
        share = rank * before[-1] / 4
        nearest = min(range(len(before)), key=lambda j: abs(before[j] - share))
        assert abs(cut - 1 - nearest) <= 1, (rank, cut, nearest)
    # With the stage's own minimum, so small a step stays replicated.
    batch = indexer_batch.build_batch(builder, requests)
    assert batch.metadata.prefill.cp_split is None
    single = indexer_batch.make_builder(indexer_batch.make_vllm_config(1), monkeypatch)
    batch = indexer_batch.build_batch(single, [(30, 1), (0, 200)])
    assert batch.metadata.prefill.cp_split is None


def test_mtp_decodes_before_the_prefills_are_left_out_of_the_plan(monkeypatch):
    """MTP (next_n 2): the decode requests hold two rows each, so decode
    tokens outnumber decode requests. The plan takes the prefill requests'
    lengths (after the decode requests) and the prefill rows (after the
    decode tokens): rows 4-293 here, cut by their own costs."""
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(tp_size=4, num_speculative_tokens=1)
        builder = indexer_batch.make_builder(config, monkeypatch)
        builder.cp_indexer = dataclasses.replace(builder.cp_indexer, wave_rows=0)
        # Two next_n 2 decodes, then a fresh 200-token prompt and 90 new
        # tokens over 50 cached ones.
        requests = [(3000, 2), (40, 2), (0, 200), (50, 90)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
            batch = indexer_batch.build_batch(builder, requests)
    assert batch.metadata.num_decode_tokens == 4
    split = batch.metadata.prefill.cp_split
    assert split is not None and split.bounds[0] == 4 and split.bounds[-1] == 294
    fixed = rocm_cp_indexer_plan.ROW_COST_KEYS
    costs = [t + 1 + fixed for t in range(200)] + [
        50 + t + 1 + fixed for t in range(90)
    ]
    before = [sum(costs[:j]) for j in range(len(costs) + 1)]
    for rank, cut in enumerate(split.bounds[1:-1], start=1):
        share = rank * before[-1] / 4
        nearest = min(range(len(before)), key=lambda j: abs(before[j] - share))
        assert abs(cut - 4 - nearest) <= 1, (rank, cut, nearest)
