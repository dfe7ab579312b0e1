# SPDX-License-Identifier: Apache-2.0
"""Per-stage test trees: a git worktree of the work repo at each stage's commit.

Tests of stage N run against the base plus stages 1..N, importable from this
tree, while the work tree itself stays where the user left it.
"""

from __future__ import annotations

from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series
from scripts.series.git import changed_files, git, rev_parse
from scripts.series.layout import stage_tree_dir, workdir
from scripts.series.stages.state import read_chain


def stage_tree(series: Series, stage_id: str) -> Path:
    """Return a clean tree at ``stage_id`` ("base" or a stage id)."""
    if stage_id != "base":
        series.stage(stage_id)  # an unknown id is an error of its own
    repo = workdir(series)
    chain = read_chain(series, repo)
    commit = chain.current_commit(stage_id)
    tree = stage_tree_dir(series, stage_id)
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        git(repo, "worktree", "prune")
        git(repo, "worktree", "add", "-q", "--detach", "--force", str(tree), commit)
        return tree
    if changed_files(tree):
        # The tests would run on those edits, not on the stage.
        raise SeriesError(
            f"test tree {tree} has edits (make them in the work tree, "
            f"{repo}); delete it to rebuild it"
        )
    if rev_parse(tree, "HEAD") != commit:
        git(tree, "checkout", "-q", "--detach", commit)
    return tree
