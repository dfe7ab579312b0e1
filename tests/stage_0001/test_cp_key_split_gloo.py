# SPDX-License-Identifier: Apache-2.0
"""Stage 0001's key split on gloo: the real patched op over 2, 4 and 8
ranks of a real vLLM TP group, with requests whose rows every rank scores
over its own part of their keys, gives the single-rank top-k of every row,
and every rank holds the same selection of a key-split row.

The steps mix key-split turns (one across several chunks of the same
keys), rows shorter than k and parts shorter than k, tied scores at the
k-th (cached keys that repeat), decodes, and on trees with stage 0004 a
zero-length request among them. The top-k stand-ins choose
order and tied columns adversarially (``scripts.harness.adversary``).
Which requests are key-split is forced here (the planner's model weighs
serving-sized steps); the exchange and the merge are PyNccl's all_to_all
and all_gatherv on gloo. Three planted bugs must each fail the comparison:
a rank's candidates dropped, parts that end one key early, and a select
that keeps tied candidates before larger ones."""

from __future__ import annotations

import os

import pytest
import torch

from scripts.harness import indexer_batch, topk_reference
from scripts.harness.multiproc import GlooPyNccl, run_ranks
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree
from scripts.series.contract import STAGES_ENV

TREE = applied_tree("0001")

from vllm.v1.attention.ops import (  # noqa: E402
    rocm_cp_indexer,
    rocm_cp_indexer_merge,
    rocm_cp_indexer_plan,
)

TOPK = 16
LOGITS = 4096
# Requests with at least this many cached tokens are key-split.
KEY_SPLIT_CACHED = 40
# name: (requests as (cached, new), the period of cached keys (0: random))
SCENARIOS = {
    "a long turn alone": ([(300, 24)], 0),
    # Decodes, a key-split turn and a fresh prompt (its first rows shorter
    # than k), whole rows.
    "a turn beside a prompt and decodes": ([(30, 1), (41, 1), (400, 20), (0, 40)], 0),
    # Cached keys repeating every 7: scores tie in groups of ~70 at the
    # k-th, across the ranks' parts.
    "ties at the k-th score": ([(500, 12), (0, 30)], 7),
    # 30 rows over 1,030 keys: several chunks over the same keys.
    "a turn across chunks": ([(1000, 30), (30, 10)], 0),
    # 41-46 keys a row: at tp 8 each part is shorter than k.
    "parts shorter than k": ([(40, 6), (0, 20)], 0),
}
# A zero-length request joins vLLM's decode group and pads it, a path stage
# 0004 mends (the 0001 tree alone writes over prefill rows there): on the
# trees with stage 0004 only.
if "0004" in os.environ.get(STAGES_ENV, "").split(","):
    SCENARIOS["a zero-length request among the decodes"] = (
        [(30, 1), (25, 0), (41, 1), (400, 20), (0, 40)],
        0,
    )


def _forced_key_split(planned, keys, query_lens_cpu, *_):
    """The planner's choice, forced: the requests with KEY_SPLIT_CACHED
    cached tokens or more (the whole rows cut as the planner cuts them)."""
    ends = torch.cumsum(query_lens_cpu.to(torch.int64), 0).tolist()
    chosen = [
        (end - q, end)
        for end, q in zip(ends, query_lens_cpu.tolist(), strict=True)
        if q and int(keys[end - q]) > KEY_SPLIT_CACHED
    ]
    costs = planned.costs.clone()
    for start, end in chosen:
        costs[start:end] = 0
    return planned.bounds(costs), tuple(chosen)


def _build_all(tp_size: int, cp: bool) -> dict:
    batches = {}
    for name, (requests, period) in SCENARIOS.items():
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if cp else "0")
            indexer_batch.shrink_logits_budget(monkeypatch, LOGITS)
            monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
            monkeypatch.setattr(
                rocm_cp_indexer_plan, "_key_split_plan", _forced_key_split
            )
            monkeypatch.setattr(rocm_cp_indexer_plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)
            # The logits budget here is 4 KiB, too small for serving's
            # candidates (k = 2,048): the cap is not what these steps test.
            monkeypatch.setattr(
                rocm_cp_indexer_plan, "key_split_max_rows", lambda *_: 64
            )
            with emulate_rocm("gfx950"):
                config = indexer_batch.make_vllm_config(tp_size=tp_size)
                builder = indexer_batch.make_builder(config, monkeypatch)
                batches[name] = indexer_batch.build_batch(
                    builder,
                    requests,
                    cache_new_keys=True,
                    torch_context=True,
                    key_period=period,
                )
    return batches


def _run(batch) -> dict:
    """The op on one batch, recording each collective: the all_to_all's
    dtype and the rows it sends each rank, the all_gatherv's dtype and the
    rows each rank sends."""
    collectives: list[tuple[str, torch.dtype, list[int]]] = []
    gather, exchange = GlooPyNccl.all_gatherv, GlooPyNccl.all_to_all_single

    def recording_gather(self, output, input_, sizes, stream=None):
        collectives.append(("all_gatherv", output.dtype, list(sizes)))
        return gather(self, output, input_, sizes, stream)

    def recording_exchange(self, output, input_, out_sizes, in_sizes, stream=None):
        collectives.append(("all_to_all", input_.dtype, list(in_sizes)))
        return exchange(self, output, input_, out_sizes, in_sizes, stream)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(GlooPyNccl, "all_gatherv", recording_gather)
        monkeypatch.setattr(GlooPyNccl, "all_to_all_single", recording_exchange)
        with emulate_rocm("gfx950"):
            out = indexer_batch.run_indexer(
                batch, TOPK, skip_k_cache_insert=True, torch_gather=True
            )
    prefill = batch.metadata.prefill
    split = prefill.cp_split if prefill is not None else None
    return {
        "out": out,
        "collectives": collectives,
        "split": split,
        "chunks": len(prefill.chunks),
        "decode": batch.num_decode_tokens,
        "row_ends": batch.row_ends,
    }


