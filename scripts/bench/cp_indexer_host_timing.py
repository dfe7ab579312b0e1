# SPDX-License-Identifier: Apache-2.0
"""The host bench's timing: the whole indexer prefill op on one serving
step, replicated and as each TP rank's share of the split, and its logits
and top-k kernels on one uniform chunk (``scripts.bench.cp_indexer_host``
says what is timed and how it is reported)."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import warnings
from types import SimpleNamespace

from scripts.bench import cp_indexer_host_check as check

TOPK = 2048
HEADS = 32
K = 1024
# Set by --aiter: AITER's kernels on this machine's ROCm, not the stand-ins.
ON_AITER = False
# Set by --key-split-all: the planner key-splits every candidate request
# (``KEY_SPLIT_BY_MODEL`` off), to measure that policy beside its model's.
KEY_SPLIT_ALL = False
# Where the op runs: a CPU test sets "cpu" to walk the bench's plumbing
# through Triton's interpreter.
DEVICE = "cuda"
# Set by --check-only: every split step's rows checked, nothing timed.
CHECK_ONLY = False
# A planner variant's costs: ROW_COST_KEYS, CALL_COST_KEYS, WAVE_ROWS_PER_CU
# and LOGITS_SHARE.
Costs = tuple[int, int, float, float]
# The variant that plans the zigzag layout (``ROW_LAYOUT``), not cost cuts.
ZIGZAG = "zigzag"


# Each figure is the worse of this many timings (each a median of --runs
# calls per rank): a slow spell of the GPU's clocks then shows, not hides.
TIMINGS = 2
# Cycles of ``torch.cuda._sleep`` per ms, measured once.
_SLEEP_CYCLES_PER_MS: list[float] = []


def _keep_gpu_busy(ms: float) -> None:
    """Queue ``ms`` of GPU work, so that the call queued after it starts on
    a busy GPU and its events time the GPU, not the host's launches."""
    import torch

    if not _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        cycles = 50_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_CYCLES_PER_MS.append(cycles / start.elapsed_time(end))
    torch.cuda._sleep(int(ms * _SLEEP_CYCLES_PER_MS[0]))


def timed(fn, ranks: list[int], runs: int) -> list[dict]:
    """Per rank: GPU ms, host ms and the syncs of one call of ``fn(rank)``,
    as one rank pays them layer after layer: its calls back to back. GPU ms
    is CUDA events around the call, queued behind enough GPU work to cover
    the host's time to queue it; each figure is the worse of ``TIMINGS``
    medians of ``runs`` calls (``gpu_ms_timings`` lists them), the ranks in
    turn, in reverse order the second time (a drift of the GPU's clocks then
    weighs on every rank alike). Each rank's first call of a turn makes
    what the op keeps for the step (the split's windows), once per step in
    serving: its host time over the later calls' is ``windows_ms``, not in
    the medians. Whatever ``fn`` needs besides the call (inputs, buffers) is
    made before, untimed."""
    import torch

    for _ in range(2):  # warm-up: Triton compiles, workspace grows
        queueing = []  # the host's time to queue a call, once compiled
        for rank in ranks:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(rank)
            queueing.append((time.perf_counter() - t0) * 1e3)
    host_lead = statistics.median(queueing)
    torch.cuda.synchronize()
    gpu: dict[int, list[float]] = {rank: [] for rank in ranks}
    host: dict[int, list[float]] = {rank: [] for rank in ranks}
    windows: dict[int, list[float]] = {rank: [] for rank in ranks}
    for turn in range(TIMINGS):
        for rank in ranks if turn % 2 == 0 else ranks[::-1]:
            times: list[float] = []
            hosts: list[float] = []
            for _ in range(runs + 1):
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                torch.cuda.synchronize()
                _keep_gpu_busy(2 * host_lead + 0.2)
                start.record()
                t0 = time.perf_counter()
                fn(rank)
                hosts.append((time.perf_counter() - t0) * 1e3)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            gpu[rank].append(statistics.median(times[1:]))
            host[rank].append(statistics.median(hosts[1:]))
            windows[rank].append(max(0.0, hosts[0] - host[rank][-1]))
    timings = []
    for rank in ranks:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn(rank)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        timings.append(
            {
                "gpu_ms": max(gpu[rank]),
                "gpu_ms_timings": gpu[rank],
                "host_ms": max(host[rank]),
                "windows_ms": max(windows[rank]),
                "syncs": sum("synchronizing" in str(w.message) for w in caught),
            }
        )
    return timings


