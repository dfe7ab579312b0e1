# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on one GPU, host included: the whole indexer prefill op per
step, replicated vs each TP rank's share of the split, on serving steps.

For each step (requests as (cached tokens, new tokens), from the cost
model's workload set) and tp 2 and 8, vLLM's metadata builder plans the
step and the real ``rocm_aiter_sparse_attn_indexer`` of the applied tree
runs it: once replicated (the flag off), then once as each rank of a split
(the flag on, the rank's id patched in; one GPU has no TP group, so the
merge's collective is replaced by its local part and not timed). Per run:

- GPU ms: CUDA events around the call;
- host ms: wall time until the call returns, without waiting for the GPU
  (with no sync inside, the host runs ahead; a sync makes it wait);
- syncs: synchronizing CUDA calls counted by
  ``torch.cuda.set_sync_debug_mode("warn")``.

The logits and top-k are the fast stand-ins of
``scripts.harness.fast_indexer_kernels`` (a Triton fp8 MQA-logits kernel
and one torch.topk per chunk), so that GPU time is not dominated by a
reference kernel 10-100x slower than AITER. Their times are H200 times, not
MI355X times. Run on the previous design's tree too (stage 0001 at commit
5a047b0) for its figures; each run writes cp_indexer_host_bench_<after or
before>.json.

With ``--crossover`` it sweeps small steps instead, the split forced on,
for the minimum split size (cp_indexer_min_split.json).

Usage (on the device, under scripts/gpu_run.sh; see README "GPU runs"):
    python3 -m scripts.bench.cp_indexer_host --out DIR
    python3 -m scripts.bench.cp_indexer_host --crossover --out DIR
then, with the JSON files in docs/:
    python -m scripts.bench.cp_indexer_host --report docs
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

from scripts.bench.common import command_line, gpu_versions, parse_args

TOPK = 2048
HEADS = 32
K = 1024
STEPS: dict[str, list[tuple[int, int]]] = {
    "fresh 16K": [(0, 16 * K)],
    "fresh 64K, last 16K-row step": [(48 * K, 16 * K)],
    "turn 4096 over 200K": [(200 * K, 4096)],
    "turn 512 over 100K + fresh 8K": [(100 * K, 512), (0, 8 * K)],
    "8 turns of 256 over 4K-200K": [
        (p * K, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)
    ],
    "turn 64 over 15K + fresh 1K": [(15 * K, 64), (0, K)],
}
TPS = (2, 8)


def _timed(fn, runs: int) -> dict:
    """Median GPU ms, host ms and the syncs of one call."""
    import torch

    fn()  # warm-up: Triton compiles, workspace grows
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(runs):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return {
        "gpu_ms": statistics.median(gpu),
        "host_ms": statistics.median(host),
        "syncs": syncs,
    }


def _bench(
    step: list[tuple[int, int]], tp: int, runs: int, force_split: bool = False
) -> dict:
    import pytest
    import torch

    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as op
    from scripts.harness import fast_indexer_kernels as fast
    from scripts.harness import indexer_batch
    from scripts.harness.rocm_platform import emulate_rocm
    from vllm.v1.attention.ops import rocm_cp_indexer

    longest = max(c + q for c, q in step)
    rows = sum(q for _, q in step)
    result: dict = {}
    for mode in ("replicated", "split"):
        with contextlib.ExitStack() as stack:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            # Before the platform: entering it reads AITER's switches.
            mp.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1" if mode == "split" else "0")
            stack.enter_context(emulate_rocm("gfx950"))
            mp.setattr(op, "rocm_fp8_mqa_logits", fast.mqa_logits)
            mp.setattr(
                torch.ops._C,
                "top_k_per_row_prefill",
                fast.top_k_per_row_prefill,
                raising=False,
            )
            config = indexer_batch.make_vllm_config(
                tp_size=tp, device="cuda", max_len=longest + 64, max_tokens=rows
            )
            builder = indexer_batch.make_builder(config, mp, "cuda")
            if force_split:
                mp.setattr(rocm_cp_indexer, "MIN_SPLIT_KEY_ROWS", 0)
            batch = indexer_batch.build_batch(
                builder, step, heads=HEADS, cache_new_keys=True, torch_context=True
            )
            prefill = batch.metadata.prefill  # type: ignore[attr-defined]
            split = prefill.cp_split
            if hasattr(rocm_cp_indexer, "prefill_row_costs"):
                costs = rocm_cp_indexer.prefill_row_costs(
                    torch.tensor([c + q for c, q in step]),
                    torch.tensor([q for _, q in step]),
                    1,
                    prefill.chunks,
                    0,
                )
                result["cost_key_rows"] = int(costs.sum())
            if mode == "split" and split is None:
                result["split"] = None  # below the minimum: stays replicated
                continue
            # One GPU: no TP group. The merge keeps its local work (its own
            # rows made contiguous, the gathered rows written back).
            group = SimpleNamespace(
                world_size=tp,
                device_group=None,
                all_gatherv=lambda own, dim=0, sizes=None: own.new_empty(
                    (sum(sizes), *own.shape[1:])
                ),
            )
            mp.setattr(
                rocm_cp_indexer, "get_tp_group", lambda g=group: g, raising=False
            )
            mp.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
            ranks = range(tp) if mode == "split" else [0]
            per_rank = []
            for rank in ranks:
                mp.setattr(
                    rocm_cp_indexer,
                    "get_tensor_model_parallel_rank",
                    lambda r=rank: r,
                    raising=False,
                )
                per_rank.append(
                    _timed(
                        functools.partial(
                            indexer_batch.run_indexer,
                            batch,
                            TOPK,
                            skip_k_cache_insert=True,
                        ),
                        runs,
                    )
                )
            result[mode] = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
            result[mode]["per_rank_gpu_ms"] = [r["gpu_ms"] for r in per_rank]
            result["chunks"] = len(prefill.chunks)
    return result


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
        "step's key-rows as the planner counts them (`prefill_row_costs`). "
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
        rep, split = result["replicated"], result["split"]
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
        f"split / replicated, below and from the shipped minimum "
        f"(`MIN_SPLIT_KEY_ROWS` = {minimum / 1e6:.1f}M key-rows):",
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
        "vllm_overlay/vllm/v1/attention/ops/rocm_cp_indexer.py"
    )
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MIN_SPLIT_KEY_ROWS"
            for t in node.targets
        ):
            expression = compile(ast.Expression(node.value), "min", "eval")
            return int(eval(expression, {"__builtins__": {}}))
    raise SystemExit(f"no MIN_SPLIT_KEY_ROWS in {source}")


