# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: with the flag on, the TP ranks' CP indexer decision and plan
settings are checked to agree once, when vLLM's indexer metadata builder is
created on every rank of a real vLLM TP group (gloo). A mismatch is a clear
error on every rank, never a hang in the merge's collective or rows that no
rank scores. With the flag off the ranks make no collective at all (the
flag itself must then agree: docs/stage_0001.md)."""

from __future__ import annotations

import os

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.multiproc import run_ranks
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

ENABLE = "VLLM_ROCM_USE_AITER_CP_INDEXER"
STRIPE = "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE"
TP = 4


def _start(rank: int, world_size: int, settings: list[tuple]):
    """Create the builder with this rank's settings (the flag, then other
    variables); whether it splits, or its error. Any collective the startup
    makes is counted, after the engine's own (making the config)."""
    enabled, *more = settings[rank]
    os.environ[ENABLE] = enabled
    os.environ.update(*more)
    with pytest.MonkeyPatch.context() as monkeypatch, emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(tp_size=world_size)
        calls = []
        for name in ("all_gather_object", "all_gather", "broadcast", "barrier"):
            real = getattr(torch.distributed, name)
            monkeypatch.setattr(
                torch.distributed,
                name,
                lambda *a, _real=real, _name=name, **k: (
                    calls.append(_name) or _real(*a, **k)
                ),
            )
        try:
            builder = indexer_batch.make_builder(config, monkeypatch)
        except ValueError as error:
            return "error", str(error)
    if os.environ.get("COUNT_COLLECTIVES"):
        return "ok", builder.cp_indexer is not None, calls
    return "ok", builder.cp_indexer is not None


def _on_every_rank(settings: list[tuple]) -> list[tuple[str, object]]:
    return run_ranks(TP, _start, settings, timeout_s=60)


def test_the_same_settings_start():
    assert _on_every_rank([("1",)] * TP) == [("ok", True)] * TP
    assert _on_every_rank([("0",)] * TP) == [("ok", False)] * TP


def test_the_flag_off_makes_no_collective_and_on_makes_one():
    counting = {"COUNT_COLLECTIVES": "1"}
    assert _on_every_rank([("0", counting)] * TP) == [("ok", False, [])] * TP
    on = [("ok", True, ["all_gather_object"])] * TP
    assert _on_every_rank([("1", counting)] * TP) == on


@pytest.mark.parametrize(
    "variable, value, says",
    [
        # Rank 1 would plan a split the others do not, and wait in the merge.
        pytest.param(
            "VLLM_USE_NCCL_SYMM_MEM",
            "1",
            [
                "the CP indexer's decision differs across the TP ranks",
                "rank 0: 'split', rank 1: \"the merge's all_gatherv does not use",
            ],
            id="the decision (symmetric memory on one rank)",
        ),
        # The logits budget shapes the chunks, and the cuts with them.
        pytest.param(
            "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB",
            "256",
            [
                "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB differs across the TP ranks",
                "rank 1: 256",
            ],
            id="the logits budget",
        ),
    ],
)
def test_a_decision_or_plan_setting_that_differs_is_an_error_on_every_rank(
    variable, value, says
):
    settings = [("1", {variable: value}) if r == 1 else ("1",) for r in range(TP)]
    for status, message in _on_every_rank(settings):
        assert status == "error", message
        for text in says:
            assert text in message, message


def test_the_deprecated_stripe_size_may_differ_it_is_ignored():
    stripes = ["512", "1024", "oops", "0"]
    settings = [("1", {STRIPE: stripe}) for stripe in stripes]
    assert _on_every_rank(settings) == [("ok", True)] * TP
