# SPDX-License-Identifier: Apache-2.0
"""Which pytest runs test a stage's tree, and the summary of their results.

A stage's tree holds the base plus stages 1..N. It runs the base tests, the
stage's own tests, the regression selection of vLLM's own tests and the
tests the stage adds to vLLM's tests/ (its PR's, with plain pytest); the top
stage's tree (the one users serve) runs every stage's tests, so a later stage
that breaks an earlier one is caught there. The runs are independent
processes and run side by side (one per CPU by default), the longest first
by their last result. Results come back as JUnit XML, one file per run, and
are summed into one table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import REPO_ROOT, Series, Stage
from scripts.series.contract import (
    COMPILE_SUMMARY_ENV,
    CPU_ENV,
    PLUGIN_FILES_ENV,
    tree_env,
)
from scripts.series.git import git
from scripts.series.layout import results_dir
from scripts.series.stages.trees import stage_tree

# Tests that compile the stages' Triton kernels for the AMD targets, run on
# every stage's tree in a process of their own, and what they write.
COMPILE_TESTS = "gfx_compile"
COMPILE_SUMMARY = "gfx-compile.json"


@dataclass(frozen=True)
class PytestRun:
    """One pytest invocation: arguments (after ``python -m pytest``), env,
    where it writes its JUnit XML and the folder it runs in (None: the
    project). ``row`` is its line in the summary."""

    row: str
    label: str
    args: tuple[str, ...]
    env: dict[str, str]
    junit: Path
    cwd: Path | None = None


def stage_runs(
    series: Series, stage_id: str, tree: Path, base_tree: Path
) -> list[PytestRun]:
    """The pytest runs for one stage's tree ("base" or a stage id)."""
    applied = series.stages_upto(stage_id)
    stages = ["base", *(s.id for s in applied)]
    out = results_dir(series) / stage_id
    is_top = bool(applied) and applied[-1] == series.stages[-1]
    tested = applied if is_top else applied[-1:]
    own_dirs = ["base", *(s.tests for s in tested)]
    env = tree_env(tree, stages, base_tree)
    # Every folder in one run: each run imports torch and vLLM anew, and that
    # import costs more than the balance of smaller runs side by side gains.
    runs = [
        PytestRun(
            stage_id,
            "series tests (" + ", ".join(own_dirs) + ")",
            (
                *(str(series.tests_dir / folder) for folder in own_dirs),
                f"--junitxml={out / 'series.xml'}",
                "-q",
            ),
            env,
            out / "series.xml",
        )
    ]
    if series.regression:
        # vLLM's own tests, every suite in one run (each run imports vLLM
        # anew). A suite's plugin applies to that suite's files only: the
        # plugin finds them under its module name in PLUGIN_FILES_ENV.
        junit = out / "vllm-tests.xml"
        plugins = sorted({s.plugin for s in series.regression if s.plugin})
        plugin_files = {
            plugin: [
                str(tree / p)
                for s in series.regression
                if s.plugin == plugin
                for p in s.paths
            ]
            for plugin in plugins
        }
        runs.append(
            PytestRun(
                stage_id,
                "vLLM tests (" + ", ".join(s.name for s in series.regression) + ")",
                (
                    "--noconftest",
                    f"--rootdir={tree}",
                    "-p",
                    "no:cacheprovider",
                    *(arg for plugin in plugins for arg in ("-p", plugin)),
                    f"--junitxml={junit}",
                    "-q",
                    *(str(tree / p) for s in series.regression for p in s.paths),
                ),
                # vLLM's tests import `tests.*` helpers from the tree root;
                # the plugins live in our scripts/harness/.
                {
                    **env,
                    "PYTHONPATH": f"{tree}:{series.root}",
                    PLUGIN_FILES_ENV: json.dumps(plugin_files),
                },
                junit,
            )
        )
    if pr_tests := [path for stage in tested for path in stage.vllm_tests]:
        runs.append(pr_tests_run(stage_id, tree, pr_tests, out / "pr-tests.xml"))
    compile_tests = series.tests_dir / COMPILE_TESTS
    if applied and compile_tests.is_dir():
        # Triton's compiler, not its interpreter: the kernels are compiled
        # for the AMD targets (tests/gfx_compile/conftest.py).
        runs.append(
            PytestRun(
                stage_id,
                "compile matrix (gfx950, gfx942)",
                (
                    str(compile_tests),
                    f"--junitxml={out / 'gfx-compile.xml'}",
                    "-q",
                ),
                {
                    **env,
                    "TRITON_INTERPRET": "0",
                    COMPILE_SUMMARY_ENV: str(out / COMPILE_SUMMARY),
                },
                out / "gfx-compile.xml",
            )
        )
    return runs


