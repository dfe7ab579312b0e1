# SPDX-License-Identifier: Apache-2.0
"""The results of pytest runs: JUnit XML counted into tallies, and the
summary and timing tables made from them."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RunTiming:
    """One pytest run's wall time and CPU time (its children included)."""

    run: str
    wall_s: float
    cpu_s: float


@dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    skip_reasons: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    timings: list[RunTiming] = field(default_factory=list)
    first_error: str = ""  # the first failure's message, one line

    def add(self, other: Tally) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.skip_reasons.update(other.skip_reasons)
        self.failures += other.failures
        self.timings += other.timings
        self.first_error = self.first_error or other.first_error


def format_timings(rows: list[tuple[str, Tally]], wall_s: float) -> str:
    """The runs this invocation ran, slowest first: wall and CPU seconds."""
    timings = sorted(
        (t for _, tally in rows for t in tally.timings), key=lambda t: -t.wall_s
    )
    lines = ["| pytest run | wall s | CPU s |", "|---|---:|---:|"]
    lines += [f"| {t.run} | {t.wall_s:.1f} | {t.cpu_s:.1f} |" for t in timings]
    cpu = sum(t.cpu_s for t in timings)
    lines.append(
        f"| all ({len(timings)} runs, side by side) | {wall_s:.1f} | {cpu:.1f} |"
    )
    return "\n".join(lines)


def read_junit(path: Path, modules: Sequence[str] = ()) -> Tally:
    """Count a JUnit XML file (only the tests of ``modules``, dotted, if
    given); a missing or broken file counts as a failure."""
    tally = Tally()
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        tally.failed = 1
        tally.failures.append(f"{path.name}: no results ({exc})")
        return tally
    for case in root.iter("testcase"):
        classname = case.get("classname") or ""
        # A module that fails to collect is a case named after the module.
        module = classname or case.get("name") or ""
        if modules and not any(
            module == m or module.startswith(m + ".") for m in modules
        ):
            continue
        name = f"{classname}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            tally.failed += 1
            tally.failures.append(name)
            if not tally.first_error:
                tally.first_error = _one_line(problem)
        elif (skip := case.find("skipped")) is not None:
            tally.skipped += 1
            reason = (skip.get("message") or "no reason given").strip()
            tally.skip_reasons[reason.removeprefix("Skipped: ")] += 1
        else:
            tally.passed += 1
    # Collection errors appear as <testsuite errors=N> without test cases.
    for suite in [] if modules else root.iter("testsuite"):
        errors = int(suite.get("errors", 0))
        listed = sum(1 for c in suite.iter("testcase") if c.find("error") is not None)
        if errors > listed:
            tally.failed += errors - listed
            tally.failures.append(f"{path.name}: {errors - listed} collection error(s)")
    return tally


def _one_line(problem: ET.Element) -> str:
    """A failure's cause in one line: pytest's last ``E`` line (the raised
    error, also for a module that fails to collect), else its message."""
    lines = (problem.text or "").splitlines()
    raised = [line[1:].strip() for line in lines if line.startswith("E ")]
    if raised and raised[-1]:
        return raised[-1]
    message = (problem.get("message") or "").strip().splitlines()
    return message[-1] if message else ""


def format_summary(
    rows: list[tuple[str, Tally]], compiled: Sequence[tuple[str, list[dict]]] = ()
) -> str:
    """A Markdown table: stage, passed, failed, skipped, and the skip
    reasons; then, per tree, the kernels compiled for the AMD targets."""
    lines = [
        "| stage | passed | failed | skipped | skip reasons |",
        "|---|---:|---:|---:|---|",
    ]
    for stage, tally in rows:
        reasons = "; ".join(f"{n}× {r}" for r, n in tally.skip_reasons.most_common())
        lines.append(
            f"| {stage} | {tally.passed} | {tally.failed} | {tally.skipped} | "
            f"{reasons or '-'} |"
        )
    if any(kernels for _, kernels in compiled):
        lines += [
            "",
            "Triton kernels compiled for AMD targets (tests/gfx_compile):",
            "",
            "| tree | target | kernel | variants compiled | failed |",
            "|---|---|---|---:|---:|",
        ]
        for stage, kernels in compiled:
            for k in kernels:
                lines.append(
                    f"| {stage} | {k['target']} | {k['kernel']} | {k['compiled']} | "
                    f"{k['failed']} |"
                )
    failures = [f for _, tally in rows for f in tally.failures]
    if failures:
        lines += ["", "Failed:"] + [f"- {f}" for f in failures]
    return "\n".join(lines)


def format_verdict(
    label: str,
    rows: list[tuple[str, Tally]],
    compiled: Sequence[tuple[str, list[dict]]],
    details: Path,
    most: int = 10,
) -> str:
    """What the console ends with, in one screen: the failures (at most
    ``most``), the kernels compiled in one line, where the details are, and
    last the verdict per stage."""
    lines = []
    failures = [f for _, tally in rows for f in tally.failures]
    if failures:
        lines += ["Failed:", *(f"- {f[:200]}" for f in failures[:most])]
        if len(failures) > most:
            lines.append(f"- ... and {len(failures) - most} more")
        lines.append("")
    kernels = [k for _, each in compiled for k in each]
    if kernels:
        targets = "/".join(sorted({k["target"] for k in kernels}))
        broken = sum(k["failed"] for k in kernels)
        lines.append(
            f"Triton kernels compiled for {targets}: "
            f"{sum(k['compiled'] for k in kernels)} variants of {len(kernels)} "
            f"kernel-targets, {broken} failed."
        )
    lines += [
        "Skip reasons, each kernel and each failure (per-run times in "
        "timings.md beside it):",
        f"  {details}",
        "",
        f"{label}:",
        "| stage | verdict | passed | failed | skipped |",
        "|---|---|---:|---:|---:|",
    ]
    for stage, tally in rows:
        verdict = "FAILED" if tally.failed else "ok"
        counts = f"{tally.passed} | {tally.failed} | {tally.skipped}"
        lines.append(f"| {stage} | {verdict} | {counts} |")
    failed = [stage for stage, tally in rows if tally.failed]
    lines.append(
        f"FAILED: {', '.join(failed)}" if failed else
        "Every test passed or skipped with a reason."
    )  # fmt: skip
    return "\n".join(lines)


def junit_suite(path: Path) -> dict[str, str]:
    """The attributes of a JUnit file's (first) test suite: its time,
    timestamp and counts; empty if there is no readable file."""
    try:
        return dict(next(ET.parse(path).getroot().iter("testsuite")).attrib)
    except (OSError, ET.ParseError, StopIteration):
        return {}
