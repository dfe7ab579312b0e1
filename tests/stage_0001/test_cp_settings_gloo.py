# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the TP ranks' CP indexer flag, decision and plan settings
are checked to agree once, when vLLM's indexer metadata builder is created
on every rank of a real vLLM TP group (gloo), through the group's store. A
mismatch is a clear error on every rank with the flag on, never a hang in
the merge or rows that no rank scores; a rank with the flag off only
publishes its flag and makes no collective."""

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
UNITS = "DSA_TEST_COMPUTE_UNITS"  # this test's own, read by _start
GFX942_LOGITS = "DSA_TEST_GFX942_LOGITS"  # this test's own, read by _start
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
        # The GPU's compute units, which the builder reads from the device
        # and which size the planner's wave (MI355X's 256 unless a case
        # gives a rank another GPU).
        units = int(os.environ.get(UNITS, "256"))
        if os.environ.get(GFX942_LOGITS):
            # This rank's op calls gfx942's logits, which fill their chunk
            # (a TP group of mixed GPUs).
            from vllm.v1.attention.ops import rocm_aiter_mla_sparse

            monkeypatch.setattr(rocm_aiter_mla_sparse, "_ON_GFX942", True)
        try:
            builder = indexer_batch.make_builder(
                config, monkeypatch, compute_units=units
            )
            result = ("ok", builder.cp_indexer is not None)
        except ValueError as error:
            result = ("error", str(error))
    # Every rank stays up until all have started, as an engine's do (rank 0
    # serves the group's store).
    torch.distributed.barrier()
    if os.environ.get("COUNT_COLLECTIVES") and result[0] == "ok":
        return (*result, calls)
    return result


def _on_every_rank(settings: list[tuple]) -> list[tuple[str, object]]:
    return run_ranks(TP, _start, settings, timeout_s=60)


def test_the_same_settings_start():
    assert _on_every_rank([("1",)] * TP) == [("ok", True)] * TP
    assert _on_every_rank([("0",)] * TP) == [("ok", False)] * TP


def test_the_startup_check_makes_no_collective():
    counting = {"COUNT_COLLECTIVES": "1"}
    assert _on_every_rank([("0", counting)] * TP) == [("ok", False, [])] * TP
    assert _on_every_rank([("1", counting)] * TP) == [("ok", True, [])] * TP


@pytest.mark.parametrize("off", [0, 2])
def test_the_flag_off_on_one_rank_is_an_error_on_the_others(off):
    """The rank with the flag off goes on without waiting (it would be
    stopped with the engine); every rank with it on names the flag and the
    ranks, rather than waiting for that rank in the merge."""
    settings = [("0",) if r == off else ("1",) for r in range(TP)]
    for rank, result in enumerate(_on_every_rank(settings)):
        if rank == off:
            assert result == ("ok", False)
            continue
        status, message = result
        assert status == "error", message
        flags = ", ".join(f"rank {r}: {r != off}" for r in range(TP))
        assert (
            f"VLLM_ROCM_USE_AITER_CP_INDEXER differs across the TP ranks ({flags})"
            in message
        )


@pytest.mark.parametrize(
    "variable, value, says",
    [
        # The others would plan a split rank 1 does not, and wait in the merge.
        pytest.param(
            "VLLM_DISABLE_PYNCCL",
            "1",
            [
                "the CP indexer's decision differs across the TP ranks",
                "rank 0: 'split', rank 1: 'the merge runs on PyNccl",
            ],
            id="the decision (PyNccl off on one rank)",
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
        # The compute units size the wave, which moves the cuts.
        pytest.param(
            UNITS,
            "304",
            ["the GPU's compute units differs across the TP ranks", "rank 1: 304"],
            id="the GPU's compute units",
        ),
        # The logits' -inf fill adds each chunk's width to a row's cost.
        pytest.param(
            GFX942_LOGITS,
            "1",
            [
                "the logits kernel's -inf fill differs across the TP ranks",
                "rank 0: False, rank 1: True, rank 2: False",
            ],
            id="the logits kernel's fill",
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
