# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on a GPU: the split op makes no synchronizing CUDA call.

vLLM's builder plans a prefill step (a new turn over a cached prefix next to
a fresh prompt, several chunks, continuation chunks that reuse a gather) for
two TP ranks; each rank's share of the real ``rocm_aiter_sparse_attn_indexer``
then runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on
any synchronizing call (a ``.item()``, a copy from pageable host memory, a
``nonzero``). One GPU has no TP group, so the merge's PyNccl all_gatherv
does nothing here. The logits and top-k are the fast GPU stand-ins
(``scripts.harness.fast_indexer_kernels``), which make no sync themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.harness import fast_indexer_kernels, indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0001")

import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op  # noqa: E402
from vllm.v1.attention.ops import (  # noqa: E402
    rocm_cp_indexer,
    rocm_cp_indexer_plan,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (run on the H200 device)"
)
WORLD = 2
TOPK = 2048
# A 96-row turn over 6,000 cached tokens, then a fresh 1,500-token prompt.
REQUESTS = [(6000, 96), (0, 1500)]


def _key_split_the_turn(planned, keys, query_lens_cpu, *_):
    """The planner's choice, forced: the turn (the first request)."""
    turn = (0, int(query_lens_cpu[0]))
    costs = planned.costs.clone()
    costs[turn[0] : turn[1]] = 0
    return planned.bounds(costs, (turn,)), (turn,)


@pytest.mark.parametrize(
    "layout, key_split",
    [("cost", False), ("cost", True), ("zigzag", True)],
    ids=["whole rows", "key split", "zigzag key split"],
)
@pytest.mark.parametrize("rank", range(WORLD))
def test_a_ranks_share_makes_no_synchronizing_call(
    monkeypatch, rank, layout, key_split
):
    """With the turn key-split too: its parts' scores, the exchange's
    buffer, the select and the int16 merge; in the zigzag layout, the
    gathered rows and their places as well."""
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    monkeypatch.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
    monkeypatch.setattr(rocm_cp_indexer_plan, "ROW_LAYOUT", layout)
    if key_split:
        monkeypatch.setattr(
            rocm_cp_indexer_plan, "_key_split_plan", _key_split_the_turn
        )
        monkeypatch.setattr(
            rocm_cp_indexer_plan,
            "binding_requests",
            lambda keys, query_lens_cpu, *_: ((0, int(query_lens_cpu[0])),),
        )
        monkeypatch.setattr(rocm_cp_indexer_plan, "KEY_SPLIT_MIN_STEP_KEY_ROWS", 0)
    # 8 MiB of logits per chunk: the turn's rows take several chunks.
    monkeypatch.setenv("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "8")
    monkeypatch.setattr(op, "rocm_fp8_mqa_logits", fast_indexer_kernels.mqa_logits)
    monkeypatch.setattr(
        torch.ops._C,
        "top_k_per_row_prefill",
        fast_indexer_kernels.top_k_per_row_prefill,
        raising=False,
    )
    pynccl = SimpleNamespace(
        disabled=False,
        all_gatherv=lambda output, own, sizes: None,
        all_to_all_single=lambda output, sent, out_sizes, sent_sizes: None,
    )
    group = SimpleNamespace(
        world_size=WORLD, device_communicator=SimpleNamespace(pynccl_comm=pynccl)
    )
    monkeypatch.setattr(rocm_cp_indexer, "get_tp_group", lambda: group)
    monkeypatch.setattr(rocm_cp_indexer, "get_tensor_model_parallel_rank", lambda: rank)
    with emulate_rocm("gfx950"):
        config = indexer_batch.make_vllm_config(
            tp_size=WORLD, device="cuda", max_len=8192, max_tokens=2048
        )
        builder = indexer_batch.make_builder(config, monkeypatch, "cuda")
        batch = indexer_batch.build_batch(
            builder, REQUESTS, heads=32, cache_new_keys=True
        )
        split = batch.metadata.prefill.cp_split
        assert split is not None and bool(split.key_split) is key_split
        assert (split.order is not None) is (layout == "zigzag")
        assert len(batch.metadata.prefill.chunks) >= 3
        run = lambda: indexer_batch.run_indexer(batch, TOPK, skip_k_cache_insert=True)  # noqa: E731
        run()  # compile the Triton kernels and grow the workspace first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
