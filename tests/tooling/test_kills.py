# SPDX-License-Identifier: Apache-2.0
"""Faults a user's machine meets, met from outside: the tool runs in a
process of its own, and the test stops it with a signal to its process
group at a real moment (git stopped before or after one of its calls, or
inside a checkout, by a git on PATH that waits there). What is left must be
continuable, or cleared by the next run, or named in one sentence that says
what to run; and the rehearsal never touches a user's rebase."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Project, add_two_stages, run_cli, sh
from test_export import _stage_with_a_pr_test
from test_rebase import _conflicting_target

from scripts.series import SeriesError
from scripts.series.config import REPO_ROOT
from scripts.series.layout import export_dir, pr_check_dir, rebase_dir, workdir
from scripts.series.rebase import rehearsal
from scripts.series.rebase.state import state_file
from scripts.series.stages.fetch import CACHE_ENV

REAL_GIT = shutil.which("git")
_WRAPPER = """#!/bin/sh
# git, except that its first call whose arguments hold $BLOCK_MATCH waits:
# before the real git runs, after it ran, or inside its checkout (a smudge
# filter that waits), having written $BLOCK_MARKER.
case " $* " in
*"$BLOCK_MATCH"*)
  if [ ! -e "$BLOCK_MARKER.seen" ]; then
    : > "$BLOCK_MARKER.seen"
    case "$BLOCK_WHEN" in
    before) : > "$BLOCK_MARKER"
      while [ ! -e "$BLOCK_MARKER.go" ]; do sleep 0.05; done ;;
    after) "$REAL_GIT" "$@"; rc=$?; : > "$BLOCK_MARKER"; sleep 600; exit $rc ;;
    inside) exec "$REAL_GIT" -c "filter.block.smudge=$BLOCK_FILTER" "$@" ;;
    esac
  fi ;;
esac
exec "$REAL_GIT" "$@"
"""
_FILTER = """#!/bin/sh
: > "$BLOCK_MARKER"
sleep 600
cat
"""


class Blocked:
    """A process of the tool, run until its git blocks (``run``), then
    signalled (``signal``) or let go (``release``, for "before")."""

    def __init__(self, tmp: Path, match: str, when: str):
        self.dir = tmp / "blocking-git"
        self.dir.mkdir(exist_ok=True)
        self.marker = self.dir / "blocked"
        for name, text in (("git", _WRAPPER), ("filter", _FILTER)):
            (self.dir / name).write_text(text)
            (self.dir / name).chmod(0o755)
        self.env = {
            **os.environ,
            "PATH": f"{self.dir}{os.pathsep}{os.environ['PATH']}",
            "REAL_GIT": str(REAL_GIT),
            "BLOCK_MATCH": match,
            "BLOCK_WHEN": when,
            "BLOCK_MARKER": str(self.marker),
            "BLOCK_FILTER": str(self.dir / "filter"),
        }
        self.proc: subprocess.Popen[str] | None = None
        self.output: tuple[str, str] = ("", "")  # of a run that never blocked

    def run(self, *argv: str) -> bool:
        """Start ``argv``; True once its git blocked, False if it ended
        first."""
        self.proc = subprocess.Popen(
            list(argv),
            cwd=REPO_ROOT,
            env=self.env,
            start_new_session=True,
            # As in a terminal: a test run started in the background (`&`)
            # ignores SIGINT, and its children would inherit that.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not self.marker.exists():
            if self.proc.poll() is not None:
                self.output = self.proc.communicate()
                return False
            assert time.monotonic() < deadline, "never blocked"
            time.sleep(0.05)
        return True

    def signal(self, sig: int = signal.SIGKILL) -> tuple[int, str, str]:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err

    def release(self) -> tuple[int, str, str]:
        assert self.proc is not None
        (self.dir / "blocked.go").write_text("")
        out, err = self.proc.communicate(timeout=300)
        return self.proc.returncode, out, err


def _command(module: str, project: Project, *args: str) -> list[str]:
    """``python -m MODULE --series <the project's> ARGS`` as a user runs it."""
    return [sys.executable, "-m", module, "--series", str(project.series_file), *args]


def _tool(project: Project, *args: str) -> list[str]:
    return _command("scripts.series", project, *args)


