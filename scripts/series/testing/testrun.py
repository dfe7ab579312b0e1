# SPDX-License-Identifier: Apache-2.0
"""Which pytest runs test a stage's tree, and running them side by side.

Each test runs where a repetition could catch something new. The top tree
runs every stage's tests, the base tests and every PR's tests (a PR alone
is tested by ``export``'s CPU view); the base tree runs the base tests; a
lower stage's tree runs that stage's tests only when a later stage patches
one of its files (``check`` refuses a later stage that changes its lines).
The regression selection of vLLM's tests joins each of those runs. The
compile matrix's kernel groups compile on a tree whose own stage patches a
file that launches them (each group's ``KERNEL_CALLERS``); the top tree
also compiles those of the stages whose trees are not tested with it."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.contract import (
    COMPILE_SUMMARY_ENV,
    CPU_ENV,
    OWN_TREE_RAN_ENV,
    PLUGIN_FILES_ENV,
    tree_env,
)
from scripts.series.layout import results_dir
from scripts.series.stages.patchfile import read_patch
from scripts.series.stages.trees import stage_tree
from scripts.series.testing.results import RunTiming, Tally, junit_suite, read_junit

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
    series: Series,
    stage_id: str,
    tree: Path,
    base_tree: Path,
    *,
    tested: Sequence[str],
) -> list[PytestRun]:
    """The pytest runs for one stage's tree ("base" or a stage id), tested
    together with the trees ``tested`` (the highest of them runs as the
    top)."""
    applied = series.stages_upto(stage_id)
    stages = ["base", *(s.id for s in applied)]
    out = results_dir(series) / stage_id
    tree_ids = ["base", *(s.id for s in series.stages)]
    is_top = bool(applied) and stage_id == max(tested, key=tree_ids.index)
    env = tree_env(tree, stages, base_tree)
    if not applied or is_top:
        own_dirs = ["base", *(s.tests for s in applied)]
        ran = [
            s.tests
            for s in applied[:-1]
            if s.id in tested and _patched_later(series, s)
        ]
        env[OWN_TREE_RAN_ENV] = ",".join(ran)
    else:
        own_dirs = [s.tests for s in applied[-1:] if _patched_later(series, s)]
    runs = []
    if own_dirs:
        runs.append(_series_run(series, stage_id, tree, own_dirs, env, out))
    pr_tests = [path for stage in applied for path in stage.vllm_tests]
    if is_top and pr_tests:
        runs.append(pr_tests_run(stage_id, tree, pr_tests, out / "pr-tests.xml"))
    compiled = [s for s in applied if s.id == stage_id or is_top and s.id not in tested]
    groups = sorted({g for stage in compiled for g in _compile_groups(series, stage)})
    if groups:
        # Triton's compiler, not its interpreter: the kernels are compiled
        # for the AMD targets (tests/gfx_compile/conftest.py).
        runs.append(
            PytestRun(
                stage_id,
                "compile matrix (gfx950, gfx942)",
                (
                    *(str(group) for group in groups),
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


def _series_run(
    series: Series,
    stage_id: str,
    tree: Path,
    own_dirs: list[str],
    env: dict[str, str],
    out: Path,
) -> PytestRun:
    """The series' test folders and vLLM's own tests in one run: each run
    imports torch and vLLM anew, and that import costs more than the balance
    of smaller runs side by side gains (the regression selection's run was
    mostly that import)."""
    folders = [str(series.tests_dir / folder) for folder in own_dirs]
    label = "series tests (" + ", ".join(own_dirs) + ")"
    regression_args: list[str] = []
    if series.regression:
        regression_args, plugin_files = _regression_args(series, tree)
        env = {**env, PLUGIN_FILES_ENV: json.dumps(plugin_files)}
        names = ", ".join(s.name for s in series.regression)
        label += f" and vLLM tests ({names})"
    return PytestRun(
        stage_id,
        label,
        (*folders, *regression_args, f"--junitxml={out / 'series.xml'}", "-q"),
        env,
        out / "series.xml",
    )


def _stage_files(series: Series, stage: Stage) -> set[str]:
    return set(read_patch(series.patch_file(stage)).files) | set(stage.overlays)


def _patched_later(series: Series, stage: Stage) -> bool:
    """Whether a later stage patches a file ``stage`` patches."""
    later = series.stages[series.stages.index(stage) + 1 :]
    files = set(read_patch(series.patch_file(stage)).files)
    return any(files & set(read_patch(series.patch_file(s)).files) for s in later)


def kernel_callers(module: Path) -> tuple[str, ...]:
    """A compile-matrix module's ``KERNEL_CALLERS``: the vLLM files whose
    code launches the kernels it compiles (read without importing it)."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and [
            getattr(t, "id", None) for t in node.targets
        ] == ["KERNEL_CALLERS"]:
            return tuple(ast.literal_eval(node.value))
    raise SeriesError(f"{module} names no KERNEL_CALLERS (a tuple of vLLM files)")


