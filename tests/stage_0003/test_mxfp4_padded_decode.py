# SPDX-License-Identifier: Apache-2.0
"""The MXFP4 indexer cache (DeepSeek-V3.2's decode under stage 0003) on the
decode layouts that make the FP8 op pad: zero-length requests among MTP
decodes, first, in the middle, two in a row, with prefills after them.

vLLM's MXFP4 indexer builder (``RocmMxfp4IndexerMetadataBuilder``, which
stage 0003 selects) flattens decodes to one row per token
(``use_flattening``), so it never sets ``requires_padding``: its rows, the
weights the op hands the logits kernel (``weights[:rows]``) and the top-k
rows are all in token order. These tests hold it to that: the builder's
layout, and the real ``rocm_mxfp4_sparse_attn_indexer`` selecting for each
row the top-k of its own token's scores. Top-k is below every row's key
count, so the weights decide.

The paged MXFP4 logits kernel is stood in: row r's score of the key at
position c is a function of c and of the weights the kernel is given for row
r (``_score``); columns past the row's end hold values larger than any
score, which a top-k that ignores the row's end would take. The rest is
vLLM's own, on the emulated gfx950.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.harness import indexer_batch
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import (  # noqa: E402
    create_forward_context,
    override_forward_context,
)
from vllm.v1.attention.backends.mla.rocm_dsa_mxfp4_indexer import (  # noqa: E402
    DeepseekV32RocmMxfp4IndexerBackend,
)
from vllm.v1.attention.ops import rocm_paged_mxfp4_indexer as mxfp4_ops  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

TOPK = 32
PAGE = 64
HEADS, HEAD_DIM = indexer_batch.HEADS, indexer_batch.HEAD_DIM
ROW_BYTES = HEAD_DIM // 2 + HEAD_DIM // 32  # 68: values, then ue8m0 scales

# (next_n, requests): (context, query) per request, decodes first. Every row
# has more keys than TOPK.
STEPS = {
    "a gap in the middle, then a prefill": (
        2,
        [(248, 2), (140, 0), (120, 2), (90, 2), (40, 61)],
    ),
    "two gaps in a row, then prefills": (
        2,
        [(300, 2), (80, 0), (150, 0), (120, 2), (40, 70), (70, 30)],
    ),
    "a gap first, decodes only": (2, [(140, 0), (200, 2), (96, 2)]),
    "a gap last among the decodes, then a prefill": (
        2,
        [(180, 2), (120, 2), (140, 0), (50, 80)],
    ),
    "next_n 1: decode lengths 1 and 0, then a prefill": (
        1,
        [(200, 1), (90, 0), (150, 1), (180, 1), (40, 60)],
    ),
}


def _score(positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.cos(positions * weights[..., :1] + weights[..., 1:2])


def _logits(q, q_scale, kv, weights, context_lens, block_table, width, *,
            out_logits, clean_logits, row_ends=None, **kwargs):  # fmt: skip
    """AITER's ``paged_mxfp4_mqa_logits`` as the op calls it: one output row
    per query row, ended by ``row_ends`` (or, one row a sequence, by
    ``context_lens``), scored with that row's weights."""
    ends = (row_ends if row_ends is not None else context_lens).reshape(-1)
    rows = out_logits.shape[0]
    assert ends.numel() == rows and weights.shape[0] == rows
    cols = torch.arange(width)
    scores = _score(cols.expand(rows, -1).float(), weights.float())
    out_logits.copy_(scores.masked_fill(cols >= ends[:, None], 1e30))


def _builder(monkeypatch, next_n: int):
    config = indexer_batch.make_vllm_config(num_speculative_tokens=next_n - 1)
    config.attention_config.indexer_kv_dtype = "mxfp4"
    config.cache_config.block_size = PAGE
    import vllm.v1.attention.backends.mla.indexer as indexer

    monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 256)
    spec = MLAAttentionSpec(
        block_size=PAGE, num_kv_heads=1, head_size=ROW_BYTES, dtype=torch.uint8
    )
    builder_cls = DeepseekV32RocmMxfp4IndexerBackend.get_builder_cls()
    with set_current_vllm_config(config):
        return builder_cls(
            spec,
            [indexer_batch.LAYER],
            config,
            torch.device("cpu"),
            block_table_width=indexer_batch.MAX_MODEL_LEN // PAGE,
        )


@pytest.mark.parametrize("name", list(STEPS))
def test_every_row_selects_with_its_own_weights(name, monkeypatch):
    next_n, requests = STEPS[name]
    tokens = sum(q for _, q in requests)
    ends = [c + t + 1 for c, q in requests for t in range(q)]
    assert min(ends) > TOPK
    with emulate_rocm("gfx950"):
        aiter = mxfp4_ops._aiter()
        monkeypatch.setattr(
            mxfp4_ops,
            "_aiter",
            lambda: SimpleNamespace(
                **{**vars(aiter), "paged_mxfp4_mqa_logits": _logits},
                build_schedule=lambda *args, **kwargs: None,
            ),
        )
        builder = _builder(monkeypatch, next_n)
        batch = indexer_batch.build_batch(builder, requests, write_cache=False)
        metadata = batch.metadata
        # One row per decode token, in token order, each its causal end.
        assert not metadata.decode.requires_padding
        decode_rows = metadata.decode_row_lens.tolist()
        assert decode_rows == ends[: len(decode_rows)]
        weights = torch.rand(tokens, HEADS, generator=torch.Generator().manual_seed(1))
        buffer = torch.full((tokens, TOPK), 7777, dtype=torch.int32)
        indexer_batch.ensure_workspace(torch.device("cpu"))
        context = create_forward_context(
            {indexer_batch.LAYER: metadata}, batch.vllm_config
        )
        with override_forward_context(context):
            mxfp4_ops.rocm_mxfp4_sparse_attn_indexer(
                torch.zeros(tokens, 8),
                indexer_batch.LAYER,
                torch.zeros(
                    batch.kv_cache.shape[0], PAGE, ROW_BYTES, dtype=torch.uint8
                ),
                torch.zeros(tokens, HEADS, HEAD_DIM // 2, dtype=torch.uint8),
                torch.zeros(tokens, HEADS, dtype=torch.int32),
                weights,
                TOPK,
                HEAD_DIM,
                indexer_batch.MAX_MODEL_LEN,
                buffer,
            )
    for row, end in enumerate(ends):
        best = _score(torch.arange(end).float(), weights[row]).topk(TOPK).indices
        assert sorted(buffer[row].tolist()) == sorted(best.tolist()), (
            f"row {row} ({end} keys) does not hold the top-k of its own scores"
        )
