# SPDX-License-Identifier: Apache-2.0
"""The gloo launcher runs real vLLM TP groups of 2, 4 and 8 ranks."""

import pytest
import torch

from scripts.harness.multiproc import run_ranks
from scripts.harness.tree import applied_tree

TREE = applied_tree("base")


def _max_over_tp(rank, world_size):
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    assert group.world_size == world_size and group.rank_in_group == rank
    rows = torch.full((3, 5), -1, dtype=torch.int32)
    rows[rank % 3] = rank  # each rank owns one row; the rest stay -1
    torch.distributed.all_reduce(
        rows, op=torch.distributed.ReduceOp.MAX, group=group.device_group
    )
    return rows


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_reduce_max_over_the_tp_group(world_size):
    results = run_ranks(world_size, _max_over_tp)
    expected = torch.full((3, 5), -1, dtype=torch.int32)
    for rank in range(world_size):
        expected[rank % 3] = max(int(expected[rank % 3, 0]), rank)
    for merged in results:
        assert torch.equal(merged, expected)


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)rank 1 failed.*rank one says no"):
        run_ranks(2, _fail_on_rank_one)