def _rehearsal(project: Project, *args: str) -> list[str]:
    return _command(
        "scripts.series.rebase.rehearsal",
        project,
        "--test-python",
        sys.executable,
        *args,
    )


def _keep_both_sides(path: Path) -> str:
    """A conflict resolved by keeping both sides (the markers dropped)."""
    resolved = "".join(
        line
        for line in path.read_text().splitlines(keepends=True)
        if not line.startswith(("<<<<<<<", "=======", ">>>>>>>"))
    )
    path.write_text(resolved)
    return resolved


def _cli(project: Project, *args: str):
    return run_cli(["--series", str(project.series_file), *args])


def _upstream_moves(project: Project) -> None:
    ops = project.upstream / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 5\n", "return 55\n", 1))
    sh(project.upstream, "git", "commit", "-q", "-am", "upstream main")


def _branches(project: Project, pattern: str) -> list[str]:
    return sh(
        project.root, "git", "branch", "--list", pattern, "--format=%(refname:short)"
    ).split()


# -- 1. the rehearsal beside a user's stopped rebase ---------------------------


def test_the_rehearsal_leaves_a_users_stopped_rebase_as_it_was(two_stages: Project):
    """A real rebase stopped on a conflict, the user's resolution half done
    and another edit in its work repo: the rehearsal refuses, saying what
    to run, and the rebase then continues with every edit."""
    two_stages.commit_all()
    target = _conflicting_target(two_stages)
    series = two_stages.series()
    done = _cli(two_stages, "rebase", "--git", str(target.path), "--rev", target.rev)
    assert "stage 0001 has conflicts" in done.stderr
    state = state_file(series).read_bytes()
    work = rebase_dir(series) / target.label / "vllm"
    envs = work / "vllm/envs.py"
    resolved = _keep_both_sides(envs)
    (work / "vllm/notes.py").write_text("# the user's other edit\n")
    with pytest.raises(SeriesError) as refused:
        rehearsal.rehearse(series, sys.executable)
    assert str(refused.value) == (
        "a rebase is stopped in this checkout; the rehearsal shares its work "
        "area and leaves it alone: go on with `nox -s rebase -- --continue` or "
        "drop it with `nox -s rebase -- --abort`, then rehearse"
    )
    assert state_file(series).read_bytes() == state
    assert envs.read_text() == resolved
    assert (work / "vllm/notes.py").exists()
    go_on = _cli(two_stages, "rebase", "--continue")
    assert go_on.returncode == 0, go_on.stderr
    assert _branches(two_stages, "rebase/*")


def test_a_branch_of_the_same_name_is_not_taken_for_the_tools_own(two_stages: Project):
    """A branch of the rebase's name made by hand while it is stopped is not
    its finished branch: --continue refuses and keeps the state. A branch of
    the rehearsal's name it did not make is not deleted."""
    two_stages.commit_all()
    target = _conflicting_target(two_stages)
    series = two_stages.series()
    main = sh(target.path, "git", "rev-parse", target.rev).strip()
    branch = f"rebase/vllm-git-{main[:12]}"
    done = _cli(two_stages, "rebase", "--git", str(target.path), "--rev", target.rev)
    assert "stage 0001 has conflicts" in done.stderr
    work = rebase_dir(series) / target.label / "vllm"
    _keep_both_sides(work / "vllm/envs.py")
    sh(two_stages.root, "git", "branch", branch)
    by_hand = sh(two_stages.root, "git", "rev-parse", branch).strip()
    refused = _cli(two_stages, "rebase", "--continue")
    assert refused.returncode == 1
    assert f"already has a branch {branch}" in refused.stderr
    assert state_file(series).exists()
    assert sh(two_stages.root, "git", "rev-parse", branch).strip() == by_hand
    sh(two_stages.root, "git", "branch", "-D", branch)
    assert _cli(two_stages, "rebase", "--continue").returncode == 0

    assert _cli(two_stages, "apply").returncode == 0
    repo, _ = rehearsal.make_target(series)
    head = sh(repo, "git", "rev-parse", "HEAD").strip()
    mine = f"rehearsal/vllm-git-{head[:12]}"
    sh(two_stages.root, "git", "branch", mine)
    with pytest.raises(SeriesError, match=f"the branch {mine} is not a rehearsal's"):
        rehearsal.rehearse(series, sys.executable)
    assert _branches(two_stages, "rehearsal/*") == [mine]
    # Its own branch is read by its full name: a tag named as the branch is
    # neither taken for it nor deleted.
    sh(two_stages.root, "git", "branch", "-q", "-D", mine)
    rehearsal.rehearse(series, sys.executable, keep=True)
    sh(two_stages.root, "git", "tag", mine, "HEAD")
    assert rehearsal.rehearse(series, sys.executable) == mine
    assert _branches(two_stages, "rehearsal/*") == []
    assert sh(two_stages.root, "git", "tag", "--list", mine).strip() == mine


