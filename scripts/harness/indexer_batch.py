# SPDX-License-Identifier: Apache-2.0
"""Indexer batches built the way vLLM builds them, and the real indexer op.

The metadata comes from vLLM's own ``DeepseekV32IndexerMetadataBuilder``
(``build()`` with a ``CommonAttentionMetadata``), the K cache is filled by
vLLM's own insert kernel (Triton, interpreted on the CPU), and
``rocm_aiter_sparse_attn_indexer`` runs inside a real forward context. Only
the CPU's missing pieces are stood in: the compute-unit count and the
AITER/``_C`` kernels (see ``rocm_platform``).

A request is ``(context, query)``: ``context`` tokens already in the cache,
``query`` new tokens this step. Decode requests (query == 1) come first, as
vLLM orders them.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import torch

from scripts.harness.chunk_metadata import torch_chunk_metadata
from scripts.harness.indexer_k_cache import gather_paged_k, read_paged_k, write_paged_k

HEADS = 4
HEAD_DIM = 128
BLOCK_SIZE = 64
QUANT_BLOCK = 128
SCALE_FMT = "ue8m0"
MAX_MODEL_LEN = 4096
MAX_TOKENS = 2048
LAYER = "model.layers.0.self_attn.indexer.k_cache"


def shrink_logits_budget(monkeypatch, elements: int) -> None:
    """Chunk prefills at ``elements`` logits instead of at least 1 MiB, so
    that a few hundred tokens make several chunks. vLLM multiplies the MiB
    value by 2**20 and divides by 4; a Fraction keeps that arithmetic exact."""
    from fractions import Fraction

    import vllm.envs as envs

    monkeypatch.setattr(
        envs,
        "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB",
        Fraction(4 * elements, 1 << 20),
        raising=False,
    )


def max_model_len(vllm_config) -> int:
    return vllm_config.model_config.max_model_len


# A DeepSeek-V3.2 with the published config's attention and indexer shape
# (deepseek-ai/DeepSeek-V3.2-Exp config.json: 128 heads, kv_lora_rank 512,
# index_head_dim 128, index_topk 2048, one MTP layer) and one small layer;
# the tests' queries use HEADS indexer heads. vLLM's own ModelConfig reads it
# from disk, as it would a checkpoint's.
TINY_DSV32 = {
    "model_type": "deepseek_v32",
    "architectures": ["DeepseekV32ForCausalLM"],
    "torch_dtype": "bfloat16",
    "hidden_size": 256,
    "num_hidden_layers": 1,
    "num_nextn_predict_layers": 1,
    "vocab_size": 1024,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_n_heads": HEADS,
    "index_head_dim": HEAD_DIM,
    "index_topk": 2048,
    "max_position_embeddings": 163840,
}
TINY_MAX_POSITIONS = 163840


@functools.cache
def _tiny_checkpoint(max_len: int, index_heads: int) -> str:
    """Its config.json, with room for ``max_len`` positions (the long-context
    tests go to 1M tokens; vLLM refuses a longer max_model_len) and
    ``index_heads`` indexer heads."""
    folder = Path(tempfile.mkdtemp(prefix="dsa-tiny-dsv32-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    positions = max(TINY_MAX_POSITIONS, max_len)
    config = {
        **TINY_DSV32,
        "max_position_embeddings": positions,
        "index_n_heads": index_heads,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@contextmanager
def _inspect_models_in_process() -> Iterator[None]:
    """vLLM inspects a model class in a fresh interpreter (to keep CUDA out
    of the engine's process) unless its on-disk cache has it; there is no
    GPU to keep out here, so the same inspection runs in this process."""
    from vllm.model_executor.models import registry

    with patch.object(registry, "_run_in_subprocess", lambda inspect: inspect()):
        yield


def make_vllm_config(
    tp_size: int = 1,
    cudagraph_mode=None,
    device: str = "cpu",
    max_len: int = MAX_MODEL_LEN,
    max_tokens: int = MAX_TOKENS,
    num_speculative_tokens: int = 0,
    index_heads: int = HEADS,
):
    """vLLM's own VllmConfig of the tiny DeepSeek-V3.2 (``TINY_DSV32``),
    with MTP drafts when ``num_speculative_tokens`` is set, and
    ``index_heads`` indexer heads (the published model has 64)."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    # One GPU standing for one rank of a larger TP group (the single-GPU
    # benchmarks): vLLM checks the size against the GPUs it sees, so the
    # size is set after the check.
    one_gpu = device.startswith("cuda") and torch.cuda.device_count() < tp_size
    parallel = ParallelConfig(tensor_parallel_size=1 if one_gpu else tp_size)
    with _inspect_models_in_process():
        model = ModelConfig(
            model=_tiny_checkpoint(max_len, index_heads),
            skip_tokenizer_init=True,
            max_model_len=max_len,
        )
        speculative = (
            SpeculativeConfig(
                method="mtp",
                num_speculative_tokens=num_speculative_tokens,
                target_model_config=model,
                target_parallel_config=parallel,
            )
            if num_speculative_tokens
            else None
        )
    config = VllmConfig(
        model_config=model,
        speculative_config=speculative,
        device_config=DeviceConfig(device=device),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_tokens,
            max_num_seqs=16,
            max_model_len=max_len,
            is_encoder_decoder=False,
        ),
        parallel_config=parallel,
    )
    if one_gpu:
        object.__setattr__(config.parallel_config, "tensor_parallel_size", tp_size)
    # Set after construction: VllmConfig adjusts it to the platform.
    config.compilation_config.cudagraph_mode = cudagraph_mode
    config.attention_config.sparse_mla_prefill_workspace_factor = 5
    return config


