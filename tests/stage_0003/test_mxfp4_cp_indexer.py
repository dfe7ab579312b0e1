# SPDX-License-Identifier: Apache-2.0
"""Stage 0003 beside stage 0001: with the MXFP4 indexer cache the prefill
is scored by the paged MXFP4 op, which does not split rows across TP ranks.
So with VLLM_ROCM_USE_AITER_CP_INDEXER=1 vLLM's MXFP4 indexer builder
(the one DeepseekV32RocmMxfp4IndexerBackend selects) must say at startup
that the split stays off, and plan none; the FP8 builder still splits."""

from __future__ import annotations

import torch

from scripts.harness import dsa_attention, indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.mla.rocm_dsa_mxfp4_indexer import (  # noqa: E402
    DeepseekV32RocmMxfp4IndexerBackend,
)
from vllm.v1.attention.ops import rocm_cp_indexer_startup  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

TP = 4


def _builder(monkeypatch, kv_dtype: str):
    logged: list[str] = []
    monkeypatch.setattr(
        rocm_cp_indexer_startup.logger,
        "info_once",
        lambda msg, *args: logged.append(msg % args),
    )
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
    model = dsa_attention.DEEPSEEK_V32
    with emulate_rocm("gfx950"):
        config = dsa_attention.make_config(model, kv_dtype, 64)
        config.parallel_config.tensor_parallel_size = TP
        if kv_dtype == "fp8":
            return indexer_batch.make_builder(config, monkeypatch), logged
        import vllm.v1.attention.backends.mla.indexer as indexer

        monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 256)
        spec = MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=68, dtype=torch.uint8
        )
        builder_cls = DeepseekV32RocmMxfp4IndexerBackend.get_builder_cls()
        with set_current_vllm_config(config):
            builder = builder_cls(
                spec,
                [indexer_batch.LAYER],
                config,
                torch.device("cpu"),
                block_table_width=indexer_batch.MAX_MODEL_LEN // 64,
            )
        return builder, logged


def test_the_mxfp4_builder_plans_no_split_and_says_so(monkeypatch):
    builder, logged = _builder(monkeypatch, "mxfp4")
    assert builder.indexer_uses_fp4
    assert builder.cp_indexer is None
    assert logged == [
        "CP indexer stays off (replicated prefill): the MXFP4 indexer cache's op "
        "does not split prefill rows."
    ]


def test_the_fp8_builder_still_splits(monkeypatch):
    builder, logged = _builder(monkeypatch, "fp8")
    assert builder.cp_indexer is not None and builder.cp_indexer.tp_size == TP
    assert logged == [
        f"CP indexer on: {TP} TP ranks, cost-balanced row ranges, long rows key-split."
    ]
