# SPDX-License-Identifier: Apache-2.0
"""Rebase the series onto a newer vLLM (a release's sdist or a git checkout).

Each stage merges three ways in build/rebase/<target>/vllm, which also
holds the current series' commits; the report says per hunk whether it
applied, merged, conflicted, was already upstream or was dropped (never
silently). Resolutions are recorded with git rerere and replay. A stage
whose changes, or whose upstream probe, the target already has is left
out. The result is a commit on a new project branch, rebase/<target>
(branch.py); merging a release's branch adopts its pin, a git checkout's
branch is never merged (docs/maintaining.md)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, GitBase, Series, Stage
from scripts.series.git import (
    commit_verbatim,
    files_with_conflict_markers,
    git,
    git_out,
    is_repo,
    rev_parse,
)
from scripts.series.layout import (
    BASE_REF,
    REBASE_OLD_REF,
    REBASED_BRANCH,
    kept_resolutions_dir,
    rebase_branch,
    rebase_dir,
    resolution_dirs,
    workdir,
)
from scripts.series.rebase import checks
from scripts.series.rebase.branch import (
    finish,
    pinned_target,
    refuse_unless_ready,
    remove_worktree,
    series_digest,
)
from scripts.series.rebase.hunks import (
    DELETED_ON_TARGET,
    added_lines_present,
    hunk_on,
    moved_on_target,
    replayed_paths,
)
from scripts.series.rebase.series_toml import git_pin_note
from scripts.series.rebase.state import (
    HunkReport,
    RebaseState,
    StageReport,
    format_report,
    load_state,
    rebase_command,
    remove_state,
    save_state,
    state_file,
    target_dict,
    target_from,
    work_repo,
)
from scripts.series.rebase.tree_tester import TreeTester, probe_paths
from scripts.series.stages.apply import apply
from scripts.series.stages.patchfile import read_patch
from scripts.series.stages.prepare import prepare, resolve_git_rev
from scripts.series.stages.state import read_chain


def start(
    series: Series,
    target: Base,
    *,
    test_python: str | None = None,
    drop: Sequence[str] = (),
    rehearsal: bool = False,
) -> list[StageReport]:
    """Begin a rebase of ``series`` onto ``target``; run as far as it goes.
    With ``test_python`` a stage whose upstream probe passes on the target
    without it is left out; the stages in ``drop`` are left out on request.
    The project must be committed, unless this is the ``rehearsal``'s
    rebase (its branch, rehearsal/<target>, is deleted)."""
    if state_file(series).exists():
        raise SeriesError(
            "a rebase is already in progress; finish it with "
            f"{rebase_command('--continue')}, or drop it with "
            f"{rebase_command('--abort')}"
        )
    if target == series.base:
        raise SeriesError(f"the series is already on {target.label}")
    for stage_id in drop:
        series.stage(stage_id)
    pinned = (
        replace(target, rev=resolve_git_rev(target))
        if isinstance(target, GitBase)
        else target
    )
    refuse_unless_ready(series, rebase_branch(pinned, rehearsal), clean=not rehearsal)
    tester = TreeTester(test_python) if test_python else None
    old_tip = _old_tip(series)
    area = rebase_dir(series)
    work = area / target.label / "vllm"
    shutil.rmtree(area / target.label, ignore_errors=True)
    work.parent.mkdir(parents=True)
    prepare(replace(series, base=target), repo=work, quiet=True)
    git(work, "fetch", "-q", str(workdir(series)), f"+{old_tip}:{REBASE_OLD_REF}")
    git(work, "checkout", "-q", "-b", REBASED_BRANCH, BASE_REF)
    git(work, "config", "rerere.enabled", "true")
    git(work, "config", "rerere.autoUpdate", "true")
    _offer_recorded_resolutions(series, work)
    gone = [
        path
        for suite in series.regression
        for path in suite.paths
        if not (work / path).is_file()
    ]
    if gone:
        print(
            "vLLM's own tests in [[regression]] that the target no longer has "
            "(left out of the rebased series.toml): " + ", ".join(gone)
        )
    state = RebaseState(
        target_dict(target),
        old_tip,
        series_digest(series),
        test_python=test_python,
        drop=list(drop),
        # A branch moves; the rebased series pins the commit it is onto.
        target_commit=pinned.rev if isinstance(pinned, GitBase) else None,
        regression_gone=gone,
        rehearsal=rehearsal,
        project_head=git_out(series.root, "rev-parse", "HEAD"),
    )
    save_state(series, state)
    print(f"rebasing {len(series.stages)} stage(s) onto {target.label} in {work}")
    return _run(series, state, tester)


def _old_tip(series: Series) -> str:
    """The series' last stage commit, built if needed. The work tree stays
    at the stage it was at (``apply --upto``), moved at most once, to that
    stage's new commit when its inputs changed; the stages above it are
    made without moving it, so a kill cannot leave it at another stage."""
    repo = workdir(series)
    position = None
    if repo.exists():
        chain = read_chain(series, repo)
        if chain.current == len(series.stages):
            return chain.tip
        head = git_out(repo, "rev-parse", "HEAD")
        commits = {c: s.id for s, c in chain.applied}
        position = "base" if head == chain.base else commits.get(head)
    if position is not None:
        apply(series, position, quiet=True)
    apply(series, quiet=True, move_tree=position is None)
    return read_chain(series, repo).tip


def _offer_recorded_resolutions(series: Series, work: Path) -> None:
    """git rerere keys a resolution by the conflict itself, so the ones kept
    with any review (any target) replay wherever the same conflict recurs."""
    cache = work / ".git" / "rr-cache"
    offered = resolution_dirs(series)
    for recorded in offered:
        shutil.copytree(recorded, cache, dirs_exist_ok=True)
    if offered:
        where = ", ".join(str(r.relative_to(series.root)) for r in offered)
        print(f"conflict resolutions recorded in {where} are offered to git rerere")


def resume(
    series: Series, *, test_python: str | None = None, drop: Sequence[str] = ()
) -> list[StageReport]:
    """``--continue``: take the user's resolution of the conflicted stage (or
    leave it out, when it is in ``drop``), or redo the stage an interrupted
    rebase was in the middle of. Options given now join those it started
    with."""
    state = load_state(series)
    if series_digest(series) != state.series_digest:
        # The stage list and patches the rebase walks are the recorded ones.
        raise SeriesError(
            "patches/ or vllm_overlay/ changed while the rebase was stopped "
            "(patches/series.toml, a patch or an overlay); the rebase goes on "
            "with the series it started from: put them back (`git checkout -- "
            "patches vllm_overlay`, or undo your edit) and continue, or abort "
            "(`nox -s rebase -- --abort`) and rebase the edited series"
        )
    for stage_id in drop:
        series.stage(stage_id)
    state.drop += [d for d in drop if d not in state.drop]
    state.test_python = test_python or state.test_python
    tester = TreeTester(state.test_python) if state.test_python else None
    repo = work_repo(series, state)
    _refuse_unless_work_repo_holds(series, state, repo)
    if not state.pending:
        # Interrupted inside a stage: only the tool has touched the work repo
        # since the last recorded stage, so go back to it (a commit made for
        # the stage since is dropped too) and redo the stage.
        _discard_merge(repo)
        git(repo, "reset", "-q", "--hard", _stage_start(series, state))
        return _run(series, state, tester)
    stage = series.stages[state.next]
    report = state.reports[-1]
    before = _stage_start(series, state)
    if stage.id in state.drop:
        if report.outcome == CHECKS_FAILED:
            del state.commits[stage.id]
        _discard_merge(repo)
        git(repo, "reset", "-q", "--hard", before)
        report.outcome = "dropped on request"
        report.evidence = "left out with --drop"
    elif report.outcome == CHECKS_FAILED:
        # Fixes made in the work repo join the stage's commit; check again.
        _refuse_conflict_markers(repo)
        git(repo, "add", "-A")
        _take_commits_since(repo, before)
        _commit_stage(series, repo, stage, state)
        report.outcome = "merged, fixed by hand after its checks"
        report.evidence = report.evidence.replace(
            CHECKS_FAILED_NOTE, "fixed by hand after its checks failed: "
        )
        _stop_unless_checked(series, repo, stage, state, report, tester)
    else:
        _refuse_conflict_markers(repo)
        _refuse_undecided_deletions(repo)
        git(repo, "add", "-A")
        # A resolution the user (or git, before a kill) committed is still
        # the resolution: its changes go into the stage's commit.
        _take_commits_since(repo, before)
        for hunk in report.hunks:
            if hunk.outcome in ("conflicted", DELETED_ON_TARGET):
                hunk.outcome = "conflicted, resolved by hand"
        if _touches_vllm(series, repo):
            _commit_stage(series, repo, stage, state)
            report.outcome = "conflicted, resolved by hand"
            _stop_unless_checked(series, repo, stage, state, report, tester)
        else:
            _discard_merge(repo)
            report.outcome = "already upstream"
            report.evidence = _evidence(
                report.evidence,
                "resolved to the target's version of every file: left out",
            )
    state.pending = False
    state.next += 1
    save_state(series, state)
    return _run(series, state, tester)


def _refuse_unless_work_repo_holds(
    series: Series, state: RebaseState, repo: Path
) -> None:
    """The work repo must hold what the state records (the last rebased
    stage's commit): a kill can leave the state without it (an older
    version of this tool deleted the work repo before the state)."""
    start = _stage_start(series, state)
    found = is_repo(repo) and (
        git(
            repo, "rev-parse", "--verify", "-q", f"{start}^{{commit}}", check=False
        ).returncode
        == 0
    )
    if not found:
        raise SeriesError(
            f"the rebase onto {target_from(state.target).label} recorded in "
            f"{state_file(series)} cannot go on: its work repo {repo} is "
            f"{'damaged' if repo.exists() else 'missing'} (a run killed while it "
            f"ended or aborted). Run {rebase_command('--abort')} to drop it, then "
            "rebase again"
        )


CHECKS_FAILED = "merged, but fails its checks"
CHECKS_FAILED_NOTE = "its checks failed: "


def _evidence(before: str, more: str) -> str:
    return f"{before}; {more}" if before else more


def _stage_start(series: Series, state: RebaseState) -> str:
    """The commit the stage being rebased goes on: the last stage kept so
    far, or the target's base."""
    done = [
        state.commits[s.id]
        for s in series.stages[: state.next]
        if s.id in state.commits
    ]
    return done[-1] if done else BASE_REF


