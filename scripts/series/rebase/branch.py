# SPDX-License-Identifier: Apache-2.0
"""A finished rebase as a branch of the project, ``rebase/<target label>``:
one commit on the project's HEAD holding the rebased patches/, overlays and
series.toml, the rebase's report (docs/rebased_onto_<label>.md), the kept
conflict resolutions, the README's stage table and the files that name the
pin. Test it as any branch; merging a release's branch adopts its pin, and
a git checkout's branch is for testing only.

The commit is made in a git worktree under build/, and the branch is created
last, in one ref update: the project's checkout is never touched, and a run
killed before the branch exists leaves nothing but that worktree, which the
next run (``--continue``) replaces."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, GitBase, Series, Stage
from scripts.series.git import (
    TOOL_IDENTITY,
    Identity,
    git,
    git_out,
    ownership_refusal,
    status_as_the_user_sees_it,
)
from scripts.series.layout import RESOLUTIONS, rebase_branch
from scripts.series.pin_sites import PIN_FILES, moved_pin_files
from scripts.series.rebase.series_toml import (
    series_toml,
    updated_series_file,
)
from scripts.series.rebase.state import (
    RebaseState,
    format_report,
    rebase_command,
    save_state,
    target_from,
    work_repo,
)
from scripts.series.stages.check import edits_of_earlier_lines, hunk_budget
from scripts.series.stages.overview import with_stage_table
from scripts.series.stages.patchfile import read_patch
from scripts.series.stages.refresh import format_stage_patch, overlay_bytes


def series_digest(series: Series) -> str:
    """A fingerprint of the series files, so that a rebase stopped for a
    conflict goes on only with the series it started from."""
    digest = hashlib.sha256()
    files = [series.patches_dir / "series.toml"]
    for stage in series.stages:
        files.append(series.patch_file(stage))
        files += [series.overlay_file(o) for o in stage.overlays]
    for path in files:
        digest.update(str(path.relative_to(series.root)).encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    return digest.hexdigest()


def refuse_unless_ready(
    series: Series,
    branch: str,
    *,
    clean: bool = True,
    then: str = "run the rebase again",
) -> None:
    """The project must be a git checkout without ``branch``, and (unless
    ``clean`` is False) without uncommitted changes: the branch is made from
    its last commit, so an uncommitted edit would silently be left out."""
    listed = status_as_the_user_sees_it(series.root)
    if refused := ownership_refusal(listed.stderr):
        raise SeriesError(refused)
    if listed.returncode != 0:
        raise SeriesError(
            f"{series.root} is not a git checkout: a rebase writes its result as "
            "a branch of the project's git repository; clone the project with "
            "git and rebase there"
        )
    changed = [line[3:] for line in listed.stdout.decode().splitlines()]
    if clean and changed:
        raise SeriesError(
            "the project has uncommitted changes ("
            + ", ".join(changed[:5])
            + (", ..." if len(changed) > 5 else "")
            + f"); the rebase's branch {branch} is made from the last commit, "
            f"so commit or stash them first, then {then}"
        )
    if branch_commit(series, branch) is not None:
        raise SeriesError(
            f"the project already has a branch {branch}: merge it, or delete "
            f"it (`git branch -D {branch}`), then {then}"
        )


def branch_commit(series: Series, branch: str) -> str | None:
    found = git(
        series.root, "rev-parse", "--verify", "-q", f"refs/heads/{branch}", check=False
    )
    return found.stdout.decode().strip() if found.returncode == 0 else None


def finish(series: Series, state: RebaseState) -> str:
    """Commit the rebased series on its branch; return the branch name. A
    run killed after the commit and before the state went finds its branch
    and only tidies up."""
    target = pinned_target(state)
    branch = rebase_branch(target, state.rehearsal)
    tree = work_repo(series, state).with_name("project")
    made = branch_commit(series, branch)
    if made is not None and made == state.branch_commit:
        remove_worktree(series, tree)
        return branch
    refuse_unless_ready(
        series,
        branch,
        clean=not state.rehearsal,
        then="`nox -s rebase -- --continue`",
    )
    moved = git(
        series.root,
        "merge-base",
        "--is-ancestor",
        state.project_head,
        "HEAD",
        check=False,
    )
    if state.project_head and moved.returncode != 0:
        raise SeriesError(
            f"the project's HEAD no longer contains the commit this rebase "
            f"started from ({state.project_head[:12]}); the branch is made on "
            "HEAD: switch back to a branch that contains it, then "
            "`nox -s rebase -- --continue`"
        )
    remove_worktree(series, tree)
    git(series.root, "worktree", "add", "-q", "--detach", str(tree), "HEAD")
    _write_series(series, state, tree)
    git(tree, "add", "-A")
    now = datetime.now(UTC).isoformat(timespec="seconds")
    git(
        tree,
        "commit",
        "-q",
        "-m",
        f"Rebase the series onto {target.label}",
        "-m",
        "Written by `nox -s rebase`; the report is "
        f"docs/rebased_onto_{target.label}.md. "
        + (
            "It is for testing against vLLM main: never merge it (install "
            "and the Dockerfile take a release)."
            if isinstance(target, GitBase)
            else "Merging this branch adopts the new pin."
        )
        + "\n\n"
        + format_report(state.reports),
        identity=Identity(*TOOL_IDENTITY, now),
    )
    state.branch_commit = git_out(tree, "rev-parse", "HEAD")
    save_state(series, state)
    # Created only if absent (the empty old value): never moves a branch.
    created = git(
        series.root,
        "update-ref",
        f"refs/heads/{branch}",
        state.branch_commit,
        "",
        check=False,
    )
    if created.returncode != 0:
        said = created.stderr.decode(errors="replace").strip()
        raise SeriesError(_branch_not_made(series, branch, state.branch_commit, said))
    remove_worktree(series, tree)
    return branch


def _branch_not_made(series: Series, branch: str, commit: str, said: str) -> str:
    """Why git did not create ``branch``, and what to do: another rebase
    (in another worktree of this repository) made it first, git's lock on
    it is held or left by a killed git, or git's own reason (``said``)."""
    other = branch_commit(series, branch)
    if other is not None:
        return (
            f"the branch {branch} appeared while this rebase made it, at "
            f"{other[:12]}, not this rebase's commit {commit[:12]} (another "
            f"rebase onto the same target, in another worktree?): keep one, "
            f"`git branch -D {branch}` and {rebase_command('--continue')} to "
            "make this one"
        )
    path = git_out(series.root, "rev-parse", "--git-path", f"refs/heads/{branch}")
    lock = series.root / f"{path}.lock"  # relative to the project, if not absolute
    if not lock.exists():
        return (
            f"git could not create the branch {branch} ({said}); the rebase is "
            f"kept: fix that, then {rebase_command('--continue')}"
        )
    return (
        f"git could not create the branch {branch}: its lock file {lock} is "
        "held by another git command in this repository, or was left by one "
        f"that was killed; if none is running, `rm {lock}`, then "
        f"{rebase_command('--continue')}"
    )


