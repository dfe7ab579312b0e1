# SPDX-License-Identifier: Apache-2.0
"""Tests and imports on a checkout of a rebase repo's HEAD: what a rebase
checks each stage with on its target."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import REPO_ROOT, Series, Stage
from scripts.series.contract import tree_env
from scripts.series.export.pr_views import CPU, run_view
from scripts.series.git import git
from scripts.series.testing.results import Tally, read_junit


def check_log(repo: Path, kind: str) -> Path:
    """The output of the last ``kind`` test run ("tests" or "pr-tests") on a
    rebase repo's tree."""
    return repo.parent / f"check-{kind}.log"


def probe_paths(stage: Stage) -> tuple[str, ...]:
    return stage.upstream_probe or (stage.tests,)


@dataclass(frozen=True)
class TreeTester:
    """Tests (the series' pytest files) and imports on a checkout of a rebase
    repo's HEAD, with ``python`` (which has the test dependencies)."""

    python: str

    def __post_init__(self) -> None:
        if shutil.which(self.python) is None:
            raise SeriesError(f"--test-python {self.python}: no such Python")

    def pytest(
        self,
        series: Series,
        repo: Path,
        stages: list[str],
        paths: Sequence[str],
        first_failure: bool = False,
    ) -> Tally:
        """``paths`` (under tests/) on the tree, claimed to hold ``stages``,
        stopping at the ``first_failure`` if asked. Its output goes to
        ``check_log(repo, "tests")``, not to the terminal: a probe is
        expected to fail, and the report says what it needs to."""
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
                    *(["-x"] if first_failure else []),
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
        with self._checkout(repo, "check-pr") as tree:
            junit, log = repo.parent / "check-pr.xml", check_log(repo, "pr-tests")
            return run_view(CPU, self.python, tree, paths, junit, log)

    def imports(
        self, series: Series, repo: Path, stages: list[str], modules: Sequence[str]
    ) -> str | None:
        """The first of ``modules`` that fails to import, with the error."""
        with self._checkout(repo) as tree:
            done = subprocess.run(
                # On the platform the tests emulate (ROCm, AITER's stand-in).
                [self.python, "-m", "scripts.harness.import_check", *modules],
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
        # No bytecode in the project's tests/: the rebase ends on a branch
        # made from a project with nothing uncommitted.
        return {
            **os.environ,
            **tree_env(tree, stages, tree),
            "PYTHONPATH": str(tree),
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    @staticmethod
    @contextmanager
    def _checkout(repo: Path, name: str = "check") -> Iterator[Path]:
        """A checkout of HEAD beside ``repo``; two may be out at once (the
        stage's tests and its PR's), made and removed one at a time."""
        tree = repo.parent / name
        with _WORKTREES:
            shutil.rmtree(tree, ignore_errors=True)
            git(repo, "worktree", "prune")
            git(repo, "worktree", "add", "-q", "--detach", str(tree), "HEAD")
        try:
            yield tree
        finally:
            with _WORKTREES:
                git(repo, "worktree", "remove", "--force", str(tree))


_WORKTREES = threading.Lock()