def _compile_groups(series: Series, stage: Stage) -> list[Path]:
    """The compile-matrix modules whose kernels ``stage`` patches a caller of."""
    folder = series.tests_dir / COMPILE_TESTS
    files = _stage_files(series, stage)
    return [
        module
        for module in sorted(folder.glob("test_*.py"))
        if files & set(kernel_callers(module))
    ]


def _regression_args(
    series: Series, tree: Path
) -> tuple[list[str], dict[str, list[str]]]:
    """vLLM's own tests in the tree's series run: their files, each suite's
    plugin (which applies to that suite's files only: it finds them under
    its module name in PLUGIN_FILES_ENV) and a --confcutdir that keeps
    vLLM's conftest files out, as they ran before (--noconftest, in a run
    of their own). vLLM's ``tests.*`` helpers import from the tree, which
    tests/conftest.py puts first on sys.path."""
    files = [tree / p for s in series.regression for p in s.paths]
    # pytest loads no conftest.py found upwards from the cut (the tree's
    # tests/conftest.py among them), but would load one in a folder below
    # it or beside it: there must be none.
    cut = files[0].parent
    for file in files:
        for folder in file.parents:
            if folder == tree or not folder.is_relative_to(tree):
                break
            if folder not in cut.parents and (folder / "conftest.py").is_file():
                raise SeriesError(
                    f"{folder / 'conftest.py'} would be loaded with vLLM's tests "
                    f"{file.relative_to(tree)} (cut at {cut}); they run without "
                    "vLLM's conftest files"
                )
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
    args = [
        f"--confcutdir={cut}",
        *(arg for plugin in plugins for arg in ("-p", plugin)),
        *(str(f) for f in files),
    ]
    return args, plugin_files


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
    extra: Sequence[str] = (),
) -> TestResults:
    """Run the tooling tests (if asked) and each stage's runs, one per CPU,
    the longest first by their last time."""
    base_tree = stage_tree(series, "base")
    runs: list[PytestRun] = []
    for stage_id in stage_ids:
        tree = stage_tree(series, stage_id)
        runs += stage_runs(series, stage_id, tree, base_tree, tested=stage_ids)
        # The summary reads it: none from an earlier run.
        (results_dir(series) / stage_id / COMPILE_SUMMARY).unlink(missing_ok=True)
    # With no results yet (a fresh clone), the longest runs lead: the
    # tooling tests, then the top tree's.
    runs = [*(tooling_runs(series) if tooling else []), *reversed(runs)]
    started = time.monotonic()
    order = sorted(runs, key=_last_duration, reverse=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        tallies = list(
            pool.map(lambda run: _run_one(run, python, extra, series.root), order)
        )
    wall_s = time.monotonic() - started
    print(f"{len(runs)} pytest runs took {wall_s:.0f} s")
    # A tree with no run of its own keeps its row (its tests ran on the top).
    names = ["tooling"] if tooling else []
    rows: dict[str, Tally] = {row: Tally() for row in [*names, *stage_ids]}
    for run, tally in zip(order, tallies, strict=True):
        rows[run.row].add(tally)
    return TestResults(list(rows.items()), len(runs), wall_s)
