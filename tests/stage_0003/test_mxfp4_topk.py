# SPDX-License-Identifier: Apache-2.0
"""aiter's top-k on the MXFP4 indexer of DeepSeek-V3.2-style layers.

- Prefill follows the FP8 indexer's 32K gate: a chunk whose rows reach 32K
  keys ranks with aiter's top-k, a shorter one with vLLM's (upstream's
  ``rocm_aiter_ops.is_indexer_top_k_supported(is_prefill=True, ...)``, which
  the MXFP4 op calls; AITER is slower below about 24K). Before, every chunk
  at least k wide went to aiter's.
- The memory profiling run reserves aiter's top-k scratch: aiter's
  ``top_k_per_row_decode`` allocates its one-block workspace for every call,
  beside the logits it ranks. The stand-in allocates what AITER's source
  asks for (``topk_reference.aiter_one_block_workspace_bytes``); the
  profiling run must claim at least a real step's peak, for the largest
  prefill chunk and the largest decode batch.

The op runs on vLLM's ROCm platform emulated as gfx950 with AITER; the paged
MXFP4 logits kernel is stood in by random scores (the top-k choice and the
memory do not depend on them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.harness import dsa_attention, indexer_batch, topk_reference
from scripts.harness.rocm_platform import emulate_rocm
from scripts.harness.tree import applied_tree

TREE = applied_tree("0003")

import vllm.envs as envs  # noqa: E402
from vllm._aiter_ops import rocm_aiter_ops  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import (  # noqa: E402
    create_forward_context,
    override_forward_context,
)
from vllm.v1.attention.ops import rocm_paged_mxfp4_indexer as mxfp4_ops  # noqa: E402
from vllm.v1.worker.workspace import current_workspace_manager  # noqa: E402

K = 2048
HEADS, HEAD_DIM = 64, 128  # DeepSeek-V3.2's indexer
ROWS = 2


def _layer(rows: int, k: int, compress_ratio: int = 1) -> SimpleNamespace:
    """What ``_dense_prefill`` reads of a layer: the MXFP4 query, its
    scales, the weights and the top-k buffer."""
    return SimpleNamespace(
        q=torch.zeros(rows, HEADS, HEAD_DIM // 2, dtype=torch.uint8),
        q_scale=torch.zeros(rows, HEADS, 4, dtype=torch.uint8),
        kv=torch.zeros(1, 64, 1, 68, dtype=torch.uint8),
        weights=torch.ones(rows, HEADS),
        topk_buffer=torch.full((rows, k), 7777, dtype=torch.int32),
        topk_tokens=k,
        candidates=None,
        block=0,
        compress_ratio=compress_ratio,
    )


def _chunk_and_plan(rows: int, seq_len: int):
    """One prefill chunk of ``rows`` rows of a ``seq_len``-token request
    (its last rows), planned as RocmMxfp4IndexerMetadataBuilder plans it."""
    ends = torch.arange(seq_len - rows + 1, seq_len + 1, dtype=torch.int32)
    chunk = SimpleNamespace(
        token_start=0,
        token_end=rows,
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        max_seqlen_k=seq_len,
    )
    plan = SimpleNamespace(
        width=seq_len,
        row_ends=ends,
        context_lens=torch.tensor([seq_len], dtype=torch.int32),
        query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
    )
    return chunk, plan


@pytest.fixture
def op(monkeypatch):
    """The MXFP4 op on an emulated gfx950 with AITER; returns the list of
    top-k kernels it ran ("aiter" or "vllm"), in order."""
    ran: list[str] = []

    def logits(*args, out_logits, **kwargs):
        out_logits.copy_(torch.randn(out_logits.shape))

    def aiter_topk(*args, **kwargs):
        ran.append("aiter")
        return topk_reference.aiter_top_k_per_row_decode(*args, **kwargs)

    def vllm_topk(*args):
        ran.append("vllm")
        return topk_reference.vllm_top_k_per_row_decode(*args)

    with emulate_rocm("gfx950"):
        monkeypatch.setattr(
            mxfp4_ops, "_aiter", lambda: SimpleNamespace(paged_mxfp4_mqa_logits=logits)
        )
        monkeypatch.setattr(mxfp4_ops, "_aiter_topk", lambda: aiter_topk)
        monkeypatch.setattr(torch.ops._C, "top_k_per_row_decode", vllm_topk)
        topk_reference.WORKSPACE_LOG.clear()
        yield ran


@pytest.mark.parametrize("seq_len", [4096, 16384, 24576, 32767, 32768, 40960])
def test_prefill_follows_the_fp8_indexers_32k_gate(op, seq_len):
    chunk, plan = _chunk_and_plan(ROWS, seq_len)
    layer = _layer(ROWS, K)
    mxfp4_ops._dense_prefill(layer, chunk, plan, candidate_write=False)
    fp8_takes_aiter = rocm_aiter_ops.is_indexer_top_k_supported(
        is_prefill=True,
        compress_ratio=1,
        num_rows=ROWS,
        max_valid_seq_len=seq_len,
        topk_tokens=K,
    )
    assert fp8_takes_aiter == (seq_len >= 32 * 1024)
    assert op == ["aiter" if fp8_takes_aiter else "vllm"]
    # Either kernel: each row's top-k of its own keys.
    assert bool((layer.topk_buffer >= 0).all())
    assert bool((layer.topk_buffer < plan.row_ends[:, None]).all())


def _requests_chunk_and_plan(seq_lens: list[int], rows_each: int = ROWS):
    """One prefill chunk holding the last ``rows_each`` rows of several
    requests: as vLLM's chunk metadata has it, ``max_seqlen_k`` is the
    longest request and ``total_seq_lens`` all of the chunk's keys; the
    MXFP4 plan's logits are as wide as the longest request."""
    ends = [torch.arange(n - rows_each + 1, n + 1, dtype=torch.int32) for n in seq_lens]
    rows = rows_each * len(seq_lens)
    chunk = SimpleNamespace(
        token_start=0,
        token_end=rows,
        block_table=torch.zeros(len(seq_lens), 1, dtype=torch.int32),
        max_seqlen_k=max(seq_lens),
        total_seq_lens=sum(seq_lens),
        num_reqs=len(seq_lens),
    )
    plan = SimpleNamespace(
        width=max(seq_lens),
        row_ends=torch.cat(ends),
        context_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(0, rows + 1, rows_each, dtype=torch.int32),
    )
    return chunk, plan