def pinned_target(state: RebaseState) -> Base:
    """The rebase's target as the new pin names it: a git target at the
    commit the rebase was onto, not a ref that moves."""
    target = target_from(state.target)
    if state.target_commit and isinstance(target, GitBase):
        target = replace(target, rev=state.target_commit)
    return target


def remove_worktree(series: Series, tree: Path) -> None:
    """Remove the rebase's worktree of the project, and what a kill inside
    `git worktree add` leaves: a registration git keeps locked
    ("initializing") even when the folder is gone, which `prune` skips."""
    git(series.root, "worktree", "unlock", str(tree), check=False)
    git(series.root, "worktree", "remove", "-f", "-f", str(tree), check=False)
    shutil.rmtree(tree, ignore_errors=True)
    git(series.root, "worktree", "prune", check=False)


def _write_series(series: Series, state: RebaseState, tree: Path) -> None:
    """Write the rebased series and its report into ``tree``, a checkout of
    the project."""
    target = pinned_target(state)
    repo = work_repo(series, state)
    dropped = {s.id for s in series.stages} - set(state.commits)
    kept = [
        replace(s, depends_on=_depends(series, s, dropped))
        for s in series.stages
        if s.id in state.commits
    ]
    regression = tuple(
        replace(suite, paths=paths)
        for suite in series.regression
        if (paths := tuple(p for p in suite.paths if p not in state.regression_gone))
    )
    tree = tree.resolve()
    new = replace(
        series,
        root=tree,
        base=target,
        stages=tuple(kept),
        regression=regression,
        patches_dir=tree / series.patches_dir.relative_to(series.root),
        overlay_dir=tree / series.overlay_dir.relative_to(series.root),
    )
    files: dict[Path, bytes] = {}
    changed_overlays = []
    for stage in kept:
        commit = state.commits[stage.id]
        files[new.patch_file(stage)] = format_stage_patch(new, repo, stage, commit)
        for overlay in stage.overlays:
            data = overlay_bytes(repo, commit, overlay)
            assert data is not None
            if data != series.overlay_file(overlay).read_bytes():
                changed_overlays.append(f"`{overlay}`")
            files[new.overlay_file(overlay)] = data
    for stage in series.stages:
        if stage.id in dropped:
            new.patch_file(stage).unlink(missing_ok=True)
            for overlay in stage.overlays:
                if new.overlay_file(overlay) not in files:
                    new.overlay_file(overlay).unlink(missing_ok=True)
    series_file = new.patches_dir / "series.toml"
    files[series_file] = updated_series_file(
        series_file.read_text(encoding="utf-8"), series_toml(new, series.patches_dir)
    ).encode()
    readme = tree / "README.md"
    if readme.is_file():
        table = with_stage_table(readme.read_text(encoding="utf-8"), new)
        if table is not None:
            files[readme] = table.encode()
    files.update(moved_pin_files(tree, target, files))
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    report = tree / "docs" / f"rebased_onto_{target.label}.md"
    report.parent.mkdir(exist_ok=True)
    report.write_text(_report(series, state, new, changed_overlays))
    # The conflicts resolved (a conflict left unresolved has no postimage).
    rr_cache = repo / ".git" / "rr-cache"
    resolved = rr_cache.glob("*/postimage") if rr_cache.is_dir() else ()
    for postimage in resolved:
        shutil.copytree(
            postimage.parent,
            new.patches_dir / RESOLUTIONS / postimage.parent.name,
            dirs_exist_ok=True,
        )


