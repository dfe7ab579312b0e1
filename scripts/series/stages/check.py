# SPDX-License-Identifier: Apache-2.0
"""``check``: the patch files match a fresh export, and each hunk is glue.

A hunk in vLLM's files should only wire an overlay module in: at most
``HUNK_BUDGET`` changed lines (a line only re-indented under a new ``if`` is
not counted). A larger hunk needs an entry in its stage's ``large_hunks`` in
series.toml saying why; an entry that no longer names a large hunk is an
error too, so the list stays true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import GitBase, LargeHunk, Series, Stage
from scripts.series.git import changed_files, git, git_out, rev_parse
from scripts.series.layout import workdir
from scripts.series.stages.patchfile import Hunk, read_patch
from scripts.series.stages.refresh import (
    format_stage_patch,
    lines_added_by,
    overlay_bytes,
)
from scripts.series.stages.state import read_chain

HUNK_BUDGET = 15
# The branch users clone, CI tests and the image is built from.
MAIN_BRANCH = "main"
# The branches a vLLM git pin may live on: what rebase and its rehearsal make.
GIT_PIN_BRANCHES = ("rebase/", "rehearsal/")


def stale_files(series: Series) -> list[str]:
    """Committed patch/overlay files that differ from a fresh export."""
    repo = workdir(series)
    chain = read_chain(series, repo)
    if chain.current < len(chain.applied):
        ids = ", ".join(stage.id for stage, _ in chain.applied[chain.current :])
        raise SeriesError(
            f"stale stage(s) {ids}: their patch or overlays changed since the "
            "work tree was applied (`nox -s status` says so too); run "
            "`nox -s apply` to rebuild them, then check again"
        )
    if len(chain.applied) < len(series.stages):
        raise SeriesError(
            "the work tree is not at the last stage; run `nox -s apply` first"
        )
    if changed_files(repo) or rev_parse(repo, "HEAD") != chain.tip:
        raise SeriesError(
            f"{repo} has edits beyond the last stage; run `nox -s refresh` to keep them"
        )
    stale = []
    for stage, commit in chain.applied:
        patch = series.patch_file(stage)
        if patch.read_bytes() != format_stage_patch(series, repo, stage, commit):
            stale.append(str(patch.relative_to(series.root)))
        for overlay in stage.overlays:
            source = series.overlay_file(overlay)
            if source.read_bytes() != overlay_bytes(repo, commit, overlay):
                stale.append(str(source.relative_to(series.root)))
    return stale


def later_stage_edits(series: Series) -> list[str]:
    """A later stage that changes or removes lines an earlier stage adds
    (git blame on the lines each stage commit removes). The test runs rely
    on there being none: the base tests and the PR tests run only on the
    base and top trees, so an earlier stage's lines as its own PR has them
    would go untested."""
    repo = workdir(series)
    return edits_of_earlier_lines(repo, read_chain(series, repo).applied)


def edits_of_earlier_lines(
    repo: Path, applied: Sequence[tuple[Stage, str]]
) -> list[str]:
    """``later_stage_edits`` for the stage commits ``applied`` in ``repo``."""
    problems = []
    for index, (stage, commit) in enumerate(applied[1:], start=1):
        earlier = {c: s for s, c in applied[:index]}
        found = lines_added_by(repo, (f"{commit}^", commit), f"{commit}^", earlier)
        problems += [
            f"stage {stage.id} changes {len(lines)} line(s) of {path} that stage "
            f"{owner} adds; make that change in stage {owner} (the base "
            "tests and the PR tests run on the top tree only, so they would "
            f"not see stage {owner}'s lines as its own PR has them)"
            for (path, owner), lines in sorted(found.items())
        ]
    return problems


@dataclass(frozen=True)
class HunkSize:
    stage: Stage
    hunk: Hunk
    allowed: LargeHunk | None  # its large_hunks entry, if it has one

    @property
    def over_budget(self) -> bool:
        return self.hunk.changed > HUNK_BUDGET and self.allowed is None


def hunk_budget(series: Series) -> tuple[list[HunkSize], list[str]]:
    """Every hunk of every patch with its size, and the problems: hunks over
    the budget without a reason, and ``large_hunks`` entries naming none."""
    sizes: list[HunkSize] = []
    problems: list[str] = []
    for stage in series.stages:
        hunks = read_patch(series.patch_file(stage)).hunks
        entries = {(e.path, e.number): e for e in stage.large_hunks}
        for hunk in hunks:
            size = HunkSize(stage, hunk, entries.pop((hunk.path, hunk.number), None))
            sizes.append(size)
            if size.over_budget:
                problems.append(
                    f"stage {stage.id}: {hunk.path} hunk {hunk.number} changes "
                    f"{hunk.changed} lines (budget {HUNK_BUDGET}); move its logic "
                    "into an overlay module, or allow it in series.toml "
                    "(large_hunks, with a reason)"
                )
            elif size.allowed and hunk.changed <= HUNK_BUDGET:
                entries[(hunk.path, hunk.number)] = size.allowed
        for entry in entries.values():
            problems.append(
                f"stage {stage.id}: large_hunks names {entry.path} hunk "
                f"{entry.number}, which is not over the budget of {HUNK_BUDGET} "
                "lines (or no longer exists); remove the entry"
            )
    return sizes, problems


def format_hunk_sizes(sizes: list[HunkSize]) -> str:
    lines = []
    for size in sizes:
        hunk = size.hunk
        flag = ""
        if size.over_budget:
            flag = "  OVER BUDGET"
        elif size.allowed is not None:
            flag = f"  allowed: {size.allowed.reason}"
        moved = f", {hunk.reindented} re-indented" if hunk.reindented else ""
        lines.append(
            f"  {size.stage.id}  {hunk.path} hunk {hunk.number}: {hunk.changed:>2} "
            f"changed (+{hunk.added} -{hunk.removed}{moved}){flag}"
        )
    return "\n".join(lines)


def pin_problems(series: Series) -> list[str]:
    """A git pin anywhere in a git checkout but on the tool's own branches
    (``rebase/`` and ``rehearsal/``, which test against vLLM main): users
    install and build the image from main, which take a release, and CI
    checks a pull request on a detached merge commit, so only the branch's
    name can tell. A project that is no git checkout has no branch to tell
    by (every clone, CI's included, is one)."""
    base = series.base
    if not isinstance(base, GitBase):
        return []
    if git(series.root, "rev-parse", "--git-dir", check=False).returncode != 0:
        return []
    branch = git(series.root, "symbolic-ref", "--short", "-q", "HEAD", check=False)
    name = branch.stdout.decode().strip()
    if name.startswith(GIT_PIN_BRANCHES):
        return []
    head = name or "a detached HEAD (as CI checks out a pull request)"
    where = base.url or f"the folder {base.path}, on this machine only"
    series_file = (series.patches_dir / "series.toml").relative_to(series.root)
    pinned = git_out(
        series.root, "log", "-1", "--no-merges", "--format=%h", "-G", "^git = ",
        "--", str(series_file),
    )  # fmt: skip
    undo = f" (`git revert --no-edit {pinned}` undoes the commit that pinned it)"
    return [
        f"{head} pins a vLLM git commit ({where}, at {base.rev[:12]}), "
        "but install and the Dockerfile take a release: only the tool's "
        "rebase/ and rehearsal/ branches may pin a git commit, to test the "
        "series against vLLM main there; never merge them. If one was merged"
        f"{undo if pinned else ''}, adopt a release with `nox -s roll`, which "
        "rebases onto the newest one"
    ]
