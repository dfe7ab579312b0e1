# SPDX-License-Identifier: Apache-2.0
"""Stage 0001: the row assignment, the env vars and when the split stays off."""

from __future__ import annotations

import pytest
import torch

from harness import indexer_batch
from harness.rocm_platform import emulate_rocm
from harness.tree import applied_tree

TREE = applied_tree("0001")

from vllm.v1.attention.ops import rocm_cp_indexer  # noqa: E402
from vllm.v1.attention.ops.rocm_cp_indexer import (  # noqa: E402
    CPIndexerSplit,
    parse_stripe_size,
    plan_cp_indexer_split,
)


@pytest.fixture
def cp_on(monkeypatch):
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    with emulate_rocm("gfx950"):
        yield
    monkeypatch.delenv("VLLM_ROCM_USE_AITER_CP_INDEXER")


def _owners(split: CPIndexerSplit) -> list[int]:
    rows = torch.arange(split.first_row, split.first_row + split.num_rows)
    return split.owner(rows).tolist()


def test_stripes_are_dealt_in_mirrored_order():
    split = CPIndexerSplit(world_size=3, stripe=2, first_row=5, num_rows=14)
    assert _owners(split) == [0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("num_rows", [8, 999, 4096, 16384])
def test_every_row_has_one_owner_and_every_rank_works(world_size, num_rows):
    split = CPIndexerSplit(world_size, 512, 7, num_rows)
    owners = torch.tensor(_owners(split))
    assert owners.min() >= 0 and owners.max() < world_size
    if num_rows >= 2 * world_size * split.stripe:
        assert set(owners.tolist()) == set(range(world_size))


def test_the_plan_uses_the_prefill_row_index_and_shrinks_short_stripes(cp_on):
    config = indexer_batch.make_vllm_config(tp_size=8)
    split = plan_cp_indexer_split(config, 1, False, 8, 3, 16384)
    assert split == CPIndexerSplit(8, 512, 3, 16384)
    # 2K rows: two rounds of eight ranks need stripes of 128.
    short = plan_cp_indexer_split(config, 1, False, 8, 0, 2048)
    assert short is not None and short.stripe == 128
    assert set(_owners(short)) == set(range(8))


def test_long_context_chunks_engage_every_rank(cp_on):
    """At 128K keys the chunker gives ~1K-row chunks; per-chunk stripes of 512
    would use 2 of 8 ranks, stripes over the prefill use all of them."""
    config = indexer_batch.make_vllm_config(tp_size=8)
    split = plan_cp_indexer_split(config, 1, False, 8, 0, 16384)
    assert split is not None
    per_rank = torch.bincount(torch.tensor(_owners(split)), minlength=8)
    assert per_rank.tolist() == [2048] * 8


@pytest.mark.parametrize(
    ("tp", "dcp", "pcp", "rows"), [(1, 1, False, 100), (4, 1, False, 3)]
)
def test_nothing_to_split(cp_on, tp, dcp, pcp, rows):
    config = indexer_batch.make_vllm_config(tp_size=tp)
    assert plan_cp_indexer_split(config, dcp, pcp, tp, 0, rows) is None


def test_flag_off_or_no_aiter_means_no_split(monkeypatch):
    config = indexer_batch.make_vllm_config(tp_size=2)
    with emulate_rocm("gfx950"):
        assert plan_cp_indexer_split(config, 1, False, 2, 0, 4096) is None
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    with emulate_rocm("gfx950", aiter=False):
        assert plan_cp_indexer_split(config, 1, False, 2, 0, 4096) is None
    assert plan_cp_indexer_split(config, 1, False, 2, 0, 4096) is None  # not ROCm


@pytest.mark.parametrize(
    ("dcp", "pcp", "graphs", "invariant", "reason"),
    [
        (2, False, None, False, "decode context parallelism"),
        (1, True, None, False, "prefill context parallelism"),
        (1, False, "FULL", False, "FULL CUDA graphs"),
        (1, False, None, True, "batch invariance"),
    ],
)
def test_unsafe_configurations_fall_back_with_one_log_line(
    cp_on, monkeypatch, dcp, pcp, graphs, invariant, reason
):
    import vllm.envs as envs
    from vllm.config import CUDAGraphMode

    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", invariant, raising=False)
    mode = CUDAGraphMode[graphs] if graphs else None
    config = indexer_batch.make_vllm_config(tp_size=2, cudagraph_mode=mode)
    assert rocm_cp_indexer.unsafe_config_reason(config, dcp, pcp) is not None
    assert reason in rocm_cp_indexer.unsafe_config_reason(config, dcp, pcp)
    logged = []
    monkeypatch.setattr(
        rocm_cp_indexer.logger,
        "info_once",
        lambda msg, *args: logged.append(msg % args),
    )
    assert plan_cp_indexer_split(config, dcp, pcp, 2, 0, 4096) is None
    assert len(logged) == 1 and reason in logged[0]


@pytest.mark.parametrize(
    "graphs", ["PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]
)
def test_graphs_that_leave_mixed_batches_eager_or_piecewise_are_safe(cp_on, graphs):
    from vllm.config import CUDAGraphMode

    config = indexer_batch.make_vllm_config(
        tp_size=2, cudagraph_mode=CUDAGraphMode[graphs]
    )
    assert rocm_cp_indexer.unsafe_config_reason(config, 1, False) is None


def test_the_metadata_builder_plans_the_split(cp_on, monkeypatch):
    """Through vLLM's own builder: decode rows first, then the plan over the
    prefill rows only."""
    config = indexer_batch.make_vllm_config(tp_size=4)
    builder = indexer_batch.make_builder(config, monkeypatch)
    batch = indexer_batch.build_batch(builder, [(30, 1), (0, 200), (50, 90)])
    assert batch.metadata.prefill.cp_split == CPIndexerSplit(4, 36, 1, 290)
    single = indexer_batch.make_builder(indexer_batch.make_vllm_config(1), monkeypatch)
    batch = indexer_batch.build_batch(single, [(30, 1), (0, 200)])
    assert batch.metadata.prefill.cp_split is None


@pytest.mark.parametrize("value", ["0", "-512", "abc", "", "1.5"])
def test_invalid_stripe_sizes_are_clear_errors(value):
    with pytest.raises(ValueError, match="must be a positive number of rows"):
        parse_stripe_size(value)


def test_env_vars_are_registered_and_mirrored(monkeypatch):
    import vllm.envs as envs
    from vllm._aiter_ops import rocm_aiter_ops

    assert envs.VLLM_ROCM_USE_AITER_CP_INDEXER is False
    assert envs.VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE == 512
    assert "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE" in envs.environment_variables
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "true")
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE", "1024")
    with emulate_rocm("gfx950"):
        assert rocm_aiter_ops.is_cp_indexer_enabled()
        assert rocm_aiter_ops.get_cp_indexer_stripe_size() == 1024


def test_a_bad_stripe_size_fails_at_startup_not_mid_prefill(monkeypatch):
    """rocm_aiter_ops reads the env vars when vLLM starts (import / refresh)."""
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE", "0")
    with pytest.raises(ValueError, match="STRIPE_SIZE must be a positive"):
        rocm_aiter_ops.refresh_env_variables()
    monkeypatch.delenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE")
    rocm_aiter_ops.refresh_env_variables()
