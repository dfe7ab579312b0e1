# SPDX-License-Identifier: Apache-2.0
"""The host bench's crossover report: docs/cp_indexer_min_split.md from its
run's JSON, the small steps replicated against split around the gate's
minimum."""

from __future__ import annotations

import ast
import json
import statistics
from pathlib import Path

from scripts.bench.cp_indexer_host_timing import step_ms

# The merge's collective, which one GPU cannot run: an all_gather of the
# rows' top-k (2,048 int32 each) on 2x H200 over NVLink, fitted to
# docs/cp_indexer_bench_2gpu.json (8K rows 0.23-0.26 ms, 32K 0.59, 64K
# 1.13-1.16): 0.10 ms + 15.7 ns a row. At tp 8 it is an assumption.
MERGE_BASE_MS, MERGE_ROW_MS = 0.10, 15.7e-6


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
