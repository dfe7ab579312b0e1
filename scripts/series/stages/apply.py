# SPDX-License-Identifier: Apache-2.0
"""Apply the stages onto the base: one commit per stage, zero fuzz.

Each stage's patch is applied exactly (``git apply``, no three-way merge, no
fuzz), its overlay modules are copied in, and one commit is made with the
patch's author, date, subject and body, so the commit id is the same on every
machine. A failure names the stage, the file and the hunk and leaves the tree
at the last good stage. Uncommitted edits are never overwritten.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Series, Stage
from scripts.series.git import (
    Identity,
    changed_files,
    commit_tree,
    commit_verbatim,
    files_with_conflict_markers,
    git,
    git_out,
    rev_parse,
    untracked_files,
)
from scripts.series.layout import SERIES_BRANCH, SERIES_REF, carry_path, stage_tag
from scripts.series.stages.patchfile import failing_hunk, read_patch
from scripts.series.stages.prepare import prepare
from scripts.series.stages.state import (
    Chain,
    fingerprint,
    in_progress_path,
    load_state,
    parent_of,
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
        "`python -m scripts.series refresh` (or `nox -s refresh`); to keep them "
        f"aside, `git -C {tree} stash --include-untracked`; to drop them, {drop}"
    )


def _recover_interrupted(series: Series, repo: Path) -> None:
    """Finish or undo a stage apply that was killed. Its commit made, HEAD is
    adopted (the commit is the canonical one: nothing but this tool commits
    with the patch's identity and date as committer); not made, the stage's
    own partial writes are dropped and it is redone. Edits to any other file
    are set aside in a git stash, never deleted."""
    marker = in_progress_path(repo)
    if not marker.exists():
        return
    text = marker.read_text()
    try:
        record = json.loads(text)
    except ValueError:  # written by an older version of the tool: the id only
        record = {"stage": text.strip(), "parent": None, "inputs": ""}
    stage = series.stage(record["stage"])
    head = rev_parse(repo, "HEAD")
    if (
        head
        and head != record["parent"]
        and _is_stage_commit(series, repo, stage, record["parent"])
    ):
        _record_stage(repo, stage, head, record["inputs"])
        print(f"finished the interrupted apply of stage {stage.id}")
    elif set(changed_files(repo)) <= _files_of(series, stage):
        git(repo, "reset", "-q", "--hard", "HEAD")
        _remove_untracked(repo)
    else:
        git(
            repo,
            "stash",
            "push",
            "-q",
            "--include-untracked",
            "-m",
            f"dsa-series: interrupted apply of stage {stage.id}",
        )
        print(
            f"an earlier apply of stage {stage.id} was interrupted and files "
            f"outside it changed since; they are in `git -C {repo} stash list`"
        )
    marker.unlink()


def _is_stage_commit(series: Series, repo: Path, stage: Stage, parent: str) -> bool:
    """Whether HEAD is the commit an apply of ``stage`` on ``parent`` makes
    (its tree committed with the patch's message and identity), with a clean
    tree."""
    head = rev_parse(repo, "HEAD")
    if parent_of(repo, "HEAD") != parent or changed_files(repo):
        return False
    info = read_patch(series.patch_file(stage))
    return head == commit_tree(
        repo, f"{head}^{{tree}}", parent, info.message, info.author
    )


def _files_of(series: Series, stage: Stage) -> set[str]:
    return set(read_patch(series.patch_file(stage)).files) | set(stage.overlays)


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
            f"`python -m scripts.series refresh`, or {move}; then run again."
        )
    refuse_foreign_branch(repo, chain)


def _apply_stage(
    series: Series, repo: Path, stage: Stage, parent: str, *, carry: bool = False
) -> str:
    patch_path = series.patch_file(stage)
    info = read_patch(patch_path)
    inputs = fingerprint(series, stage, parent)
    marker = in_progress_path(repo)
    marker.write_text(
        json.dumps({"stage": stage.id, "parent": parent, "inputs": inputs})
    )
    check = git(repo, "apply", "--check", "--verbose", str(patch_path), check=False)
    if check.returncode == 0:
        git(repo, "apply", "--index", "--whitespace=nowarn", str(patch_path))
    elif not carry:
        marker.unlink()
        where = failing_hunk(info, check.stderr.decode(errors="replace"))
        raise StageApplyError(
            f"stage {stage.id} ({stage.title}): {stage.patch} does not apply: "
            f"{where}. The tree is left at the last good stage. To carry the "
            "stage onto it with a three-way merge (conflicts left to resolve), "
            "run `nox -s apply -- --carry` (README, 'Changing a stage')."
        )
    else:
        _carry_stage(series, repo, stage, parent, inputs)
    _add_overlays(series, repo, stage, marker)
    return _commit_stage(repo, stage, info.message, info.author, inputs, marker)


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
            f"stage {stage.id}: carried by a three-way merge; run refresh to "
            "write its patch file"
        )
        return
    unmerged = git_out(repo, "diff", "--name-only", "--diff-filter=U").split()
    if not unmerged:  # git could not even start the merge: nothing to resolve
        _undo(repo, in_progress_path(repo))
        reason = merged.stderr.decode(errors="replace").strip().splitlines()
        raise StageApplyError(
            f"stage {stage.id}: {stage.patch} cannot be carried by a three-way "
            f"merge ({reason[-1] if reason else 'git apply --3way failed'}); the "
            "tree is left at the last good stage"
        )
    carry_path(repo).write_text(
        json.dumps({"stage": stage.id, "parent": parent, "inputs": inputs})
    )
    in_progress_path(repo).unlink()
    raise SeriesError(
        f"stage {stage.id} ({stage.title}) carried with conflicts in "
        f"{', '.join(unmerged)} (in {repo}); resolve them, then run "
        "`nox -s apply -- --continue` (which commits the stage and goes on), or "
        "`nox -s apply -- --abort` to go back to the stage below"
    )


def _add_overlays(
    series: Series, repo: Path, stage: Stage, marker: Path, *, undo: bool = True
) -> None:
    """Copy the stage's overlays in. On a problem the stage's partial work is
    undone, unless ``undo`` is off (a carried stage: the tree holds the
    user's resolution)."""
    for overlay in stage.overlays:
        source = series.overlay_file(overlay)
        target = repo / overlay
        if not source.is_file():
            if undo:
                _undo(repo, marker)
            raise StageApplyError(
                f"stage {stage.id}: overlay {overlay} is missing "
                f"({source} is not a file)"
            )
        if target.exists():
            if undo:
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


def _commit_stage(
    repo: Path, stage: Stage, message: str, author: Identity, inputs: str, marker: Path
) -> str:
    commit = commit_verbatim(repo, message, author)
    _record_stage(repo, stage, commit, inputs)
    marker.unlink(missing_ok=True)
    return commit


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
    _add_overlays(series, repo, stage, in_progress_path(repo), undo=False)
    git(repo, "add", "-A")
    info = read_patch(series.patch_file(stage))
    commit = _commit_stage(
        repo, stage, info.message, info.author, record["inputs"], carry_path(repo)
    )
    print(
        f"stage {stage.id}: carried as {commit[:12]}; run refresh to write its "
        "patch file from it"
    )
    return commit


def _abort_carry(repo: Path) -> None:
    """``--abort``: drop the carried stage's merge; the tree is at the stage
    below, as before the carry."""
    git(repo, "reset", "-q", "--hard", "HEAD")
    _remove_untracked(repo)
    carry_path(repo).unlink()


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
    carry: bool = False,
    resume: bool = False,
    abort: bool = False,
) -> Path:
    """Bring the work repo to ``upto`` (default: the last stage); return it.
    ``carry``: a stage whose patch no longer applies is carried with a
    three-way merge, stopping on its conflicts; ``resume`` (``--continue``)
    commits the resolved stage and goes on; ``abort`` drops it."""
    target = series.stages_upto(upto)
    repo = prepare(series, offline=offline, quiet=quiet)
    _recover_interrupted(series, repo)
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
    if head != start or rev_parse(repo, SERIES_REF) != start:
        git(repo, "checkout", "-q", "-B", SERIES_BRANCH, start)
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
    for stage in target[keep:]:
        parent = _apply_stage(series, repo, stage, parent, carry=carry)
        if not quiet:
            print(f"stage {stage.id}: applied ({stage.title}) as {parent[:12]}")
    return repo
