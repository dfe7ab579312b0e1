# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The context-parallel split of the ROCm DSA indexer prefill: which TP rank
scores each prefill row, when a batch splits, and the start-up settings.

The split is host-side planning, so these run on any machine; the ROCm
platform and AITER switches are patched the way vLLM's other ROCm policy
tests patch them. The real op over a TP group, split and merged against the
flag off, is tested in tests/distributed/test_rocm_cp_indexer_merge.py.
"""

from types import SimpleNamespace

import pytest
import torch

import vllm._aiter_ops as aiter_ops
import vllm.envs as envs
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import CUDAGraphMode
from vllm.v1.attention.ops import rocm_cp_indexer
from vllm.v1.attention.ops.rocm_cp_indexer import (
    CPIndexerPrefill,
    CPIndexerSplit,
    cp_indexer_stripe_at_startup,
    plan_cp_indexer_split,
    unsafe_config_reason,
)

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


@pytest.fixture
def rocm_aiter(monkeypatch: pytest.MonkeyPatch):
    """A ROCm platform where AITER is found, switched on (VLLM_ROCM_USE_AITER=1)."""
    monkeypatch.setattr(rocm_cp_indexer.current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(aiter_ops, "is_aiter_found_and_supported", lambda: True)
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    rocm_aiter_ops.refresh_env_variables()
    yield monkeypatch
    monkeypatch.undo()
    rocm_aiter_ops.refresh_env_variables()


@pytest.fixture
def cp_on(rocm_aiter: pytest.MonkeyPatch):
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    rocm_aiter_ops.refresh_env_variables()
    return rocm_aiter


def _config(graphs: str | None = None):
    mode = CUDAGraphMode[graphs] if graphs else None
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))


def _at_startup(tp: int, dcp: int = 1, pcp: bool = False, graphs=None) -> int | None:
    return cp_indexer_stripe_at_startup(_config(graphs), tp, dcp, pcp)


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


def test_the_plan_uses_the_prefill_row_index_and_shrinks_short_stripes():
    split = plan_cp_indexer_split(512, 8, 3, 16384, [16384])
    assert split == CPIndexerSplit(8, 512, 3, 16384)
    # 2K rows: two rounds of eight ranks need stripes of 128.
    short = plan_cp_indexer_split(512, 8, 0, 2048, [1024, 1024])
    assert short is not None and short.stripe == 128
    assert set(_owners(short)) == set(range(8))


def test_long_context_chunks_engage_every_rank():
    """At 128K keys the chunker gives ~1K-row chunks; per-chunk stripes of 512
    would use 2 of 8 ranks, stripes over the prefill use all of them."""
    split = plan_cp_indexer_split(512, 8, 0, 16384, [1024] * 16)
    assert split is not None
    per_rank = torch.bincount(torch.tensor(_owners(split)), minlength=8)
    assert per_rank.tolist() == [2048] * 8


@pytest.mark.parametrize(
    ("stripe", "tp", "chunk_rows", "split"),
    [
        (None, 4, [100], False),  # the split is off
        (512, 4, [3], False),  # fewer prefill rows than ranks
        (512, 8, [1, 5, 7, 2], False),  # every chunk shorter than tp
        (512, 8, [3355, 3355, 1], True),  # only the tail chunk is short
        (512, 8, [1, 1, 60], True),  # short chunks first
    ],
)
def test_a_batch_splits_once_any_chunk_can(stripe, tp, chunk_rows, split):
    plan = plan_cp_indexer_split(stripe, tp, 0, sum(chunk_rows), chunk_rows)
    assert (plan is not None) is split


def _chunks(gen: torch.Generator, first_row: int, rows: int) -> list:
    """A random chunk layout over ``rows`` prefill rows."""
    chunks, start = [], first_row
    while start < first_row + rows:
        size = int(torch.randint(1, 40, (1,), generator=gen))
        end = min(start + size, first_row + rows)
        chunks.append(SimpleNamespace(token_start=start, token_end=end))
        start = end
    return chunks


def test_one_writer_per_merged_row_and_the_same_collectives(monkeypatch):
    """Over many generated batches: once split, every prefill row is scored
    by exactly one rank; decode and padding rows by none; every rank makes
    the same collective calls (one merge, or none). The all_reduce(MAX)
    merge is only right with one writer per row."""
    gen = torch.Generator().manual_seed(0)
    for case in range(300):
        tp = int(torch.randint(2, 9, (1,), generator=gen))
        decode = int(torch.randint(0, 5, (1,), generator=gen))
        rows = int(torch.randint(1, 200, (1,), generator=gen))
        padding = int(torch.randint(0, 8, (1,), generator=gen))
        stripe = int(torch.randint(1, 64, (1,), generator=gen))
        chunks = _chunks(gen, decode, rows)
        split = plan_cp_indexer_split(
            stripe, tp, decode, rows, [c.token_end - c.token_start for c in chunks]
        )
        writers = torch.zeros(decode + rows + padding, dtype=torch.int64)
        merges = []
        for rank in range(tp):
            monkeypatch.setattr(
                rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda r=rank: r
            )
            prefill = CPIndexerPrefill(split, has_candidate_blocks=False)
            for chunk in chunks:
                local = prefill.rows(chunk).local
                scored = torch.arange(chunk.token_start, chunk.token_end)
                writers[scored if local is None else scored[local]] += 1
            merges.append(prefill.split is not None)
        expected = 1 if split is not None else tp
        assert writers[decode : decode + rows].eq(expected).all(), case
        assert writers[:decode].eq(0).all() and writers[decode + rows :].eq(0).all()
        assert len(set(merges)) == 1, f"case {case}: ranks disagree on the merge"
        if all(c.token_end - c.token_start < tp for c in chunks):
            assert split is None, f"case {case}: only short chunks, yet split"


def test_candidate_blocks_keep_the_prefill_replicated():
    split = CPIndexerSplit(2, 4, 0, 16)
    prefill = CPIndexerPrefill(split, has_candidate_blocks=True)
    assert prefill.split is None
    assert prefill.rows(SimpleNamespace(token_start=0, token_end=16)).local is None


def test_one_rank_never_splits(cp_on):
    assert _at_startup(1) is None


def test_the_stripe_size_is_read_at_startup(cp_on):
    assert _at_startup(4) == 512
    cp_on.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE", "1024")
    assert _at_startup(4) == 1024


def test_flag_off_aiter_off_or_not_rocm_means_no_split(rocm_aiter):
    assert _at_startup(2) is None  # flag off
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER", "0")
    rocm_aiter_ops.refresh_env_variables()
    assert _at_startup(2) is None
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER", "1")
    rocm_aiter_ops.refresh_env_variables()
    assert _at_startup(2) == 512
    rocm_aiter.setattr(rocm_cp_indexer.current_platform, "is_rocm", lambda: False)
    assert _at_startup(2) is None


@pytest.mark.parametrize(
    ("dcp", "pcp", "graphs", "invariant", "reason"),
    [
        (2, False, None, False, "decode context parallelism"),
        (1, True, None, False, "prefill context parallelism"),
        (1, False, "FULL", False, "FULL CUDA graphs"),
        (1, False, None, True, "batch invariance"),
    ],
)
def test_unsafe_configurations_stay_off_with_a_startup_log_line(
    cp_on, dcp, pcp, graphs, invariant, reason
):
    cp_on.setattr(envs, "VLLM_BATCH_INVARIANT", invariant, raising=False)
    logged = []
    cp_on.setattr(
        rocm_cp_indexer.logger,
        "info_once",
        lambda msg, *args: logged.append(msg % args),
    )
    assert _at_startup(2, dcp, pcp, graphs) is None
    assert len(logged) == 1 and reason in logged[0] and "stays off" in logged[0]


def test_an_fp4_indexer_cache_keeps_the_prefill_replicated_and_says_so(cp_on):
    """The MXFP4 cache's op (rocm_mxfp4_sparse_attn_indexer) scores every
    prefill row on every rank: the startup log must not claim a split."""
    logged = []
    cp_on.setattr(
        rocm_cp_indexer.logger,
        "info_once",
        lambda msg, *args: logged.append(msg % args),
    )
    assert cp_indexer_stripe_at_startup(_config(), 4, 1, False, fp4_cache=True) is None
    assert logged == [
        "CP indexer stays off (replicated prefill): the MXFP4 indexer cache's op "
        "does not split prefill rows."
    ]
    logged.clear()
    assert _at_startup(4) == 512
    assert logged == ["CP indexer on: 4 TP ranks, stripes of 512 rows."]


@pytest.mark.parametrize(
    "graphs", ["PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]
)
def test_graphs_that_leave_mixed_batches_eager_or_piecewise_are_safe(cp_on, graphs):
    assert unsafe_config_reason(_config(graphs), 1, False) is None
    assert _at_startup(2, graphs=graphs) == 512


@pytest.mark.parametrize("value", ["0", "-512", "abc", "", "1.5"])
def test_invalid_stripe_sizes_are_clear_errors_at_startup(cp_on, value):
    cp_on.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE", value)
    with pytest.raises(ValueError, match="STRIPE_SIZE must be a positive number"):
        _at_startup(2)


def test_a_bad_stripe_size_breaks_nothing_while_the_split_is_off(rocm_aiter):
    """Every env var is read after start-up (vLLM's enable_envs_cache) and
    rocm_aiter_ops mirrors them at import: a bad value must not break vLLM
    with the feature off."""
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE", "0")
    rocm_aiter_ops.refresh_env_variables()
    for name, read in envs.environment_variables.items():
        if name.startswith("VLLM_ROCM_USE_AITER_CP_INDEXER"):
            read()
    assert _at_startup(2) is None


def test_env_vars_are_registered_and_mirrored(rocm_aiter):
    assert envs.VLLM_ROCM_USE_AITER_CP_INDEXER is False
    assert envs.VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE == 512
    assert "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE" in envs.environment_variables
    assert not rocm_aiter_ops.is_cp_indexer_enabled()
    rocm_aiter.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "true")
    rocm_aiter_ops.refresh_env_variables()
    assert rocm_aiter_ops.is_cp_indexer_enabled()
