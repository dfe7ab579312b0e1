# SPDX-License-Identifier: Apache-2.0
"""Apply the stages onto the base: one commit per stage, zero fuzz.

The commits are made in git's object store and recorded one by one; the
tree is checked out once (docs/guarantees.md: crash-safe, nothing lost)."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.git import (
    add_blob_to_index,
    changed_files,
    commit_tree,
    commit_verbatim,
    files_with_conflict_markers,
    git,
    git_out,
    rev_parse,
    untracked_files,
)
from scripts.series.layout import (
    SERIES_BRANCH,
    SERIES_REF,
    carry_path,
    git_file,
    stage_tag,
)
from scripts.series.stages.patchfile import failing_hunk, read_patch
from scripts.series.stages.prepare import prepare
from scripts.series.stages.state import (
    Chain,
    fingerprint,
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
    tree = shlex.quote(str(repo))
    drop = f"`git -C {tree} checkout -- .`"
    if untracked_files(repo):
        drop = f"`git -C {tree} checkout -- . && git -C {tree} clean -fd`"
    raise SeriesError(
        f"{repo} has uncommitted edits; refusing to touch it:\n  {shown}\n"
        "To keep them as part of the top stage, run "
        "`nox -s refresh`; to keep them "
        f"aside, `git -C {tree} stash --include-untracked`; to drop them, {drop}"
    )


def _record_stage(repo: Path, stage: Stage, commit: str, inputs: str) -> None:
    git(repo, "tag", "-f", stage_tag(stage.id), commit)
    state = load_state(repo)
    state[stage.id] = {"commit": commit, "inputs": inputs}
    save_state(repo, state)


def _remove_untracked(repo: Path) -> None:
    for path in changed_files(repo):
        target = repo / path
        if target.is_file() or target.is_symlink():
            target.unlink()


def _stage_commits(repo: Path, chain: Chain) -> set[str]:
    ours = {chain.base} | {c for _, c in chain.applied}
    return ours | {r["commit"] for r in load_state(repo).values()}


def refuse_foreign_branch(repo: Path, chain: Chain) -> None:
    """Refuse to move the series branch while it holds a commit that is not
    a stage's (made on it before HEAD was detached): moving it would leave
    that commit only in the reflog."""
    tip = rev_parse(repo, SERIES_REF)
    if tip is None or tip == rev_parse(repo, "HEAD"):
        return
    if tip not in _stage_commits(repo, chain):
        raise SeriesError(
            f"{repo}: the {SERIES_BRANCH} branch holds commits that are not "
            f"stages (tip {tip[:12]}) and HEAD is elsewhere; keep them on "
            f"another branch first (`git -C {repo} branch -m {SERIES_BRANCH} "
            "my-work`), then run again"
        )


def _refuse_foreign_head(repo: Path, chain: Chain) -> None:
    head = rev_parse(repo, "HEAD")
    if head not in _stage_commits(repo, chain):
        branch = git(repo, "symbolic-ref", "-q", "--short", "HEAD", check=False)
        tree = shlex.quote(str(repo))
        if branch.stdout.decode().strip() == SERIES_BRANCH:
            move = (
                f"keep them on a branch of their own and put {SERIES_BRANCH} back "
                f"on the stages: `git -C {tree} branch my-work && git -C {tree} "
                f"checkout -B {SERIES_BRANCH} {chain.tip[:12]}`"
            )
        else:
            move = (
                f"leave them where they are and check the stages out again: "
                f"`git -C {tree} checkout {SERIES_BRANCH}`"
            )
        raise SeriesError(
            f"{repo}: HEAD ({head and head[:12]}) is not a stage commit: it has "
            "commits on top of the series. Turn them into stages with "
            f"`nox -s refresh`, or {move}; then run again."
        )
    refuse_foreign_branch(repo, chain)


def _apply_stage(
    series: Series, repo: Path, stage: Stage, parent: str, *, carry: bool = False
) -> str:
    """Stage ``stage`` on ``parent`` as a commit in git's object store,
    recorded; the tree is not touched, unless the patch no longer applies
    and ``carry`` asks for a three-way merge in the tree."""
    patch_path = series.patch_file(stage)
    info = read_patch(patch_path)
    inputs = fingerprint(series, stage, parent)
    index = git_file(repo, "dsa-series-apply-index")
    try:
        git(repo, "read-tree", parent, index_file=index)
        applied = git(
            repo,
            "apply",
            "--cached",
            "--verbose",
            "--whitespace=nowarn",
            str(patch_path),
            index_file=index,
            check=False,
        )
        if applied.returncode == 0:
            _add_overlays(series, repo, stage, index)
            tree = git(repo, "write-tree", index_file=index).stdout.decode().strip()
    finally:
        index.unlink(missing_ok=True)
    if applied.returncode == 0:
        commit = commit_tree(repo, tree, parent, info.message, info.author)
        _record_stage(repo, stage, commit, inputs)
        return commit
    if not carry:
        where = failing_hunk(info, applied.stderr.decode(errors="replace"))
        raise StageApplyError(
            f"stage {stage.id} ({stage.title}): {stage.patch} does not apply: "
            f"{where}. The tree is left at the last good stage. To carry the "
            "stage onto it with a three-way merge (conflicts left to resolve), "
            "run `nox -s apply -- --carry` (docs/maintaining.md, 'Change a stage')."
        )
    _move_tree(repo, parent)
    _carry_stage(series, repo, stage, parent, inputs)
    _copy_overlays(series, repo, stage)
    commit = commit_verbatim(repo, info.message, info.author)
    _record_stage(repo, stage, commit, inputs)
    return commit


def _move_tree(repo: Path, commit: str) -> None:
    """The (clean) tree, on the series branch, at ``commit``."""
    if rev_parse(repo, "HEAD") != commit or rev_parse(repo, SERIES_REF) != commit:
        git(repo, "checkout", "-q", "-B", SERIES_BRANCH, commit)


def _carry_stage(
    series: Series, repo: Path, stage: Stage, parent: str, inputs: str
) -> None:
    """Apply the stage's patch with a three-way merge against the blobs it
    was made from; stop with the conflicts left in the tree."""
    merged = git(
        repo,
        "apply",
        "--3way",
        "--index",
        "--whitespace=nowarn",
        str(series.patch_file(stage)),
        check=False,
    )
    if merged.returncode == 0:
        print(
            f"stage {stage.id}: carried by a three-way merge; run `nox -s refresh` to "
            "write its patch file"
        )
        return
    unmerged = git_out(repo, "diff", "--name-only", "--diff-filter=U").split()
    if not unmerged:  # git could not even start the merge: nothing to resolve
        _undo(repo)
        reason = merged.stderr.decode(errors="replace").strip().splitlines()
        raise StageApplyError(
            f"stage {stage.id}: {stage.patch} cannot be carried by a three-way "
            f"merge ({reason[-1] if reason else 'git apply --3way failed'}); the "
            "tree is left at the last good stage"
        )
    carry_path(repo).write_text(
        json.dumps({"stage": stage.id, "parent": parent, "inputs": inputs})
    )
    raise SeriesError(
        f"stage {stage.id} ({stage.title}) carried with conflicts in "
        f"{', '.join(unmerged)} (in {repo}); resolve them, then run "
        "`nox -s apply -- --continue` (which commits the stage and goes on), or "
        "`nox -s apply -- --abort` to go back to the stage below"
    )


def _overlay_source(series: Series, stage: Stage, overlay: str) -> Path:
    source = series.overlay_file(overlay)
    if not source.is_file():
        raise StageApplyError(
            f"stage {stage.id}: overlay {overlay} is missing ({source} is not a file)"
        )
    return source


def _overlay_exists(stage: Stage, overlay: str) -> StageApplyError:
    return StageApplyError(
        f"stage {stage.id}: overlay {overlay} would overwrite a file already "
        "in the tree; overlays add new modules, change existing ones in the "
        "patch"
    )


def _add_overlays(series: Series, repo: Path, stage: Stage, index: Path) -> None:
    """Add the stage's overlays to the scratch ``index`` as plain files (as
    git add of a copy would: the path's attributes apply)."""
    for overlay in stage.overlays:
        source = _overlay_source(series, stage, overlay)
        if git(repo, "ls-files", "--", overlay, index_file=index).stdout:
            raise _overlay_exists(stage, overlay)
        blob = git_out(repo, "hash-object", "-w", f"--path={overlay}", str(source))
        add_blob_to_index(repo, overlay, blob, index)


