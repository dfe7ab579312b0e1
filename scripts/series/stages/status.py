# SPDX-License-Identifier: Apache-2.0
"""Report which stages the work tree holds and whether it has other edits."""

from __future__ import annotations

from dataclasses import dataclass

from scripts.series.config import Series
from scripts.series.git import changed_files, git, rev_parse
from scripts.series.layout import carry_path, workdir
from scripts.series.stages.state import read_chain


@dataclass(frozen=True)
class StageStatus:
    id: str
    title: str
    # "applied", "above HEAD" (recorded, current, not in the tree now),
    # "stale" (inputs changed since), "not applied"
    state: str
    commit: str | None


@dataclass(frozen=True)
class TreeStatus:
    prepared: bool
    stages: tuple[StageStatus, ...]
    head_stage: str | None  # "base", a stage id, or None (not a stage commit)
    extra_commits: int
    edited_files: tuple[str, ...]


def tree_status(series: Series) -> TreeStatus:
    repo = workdir(series)
    if not (repo / ".git").exists():
        missing = tuple(
            StageStatus(s.id, s.title, "not applied", None) for s in series.stages
        )
        return TreeStatus(False, missing, None, 0, ())
    chain = read_chain(series, repo)
    head = rev_parse(repo, "HEAD")
    rows: list[StageStatus] = []
    head_stage = "base" if head == chain.base else None
    for index, stage in enumerate(series.stages):
        commit = chain.commit_of(stage.id)
        if commit is None:
            rows.append(StageStatus(stage.id, stage.title, "not applied", None))
            continue
        state = "applied" if index < chain.current else "stale"
        if head_stage is not None and state == "applied":
            state = "above HEAD"  # HEAD is an earlier stage (or the base)
        rows.append(StageStatus(stage.id, stage.title, state, commit))
        if commit == head:
            head_stage = stage.id
    extra = 0
    if head_stage is None:
        count = git(repo, "rev-list", "--count", f"{chain.tip}..HEAD", check=False)
        extra = int(count.stdout or 0)
    return TreeStatus(True, tuple(rows), head_stage, extra, tuple(changed_files(repo)))


def format_status(series: Series, status: TreeStatus) -> str:
    repo = workdir(series)
    if not status.prepared:
        return f"{repo}: not prepared (run `nox -s apply`)"
    lines = [f"{repo} (base {series.base.label})"]
    for row in status.stages:
        commit = row.commit[:12] if row.commit else "-"
        marker = " <- HEAD" if row.id == status.head_stage else ""
        lines.append(f"  {row.id}  {row.state:<11} {commit:<12}  {row.title}{marker}")
    if status.head_stage == "base":
        lines.append("  HEAD is at the base")
    elif status.head_stage is None:
        lines.append(f"  HEAD has {status.extra_commits} commit(s) beyond the stages")
    if carry_path(repo).exists():
        lines.append(
            "  a carried stage waits for its conflicts to be resolved: "
            "`nox -s apply -- --continue` or `--abort`"
        )
    if status.edited_files:
        lines.append(f"  uncommitted edits in {len(status.edited_files)} file(s):")
        lines += [f"    {path}" for path in status.edited_files[:20]]
    elif status.head_stage is not None:
        lines.append("  no edits beyond the stage at HEAD")
    return "\n".join(lines)