def report(docs: Path) -> str:
    """docs/cp_indexer_host_bench.md from the two runs' JSON files."""
    runs = {
        label: json.loads((docs / f"cp_indexer_host_bench_{label}.json").read_text())
        for label in ("before", "after")
    }
    after = runs["after"]
    lines = [
        "# CP indexer on one GPU, host included: split vs replicated",
        "",
        "Per serving step and tp, the whole `rocm_aiter_sparse_attn_indexer` "
        "call (vLLM's builder plans the step): replicated (flag off), and the "
        "slowest TP rank's share of the split (flag on; one GPU runs each "
        "rank's share in turn, and the merge's collective is not timed). "
        "*before*: the previous design (mirrored stripes by row index, "
        "commit 5a047b0); *after*: cost-balanced contiguous ranges. Host ms: "
        "wall time until the call returns, without waiting for the GPU; "
        "syncs: synchronizing CUDA calls per call "
        "(`torch.cuda.set_sync_debug_mode`). Speedup: replicated GPU ms / "
        "the slowest rank's GPU ms; ideal: tp.",
        "",
        "Logits and top-k are the fast stand-ins of "
        "`scripts/harness/fast_indexer_kernels.py` (a Triton fp8 MQA-logits "
        "kernel, one torch.topk per chunk); their times are H200 times, not "
        "MI355X times. Their top-k scans each chunk's whole key width for "
        "every row, so a row's cost in this benchmark has a part proportional "
        "to the chunk's width, heavier than AITER's: AITER's logits kernel walks "
        "each row's own key range (ROCm/aiter "
        "`aiter/ops/triton/_gluon_kernels/gfx950/attention/fp8_mqa_logits.py`, "
        "one program per row from `cu_starts` to `cu_ends`) after its wrapper "
        "fills the chunk's whole logits with -inf, and its top-k reads each "
        "row's range. The planner weighs that fill "
        "(`LOGITS_FILL_DIVISOR`), not the stand-in's wider top-k.",
        "",
        f"Hardware and versions: {after['versions']}. Command: "
        f"`{after['command']}`, once on each tree.",
        "",
        "| step | tp | replicated GPU ms | split GPU ms (slowest rank) "
        "before / after | speedup before / after | host ms before / after | "
        "syncs before / after |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, result in after["results"].items():
        name, tp = key.split(" | tp ")
        old = runs["before"]["results"][key]
        rep = result["replicated"]

        def cells(entry):
            split = entry["split"]
            if split is None:
                return (
                    "replicated",
                    "1.00",
                    f"{entry['replicated']['host_ms']:.1f}",
                    str(entry["replicated"]["syncs"]),
                )
            return (
                f"{split['gpu_ms']:.2f}",
                f"{entry['replicated']['gpu_ms'] / split['gpu_ms']:.2f}",
                f"{split['host_ms']:.1f}",
                str(split["syncs"]),
            )

        b, a = cells(old), cells(result)
        lines.append(
            f"| {name} | {tp} | {rep['gpu_ms']:.2f} | {b[0]} / {a[0]} | "
            f"{b[1]} / {a[1]} | {b[2]} / {a[2]} | {b[3]} / {a[3]} |"
        )
    lines += [
        "",
        '"replicated": the step stays replicated (after: below the minimum '
        "split size). Replicated calls make 0 syncs (1 in the first measured "
        "call of a process).",
    ]
    return "\n".join(lines) + "\n"


def crossover(runs: int) -> dict:
    """The CROSSOVER steps, split forced, at tp 2 and 8."""
    results = {}
    for name, step in CROSSOVER.items():
        for tp in TPS:
            result = _bench(step, tp, runs, force_split=True)
            result["tp"], result["rows"] = tp, sum(q for _, q in step)
            results[f"{name} | tp {tp}"] = result
            print(name, tp, result, flush=True)
    return results


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        docs = Path(sys.argv[2])
        (docs / "cp_indexer_host_bench.md").write_text(report(docs))
        if (docs / "cp_indexer_min_split.json").exists():
            (docs / "cp_indexer_min_split.md").write_text(crossover_report(docs))
        return 0
    if "--crossover" in sys.argv:
        sys.argv.remove("--crossover")
        args = parse_args(__doc__, runs=5)
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": command_line("scripts.bench.cp_indexer_host") + " --crossover",
            "versions": gpu_versions(),
            "results": crossover(args.runs),
        }
        (args.out / "cp_indexer_min_split.json").write_text(
            json.dumps(payload, indent=1) + "\n"
        )
        return 0
    args = parse_args(__doc__, runs=5)
    from vllm.v1.attention.ops import rocm_cp_indexer

    # The previous design's tree has no minimum split size.
    label = "after" if hasattr(rocm_cp_indexer, "MIN_SPLIT_KEY_ROWS") else "before"
    results = {}
    for name, step in STEPS.items():
        for tp in TPS:
            results[f"{name} | tp {tp}"] = _bench(step, tp, args.runs)
            print(name, tp, results[f"{name} | tp {tp}"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "label": label,
        "command": command_line("scripts.bench.cp_indexer_host"),
        "versions": gpu_versions(),
        "results": results,
    }
    (args.out / f"cp_indexer_host_bench_{label}.json").write_text(
        json.dumps(payload, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