def _run_all(rank: int, world_size: int, batches: dict, plant=None) -> dict:
    with pytest.MonkeyPatch.context() as monkeypatch:
        if plant is not None:
            plant(monkeypatch)
        return {name: _run(batch) for name, batch in batches.items()}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    batches = _build_all(1, cp=False)
    results = _run_all(0, 1, batches)
    for name, batch in batches.items():
        results[name]["logits"] = batch.reference_logits()
    return results


def _assert_exact(single_rank: dict, ranks: list[dict], names) -> None:
    """Every rank's rows equal the single-rank result (by score where
    scores tie), and every rank's key-split rows are the same."""
    for name in names:
        expected = single_rank[name]
        real = expected["row_ends"].numel()
        for result in ranks:
            topk_reference.assert_same_selection(
                expected["logits"],
                result[name]["out"][:real],
                expected["out"][:real],
                expected["row_ends"],
                TOPK,
            )
        for start, end in ranks[0][name]["split"].key_split:
            for result in ranks[1:]:
                assert torch.equal(
                    result[name]["out"][start:end], ranks[0][name]["out"][start:end]
                ), f"{name}: ranks hold key-split rows differently"


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"tp{n}")
def split_ranks(request) -> tuple[int, list[dict]]:
    batches = _build_all(request.param, cp=True)
    return request.param, run_ranks(request.param, _run_all, batches)


def test_scenarios_cover_what_they_claim(single_rank, split_ranks):
    world_size, ranks = split_ranks
    assert single_rank["a turn across chunks"]["chunks"] >= 3
    mixed = ranks[0]["a turn beside a prompt and decodes"]
    assert mixed["decode"] == 2
    assert min(mixed["row_ends"].tolist()) < TOPK
    for name in SCENARIOS:
        assert ranks[0][name]["split"].key_split, f"{name}: nothing key-split"
    # The turn's rows hold 41-46 keys: at tp 8, parts of 5 or 6.
    assert max(single_rank["parts shorter than k"]["row_ends"][:6]) // 8 < TOPK


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_key_split_rows_equal_the_single_rank_result(single_rank, split_ranks, name):
    _, ranks = split_ranks
    _assert_exact(single_rank, ranks, [name])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_exchange_and_one_merge_per_prefill(split_ranks, name):
    """One all_to_all of candidates (int32), each rank sending each owner
    the key-split rows in the owner's range, then one all_gatherv of every
    rank's range (int16 as bytes: every row here is short), key-split rows
    included."""
    world_size, ranks = split_ranks
    for result in ranks:
        scenario = result[name]
        split = scenario["split"]
        owners = split.key_split_owners
        assert sum(owners) == split.key_split_rows
        assert scenario["collectives"] == [
            ("all_to_all", torch.int32, owners),
            ("all_gatherv", torch.int8, split.sizes),
        ]


def _drop_a_rank(monkeypatch):
    real = rocm_cp_indexer_merge.select_top_k
    monkeypatch.setattr(
        rocm_cp_indexer_merge,
        "select_top_k",
        lambda candidates, parts, out, k: real(candidates[1:], parts - 1, out, k),
    )


def _parts_end_early(monkeypatch):
    real = rocm_cp_indexer.CPIndexerPrefill._key_part

    def early(self, *args):
        window = real(self, *args)
        return rocm_cp_indexer.PrefillWindow(
            **{**window.__dict__, "ke": torch.maximum(window.ke - 1, window.ks)}
        )

    monkeypatch.setattr(rocm_cp_indexer.CPIndexerPrefill, "_key_part", early)


def _ties_before_larger(monkeypatch):
    """A select that takes, in candidate order, the first k candidates
    scoring at least the k-th score: tied ones may push out larger ones."""

    def select(candidates, parts, out, k):
        indices = candidates[..., :k].transpose(0, 1).reshape(out.shape[0], -1)
        scores = candidates[..., k:].transpose(0, 1).reshape(out.shape[0], -1)
        scores = scores.contiguous().view(torch.float32)
        scores = torch.where(indices < 0, float("-inf"), scores)
        kth = scores.topk(k, dim=1).values[:, -1:]
        for row in range(out.shape[0]):
            kept = indices[row][scores[row] >= kth[row]][:k]
            out[row, : kept.numel()] = kept

    monkeypatch.setattr(rocm_cp_indexer_merge, "select_top_k", select)


@pytest.mark.parametrize(
    ("plant", "names"),
    [
        (_drop_a_rank, list(SCENARIOS)),
        (_parts_end_early, list(SCENARIOS)),
        (_ties_before_larger, ["ties at the k-th score"]),
    ],
    ids=["a rank's candidates dropped", "parts end a key early", "a wrong tie rule"],
)
def test_each_planted_bug_fails_the_comparison(single_rank, plant, names):
    """Each plant, at tp 2, breaks the comparison the exactness test makes
    (its scenarios: those where it can show)."""
    batches = _build_all(2, cp=True)
    batches = {name: batches[name] for name in names}
    ranks = run_ranks(2, _run_all, batches, plant)
    with pytest.raises(AssertionError):
        _assert_exact(single_rank, ranks, names)