def _take_commits_since(repo: Path, start: str) -> None:
    """Keep the changes of any commits on top of ``start`` (the user's, or
    the tool's own from a run killed after it committed) staged on
    ``start``, so that they become the stage's commit and are never read
    as "nothing changed"."""
    if rev_parse(repo, "HEAD") == rev_parse(repo, start):
        return
    if git(repo, "merge-base", "--is-ancestor", start, "HEAD", check=False).returncode:
        raise SeriesError(
            f"{repo}: HEAD is no longer on top of the last rebased stage "
            f"({start}); put your resolution on it (`git -C {repo} reset "
            f"--soft {start}` keeps your changes) and continue, or abort"
        )
    git(repo, "reset", "-q", "--soft", start)


def _stop_unless_checked(
    series: Series,
    repo: Path,
    stage: Stage,
    state: RebaseState,
    report: StageReport,
    tester: TreeTester | None,
) -> None:
    """Check the stage's commit; on a problem, stop as on a conflict. The
    rehearsal imports and tests only what apply-and-test does not."""
    first = series.stages[0]
    tests = not state.rehearsal or not checks.holds_the_applied_stages(
        repo, f"{_old_commit(repo, series, first)}^", _old_commit(repo, series, stage)
    )
    problem = checks.stage_problem(series, repo, stage, state, tester, tests)
    if problem is None:
        return
    report.outcome = CHECKS_FAILED
    report.evidence = _evidence(report.evidence, f"{CHECKS_FAILED_NOTE}{problem}")
    state.pending = True
    save_state(series, state)
    print(format_report(state.reports))
    raise SeriesError(
        f"stage {stage.id} merged onto the target but {problem}. Fix it in {repo} "
        f"(the stage is its HEAD commit), then {rebase_command('--continue')}; "
        f"or {rebase_command('--continue --drop ' + stage.id)}, or "
        f"{rebase_command('--abort')}"
    )


