# SPDX-License-Identifier: Apache-2.0
"""Rehearse the next rebase: the whole series onto a vLLM git checkout made
from the pinned release plus upstream commits, with the checks on.

The target is what a user following vLLM main has: a git checkout of the
pinned sources (the base commit of the work repo, without the version files
the sdist ships), tagged as the release, then three upstream commits:

- one that adds a line inside the context of the first stage's first
  Python hunk, two lines away from what the stage changes: the hunk no
  longer applies as it is, so the stage goes through the three-way merge
  (the report says "merged");
- one that adds a line at the top of another file a stage patches: its
  hunks apply at an offset;
- one unrelated to the stages (README.md).

Every stage must come out applied or merged, with its checks passed (its
Python compiles on the target; where its files hold more than the applied
stages plus the upstream comment lines, its vLLM modules import and its
tests and its PR's tests pass there; otherwise its code is what
apply-and-test imports and tests), none reported upstream, and the rebase
must end on its project branch, rehearsal/<target> (a namespace of its
own), with the rebased series.toml on it. That branch is then deleted (--keep keeps it
until the next rehearsal). Unlike a real rebase, the rehearsal runs on a
project with uncommitted edits (the branch is made from the last commit
plus the rebased series).

``python3 -m scripts.series.rebase.rehearsal --test-python PY`` (``nox -s
rehearse-rebase`` passes its own); exits 1 with the reason when the
rehearsal fails. It shares a real rebase's work area, so it refuses to run
while one is stopped, and never touches it. A rebase it stopped (a
conflict, a failed check, Ctrl-C) is aborted, its check logs kept in
build/rehearsal/logs/ (--keep keeps it to look into); what a killed
rehearsal leaves, the next one clears.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import SERIES_FILE, GitBase, Series, Stage, load_series
from scripts.series.git import TOOL_IDENTITY, Identity, git, git_out
from scripts.series.layout import (
    BASE_REF,
    build_dir,
    rebase_branch,
    rebase_dir,
    workdir,
)
from scripts.series.lock import project_lock
from scripts.series.rebase import rebase
from scripts.series.rebase.branch import branch_commit
from scripts.series.rebase.checks import UPSTREAM_NOTE
from scripts.series.rebase.state import (
    StageReport,
    load_state,
    rebase_command,
    state_file,
)
from scripts.series.stages.patchfile import Hunk, read_patch
from scripts.series.stages.prepare import extract_commit

REV = "rehearsal"
# What the rebase may report for a stage in a rehearsal (anything else:
# conflicted, dropped hunks, already upstream, checks failed, dropped).
KEPT = ("applied cleanly", "merged")
_DATE = "2000-01-02T00:00:00+00:00"


def target_dir(series: Series) -> Path:
    return build_dir(series) / "rehearsal" / series.base.name


def _python_hunks(series: Series, stages: list[Stage]) -> list[Hunk]:
    return [
        hunk
        for stage in stages
        for hunk in read_patch(series.patch_file(stage)).hunks
        if hunk.path.endswith(".py")
    ]


def _context_hunk(hunks: list[Hunk]) -> Hunk:
    """The first hunk with three lines of context before its first change."""
    for hunk in hunks:
        body = hunk.text.split("\n@@", 1)[1].split("\n", 1)[1].splitlines()
        if len(body) > 3 and all(line.startswith(" ") for line in body[:3]):
            return hunk
    raise SeriesError("no stage hunk has three lines of leading context")


def _insert_line(path: Path, after: int, line: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(after, line)
    path.write_text("".join(lines))


def _commit(repo: Path, message: str) -> None:
    # -f: the sdist's .gitignore hides files vLLM's repository tracks.
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "-m", message, identity=Identity(*TOOL_IDENTITY, _DATE))


def make_target(series: Series) -> tuple[Path, list[str]]:
    """The rehearsal's git checkout (made anew) and what each upstream
    commit changed."""
    repo = target_dir(series)
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    extract_commit(workdir(series), BASE_REF, repo)
    # What the sdist ships and a checkout does not: the rebase writes them
    # for a git target, as setuptools-scm would.
    (repo / series.base.name / "_version.py").unlink(missing_ok=True)
    for info in repo.glob("*.egg-info"):
        shutil.rmtree(info)
    git(repo, "init", "-q", "-b", REV)
    _commit(repo, f"{series.base.label} as released")
    version = getattr(series.base, "version", None)
    if version:
        git(repo, "tag", f"v{version}")
    hunks = _python_hunks(series, list(series.stages))
    # The first stage's: only its line numbers are the base's (a later
    # stage's count its parent's, which earlier stages may have moved).
    near = _context_hunk(_python_hunks(series, list(series.stages[:1])))
    # Between the hunk's first and second context lines: two unchanged lines
    # stay between it and the stage's change, so git merges the two.
    _insert_line(repo / near.path, near.old_start, UPSTREAM_NOTE)
    _commit(repo, f"upstream: a line in the context of {near.path}'s hunk")
    far = next(
        (h for h in hunks if h.path != near.path and h.old_start > 4),
        None,
    )
    changes = [f"{near.path}: a line inside the context of hunk {near.number}"]
    if far is not None:
        _insert_line(repo / far.path, 0, UPSTREAM_NOTE)
        _commit(repo, f"upstream: a line at the top of {far.path}")
        changes.append(f"{far.path}: a line at the top (its hunks move)")
    with (repo / "README.md").open("a") as readme:
        readme.write("\nAn upstream change of the rebase rehearsal.\n")
    _commit(repo, "upstream: README.md")
    changes.append("README.md: a line at the end")
    return repo, changes


def problems(reports: list[StageReport], series: Series) -> list[str]:
    """What keeps the rehearsal from passing, from the rebase's report."""
    found = []
    reported = {r.id: r for r in reports}
    for stage in series.stages:
        report = reported.get(stage.id)
        if report is None:
            found.append(f"stage {stage.id}: not in the report")
        elif report.outcome not in KEPT:
            found.append(f"stage {stage.id}: {report.outcome} ({report.evidence})")
    if not any(h.outcome == "merged" for r in reports for h in r.hunks):
        found.append("no hunk went through the three-way merge")
    return found


