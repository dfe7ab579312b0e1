# SPDX-License-Identifier: Apache-2.0
"""The host bench checks every split step it runs: each simulated rank's
rows, with the exchange and the merge emulated by copies between the
ranks, equal the replicated op's by score, and a step whose rows differ
ends the run with its name.

Run here through Triton's interpreter (as the bench's plumbing test does),
on the step the key split once got wrong: two turns key-split next to each
other, in different runs of chunks, beside a fresh prompt."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.harness import indexer_batch, plants
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")
# The bench runs on stage 0001's tree (scripts/gpu_bundle.sh 0001).
pytestmark = pytest.mark.own_tree

from scripts.bench import cp_indexer_host as bench  # noqa: E402
from scripts.bench import cp_indexer_host_timing as timing  # noqa: E402
from scripts.bench.cp_indexer_host_check import RowsDiffer  # noqa: E402
from scripts.bench.serving_steps import Step  # noqa: E402
from vllm.v1.attention.ops import rocm_cp_indexer_plan  # noqa: E402

STEP = Step("two turns key-split + fresh 30", [(300, 24), (400, 20), (0, 30)])


def _key_split_the_turns(planned, keys, query_lens_cpu, *_):
    """The planner's choice, forced: the two turns (prefill rows 0-44)."""
    turns = ((0, 24), (24, 44))
    costs = planned.costs.clone()
    costs[:44] = 0
    return planned.bounds(costs, turns), turns


@pytest.fixture
def check_only(monkeypatch, tmp_path, bench_here):
    """The bench in --check-only at tp 2, k = 16, 4 heads, chunks of 4,096
    logits (the turns fall in different runs), the turns key-split."""
    monkeypatch.setattr(timing, "CHECK_ONLY", True)
    # The harness's torch stand-ins of AITER's kernels, not the bench's fast
    # Triton ones, which the interpreter runs slowly: the check is tested.
    monkeypatch.setattr(
        timing,
        "use_kernels",
        lambda stack, mp: stack.enter_context(emulate_rocm("gfx950")),
    )
    monkeypatch.setattr(timing, "TOPK", 16)
    monkeypatch.setattr(timing, "HEADS", 4)
    monkeypatch.setattr(bench, "TPS", (2,))
    monkeypatch.setattr(bench, "named", lambda: [STEP])
    monkeypatch.setattr(bench, "family", lambda count, seed: [])
    indexer_batch.shrink_logits_budget(monkeypatch, 4096)
    plan = rocm_cp_indexer_plan
    monkeypatch.setattr(plan, "split_repays", lambda *_: True)
    monkeypatch.setattr(plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)
    monkeypatch.setattr(plan, "_key_split_plan", _key_split_the_turns)
    monkeypatch.setattr(plan, "key_split_max_rows", lambda *_: 64)
    argv = ["cp_indexer_host", "--check-only", "--out", str(tmp_path), "--runs", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    return tmp_path


def test_every_split_step_is_checked_and_recorded(check_only, monkeypatch):
    monkeypatch.setattr(bench, "TPS", (2, 4))
    assert bench.main() == 0
    written = json.loads((check_only / "cp_indexer_exactness.json").read_text())
    assert written["exactness_checked"] is True and written["commit"]
    assert "--check-only" in written["command"]
    for tp in (2, 4):
        result = written["results"][f"{STEP.name} | tp {tp}"]
        split = result["split"]["shipped"]
        assert split["key_split"] == [[0, 24], [24, 44]]
        assert split["checked_rows"] == 74
        assert "gpu_ms" not in split  # nothing timed


def test_rows_that_differ_end_the_run_with_the_steps_name(
    check_only, monkeypatch, capsys
):
    plants.e4a57df_rank_calls(monkeypatch)
    assert bench.main() == 1
    error = capsys.readouterr().err
    assert f"exactness check failed: {STEP.name}: tp 2, shipped: rank" in error


def test_the_replicated_rows_are_the_reference(check_only, monkeypatch):
    """The check compares with the replicated op's own rows: rows that no
    rank wrote (the buffers' fill) fail it."""
    from scripts.bench import cp_indexer_host_check as check

    real = check.merged_buffers

    def one_row_unwritten(*args):
        buffers = real(*args)
        buffers[-1][50] = -7
        return buffers

    monkeypatch.setattr(check, "merged_buffers", one_row_unwritten)
    with pytest.raises(RowsDiffer, match="batch row 50"):
        bench.bench_step(STEP, 1, {"shipped": None})