def test_a_version_that_leads_out_of_build_is_refused(two_stages: Project):
    for version in ("../../x", "0.35.0/../../x"):
        done = _cli(two_stages, "rebase", "--version", version, "--sha256", "a" * 64)
        assert done.returncode == 1
        assert "--version takes a release number (X.Y.Z)" in done.stderr
    text = two_stages.series_file.read_text()
    up = two_stages.upstream
    two_stages.series_file.write_text(
        text.replace(
            f'git = "{up}"\nrev = "v1"\n', f'version = "../x"\nsha256 = "{"a" * 64}"\n'
        )
    )
    assert "base.version: expected a release" in _cli(two_stages, "status").stderr


# -- 2. git's own leftovers: a worktree git left locked, a ref lock -----------

# The checkout of the branch's worktree of the project (not a test tree's).
BRANCH_WORKTREE = "/project HEAD"


@pytest.fixture
def filtered(two_stages: Project) -> Project:
    """The project committed with every file under a smudge filter that
    only the blocking git defines (so a checkout of it can be held)."""
    (two_stages.root / ".gitattributes").write_text("* filter=block\n")
    two_stages.commit_all()
    _upstream_moves(two_stages)
    return two_stages


def _rebase_to_main(project: Project) -> list[str]:
    return _tool(project, "rebase", "--git", str(project.upstream), "--rev", "main")


@pytest.mark.parametrize("then", ["--continue", "--abort and rebase again"])
def test_a_kill_inside_git_worktree_add_strands_no_rebase(
    filtered: Project, tmp_path: Path, then: str
):
    """Killed inside the checkout of `git worktree add` (the branch's
    worktree), git leaves the worktree registered and locked
    ("initializing"): --continue makes the branch anyway, and so does a new
    rebase after --abort; no worktree is left registered."""
    blocked = Blocked(tmp_path, BRANCH_WORKTREE, "inside")
    assert blocked.run(*_rebase_to_main(filtered))
    blocked.signal()
    listed = sh(filtered.root, "git", "worktree", "list", "--porcelain")
    assert "locked initializing" in listed, "git's own leftover, as a kill leaves it"
    if then == "--continue":
        done = _cli(filtered, "rebase", "--continue")
    else:
        assert _cli(filtered, "rebase", "--abort").returncode == 0
        done = run_cli(_rebase_to_main(filtered)[3:])
    assert done.returncode == 0, done.stderr
    assert _branches(filtered, "rebase/*")
    assert sh(filtered.root, "git", "worktree", "list").count("\n") == 1