def planner_ms(plan, args: tuple, runs: int) -> float:
    """The median host time of ``plan(*args)``: the planner's own time per
    step, which every layer of the step shares."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        plan(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_step(
    step: list[tuple[int, int]],
    tp: int,
    runs: int,
    variants: dict[str, Costs | None],
    force_split: bool = False,
    replicated: bool = True,
) -> dict:
    """The step replicated (unless not ``replicated``), then split under
    each planner variant (a name and its ``Costs``; None: the shipped
    planner as it is; ``ZIGZAG``: in the zigzag layout), the stage's gate
    (``split_repays``) ignored with ``force_split``. The builder is told
    this GPU's compute units, which the planner's wave is counted in. Every
    split's rows are checked against the replicated op's
    (``cp_indexer_host_check``; with CHECK_ONLY, not timed)."""
    import pytest
    import torch

    from scripts.harness import indexer_batch
    from vllm.v1.attention.ops import (
        rocm_cp_indexer,
        rocm_cp_indexer_calls,
        rocm_cp_indexer_plan,
    )

    longest = max(c + q for c, q in step)
    rows = sum(q for _, q in step)
    result: dict = {"split": {}}
    runs_of: list[tuple[str, str | None]] = [("replicated", None)] if replicated else []
    runs_of += [("split", name) for name in variants]
    for mode, variant in runs_of:
        with contextlib.ExitStack() as stack:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            # Before the platform: entering it reads AITER's switches.
            mp.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if mode == "split" else "0")
            use_kernels(stack, mp)
            costs = variants[variant] if variant is not None else None
            if costs is not None:
                row_cost, call_cost, wave, share = costs
                mp.setattr(rocm_cp_indexer_plan, "ROW_COST_KEYS", row_cost)
                mp.setattr(rocm_cp_indexer_plan, "CALL_COST_KEYS", call_cost)
                mp.setattr(rocm_cp_indexer_plan, "WAVE_ROWS_PER_CU", wave)
                mp.setattr(rocm_cp_indexer_plan, "LOGITS_SHARE", share)
            if variant == ZIGZAG:
                mp.setattr(rocm_cp_indexer_plan, "ROW_LAYOUT", "zigzag")
            if force_split:
                mp.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
            if KEY_SPLIT_ALL:
                mp.setattr(rocm_cp_indexer_plan, "KEY_SPLIT_BY_MODEL", False)
            # The planner's arguments, to time it apart (it runs once per
            # step, in the builder).
            planned: list = []
            plan = rocm_cp_indexer_plan.CPIndexerPlanner.plan
            mp.setattr(
                rocm_cp_indexer_plan.CPIndexerPlanner,
                "plan",
                lambda self, *args, plan=plan, planned=planned: (
                    planned.append((self, args)) or plan(self, *args)
                ),
            )
            config = indexer_batch.make_vllm_config(
                tp_size=tp,
                device=DEVICE,
                max_len=longest + 64,
                # vLLM's scheduler takes no fewer than its 16 sequences.
                max_tokens=max(rows, 16),
            )
            builder = indexer_batch.make_builder(
                config, mp, DEVICE, compute_units=compute_units()
            )
            batch = indexer_batch.build_batch(
                builder, step, heads=HEADS, cache_new_keys=True, torch_context=True
            )
            prefill = batch.metadata.prefill  # type: ignore[attr-defined]
            split = prefill.cp_split
            # As the planner counts it (gfx950: no fill term).
            result["cost_key_rows"] = int(
                rocm_cp_indexer_plan.prefill_row_costs(
                    torch.tensor([c + q for c, q in step]),
                    torch.tensor([q for _, q in step]),
                    1,
                    prefill.chunks,
                    0,
                    None,
                    rocm_cp_indexer_plan.ROW_COST_KEYS,
                ).sum()
            )
            result["chunks"] = len(prefill.chunks)
            result["narrow"] = rocm_cp_indexer_plan.travels_narrow(prefill.chunks)
            # The runs of chunks over the same keys: (first row, end, the
            # largest chunk's rows), for the modelled per-call cost.
            result["runs"] = rocm_cp_indexer_calls.shared_key_runs(prefill.chunks, 0)
            if mode == "split" and split is None:
                result["split"][variant] = None  # below the minimum: replicated
                continue
            # One GPU: no TP group. The merge gathers in place, so it has
            # no local work to keep; the key split's exchange leaves its
            # output as it found it (the select still runs on it).
            pynccl = SimpleNamespace(
                disabled=False,
                all_gatherv=lambda rows, own, sizes: None,
                all_to_all_single=lambda out, sent, out_sizes, sent_sizes: None,
            )
            group = SimpleNamespace(
                world_size=tp,
                device_group=None,
                device_communicator=SimpleNamespace(pynccl_comm=pynccl),
            )
            mp.setattr(
                rocm_cp_indexer, "get_tp_group", lambda g=group: g, raising=False
            )
            mp.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
            ranks = list(range(tp)) if mode == "split" else [0]

            this_rank = [0]
            mp.setattr(
                rocm_cp_indexer,
                "get_tensor_model_parallel_rank",
                lambda this_rank=this_rank: this_rank[0],
                raising=False,
            )

            # Made once: the op inserts no keys here, and fills the rows
            # of the buffer it writes.
            buffer = torch.empty(
                (batch.hidden_states.shape[0], TOPK), dtype=torch.int32, device=DEVICE
            )

            def run(buffer, batch=batch):
                indexer_batch.run_indexer(
                    batch,
                    TOPK,
                    skip_k_cache_insert=True,
                    kv_cache=batch.kv_cache,
                    buffer=buffer,
                )

            def call(rank: int, this_rank=this_rank, buffer=buffer, run=run):
                this_rank[0] = rank
                run(buffer)

            entry: dict = {}
            if not CHECK_ONLY:
                per_rank = timed(call, ranks, runs)
                entry = {
                    key: max(r[key] for r in per_rank)
                    for key in ("gpu_ms", "host_ms", "syncs")
                }
                entry["per_rank_gpu_ms"] = [r["gpu_ms"] for r in per_rank]
                entry["per_rank_gpu_ms_timings"] = [
                    r["gpu_ms_timings"] for r in per_rank
                ]
                entry["per_rank_host_ms"] = [r["host_ms"] for r in per_rank]
                if mode == "split":  # the replicated op makes no windows
                    entry["per_rank_windows_ms"] = [r["windows_ms"] for r in per_rank]
                if planned:
                    planner, args = planned[-1]
                    entry["plan_ms"] = planner_ms(
                        lambda *a, p=planner, plan=plan: plan(p, *a), args, runs
                    )
            if mode == "split":
                entry["bounds"] = list(split.bounds)
                entry["key_split"] = [list(rows) for rows in split.key_split]
                entry["owners"] = split.key_split_owners
                # Every split timed is checked too (RowsDiffer ends the run),
                # with one row a logits program in every call: a key's score
                # then has the same bits whichever call scores it (the
                # kernel's dot rounds by its rows a program, which no
                # selection can undo). AITER's kernel is run as it is.
                if not ON_AITER:
                    from scripts.harness import fast_indexer_kernels as fast

                    mp.setattr(fast, "logits_rows_per_program", lambda *_: 1)
                try:
                    buffers = check.merged_buffers(
                        run, this_rank, pynccl, tp, buffer.shape, DEVICE
                    )
                    entry["checked_rows"] = check.check_split(
                        batch,
                        buffers,
                        lambda replicated, buffer=buffer: run(
                            torch.empty_like(buffer), replicated
                        ),
                        TOPK,
                        mp,
                    )
                except check.RowsDiffer as error:
                    raise check.RowsDiffer(f"tp {tp}, {variant}: {error}") from None
                result["split"][variant] = entry
            else:
                result["replicated"] = entry
    return result


def use_kernels(stack: contextlib.ExitStack, mp) -> None:
    """The logits and top-k the op runs: the fast stand-ins on an emulated
    gfx950, or with --aiter AITER's own, on this machine's ROCm platform."""
    import torch

    from vllm._aiter_ops import rocm_aiter_ops

    if ON_AITER:
        mp.setenv("VLLM_ROCM_USE_AITER", "1")
        rocm_aiter_ops.refresh_env_variables()
        return
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op
    from scripts.harness import fast_indexer_kernels as fast
    from scripts.harness.rocm_platform import emulate_rocm

    stack.enter_context(emulate_rocm("gfx950"))
    mp.setattr(op, "rocm_fp8_mqa_logits", fast.mqa_logits)
    mp.setattr(
        torch.ops._C, "top_k_per_row_prefill", fast.top_k_per_row_prefill, raising=False
    )
    # vLLM takes AITER's top-k for chunks of 32K keys and more.
    mp.setattr(
        sys.modules["aiter.ops.topk"],
        "top_k_per_row_prefill",
        fast.aiter_top_k_per_row_prefill,
    )


def chunk_kernels():
    """The logits (``rocm_fp8_mqa_logits``'s signature) and the prefill
    top-k (``logits, starts, ends, indices``) the calibration times: the
    fast stand-ins, or with --aiter vLLM's ROCm op's own calls of AITER's
    (its prefill top-k, the one vLLM's gate takes for long rows)."""
    if ON_AITER:
        import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op

        def aiter_select(logits, starts, ends, indices) -> None:
            op._launch_aiter_top_k_per_row_prefill(logits, starts, ends, indices, TOPK)

        return op.rocm_fp8_mqa_logits, aiter_select
    from scripts.harness import fast_indexer_kernels as fast

    def select(logits, starts, ends, indices) -> None:
        fast.top_k_per_row_prefill(
            logits, starts, ends, indices, logits.shape[0], logits.stride(0), 1, TOPK
        )

    return fast.mqa_logits, select


def compute_units() -> int:
    """This GPU's compute units (SMs), as vLLM's ``num_compute_units``."""
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def time_chunk(rows: int, keys: int, runs: int) -> dict:
    """The logits and top-k kernels' GPU ms (``chunk_kernels``) on one
    chunk of ``rows`` rows of ``keys`` keys each."""
    import torch

    from vllm.platforms import current_platform

    mqa_logits, top_k = chunk_kernels()
    # The stand-ins take OCP fp8; on ROCm, the platform's (gfx942: fnuz).
    fp8 = current_platform.fp8_dtype() if ON_AITER else torch.float8_e4m3fn
    gen = torch.Generator(device=DEVICE).manual_seed(rows + keys)
    q = torch.randn(rows, HEADS, 128, device=DEVICE, generator=gen).to(fp8)
    k = torch.randn(keys, 128, device=DEVICE, generator=gen).to(fp8)
    scale = torch.rand(keys, device=DEVICE, generator=gen) + 0.5
    weights = torch.randn(rows, HEADS, device=DEVICE, generator=gen)
    starts = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    ends = torch.full((rows,), keys, dtype=torch.int32, device=DEVICE)
    indices = torch.empty(rows, TOPK, dtype=torch.int32, device=DEVICE)
    logits = mqa_logits(q, (k, scale), weights, starts, ends)

    def score() -> None:
        mqa_logits(q, (k, scale), weights, starts, ends)

    def select() -> None:
        top_k(logits, starts, ends, indices)

    return {
        "rows": rows,
        "keys": keys,
        "logits_ms": timed(lambda _: score(), [0], runs)[0]["gpu_ms"],
        "topk_ms": timed(lambda _: select(), [0], runs)[0]["gpu_ms"],
    }


# The indexer layers of a step, which share the step's plan and windows:
# DeepSeek-V3.2's 61 (``num_hidden_layers`` in its config.json, every one
# with an indexer).
LAYERS = 61


def layer_host_ms(host_ms: float, windows_ms: float = 0.0, plan_ms: float = 0.0):
    """A rank's host time per layer: its call's, and its share of the
    step's windows and plan, made once for the step's LAYERS."""
    return host_ms + (windows_ms + plan_ms) / LAYERS


def step_ms(run: dict) -> float:
    """A call's time in a forward of many layers: its slowest rank's
    (``rank_ms``), or in runs without per-rank times, the GPU's or the
    host's, whichever is longer."""
    if "per_rank_host_ms" in run:
        return max(rank_ms(run))
    return max(run["gpu_ms"], run["host_ms"])


def rank_ms(run: dict) -> list[float]:
    """Each rank's time per call in a forward of many layers: the GPU's or
    the host's (``layer_host_ms``), whichever is longer (with no sync, the
    host runs ahead of the GPU)."""
    ranks = len(run["per_rank_gpu_ms"])
    windows = run.get("per_rank_windows_ms", [0.0] * ranks)
    return [
        max(gpu, layer_host_ms(host, made, run.get("plan_ms", 0.0)))
        for gpu, host, made in zip(
            run["per_rank_gpu_ms"], run["per_rank_host_ms"], windows, strict=True
        )
    ]
