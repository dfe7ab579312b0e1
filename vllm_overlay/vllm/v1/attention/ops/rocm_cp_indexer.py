# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Context-parallel split of the ROCm DSA indexer prefill across TP ranks.

Every TP rank holds the same indexer inputs, so without this each rank scores
all prefill rows. With ``VLLM_ROCM_USE_AITER_CP_INDEXER=1`` each rank scores
only its own rows (logits and top-k), leaves the other rows at -1, and one
``all_reduce(MAX)`` over the prefill rows of ``topk_indices_buffer`` per
prefill merges the ranks' results.

The MAX merge is only right if every merged row has exactly one writer: the
top-k kernels emit in atomic order and choose freely among tied columns, so
two ranks' copies of one row differ, and MAX of two copies holds duplicates
and loses keys. So the split is decided once per batch, and once a batch
splits, every chunk is split, short chunks included (a chunk with fewer rows
than ranks leaves some ranks nothing to score). A batch whose chunks are all
shorter than the TP size stays replicated and does not merge.

Rows are assigned in stripes over the prefill's own row index, not per chunk:
the chunker keeps a chunk's logits within VLLM_SPARSE_INDEXER_MAX_LOGITS_MB,
so at long context a chunk holds ~1K rows and per-chunk stripes would leave
most ranks idle. The stripes are dealt in mirrored order (0, 1, .., tp-1,
tp-1, .., 1, 0, ...): a row costs about its causal key count, which grows
along a prompt, and each pass back and forth gives every rank one cheaper and
one dearer stripe. A prefill too short for two passes uses smaller stripes so
that every rank still gets work (see scripts/cp_indexer_cost_model.py).

The settings are read once, when the indexer metadata builder is created,
and checked to agree across the TP group there: a rank that merges while
another does not would hang in the collective, and different stripe sizes
would leave rows that no rank scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import vllm.envs as envs
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.logger import init_logger
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillChunkMetadata,
    )

logger = init_logger(__name__)

ENABLE_ENV = "VLLM_ROCM_USE_AITER_CP_INDEXER"
STRIPE_SIZE_ENV = "VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE"


def unsafe_config_reason(
    vllm_config: VllmConfig, dcp_world_size: int, use_pcp: bool
) -> str | None:
    """Why splitting prefill rows is unsafe in this configuration, if it is."""
    if dcp_world_size > 1:
        return "decode context parallelism shards the indexer keys"
    if use_pcp:
        return "prefill context parallelism shards the prefill rows already"
    if envs.VLLM_BATCH_INVARIANT:
        return "batch invariance needs every rank to compute every row"
    mode = vllm_config.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    if mode.mixed_mode() == CUDAGraphMode.FULL:
        return "FULL CUDA graphs capture mixed batches, which split rows cannot"
    return None


def _check_ranks_agree(enabled: bool, stripe: int | str) -> None:
    """Every TP rank must hold the same settings; raise on every rank, naming
    the setting and each rank's value, if they do not. The stripe size only
    matters when the split is on."""
    group = get_tp_group()
    settings: list[tuple[bool, int | str]] = [(False, "")] * group.world_size
    torch.distributed.all_gather_object(
        settings, (enabled, stripe), group=group.cpu_group
    )
    checked: list[tuple[str, list[bool | int | str]]] = [
        (ENABLE_ENV, [on for on, _ in settings])
    ]
    if all(on for on, _ in settings):
        checked.append((STRIPE_SIZE_ENV, [size for _, size in settings]))
    for name, values in checked:
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"{name} differs across the TP ranks ({per_rank}); the CP "
                "indexer needs the same value on every rank"
            )


def cp_indexer_stripe_at_startup(
    vllm_config: VllmConfig,
    tp_size: int,
    dcp_world_size: int,
    use_pcp: bool,
    *,
    fp4_cache: bool = False,
) -> int | None:
    """The stripe size when this engine splits the indexer prefill, else None.

    Called once per indexer metadata builder at engine start, on every rank:
    it checks that the TP ranks agree on the settings (a collective on the
    TP group's CPU group), validates the stripe size and says why the split
    stays off in an unsafe configuration, or with an FP4 indexer cache
    (``fp4_cache``), whose op scores every prefill row on every rank."""
    # Imported here as vLLM's indexer backend does (dsa_indexer_uses_fp4):
    # vllm._aiter_ops imports the backend, which imports this module.
    from vllm._aiter_ops import rocm_aiter_ops

    if tp_size < 2 or not current_platform.is_rocm():
        return None
    enabled = bool(rocm_aiter_ops.is_cp_indexer_enabled())
    # A bad stripe size (an error only with the split on) is compared like a
    # value, so that no rank raises while the others wait in the collective.
    stripe: int | str
    try:
        stripe = envs.VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE
    except ValueError as error:
        stripe = str(error)
    # Engines always build the TP group before the attention backends; only
    # a builder made outside an engine (a unit test) has no group to ask.
    if model_parallel_is_initialized():
        _check_ranks_agree(enabled, stripe)
    if not enabled:
        return None
    if isinstance(stripe, str):
        raise ValueError(stripe)
    reason = unsafe_config_reason(vllm_config, dcp_world_size, use_pcp)
    if fp4_cache:
        # Only rocm_aiter_sparse_attn_indexer (the FP8 cache) splits rows.
        reason = "the MXFP4 indexer cache's op does not split prefill rows"
    if reason is not None:
        logger.info_once("CP indexer stays off (replicated prefill): %s.", reason)
        return None
    logger.info_once("CP indexer on: %d TP ranks, stripes of %d rows.", tp_size, stripe)
    return stripe