@pytest.mark.parametrize(
    "seq_lens, kernel",
    [
        # 56K keys in the chunk, none of its rows 32K long: vLLM's.
        ([20_000, 24_000, 12_000], "vllm"),
        ([16_384] * 4, "vllm"),
        # One row past 32K among short ones: aiter's.
        ([1_000, 40_000, 3_000], "aiter"),
    ],
)
def test_a_chunk_of_several_requests_is_gated_by_its_longest_row(op, seq_lens, kernel):
    """The gate reads the chunk's longest row, not all the keys it holds."""
    chunk, plan = _requests_chunk_and_plan(seq_lens)
    rows = ROWS * len(seq_lens)
    layer = _layer(rows, K)
    mxfp4_ops._dense_prefill(layer, chunk, plan, candidate_write=False)
    assert op == [kernel]
    assert bool((layer.topk_buffer < plan.row_ends[:, None]).all())


def test_the_first_rows_of_a_long_prompt_are_gated_as_the_fp8_op_gates_them(op):
    """A chunk holding a query slice of a 40K-token request (its first rows,
    each of few keys): the FP8 op asks the gate with the chunk's
    ``max_seqlen_k``, the request's length, so the MXFP4 op does too."""
    chunk, plan = _chunk_and_plan(ROWS, 40_960)
    plan.row_ends = torch.arange(1, ROWS + 1, dtype=torch.int32)
    layer = _layer(ROWS, K)
    mxfp4_ops._dense_prefill(layer, chunk, plan, candidate_write=False)
    assert op == ["aiter"]


def test_the_gate_is_upstreams_function_not_a_copy(op, monkeypatch):
    """Whatever vLLM's gate answers, the MXFP4 op does, asked as the FP8 op
    asks it: the chunk's longest row and k."""
    asked = []

    def gate(**kwargs):
        asked.append(kwargs)
        return True

    monkeypatch.setattr(rocm_aiter_ops, "is_indexer_top_k_supported", gate)
    chunk, plan = _chunk_and_plan(ROWS, 4096)
    mxfp4_ops._dense_prefill(_layer(ROWS, K), chunk, plan, candidate_write=False)
    assert op == ["aiter"]
    assert asked == [
        dict(
            is_prefill=True,
            compress_ratio=1,
            num_rows=ROWS,
            max_valid_seq_len=4096,
            topk_tokens=K,
        )
    ]