def make_builder(
    vllm_config,
    monkeypatch,
    device: str = "cpu",
    block_size: int = BLOCK_SIZE,
    compute_units: int = 256,
):
    import vllm.v1.attention.backends.mla.indexer as indexer
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    # The emulated ROCm platform reads no device: MI355X (gfx950) has 256.
    monkeypatch.setattr(
        indexer, "num_compute_units", lambda device_index: compute_units
    )
    spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=HEAD_DIM + HEAD_DIM // QUANT_BLOCK * 4,
        dtype=torch.uint8,
    )
    with set_current_vllm_config(vllm_config):
        return indexer.DeepseekV32IndexerMetadataBuilder(
            spec,
            [LAYER],
            vllm_config,
            torch.device(device),
            block_table_width=max_model_len(vllm_config) // block_size,
        )


@dataclass
class IndexerBatch:
    vllm_config: object
    metadata: object
    kv_cache: torch.Tensor
    hidden_states: torch.Tensor
    q_fp8: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    num_decode_tokens: int
    num_prefill_tokens: int
    row_ends: torch.Tensor  # causal key count of each real row
    row_requests: torch.Tensor  # the request of each real row
    block_table: torch.Tensor

    def reference_logits(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``[len(rows), longest row]`` (all real rows by default): each
        row's scores over its own sequence's keys read back from the cache
        (which must hold the step's keys: ``cache_new_keys``), by vLLM's
        torch reference; -inf past the row's end. Compares top-k results
        where scores tie."""
        from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

        if rows is None:
            rows = torch.arange(self.row_ends.numel())
        row_ends, row_requests = self.row_ends[rows], self.row_requests[rows]
        width = int(row_ends.max())
        out = torch.full((rows.numel(), width), float("-inf"))
        for req in row_requests.unique().tolist():
            mine = torch.nonzero(row_requests == req).flatten()
            ends = row_ends[mine]
            keys = read_paged_k(
                self.kv_cache.cpu(), self.block_table[req], int(ends.max()), HEAD_DIM
            )
            logits = fp8_mqa_logits_torch(
                self.q_fp8[rows[mine]].cpu(),
                (keys, torch.ones(keys.shape[0])),
                self.weights[rows[mine]].cpu(),
                torch.zeros_like(ends, dtype=torch.int32),
                ends.to(torch.int32),
            )
            out[mine, : logits.shape[1]] = logits
        return out


def build_batch(
    builder,
    requests: list[tuple[int, int]],
    *,
    padding: int = 0,
    seed: int = 0,
    cache_new_keys: bool = False,
    heads: int = HEADS,
    torch_context: bool = False,
    write_cache: bool = True,
    random_inputs: bool = True,
    key_period: int = 0,
) -> IndexerBatch:
    """Fill the cache with each request's context and build the step's
    metadata; ``padding`` rows mimic a CUDA-graph padded batch.

    With ``cache_new_keys`` the step's own keys are cached here too, for a
    run with ``skip_k_cache_insert`` (as vLLM does when another layer owns
    the insert): multi-rank tests build once and fork. ``torch_context``
    is for long contexts: the context (and such new keys) is written with
    the torch writer, and the builder's prefill chunk metadata is computed
    by the torch equivalent of its kernel (both checked against the Triton
    kernels in tests/base). Without ``write_cache`` the cache stays zero,
    and without ``random_inputs`` so do the step's queries, keys and weights
    (dispatch-only tests: a 131,072-token step's queries are 1 GiB). With
    ``key_period`` each request's cached keys repeat with that period, so
    its rows' scores tie in groups (at the k-th score too)."""
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        FP8_DTYPE,
        indexer_k_quant_and_cache_triton,
    )

    gen = torch.Generator().manual_seed(seed)
    device = builder.device
    page = builder.kv_cache_spec.block_size
    num_reqs = len(requests)
    # Pages for the tokens each request has; the rest of its table row is 0.
    pages = [-(-(c + q) // page) for c, q in requests]
    kv_cache = torch.zeros(
        (sum(pages), page, HEAD_DIM + 4), dtype=torch.uint8, device=device
    )
    width = max_model_len(builder.vllm_config) // page
    block_table = torch.zeros((num_reqs, width), dtype=torch.int32)
    first = 0
    for req, count in enumerate(pages):
        block_table[req, :count] = torch.arange(first, first + count)
        first += count

    def slots(req: int, positions: torch.Tensor) -> torch.Tensor:
        blocks = block_table[req, positions // page].to(torch.int64)
        return blocks * page + positions % page

    new_slots, row_ends, row_requests = [], [], []
    for req, (context, query) in enumerate(requests):
        if context and write_cache:
            cached = torch.randn(context, HEAD_DIM, generator=gen).to(torch.bfloat16)
            if key_period:
                cached = cached[torch.arange(context) % key_period]
            cached_slots = slots(req, torch.arange(context)).to(device)
            if torch_context:
                write_paged_k(kv_cache, cached_slots, cached.to(device))
            else:
                indexer_k_quant_and_cache_triton(
                    cached.to(device), kv_cache, cached_slots, QUANT_BLOCK, SCALE_FMT
                )
        positions = torch.arange(context, context + query)
        new_slots.append(slots(req, positions))
        row_ends.append(positions + 1)
        row_requests.append(torch.full((query,), req))
    num_tokens = sum(q for _, q in requests)
    rows = num_tokens + padding
    if random_inputs:
        q_fp8 = torch.randn(rows, heads, HEAD_DIM, generator=gen).to(FP8_DTYPE)
        k = torch.randn(rows, HEAD_DIM, generator=gen).to(torch.bfloat16)
        weights = torch.randn(rows, heads, generator=gen)
    else:
        q_fp8 = torch.zeros(rows, heads, HEAD_DIM, dtype=FP8_DTYPE)
        k = torch.zeros(rows, HEAD_DIM, dtype=torch.bfloat16)
        weights = torch.zeros(rows, heads)
    q_fp8, k, weights = q_fp8.to(device), k.to(device), weights.to(device)
    slot_mapping = torch.cat(new_slots).to(device)
    if cache_new_keys and torch_context:
        write_paged_k(kv_cache, slot_mapping, k[:num_tokens])
    elif cache_new_keys:
        indexer_k_quant_and_cache_triton(
            k[:num_tokens], kv_cache, slot_mapping, QUANT_BLOCK, SCALE_FMT
        )
    query_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(device),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=seq_lens,
    )
    with torch_chunk_metadata() if torch_context else nullcontext():
        metadata = builder.build(0, common)
    return IndexerBatch(
        vllm_config=builder.vllm_config,
        metadata=metadata,
        kv_cache=kv_cache,
        hidden_states=torch.zeros(rows, 8, device=device),
        q_fp8=q_fp8,
        k=k,
        weights=weights,
        num_decode_tokens=metadata.num_decode_tokens,
        num_prefill_tokens=metadata.num_prefill_tokens,
        row_ends=torch.cat(row_ends),
        row_requests=torch.cat(row_requests),
        block_table=block_table,
    )


def ensure_workspace(device: torch.device) -> None:
    """vLLM's workspace manager, which the model runner sets up."""
    from vllm.v1.worker import workspace

    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(device)
    if not torch.accelerator.is_available():
        # The workspace frees the accelerator's cache when it grows; the CPU
        # has none to free.
        torch.accelerator.empty_cache = lambda: None


@contextmanager
def _k_gather(torch_gather: bool) -> Iterator[None]:
    """The op's K gather: vLLM's Triton kernel, or its torch equivalent."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as op_module

    name = "cp_gather_indexer_k_quant_cache_triton"
    triton_gather = getattr(op_module, name)
    if torch_gather:
        setattr(op_module, name, gather_paged_k)
    try:
        yield
    finally:
        setattr(op_module, name, triton_gather)


def run_indexer(
    batch: IndexerBatch,
    topk: int,
    *,
    candidate_blocks: torch.Tensor | None = None,
    candidate_block_size: int = 0,
    skip_k_cache_insert: bool = False,
    torch_gather: bool = False,
    kv_cache: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Call the real ``rocm_aiter_sparse_attn_indexer``; return its buffer.
    ``torch_gather`` gathers K with the torch equivalent of vLLM's Triton
    gather (``indexer_k_cache.gather_paged_k``), for long contexts. By
    default the op writes a copy of the batch's cache and a new buffer;
    a benchmark passes its own (``kv_cache``, ``buffer``) so that making
    them is not timed."""
    from vllm.forward_context import create_forward_context, override_forward_context
    from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        rocm_aiter_sparse_attn_indexer,
    )

    device = batch.q_fp8.device
    ensure_workspace(device)
    rows = batch.hidden_states.shape[0]
    if buffer is None:
        buffer = torch.full((rows, topk), 12345, dtype=torch.int32, device=device)
    if kv_cache is None:
        kv_cache = batch.kv_cache.clone()
    context = create_forward_context({LAYER: batch.metadata}, batch.vllm_config)
    with override_forward_context(context), _k_gather(torch_gather):
        rocm_aiter_sparse_attn_indexer(
            batch.hidden_states,
            LAYER,
            kv_cache,
            batch.q_fp8,
            None if skip_k_cache_insert else batch.k,
            batch.weights,
            QUANT_BLOCK,
            SCALE_FMT,
            topk,
            HEAD_DIM,
            max_model_len(batch.vllm_config),
            # What vLLM's indexer layer passes as max_total_seq_len.
            get_max_prefill_buffer_size(batch.vllm_config),
            buffer,
            skip_k_cache_insert=skip_k_cache_insert,
            candidate_blocks=candidate_blocks,
            candidate_block_size=candidate_block_size,
        )
    return buffer


def run_lengths(labels: list[str]) -> list[str]:
    """Labels in run-length form: ``["prefill aiter x12"]``."""
    runs: list[list] = []
    for label in labels:
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return [f"{label} x{count}" for label, count in runs]
