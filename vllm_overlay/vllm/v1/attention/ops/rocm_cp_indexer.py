# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Context-parallel split of the ROCm DSA indexer prefill across TP ranks:
the op's side.

Every TP rank holds the same indexer inputs, so without this each rank scores
all prefill rows. With ``VLLM_ROCM_USE_AITER_CP_INDEXER=1`` each rank scores
only its own contiguous range of the step's prefill rows (logits and top-k),
and one all_gatherv per prefill puts every rank's rows into every rank's
``topk_indices_buffer``, in place. The ranges are planned once per step on
the host (``rocm_cp_indexer_plan``), and the decision is taken at startup
(``rocm_cp_indexer_startup``); the op only slices (and joins the key ranges
of a call that spans two chunks, on the device). Each rank gathers the keys
of the chunks it scores, once for a run of chunks that slice the same
requests (``skip_kv_gather``), whose rows it scores in as few equal calls as
the logits budget allows (``CPIndexerPrefill.windows``). Every merged row
has exactly one writer (the top-k kernels choose freely among tied columns,
so two ranks' copies of a row could differ).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group
from vllm.v1.attention.ops.rocm_cp_indexer_plan import (
    CPIndexerSplit,
    equal_calls,
    runs_of_shared_keys,
)

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillChunkMetadata,
    )


@dataclass(frozen=True)
class PrefillWindow:
    """One logits and top-k call of this rank: batch rows ``start:end``,
    scored against the keys of ``chunk`` (its key gather, block table and
    key count), with the rows' key ranges ``ks`` and ``ke`` (device)."""

    chunk: DeepseekV32IndexerPrefillChunkMetadata
    start: int
    end: int
    ks: torch.Tensor
    ke: torch.Tensor
    max_seqlen_k: int
    gather_keys: bool  # False: the workspace holds these keys already

    @property
    def batch_rows(self) -> slice:
        return slice(self.start, self.end)


def _key_ranges_of(
    run: list[DeepseekV32IndexerPrefillChunkMetadata], first: int, last: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``cu_seqlen_ks`` and ``cu_seqlen_ke`` of batch rows ``first:last`` of
    a run (views within one chunk, joined across chunks), and the longest
    key range among the chunks they come from."""
    parts = [c for c in run if c.token_start < last and c.token_end > first]
    starts, ends = [], []
    for chunk in parts:
        lo = max(first, chunk.token_start) - chunk.token_start
        hi = min(last, chunk.token_end) - chunk.token_start
        starts.append(chunk.cu_seqlen_ks[lo:hi])
        ends.append(chunk.cu_seqlen_ke[lo:hi])
    if len(parts) == 1:
        ks, ke = starts[0], ends[0]
    else:
        ks, ke = torch.cat(starts), torch.cat(ends)
    return ks, ke, max(c.max_seqlen_k for c in parts)


class CPIndexerPrefill:
    """One indexer call's prefill on this rank: the calls that score its
    rows, then the merge. Replicated (every chunk whole, every gather, no
    merge) without a split, or when the call carries candidate blocks,
    whose writes are per row and unmerged."""

    def __init__(self, split: CPIndexerSplit | None, has_candidate_blocks: bool):
        self.split = None if has_candidate_blocks else split
        self.start = self.end = 0
        if self.split is not None:
            self.start, self.end = self.split.rows_of(get_tensor_model_parallel_rank())

    def windows(
        self, chunks: list[DeepseekV32IndexerPrefillChunkMetadata]
    ) -> Iterator[PrefillWindow]:
        """The logits and top-k calls this rank makes, in order.

        Without a split, one per chunk, as vLLM's builder made them. With a
        split, a rank's rows of a run of chunks that share their keys are
        chunked again on their own: as few calls as the run's largest chunk
        allows (so within the logits budget), of equal size. The builder's
        cuts would otherwise leave a rank a sliver of one chunk beside most
        of the next, two calls where one does, and a small call that fills
        little of the GPU. The keys are gathered once per run."""
        if self.split is None:
            for chunk in chunks:
                yield PrefillWindow(
                    chunk,
                    chunk.token_start,
                    chunk.token_end,
                    chunk.cu_seqlen_ks,
                    chunk.cu_seqlen_ke,
                    chunk.max_seqlen_k,
                    gather_keys=True,
                )
            return
        for run in runs_of_shared_keys(chunks):
            start = max(run[0].token_start, self.start)
            end = min(run[-1].token_end, self.end)
            if start >= end:
                continue
            most = max(c.token_end - c.token_start for c in run)
            for call, (first, last) in enumerate(equal_calls(start, end, most)):
                ks, ke, longest = _key_ranges_of(run, first, last)
                yield PrefillWindow(
                    run[0], first, last, ks, ke, longest, gather_keys=call == 0
                )

    def merge(self, topk_indices_buffer: torch.Tensor) -> None:
        """Give every rank every prefill row, once per prefill, on every
        rank alike; nothing without a split.

        In place: PyNccl's all_gatherv broadcasts each rank's rows into its
        slice of the output, and a rank's own rows are that slice already
        (NCCL broadcasts in place when the root's send and receive buffers
        are one), so the merge allocates and copies nothing. Whole rows of
        the buffer travel, which is contiguous in them. Called on PyNccl
        directly: the coordinator's all_gatherv returns a new tensor, and
        the split is off wherever it would take another path
        (``unsafe_config_reason``)."""
        if self.split is None:
            return
        first, last = self.split.bounds[0], self.split.bounds[-1]
        rows = topk_indices_buffer[first:last]
        own = rows[self.start - first : self.end - first]
        pynccl = getattr(get_tp_group().device_communicator, "pynccl_comm", None)
        # Checked at startup (the split is off without PyNccl); PyNccl sends
        # raw memory, so the rows must be contiguous.
        if pynccl is None or pynccl.disabled or not rows.is_contiguous():
            raise RuntimeError(
                "the CP indexer's merge needs PyNccl and a contiguous top-k buffer"
            )
        pynccl.all_gatherv(rows, own, self.split.sizes)
