# SPDX-License-Identifier: Apache-2.0
"""Wall and CPU time of ``nox -s apply-and-test``, warm and cold, per pytest run.

Warm: ``nox -s apply-and-test`` again in this checkout, which must have run
it before (its venv and trees exist); every test runs every time.
Cold: a fresh ``git clone`` of HEAD in a temporary folder, then
``nox -s apply-and-test`` there (a new venv, the sdist downloaded, nothing
under build/), as the README's quick start does; the clone is deleted
after. Caches outside the clone (pip's, Triton's in ~/.triton) stay.
Each run's per-run times are the tool's own (``timings.md`` beside the
summary: wall time, and CPU time with the run's children). Writes
``docs/test_suite_time.{md,json}``.

    python3 -m scripts.bench.test_suite_time [--warm 3] [--cold 3] [--out docs]

Run it on an otherwise idle machine: the figures are that machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.series.config import load_series
from scripts.series.layout import results_dir

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TOTAL = "all"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def read_timings(path: Path) -> dict[str, tuple[float, float]]:
    """A ``timings.md`` table: pytest run -> (wall s, CPU s); the whole
    invocation under ``TOTAL``."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].replace(".", "", 1).isdigit():
            continue
        name = TOTAL if cells[0].startswith("all (") else cells[0]
        rows[name] = (float(cells[1]), float(cells[2]))
    return rows


def one_run(project: Path, posargs: list[str], log: Path) -> dict:
    """``nox -s apply-and-test`` in ``project``: its wall time and the tool's
    per-run times."""
    series = load_series(project / "patches" / "series.toml")
    timings = results_dir(series) / "timings.md"
    timings.unlink(missing_ok=True)
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "nox", "-s", "apply-and-test", *posargs],
            cwd=project,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"nox -s apply-and-test failed in {project}; see {log}")
    return {"nox_wall_s": round(wall, 1), "runs": read_timings(timings)}


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def write_report(result: dict, out: Path) -> None:
    (out / "test_suite_time.json").write_text(json.dumps(result, indent=2) + "\n")
    kinds = [k for k in ("warm", "cold") if result[k]]
    names = sorted(
        {n for k in kinds for r in result[k] for n in r["runs"] if n != TOTAL},
        key=lambda n: (
            -max(r["runs"].get(n, (0, 0))[1] for k in kinds for r in result[k])
        ),
    )
    lines = [
        "# `nox -s apply-and-test`: wall and CPU time per pytest run",
        "",
        f"Measured {result['date']} on {result['machine']}, commit "
        f"{result['commit']}, with `{result['command']}`. Warm: "
        "`nox -s apply-and-test` in a checkout that ran it before; "
        "cold: a fresh clone's first `nox -s apply-and-test` (new venv, the "
        "sdist and vLLM's wheel fetched, nothing under build/). What lives "
        "outside the clone stays: pip's cache, and Triton's kernel cache "
        "(~/.triton), keyed by the clone's path, which is the same for every "
        "cold run: the first compiles the kernels the others reuse. Per run: "
        "the tool's own figures (wall; CPU with the run's children), each of "
        "the runs in order, seconds.",
        "",
        "| | " + " | ".join(f"{k} wall s | {k} CPU s" for k in kinds) + " |",
        "|---|" + "---:|---:|" * len(kinds),
    ]

    def cells(kind: str, pick) -> str:
        walls = ", ".join(f"{pick(r)[0]:.1f}" for r in result[kind])
        cpus = ", ".join(f"{pick(r)[1]:.1f}" for r in result[kind])
        return f"{walls} | {cpus}"

    whole = []
    for kind in kinds:
        walls = [r["nox_wall_s"] for r in result[kind]]
        shown = ", ".join(f"{w:.1f}" for w in walls)
        whole.append(f"{shown} (median {_median(walls)}) | -")
    lines.append("| **`nox -s apply-and-test`** | " + " | ".join(whole) + " |")
    lines.append(
        "| all pytest runs, side by side | "
        + " | ".join(cells(k, lambda r: r["runs"][TOTAL]) for k in kinds)
        + " |"
    )
    for name in names:
        lines.append(
            f"| {name} | "
            + " | ".join(
                cells(k, lambda r, n=name: r["runs"].get(n, (0, 0))) for k in kinds
            )
            + " |"
        )
    (out / "test_suite_time.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args()
    if shutil.which("git") is None:
        raise SystemExit("git is needed (the cold runs clone HEAD)")
    if _git("status", "--porcelain", "--untracked-files=no"):
        raise SystemExit(
            "uncommitted changes: commit them first (the cold runs clone HEAD, "
            "the warm runs use this checkout; both must be the same code)"
        )
    logs = Path(tempfile.mkdtemp(prefix="dsa-suite-time-"))
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "machine": (
            f"{os.cpu_count()} CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} "
            f"GiB, {platform.machine()}, Python {platform.python_version()}"
        ),
        "command": "python3 -m scripts.bench.test_suite_time "
        f"--warm {args.warm} --cold {args.cold}",
        "warm": [],
        "cold": [],
    }
    for i in range(args.warm):
        result["warm"].append(one_run(ROOT, [], logs / f"warm{i}.log"))
        print(f"warm {i + 1}: {result['warm'][-1]['nox_wall_s']} s", flush=True)
    for i in range(args.cold):
        clone = logs / "clone"
        shutil.rmtree(clone, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        try:
            result["cold"].append(one_run(clone, [], logs / f"cold{i}.log"))
        finally:
            shutil.rmtree(clone, ignore_errors=True)
        print(f"cold {i + 1}: {result['cold'][-1]['nox_wall_s']} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(result, args.out)
    print(f"written to {args.out / 'test_suite_time.md'} (logs: {logs})")


if __name__ == "__main__":
    main()