def _copy_overlays(series: Series, repo: Path, stage: Stage) -> None:
    """Copy the stage's overlays into the tree of a carried stage (it holds
    the user's resolution: nothing is undone on a problem)."""
    for overlay in stage.overlays:
        source = _overlay_source(series, stage, overlay)
        target = repo / overlay
        if target.exists():
            raise _overlay_exists(stage, overlay)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    if stage.overlays:
        git(repo, "add", "-f", "--", *stage.overlays)


def _continue_carry(series: Series, repo: Path) -> str:
    """``--continue``: the carried stage, resolved, becomes its commit (its
    own message and author); its patch file is written by refresh."""
    record = json.loads(carry_path(repo).read_text())
    stage = series.stage(record["stage"])
    if leftover := files_with_conflict_markers(repo):
        raise SeriesError(
            f"conflict markers are still in: {', '.join(leftover)} (in {repo}); "
            "resolve them, then `nox -s apply -- --continue` again"
        )
    _copy_overlays(series, repo, stage)
    git(repo, "add", "-A")
    info = read_patch(series.patch_file(stage))
    commit = commit_verbatim(repo, info.message, info.author)
    _record_stage(repo, stage, commit, record["inputs"])
    carry_path(repo).unlink()
    print(
        f"stage {stage.id}: carried as {commit[:12]}; run `nox -s refresh` to "
        "write its patch file from it"
    )
    return commit