@dataclass(frozen=True)
class CPIndexerSplit:
    """Which TP rank scores each prefill row of one step (same on all ranks)."""

    world_size: int
    stripe: int
    first_row: int  # the first prefill row of the batch (decode rows come first)
    num_rows: int  # real prefill rows, CUDA-graph padding excluded

    @classmethod
    def for_prefill(
        cls, world_size: int, max_stripe: int, first_row: int, num_rows: int
    ) -> CPIndexerSplit:
        """Stripes of ``max_stripe`` rows, smaller when the prefill is too
        short for two mirrored rounds over the ranks."""
        stripe = min(max_stripe, max(1, num_rows // (2 * world_size)))
        return cls(world_size, stripe, first_row, num_rows)

    def owner(self, rows: torch.Tensor) -> torch.Tensor:
        """The rank that scores each of ``rows`` (batch row indices)."""
        phase = ((rows - self.first_row) // self.stripe) % (2 * self.world_size)
        return torch.where(
            phase < self.world_size, phase, 2 * self.world_size - 1 - phase
        )


def plan_cp_indexer_split(
    max_stripe: int | None,
    tp_size: int,
    num_decode_tokens: int,
    num_prefill_tokens: int,
    chunk_rows: Sequence[int],
) -> CPIndexerSplit | None:
    """This step's split of the prefill rows, or None to score them
    replicated: when the split is off, or when every chunk (``chunk_rows``:
    the rows of each) is shorter than the TP size.

    Called by the indexer metadata builder on every rank with the same inputs,
    so every rank takes the same decision and the merge's collective matches.
    """
    if max_stripe is None or all(rows < tp_size for rows in chunk_rows):
        return None
    return CPIndexerSplit.for_prefill(
        tp_size, max_stripe, num_decode_tokens, num_prefill_tokens
    )


class ChunkRows:
    """The rows of one prefill chunk this rank scores: all of them, or its own.

    ``local`` holds chunk-relative row offsets, or is None for all rows."""

    def __init__(self, token_start: int, token_end: int, local: torch.Tensor | None):
        self.token_start = token_start
        self.token_end = token_end
        self.local = local
        self._device_local: torch.Tensor | None = None

    def _index(self, device: torch.device) -> torch.Tensor:
        """``local`` on ``device``, copied there once per chunk."""
        assert self.local is not None
        if self._device_local is None or self._device_local.device != device:
            self._device_local = self.local.to(device)
        return self._device_local

    @property
    def empty(self) -> bool:
        return self.local is not None and self.local.numel() == 0

    def _select(self, chunk_rows: torch.Tensor) -> torch.Tensor:
        if self.local is None:
            return chunk_rows
        return chunk_rows.index_select(0, self._index(chunk_rows.device))

    def of_batch(self, batch_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor with one row per batch token."""
        return self._select(batch_tensor[self.token_start : self.token_end])

    def of_chunk(self, chunk_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor with one row per chunk row."""
        return self._select(chunk_tensor)

    def topk_out(self, topk_indices_buffer: torch.Tensor, topk: int) -> torch.Tensor:
        """Where top-k writes: the buffer itself, or a block of this rank's rows."""
        rows = topk_indices_buffer[self.token_start : self.token_end, :topk]
        if self.local is None:
            return rows
        return torch.empty(
            (self.local.numel(), topk), dtype=rows.dtype, device=rows.device
        )

    def store(self, topk_indices_buffer: torch.Tensor, out: torch.Tensor) -> None:
        """Put this rank's rows back in their buffer rows (the rest stay -1)."""
        if self.local is None:
            return
        rows = topk_indices_buffer[self.token_start : self.token_end, : out.shape[1]]
        rows.index_copy_(0, self._index(rows.device), out)


class CPIndexerPrefill:
    """One indexer call's prefill on this rank: which rows to score per chunk,
    then the merge. Replicated (every row, no merge) without a split, or when
    the call carries candidate blocks, whose writes are per row and unmerged."""

    def __init__(self, split: CPIndexerSplit | None, has_candidate_blocks: bool):
        self.split = None if has_candidate_blocks else split
        self.rank = 0
        if self.split is not None:
            self.rank = get_tensor_model_parallel_rank()

    def rows(self, chunk: DeepseekV32IndexerPrefillChunkMetadata) -> ChunkRows:
        """This rank's rows of ``chunk``: its own ones once the batch splits
        (possibly none), else all of them."""
        start, end = chunk.token_start, chunk.token_end
        if self.split is None:
            return ChunkRows(start, end, None)
        owners = self.split.owner(torch.arange(start, end))
        return ChunkRows(start, end, torch.nonzero(owners == self.rank).flatten())

    def merge(self, topk_indices_buffer: torch.Tensor) -> None:
        """all_reduce(MAX) over the prefill rows, once per prefill, on every
        rank alike; nothing runs when the batch is not split."""
        if self.split is None:
            return
        first, count = self.split.first_row, self.split.num_rows
        rows = topk_indices_buffer[first : first + count]
        merged = rows if rows.is_contiguous() else rows.contiguous()
        torch.distributed.all_reduce(
            merged, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group
        )
        if merged is not rows:
            rows.copy_(merged)
