# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Context-parallel split of the ROCm DSA indexer prefill across TP ranks:
the op's side.

Every TP rank holds the same indexer inputs, so without this each rank scores
all prefill rows. With ``VLLM_ROCM_USE_AITER_CP_INDEXER=1`` each rank scores
only its own contiguous range of the step's prefill rows (logits and top-k),
and one all_gatherv per prefill puts every rank's rows into every rank's
``topk_indices_buffer``. The rows of a request the plan key-splits are
scored by every rank, each over its part of their keys (``PrefillWindow.
key_offset``); each row's parts' top-k, with their scores, go to the rank
whose range holds it (one all_to_all), which selects its top-k from them
(``rocm_cp_indexer_merge``) before the merge. The ranges
are planned once per step on the host (``rocm_cp_indexer_plan``), and the
decision is taken at startup (``rocm_cp_indexer_startup``); the op only
slices (and joins the key ranges of a call that spans two chunks, and cuts
a key-split row's keys, on the device). Each rank gathers the keys
of the chunks it scores, once for a run of chunks that slice the same
requests (``skip_kv_gather``), whose rows it scores in as few equal calls as
the logits budget allows (``CPIndexerPrefill.windows``). Every merged row
has exactly one writer (the top-k kernels choose freely among tied columns,
so two ranks' copies of a row could differ); a key-split row's is the rank
that selects it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    model_parallel_is_initialized,
)
from vllm.v1.attention.ops import rocm_cp_indexer_merge as device_merge
from vllm.v1.attention.ops import rocm_cp_indexer_plan
from vllm.v1.attention.ops.rocm_cp_indexer_calls import (
    equal_calls,
    joined,
    rank_calls,
    run_key_split_calls,
    runs_of_shared_keys,
    shared_key_runs,
)
from vllm.v1.attention.ops.rocm_cp_indexer_plan import (
    CANDIDATE_ROW_BYTES,
    CPIndexerSplit,
    key_split_max_rows,
    travels_narrow,
)

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillChunkMetadata,
    )


def profile_bytes(logits_bytes: int, max_tokens: int, k: int) -> int:
    """What the profiling run reserves for the indexer prefill's transient
    tensors, where vLLM reserves one call's logits (``logits_bytes``, the
    logits budget): with the split on (the switch, TP 2 or more), more
    where the split holds more at once (``max_tokens`` rows a step, ``k``
    indices a row). Its peaks: a call's logits beside the candidates this
    rank sends (at most ``key_split_max_rows``, kept until the exchange);
    those candidates beside what it receives, after the last call's logits
    are freed (within the budget: ``key_split_max_owned``); and the merge's
    int16 copy of every prefill row, after both are freed, or in a zigzag
    layout its int32 copy, which puts the rows back in batch order. A
    key-split call's top-k, before its candidates are kept, take ``k``
    int32 a row beside its logits."""
    from vllm._aiter_ops import rocm_aiter_ops

    if _tp_size() < 2 or not rocm_aiter_ops.is_cp_indexer_enabled():
        return logits_bytes
    sent = key_split_max_rows(logits_bytes) * (CANDIDATE_ROW_BYTES + k * 4)
    row_bytes = 4 if rocm_cp_indexer_plan.ROW_LAYOUT == "zigzag" else 2
    return max(logits_bytes + sent, max_tokens * k * row_bytes)


def _tp_size() -> int:
    """The TP group's size; 1 before vLLM's model parallel state is made."""
    if not model_parallel_is_initialized():
        return 1
    return get_tensor_model_parallel_world_size()


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
    # Key-split rows: where this rank's part of each row's keys starts,
    # from the row's first key (device), and the rows' first candidate row.
    key_offset: torch.Tensor | None = None
    candidate_row: int = 0
    # In a zigzag split: the batch rows the call scores (device), gathered;
    # their top-k go to rows ``start:end``, this rank's places in the merge.
    rows: torch.Tensor | None = None

    @property
    def batch_rows(self) -> slice | torch.Tensor:
        """The rows of the queries and weights the call scores."""
        return slice(self.start, self.end) if self.rows is None else self.rows

    def topk_out(self, topk_indices_buffer: torch.Tensor) -> torch.Tensor:
        """Where the call writes its top-k: rows ``start:end`` of the
        buffer, or for key-split rows, whose top-k are only candidates (and
        in a zigzag split not at their places in the merge), new rows of
        the buffer's width."""
        if self.key_offset is None:
            return topk_indices_buffer[self.start : self.end]
        return topk_indices_buffer.new_empty(
            (self.end - self.start, topk_indices_buffer.shape[1])
        )