def _report(
    series: Series, state: RebaseState, new: Series, changed_overlays: list[str]
) -> str:
    """The rebase's report: per stage and hunk what happened, what the
    target deleted, and what CI's check-patches will say of the branch."""
    hunks = "".join(
        _hunks_note(series.patch_file(stage), new, stage) for stage in new.stages
    )
    gone = (
        "vLLM's own tests in `[[regression]]` that the target deleted, left out "
        "of series.toml (add the target's tests that cover the same code): "
        + ", ".join(f"`{p}`" for p in state.regression_gone)
        + ".\n\n"
        if state.regression_gone
        else ""
    )
    overlays = (
        "Overlays changed by the rebase: " + ", ".join(changed_overlays) + ".\n\n"
        if changed_overlays
        else "No overlay changed.\n\n"
    )
    _, problems = hunk_budget(new)
    repo = work_repo(series, state)
    problems += edits_of_earlier_lines(
        repo, [(stage, state.commits[stage.id]) for stage in new.stages]
    )
    budget = (
        "CI's check-patches: the glue budget holds, no stage changes an earlier "
        "one's lines, and the README's stage table and "
        f"the pin in {', '.join(PIN_FILES)} are written for the new pin.\n"
        if not problems
        else "CI's check-patches will fail on this branch until series.toml "
        "(large_hunks, with the reason) or the stages fix it:\n\n"
        + "".join(f"- {problem}\n" for problem in problems)
    )
    return (
        f"# Rebase onto {new.base.label}\n\n"
        + format_report(state.reports)
        + "\n\n"
        + hunks
        + gone
        + overlays
        + budget
    )


def _hunks_note(old_patch: Path, new: Series, stage: Stage) -> str:
    """Every hunk of the rebased stage, the ones the rebase added (a hand
    fix, or a change the merge made) marked."""

    def added(hunk) -> list[str]:
        return [
            line
            for line in hunk.text.splitlines()[1:]
            if line.startswith("+") and not line.startswith("+++")
        ]

    old_added = {line for hunk in read_patch(old_patch).hunks for line in added(hunk)}
    rows = []
    for hunk in read_patch(new.patch_file(stage)).hunks:
        new_lines = [line for line in added(hunk) if line not in old_added]
        mark = f"{len(new_lines)} line(s) new in the rebase" if new_lines else "-"
        size = f"+{hunk.added} -{hunk.removed}"
        rows.append(f"| {hunk.path} | `{hunk.header}` | {size} | {mark} |")
    return (
        f"Stage {stage.id} as rebased, every hunk:\n\n"
        "| file | hunk | lines | added by the rebase |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
    )


def _depends(series: Series, stage: Stage, dropped: set[str]) -> tuple[str, ...]:
    """A stage's dependencies with upstreamed stages replaced by theirs."""
    out: list[str] = []
    for dep in stage.depends_on:
        if dep in dropped:
            out += [
                d for d in _depends(series, series.stage(dep), dropped) if d not in out
            ]
        elif dep not in out:
            out.append(dep)
    return tuple(out)
