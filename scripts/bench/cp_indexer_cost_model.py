# SPDX-License-Identifier: Apache-2.0
"""Cost model of the CP indexer's row assignment (stage 0001).

A prefill row costs about its causal key count (ke - ks). For realistic
prefill steps this computes each TP rank's cost under several assignments and
reports max/mean rank cost (1.00 is perfect balance), summed over the steps of
a shape as sum(max) / sum(mean): ranks meet at the merge once per step.

Shapes: ISL 8K, 50K, 128K and 200K; one prompt, or four packed prompts; tp 2,
4 and 8; vLLM's chunked prefill of 8K or 16K tokens per step, and inside a
step the indexer chunker's 512 MiB logits budget (VLLM_SPARSE_INDEXER_MAX_
LOGITS_MB), which the per-chunk assignments stripe within.

The "shipped" column runs the stage's own code (CPIndexerSplit from the
applied tree, with the default stripe size). Run it with
``nox -s cost-model``; it writes docs/cp_indexer_cost_model.{md,png}.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator

import numpy as np

from scripts.bench.common import parse_args

LOGITS_BUDGET = 512 * 1024 * 1024 // 4  # fp32 logits per chunk
ISLS = (8192, 51200, 131072, 204800)
TPS = (2, 4, 8)
STEP_TOKENS = (8192, 16384)
PACKED = 4


def prefill_steps(prompts: list[int], step_tokens: int) -> Iterator[np.ndarray]:
    """Per step, the key count of each prefill row (one row per new token),
    the prompts packed into steps of ``step_tokens`` in order."""
    remaining = [(length, 0) for length in prompts]
    while remaining:
        rows, budget, left = [], step_tokens, []
        for length, done in remaining:
            take = min(budget, length - done)
            if take > 0:
                rows.append(np.arange(done, done + take) + 1)
                budget -= take
            if done + take < length:
                left.append((length, done + take))
        remaining = left
        yield np.concatenate(rows)


def chunk_bounds(costs: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges of the indexer chunks of one step. Like vLLM's chunker it
    keeps rows x keys within the logits budget; the keys are taken as the
    step's longest row (exact for one prompt, an upper bound when packed)."""
    rows = max(1, LOGITS_BUDGET // int(costs.max()))
    return [(s, min(s + rows, len(costs))) for s in range(0, len(costs), rows)]


Assign = Callable[[np.ndarray, int], np.ndarray]


def contiguous(costs: np.ndarray, tp: int) -> np.ndarray:
    return np.minimum(np.arange(len(costs)) * tp // len(costs), tp - 1)


def striped(stripe: int, per_chunk: bool) -> Assign:
    def assign(costs: np.ndarray, tp: int) -> np.ndarray:
        if not per_chunk:
            return (np.arange(len(costs)) // stripe) % tp
        owners = np.empty(len(costs), dtype=np.int64)
        for start, end in chunk_bounds(costs):
            owners[start:end] = (np.arange(end - start) // stripe) % tp
        return owners

    return assign


def mirrored(stripe: int) -> Assign:
    def assign(costs: np.ndarray, tp: int) -> np.ndarray:
        phase = (np.arange(len(costs)) // stripe) % (2 * tp)
        return np.where(phase < tp, phase, 2 * tp - 1 - phase)

    return assign


def cost_aware(costs: np.ndarray, tp: int) -> np.ndarray:
    """Contiguous ranges cut where the cumulative cost crosses k/tp."""
    cumulative = np.cumsum(costs)
    cuts = np.searchsorted(cumulative, np.arange(1, tp) * cumulative[-1] / tp)
    return np.searchsorted(cuts, np.arange(len(costs)), side="right")


def shipped(costs: np.ndarray, tp: int) -> np.ndarray:
    """The stage's own plan and assignment, from the applied vLLM tree."""
    import torch

    from vllm.v1.attention.ops.rocm_cp_indexer import CPIndexerSplit

    split = CPIndexerSplit.for_prefill(tp, 512, 0, len(costs))
    return split.owner(torch.arange(len(costs))).numpy()


ASSIGNMENTS: dict[str, Assign] = {
    "contiguous": contiguous,
    "striped 512 per chunk (seed)": striped(512, per_chunk=True),
    "striped 256": striped(256, per_chunk=False),
    "striped 512": striped(512, per_chunk=False),
    "striped 1024": striped(1024, per_chunk=False),
    "mirrored 256": mirrored(256),
    "mirrored 512": mirrored(512),
    "mirrored 1024": mirrored(1024),
    "cost-aware": cost_aware,
    "shipped (mirrored 512, shrinking)": shipped,
}


def imbalance(prompts: list[int], tp: int, step_tokens: int, assign: Assign) -> float:
    worst = mean = 0.0
    for costs in prefill_steps(prompts, step_tokens):
        per_rank = np.bincount(assign(costs, tp), weights=costs, minlength=tp)
        worst += per_rank.max()
        mean += per_rank.sum() / tp
    return worst / mean


def shapes() -> Iterator[tuple[str, int, list[int]]]:
    for isl in ISLS:
        yield f"{isl // 1024}K", isl, [isl]
        yield f"{PACKED}x{isl // 1024}K", isl, [isl] * PACKED


def main() -> int:
    args = parse_args(__doc__)

    rows = []
    for step_tokens in STEP_TOKENS:
        for tp in TPS:
            for label, isl, prompts in shapes():
                values = {
                    name: imbalance(prompts, tp, step_tokens, fn)
                    for name, fn in ASSIGNMENTS.items()
                }
                rows.append((step_tokens, tp, label, isl, values))

    names = list(ASSIGNMENTS)
    lines = [
        "# CP indexer: per-rank cost balance of the row assignment",
        "",
        "max/mean rank cost, summed over the prefill steps of a shape "
        "(1.00 = perfect). A row costs its causal key count. Goal: <= 1.05 "
        "for every shape at ISL >= 50K, tp 2-8.",
        "",
        f"Command: `nox -s cost-model` (python {platform.python_version()}, "
        "pure arithmetic, no GPU).",
        "",
        "| step tokens | tp | shape | " + " | ".join(names) + " |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    for step_tokens, tp, label, _, values in rows:
        cells = " | ".join(f"{values[n]:.3f}" for n in names)
        lines.append(f"| {step_tokens} | {tp} | {label} | {cells} |")
    worst = {n: max(v[n] for *_, isl, v in rows if isl >= 51200) for n in names}
    lines += ["", "Worst case at ISL >= 50K:", ""]
    lines += [f"- {n}: {worst[n]:.3f}" for n in names]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cp_indexer_cost_model.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TPS), figsize=(16, 5), sharey=True)
    for ax, tp in zip(axes, TPS, strict=True):
        picked = [r for r in rows if r[0] == 16384 and r[1] == tp]
        x = np.arange(len(picked))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(x + i * width, [r[4][name] for r in picked], width, label=name)
        ax.set_xticks(x + 0.4, [r[2] for r in picked], rotation=45)
        ax.axhline(1.05, color="k", linestyle="--", linewidth=0.8)
        ax.set_title(f"tp {tp}, 16K-token prefill steps")
        ax.set_ylim(0.95, 2.0)
    axes[0].set_ylabel("max / mean rank cost")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out / "cp_indexer_cost_model.png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