@pytest.mark.parametrize("rows, k, expected", [(200, 512, "aiter"), (2, 512, "vllm")])
def test_a_compressed_indexer_keeps_its_own_rule(op, rows, k, expected):
    """DeepSeek-V4.x's dense layers (compress ratio 4) keep the op's shape
    rule: aiter's top-k from 128 rows on, or at k = 2048."""
    chunk, plan = _chunk_and_plan(rows, 4096)
    layer = _layer(rows, k, compress_ratio=4)
    mxfp4_ops._dense_prefill(layer, chunk, plan, candidate_write=False)
    assert op == [expected]


# A served step's shape, small enough for the CPU: a 1 MiB logits budget
# (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1), contexts of 40,960 keys, 8 sequences.
MAX_MODEL_LEN = 40960
MAX_NUM_SEQS = 8


# 8 decodes: the prefill chunk's logits and scratch are the peak; 256: the
# decode batch's scratch (about 5 MB) is, past the 1 MB logits budget.
@pytest.mark.parametrize("max_num_seqs", [MAX_NUM_SEQS, 256])
def test_the_profiling_run_reserves_aiters_topk_scratch(op, monkeypatch, max_num_seqs):
    monkeypatch.setattr(envs, "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", 1)
    budget = 1 << 20
    config = dsa_attention.make_config(dsa_attention.DEEPSEEK_V32, "mxfp4", 64)
    config.scheduler_config.max_num_seqs = max_num_seqs
    config.speculative_config = None

    # A real step's peak: the largest prefill chunk (the chunker's rows at
    # this width, logits within the budget) and its aiter scratch...
    rows = budget // (4 * MAX_MODEL_LEN)
    chunk, plan = _chunk_and_plan(rows, MAX_MODEL_LEN)
    mxfp4_ops._dense_prefill(_layer(rows, K), chunk, plan, candidate_write=False)
    assert op == ["aiter"] and len(topk_reference.WORKSPACE_LOG) == 1
    prefill_peak = rows * MAX_MODEL_LEN * 4 + topk_reference.WORKSPACE_LOG[0]
    # ...and the largest decode batch's scratch, beside the workspace logits.
    decode_logits = torch.randn(max_num_seqs, MAX_MODEL_LEN)
    lengths = torch.full((max_num_seqs,), MAX_MODEL_LEN, dtype=torch.int32)
    out = torch.empty(max_num_seqs, K, dtype=torch.int32)
    mxfp4_ops._topk(decode_logits, lengths, out, K)
    decode_scratch = topk_reference.WORKSPACE_LOG[1]
    assert decode_scratch == topk_reference.aiter_one_block_workspace_bytes(
        max_num_seqs, MAX_MODEL_LEN
    )
    assert (decode_scratch > prefill_peak) is (max_num_seqs > MAX_NUM_SEQS)

    # The profiling run (no attention metadata) claims, for a moment, bytes
    # beside the persistent workspace: record every transient byte buffer.
    claimed: list[int] = []
    real_empty = torch.empty

    def empty(*size, dtype=None, **kwargs):
        tensor = real_empty(*size, dtype=dtype, **kwargs)
        if dtype == torch.uint8 and tensor.dim() == 1:
            claimed.append(tensor.numel())
        return tensor

    indexer_batch.ensure_workspace(torch.device("cpu"))
    # The profiling run's tokens: vLLM's token budget, at least max_num_seqs.
    tokens = 2 * max_num_seqs
    with set_current_vllm_config(config):
        # The persistent workspace (the decode logits) is the model runner's
        # and already this large: grown here, it is not counted below.
        current_workspace_manager().get_simultaneous(
            ((max_num_seqs, MAX_MODEL_LEN), torch.float32)
        )
        context = create_forward_context(None, config)
        with override_forward_context(context):
            monkeypatch.setattr(torch, "empty", empty)
            mxfp4_ops.rocm_mxfp4_sparse_attn_indexer(
                torch.zeros(tokens, 8),
                "model.layers.0.self_attn.indexer.k_cache",
                torch.zeros(1, 64, 68, dtype=torch.uint8),
                torch.zeros(tokens, HEADS, HEAD_DIM // 2, dtype=torch.uint8),
                torch.zeros(tokens, HEADS, dtype=torch.int32),
                torch.ones(tokens, HEADS),
                K,
                HEAD_DIM,
                MAX_MODEL_LEN,
                torch.zeros(tokens, K, dtype=torch.int32),
            )
            monkeypatch.setattr(torch, "empty", real_empty)
    assert claimed, "the profiling run claims nothing"
    assert max(claimed) >= prefill_peak, (max(claimed), prefill_peak)
    assert max(claimed) >= decode_scratch
    # And not wildly more: the logits budget and an eighth of it, or the
    # decode batch's scratch.
    assert max(claimed) <= max(budget + budget // 8 + 512, decode_scratch)
