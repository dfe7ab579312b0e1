# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 is exact on generated steps: the real patched op over 2, 4
and 8 ranks of a real vLLM TP group (gloo) gives every prefill and decode
row the single-rank top-k (by score, where scores tie), and every rank
holds the same selection of a key-split row.

Each seed draws one step from the serving distribution the host bench
models (``scripts.bench.serving_steps``), scaled to CPU size: a fresh
prompt's chunk, turns over cached prefixes, or a mix of both with decodes
(and on trees with stage 0004 a zero-length request among them), cached
keys that repeat in some (tied scores at the k-th), requests across several
chunks of one run, next requests in different runs. It draws which
requests are key-split too: none, one, next ones, ones apart, all, or
the shipped planner's own choice with its minimums and costs scaled to
these steps. The top-k stand-ins choose order and tied columns
adversarially (``scripts.harness.adversary``); the exchange and the merge
are PyNccl's all_to_all and all_gatherv on gloo.

CI runs ``SEEDS`` seeds; ``DSA_CP_EXACT_SEEDS=N`` runs seeds 0 to N - 1
instead (a seed that fails names its step). Planted bugs must each fail
the comparison: candidate rows of next key-split requests counted from the
run (the bug this test was written for), an owner one row off, a rank's
part of a row one key off, a rank's candidates dropped, and a select that
keeps tied candidates before larger ones; in the zigzag layout, an owner's
select one place early and owner blocks that the exchange counts
otherwise."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch

from scripts.harness import indexer_batch, plants, topk_reference
from scripts.harness.multiproc import GlooPyNccl, run_ranks
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree
from scripts.series.contract import STAGES_ENV

TREE = applied_tree("0001")

from vllm.v1.attention.ops import (  # noqa: E402
    rocm_cp_indexer,
    rocm_cp_indexer_calls,
    rocm_cp_indexer_merge,
    rocm_cp_indexer_plan,
)

TOPK = 16
# Logits elements a chunk: a few hundred keys make several chunks.
LOGITS = 4096
SEEDS_ENV = "DSA_CP_EXACT_SEEDS"
SEEDS = range(int(os.environ.get(SEEDS_ENV, "18")))
ZERO_LENGTH = "0004" in os.environ.get(STAGES_ENV, "").split(",")
# The serving family's ranges (scripts.bench.serving_steps), about a
# few hundredths: budgets of 8K-16K tokens, prompts of 1K-64K, turns of 64-4,096
# over 1K-300K.
BUDGETS = (24, 48)
FRESH = (8, 500)
TURN_NEW = (2, 24)
TURN_CACHED = (16, 900)
KEY_SPLITS = ("none", "one", "next ones", "ones apart", "all", "planner")


