# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on one GPU, host included: the whole indexer prefill op per
step, replicated vs each TP rank's share of the split, on serving steps.

The steps (``scripts.bench.serving_steps``): the six named ones the
planner was tuned on, and a seeded family of at least 30 it was not
(``--family N --seed S``), each at tp 2, 4 and 8. For each, vLLM's
metadata builder plans the step and the real
``rocm_aiter_sparse_attn_indexer`` of the applied tree runs it: once
replicated (the flag off), then once as each rank of the shipped split
(the flag on, the rank's id patched in; one GPU has no TP group, so the
merge's collective is replaced by its local part and not timed), and,
where the planner leaves the step replicated, split anyway
(``forced_split``), to show what that leaves. Per step, also:

- ``floor_ms``, F1: the op on one call holding only the step's costliest
  row (``floor_step``), with each top-k stand-in shape;
- ``merge_ms``: the merge modelled at H200 NVLink and MI355X xGMI
  bandwidths (``merge_ms``, with the stage's own ``MergeLink`` model).

Per call:

- GPU ms: CUDA events around the call, queued behind enough GPU work to
  cover the host's queueing (so small steps time the GPU, not the host),
  the worse of two medians of ``--runs`` calls; inputs and buffers are made
  before, untimed;
- host ms: wall time until the call returns, without waiting for the GPU
  (with no sync inside, the host runs ahead; a sync makes it wait);
- syncs: synchronizing CUDA calls counted by
  ``torch.cuda.set_sync_debug_mode("warn")``.

With ``--variants`` it first calibrates the planner's costs: the logits
and top-k are timed on chunks of R rows of L keys each. The whole op on
chunks of 256 rows and more is fitted as ``ms = a R L + b R + c`` by least
squares: ``b / a`` is a row's fixed cost in key-rows (``ROW_COST_KEYS``),
``c / a`` a call's (``CALL_COST_KEYS``). The logits alone, with chunks of
a wave's worth of rows too, are fitted as ``ms = a max(R, W) L + b R + c``
for a few waves W (rows the GPU scores at once): the best W per compute
unit is the wave (``WAVE_ROWS_PER_CU``), their a over the whole op's the
logits' share (``LOGITS_SHARE``). The named steps then also run under
planner variants: the shipped costs without the wave floor, with half and
with twice the wave, the fitted costs, and the shipped costs again (the
run's noise).

ROCm is emulated as gfx950, where vLLM 0.34.0 asks AITER's logits for no
-inf fill. The logits and top-k are the fast stand-ins of
``scripts.harness.fast_indexer_kernels`` (a Triton fp8 MQA-logits kernel
on AITER's grid and a Triton radix top-k with the threads of AITER's
one-block kernel, or with ``--narrow-topk`` the bench's first, narrow one),
so that GPU time is not dominated by a reference kernel 10-100x slower than
AITER. Their times are NVIDIA times, not MI355X times.

With ``--crossover`` it sweeps small steps instead, the split forced on,
for the minimum split size (cp_indexer_min_split.json). With
``--topk-shapes`` it times only the logits and each top-k stand-in shape on
a few calls (cp_indexer_topk_shapes.json), to choose the shape first.

With ``--aiter`` (on an MI355X, against a built tree) nothing is emulated
or stood in: the op runs on the machine's own ROCm platform with AITER's
logits and top-k (``VLLM_ROCM_USE_AITER=1``), and the calibration times
AITER's logits and its prefill top-k, so the fits give MI355X's row, call
and wave costs.

The JSON is written after every step; ``--resume`` runs only the steps it
lacks, so a run cut short by a time limit goes on where it stopped.

Usage (on the device, under scripts/gpu_run.sh; see docs/gpu_runs.md):
    python3 -m scripts.bench.cp_indexer_host --out DIR [--resume]
    python3 -m scripts.bench.cp_indexer_host --crossover --out DIR
on an MI355X (docs/serving.md, "Stage 0001's host bench on an MI355X"):
    python -m scripts.bench.cp_indexer_host --aiter --tree TREE --out DIR
then, with the JSON files in docs/:
    python -m scripts.bench.cp_indexer_host --report docs
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

from scripts.bench.common import command_line, gpu_versions, parse_args, use_tree
from scripts.bench.serving_steps import LONG_TURNS, NAMED, Step, family, named
from scripts.series.contract import TREE_ENV

TOPK = 2048
HEADS = 32
K = 1024
STEPS = NAMED
TPS = (2, 4, 8)
# Set by --aiter: AITER's kernels on this machine's ROCm, not the stand-ins.
ON_AITER = False
# Set by --variants: the calibration, and planner variants on the named steps.
VARIANTS = False
# The top-k stand-in's shape (fast_indexer_kernels.TOPK_SHAPES): "wide",
# AITER's 1,024 threads a row, since Triton's 12-bit histogram ("aiter")
# takes 8-23x as long on NVIDIA (docs/cp_indexer_topk_shapes.json);
# --narrow-topk sets the narrow one.
TOPK_SHAPE = "wide"
# Set by --resume: the steps the output's JSON holds already are not run again.
RESUME = False
# Where the op runs: a CPU test sets "cpu" to walk the bench's plumbing
# through Triton's interpreter.
DEVICE = "cuda"
# A planner variant's costs: ROW_COST_KEYS, CALL_COST_KEYS, WAVE_ROWS_PER_CU
# and LOGITS_SHARE.
Costs = tuple[int, int, float, float]


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


def _timed(fn, ranks: list[int], runs: int) -> list[dict]:
    """Per rank: GPU ms, host ms and the syncs of one call of ``fn(rank)``.
    GPU ms is CUDA events around the call, queued behind enough GPU work
    to cover the host's time to queue it; each figure is the worse of
    ``TIMINGS`` medians of ``runs`` calls (``gpu_ms_timings`` lists them).
    The ranks take turns call by call, so that a drift of the GPU's clocks
    over the run weighs on every rank alike. Whatever ``fn`` needs besides
    the call (inputs, buffers) is made before, untimed."""
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
    for _ in range(TIMINGS):
        times: dict[int, list[float]] = {rank: [] for rank in ranks}
        hosts: dict[int, list[float]] = {rank: [] for rank in ranks}
        for _ in range(runs):
            for rank in ranks:
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                torch.cuda.synchronize()
                _keep_gpu_busy(2 * host_lead + 0.2)
                start.record()
                t0 = time.perf_counter()
                fn(rank)
                hosts[rank].append((time.perf_counter() - t0) * 1e3)
                end.record()
                torch.cuda.synchronize()
                times[rank].append(start.elapsed_time(end))
        for rank in ranks:
            gpu[rank].append(statistics.median(times[rank]))
            host[rank].append(statistics.median(hosts[rank]))
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
                "syncs": sum("synchronizing" in str(w.message) for w in caught),
            }
        )
    return timings


def _bench(
    step: list[tuple[int, int]],
    tp: int,
    runs: int,
    variants: dict[str, Costs | None],
    force_split: bool = False,
    replicated: bool = True,
) -> dict:
    """The step replicated (unless not ``replicated``), then split under
    each planner variant (a name and its ``Costs``; None: the shipped
    planner as it is), the stage's gate (``split_repays``) ignored with
    ``force_split``. The builder is told this GPU's compute units, which
    the planner's wave is counted in."""
    import pytest
    import torch

    from scripts.harness import indexer_batch
    from vllm.v1.attention.ops import (
        rocm_cp_indexer,
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
            _use_kernels(stack, mp)
            costs = variants[variant] if variant is not None else None
            if costs is not None:
                row_cost, call_cost, wave, share = costs
                mp.setattr(rocm_cp_indexer_plan, "ROW_COST_KEYS", row_cost)
                mp.setattr(rocm_cp_indexer_plan, "CALL_COST_KEYS", call_cost)
                mp.setattr(rocm_cp_indexer_plan, "WAVE_ROWS_PER_CU", wave)
                mp.setattr(rocm_cp_indexer_plan, "LOGITS_SHARE", share)
            if force_split:
                mp.setattr(rocm_cp_indexer_plan, "split_repays", lambda *_: True)
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
            # The runs of chunks over the same keys: (first row, end, the
            # largest chunk's rows), for the modelled per-call cost.
            result["runs"] = rocm_cp_indexer_plan.shared_key_runs(prefill.chunks, 0)
            if mode == "split" and split is None:
                result["split"][variant] = None  # below the minimum: replicated
                continue
            # One GPU: no TP group. The merge gathers in place, so it has
            # no local work to keep.
            pynccl = SimpleNamespace(
                disabled=False, all_gatherv=lambda rows, own, sizes: None
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

            def call(rank: int, batch=batch, this_rank=this_rank, buffer=buffer):
                this_rank[0] = rank
                indexer_batch.run_indexer(
                    batch,
                    TOPK,
                    skip_k_cache_insert=True,
                    kv_cache=batch.kv_cache,
                    buffer=buffer,
                )

            per_rank = _timed(call, ranks, runs)
            entry = {
                key: max(r[key] for r in per_rank)
                for key in ("gpu_ms", "host_ms", "syncs")
            }
            entry["per_rank_gpu_ms"] = [r["gpu_ms"] for r in per_rank]
            entry["per_rank_gpu_ms_timings"] = [r["gpu_ms_timings"] for r in per_rank]
            entry["per_rank_host_ms"] = [r["host_ms"] for r in per_rank]
            if mode == "split":
                entry["bounds"] = list(split.bounds)
                result["split"][variant] = entry
            else:
                result["replicated"] = entry
    return result


# The calibration's chunks: R rows of L keys each (R * L <= 2**28 fp32
# logits), and chunks of fewer rows than a few waves, for the wave's size.
CALIBRATION_ROWS = (256, 1024, 4096)
CALIBRATION_KEYS = (4096, 16384, 65536, 200 * K)
WAVE_KEYS = (65536, 200 * K)
WAVE_SAMPLES_PER_CU = (0.25, 0.5, 1, 1.5, 2, 3)
# The waves tried in the logits' fit, in rows per compute unit.
WAVES_PER_CU = (0.5, 1, 1.25, 1.5, 1.75, 2, 2.5, 3)


def _use_kernels(stack: contextlib.ExitStack, mp) -> None:
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


def _chunk_kernels():
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


def _time_chunk(rows: int, keys: int, runs: int) -> dict:
    """The logits and top-k kernels' GPU ms (``_chunk_kernels``) on one
    chunk of ``rows`` rows of ``keys`` keys each."""
    import torch

    from vllm.platforms import current_platform

    mqa_logits, top_k = _chunk_kernels()
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
        "logits_ms": _timed(lambda _: score(), [0], runs)[0]["gpu_ms"],
        "topk_ms": _timed(lambda _: select(), [0], runs)[0]["gpu_ms"],
    }


def fit_costs(samples: list[dict], wave: int) -> dict:
    """``ms = a * max(rows, wave) * keys + b * rows + c`` fitted by least
    squares to each kernel's times and their sum (``wave`` 0: a R L)."""
    import torch

    design = torch.tensor(
        [[max(s["rows"], wave) * s["keys"], s["rows"], 1.0] for s in samples],
        dtype=torch.float64,
    )
    fit: dict = {"wave_rows": wave}
    for part in ("logits_ms", "topk_ms", "total"):
        times = torch.tensor(
            [
                s["logits_ms"] + s["topk_ms"] if part == "total" else s[part]
                for s in samples
            ],
            dtype=torch.float64,
        )
        a, b, c = torch.linalg.lstsq(design, times[:, None]).solution[:, 0].tolist()
        modelled = design @ torch.tensor([a, b, c], dtype=torch.float64)
        fit[part] = {
            "ns_per_key_row": a * 1e6,
            "ns_per_row": b * 1e6,
            "us_per_call": c * 1e3,
            "worst_relative_error": float(((modelled - times).abs() / times).max()),
        }
    fit["row_cost_keys"] = round(
        fit["total"]["ns_per_row"] / fit["total"]["ns_per_key_row"]
    )
    fit["call_cost_keys"] = round(
        fit["total"]["us_per_call"] * 1e3 / fit["total"]["ns_per_key_row"]
    )
    return fit


def calibrate(runs: int) -> dict:
    """The logits + top-k time (``_chunk_kernels``) on uniform chunks. ``fit``: the
    whole op on the chunks of CALIBRATION_ROWS, ``ms = a R L + b R + c``
    (``row_cost_keys`` = b / a, ``call_cost_keys`` = c / a). ``wave``: the
    logits alone, fitted with the wave W (in rows per compute unit, from
    ``WAVES_PER_CU``) whose fit errs least, and the logits' share of a
    key-row's cost, ``logits_share``."""
    units = compute_units()
    shapes = [
        (rows, keys)
        for rows in CALIBRATION_ROWS
        for keys in CALIBRATION_KEYS
        if rows * keys <= 1 << 28
    ]
    shapes += [
        (max(1, round(units * waves)), keys)
        for waves in WAVE_SAMPLES_PER_CU
        for keys in WAVE_KEYS
    ]
    samples = []
    for rows, keys in shapes:
        samples.append(_time_chunk(rows, keys, runs))
        print("calibration", samples[-1], flush=True)
    # The row and call costs from the chunks of a few waves and more, where
    # the floor does not hold: fitted with the wave's chunks they would be
    # bent by it.
    fit = fit_costs([s for s in samples if s["rows"] in CALIBRATION_ROWS], 0)
    waves = [
        fit_costs(samples, round(units * per_cu)) | {"wave_rows_per_cu": per_cu}
        for per_cu in WAVES_PER_CU
    ]
    wave = min(waves, key=lambda f: f["logits_ms"]["worst_relative_error"])
    wave["logits_share"] = round(
        wave["logits_ms"]["ns_per_key_row"] / fit["total"]["ns_per_key_row"], 2
    )
    return {
        "samples": samples,
        "compute_units": units,
        "fit": fit,
        "waves": waves,
        "wave": wave,
    }


# The minimum split size's sweep: small steps around it, split forced.
CROSSOVER: dict[str, list[tuple[int, int]]] = {
    **{f"fresh {n}K": [(0, n * K)] for n in (1, 2, 3, 4, 6, 8)},
    **{f"turn 256 over {p}K": [(p * K, 256)] for p in (8, 16, 32, 64)},
    "turn 64 over 15K + fresh 1K": [(15 * K, 64), (0, K)],
    "turn 1024 over 16K": [(16 * K, 1024)],
}
# The merge's collective, which one GPU cannot run: an all_gather of the
# rows' top-k (2,048 int32 each) on 2x H200 over NVLink, fitted to
# docs/cp_indexer_bench_2gpu.json (8K rows 0.23-0.26 ms, 32K 0.59, 64K
# 1.13-1.16): 0.10 ms + 15.7 ns a row. At tp 8 it is an assumption.
MERGE_BASE_MS, MERGE_ROW_MS = 0.10, 15.7e-6


def step_ms(run: dict) -> float:
    """A call's time in a forward of many layers: the GPU's or the host's,
    whichever is longer (with no sync, the host runs ahead of the GPU)."""
    return max(run["gpu_ms"], run["host_ms"])


def crossover_report(docs: Path) -> str:
    """docs/cp_indexer_min_split.md from the crossover run's JSON."""
    run = json.loads((docs / "cp_indexer_min_split.json").read_text())
    lines = [
        "# CP indexer: the minimum split size",
        "",
        "Small serving steps, replicated against split (the split forced on, "
        "whatever the minimum), on one GPU as in cp_indexer_host_bench.md. A "
        "call's time is max(GPU ms, host ms): in a forward of 61 indexer "
        "layers without syncs the host runs ahead, so the longer of the two "
        "sets the pace. The split adds the merge's collective, which one GPU "
        f"cannot run: {MERGE_BASE_MS} ms + {MERGE_ROW_MS * 1e6:.1f} ns a row, "
        "fitted to the all_gather measured on 2x H200 "
        "(cp_indexer_bench_2gpu.json; at tp 8 an assumption). Cost: the "
        "step's key-rows as the run's planner counted them "
        "(`prefill_row_costs`, with the run's `ROW_COST_KEYS`). "
        "Steps this small run about 1 ms, mostly host work (GPU ms close to "
        "host ms), and medians of 5 calls scatter by tens of percent between "
        "equal calls: read the bands below, not single rows.",
        "",
        f"Hardware and versions: {run['versions']}. Command: `{run['command']}`.",
        "",
        "| step | tp | cost (M key-rows) | replicated ms (GPU / host) | "
        "split ms, slowest rank (GPU / host) | merge ms (model) | "
        "split / replicated |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for key, result in sorted(
        run["results"].items(), key=lambda kv: (kv[1]["tp"], kv[1]["cost_key_rows"])
    ):
        rep, split = result["replicated"], result["split"]["shipped"]
        merge = MERGE_BASE_MS + MERGE_ROW_MS * result["rows"]
        ratio = (step_ms(split) + merge) / step_ms(rep)
        ratios.append((result["tp"], result["cost_key_rows"], ratio))
        lines.append(
            f"| {key.split(' | tp ')[0]} | {result['tp']} | "
            f"{result['cost_key_rows'] / 1e6:.1f} | "
            f"{rep['gpu_ms']:.2f} / {rep['host_ms']:.2f} | "
            f"{split['gpu_ms']:.2f} / {split['host_ms']:.2f} | {merge:.2f} | "
            f"{ratio:.2f} |"
        )
    minimum = shipped_minimum()
    lines += [
        "",
        f"split / replicated, below and from the gate's minimum "
        f"(`MIN_SPLIT_KEY_ROWS` = {minimum / 1e6:.1f}M key-rows; the gate, "
        "`split_repays`, also weighs the merge on the TP group's link):",
        "",
    ]
    for tp in sorted({r[0] for r in ratios}):
        for label, picked in (
            ("below", [r for t, c, r in ratios if t == tp and c < minimum]),
            ("from", [r for t, c, r in ratios if t == tp and c >= minimum]),
        ):
            lines.append(
                f"- tp {tp}, {label} it: {len(picked)} steps, "
                f"{min(picked):.2f}-{max(picked):.2f}, median "
                f"{statistics.median(picked):.2f}"
            )
    return "\n".join(lines) + "\n"


def shipped_minimum() -> int:
    """``MIN_SPLIT_KEY_ROWS`` as the stage's overlay sets it (read from the
    source: the report runs without a vLLM tree)."""
    source = Path(__file__).resolve().parents[2] / (
        "vllm_overlay/vllm/v1/attention/ops/rocm_cp_indexer_plan.py"
    )
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MIN_SPLIT_KEY_ROWS"
            for t in node.targets
        ):
            expression = compile(ast.Expression(node.value), "min", "eval")
            return int(eval(expression, {"__builtins__": {}}))
    raise SystemExit(f"no MIN_SPLIT_KEY_ROWS in {source}")


def modelled_balance(
    step: list[tuple[int, int]],
    bounds: list[int],
    costs: Costs,
    runs: list[tuple[int, int, int]],
    units: int,
) -> float:
    """max/mean rank cost of a split as its planner scored it, with the
    planner's own ``RankCost`` (gfx950: a row of a request with C cached
    tokens costs C + t + 1 keys, t its index among the request's new rows,
    plus the row cost)."""
    import torch

    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    row_cost, call_cost, wave, share = costs
    rows = torch.tensor([c + t + 1 + row_cost for c, q in step for t in range(q)])
    before = torch.zeros(rows.numel() + 1, dtype=torch.int64)
    torch.cumsum(rows, 0, out=before[1:])
    saved = rocm_cp_indexer_plan.LOGITS_SHARE
    rocm_cp_indexer_plan.LOGITS_SHARE = share
    rank_cost = rocm_cp_indexer_plan.RankCost(
        before,
        rows,
        torch.tensor([q for _, q in step]),
        [tuple(run) for run in runs],
        call_cost,
        int(wave * units),
    )
    try:
        ranks = rank_cost.of(bounds)
    finally:
        rocm_cp_indexer_plan.LOGITS_SHARE = saved
    return max(ranks) / statistics.mean(ranks)


def balance(
    entry: dict | None,
    replicated: dict,
    step: list[tuple[int, int]],
    costs: Costs,
    runs: list[tuple[int, int, int]],
    units: int,
) -> tuple[str, str, str, str]:
    """A split's slowest-rank GPU ms, max/mean rank GPU time (measured, and
    modelled) and speedup (replicated GPU ms over the slowest rank's), as
    table cells."""
    if entry is None:
        return "replicated", "-", "-", "1.00"
    ranks = entry["per_rank_gpu_ms"]
    return (
        f"{max(ranks):.2f}",
        f"{max(ranks) / statistics.mean(ranks):.3f}",
        f"{modelled_balance(step, entry['bounds'], costs, runs, units):.3f}",
        f"{replicated['gpu_ms'] / max(ranks):.2f}",
    )


def _fit_table(fit: dict) -> list[str]:
    """A fit's coefficients per kernel, as table lines."""
    lines = [
        "| kernel | a: ns per key-row | b: ns per row | c: us per call | "
        "worst relative error |",
        "|---|---:|---:|---:|---:|",
    ]
    for part in ("logits_ms", "topk_ms", "total"):
        f = fit[part]
        lines.append(
            f"| {part.removesuffix('_ms')} | {f['ns_per_key_row']:.4f} | "
            f"{f['ns_per_row']:.1f} | {f['us_per_call']:.1f} | "
            f"{f['worst_relative_error']:.1%} |"
        )
    return lines


def report(docs: Path) -> str:
    """docs/cp_indexer_host_bench.md from the run's JSON."""
    run = json.loads((docs / "cp_indexer_host_bench.json").read_text())
    on_aiter = run.get("kernels") == "aiter"
    lines = [
        "# CP indexer on one GPU, host included: split vs replicated",
        "",
        "Per serving step and tp, the whole `rocm_aiter_sparse_attn_indexer` "
        "call (vLLM's builder plans the step, "
        + ("on this machine's ROCm" if on_aiter else "ROCm emulated as gfx950")
        + "): "
        "replicated (flag off), and each TP rank's share of the split (flag "
        "on; one GPU runs each rank's share in turn, and the merge's "
        "collective is not timed). The ranks take turns call by call.",
        "",
        (
            "Logits and top-k are AITER's, as vLLM's ROCm op calls them "
            "(`--aiter`); the calibration times AITER's prefill top-k."
            if on_aiter
            else "Logits and top-k are the fast stand-ins of "
            "`scripts/harness/fast_indexer_kernels.py`: a Triton fp8 MQA-logits "
            "kernel that leaves positions outside a row's range unwritten "
            "(vLLM 0.34.0 asks AITER for `clean_logits=False` on gfx950), one "
            "program per row as AITER's gfx950 kernel, and a Triton radix top-k "
            "that reads only each row's range, one program per row or, where "
            "AITER's rule takes its multi-block kernel, several, in the "
            f"*{run.get('topk_shape', 'narrow')}* shape (`TOPK_SHAPES`). Their "
            "times are NVIDIA GPU times, not MI355X times."
        ),
        "",
        f"Hardware and versions: {run['versions']}. Command: `{run['command']}`.",
        "",
    ]
    if "family" not in run:
        lines += [
            "This run predates the family of steps, F1 and the bench's timing "
            "hygiene: each figure is one median of the calls, timed from an "
            "idle GPU with the harness's K-cache copy and top-k buffer fill "
            "inside the events.",
            "",
        ]
    if run["calibration"]:
        lines += _calibration_section(run)
    if any("floor_ms" in result for result in run["results"].values()):
        lines += _goals_section(run)
    if run["calibration"]:
        lines += _variants_section(run)
    return "\n".join(lines).rstrip("\n") + "\n"


def _calibration_section(run: dict) -> list[str]:
    fit, wave = run["calibration"]["fit"], run["calibration"]["wave"]
    on_aiter = run.get("kernels") == "aiter"
    return [
        "## The costs, calibrated",
        "",
        ("AITER's kernels" if on_aiter else "The stand-ins")
        + " timed on chunks of R rows of L keys each "
        f"(R in {list(CALIBRATION_ROWS)}, L in {list(CALIBRATION_KEYS)}, "
        "R L <= 2^28; and R a wave's worth of rows for each of "
        f"{list(WAVE_SAMPLES_PER_CU)} rows per compute unit, L in "
        f"{list(WAVE_KEYS)}; {run['calibration']['compute_units']} compute "
        "units), the whole op fitted as ms = a R L + b R + c on the chunks "
        f"of {list(CALIBRATION_ROWS)} rows:",
        "",
        *_fit_table(fit),
        "",
        f"A row's fixed cost is b / a = {fit['row_cost_keys']} key-rows, a "
        f"call's c / a = {fit['call_cost_keys']:,}.",
        "",
        "The logits alone fitted as ms = a max(R, W) L + b R + c, for each "
        "wave W tried (W rows per compute unit):",
        "",
        "| W per compute unit | W | logits' worst relative error |",
        "|---:|---:|---:|",
        *(
            f"| {f['wave_rows_per_cu']} | {f['wave_rows']} | "
            f"{f['logits_ms']['worst_relative_error']:.1%} |"
            for f in run["calibration"]["waves"]
        ),
        "",
        f"The fit with the least error, W = {wave['wave_rows']} "
        f"({wave['wave_rows_per_cu']} per compute unit):",
        "",
        *_fit_table(wave),
        "",
        "The logits' share of a key-row's cost (their a over the whole op's): "
        f"{wave['logits_share']}.",
        "",
    ]


# The goals the shipped planner is held to on every step and tp.
# G1: a split step's (slowest rank + merge) / replicated at most this ...
G1_SPLIT = 0.95
# ... and a step left replicated would, split, gain less than 10%.
G1_LEFT = 0.90
# G2: a split step's slowest rank within this of its bound, per tp.
G2_BOUND = {2: 1.10, 4: 1.20, 8: 1.20}


def step_goals(result: dict, floor_shape: str) -> dict:
    """G1 and G2 of one step at one tp (``result`` as ``bench_step`` makes
    it): per link the split's (slowest rank + merge) / replicated, the bound
    LB = max(replicated / tp, F1) and the slowest rank over it, and whether
    each goal holds, on each link with the stage's gate for that link (G2:
    None for a step left replicated on both). A call's time is ``step_ms``:
    the longer of its GPU and host times."""
    replicated = step_ms(result["replicated"])
    shipped = result["split"]["shipped"]
    split = shipped if shipped is not None else result.get("forced_split")
    tp = result["tp"]
    if split is None:  # no split of its rows exists at this tp
        return {"split": False, "g1": True, "g2": None}
    ranks = [
        max(gpu, host)
        for gpu, host in zip(
            split["per_rank_gpu_ms"], split["per_rank_host_ms"], strict=True
        )
    ]
    slowest = max(ranks)
    ratios = {
        link: (slowest + ms) / replicated for link, ms in result["merge_ms"].items()
    }
    # Per link, the gate's decision: the timed split is the same plan.
    splits = splits_on(result, split)
    bound = max(replicated / tp, result["floor_ms"][floor_shape])
    return {
        "split": shipped is not None,
        "splits": splits,
        "slowest_ms": slowest,
        "balance": slowest / statistics.mean(ranks),
        "bounds": split["bounds"],
        "bound_ms": bound,
        "over_bound": slowest / bound,
        "ratios": ratios,
        "g1": all(
            ratios[link] <= G1_SPLIT if splits[link] else ratios[link] >= G1_LEFT
            for link in ratios
        ),
        "g2": slowest / bound <= G2_BOUND[tp] if any(splits.values()) else None,
    }


def _mark(holds: bool | None) -> str:
    return "-" if holds is None else ("yes" if holds else "**no**")


def _goals_section(run: dict) -> list[str]:
    shape = run.get("topk_shape", "narrow")
    family = run.get("family", {})
    lines = [
        "## Never slower (G1) and near its bound (G2)",
        "",
        f"The six named steps and a family of {family.get('count')} serving "
        f"steps drawn with seed {family.get('seed')} "
        "(`scripts/bench/serving_steps.py`), at each tp. Every GPU figure is "
        "the worse of two medians, and a call's time the longer of its GPU "
        "and host times (in a forward of 61 indexer layers without syncs the "
        "host runs ahead, so the longer sets the pace). The split timed is "
        "the shipped planner's plan, or for a step it leaves replicated the "
        "same plan forced; *plan* says, per link, whether the stage's gate "
        "(`split_repays`, with that link's `MergeLink`) splits the step "
        "(*split*) or leaves it replicated (*left*); a run made before the "
        "gate timed the same plans, so the gate is judged on its timings. "
        "F1: the op on one call holding only the step's costliest row, with "
        f"each top-k shape; LB takes the run's, *{shape}*. "
        "LB = max(replicated / tp, F1). "
        "Merge: modelled (H200 NVLink from the 2x H200 all_gather fit, "
        "MI355X xGMI from its link bandwidth; `MergeLink`), not timed. "
        f"G1, on each link: a split step's (slowest + merge) / replicated <= "
        f"{G1_SPLIT}; a step left replicated >= {G1_LEFT}, split. G2: a step "
        "split on either link: its slowest rank <= "
        + ", ".join(f"{b} x LB at tp {tp}" for tp, b in G2_BOUND.items())
        + ". Decodes take their tokens of the step's budget and are not run "
        "(the same work on every rank, replicated or split).",
        "",
        "max/mean: the ranks' times, measured / as the planner modelled "
        "them (`modelled_balance`, with the costs the run planned with).",
        "",
        "| step | tp | M key-rows | replicated ms | plan, NVLink / xGMI | "
        "slowest rank ms | "
        "max/mean | F1 ms | LB ms | slowest / LB | merge ms NVLink / xGMI | "
        "(slowest + merge) / replicated, NVLink / xGMI | G1 | G2 |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    held: dict[str, list[bool]] = {"g1": [], "g2": []}
    ordered = sorted(run["results"].items(), key=lambda kv: kv[1]["tp"])
    for key, result in ordered:
        name = key.split(" | tp ")[0]
        goals = step_goals(result, shape)
        held["g1"].append(goals["g1"])
        if goals["g2"] is not None:
            held["g2"].append(goals["g2"])
        floors = " / ".join(f"{ms:.2f}" for ms in result["floor_ms"].values())
        if "slowest_ms" not in goals:
            lines.append(
                f"| {name} | {result['tp']} | {result['cost_key_rows'] / 1e6:.0f} | "
                f"{step_ms(result['replicated']):.2f} | none | - | - | {floors} | "
                "- | - | - | - | yes | - |"
            )
            continue
        merge = " / ".join(f"{ms:.2f}" for ms in result["merge_ms"].values())
        modelled = modelled_balance(
            result["step"],
            goals["bounds"],
            tuple(run["planner_costs"]),
            result["runs"],
            run["compute_units"],
        )
        ratios = " / ".join(f"{r:.2f}" for r in goals["ratios"].values())
        lines.append(
            f"| {name} | {result['tp']} | {result['cost_key_rows'] / 1e6:.0f} | "
            f"{step_ms(result['replicated']):.2f} | "
            + " / ".join("split" if s else "left" for s in goals["splits"].values())
            + " | "
            f"{goals['slowest_ms']:.2f} | {goals['balance']:.3f} / {modelled:.3f} | "
            f"{floors} | "
            f"{goals['bound_ms']:.2f} | {goals['over_bound']:.2f} | {merge} | "
            f"{ratios} | {_mark(goals['g1'])} | {_mark(goals['g2'])} |"
        )
    lines += [
        "",
        f"G1 holds on {sum(held['g1'])} of {len(held['g1'])} steps and tps; "
        f"G2 on {sum(held['g2'])} of {len(held['g2'])} split ones. F1 is "
        "listed per top-k shape: "
        + ", ".join(next(iter(run["results"].values()))["floor_ms"])
        + ".",
        "",
    ]
    long_turns = [
        f"{name}: " + " / ".join(f"{1 / r:.2f}x" for r in goals["ratios"].values())
        for name in LONG_TURNS
        if f"{name} | tp 8" in run["results"]
        for goals in [step_goals(run["results"][f"{name} | tp 8"], shape)]
        if "ratios" in goals
    ]
    if long_turns:
        lines += [
            "The long-turn steps end to end at tp 8, replicated over (slowest "
            "+ merge), NVLink / xGMI: " + "; ".join(long_turns) + ".",
            "",
        ]
    return lines


def _variants_section(run: dict) -> list[str]:
    variants = run["variants"]
    lines = [
        "## Planner variants on the named steps",
        "",
        "max/mean: the ranks' GPU times; speedup: replicated GPU ms over the "
        "slowest rank's (ideal: tp). Planner variants by the costs they plan "
        "with (`ROW_COST_KEYS` and `CALL_COST_KEYS` in key-rows, "
        "`WAVE_ROWS_PER_CU` in rows per compute unit, `LOGITS_SHARE`): "
        + ", ".join(
            f"*{name}* {row:,}, {call:,}, {wave} and {share}"
            for name, (row, call, wave, share) in variants.items()
        )
        + ". A variant timed again plans the same split as the first with its "
        "costs: the difference between the two is this run's noise.",
        "",
        "| step | tp | replicated GPU ms | "
        + " | ".join(
            f"{name}: slowest rank ms / max/mean measured / modelled / speedup"
            for name in variants
        )
        + " |",
        "|---|---|---:|" + "---:|" * len(variants),
    ]
    for key, result in run["results"].items():
        name, tp = key.split(" | tp ")
        if name not in STEPS:
            continue
        rep = result["replicated"]
        cells = [
            " / ".join(
                balance(
                    result["split"][variant],
                    rep,
                    STEPS[name],
                    costs,
                    result["runs"],
                    run["calibration"]["compute_units"],
                )
            )
            for variant, costs in variants.items()
        ]
        lines.append(
            f"| {name} | {tp} | {rep['gpu_ms']:.2f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        '"replicated": the step stays replicated (the gate, `split_repays`, '
        "refuses it). Syncs per call, replicated and split: "
        + ", ".join(
            sorted(
                {
                    str(entry["syncs"])
                    for result in run["results"].values()
                    for entry in [result["replicated"], *result["split"].values()]
                    if entry is not None
                }
            )
        )
        + ".",
    ]
    return lines


# --topk-shapes: one call of R rows of L keys each, per top-k stand-in shape:
# a long row alone and in twos (AITER's multi-block top-k), a rank's sliver
# of a long turn, and full calls.
SHAPE_CHUNKS = ((1, 200 * K), (2, 100 * K), (128, 100 * K), (2048, 16 * K))


def topk_shapes(runs: int) -> list[dict]:
    """Logits and top-k GPU ms (``_time_chunk``) on SHAPE_CHUNKS with each
    top-k shape: which one the bench's runs should take on this GPU."""
    from scripts.harness import fast_indexer_kernels as fast

    results = []
    for rows, keys in SHAPE_CHUNKS:
        for shape in fast.TOPK_SHAPES:
            fast.TOPK_SHAPE = shape
            results.append({"shape": shape, **_time_chunk(rows, keys, runs)})
            print(results[-1], flush=True)
    return results


def crossover(runs: int) -> dict:
    """The CROSSOVER steps, split forced, at tp 2 and 8."""
    results = {}
    for name, step in CROSSOVER.items():
        for tp in TPS:
            result = _bench(step, tp, runs, {"shipped": None}, force_split=True)
            result["tp"], result["rows"] = tp, sum(q for _, q in step)
            results[f"{name} | tp {tp}"] = result
            print(name, tp, result, flush=True)
    return results


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        docs = Path(sys.argv[2])
        # The modelled balance is the planner's own RankCost: vLLM's, from
        # the tree (its absence is a clear exit, not an import traceback).
        tree = os.environ.get(TREE_ENV)
        use_tree(Path(tree) if tree else None)
        (docs / "cp_indexer_host_bench.md").write_text(report(docs))
        if (docs / "cp_indexer_min_split.json").exists():
            (docs / "cp_indexer_min_split.md").write_text(crossover_report(docs))
        return 0
    global ON_AITER, VARIANTS, TOPK_SHAPE, RESUME
    if "--aiter" in sys.argv:
        sys.argv.remove("--aiter")
        ON_AITER = True
    if "--variants" in sys.argv:
        sys.argv.remove("--variants")
        VARIANTS = True
    if "--resume" in sys.argv:
        sys.argv.remove("--resume")
        RESUME = True
    if "--narrow-topk" in sys.argv:
        sys.argv.remove("--narrow-topk")
        TOPK_SHAPE = "narrow"
    if "--crossover" in sys.argv:
        sys.argv.remove("--crossover")
        return _run_crossover()
    if "--topk-shapes" in sys.argv:
        sys.argv.remove("--topk-shapes")
        args = parse_args(__doc__, runs=5)
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": _command("--topk-shapes"),
            "versions": gpu_versions(),
            "results": topk_shapes(args.runs),
        }
        (args.out / "cp_indexer_topk_shapes.json").write_text(
            json.dumps(payload, indent=1) + "\n"
        )
        return 0
    return _run_steps()


def _command(*flags: str) -> str:
    """This run's command line, with the flags ``main`` took out of it."""
    taken = (
        *flags,
        *(["--aiter"] if ON_AITER else []),
        *(["--variants"] if VARIANTS else []),
        *(["--narrow-topk"] if TOPK_SHAPE == "narrow" else []),
        *(["--resume"] if RESUME else []),
    )
    return " ".join([command_line("scripts.bench.cp_indexer_host"), *taken])


def _run_crossover() -> int:
    args = parse_args(__doc__, runs=20)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": _command("--crossover"),
        "versions": gpu_versions(),
        "kernels": "aiter" if ON_AITER else "stand-ins",
        "results": crossover(args.runs),
    }
    (args.out / "cp_indexer_min_split.json").write_text(
        json.dumps(payload, indent=1) + "\n"
    )
    return 0


def floor_step(step: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A step whose one call holds only ``step``'s costliest row: the
    last two rows of its request with the most keys (a request of one new
    token would be a decode to vLLM's builder)."""
    cached, new = max(step, key=lambda request: request[0] + request[1])
    return [(cached + new - 2, 2)]


def measure_floor(step: list[tuple[int, int]], runs: int) -> dict[str, float]:
    """F1: the op's time (``step_ms``) on ``floor_step(step)``, replicated,
    with each top-k stand-in shape (with --aiter, AITER's own kernel, as
    "aiter"). Its call of two rows takes AITER's multi-block top-k for rows
    of 64K keys and more (``uses_multi_block``), as AITER would."""
    from scripts.harness import fast_indexer_kernels as fast

    shapes = ["aiter"] if ON_AITER else list(fast.TOPK_SHAPES)
    shipped_shape, floors = fast.TOPK_SHAPE, {}
    try:
        for shape in shapes:
            fast.TOPK_SHAPE = shape
            run = _bench(floor_step(step), 2, runs, {})
            floors[shape] = step_ms(run["replicated"])
    finally:
        fast.TOPK_SHAPE = shipped_shape
    return floors


# The links the merge is modelled on, as the stage's planner models them
# (``rocm_cp_indexer_plan.MergeLink``): NVLink from the all_gather measured on 2x
# H200, MI355X's xGMI from its link bandwidth.
LINKS = {"h200_nvlink": "NVLINK", "mi355x_xgmi": "XGMI_GFX950"}


def merge_ms(bounds: list[int]) -> dict[str, float]:
    """The merge's modelled ms per link for a split with ``bounds``."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    return {
        name: getattr(rocm_cp_indexer_plan, link).merge_ms(sizes)
        for name, link in LINKS.items()
    }


def splits_on(result: dict, split: dict) -> dict[str, bool]:
    """Per link, whether the stage's gate (``split_repays``) splits the step
    of ``result`` with ``split``'s bounds."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    sizes = [b - a for a, b in itertools.pairwise(split["bounds"])]
    return {
        name: rocm_cp_indexer_plan.split_repays(
            result["cost_key_rows"], sizes, getattr(rocm_cp_indexer_plan, link)
        )
        for name, link in LINKS.items()
    }


def _variants(runs: int) -> tuple[dict, dict[str, Costs | None]]:
    """With --variants: the calibration and the planner variants it sets
    (``report``'s columns); else none and the shipped planner alone."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    if not VARIANTS:
        return {}, {"shipped": None}
    calibration = calibrate(runs)
    fit = calibration["fit"]
    wave = calibration["wave"]
    shipped: Costs = (
        rocm_cp_indexer_plan.ROW_COST_KEYS,
        rocm_cp_indexer_plan.CALL_COST_KEYS,
        rocm_cp_indexer_plan.WAVE_ROWS_PER_CU,
        rocm_cp_indexer_plan.LOGITS_SHARE,
    )
    values: dict[str, Costs] = {
        "shipped": shipped,
        "no wave floor": (*shipped[:2], 0, shipped[3]),
        # How much the wave's size matters: MI355X's is not measured.
        "half the wave": (*shipped[:2], shipped[2] / 2, shipped[3]),
        "twice the wave": (*shipped[:2], shipped[2] * 2, shipped[3]),
        "fitted": (
            fit["row_cost_keys"],
            fit["call_cost_keys"],
            wave["wave_rows_per_cu"],
            wave["logits_share"],
        ),
    }
    # One run per distinct set of costs, named by the first variant with it.
    variants: dict[str, Costs | None] = {}
    for name, value in values.items():
        if value not in variants.values():
            variants[name] = value
    # The shipped planner twice: the spread between the two is the noise.
    variants["shipped, timed again"] = variants["shipped"]
    return calibration, variants


def bench_step(step: Step, runs: int, variants: dict[str, Costs | None]) -> dict:
    """One step at each of TPS: the op replicated (timed once: it does not
    depend on tp), split as the shipped planner (and ``variants``) plans it,
    and, where the plan stays replicated, split anyway (``forced_split``),
    to show what it leaves; F1 (``floor_ms``) and the merge modelled per
    link (``merge_ms``, of the shipped split or else the forced one)."""
    floors = measure_floor(step.prefills, runs)
    replicated = None
    results = {}
    for tp in TPS:
        result = _bench(
            step.prefills, tp, runs, variants, replicated=replicated is None
        )
        replicated = result.setdefault("replicated", replicated)
        taken = result["split"]["shipped"]
        if taken is None:
            forced = _bench(
                step.prefills,
                tp,
                runs,
                {"shipped": None},
                force_split=True,
                replicated=False,
            )
            taken = result["forced_split"] = forced["split"]["shipped"]
        result |= {
            "step": step.prefills,
            "decodes": step.decodes,
            "tp": tp,
            "rows": sum(q for _, q in step.prefills),
            "floor_ms": floors,
            "merge_ms": None if taken is None else merge_ms(taken["bounds"]),
        }
        results[f"{step.name} | tp {tp}"] = result
        print(step.name, tp, json.dumps(result), flush=True)
    return results


def _run_steps() -> int:
    args = parse_args(__doc__, runs=5, family=30, seed=0)
    from scripts.harness import fast_indexer_kernels as fast

    fast.TOPK_SHAPE = TOPK_SHAPE
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "cp_indexer_host_bench.json"
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    setup = {
        "kernels": "aiter" if ON_AITER else "stand-ins",
        "topk_shape": "aiter" if ON_AITER else TOPK_SHAPE,
        "family": {"count": args.family, "seed": args.seed},
        # What the shipped planner planned with, for the modelled balance.
        "planner_costs": [
            rocm_cp_indexer_plan.ROW_COST_KEYS,
            rocm_cp_indexer_plan.CALL_COST_KEYS,
            rocm_cp_indexer_plan.WAVE_ROWS_PER_CU,
            rocm_cp_indexer_plan.LOGITS_SHARE,
        ],
        "compute_units": compute_units(),
    }
    if RESUME and out.exists():
        payload = json.loads(out.read_text())
        differs = [key for key, value in setup.items() if payload.get(key) != value]
        if differs or bool(payload["calibration"]) != VARIANTS:
            raise SystemExit(
                f"{out} was run with other settings ({', '.join(differs) or 'variants'}"
                "): resume it with the same flags, or move it away"
            )
        payload.setdefault("resumed_by", []).append(_command())
    else:
        calibration, variants = _variants(args.runs)
        payload = {
            "command": _command(),
            "versions": gpu_versions(),
            **setup,
            "calibration": calibration,
            "variants": variants,
            "results": {},
        }
    variants = payload["variants"]
    for step in [*named(), *family(args.family, args.seed)]:
        if all(f"{step.name} | tp {tp}" in payload["results"] for tp in TPS):
            continue  # measured by the run this one resumes
        # Planner variants on the named steps only: the family is the
        # shipped planner's test.
        only_shipped = {"shipped": variants["shipped"]}
        payload["results"] |= bench_step(
            step, args.runs, variants if step.name in NAMED else only_shipped
        )
        # After every step, whole (a kill mid-write leaves the last one): a
        # run stopped by a time limit resumes from here.
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(payload, indent=1) + "\n")
        partial.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
