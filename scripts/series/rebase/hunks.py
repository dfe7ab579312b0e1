# SPDX-License-Identifier: Apache-2.0
"""How a stage's hunks stand on a rebase target: before the merge (applies,
already upstream, needs a merge), after it (its added lines present, files
the target renamed or deleted), and which files git rerere resolved from a
recorded resolution."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.series.git import git, git_out
from scripts.series.layout import BASE_REF, REBASE_OLD_REF
from scripts.series.stages.patchfile import Hunk

_REPLAYED = re.compile(r"^(?:Staged|Resolved) '(.+)' using previous resolution\.$")


def replayed_paths(git_stderr: str) -> set[str]:
    """Paths whose conflicts git rerere resolved from recorded resolutions
    (git runs with LC_ALL=C, so its messages are stable)."""
    return {
        m.group(1)
        for line in git_stderr.splitlines()
        if (m := _REPLAYED.match(line.strip()))
    }


DELETED_ON_TARGET = "conflicted: the file is deleted on the target"


def moved_on_target(repo: Path, stages: int) -> dict[str, str | None]:
    """Files the target renamed (old path -> new) or deleted (-> None) since
    the pinned base (the root of the series' old commits)."""
    old_base = f"{REBASE_OLD_REF}~{stages}"
    out = git_out(
        repo, "diff", "-M", "--name-status", "--diff-filter=RD", old_base, BASE_REF
    )
    moved: dict[str, str | None] = {}
    for line in out.splitlines():
        status, *paths = line.split("\t")
        moved[paths[0]] = paths[1] if status.startswith("R") else None
    return moved


def hunk_on(repo: Path, hunk: Hunk) -> str:
    """How one hunk stands on the tree before any merge."""

    def applies(*flags: str) -> bool:
        check = git(
            repo, "apply", "--check", *flags, "-", input=hunk.text.encode(), check=False
        )
        return check.returncode == 0

    if applies():
        return "applied cleanly"
    if applies("--reverse"):
        return "already upstream"
    return "needs a merge"


def added_lines_present(path: Path, hunk: Hunk) -> bool:
    """Whether each run of the hunk's added lines is in the merged file."""
    if not path.exists():
        return False
    content = path.read_text(encoding="utf-8", errors="replace")
    runs: list[list[str]] = [[]]
    for line in hunk.text.splitlines(keepends=True)[1:]:
        if line.startswith("+") and not line.startswith("+++"):
            runs[-1].append(line[1:])
        elif runs[-1]:
            runs.append([])
    return all("".join(run) in content for run in runs if run)