def _leave_a_ref_lock(project: Project, ref: str) -> Path:
    """A `git update-ref` killed while it held its lock on ``ref``."""
    proc = subprocess.Popen(
        [str(REAL_GIT), "-C", str(project.root), "update-ref", "--stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    head = sh(project.root, "git", "rev-parse", "HEAD").strip()
    proc.stdin.write(f"start\ncreate {ref} {head}\nprepare\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "start: ok\n"
    assert proc.stdout.readline() == "prepare: ok\n"
    proc.kill()
    proc.wait()
    lock = project.root / ".git" / f"{ref}.lock"
    assert lock.exists()
    return lock


def test_a_ref_lock_a_killed_git_left_is_named_with_what_to_run(two_stages: Project):
    two_stages.commit_all()
    _upstream_moves(two_stages)
    main = sh(two_stages.upstream, "git", "rev-parse", "main").strip()
    lock = _leave_a_ref_lock(two_stages, f"refs/heads/rebase/vllm-git-{main[:12]}")
    done = run_cli(_rebase_to_main(two_stages)[3:])
    assert done.returncode == 1
    assert done.stderr == (
        f"error: git could not create the branch rebase/vllm-git-{main[:12]}: its "
        f"lock file {lock} is held by another git command in this repository, or "
        f"was left by one that was killed; if none is running, `rm {lock}`, then "
        "`nox -s rebase -- --continue`\n"
    )
    lock.unlink()
    assert _cli(two_stages, "rebase", "--continue").returncode == 0
    assert _branches(two_stages, "rebase/*") == [f"rebase/vllm-git-{main[:12]}"]


def test_two_rebases_racing_to_one_branch_the_loser_says_so(
    two_stages: Project, tmp_path: Path
):
    """Another rebase (in another worktree of the repository) makes the
    branch while this one is about to: this one names it, keeps its state,
    and makes its own once the other is deleted."""
    two_stages.commit_all()
    _upstream_moves(two_stages)
    main = sh(two_stages.upstream, "git", "rev-parse", "main").strip()
    branch = f"rebase/vllm-git-{main[:12]}"
    blocked = Blocked(tmp_path, "update-ref refs/heads/rebase/", "before")
    assert blocked.run(*_rebase_to_main(two_stages))
    other = sh(two_stages.root, "git", "rev-parse", "HEAD").strip()
    sh(two_stages.root, "git", "branch", branch, other)
    code, _, err = blocked.release()
    assert code == 1
    assert (
        f"error: the branch {branch} appeared while this rebase made it, at "
        f"{other[:12]}, not this rebase's commit" in err
    )
    assert state_file(two_stages.series()).exists()
    sh(two_stages.root, "git", "branch", "-D", branch)
    assert _cli(two_stages, "rebase", "--continue").returncode == 0
    assert sh(two_stages.root, "git", "rev-parse", branch).strip() != other


def test_a_branch_git_cannot_make_is_named_with_gits_reason(two_stages: Project):
    """A branch named `rebase` keeps git from making rebase/<target>: the
    message gives git's own reason (no lock file is blamed) and the rebase
    is kept, to finish once that is fixed."""
    two_stages.commit_all()
    _upstream_moves(two_stages)
    sh(two_stages.root, "git", "branch", "rebase")
    done = run_cli(_rebase_to_main(two_stages)[3:])
    assert done.returncode == 1
    assert "'refs/heads/rebase' exists" in done.stderr
    assert "lock file" not in done.stderr
    assert state_file(two_stages.series()).exists()
    sh(two_stages.root, "git", "branch", "-D", "rebase")
    assert _cli(two_stages, "rebase", "--continue").returncode == 0


def test_a_fetch_of_a_git_pin_killed_part_way_leaves_nothing_to_meet(
    two_stages: Project, tmp_path: Path, monkeypatch
):
    """The commit of a URL pin is fetched aside and renamed into place once
    whole: killed right after git fetched it, the cache holds no repository
    at the pin's path for a later apply (or another clone's, at the same
    moment) to take, and the next apply fetches it again."""
    commit = sh(two_stages.upstream, "git", "rev-parse", "HEAD").strip()
    text = two_stages.series_file.read_text()
    two_stages.series_file.write_text(
        text.replace(
            f'git = "{two_stages.upstream}"\nrev = "v1"',
            f'git = "{two_stages.upstream.as_uri()}"\nrev = "{commit}"',
        )
    )
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    pin = two_stages.series().base.path
    assert pin.is_relative_to(tmp_path / "cache")
    blocked = Blocked(tmp_path, "fetch -q --depth 1", "after")
    assert blocked.run(*_tool(two_stages, "apply")), blocked.output
    blocked.signal()
    assert not pin.exists()
    assert _cli(two_stages, "apply").returncode == 0
    assert sh(pin, "git", "cat-file", "-t", commit).strip() == "commit"


# -- 3. an interrupted rehearsal and the next one ------------------------------


@pytest.mark.parametrize(
    "match, when",
    [
        ("update-ref refs/heads/re", "after"),  # its branch made, not deleted
        (BRANCH_WORKTREE, "inside"),  # its rebase stopped near its end
    ],
    ids=["branch left", "rebase left"],
)
def test_a_killed_rehearsal_is_cleared_by_the_next(
    filtered: Project, tmp_path: Path, match: str, when: str
):
    assert _cli(filtered, "apply").returncode == 0
    blocked = Blocked(tmp_path, match, when)
    assert blocked.run(*_rehearsal(filtered)), blocked.output
    blocked.signal()
    again = subprocess.run(
        _rehearsal(filtered), cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert "rebase rehearsal passed" in again.stdout
    assert not state_file(filtered.series()).exists()
    assert _branches(filtered, "rehearsal/*") == []
    assert sh(filtered.root, "git", "worktree", "list").count("\n") == 1


def test_ctrl_c_stops_a_rehearsal_in_one_line(filtered: Project, tmp_path: Path):
    assert _cli(filtered, "apply").returncode == 0
    blocked = Blocked(tmp_path, BRANCH_WORKTREE, "inside")
    assert blocked.run(*_rehearsal(filtered)), blocked.output
    code, _, err = blocked.signal(signal.SIGINT)
    assert code == 130
    assert err.splitlines()[-1] == (
        "error: the rebase rehearsal was interrupted; its rebase is dropped, and "
        "the next rehearsal clears what is left"
    )
    assert "Traceback" not in err
    assert not state_file(filtered.series()).exists()


# -- 5. a stale work tree stays at its stage ----------------------------------


@pytest.mark.parametrize("match", ["tag -f stage/0002", "checkout -q -B series"])
def test_a_rebase_killed_as_it_rebuilds_stale_stages_leaves_the_tree_at_its_stage(
    tmp_path: Path, match: str
):
    """The work tree at stage 0001, stage 0002's patch changed since (a
    pull): killed as the rebase rebuilds 0002, or right after it first moves
    the tree (if it does), the tree is at stage 0001, with nothing to abort."""
    project = add_two_stages(Project(tmp_path / "p"))
    series = project.series()
    assert _cli(project, "apply").returncode == 0
    assert _cli(project, "apply", "--upto", "0001").returncode == 0
    patch = project.root / "patches" / project.stages[1]["patch"]
    patch.write_text(patch.read_text().replace("Why this stage exists.", "Pulled."))
    project.commit_all()
    _upstream_moves(project)
    blocked = Blocked(tmp_path, match, "after")
    if blocked.run(*_rebase_to_main(project)):
        blocked.signal()
    else:
        assert blocked.proc is not None and blocked.proc.returncode == 0
    tag = sh(workdir(series), "git", "rev-parse", "refs/tags/stage/0001").strip()
    assert sh(workdir(series), "git", "rev-parse", "HEAD").strip() == tag
    assert "0001  applied" in _cli(project, "status").stdout


# -- 6. an export killed while it checks its PRs ------------------------------


def test_an_export_killed_mid_check_leaves_no_review_and_the_next_clears_it(
    project: Project, tmp_path: Path
):
    """Killed after its check made a vLLM worktree: the last export's review
    ("ok" for a patch it never checked) is gone beside the new patch, and
    the next export removes the worktree and its registration."""
    _stage_with_a_pr_test(project, "def test_on():\n    assert envs.CP_INDEXER\n")
    series = project.series()
    check = ["export", "--signoff", "Eve <eve@example.org>", "--test-python",
             sys.executable]  # fmt: skip
    assert _cli(project, "apply").returncode == 0
    first = _cli(project, *check)
    assert first.returncode == 0, first.stderr
    (review,) = export_dir(series).glob("*.review.md")
    worktrees = sh(workdir(series), "git", "worktree", "list")

    blocked = Blocked(tmp_path, "worktree add -q --detach", "after")
    assert blocked.run(*_tool(project, *check)), blocked.output
    blocked.signal()
    assert review.with_name(review.name.replace(".review.md", ".patch")).exists()
    assert not review.exists(), "a review of the last export's patch"
    assert list(pr_check_dir(series).iterdir()), "the kill left no worktree"

    again = subprocess.run(_tool(project, *check), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "| `git am` | ok |" in review.read_text()
    assert sh(workdir(series), "git", "worktree", "list") == worktrees
    assert list(pr_check_dir(series).iterdir()) == []