def compile_summary(series: Series, stage_id: str) -> list[dict]:
    """Per kernel and target, the variants a tree's compile matrix compiled
    and failed (empty when it did not run)."""
    path = results_dir(series) / stage_id / COMPILE_SUMMARY
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def pr_tests_run(row: str, tree: Path, paths: Sequence[str], junit: Path) -> PytestRun:
    """The tests stages add to vLLM's tests/, as a vLLM checkout runs them:
    plain pytest from the tree's root with vLLM's own conftest, nothing of
    this project on the path."""
    return PytestRun(
        row,
        "PR tests (vLLM's tests/, plain pytest)",
        ("-p", "no:cacheprovider", f"--junitxml={junit}", "-q", *paths),
        {**CPU_ENV, "PYTHONPATH": ""},
        junit,
        cwd=tree,
    )


def run_pr_tests(
    python: str, tree: Path, paths: Sequence[str], junit: Path, log: Path
) -> Tally:
    """Run ``pr_tests_run`` now, its output to ``log``, with ``python``; its
    results."""
    junit.unlink(missing_ok=True)
    run = pr_tests_run("check", tree, paths, junit)
    with log.open("w") as out:
        subprocess.run(
            [python, "-m", "pytest", *run.args],
            env={**os.environ, **run.env},
            cwd=tree,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    return read_junit(junit)


def tooling_runs(series: Series) -> list[PytestRun]:
    """The tool's tests, in one run (they import no vLLM)."""
    out = results_dir(series) / "tooling"
    return [
        PytestRun(
            "tooling",
            "tooling tests",
            (
                str(series.tests_dir / "tooling"),
                f"--junitxml={out / 'tooling.xml'}",
                "-q",
            ),
            {},
            out / "tooling.xml",
        )
    ]


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


def junit_suite(path: Path) -> dict[str, str]:
    """The attributes of a JUnit file's (first) test suite: its time,
    timestamp and counts; empty if there is no readable file."""
    try:
        return dict(next(ET.parse(path).getroot().iter("testsuite")).attrib)
    except (OSError, ET.ParseError, StopIteration):
        return {}


def _last_duration(run: PytestRun) -> float:
    """Seconds the run took last time (unknown: infinite, so it starts first)."""
    try:
        return float(junit_suite(run.junit).get("time", "inf"))
    except ValueError:
        return math.inf


_PRINT_LOCK = threading.Lock()


def _run_one(run: PytestRun, python: str, extra: Sequence[str], cwd: Path) -> Tally:
    """Run one pytest run; its output is printed whole when it ends."""
    run.junit.parent.mkdir(parents=True, exist_ok=True)
    run.junit.unlink(missing_ok=True)
    if summary := run.env.get(COMPILE_SUMMARY_ENV):
        Path(summary).unlink(missing_ok=True)
    started = time.monotonic()
    process = subprocess.Popen(
        [python, "-m", "pytest", *run.args, *extra],
        env={**os.environ, **run.env},
        cwd=run.cwd or cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert process.stdout is not None
    output = process.stdout.read()
    # wait4: the run's own CPU time, its forked ranks included.
    _, status, usage = os.wait4(process.pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    tally = read_junit(run.junit)
    tally.timings.append(
        RunTiming(
            f"{run.row}: {run.label}",
            time.monotonic() - started,
            usage.ru_utime + usage.ru_stime,
        )
    )
    # 0: passed, 1: some failed, 5: nothing collected; the rest is pytest
    # itself failing (usage, internal error, interrupted).
    if returncode not in (0, 1, 5):
        tally.failed += 1
        tally.failures.append(f"{run.row} {run.label}: pytest exited {returncode}")
    with _PRINT_LOCK:
        print(f"=== {run.row}: {run.label}\n{output}", flush=True)
    return tally


@dataclass
class TestResults:
    """One tally per summary row, in order."""

    rows: list[tuple[str, Tally]]
    runs: int
    wall_s: float


def run_tests(
    series: Series,
    stage_ids: Sequence[str],
    *,
    tooling: bool,
    python: str = sys.executable,
    jobs: int = 0,
    extra: Sequence[str] = (),
) -> TestResults:
    """Run the tooling tests (if asked) and each stage's runs, ``jobs`` at a
    time (0: one per CPU), the longest first by their last time."""
    base_tree = stage_tree(series, "base")
    runs = tooling_runs(series) if tooling else []
    for stage_id in stage_ids:
        runs += stage_runs(series, stage_id, stage_tree(series, stage_id), base_tree)
    started = time.monotonic()
    # Reversed first: with no results yet, the top tree's runs lead.
    order = sorted(reversed(runs), key=_last_duration, reverse=True)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        tallies = list(
            pool.map(lambda run: _run_one(run, python, extra, series.root), order)
        )
    wall_s = time.monotonic() - started
    print(f"{len(runs)} pytest runs took {wall_s:.0f} s")
    rows: dict[str, Tally] = {run.row: Tally() for run in runs}
    for run, tally in zip(order, tallies, strict=True):
        rows[run.row].add(tally)
    return TestResults(list(rows.items()), len(runs), wall_s)


def check_log(repo: Path, kind: str) -> Path:
    """The output of the last ``kind`` test run ("tests" or "pr-tests") on a
    rebase repo's tree."""
    return repo.parent / f"check-{kind}.log"


def probe_paths(stage: Stage) -> tuple[str, ...]:
    return stage.upstream_probe or (stage.tests,)


# Imports the modules with vLLM's compiled extension stood in, as the tests do.
_IMPORT_CHECK = """
import importlib, sys, traceback
from scripts.harness import compiled_stub
compiled_stub.install()
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
        sys.exit(1)
"""


@dataclass(frozen=True)
class TreeTester:
    """Tests (the series' pytest files) and imports on a checkout of a rebase
    repo's HEAD, with ``python`` (which has the test dependencies)."""

    python: str

    def __post_init__(self) -> None:
        if shutil.which(self.python) is None:
            raise SeriesError(f"--test-python {self.python}: no such Python")

    def pytest(
        self, series: Series, repo: Path, stages: list[str], paths: Sequence[str]
    ) -> Tally:
        """``paths`` (under tests/) on the tree, claimed to hold ``stages``.
        Its output goes to ``check_log(repo, "tests")``, not to the terminal:
        a probe is expected to fail, and the report says what it needs to."""
        junit = repo.parent / "check.xml"
        junit.unlink(missing_ok=True)
        log_file = check_log(repo, "tests")
        with self._checkout(repo) as tree, log_file.open("w") as log:
            subprocess.run(
                [
                    self.python,
                    "-m",
                    "pytest",
                    *(str(series.tests_dir / p) for p in paths),
                    f"--junitxml={junit}",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                ],
                env=self._env(tree, stages),
                cwd=series.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
            )
        tally = read_junit(junit)
        # Paths in the checkout, which is gone after this, as the tree's own.
        tally.first_error = tally.first_error.replace(f"{tree}/", "")
        return tally

    def pr_tests(self, repo: Path, paths: Sequence[str]) -> Tally:
        """``paths`` (tests the stages add to vLLM's tests/) on the tree,
        with plain pytest from its root."""
        with self._checkout(repo) as tree:
            return run_pr_tests(
                self.python,
                tree,
                paths,
                repo.parent / "check-pr.xml",
                check_log(repo, "pr-tests"),
            )

    def imports(
        self, series: Series, repo: Path, stages: list[str], modules: Sequence[str]
    ) -> str | None:
        """The first of ``modules`` that fails to import, with the error."""
        with self._checkout(repo) as tree:
            done = subprocess.run(
                [self.python, "-c", _IMPORT_CHECK, *modules],
                # The stand-ins live with the tool, whatever project it serves.
                env={**self._env(tree, stages), "PYTHONPATH": f"{tree}:{REPO_ROOT}"},
                cwd=series.root,
                capture_output=True,
                text=True,
                check=False,
            )
        if done.returncode == 0:
            return None
        lines = (done.stdout or done.stderr).strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"

    @staticmethod
    def _env(tree: Path, stages: list[str]) -> dict[str, str]:
        return {**os.environ, **tree_env(tree, stages, tree), "PYTHONPATH": str(tree)}

    @staticmethod
    @contextmanager
    def _checkout(repo: Path) -> Iterator[Path]:
        tree = repo.parent / "check"
        shutil.rmtree(tree, ignore_errors=True)
        git(repo, "worktree", "prune")
        git(repo, "worktree", "add", "-q", "--detach", str(tree), "HEAD")
        try:
            yield tree
        finally:
            git(repo, "worktree", "remove", "--force", str(tree))