def _discard_merge(repo: Path) -> None:
    git(repo, "cherry-pick", "--quit", check=False)
    git(repo, "reset", "-q", "--hard", "HEAD")
    git(repo, "clean", "-q", "-f", "-d")


def _refuse_conflict_markers(repo: Path) -> None:
    """Before anything is staged, so git's unmerged state (for `git
    mergetool`, `git diff`) stays while markers are left."""
    if leftover := files_with_conflict_markers(repo):
        raise SeriesError(
            "conflict markers are still in: " + ", ".join(leftover) + f" (in {repo})"
        )


def _refuse_undecided_deletions(repo: Path) -> None:
    """A file the target deleted and the stage changed stays unmerged until
    the user says what becomes of it; staging it silently would put the
    whole file back into the stage."""
    listed = git(repo, "status", "--porcelain=v1", "-z", "--no-renames")
    status = listed.stdout.decode()
    undecided = [e[3:] for e in status.split("\0") if e[:2] in ("DU", "UD")]
    if undecided:
        raise SeriesError(
            "deleted on the target and changed by the stage: "
            + ", ".join(undecided)
            + "; port the change to where the code went and `git rm` the file, "
            "or `git add` it to keep the whole file in the stage"
        )


def _touches_vllm(series: Series, repo: Path) -> bool:
    """Whether the staged resolution changes a vLLM file besides overlays."""
    overlays = {o for s in series.stages for o in s.overlays}
    staged = git_out(repo, "diff", "--cached", "--name-only", "HEAD").split()
    return any(path not in overlays for path in staged)


