# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Context-parallel split of the ROCm DSA indexer prefill across TP ranks.

Every TP rank holds the same indexer inputs, so without this each rank scores
all prefill rows. With ``VLLM_ROCM_USE_AITER_CP_INDEXER=1`` each rank scores
only its own contiguous range of the step's prefill rows (logits and top-k),
and one all_gatherv per prefill puts every rank's rows into every rank's
``topk_indices_buffer``, in place.

The ranges are balanced by cost, not by row count: a row costs its causal
key count, which the metadata builder knows on the host (sequence and query
lengths), and a new chat turn over a long cached prefix costs 10-100x a
fresh prompt's row. A row also costs a fixed part (``ROW_COST_KEYS``: its
top-k's own work and output), and on gfx942 its chunk's whole key width,
which the logits kernel fills with -inf (``LOGITS_FILL_DIVISOR``). The cuts
fall where the cumulative cost crosses each rank's share. A rank whose
rows span two runs of chunks pays a second call (``CALL_COST_KEYS``), and
a call's logits last at least as long as its costliest row (one program
per row), so they cost at least a wave of that row (``WAVE_ROWS_PER_CU``:
the rows the GPU scores at once). Where the cuts leave the ranks' calls
unlike, or a rank a call below that floor, such as a sliver of a long
turn, they are found again with calls and floors counted.
A step whose split would not repay its merge over the TP group's link
(``split_repays``) stays replicated and does not merge.

The plan is made once per step by the indexer metadata builder, from host
integers, identically on every rank; the op only slices (and joins the key
ranges of a call that spans two chunks, on the device). Each rank gathers
the keys of the chunks it scores, once for a run of chunks that slice the
same requests (``skip_kv_gather``), whose rows it scores in as few equal
calls as the logits budget allows (``CPIndexerPrefill.windows``). Every
merged row has exactly one writer (the top-k kernels choose freely among
tied columns, so two ranks' copies of a row could differ).

The settings are read once, when the indexer metadata builder is created,
and checked there to agree across the TP group, through its store (no
collective): a rank that merges while another does not would hang in the
merge, and different chunk sizes would cut the rows differently.
``VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE`` is deprecated and ignored:
AITER's logits and top-k run one program per row, so a rank's rows need
no alignment.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import accumulate, pairwise
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
    if envs.VLLM_DISABLE_PYNCCL:
        return "the merge runs on PyNccl (VLLM_DISABLE_PYNCCL is set)"
    mode = vllm_config.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    if mode.mixed_mode() == CUDAGraphMode.FULL:
        return "FULL CUDA graphs capture mixed batches, which split rows cannot"
    return None


def _off_reason(
    vllm_config: VllmConfig, dcp_world_size: int, use_pcp: bool, fp4_cache: bool
) -> str | None:
    """Why this engine's prefill stays replicated with the flag on, if it
    does: an unsafe configuration, or an FP4 indexer cache, whose op scores
    every prefill row on every rank."""
    if fp4_cache:
        # Only rocm_aiter_sparse_attn_indexer (the FP8 cache) splits rows.
        return "the MXFP4 indexer cache's op does not split prefill rows"
    return unsafe_config_reason(vllm_config, dcp_world_size, use_pcp)


# Keys of the startup records in the TP group's store.
_STARTUP_KEY = "rocm_cp_indexer_startup"
# How long a rank with the flag on waits for the others' records: they come
# from the same point of every rank's start, after the same collectives.
_STARTUP_WAIT = timedelta(minutes=5)


def _publish_and_compare(settings: dict[str, object], compare: bool) -> None:
    """Publish this rank's settings in the TP group's store; with
    ``compare``, wait for every rank's and raise, naming what differs and
    each rank's value, if they do not all agree.

    Through the store rather than a collective, so that a rank with the flag
    off only writes and goes on: a collective it skipped would leave the
    others waiting for it, and one it joined would tax every deployment. The
    ranks with the flag on then see its record and fail at startup."""
    group = get_tp_group()
    rank = group.rank_in_group
    try:
        store = group.cpu_group.get_group_store()
        # Every rank creates as many builders, with the same settings: the
        # n-th call on one rank meets the n-th on the others.
        call = store.add(f"{_STARTUP_KEY}/calls/{rank}", 1)
        shown = {name: repr(value) for name, value in settings.items()}
        store.set(f"{_STARTUP_KEY}/{call}/{rank}", json.dumps(shown))
    except Exception as error:
        if compare:
            raise
        # With the flag off the record only lets other ranks see it; a store
        # that fails here must not stop a deployment that never asked for
        # the split.
        logger.warning_once("CP indexer: could not publish its flag: %s", error)
        return
    if not compare:
        return
    keys = [f"{_STARTUP_KEY}/{call}/{r}" for r in range(group.world_size)]
    try:
        # One wait for all of them: a wait per rank would add up to
        # world_size times _STARTUP_WAIT when several never come.
        store.wait(keys, _STARTUP_WAIT)
    except Exception:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if missing:
            raise RuntimeError(
                f"TP ranks {missing} published no CP indexer settings within "
                f"{_STARTUP_WAIT}; every rank must reach the indexer's startup"
            ) from None
        # Every record came just after the wait gave up: go on.
    gathered = [json.loads(store.get(key)) for key in keys]
    for name in settings:
        values = [ranks_settings.get(name) for ranks_settings in gathered]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"{name} differs across the TP ranks ({per_rank}); the CP "
                "indexer needs the same on every rank"
            )


