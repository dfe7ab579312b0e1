# SPDX-License-Identifier: Apache-2.0
"""Check exported PRs as a vLLM maintainer would take them (``export
--test-python``): each patch applied with plain ``git am`` onto a checkout of
the base, after the patches of the PRs it needs; its title and sign-off as
exported, and its message unchanged by an editor; the tests it adds to
vLLM's tests/ passing there with plain pytest.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series
from scripts.series.export import PullRequest
from scripts.series.git import git, git_out
from scripts.series.layout import workdir
from scripts.series.state import read_chain
from scripts.series.testrun import run_pr_tests


def _patches_in_order(pr: PullRequest, by_id: dict[str, PullRequest]) -> list[Path]:
    """The patches to apply for ``pr``: those it needs first, then its own."""
    needed = _patches_in_order(by_id[pr.needs], by_id) if pr.needs else []
    return [*needed, pr.patch]


def check_pr(
    series: Series, pr: PullRequest, by_id: dict[str, PullRequest], python: str
) -> str | None:
    """What a maintainer would find wrong with ``pr``, if anything."""
    repo = workdir(series)
    base = read_chain(series, repo).base
    with tempfile.TemporaryDirectory(prefix=f"pr-{pr.stage.id}-") as tmp:
        tree = Path(tmp) / "vllm"
        git(repo, "worktree", "prune")
        git(repo, "worktree", "add", "-q", "--detach", str(tree), base)
        try:
            for patch in _patches_in_order(pr, by_id):
                applied = git(tree, "am", "-q", str(patch), check=False)
                if applied.returncode != 0:
                    return (
                        f"{patch.name} does not apply with `git am` on "
                        f"{series.base.label}: "
                        + applied.stderr.decode(errors="replace").strip()
                    )
            subject, author, message = (
                git_out(tree, "log", "-1", f"--format={field}")
                for field in ("%s", "%an <%ae>", "%B")
            )
            wanted = git_out(repo, "log", "-1", "--format=%s", pr.commit)
            if subject != wanted:
                return (
                    f"`git am` changed its title to {subject!r} (exported: {wanted!r})"
                )
            if f"Signed-off-by: {author}" not in message:
                return f"the applied commit is not signed off by its author, {author}"
            # What an editor keeps of it (`git commit --amend`: comment lines
            # and surplus blank lines go).
            git(tree, "commit", "-q", "--amend", "--no-edit", "--cleanup=strip")
            if git_out(tree, "log", "-1", "--format=%B") != message:
                return "its commit message changes when edited (lines git strips)"
            if not pr.stage.vllm_tests:
                return None
            tally = run_pr_tests(
                python, tree, pr.stage.vllm_tests, Path(tmp) / "pr-tests.xml"
            )
        finally:
            git(repo, "worktree", "remove", "--force", str(tree))
    if tally.failed or not tally.passed:
        failed = ", ".join(tally.failures[:5]) or "no test passed"
        return f"its tests fail after `git am` ({tally.failed} failed: {failed})"
    return None


def check_prs(series: Series, prs: Sequence[PullRequest], python: str) -> None:
    """Raise SeriesError naming every PR that fails ``check_pr``."""
    if shutil.which(python) is None:
        raise SeriesError(f"--test-python {python}: no such Python")
    by_id = {pr.stage.id: pr for pr in prs}
    problems = [
        f"PR of stage {pr.stage.id}: {problem}"
        for pr in prs
        if (problem := check_pr(series, pr, by_id, python)) is not None
    ]
    if problems:
        raise SeriesError(
            "exported PRs fail the maintainer's check:\n" + "\n".join(problems)
        )
