# SPDX-License-Identifier: Apache-2.0
"""Cost model of the CP indexer's row assignment (stage 0001).

A prefill row costs about its causal key count (ke - ks): a fresh prompt's
row t sees t + 1 keys, a new chat turn's row over a cached prefix of P tokens
sees P + t + 1. It also costs its chunk's key width W / 8: AITER's logits
first fill the chunk's whole [rows, W] output with -inf, one element taken
as 1/8 of a scored key-row (the stage's ``LOGITS_FILL_DIVISOR``, an
estimate). Chunks are vLLM's logits-budget chunks of a step
(``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``, 512 MB: requests packed while
rows x keys x 4 bytes fit, a longer one cut into slices of rows; the
workspace limit, 40 x max_model_len keys, never binds here). For a
workload this walks vLLM's chunked prefill step by step (each step takes
up to ``step tokens`` new tokens from the waiting requests,
in order, as the scheduler's token budget does), computes each TP rank's
cost under several assignments and reports max/mean rank cost (1.00 is
perfect balance), summed over the steps as sum(max) / sum(mean): ranks meet
at the merge once per step.

Workloads (``WORKLOADS``): the seeds' fresh prompts of 8K-200K, alone and
four packed; prefix-cached turns of 64-4,096 new rows over cached prefixes
of 4K-200K; those next to a fresh prompt, and several turns together.
Decode rows are not split, so decodes in the same step change nothing here.

"shipped" runs the stage's own planner from the applied tree
(``plan_cp_indexer_split``), first splitting every step (the balance of
its cut), then as it ships:
"work split" is the share of the workload's cost in steps that split (the
rest stays replicated, refused by ``split_repays``). The previous
design (mirrored stripes of 512 dealt by row index) is kept for comparison.
Run it with ``nox -s cost-model``; it writes docs/cp_indexer_cost_model.{md,png}.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np

from scripts.bench.common import parse_args

TPS = (2, 4, 8)
STEP_TOKENS = (8192, 16384)
STRIPE = 512  # the previous design's stripe size
K = 1024

# name -> requests as (cached prefix tokens, new tokens)
WORKLOADS: dict[str, list[tuple[int, int]]] = {
    **{f"fresh {n}K": [(0, n * K)] for n in (8, 50, 128, 200)},
    **{f"4x fresh {n}K": [(0, n * K)] * 4 for n in (8, 50)},
    **{
        f"turn {rows} over {prefix}K": [(prefix * K, rows)]
        for prefix in (4, 32, 200)
        for rows in (64, 512, 4096)
    },
    "turn 64 over 15K + fresh 1K": [(15 * K, 64), (0, K)],
    "turn 512 over 100K + fresh 8K": [(100 * K, 512), (0, 8 * K)],
    "turn 4096 over 32K + fresh 16K": [(32 * K, 4096), (0, 16 * K)],
    "8 turns of 256 over 4K-200K": [
        (p * K, 256) for p in (4, 8, 16, 32, 64, 100, 150, 200)
    ],
    "4 turns of 2048 over 64K + fresh 4K": [(64 * K, 2048)] * 4 + [(0, 4 * K)],
}


def prefill_steps(
    requests: list[tuple[int, int]], step_tokens: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per step, the requests' (sequence length, new tokens) as vLLM's
    builder sees them, the new tokens taken in order within the budget."""
    remaining = [(cached, new) for cached, new in requests]
    while remaining:
        seq, query, budget, left = [], [], step_tokens, []
        for cached, new in remaining:
            take = min(budget, new)
            if take > 0:
                seq.append(cached + take)
                query.append(take)
                budget -= take
            if new > take:
                left.append((cached + take, new - take))
        remaining = left
        yield np.array(seq), np.array(query)


FILL_DIVISOR = 8
LOGITS_BUDGET = 512 * 1024 * 1024 // 4  # elements


