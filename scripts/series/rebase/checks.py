# SPDX-License-Identifier: Apache-2.0
"""A rebased stage's checks on the target: its Python files compile, and
with a test Python its vLLM modules import and its tests (the series' and
its PR's) pass. Each check says what it runs, and a failure names the
project's own files its output goes through."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.series.config import Series, Stage
from scripts.series.git import git, git_out
from scripts.series.rebase.state import RebaseState
from scripts.series.rebase.tree_tester import TreeTester, check_log
from scripts.series.testing.results import Tally

# The line the rebase rehearsal's upstream commits add to Python files.
UPSTREAM_NOTE = "# An upstream change of the rebase rehearsal.\n"


def holds_the_applied_stages(repo: Path, old_base: str, old: str) -> bool:
    """Whether HEAD of the rehearsal's rebase repo holds, in every file the
    stages up to ``old`` change (from ``old_base``), what ``old`` (their
    commit on the pinned release) holds, give or take the rehearsal's
    UPSTREAM_NOTE lines: then its code is what apply-and-test tests."""
    note = UPSTREAM_NOTE.encode()
    for path in git_out(repo, "diff", "--name-only", old_base, old).splitlines():
        before = git(repo, "show", f"{old}:{path}", check=False)
        after = git(repo, "show", f"HEAD:{path}", check=False)
        kept = b"".join(
            line for line in after.stdout.splitlines(keepends=True) if line != note
        )
        if (before.returncode, before.stdout) != (after.returncode, kept):
            return False
    return True


def claimed_stages(series: Series, state: RebaseState) -> list[str]:
    """What a test tree of the rebase repo's HEAD holds, for the tests: the
    base, the stages kept so far and the one being rebased."""
    kept = [s.id for s in series.stages[: state.next] if s.id in state.commits]
    return ["base", *kept, series.stages[state.next].id]


def package_modules(package: str, paths: list[str]) -> list[str]:
    """The modules of ``package`` among ``paths`` (files of the tree)."""
    return [
        p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for p in paths
        if p.startswith(f"{package}/") and p.endswith(".py")
    ]


def stage_problem(
    series: Series,
    repo: Path,
    stage: Stage,
    state: RebaseState,
    tester: TreeTester | None,
    tests: bool = True,
) -> str | None:
    """What is wrong with the stage's commit on the target, if anything: a
    Python file it touches that does not compile; with a test Python
    (unless not ``tests``), a module it touches that does not import, or a
    failing test of its own."""
    touched = git_out(repo, "diff", "--name-only", "HEAD^", "HEAD").split()
    python = [p for p in touched if p.endswith(".py") and (repo / p).is_file()]
    for path in python:
        try:
            compile((repo / path).read_bytes(), path, "exec")
        except SyntaxError as exc:
            return f"{path}, line {exc.lineno}: does not compile: {exc.msg}"
    if tester is None:
        return None
    if not tests:
        _progress(
            stage,
            "its files hold the applied stages plus the rehearsal's comment "
            "lines: apply-and-test imports and tests that code",
        )
        return None
    claimed = claimed_stages(series, state)
    modules = package_modules(series.base.name, python)
    _progress(stage, f"importing the {len(modules)} vLLM module(s) it touches")
    if failure := tester.imports(series, repo, claimed, modules):
        return f"does not import: {failure}"
    runs: dict[str, Callable[[], Tally]] = {}
    if (series.tests_dir / stage.tests).is_dir():  # config names the folder
        _progress(stage, f"its tests (tests/{stage.tests}/)")
        runs["its tests"] = lambda: tester.pytest(series, repo, claimed, [stage.tests])
    if stage.vllm_tests:
        _progress(stage, f"its PR's tests ({', '.join(stage.vllm_tests)})")
        runs["its PR's tests"] = lambda: tester.pr_tests(repo, stage.vllm_tests)
    # Side by side, one per CPU, each in a checkout of its own.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = {what: pool.submit(run) for what, run in runs.items()}
    logs = {"its tests": "tests", "its PR's tests": "pr-tests"}
    tallies = [(w, f.result(), check_log(repo, logs[w])) for w, f in done.items()]
    for what, tally, log in tallies:
        if tally.failed or not tally.passed:
            failed = ", ".join(tally.failures[:5]) or "no test passed"
            first = f"; first error: {tally.first_error}" if tally.first_error else ""
            ours = _project_files_in(series, log)
            where = (
                "; its tracebacks go through the project's "
                + ", ".join(ours)
                + " (a break there is fixed in the project, not the work repo)"
                if ours
                else ""
            )
            return (
                f"{what} fail on the target ({tally.failed} failed: {failed}"
                f"{first}; output in {log}){where}"
            )
    return None


def _progress(stage: Stage, what: str) -> None:
    print(f"  checking stage {stage.id} on the target: {what}", flush=True)


def _project_files_in(series: Series, log: Path) -> list[str]:
    """The project's own files (its test harness and tests, not the vLLM
    tree) named in a check's output, in order of first mention."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    root = re.escape(str(series.root))
    found = re.findall(rf"(?:{root}/)?((?:scripts|tests)/[\w/.-]+\.py):\d+", text)
    return list(dict.fromkeys(p for p in found if (series.root / p).is_file()))
