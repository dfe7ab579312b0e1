# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The merge of the context-parallel ROCm DSA indexer prefill: each TP rank
scores only its own prefill rows, and one all_reduce(MAX) over the TP group
gives every rank every row. Runs with gloo ranks on any machine, and over
two GPUs on ROCm."""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.platforms import current_platform
from vllm.v1.attention.ops.rocm_cp_indexer import (
    CPIndexerPrefill,
    plan_cp_indexer_split,
)

TOPK = 16
# Decode rows first, then prefill chunks (rows each): a short chunk between
# long ones, and a 1-row tail, as the chunker makes them.
DECODE_ROWS, CHUNK_ROWS, PADDING_ROWS = 3, [40, 2, 57, 1], 4


def _merge_worker(rank: int, world_size: int, port: int, device_kind: str) -> None:
    """One TP rank: score only its own rows of each chunk, then merge. Each
    rank writes its rows' top-k in its own order (the kernels emit in atomic
    order), so the merge is only right if every row has one writer."""
    device = torch.device(device_kind, rank if device_kind != "cpu" else None)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device)
    # On the CPU, whatever platform vLLM was built for: gloo.
    backend = "gloo" if device.type == "cpu" else current_platform.dist_backend
    config = VllmConfig(device_config=DeviceConfig(device=device.type))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size, rank, f"tcp://localhost:{port}", rank, backend=backend
        )
        ensure_model_parallel_initialized(world_size, 1)
    prefill_rows = sum(CHUNK_ROWS)
    split = plan_cp_indexer_split(4, world_size, DECODE_ROWS, prefill_rows, CHUNK_ROWS)
    assert split is not None
    total = DECODE_ROWS + prefill_rows + PADDING_ROWS
    # Every rank holds the same logits (same seed), as in the indexer.
    logits = torch.randn(total, 64, generator=torch.Generator().manual_seed(0))
    expected = logits.topk(TOPK, dim=1).indices.sort(dim=1).values.int()
    buffer = torch.full((total, TOPK), -1, dtype=torch.int32)
    buffer[:DECODE_ROWS] = expected[:DECODE_ROWS]  # decode: replicated
    buffer = buffer.to(device)
    prefill = CPIndexerPrefill(split, has_candidate_blocks=False)
    start = DECODE_ROWS
    for rows in CHUNK_ROWS:
        chunk = SimpleNamespace(token_start=start, token_end=start + rows)
        mine = prefill.rows(chunk)
        if not mine.empty:
            scored = mine.of_batch(logits).topk(TOPK, dim=1).indices.int()
            order = torch.randperm(TOPK, generator=torch.Generator().manual_seed(rank))
            out = mine.topk_out(buffer, TOPK)
            out.copy_(scored[:, order].to(device))
            mine.store(buffer, out)
        start += rows
    prefill.merge(buffer)
    merged = buffer.cpu()
    destroy_model_parallel()
    destroy_distributed_environment()
    stop = DECODE_ROWS + prefill_rows
    assert torch.equal(merged[:stop].sort(dim=1).values, expected[:stop]), rank
    assert merged[stop:].eq(-1).all(), "padding rows are left alone"


def _run_merge(world_size: int, device_kind: str) -> None:
    from vllm.utils.network_utils import get_open_port

    torch.multiprocessing.spawn(
        _merge_worker,
        args=(world_size, get_open_port(), device_kind),
        nprocs=world_size,
    )


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("world_size", [3])
def test_the_merge_gives_every_rank_every_row_on_cpu(world_size):
    """all_reduce(MAX) over the TP group (gloo on the CPU platform)."""
    _run_merge(world_size, "cpu")


@pytest.mark.skipif(
    not current_platform.is_rocm() or torch.accelerator.device_count() < 2,
    reason="ROCm-only, needs 2 GPUs",
)
def test_the_merge_gives_every_rank_every_row_on_gpus():
    """The same over the TP device group of two GPUs (RCCL)."""
    _run_merge(2, "cuda")
