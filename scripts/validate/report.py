# SPDX-License-Identifier: Apache-2.0
"""The report of a validation run (report.md and one plot per ISL in its
output folder): each variant against the stage's baseline (its first
variant), per ISL, metric and concurrency, beside the PR text's figures
where it has tables of them, then each variant's KV cache capacity (from its
server log) and accuracy (from the lm_eval results). Only results that pass
their checks count."""

from __future__ import annotations

import csv
import json
import platform
import re
import sys
from collections import defaultdict
from pathlib import Path

METRICS = {
    "output_throughput": ("Output throughput (tok/s)", True),  # higher is better
    "mean_ttft_ms": ("Mean TTFT (ms)", False),
    "mean_tpot_ms": ("Mean TPOT (ms)", False),
}
_PR_FIGURES = Path(__file__).parent


def pr_figures(
    stage: str,
) -> dict[tuple[str, int, str, int], tuple[float, float, str]]:
    """{(variant, isl, metric, conc): (baseline, variant, the PR's delta)}
    from the PR text's tables (pr_figures_<stage>.tsv); empty without any."""
    path = _PR_FIGURES / f"pr_figures_{stage}.tsv"
    if not path.exists():
        return {}
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return {
        (r["config"], int(r["isl"]), r["metric"], int(r["conc"])): (
            float(r["before"]),
            float(r["after"]),
            r["delta"],
        )
        for r in csv.DictReader(lines, delimiter="\t")
    }


# vLLM logs its KV cache capacity once at start-up (v1/core/kv_cache_utils.py).
_KV_CACHE = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_cache_tokens(folder: Path) -> int | None:
    """The KV cache capacity in tokens from a variant's server log."""
    log = folder / "server.log"
    found = _KV_CACHE.search(log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1).replace(",", "")) if found else None


# sglang's run_eval prints its result as "Score: 0.xxx"
# (sgl-project/sglang python/sglang/test/run_eval.py, commit 01e58e4f, line
# ~310) and writes no file the kit can name, so its score is read from the
# output the kit keeps (eval-<i>-<task>.log).
_RUN_EVAL_SCORE = re.compile(r"^Score: ([0-9.]+)$", re.MULTILINE)


def accuracy(folder: Path) -> dict[str, float]:
    """{"task metric": value} from the lm_eval results files under a variant's
    folder (``--output_path``), standard errors left out, and from the kept
    output of each sglang run_eval ("gpqa score")."""
    scores: dict[str, float] = {}
    for path in sorted(folder.rglob("results_*.json")):
        for task, metrics in json.loads(path.read_text()).get("results", {}).items():
            for name, value in metrics.items():
                if isinstance(value, float | int) and "stderr" not in name:
                    scores[f"{task} {name}"] = float(value)
    for log in sorted(folder.glob("eval-*-*.log")):
        found = _RUN_EVAL_SCORE.findall(log.read_text(errors="replace"))
        if found:
            task = log.stem.split("-", 2)[2]
            scores[f"{task} score"] = float(found[-1])
    return scores


def _gain(base: float, value: float, higher_is_better: bool) -> str:
    """Signed so that positive is better, as the PR texts sign it."""
    change = (value - base) / base if higher_is_better else (base - value) / base
    return f"{change:+.2%}"


def _measured(summary: list[dict]) -> dict[str, dict[tuple[int, int], dict]]:
    """{variant: {(isl, conc): result}} for the points that pass their checks."""
    out: dict[str, dict[tuple[int, int], dict]] = defaultdict(dict)
    for o in summary:
        if o["isl"] is not None and not o["problems"] and o["result"]:
            out[o["variant"]][(o["isl"], o["conc"])] = o["result"]
    return out


def write_report(stage: str, out: Path, variants: list[str], command: str) -> Path:
    summary = json.loads((out / "summary.json").read_text())
    measured = _measured(summary)
    quoted = pr_figures(stage)
    baseline, others = variants[0], variants[1:]
    points = sorted({p for v in measured.values() for p in v})
    failed = [o for o in summary if o["problems"]]
    lines = [
        f"# Validation of stage {stage}",
        "",
        f"Host {platform.node()}, Python {sys.version.split()[0]}. Command: "
        f"`{command}`. Raw results beside this file; {len(failed)} run(s) "
        "failed a check and are left out (summary.json says why).",
        "",
        "Measured: this run. PR: quoted from the stage's PR text (MI355X, the "
        "PR's own runs), where it has tables. Δ is signed so positive is better.",
    ]
    for isl in sorted({isl for isl, _ in points}):
        for metric, (title, higher) in METRICS.items():
            header = ["conc", f"{baseline}"]
            for name in others:
                header += [name, "Δ"]
                if quoted:
                    header += [f"PR {baseline}", f"PR {name}", "PR Δ"]
            lines += ["", f"## ISL {isl}: {title}", ""]
            lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
            for conc in sorted(c for i, c in points if i == isl):
                base = measured[baseline].get((isl, conc), {}).get(metric)
                row = [str(conc), "-" if base is None else f"{base:.1f}"]
                for name in others:
                    value = measured[name].get((isl, conc), {}).get(metric)
                    row.append("-" if value is None else f"{value:.1f}")
                    if base is None or value is None:
                        row.append("-")
                    else:
                        row.append(_gain(base, value, higher))
                    if quoted:
                        pr = quoted.get((name, isl, metric, conc))
                        row += (
                            [f"{pr[0]:.1f}", f"{pr[1]:.1f}", pr[2]]
                            if pr
                            else ["-", "-", "-"]
                        )
                lines.append("| " + " | ".join(row) + " |")
        try:
            _plot(out / f"report_isl{isl}.png", isl, measured, quoted, variants)
            lines += ["", f"![ISL {isl}](report_isl{isl}.png)"]
        except ImportError:
            lines += ["", "(No plot: matplotlib is not installed.)"]
    lines += ["", "## KV cache and accuracy", ""]
    lines += [
        "| what | " + " | ".join(variants) + " |",
        "|---|" + "---:|" * len(variants),
    ]
    kv = [kv_cache_tokens(out / name) for name in variants]
    lines.append(
        "| KV cache (tokens) | "
        + " | ".join("-" if t is None else f"{t:,}" for t in kv)
        + " |"
    )
    scores = [accuracy(out / name) for name in variants]
    for key in sorted({k for s in scores for k in s}):
        cells = ["-" if key not in s else f"{s[key]:.4f}" for s in scores]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _plot(path: Path, isl: int, measured, quoted, variants: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4))
    for ax, (metric, (title, _)) in zip(axes, METRICS.items(), strict=True):
        for name in variants:
            got = sorted(
                (c, r[metric]) for (i, c), r in measured[name].items() if i == isl
            )
            if got:
                ax.plot(*zip(*got, strict=True), marker="o", label=f"{name} (measured)")
            # The PR's baseline ("before") is the same in each of its tables.
            pr = sorted(
                {
                    (c, v[1] if n == name else v[0])
                    for (n, i, m, c), v in quoted.items()
                    if i == isl and m == metric and (n == name or name == variants[0])
                }
            )
            if pr:
                ax.plot(*zip(*pr, strict=True), ls="--", label=f"{name} (PR text)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(f"ISL {isl}: {title}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