def _own_stopped_rebase(series: Series) -> bool:
    """Whether a stopped rebase is there and the rehearsal's own."""
    return state_file(series).exists() and load_state(series).rehearsal


def _made_by_a_rehearsal(series: Series, branch: str, target: GitBase) -> bool:
    """Whether ``branch`` is a rehearsal's: its commit is a rebase's onto
    this very target (the target's commit is the same every time)."""
    ref = f"refs/heads/{branch}"  # not a tag of the same name
    subject = git_out(series.root, "log", "-1", "--format=%s", ref)
    pin = git(series.root, "show", f"{ref}:patches/series.toml", check=False)
    return subject == f"Rebase the series onto {target.label}" and (
        f'rev = "{target.rev}"' in pin.stdout.decode(errors="replace")
    )


def _clear_leftovers(series: Series, branch: str, target: GitBase) -> None:
    """What an earlier rehearsal, killed, may have left: its stopped rebase
    (aborted) and its branch (deleted). A user's stopped rebase shares the
    rehearsal's work area, so the rehearsal refuses to run beside it; a
    branch of the same name it did not make is refused too."""
    if state_file(series).exists():
        if not load_state(series).rehearsal:
            raise SeriesError(
                "a rebase is stopped in this checkout; the rehearsal shares its "
                "work area and leaves it alone: go on with "
                f"{rebase_command('--continue')} or drop it with "
                f"{rebase_command('--abort')}, then rehearse"
            )
        print("a rehearsal stopped earlier left its rebase; dropping it")
        rebase.abort(series)
    if branch_commit(series, branch) is not None:
        if not _made_by_a_rehearsal(series, branch, target):
            raise SeriesError(
                f"the branch {branch} is not a rehearsal's (not a rebase onto "
                f"{target.label}), and the rehearsal writes that name: rename it "
                f"(`git branch -m {branch} NEW`), then rehearse"
            )
        print(f"deleting the branch {branch} an earlier rehearsal left")
        git(series.root, "branch", "-q", "-D", branch)


def _stopped(series: Series, target: GitBase, error: str, keep: bool) -> str:
    """The rehearsal's rebase stopped (a conflict or a failed check): what to
    say. Unless ``keep``, the stopped rebase is dropped, so that it blocks no
    later rebase, its check logs kept beside the target."""
    message = f"the rebase rehearsal stopped: {error}"
    if not _own_stopped_rebase(series):
        return message
    if keep:
        return (
            f"{message}\n(kept for a look, as --keep asks: the rebase onto "
            f"{target.label} is a rehearsal; drop it with "
            f"{rebase_command('--abort')})"
        )
    logs = target_dir(series).parent / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    for log in (rebase_dir(series) / target.label).glob("check-*.log"):
        shutil.copy2(log, logs / log.name)
    rebase.abort(series)
    return (
        f"{message}\n(The rehearsal's rebase was aborted, not to block a real "
        f"one; its check logs are in {logs}. `nox -s rehearse-rebase -- --keep` "
        "keeps a stopped one to look into.)"
    )


def rehearse(series: Series, test_python: str, keep: bool = False) -> str:
    """Run the rehearsal; return its branch (deleted unless ``keep``, and by
    the next rehearsal)."""
    with project_lock(series, "rebase rehearsal"):
        repo, changes = make_target(series)
        target = GitBase(series.base.name, repo, git_out(repo, "rev-parse", "HEAD"))
        branch = rebase_branch(target, rehearsal=True)
        _clear_leftovers(series, branch, target)
        print(
            f"rehearsal target {repo} "
            f"({git_out(repo, 'describe', '--tags', '--always')}):"
        )
        for change in changes:
            print(f"  upstream commit: {change}")
        try:
            reports = rebase.start(
                series, target, test_python=test_python, rehearsal=True
            )
        except SeriesError as exc:
            raise SeriesError(_stopped(series, target, str(exc), keep)) from None
        except KeyboardInterrupt:
            if _own_stopped_rebase(series) and not keep:
                rebase.abort(series)
            raise
    found = problems(reports, series)
    if branch_commit(series, branch) is None:
        found.append(f"the rebase made no branch {branch}")
    else:
        written = git_out(
            series.root, "show", f"refs/heads/{branch}:patches/series.toml"
        )
        if f'rev = "{target.rev}"' not in written:
            found.append(f"{branch}'s series.toml is not pinned to {target.rev}")
        if not keep:
            git(series.root, "branch", "-q", "-D", branch)
    if found:
        raise SeriesError("the rebase rehearsal failed: " + "; ".join(found))
    print(f"rebase rehearsal passed: {len(series.stages)} stage(s) on {repo}")
    return branch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m scripts.series.rebase.rehearsal", description=__doc__
    )
    parser.add_argument("--series", type=Path, default=SERIES_FILE)
    parser.add_argument("--test-python", required=True)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the rebase's branch, or a stopped rebase",
    )
    args = parser.parse_args(argv)
    try:
        rehearse(load_series(args.series), args.test_python, args.keep)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        kept = "kept (--keep)" if args.keep else "dropped"
        print(
            f"error: the rebase rehearsal was interrupted; its rebase is {kept}, "
            "and the next rehearsal clears what is left",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