# The windows of the last step's split on this rank (the split, the rank,
# and the chunks with their windows and a zigzag split's places): every
# indexer layer of a step makes the same calls, and their key ranges are
# device tensors made on the host.
_STEP_WINDOWS: list = [None, None, (None, [], None)]


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
        # The key-split rows' candidates this rank sends (in their order).
        self.sent: torch.Tensor | None = None
        self.narrow = False
        # A zigzag split's batch row at each place of the merge, from its
        # first (device).
        self.places: torch.Tensor | None = None
        if self.split is not None:
            self.rank = get_tensor_model_parallel_rank()
            self.start, self.end = self.split.rows_of(self.rank)

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
        little of the GPU. Then the run's key-split rows (next requests'
        together), in calls of the same kind, over this rank's part of
        their keys. The keys are gathered once per run."""
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
        self.narrow = travels_narrow(chunks)
        # The same on every indexer layer of the step: made for the first.
        split, rank, made = _STEP_WINDOWS
        if split is not self.split or rank != self.rank or made[0] is not chunks:
            if self.split.order is None:
                made = (chunks, list(self._split_windows(chunks)), None)
            else:
                device = chunks[0].cu_seqlen_ks.device
                places = (self.split.order - self.split.bounds[0]).to(
                    device, non_blocking=True
                )
                made = (chunks, list(self._zigzag_windows(chunks, device)), places)
            _STEP_WINDOWS[:] = [self.split, self.rank, made]
        self.places = made[2]
        yield from made[1]

    def _zigzag_windows(self, chunks, device) -> Iterator[PrefillWindow]:
        """A zigzag split's calls on this rank: its rows of each run of
        chunks (in batch order) but the key-split rows it owns, in as few
        equal calls as the run's largest chunk allows, each gathering its
        rows' queries and key ranges, and writing their top-k at this
        rank's places in the merge; then the run's key-split rows, as in a
        split of contiguous ranges."""
        split = self.split
        assert split is not None and split.order is not None
        first_place = split.bounds[0]
        # Its places but the last ones, where it selects its key-split rows.
        owned_start = split.owned_places(self.rank)[0][0]
        mine = split.order[self.start - first_place : owned_start - first_place]
        runs = runs_of_shared_keys(chunks)
        shared = shared_key_runs(chunks, 0)
        holes = joined(split.key_split)
        for index, (run, (first, last, most)) in enumerate(zip(runs, shared)):
            start = int(torch.searchsorted(mine, first))
            end = int(torch.searchsorted(mine, last))
            gather = True
            if start < end:
                ks, ke, longest = _key_ranges_of(run, first, last)
            for a, b in equal_calls(start, end, most):
                rows = mine[a:b].to(device, non_blocking=True)
                in_run = rows - first
                yield PrefillWindow(
                    run[0],
                    self.start + a,
                    self.start + b,
                    ks[in_run],
                    ke[in_run],
                    longest,
                    gather,
                    rows=rows,
                )
                gather = False
            for call in run_key_split_calls(index, shared, holes):
                assert call.candidate_row is not None
                yield self._key_part(
                    run, call.first, call.last, gather, call.candidate_row
                )
                gather = False

    def _split_windows(self, chunks) -> Iterator[PrefillWindow]:
        """The calls ``rank_calls`` plans for this rank (the planner prices
        the same), each over the keys its run of chunks gathers first."""
        assert self.split is not None
        runs = runs_of_shared_keys(chunks)
        gathered = None
        for call in rank_calls(
            self.start, self.end, shared_key_runs(chunks, 0), self.split.key_split
        ):
            run = runs[call.run]
            gather, gathered = call.run != gathered, call.run
            if call.candidate_row is None:
                ks, ke, longest = _key_ranges_of(run, call.first, call.last)
                yield PrefillWindow(
                    run[0], call.first, call.last, ks, ke, longest, gather
                )
            else:
                yield self._key_part(
                    run, call.first, call.last, gather, call.candidate_row
                )

    def _key_part(self, run, first: int, last: int, gather: bool, row: int):
        """The call that scores rows ``first:last`` of ``run`` over this
        rank's part of each row's keys: the r-th of tp equal parts."""
        assert self.split is not None
        ks, ke, longest = _key_ranges_of(run, first, last)
        tp_size = len(self.split.bounds) - 1
        keys = ke - ks
        offset = keys * self.rank // tp_size
        part_ks = ks + offset
        part_ke = ks + keys * (self.rank + 1) // tp_size
        return PrefillWindow(
            run[0],
            first,
            last,
            part_ks,
            part_ke,
            -(-longest // tp_size),
            gather,
            key_offset=offset,
            candidate_row=row,
        )

    def keep_candidates(
        self, window: PrefillWindow, logits: torch.Tensor, topk: torch.Tensor
    ) -> None:
        """After a key-split window's top-k (``topk``, its rows of the top-k
        buffer, indices from the part's first key): its rows' candidates
        for the exchange, row-local indices and their scores read from
        ``logits`` (``keep_candidates``)."""
        if window.key_offset is None:
            return
        assert self.split is not None
        k = topk.shape[1]
        if self.sent is None:
            rows = self.split.key_split_rows
            columns = device_merge.candidate_columns(k)
            self.sent = torch.empty(
                (rows, columns), dtype=torch.int32, device=topk.device
            )
        first = window.candidate_row
        device_merge.keep_candidates(
            logits,
            topk,
            window.ks,
            window.key_offset,
            self.sent[first : first + topk.shape[0]],
        )

    def merge(self, topk_indices_buffer: torch.Tensor) -> None:
        """Give every rank every prefill row, once per prefill, on every
        rank alike; nothing without a split.

        First the key-split rows: one all_to_all sends each rank's
        candidates of a row (its part's top-k indices and scores) to the
        rank whose range holds the row, which selects the row's top-k from
        them into its range. Then every rank's range: one all_gatherv, in
        place (PyNccl broadcasts each rank's rows into its slice of the
        output, and a rank's own rows are that slice already), or, where
        every row has fewer than 65,535 keys, as int16 (``travels_narrow``):
        half the bytes, packed before and unpacked after. Whole rows of the
        buffer travel, which is contiguous in them. A zigzag split's ranks
        write their rows at their places in the merge, which then go back
        to their batch rows. Called on PyNccl
        directly: the coordinator's collectives return new tensors, and the
        split is off wherever it would take another path
        (``unsafe_config_reason``)."""
        if self.split is None:
            return
        pynccl = getattr(get_tp_group().device_communicator, "pynccl_comm", None)
        # Checked at startup (the split is off without PyNccl); PyNccl sends
        # raw memory, so the rows must be contiguous.
        if pynccl is None or pynccl.disabled or not topk_indices_buffer.is_contiguous():
            raise RuntimeError(
                "the CP indexer's merge needs PyNccl and a contiguous top-k buffer"
            )
        if self.split.key_split:
            self._exchange_and_select(pynccl, topk_indices_buffer)
        first, last = self.split.bounds[0], self.split.bounds[-1]
        rows = topk_indices_buffer[first:last]
        own = slice(self.start - first, self.end - first)
        if not self.narrow:
            pynccl.all_gatherv(rows, rows[own], self.split.sizes)
            if self.places is not None:  # each place's row to its batch row
                rows.index_copy_(0, self.places, rows.clone())
            return
        narrow = torch.empty(rows.shape, dtype=torch.int16, device=rows.device)
        device_merge.narrow_indices(rows[own], narrow[own])
        # As bytes: NCCL has no 16-bit integer type.
        as_bytes = narrow.view(torch.int8)
        pynccl.all_gatherv(as_bytes, as_bytes[own], self.split.sizes)
        if self.places is not None:  # every place's row to its batch row
            device_merge.widen_indices(narrow, rows, self.places)
            return
        # Every rank's rows but this one's, which are in place already.
        for start, end in ((0, own.start), (own.stop, last - first)):
            device_merge.widen_indices(narrow[start:end], rows[start:end])

    def _exchange_and_select(self, pynccl, topk_indices_buffer: torch.Tensor):
        """The key-split rows' candidates, each row's sent to its owner
        (``CPIndexerSplit.owned_places``), and this rank's rows' top-k
        selected from every rank's candidates into the buffer."""
        assert self.split is not None
        assert self.sent is not None, "a key-split row was not scored"
        tp_size = len(self.split.bounds) - 1
        columns = self.sent.shape[1]
        k = columns // 2
        device = topk_indices_buffer.device
        # In key-split row order: the rows of owner 0, then of owner 1, ...
        # (owners hold ranges, or blocks, in row order).
        sent = self.sent
        owners = self.split.key_split_owners
        owned = owners[self.rank]
        received = torch.empty(
            (tp_size * owned, columns), dtype=torch.int32, device=device
        )
        pynccl.all_to_all_single(received, sent, [owned] * tp_size, owners)
        del sent
        self.sent = None  # freed before the merge's int16 rows
        parts = received.view(tp_size, owned, columns)
        row = 0
        for start, end in self.split.owned_places(self.rank):
            device_merge.select_top_k(
                parts[:, row : row + end - start],
                tp_size,
                topk_indices_buffer[start:end, :k],
                k,
            )
            row += end - start