@dataclass(frozen=True)
class Step:
    """A drawn step: its requests (cached, new) in batch order, decodes
    first; the period of its cached keys (0: random); which prefill
    requests (by index among them) it key-splits, or None for the
    planner's own choice."""

    seed: int
    kind: str
    requests: list[tuple[int, int]]
    period: int
    key_split: str
    chosen: tuple[int, ...] | None

    def __str__(self) -> str:
        return (
            f"seed {self.seed} ({self.kind}, key split {self.key_split}"
            f" {self.chosen}, period {self.period}): {self.requests}"
        )


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _fresh_chunk(rng: random.Random, budget: int) -> tuple[int, int]:
    prompt = _log_uniform(rng, *FRESH)
    chunk = rng.randrange(-(-prompt // budget))
    return chunk * budget, min(budget, prompt - chunk * budget)


def _turns(rng: random.Random, room: int, most: int) -> list[tuple[int, int]]:
    turns: list[tuple[int, int]] = []
    for _ in range(rng.randint(1, most)):
        new = min(_log_uniform(rng, *TURN_NEW), room)
        if new < TURN_NEW[0]:
            break
        turns.append((_log_uniform(rng, *TURN_CACHED), new))
        room -= new
    return turns


def _chosen(rng: random.Random, how: str, prefills: int) -> tuple[int, ...] | None:
    """Which of ``prefills`` requests ``how`` key-splits."""
    if how == "planner":
        return None
    if how == "none" or not prefills:
        return ()
    if how == "all":
        return tuple(range(prefills))
    if how == "next ones" and prefills >= 2:
        first = rng.randrange(prefills - 1)
        return tuple(range(first, rng.randint(first + 2, prefills)))
    if how == "ones apart" and prefills >= 3:
        first = rng.randrange(prefills - 2)
        return (first, rng.randrange(first + 2, prefills))
    return (rng.randrange(prefills),)


def draw(seed: int) -> Step:
    """One step of the scaled serving distribution, and its key split."""
    rng = random.Random(seed)
    budget = rng.choice(BUDGETS)
    kind = rng.choice(("fresh", "turns", "mix"))
    decodes: list[tuple[int, int]] = []
    if kind == "fresh":
        prefills = [_fresh_chunk(rng, budget)]
    elif kind == "turns":
        prefills = _turns(rng, budget, 4)
    else:
        decodes = [(_log_uniform(rng, 8, 300), 1) for _ in range(rng.randint(1, 4))]
        if ZERO_LENGTH and rng.random() < 0.5:
            decodes.insert(rng.randrange(len(decodes) + 1), (rng.randint(8, 60), 0))
        fresh = _fresh_chunk(rng, budget // 2)
        prefills = [*_turns(rng, budget - fresh[1], 3), fresh]
    # A one-token prefill would be a decode: vLLM's builder reorders those.
    prefills = [(cached, max(new, 2)) for cached, new in prefills]
    period = 7 if rng.random() < 0.3 else 0
    # Steps of one request cannot show next or apart ones: mostly planned.
    how = rng.choice(KEY_SPLITS)
    return Step(
        seed,
        kind,
        decodes + prefills,
        period,
        how,
        _chosen(rng, how, len(prefills)),
    )


def _row_ranges(query_lens_cpu: torch.Tensor) -> list[tuple[int, int]]:
    ends = torch.cumsum(query_lens_cpu.to(torch.int64), 0).tolist()
    return [
        (end - q, end) for end, q in zip(ends, query_lens_cpu.tolist(), strict=True)
    ]


def _scale_the_planner(monkeypatch, step: Step) -> None:
    """The planner at CPU size: every step splits (the gate weighs
    serving-sized steps), its minimums and costs scaled by about a
    thousandth; or, for a drawn key split, that choice forced, the whole
    rows cut as the planner cuts them."""
    plan = rocm_cp_indexer_plan
    monkeypatch.setattr(plan, "split_repays", lambda *_: True)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_KEYS_PER_RANK", 2 * TOPK)
    monkeypatch.setattr(plan, "CALL_COST_KEYS", 2_600)
    monkeypatch.setattr(plan, "ROW_COST_KEYS", 1)
    monkeypatch.setattr(plan, "NS_PER_KEY_ROW", plan.NS_PER_KEY_ROW * 1000)
    # The logits budget here is 16 KiB, too small for serving's candidates
    # (k = 2,048): caps scaled like the rest.
    monkeypatch.setattr(plan, "key_split_max_rows", lambda *_: 64)
    monkeypatch.setattr(plan, "key_split_max_owned", lambda *_: 32)
    if step.chosen is None:
        return

    def forced(planned, keys, query_lens_cpu, *_):
        requests = [r for r in _row_ranges(query_lens_cpu) if r[1] > r[0]]
        chosen = tuple(requests[i] for i in step.chosen)
        costs = planned.costs.clone()
        for start, end in chosen:
            costs[start:end] = plan.owned_row_cost(planned.tp_size)
        return planned.bounds(costs, chosen), chosen

    monkeypatch.setattr(plan, "_key_split_plan", forced)

    def forced_binding(keys, query_lens_cpu, *_):
        requests = [r for r in _row_ranges(query_lens_cpu) if r[1] > r[0]]
        return tuple(requests[i] for i in step.chosen)

    monkeypatch.setattr(plan, "binding_requests", forced_binding)


def _build_all(tp_size: int, cp: bool, steps: list[Step], layout: str = "cost") -> list:
    batches = []
    for step in steps:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if cp else "0")
            indexer_batch.shrink_logits_budget(monkeypatch, LOGITS)
            _scale_the_planner(monkeypatch, step)
            monkeypatch.setattr(rocm_cp_indexer_plan, "ROW_LAYOUT", layout)
            with emulate_rocm("gfx950"):
                config = indexer_batch.make_vllm_config(tp_size=tp_size)
                builder = indexer_batch.make_builder(config, monkeypatch)
                batches.append(
                    indexer_batch.build_batch(
                        builder,
                        step.requests,
                        seed=step.seed,
                        cache_new_keys=True,
                        torch_context=True,
                        key_period=step.period,
                    )
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
    return {
        "out": out,
        "collectives": collectives,
        "split": prefill.cp_split if prefill is not None else None,
        "chunks": prefill.chunks if prefill is not None else [],
        "decode": batch.num_decode_tokens,
    }


def _run_all(rank: int, world_size: int, batches: list, plant=None) -> list[dict]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        if plant is not None:
            plant(monkeypatch)
        results = []
        for batch in batches:
            rocm_cp_indexer._STEP_WINDOWS[:] = [None, None, (None, [], None)]
            results.append(_run(batch))
        return results


STEPS = [draw(seed) for seed in SEEDS]


@pytest.fixture(scope="module")
def single_rank() -> list[dict]:
    batches = _build_all(1, False, STEPS)
    results = _run_all(0, 1, batches)
    for result, batch in zip(results, batches, strict=True):
        result["logits"] = batch.reference_logits()
        result["row_ends"] = batch.row_ends
    return results


def _mismatches(single_rank: list[dict], ranks: list[list[dict]], steps) -> list[str]:
    """The steps whose rows differ from the single-rank result on some rank
    (by score where scores tie), or whose key-split rows differ between
    ranks."""
    wrong = []
    for index, step in enumerate(steps):
        expected = single_rank[index]
        real = expected["row_ends"].numel()
        try:
            for rank, results in enumerate(ranks):
                try:
                    topk_reference.assert_same_selection(
                        expected["logits"],
                        results[index]["out"][:real],
                        expected["out"][:real],
                        expected["row_ends"],
                        TOPK,
                    )
                except AssertionError as error:
                    raise AssertionError(f"rank {rank}, {error}") from None
            split = ranks[0][index]["split"]
            for start, end in split.key_split if split else ():
                for results in ranks[1:]:
                    assert torch.equal(
                        results[index]["out"][start:end],
                        ranks[0][index]["out"][start:end],
                    ), "ranks hold key-split rows differently"
        except AssertionError as error:
            wrong.append(f"{step}: {error}")
    return wrong


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"tp{n}")
def split_ranks(request) -> tuple[int, list[list[dict]]]:
    batches = _build_all(request.param, True, STEPS)
    return request.param, run_ranks(request.param, _run_all, batches)


def test_every_rank_holds_the_single_rank_top_k(single_rank, split_ranks):
    _, ranks = split_ranks
    wrong = _mismatches(single_rank, ranks, STEPS)
    assert not wrong, "\n".join(wrong)


def _wide(monkeypatch) -> None:
    """Every row travels int32, as rows of 65,535 keys and more do."""
    monkeypatch.setattr(rocm_cp_indexer_plan, "NARROW_KEYS", 0)


@pytest.fixture(
    scope="module",
    params=[(2, "wide"), (4, "narrow"), (8, "wide")],
    ids=lambda p: f"tp{p[0]}-{p[1]}",
)
def zigzag_ranks(request) -> tuple[int, str, list[list[dict]]]:
    tp, width = request.param
    batches = _build_all(tp, True, STEPS, layout="zigzag")
    plant = _wide if width == "wide" else None
    return tp, width, run_ranks(tp, _run_all, batches, plant)


def test_a_zigzag_split_gives_every_rank_the_single_rank_top_k(
    single_rank, zigzag_ranks
):
    """The zigzag layout: each rank's rows of every request, gathered into
    one call per run, the key-split rows owned in equal blocks, merged once
    (int16 or int32) and put back in batch order."""
    tp, width, ranks = zigzag_ranks
    wrong = _mismatches(single_rank, ranks, STEPS)
    assert not wrong, "\n".join(wrong)
    key_split_seen = 0
    for index, step in enumerate(STEPS):
        split = ranks[0][index]["split"]
        if split is None:
            continue
        assert split.order is not None, str(step)
        prefill_rows = sum(new for _, new in step.requests) - ranks[0][index]["decode"]
        # Every rank holds rows, none more than its share and a block of
        # each request and of the key-split rows over it.
        assert min(split.sizes) > 0, str(step)
        most = prefill_rows / tp + 2 * len(step.requests) + 1
        assert max(split.sizes) <= most, str(step)
        dtype = torch.int32 if width == "wide" else torch.int8
        expected = [("all_gatherv", dtype, split.sizes)]
        if split.key_split:
            key_split_seen += 1
            owners = split.key_split_owners
            assert max(owners) - min(owners) <= 1, str(step)
            expected.insert(0, ("all_to_all", torch.int32, owners))
        for results in ranks:
            assert results[index]["collectives"] == expected, str(step)
    assert key_split_seen >= 3


def test_one_exchange_and_one_merge_per_prefill(split_ranks):
    """Where rows are key-split, one all_to_all of candidates (int32), each
    rank sending each owner the key-split rows in the owner's range; then
    one all_gatherv of every rank's range (int16 as bytes: every row here
    is short). None where a step has fewer prefill rows than ranks
    (replicated)."""
    _, ranks = split_ranks
    for index, step in enumerate(STEPS):
        for results in ranks:
            split = results[index]["split"]
            expected = [("all_gatherv", torch.int8, split.sizes)] if split else []
            if split and split.key_split:
                owners = split.key_split_owners
                assert sum(owners) == split.key_split_rows
                expected.insert(0, ("all_to_all", torch.int32, owners))
            assert results[index]["collectives"] == expected, str(step)


def _covered(tp: int, ranks: list[list[dict]]) -> set[str]:
    """What the steps held, as the op saw them on rank 0."""
    seen: set[str] = set()
    for index, step in enumerate(STEPS):
        result = ranks[0][index]
        split, chunks = result["split"], result["chunks"]
        seen |= {step.kind, f"key split {step.key_split}"}
        if step.period:
            seen.add("tied keys")
            if split and split.key_split:
                seen.add("tied keys, key-split")
        if result["decode"]:
            seen.add("decodes")
        if any(new == 0 for _, new in step.requests):
            seen.add("a zero-length request")
        # Each row's keys, in batch order (decodes first, as built).
        keys = [c + t + 1 for c, n in step.requests for t in range(n)]
        if min(keys[result["decode"] :]) < TOPK:
            seen.add("rows shorter than k")
        runs = rocm_cp_indexer_calls.shared_key_runs(chunks, 0)
        if any(last - first > most for first, last, most in runs):
            seen.add("a request across chunks of one run")
        if split is None:
            continue
        key_split = split.key_split
        if step.chosen is None and key_split:
            seen.add("the planner key-splits")
        if any(a[1] == b[0] for a, b in pairwise(key_split)):
            seen.add("next key-split requests")
        for start, end in rocm_cp_indexer_calls.joined(key_split):
            if sum(first < end and last > start for first, last, _ in runs) > 1:
                seen.add("key-split rows across runs")
            if any(start < cut < end for cut in split.bounds[1:-1]):
                seen.add("key-split rows across a cut")
            if min(keys[start:end]) // tp < TOPK:
                seen.add("parts shorter than k")
    return seen


def test_the_steps_hold_what_they_claim(split_ranks):
    """The CI seeds cover what the docstring says, at every tp."""
    tp, ranks = split_ranks
    if len(SEEDS) < 18:
        pytest.skip(f"{SEEDS_ENV} asks for fewer steps than CI's")
    wanted = {
        "fresh",
        "turns",
        "mix",
        *(f"key split {how}" for how in KEY_SPLITS),
        "tied keys",
        "tied keys, key-split",
        "decodes",
        "rows shorter than k",
        "a request across chunks of one run",
        "the planner key-splits",
        "next key-split requests",
        "key-split rows across runs",
        "key-split rows across a cut",
    }
    if tp == 8:
        wanted.add("parts shorter than k")
    if ZERO_LENGTH:
        wanted.add("a zero-length request")
    assert wanted <= _covered(tp, ranks), sorted(wanted - _covered(tp, ranks))


# Planted bugs. Each must fail the comparison at tp 2 on the CI seeds.


def _owner_one_row_off(monkeypatch):
    """Each rank selects the key-split rows one row past its range."""
    split_class = rocm_cp_indexer_plan.CPIndexerSplit

    def owned(self, rank):
        # Every cut between two ranks one row late: each row still has one
        # owner, but the row at a cut is selected by the rank below it.
        first, last = self.rows_of(rank)
        first += rank > 0
        last += rank < len(self.bounds) - 2
        return [
            (max(start, first), min(end, last))
            for start, end in self.key_split
            if start < last and end > first
        ]

    monkeypatch.setattr(split_class, "owned_key_split", owned)


def _part_one_key_late(monkeypatch):
    """Each rank's part of a key-split row starts one key late."""
    real = rocm_cp_indexer.CPIndexerPrefill._key_part

    def late(self, *args):
        window = real(self, *args)
        offset = window.key_offset + 1
        return rocm_cp_indexer.PrefillWindow(
            **{
                **window.__dict__,
                "ks": torch.minimum(window.ks + 1, window.ke),
                "key_offset": offset,
            }
        )

    monkeypatch.setattr(rocm_cp_indexer.CPIndexerPrefill, "_key_part", late)


def _drop_a_rank(monkeypatch):
    real = rocm_cp_indexer_merge.select_top_k
    monkeypatch.setattr(
        rocm_cp_indexer_merge,
        "select_top_k",
        lambda candidates, parts, out, k: real(candidates[1:], parts - 1, out, k),
    )


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


def _across_runs(split, runs) -> bool:
    return any(
        sum(first < end and last > start for first, last, _ in runs) > 1
        for start, end in rocm_cp_indexer_calls.joined(split.key_split)
    )


def _at_a_cut(split, runs) -> bool:
    return any(
        start <= cut < end
        for start, end in split.key_split
        for cut in split.bounds[1:-1]
    )


# Each plant, and the steps it can show on: their split and runs of chunks.
PLANTS = {
    "e4a57df's walk": (plants.e4a57df_rank_calls, _across_runs),
    "an owner one row off": (_owner_one_row_off, _at_a_cut),
    "a part one key late": (_part_one_key_late, lambda split, runs: True),
    "a rank dropped": (_drop_a_rank, lambda split, runs: True),
    "ties kept first": (_ties_before_larger, lambda split, runs: None),
}


@pytest.fixture(scope="module")
def at_tp_2() -> list:
    return _build_all(2, True, STEPS)


@pytest.mark.parametrize("name", list(PLANTS))
def test_each_planted_bug_fails_the_comparison(single_rank, at_tp_2, name):
    """At tp 2, on three of the CI seeds' key-split steps the plant can show
    on (ties kept first: those with tied keys)."""
    plant, shows = PLANTS[name]
    chosen = []
    for index, (step, batch) in enumerate(zip(STEPS, at_tp_2, strict=True)):
        prefill = batch.metadata.prefill
        split = prefill.cp_split if prefill is not None else None
        if split is None or not split.key_split:
            continue
        runs = rocm_cp_indexer_calls.shared_key_runs(prefill.chunks, 0)
        if shows(split, runs) or (shows(split, runs) is None and step.period):
            chosen.append(index)
    chosen = chosen[:3]
    assert chosen, f"no CI seed shows {name}"
    ranks = run_ranks(2, _run_all, [at_tp_2[i] for i in chosen], plant)
    expected = [single_rank[i] for i in chosen]
    assert _mismatches(expected, ranks, [STEPS[i] for i in chosen])


def _places_one_early(monkeypatch):
    """A zigzag owner selects its key-split rows one place early."""

    def owned_places(self, rank):
        end = self.bounds[rank + 1] - 1
        return [(end - self.key_split_owners[rank], end)]

    monkeypatch.setattr(
        rocm_cp_indexer_plan.CPIndexerSplit, "owned_places", owned_places
    )


def _blocks_rounded_up(monkeypatch):
    """The key-split rows' owners cut at rows * r / tp rounded up, while the
    exchange counts blocks rounded down: on rows that tp does not divide,
    a row travels to one owner and is placed at another's."""
    real = rocm_cp_indexer_plan.even_blocks

    def rounded_up(rows, tp_size):
        cuts = [-(-rows * r // tp_size) for r in range(tp_size + 1)]
        return [b - a for a, b in pairwise(cuts)]

    monkeypatch.setattr(rocm_cp_indexer_plan, "even_blocks", rounded_up)
    split_class = rocm_cp_indexer_plan.CPIndexerSplit
    monkeypatch.setattr(
        split_class,
        "key_split_owners",
        property(lambda self: real(self.key_split_rows, len(self.bounds) - 1)),
    )


ZIGZAG_PLANTS = {
    "places one early": _places_one_early,
    "blocks rounded up": _blocks_rounded_up,
}


@pytest.mark.parametrize("name", list(ZIGZAG_PLANTS))
def test_each_planted_zigzag_bug_fails_the_comparison(single_rank, name):
    """At tp 2, on the CI seeds' zigzag steps with key-split rows that tp
    does not divide (planted at the plan, so it holds on every rank)."""
    with pytest.MonkeyPatch.context() as planted:
        ZIGZAG_PLANTS[name](planted)
        batches = _build_all(2, True, STEPS, layout="zigzag")
    chosen = [
        index
        for index, batch in enumerate(batches)
        if batch.metadata.prefill is not None
        and (split := batch.metadata.prefill.cp_split) is not None
        and split.key_split_rows % 2
    ][:3]
    assert chosen, "no CI seed key-splits an odd count of rows"
    ranks = run_ranks(2, _run_all, [batches[i] for i in chosen], ZIGZAG_PLANTS[name])
    expected = [single_rank[i] for i in chosen]
    assert _mismatches(expected, ranks, [STEPS[i] for i in chosen])