def key_counts(seq: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Each row's causal key count, written from the definition (row t of a
    request with S tokens, Q of them new, sees S - Q + t + 1 keys)."""
    return np.concatenate(
        [np.arange(s - q, s) + 1 for s, q in zip(seq, query, strict=True)]
    )


def chunks(seq: np.ndarray, query: np.ndarray) -> list[tuple[int, int, int]]:
    """The step's logits chunks as (first row, end row, key width)."""
    out: list[tuple[int, int, int]] = []
    row = start = 0
    while start < len(seq):
        end, rows, width = start, 0, 0
        while end < len(seq) and (rows + query[end]) * (width + seq[end]) <= (
            LOGITS_BUDGET
        ):
            rows, width, end = rows + query[end], width + seq[end], end + 1
        if end == start:  # one request alone over the budget
            rows, width, end = query[start], seq[start], start + 1
        per_slice = max(1, LOGITS_BUDGET // width)
        for first in range(0, rows, per_slice):
            out.append((row + first, row + min(rows, first + per_slice), width))
        row, start = row + rows, end
    return out


def row_costs(seq: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Each row's key count, its fixed cost (the stage's ``ROW_COST_KEYS``)
    and its share of its chunk's -inf fill."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    costs = key_counts(seq, query) + rocm_cp_indexer_plan.ROW_COST_KEYS
    for first, end, width in chunks(seq, query):
        costs[first:end] += width // FILL_DIVISOR
    return costs


# An assignment maps (seq, query, tp) to each row's rank, or None (replicated).
Assign = Callable[[np.ndarray, np.ndarray, int], np.ndarray | None]


def by_row_count(seq: np.ndarray, query: np.ndarray, tp: int) -> np.ndarray:
    rows = int(query.sum())
    return np.minimum(np.arange(rows) * tp // rows, tp - 1)


def mirrored_stripes(seq: np.ndarray, query: np.ndarray, tp: int) -> np.ndarray:
    """The previous design: mirrored stripes over the row index, shrunk for
    a prefill too short for two rounds."""
    rows = int(query.sum())
    stripe = min(STRIPE, max(1, rows // (2 * tp)))
    phase = (np.arange(rows) // stripe) % (2 * tp)
    return np.where(phase < tp, phase, 2 * tp - 1 - phase)


def exact_cost_cut(seq: np.ndarray, query: np.ndarray, tp: int) -> np.ndarray:
    """Contiguous ranges cut where the cumulative cost crosses k/tp."""
    cumulative = np.cumsum(row_costs(seq, query))
    cuts = np.searchsorted(cumulative, np.arange(1, tp) * cumulative[-1] / tp)
    return np.searchsorted(cuts, np.arange(len(cumulative)), side="right")


def shipped(minimum: bool) -> Assign:
    """The stage's own planner, from the applied vLLM tree."""

    def assign(seq: np.ndarray, query: np.ndarray, tp: int) -> np.ndarray | None:
        import torch

        from vllm.v1.attention.ops import rocm_cp_indexer_plan

        saved = rocm_cp_indexer_plan.split_repays
        if not minimum:
            rocm_cp_indexer_plan.split_repays = lambda *_: True
        step_chunks = [
            SimpleNamespace(token_start=a, token_end=b, total_seq_lens=int(w))
            for a, b, w in chunks(seq, query)
        ]
        try:
            split = rocm_cp_indexer_plan.plan_cp_indexer_split(
                tp,
                0,
                torch.from_numpy(seq),
                torch.from_numpy(query),
                1,
                step_chunks,
                # This model has no per-call term to score it with.
                call_cost_keys=0,
            )
        finally:
            rocm_cp_indexer_plan.split_repays = saved
        if split is None:
            return None
        return np.repeat(np.arange(tp), split.sizes)

    return assign


BUILDER = "shipped, through vLLM's builder"


def through_the_builder(
    requests: list[tuple[int, int]], tp: int, step_tokens: int
) -> float:
    """max/mean rank cost as vLLM's own metadata builder plans and chunks
    each step (the ROCm platform emulated, the split on, the shipped
    minimum); the costs from the definitions and the builder's chunks."""
    import pytest
    import torch

    from scripts.harness import indexer_batch
    from scripts.harness.rocm_platform import emulate_rocm
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    longest = max(cached + new for cached, new in requests)
    worst = mean = 0.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ROCM_USE_AITER_CP_INDEXER", "1")
        # This model has no per-call term or wave to score it with.
        mp.setattr(rocm_cp_indexer_plan, "CALL_COST_KEYS", 0)
        mp.setattr(rocm_cp_indexer_plan, "WAVE_ROWS_PER_CU", 0)
        # gfx942: the logits fill their chunk, as the costs here assume.
        with emulate_rocm("gfx942"):
            config = indexer_batch.make_vllm_config(
                tp_size=tp, max_len=longest + 64, max_tokens=step_tokens
            )
            builder = indexer_batch.make_builder(config, mp)
            for seq, query in prefill_steps(requests, step_tokens):
                step = [(int(s - q), int(q)) for s, q in zip(seq, query, strict=True)]
                batch = indexer_batch.build_batch(
                    builder, step, torch_context=True, write_cache=False, heads=4
                )
                prefill = batch.metadata.prefill  # type: ignore[attr-defined]
                if prefill is None or prefill.cp_split is None:
                    continue
                first = prefill.cp_split.bounds[0]  # after the decodes
                costs = torch.from_numpy(
                    key_counts(seq, query) + rocm_cp_indexer_plan.ROW_COST_KEYS
                ).to(torch.float64)
                for chunk in prefill.chunks:
                    rows = slice(chunk.token_start - first, chunk.token_end - first)
                    costs[rows] += chunk.total_seq_lens // FILL_DIVISOR
                bounds = prefill.cp_split.bounds
                per_rank = [
                    float(costs[a - first : b - first].sum())
                    for a, b in zip(bounds, bounds[1:], strict=False)
                ]
                worst += max(per_rank)
                mean += sum(per_rank) / tp
    return worst / mean if mean else float("nan")


ASSIGNMENTS: dict[str, Assign] = {
    "equal row counts": by_row_count,
    "mirrored stripes 512 (previous)": mirrored_stripes,
    "exact cost cut": exact_cost_cut,
    "shipped cut": shipped(minimum=False),
}


def balance(
    requests: list[tuple[int, int]], tp: int, step_tokens: int, assign: Assign
) -> tuple[float, float]:
    """(sum of max / sum of mean rank cost over the split steps, the share
    of the workload's cost in steps that split)."""
    worst = mean = split_cost = total = 0.0
    for seq, query in prefill_steps(requests, step_tokens):
        costs = row_costs(seq, query)
        total += costs.sum()
        owners = assign(seq, query, tp) if len(costs) >= tp else None
        if owners is None:
            continue
        per_rank = np.bincount(owners, weights=costs, minlength=tp)
        worst += per_rank.max()
        mean += per_rank.sum() / tp
        split_cost += costs.sum()
    return (worst / mean if mean else float("nan")), split_cost / total


def main() -> int:
    args = parse_args(__doc__)
    names = [*ASSIGNMENTS, BUILDER]
    as_shipped = shipped(minimum=True)
    rows = []
    for step_tokens in STEP_TOKENS:
        for tp in TPS:
            for label, requests in WORKLOADS.items():
                values = {
                    name: balance(requests, tp, step_tokens, fn)[0]
                    for name, fn in ASSIGNMENTS.items()
                }
                values[BUILDER] = through_the_builder(requests, tp, step_tokens)
                split_share = balance(requests, tp, step_tokens, as_shipped)[1]
                rows.append((step_tokens, tp, label, values, split_share))

    lines = [
        "# CP indexer: per-rank cost balance of the row assignment",
        "",
        "max/mean rank cost, summed over the prefill steps of a workload "
        "(1.00 = perfect), as modelled: the measured balance on a GPU is in "
        "cp_indexer_host_bench.md. A row costs its causal key count, the "
        "planner's fixed row cost (`ROW_COST_KEYS`) and 1/8 of its logits "
        "chunk's key width (gfx942's -inf fill, an estimate); a call's fixed "
        "cost and its floor are not counted, so the planner runs without "
        "them (`CALL_COST_KEYS` and `WAVE_ROWS_PER_CU` 0; the measured bench "
        "counts both). vLLM's chunked "
        "prefill is walked step by step. Goal: <= 1.05 on every workload, "
        'tp 2-8. "work split" is the share of the workload\'s cost in steps '
        "the shipped planner splits (the others its gate, `split_repays`, "
        "leaves replicated). The last column runs vLLM's own indexer "
        "metadata builder on each step (ROCm emulated as gfx942, the split on, the "
        'shipped gate: steps it refuses are left out; "replicated": every '
        "step is) and weighs its plan with the builder's own chunks.",
        "",
        f"Command: `nox -s cost-model` (python {platform.python_version()}, "
        "pure arithmetic, no GPU; the shipped columns run the applied tree's "
        "planner).",
        "",
        "| step tokens | tp | workload | "
        + " | ".join(names)
        + " | work split (shipped) |",
        "|---|---|---|" + "---:|" * (len(names) + 1),
    ]
    for step_tokens, tp, label, values, split_share in rows:
        cells = " | ".join(
            "replicated" if np.isnan(values[n]) else f"{values[n]:.3f}" for n in names
        )
        lines.append(
            f"| {step_tokens} | {tp} | {label} | {cells} | {split_share:.0%} |"
        )
    lines += ["", "Worst case over the workloads:", ""]
    for name in names:
        split = [r for r in rows if not np.isnan(r[3][name])]
        where = max(split, key=lambda r: r[3][name])
        worst = where[3][name]
        lines.append(
            f"- {name}: {worst:.3f} ({where[2]}, tp {where[1]}, {where[0]}-token steps)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cp_indexer_cost_model.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TPS), 1, figsize=(16, 13), sharex=True)
    for ax, tp in zip(axes, TPS, strict=True):
        picked = [r for r in rows if r[0] == 16384 and r[1] == tp]
        x = np.arange(len(picked))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(x + i * width, [r[3][name] for r in picked], width, label=name)
        ax.axhline(1.05, color="k", linestyle="--", linewidth=0.8)
        ax.set_title(f"tp {tp}, 16K-token prefill steps")
        ax.set_ylim(0.95, 3.0)
        ax.set_ylabel("max / mean rank cost")
        ax.set_xticks(x + 0.4, [r[2] for r in picked], rotation=60, ha="right")
    axes[0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out / "cp_indexer_cost_model.png", dpi=100)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