def abort(series: Series) -> None:
    """Drop the rebase in progress: its work area and record, nothing else.
    The conflict resolutions made so far (also one resolved but not yet
    continued) are kept under build/ and replay on the next rebase."""
    state = load_state(series)
    target = target_from(state.target)
    count = _keep_resolutions(series, state)
    # A kill while the branch was made can leave its worktree registered.
    remove_worktree(series, work_repo(series, state).with_name("project"))
    shutil.rmtree(rebase_dir(series) / target.label, ignore_errors=True)
    remove_state(series)
    kept = (
        f"; {count} conflict resolution(s) kept in "
        f"{kept_resolutions_dir(series, target).relative_to(series.root)}, "
        "replayed by the next rebase"
        if count
        else ""
    )
    print(
        f"rebase onto {target.label} aborted; the series and its tree are as "
        f"before{kept}"
    )


def _keep_resolutions(series: Series, state: RebaseState) -> int:
    """Copy the conflict resolutions this rebase made (not those it was
    offered, kept where they came from) under build/; return how many."""
    repo = work_repo(series, state)
    if not (repo / ".git" / "rr-cache").is_dir():
        return 0
    git(repo, "rerere", check=False)  # records a resolution not continued
    offered = {entry.name for d in resolution_dirs(series) for entry in d.iterdir()}
    resolved = [
        entry
        for entry in (repo / ".git" / "rr-cache").iterdir()
        if (entry / "postimage").is_file() and entry.name not in offered
    ]
    out = kept_resolutions_dir(series, target_from(state.target))
    for entry in resolved:
        shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
    return len(resolved)


def _run(
    series: Series, state: RebaseState, tester: TreeTester | None
) -> list[StageReport]:
    repo = work_repo(series, state)
    while state.next < len(series.stages):
        stage = series.stages[state.next]
        if stage.id in state.drop:
            report = StageReport(
                stage.id, stage.title, "dropped on request", "left out with --drop"
            )
        else:
            report = _rebase_stage(series, repo, stage, state, tester)
        state.reports.append(report)
        if stage.id in state.commits and report.outcome != "conflicted":
            _stop_unless_checked(series, repo, stage, state, report, tester)
        if report.outcome == "conflicted":
            state.pending = True
            save_state(series, state)
            print(format_report(state.reports))
            deleted = sorted(
                {h.path for h in report.hunks if h.outcome == DELETED_ON_TARGET}
            )
            todo = "".join(
                f"; {path} is deleted on the target: port the stage's change to "
                "where its code went (`git log --diff-filter=D -- PATH` on the "
                f"target says where), then `git rm {path}`"
                for path in deleted
            )
            raise SeriesError(
                f"stage {stage.id} has conflicts; resolve them in {repo} (the files "
                f"listed as conflicted above){todo}; then run "
                f"{rebase_command('--continue')} (or "
                f"{rebase_command('--continue --drop ' + stage.id)} to leave the "
                f"stage out), or {rebase_command('--abort')} to drop the rebase"
            )
        state.next += 1
        save_state(series, state)
    branch = finish(series, state)
    _keep_resolutions(series, state)
    # The branch holds all that is kept (patches, resolutions, report). The
    # state goes first: a kill while the work area is deleted then leaves
    # no rebase to continue, only a folder the next rebase deletes.
    remove_state(series)
    shutil.rmtree(rebase_dir(series) / target_from(state.target).label)
    print(format_report(state.reports))
    pinned = pinned_target(state)
    print(
        f"the rebased series is committed on the project's branch {branch} (your "
        f"checkout is as it was): `git switch {branch}`, read "
        f"docs/rebased_onto_{pinned.label}.md, test it with "
        "`nox -s apply-and-test`"
        + (
            " (or push it for CI), and merge it to adopt the new pin"
            if not isinstance(pinned, GitBase)
            else git_pin_note(pinned)
        )
    )
    return state.reports


