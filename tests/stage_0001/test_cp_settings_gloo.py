# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the TP ranks' CP indexer settings are checked to agree once,
when vLLM's indexer metadata builder is created on every rank of a real
vLLM TP group (gloo). A mismatch is a clear error on every rank, never a
hang in the merge's collective or rows that no rank scores."""

from __future__ import annotations

import os

import pytest

from scripts.harness import indexer_batch
from scripts.harness.multiproc import run_ranks
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

ENABLE = "VLLM_ROCM_USE_AITER_CP_INDEXER"
STRIPE = "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE"
TP = 4


def _start(rank: int, world_size: int, settings: list[tuple]):
    """Create the builder with this rank's settings (the flag, the stripe
    size, then other variables); its stripe or error."""
    enabled, stripe, *more = settings[rank]
    os.environ[ENABLE] = enabled
    os.environ[STRIPE] = stripe
    os.environ.update(*more)
    with pytest.MonkeyPatch.context() as monkeypatch, emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(tp_size=world_size)
        try:
            builder = indexer_batch.make_builder(config, monkeypatch)
        except ValueError as error:
            return "error", str(error)
    planner = builder.cp_indexer
    return "ok", None if planner is None else planner.stripe


def _on_every_rank(settings: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return run_ranks(TP, _start, settings, timeout_s=60)


def test_the_same_settings_start():
    assert _on_every_rank([("1", "1024")] * TP) == [("ok", 1024)] * TP
    assert _on_every_rank([("0", "512")] * TP) == [("ok", None)] * TP


@pytest.mark.parametrize(
    "settings, says",
    [
        pytest.param(
            [("1", "512"), ("0", "512"), ("1", "512"), ("1", "512")],
            [f"{ENABLE} differs across the TP ranks", "rank 0: True, rank 1: False"],
            id="the flag",
        ),
        pytest.param(
            [("1", "512"), ("1", "1024"), ("1", "512"), ("1", "512")],
            [f"{STRIPE} differs across the TP ranks", "rank 1: 1024"],
            id="the stripe size",
        ),
        # The rank that cannot read its stripe size must not raise while the
        # others wait for it in the collective.
        pytest.param(
            [("1", "512"), ("1", "512"), ("1", "oops"), ("1", "512")],
            [
                f"{STRIPE} differs across the TP ranks",
                "must be a positive number of rows, got 'oops'",
            ],
            id="a bad stripe size on one rank",
        ),
    ],
)
def test_settings_that_differ_are_an_error_on_every_rank(settings, says):
    for status, message in _on_every_rank(settings):
        assert status == "error"
        for text in says:
            assert text in message


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
    settings = [("1", "512", {variable: value}) if r == 1 else ("1", "512")
                for r in range(TP)]  # fmt: skip
    for status, message in _on_every_rank(settings):
        assert status == "error", message
        for text in says:
            assert text in message, message


def test_the_stripe_size_only_matters_with_the_split_on():
    settings = [("0", "512"), ("0", "1024"), ("0", "oops"), ("0", "512")]
    assert _on_every_rank(settings) == [("ok", None)] * TP


def test_a_bad_stripe_size_is_the_same_clear_error_on_every_rank():
    for status, message in _on_every_rank([("1", "0")] * TP):
        assert status == "error"
        assert f"{STRIPE} must be a positive number of rows, got '0'" in message
