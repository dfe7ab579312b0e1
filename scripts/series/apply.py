# SPDX-License-Identifier: Apache-2.0
"""Apply the stages onto the base: one commit per stage, zero fuzz.

Each stage's patch is applied exactly (``git apply``, no three-way merge, no
fuzz), its overlay modules are copied in, and one commit is made with the
patch's author, date, subject and body, so the commit id is the same on every
machine. A failure names the stage, the file and the hunk and leaves the tree
at the last good stage. Uncommitted edits are never overwritten.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.git import changed_files, commit_verbatim, git, rev_parse
from scripts.series.layout import SERIES_BRANCH, stage_tag
from scripts.series.patchfile import failing_hunk, read_patch
from scripts.series.prepare import prepare
from scripts.series.state import (
    Chain,
    fingerprint,
    in_progress_path,
    load_state,
    read_chain,
    save_state,
)


class StageApplyError(SeriesError):
    """A stage did not apply; the tree was left at the last good stage."""


def refuse_if_dirty(repo: Path) -> None:
    changed = changed_files(repo)
    if not changed:
        return
    shown = "\n  ".join(changed[:10]) + ("\n  ..." if len(changed) > 10 else "")
    raise SeriesError(
        f"{repo} has uncommitted edits; refusing to touch it:\n  {shown}\n"
        "To keep them as part of the top stage, run "
        "`python -m scripts.series refresh` (or `nox -s refresh`); to keep them "
        "aside, `git -C <tree> stash`; to drop them, `git -C <tree> checkout -- .`"
    )


def _recover_interrupted(repo: Path) -> None:
    """An apply was killed mid-stage: set its partial edits aside in a git
    stash (not deleted: anything made since is kept there too) and redo it."""
    marker = in_progress_path(repo)
    if not marker.exists():
        return
    stage_id = marker.read_text().strip()
    if changed_files(repo):
        git(
            repo,
            "stash",
            "push",
            "-q",
            "--include-untracked",
            "-m",
            f"dsa-series: interrupted apply of stage {stage_id}",
        )
        print(
            f"an earlier apply of stage {stage_id} was interrupted; its partial "
            f"edits are in `git -C {repo} stash list`; redoing it"
        )
    marker.unlink()


def _remove_untracked(repo: Path) -> None:
    for path in changed_files(repo):
        target = repo / path
        if target.is_file() or target.is_symlink():
            target.unlink()


def _refuse_foreign_head(repo: Path, chain: Chain) -> None:
    head = rev_parse(repo, "HEAD")
    ours = {chain.base} | {c for _, c in chain.applied}
    ours |= {r["commit"] for r in load_state(repo).values()}
    if head not in ours:
        raise SeriesError(
            f"{repo}: HEAD ({head and head[:12]}) is not a stage commit: it has "
            "commits on top of the series. Turn them into stages with "
            "`python -m scripts.series refresh`, or move them to another branch."
        )


def _apply_stage(series: Series, repo: Path, stage: Stage, parent: str) -> str:
    patch_path = series.patches_dir / stage.patch
    info = read_patch(patch_path)
    marker = in_progress_path(repo)
    marker.write_text(stage.id)
    check = git(repo, "apply", "--check", "--verbose", str(patch_path), check=False)
    if check.returncode != 0:
        marker.unlink()
        where = failing_hunk(info, check.stderr.decode(errors="replace"))
        raise StageApplyError(
            f"stage {stage.id} ({stage.title}): {stage.patch} does not apply: "
            f"{where}. The tree is left at the last good stage; rebase the stage "
            "onto it (see README, 'Changing a stage')."
        )
    git(repo, "apply", "--index", "--whitespace=nowarn", str(patch_path))
    for overlay in stage.overlays:
        source = series.overlay_file(overlay)
        target = repo / overlay
        if not source.is_file():
            _undo(repo, marker)
            raise StageApplyError(
                f"stage {stage.id}: overlay {overlay} is missing ({source} not found)"
            )
        if target.exists():
            _undo(repo, marker)
            raise StageApplyError(
                f"stage {stage.id}: overlay {overlay} would overwrite a file already "
                "in the tree; overlays add new modules, change existing ones in the "
                "patch"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    if stage.overlays:
        git(repo, "add", "-f", "--", *stage.overlays)
    commit = commit_verbatim(repo, info.message, info.author)
    git(repo, "tag", "-f", stage_tag(stage.id), commit)
    state = load_state(repo)
    state[stage.id] = {"commit": commit, "inputs": fingerprint(series, stage, parent)}
    save_state(repo, state)
    marker.unlink()
    return commit


def _undo(repo: Path, marker: Path) -> None:
    git(repo, "reset", "-q", "--hard", "HEAD")
    _remove_untracked(repo)
    marker.unlink(missing_ok=True)


def apply(
    series: Series,
    upto: str | None = None,
    *,
    offline: bool = False,
    quiet: bool = False,
) -> Path:
    """Bring the work repo to ``upto`` (default: the last stage); return it."""
    target = series.stages_upto(upto)
    repo = prepare(series, offline=offline, quiet=quiet)
    chain = read_chain(series, repo)
    _recover_interrupted(repo)
    refuse_if_dirty(repo)
    _refuse_foreign_head(repo, chain)

    keep = min(chain.current, len(target))
    start = chain.applied[keep - 1][1] if keep else chain.base
    if rev_parse(repo, "HEAD") != start or rev_parse(repo, SERIES_BRANCH) != start:
        git(repo, "checkout", "-q", "-B", SERIES_BRANCH, start)
    parent = start
    for stage in target[:keep]:
        if not quiet:
            print(f"stage {stage.id}: up to date")
    for stage in target[keep:]:
        parent = _apply_stage(series, repo, stage, parent)
        if not quiet:
            print(f"stage {stage.id}: applied ({stage.title}) as {parent[:12]}")
    return repo