def _old_commit(repo: Path, series: Series, stage: Stage) -> str:
    """The current series' commit of ``stage`` (fetched into the rebase repo)."""
    back = len(series.stages) - 1 - series.stages.index(stage)
    return git_out(repo, "rev-parse", f"{REBASE_OLD_REF}~{back}")


def _rebase_stage(
    series: Series,
    repo: Path,
    stage: Stage,
    state: RebaseState,
    tester: TreeTester | None,
) -> StageReport:
    patch = series.patch_file(stage)
    report = StageReport(stage.id, stage.title, "")
    if tester is not None:
        # One failure is enough to keep the stage.
        claimed = checks.claimed_stages(series, state)
        probe = tester.pytest(series, repo, claimed, probe_paths(stage), True)
        passed, failed = probe.passed, probe.failed
        if passed and not failed:
            report.outcome = "already upstream"
            report.evidence = (
                f"its upstream probe passes on the target without it ({passed} "
                f"passed, 0 failed: {', '.join(probe_paths(stage))})"
            )
            return report
        report.evidence = "upstream probe without it: " + (
            f"fails ({passed} passed before the first failure)"
            if failed
            else "no test ran"
        )
        if probe.first_error:
            report.evidence += f" (first: {probe.first_error})"
    hunks = read_patch(patch).hunks
    before = {id(h): hunk_on(repo, h) for h in hunks}
    overlays_present = all(
        (repo / o).is_file()
        and (repo / o).read_bytes() == series.overlay_file(o).read_bytes()
        for o in stage.overlays
    )
    if all(v == "already upstream" for v in before.values()) and overlays_present:
        report.outcome = "already upstream"
        report.evidence = "every hunk reverse-applies and every overlay is present"
        report.hunks = [HunkReport(h.path, h.header, "already upstream") for h in hunks]
        return report
    result = git(
        repo,
        "cherry-pick",
        "--no-commit",
        _old_commit(repo, series, stage),
        check=False,
    )
    unmerged = set(git_out(repo, "diff", "--name-only", "--diff-filter=U").split())
    # Files git rerere resolved from recorded resolutions, also when other
    # files of the stage are still in conflict.
    stderr = result.stderr.decode(errors="replace")
    replayed = replayed_paths(stderr) if result.returncode != 0 else set()
    if result.returncode != 0 and not unmerged and not replayed:
        raise SeriesError(f"stage {stage.id}: git cherry-pick failed: {stderr.strip()}")
    moved = moved_on_target(repo, len(series.stages))
    for hunk in hunks:
        outcome = before[id(hunk)]
        if hunk.path in moved and moved[hunk.path] is None:
            outcome = DELETED_ON_TARGET
        elif outcome != "already upstream":
            now_at = moved.get(hunk.path) or hunk.path
            placed = added_lines_present(repo / now_at, hunk)
            if hunk.path in unmerged:
                # a hunk that applied on its own keeps that outcome when its
                # lines made it: the file's other hunks are in conflict
                if not (placed and outcome == "applied cleanly"):
                    outcome = "conflicted"
            elif hunk.path in replayed and outcome != "applied cleanly":
                outcome = "conflicted, recorded resolution replayed"
            elif not placed:
                outcome = "dropped"
            elif now_at != hunk.path:
                outcome = f"merged into {now_at} (renamed on the target)"
            elif outcome != "applied cleanly":
                outcome = "merged"
        report.hunks.append(HunkReport(hunk.path, hunk.header, outcome))
    outcomes = {h.outcome for h in report.hunks}
    if unmerged:
        report.outcome = "conflicted"
        return report
    _commit_stage(series, repo, stage, state)
    if "dropped" in outcomes:
        report.outcome = "merged, with dropped hunks"
    elif replayed:
        report.outcome = "conflicted, recorded resolution replayed"
    elif outcomes <= {"applied cleanly", "already upstream"}:
        report.outcome = "applied cleanly"
    else:
        report.outcome = "merged"
    return report


def _commit_stage(series: Series, repo: Path, stage: Stage, state: RebaseState) -> None:
    info = read_patch(series.patch_file(stage))
    git(repo, "add", "-A")
    state.commits[stage.id] = commit_verbatim(
        repo, info.message, info.author, allow_empty=True
    )