def _pynccl_missing() -> bool:
    """Whether this rank's TP group lacks a working PyNccl, which the merge
    runs on (a library that failed to load, as well as
    VLLM_DISABLE_PYNCCL)."""
    communicator = get_tp_group().device_communicator
    pynccl = getattr(communicator, "pynccl_comm", None)
    return pynccl is None or pynccl.disabled


def _logits_fill_their_chunk() -> bool:
    """Whether the prefill logits kernel the op calls writes -inf over its
    chunk's whole [rows, keys] output, so that a row also costs its chunk's
    key width: vLLM calls gfx942's FlyDSL ``fp8_mqa_logits`` with its default
    ``clean_logits=True`` (which writes every position outside a row's range)
    and gfx950's Triton one with ``clean_logits=False`` (which skips them;
    vllm-project/vllm v0.34.0 ``rocm_fp8_mqa_logits``; ROCm/aiter
    ``flydsl_fp8_mqa_logits``'s docstring)."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse

    return bool(rocm_aiter_mla_sparse._ON_GFX942)


def cp_indexer_at_startup(
    vllm_config: VllmConfig,
    dcp_world_size: int,
    use_pcp: bool,
    *,
    fp4_cache: bool = False,
    compute_units: int = 0,
) -> CPIndexerPlanner | None:
    """The planner of each step's split when this engine splits the indexer
    prefill, else None.

    Called once per indexer metadata builder at engine start, on every rank.
    Every rank publishes its flag in the TP group's store; with the flag off
    that is all (no collective, no wait). With it on, a rank decides (an
    unsafe configuration, or an FP4 indexer cache, ``fp4_cache``, whose op
    scores every prefill row on every rank), publishes the decision and
    every setting that shapes the plan, checks them against every rank's,
    and only then says why the split stays off. So a rank whose flag,
    decision or plan settings differ from another's is an error at startup
    on every rank with the flag on, not a hang in the merge.
    ``compute_units``: this GPU's, which set the rows of one wave (0: the
    plan counts no wave)."""
    # Imported here as vLLM's indexer backend does (dsa_indexer_uses_fp4):
    # vllm._aiter_ops imports the backend, which imports this module.
    from vllm._aiter_ops import rocm_aiter_ops

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if tp_size < 2 or not current_platform.is_rocm():
        return None
    enabled = bool(rocm_aiter_ops.is_cp_indexer_enabled())
    settings: dict[str, object] = {"VLLM_ROCM_USE_AITER_CP_INDEXER": enabled}
    reason = fill = None
    if enabled:
        if envs.VLLM_ROCM_USE_AITER_CP_INDEXER_STRIPE_SIZE is not None:
            logger.warning_once(
                "%s is deprecated and ignored: the CP indexer cuts its row "
                "ranges by cost, with no alignment.",
                STRIPE_SIZE_ENV,
            )
        reason = _off_reason(vllm_config, dcp_world_size, use_pcp, fp4_cache)
        if reason is None and model_parallel_is_initialized() and _pynccl_missing():
            reason = "the merge runs on PyNccl, which this TP group lacks"
        fill = _logits_fill_their_chunk()
        settings["the CP indexer's decision"] = reason or "split"
        if reason is None:
            # What shapes the plan: the chunks and the row costs.
            settings["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = (
                envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB
            )
            settings["the logits kernel's -inf fill"] = fill
            settings["the GPU's compute units"] = compute_units
    # Engines always build the TP group before the attention backends; only
    # a builder made outside an engine (a unit test) has no group to ask.
    if model_parallel_is_initialized():
        _publish_and_compare(settings, compare=enabled)
    if not enabled:
        return None
    if reason is not None:
        logger.info_once("CP indexer stays off (replicated prefill): %s.", reason)
        return None
    logger.info_once("CP indexer on: %d TP ranks, cost-balanced row ranges.", tp_size)
    # The floor is that of gfx950's logits grid (WAVE_ROWS_PER_CU); the
    # logits that fill their chunk (gfx942's FlyDSL kernel) are not measured.
    wave_rows = 0 if fill else int(WAVE_ROWS_PER_CU * compute_units)
    return CPIndexerPlanner(
        tp_size,
        LOGITS_FILL_DIVISOR if fill else None,
        ROW_COST_KEYS,
        CALL_COST_KEYS,
        wave_rows,
        # gfx942 (MI300X, MI325X), whose logits fill, has the slower xGMI.
        XGMI_GFX942 if fill else XGMI_GFX950,
    )


# Whether a step splits (``split_repays``): the split must save more than
# the merge costs and MIN_SPLIT_GAIN of the replicated op besides, on the
# TP group's link, and the step must cost MIN_SPLIT_KEY_ROWS at least. Below
# that a call is mostly host work, which the split does not shrink. Each
# rank's share costs 1 + SPLIT_OVERHEAD of an even share of the op (work
# every rank repeats and imbalance). All in key-rows, as
# ``prefill_row_costs`` counts them; the merge's milliseconds become
# key-rows at NS_PER_KEY_ROW, the op's time per key-row. Calibrated with
# Triton stand-ins of AITER's kernels on one H100 over 36 serving steps at
# tp 2, 4 and 8: a step of 5.9M key-rows lost split, one of 7.7M gained on
# every link and tp; the shares' GPU times summed to a median 1.05x, 1.11x
# and 1.26x the replicated op's at tp 2, 4 and 8; 0.068-0.085 ns a key-row.
# On 36 steps it was not fitted to, 101 of 108 step-tps came out right,
# none split slower than replicated: under about 8M key-rows the host's
# speed decides. MI355X's kernels move all of these (measure them there).
MIN_SPLIT_KEY_ROWS = 7_000_000
MIN_SPLIT_GAIN = 0.075
SPLIT_OVERHEAD = 0.15
NS_PER_KEY_ROW = 0.072
# The merge gathers every row's top-k indices (2,048 int32 for
# DeepSeek-V3.2 and GLM-5.x) into every rank.
MERGED_ROW_BYTES = 2048 * 4


@dataclass(frozen=True)
class MergeLink:
    """The TP group's link, as the merge's all_gatherv uses it: a latency
    and a rate one way, either through one port per GPU to a switch (a rank
    receives all other ranks' rows through it) or over one link per pair of
    GPUs (a rank receives each peer's rows on its own link, at once)."""

    latency_ms: float
    gb_per_s: float
    switched: bool

    def merge_ms(self, rank_rows: list[int]) -> float:
        """The merge of ranks holding ``rank_rows`` rows each: the rank that
        receives the most through its port, or the link that carries the
        largest rank's rows."""
        received = sum(rank_rows) - min(rank_rows) if self.switched else max(rank_rows)
        return self.latency_ms + received * MERGED_ROW_BYTES / (self.gb_per_s * 1e6)


# The all_gather of the merge measured on 2x H200 over NVLink reached 58% of
# the link's 450 GB/s one way, after 0.10 ms (8K-64K rows). AMD's Instinct
# GPUs are joined pairwise, one xGMI link each: 76.8 GB/s one way on gfx950
# (MI350X, MI355X; AMD's 153.6 GB/s both ways), 64 on gfx942 (MI300X,
# MI325X; 128 both ways). Taken at the same share and latency, not measured.
# The planner prices its GPU's xGMI link; NVLINK is the bench's H200 model.
NVLINK = MergeLink(latency_ms=0.10, gb_per_s=0.58 * 450, switched=True)
XGMI_GFX950 = MergeLink(latency_ms=0.10, gb_per_s=0.58 * 76.8, switched=False)
XGMI_GFX942 = MergeLink(latency_ms=0.10, gb_per_s=0.58 * 64, switched=False)


def split_repays(
    total_key_rows: int, rank_rows: list[int], link: MergeLink = XGMI_GFX950
) -> bool:
    """Whether a split of a step costing ``total_key_rows`` in all, whose
    ranks hold ``rank_rows`` prefill rows each, saves more than its merge
    costs and MIN_SPLIT_GAIN of the replicated op besides (the costliest
    rank taken as ``1 + SPLIT_OVERHEAD`` times an even share)."""
    if total_key_rows < MIN_SPLIT_KEY_ROWS:
        return False
    rank = total_key_rows * (1 + SPLIT_OVERHEAD) / len(rank_rows)
    merge = link.merge_ms(rank_rows) * 1e6 / NS_PER_KEY_ROW
    return rank + merge <= (1 - MIN_SPLIT_GAIN) * total_key_rows


# Where the prefill logits kernel fills the chunk's whole [rows, keys] output
# with -inf (``_logits_fill_their_chunk``: gfx942), each row also costs its
# chunk's key width, not only its own key range: on a fresh prompt the early
# rows, cheap by key count, are as wide as the last. On gfx950 vLLM asks for
# no fill, and a row costs its keys.
# One filled element is taken as 1/LOGITS_FILL_DIVISOR of a scored key-row:
# an estimate from MI355X's peak figures (a 4-byte store at ~6 TB/s against
# 32 heads x 128 dims of fp8 MFMA, the logits store and the top-k's read per
# key-row; GLM-5.x's 32 heads, where the fill weighs most: about 1/13 at
# DeepSeek-V3.2's 64), not a measurement.
LOGITS_FILL_DIVISOR = 8
# Each row's fixed cost, in key-rows: what it costs besides its keys (its
# top-k's program and its k indices written). Fitted on one H200 with Triton
# stand-ins of AITER's prefill logits and per-row top-k (time = a key-rows +
# b rows + c per call; b / a from 591 to 839 in four runs). With the logits
# stand-in on AITER's grid (one program per row) the fit gives 129, yet 700
# still balances a fresh 16K prompt better on the whole op (1.02 against
# 1.05 at tp 2). Not fitted on MI355X: AITER's top-k on many short rows, or
# a faster logits kernel, would raise it there.
ROW_COST_KEYS = 700
# Each logits and top-k call's fixed cost, in key-rows: a rank whose rows
# cross into another run of chunks pays a second call
# (``CPIndexerPrefill.windows``). Fitted with ``ROW_COST_KEYS``, as c / a
# (130-180 us a call against 0.06-0.07 ns a key-row: 2.2M-3.0M in four runs);
# the same caveats.
CALL_COST_KEYS = 2_600_000
# The logits' floor. AITER's gfx950 logits run one program per row
# (ROCm/aiter aiter/ops/triton/attention/fp8_mqa_logits.py at e4048607,
# L206 and L228: a grid of cdiv(rows, block_m), one or two rows a program,
# each walking its row's keys), so they last at least as long as their
# call's longest row, however few rows it has: a rank holding a sliver of a
# long turn pays as if it held as many rows as the GPU scores at once. That
# is WAVE_ROWS_PER_CU rows per compute unit: one row's time over a row's
# time at full occupancy (on one H200 with the stand-ins, 1.6 ms for 33 to
# 132 rows of 200K keys alike, against 0.033 ns a key-row: 1.8). The floor
# weighs on LOGITS_SHARE of a key-row's cost, the logits' share of it
# (0.47-0.48). AITER's one-block top-k, which it takes for every call of
# over 128 rows and for narrower ones (should_use_mulblocks), has a floor
# of its own (on the H200, 103 rows of 100K keys: 0.82 ms of top-k beside
# 0.74 ms of logits); yet fitted to the whole op's per-rank times on the
# host bench, the floor weighs about 0.5 of a key-row's cost, so this one
# share stands for both. Neither is measured on MI355X, where AITER's
# kernels set them; on the H200 a wave twice too large did worse than none
# on some steps, half of it about as well as this one.
WAVE_ROWS_PER_CU = 1.8
LOGITS_SHARE = 0.48


@dataclass(frozen=True)
class CPIndexerSplit:
    """Each TP rank's contiguous range of one step's prefill rows (the same
    on every rank): rank r scores batch rows ``bounds[r]:bounds[r + 1]``."""

    bounds: tuple[int, ...]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def rows_of(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]


def prefill_row_key_counts(
    seq_lens_cpu: torch.Tensor, query_lens_cpu: torch.Tensor, compress_ratio: int
) -> torch.Tensor:
    """Each prefill row's causal key count, in batch row order: row t of a
    request with S tokens and Q new ones sees (S - Q + 1 + t) // ratio keys,
    the bound the builder gives its chunk's ``cu_seqlen_ke``."""
    query_lens = query_lens_cpu.to(torch.int64)
    starts = torch.cumsum(query_lens, 0) - query_lens
    first_key = seq_lens_cpu.to(torch.int64) - query_lens + 1
    row = torch.arange(int(query_lens.sum()))
    offset = row - torch.repeat_interleave(starts, query_lens)
    return (torch.repeat_interleave(first_key, query_lens) + offset) // compress_ratio


def prefill_row_costs(
    seq_lens_cpu: torch.Tensor,
    query_lens_cpu: torch.Tensor,
    compress_ratio: int,
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
    num_decode_tokens: int,
    fill_divisor: int | None = LOGITS_FILL_DIVISOR,
    row_cost_keys: int = ROW_COST_KEYS,
) -> torch.Tensor:
    """Each prefill row's cost in key-rows, in batch row order after the
    decodes: its key count, its fixed cost (``row_cost_keys``) and, where the
    logits are filled (``fill_divisor``), its part of its chunk's -inf fill
    (a row in no chunk, which has no compressed key, has no fill)."""
    costs = (
        prefill_row_key_counts(seq_lens_cpu, query_lens_cpu, compress_ratio)
        + row_cost_keys
    )
    if fill_divisor is None:
        return costs
    for chunk in chunks:
        first = chunk.token_start - num_decode_tokens
        last = chunk.token_end - num_decode_tokens
        costs[first:last] += chunk.total_seq_lens // fill_divisor
    return costs


def plan_cp_indexer_split(
    tp_size: int,
    num_decode_tokens: int,
    seq_lens_cpu: torch.Tensor,
    query_lens_cpu: torch.Tensor,
    compress_ratio: int,
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
    fill_divisor: int | None = LOGITS_FILL_DIVISOR,
    row_cost_keys: int = ROW_COST_KEYS,
    call_cost_keys: int = CALL_COST_KEYS,
    wave_rows: int = 0,
    link: MergeLink = XGMI_GFX950,
) -> CPIndexerSplit | None:
    """This step's split of the prefill rows (the requests' sequence and
    query lengths, on the host, after the decodes; the builder's chunks of
    them), or None to score them replicated, when the split would not repay
    its merge over ``link`` (``split_repays``).

    Called by the indexer metadata builder on every rank with the same host
    inputs, so every rank takes the same decision and the merge matches."""
    costs = prefill_row_costs(
        seq_lens_cpu,
        query_lens_cpu,
        compress_ratio,
        chunks,
        num_decode_tokens,
        fill_divisor,
        row_cost_keys,
    )
    num_rows = costs.numel()
    if num_rows < tp_size:
        return None
    # before[j]: the cost of the rows before row j.
    before = torch.zeros(num_rows + 1, dtype=torch.int64)
    torch.cumsum(costs, 0, out=before[1:])
    total = int(before[-1])
    # No split merges less than an even one: a step that would not repay
    # that is left before it is planned.
    if not split_repays(total, [num_rows // tp_size] * tp_size, link):
        return None
    shares = torch.arange(1, tp_size, dtype=torch.int64) * total // tp_size
    bounds = _cut_at(before, shares)
    if call_cost_keys or wave_rows:
        runs = shared_key_runs(chunks, num_decode_tokens)
        rank_cost = RankCost(
            before, costs, query_lens_cpu, runs, call_cost_keys, wave_rows
        )
        bounds = _least_costly(bounds, rank_cost)
    split = CPIndexerSplit(tuple(num_decode_tokens + b for b in bounds))
    return split if split_repays(total, split.sizes, link) else None


def _cut_at(before: torch.Tensor, shares: torch.Tensor) -> list[int]:
    """Each rank's bounds: the row boundary whose cost before it is nearest
    each share (cumulative), at least one row per rank, in order."""
    num_rows = before.numel() - 1
    tp_size = shares.numel() + 1
    above = torch.searchsorted(before, shares).clamp_(1, num_rows)
    below = above - 1
    cuts = torch.where(shares - before[below] < before[above] - shares, below, above)
    bounds = [0, *cuts.tolist(), num_rows]
    for rank in range(1, tp_size):
        bounds[rank] = max(bounds[rank], bounds[rank - 1] + 1)
    for rank in range(tp_size - 1, 0, -1):
        bounds[rank] = min(bounds[rank], bounds[rank + 1] - 1)
    return bounds


def shared_key_runs(
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata], num_decode_tokens: int
) -> list[tuple[int, int, int]]:
    """Per run of chunks over the same keys (``_runs_of_shared_keys``), in
    prefill rows: its first and last row and its largest chunk's rows, which
    bound each call's rows."""
    return [
        (run[0].token_start - num_decode_tokens,
         run[-1].token_end - num_decode_tokens,
         max(c.token_end - c.token_start for c in run))
        for run in _runs_of_shared_keys(chunks)
    ]  # fmt: skip


def _equal_calls(start: int, end: int, most: int) -> Iterator[tuple[int, int]]:
    """Rows ``start:end`` of one run in as few calls as ``most`` rows a call
    allows, of equal size."""
    rows = end - start
    calls = -(-rows // most)
    for call in range(calls):
        yield start + call * rows // calls, start + (call + 1) * rows // calls


class RankCost:
    """What a rank's rows cost as the planner counts it, in key-rows: each
    row's cost, each call ``CPIndexerPrefill.windows`` makes for them
    (``call_cost_keys``), and, where a call's rows cost less than one wave
    of its costliest row (``wave_rows`` times it; 0: not counted), the
    logits' share of the difference (``LOGITS_SHARE``): with one program per
    row, the logits last at least as long as the costliest row.

    A rank's cost grows with its rows: vLLM's builder slices only a single
    request into a run of several chunks, so adding a row to a run adds to
    its calls' costs. ``_least_costly`` relies on it."""

    def __init__(
        self,
        before: torch.Tensor,
        costs: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        runs: list[tuple[int, int, int]],
        call_cost_keys: int,
        wave_rows: int,
    ):
        # Host ints: a tensor index per call is slow.
        self.before = before.tolist()
        self.call_cost_keys = call_cost_keys
        self.wave_rows = wave_rows
        self.runs = runs
        self.run_firsts = [first for first, _, _ in runs]
        self.run_ends = [last for _, last, _ in runs]
        if wave_rows:
            # A row's cost grows with its index within its request (a
            # request's chunks share one key width), so a range's costliest
            # row is its last one or the last of a request ending inside it.
            self.ends = torch.cumsum(query_lens_cpu.to(torch.int64), 0).tolist()
            self.last_of = [self.before[e] - self.before[e - 1] for e in self.ends]
        # What each whole run adds to its rows' cost (its calls, and with
        # ``floors`` their floors), summed over the runs before it: a rank's
        # whole runs then cost one subtraction.
        self.whole = {
            floors: [0, *accumulate(self._added(*run, floors) for run in runs)]
            for floors in (False, True)
        }

    def calls(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """The row ranges of the calls rows ``start:end`` are scored in."""
        for first, last, most in self.runs[bisect_right(self.run_ends, start) :]:
            if first >= end:
                return
            yield from _equal_calls(max(start, first), min(end, last), most)

    def _costliest(self, first: int, last: int) -> int:
        inside = self.last_of[
            bisect_right(self.ends, first) : bisect_left(self.ends, last)
        ]
        return max(self.before[last] - self.before[last - 1], max(inside, default=0))

    def _added(self, start: int, end: int, most: int, floors: bool) -> int:
        """What the calls of rows ``start:end`` of one run add to the rows'
        own cost."""
        added = 0
        for first, last in _equal_calls(start, end, most):
            added += self.call_cost_keys
            if floors and self.wave_rows:
                work = self.before[last] - self.before[first]
                floor = self.wave_rows * self._costliest(first, last)
                added += int(LOGITS_SHARE * max(0, floor - work))
        return added

    def __call__(self, start: int, end: int, floors: bool = True) -> int:
        cost = self.before[end] - self.before[start]
        # The runs rows start:end touch: i to j - 1, whole but for the ends.
        i = bisect_right(self.run_ends, start)
        j = bisect_left(self.run_firsts, end)
        for k in (i, j - 1)[: min(j - i, 2)]:
            first, last, most = self.runs[k]
            cost += self._added(max(start, first), min(end, last), most, floors)
        if j - 1 > i + 1:
            whole = self.whole[floors]
            cost += whole[j - 1] - whole[i + 1]
        return cost

    def of(self, bounds: list[int], floors: bool = True) -> list[int]:
        return [self(a, b, floors) for a, b in zip(bounds, bounds[1:])]


def _least_costly(bounds: list[int], rank_cost: RankCost) -> list[int]:
    """The cost-share cuts price every rank alike. Where the ranks' calls
    differ (a rank whose rows cross into another run of chunks makes a
    second call) or a call costs less than its floor (``RankCost``), the
    least costly plan again, with both counted: the smallest cost every
    rank keeps within, found by bisection, each rank taking as many rows as
    fit within it (as a rank's cost grows with its rows, no other plan has a
    costliest rank cheaper by more than 1/4096). Kept only if it beats
    ``bounds``."""
    costs = rank_cost.of(bounds)
    calls = {len(list(rank_cost.calls(a, b))) for a, b in pairwise(bounds)}
    if len(calls) == 1 and costs == rank_cost.of(bounds, floors=False):
        return bounds  # every rank priced alike: the cuts stand
    tp_size, num_rows = len(bounds) - 1, len(rank_cost.before) - 1
    best, high = bounds, max(costs)
    low = rank_cost.before[-1] // tp_size
    # Within 1/4096 of the least (finer than a row of the costly steps it
    # decides); a step of at least 1, so that it ends.
    while high - low > max(1, high // 4096):
        limit = (low + high) // 2
        plan = _plan_within(limit, tp_size, num_rows, rank_cost)
        if plan is None:
            low = limit
        else:
            best, high = plan, limit
    return best


def _plan_within(
    limit: int, tp_size: int, num_rows: int, rank_cost: RankCost
) -> list[int] | None:
    """Cuts that keep every rank's cost within ``limit``, each rank taking
    as many rows as fit (at least one, and one left for each later rank),
    or None if there are none."""
    bounds = [0]
    for rank in range(tp_size - 1):
        start = bounds[-1]
        # A rank's cost is at least its rows' own cost: no further than this.
        high = bisect_right(rank_cost.before, rank_cost.before[start] + limit) - 1
        high = min(high, num_rows - (tp_size - 1 - rank))
        if high <= start or rank_cost(start, start + 1) > limit:
            return None
        low = start + 1  # within the limit
        while low < high:
            middle = (low + high + 1) // 2
            if rank_cost(start, middle) <= limit:
                low = middle
            else:
                high = middle - 1
        bounds.append(low)
    if rank_cost(bounds[-1], num_rows) > limit:
        return None
    return [*bounds, num_rows]


@dataclass(frozen=True)
class CPIndexerPlanner:
    """The settings every step's split is planned with, fixed at startup."""

    tp_size: int
    # LOGITS_FILL_DIVISOR where the logits kernel fills its chunk, else None.
    fill_divisor: int | None = None
    row_cost_keys: int = ROW_COST_KEYS
    call_cost_keys: int = CALL_COST_KEYS
    # The rows the GPU scores at once (WAVE_ROWS_PER_CU per compute unit).
    wave_rows: int = 0
    # The TP group's link, which prices the merge.
    link: MergeLink = XGMI_GFX950

    def plan(
        self,
        num_decode_tokens: int,
        seq_lens_cpu: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        compress_ratio: int,
        chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
    ) -> CPIndexerSplit | None:
        """This step's split (``plan_cp_indexer_split``)."""
        return plan_cp_indexer_split(
            self.tp_size,
            num_decode_tokens,
            seq_lens_cpu,
            query_lens_cpu,
            compress_ratio,
            chunks,
            self.fill_divisor,
            self.row_cost_keys,
            self.call_cost_keys,
            self.wave_rows,
            self.link,
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


def _runs_of_shared_keys(
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata],
) -> list[list[DeepseekV32IndexerPrefillChunkMetadata]]:
    """The chunks grouped into runs that score the same keys: a chunk with
    ``skip_kv_gather`` is a later query slice of the previous chunk's
    requests (vLLM's builder slices requests too long for the logits
    budget), with the same keys laid out the same way."""
    runs: list[list[DeepseekV32IndexerPrefillChunkMetadata]] = []
    for chunk in chunks:
        if runs and chunk.skip_kv_gather:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


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
        for run in _runs_of_shared_keys(chunks):
            start = max(run[0].token_start, self.start)
            end = min(run[-1].token_end, self.end)
            if start >= end:
                continue
            most = max(c.token_end - c.token_start for c in run)
            for call, (first, last) in enumerate(_equal_calls(start, end, most)):
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