def _abort_carry(repo: Path) -> None:
    """``--abort``: drop the carried stage's merge; the tree is at the stage
    below, as before the carry."""
    git(repo, "reset", "-q", "--hard", "HEAD")
    _remove_untracked(repo)
    carry_path(repo).unlink()


def _undo(repo: Path) -> None:
    git(repo, "reset", "-q", "--hard", "HEAD")
    _remove_untracked(repo)


def apply(
    series: Series,
    upto: str | None = None,
    *,
    offline: bool = False,
    quiet: bool = False,
    carry: bool = False,
    resume: bool = False,
    abort: bool = False,
    move_tree: bool = True,
) -> Path:
    """Bring the work repo to ``upto`` (default: the last stage); return it.
    ``carry``: a stage whose patch no longer applies is carried with a
    three-way merge, stopping on its conflicts; ``resume`` (``--continue``)
    commits the resolved stage and goes on; ``abort`` drops it. Without
    ``move_tree`` the stage commits are made and recorded, and the tree
    stays where it is (at a current stage below them)."""
    target = series.stages_upto(upto)
    repo = prepare(series, offline=offline, quiet=quiet)
    waiting = carry_path(repo).exists()
    if (resume or abort) and not waiting:
        raise SeriesError("no carried stage is waiting; nothing to continue or abort")
    if abort:
        _abort_carry(repo)
        print("carry aborted; the tree is at the stage below it, as before")
        return repo
    if waiting and not resume:
        stage = json.loads(carry_path(repo).read_text())["stage"]
        raise SeriesError(
            f"stage {stage} is carried and waits for its conflicts to be resolved "
            f"in {repo}: then `nox -s apply -- --continue`, or "
            "`nox -s apply -- --abort`"
        )
    if resume:
        _continue_carry(series, repo)
        carry = True  # a later stage may need carrying too
    chain = read_chain(series, repo)
    refuse_if_dirty(repo)
    _refuse_foreign_head(repo, chain)

    keep = min(chain.current, len(target))
    start = chain.applied[keep - 1][1] if keep else chain.base
    head = rev_parse(repo, "HEAD")
    parent = start
    for stage in target[:keep]:
        if not quiet:
            print(f"stage {stage.id}: up to date")
    above = [s.id for s, commit in chain.applied[keep : chain.current]]
    was = next((s.id for s, commit in chain.applied if commit == head), None)
    if not quiet and len(target) == keep and was in above:
        now = target[-1].id if target else "the base"
        print(
            f"moved the tree from stage {was} down to {now}; "
            f"{', '.join(above)} stay recorded and return with the next apply"
        )
    try:
        for stage in target[keep:]:
            parent = _apply_stage(series, repo, stage, parent, carry=carry)
            if not quiet:
                print(f"stage {stage.id}: applied ({stage.title}) as {parent[:12]}")
    except StageApplyError:
        if move_tree:
            _move_tree(repo, parent)  # the last good stage
        raise
    if move_tree:
        _move_tree(repo, parent)
    return repo
