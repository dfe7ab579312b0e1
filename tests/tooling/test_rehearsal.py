# SPDX-License-Identifier: Apache-2.0
"""The rebase rehearsal (nox -s rehearse-rebase) on a synthetic series: its
target has upstream commits that make a hunk merge and others move, the
rebase runs with the checks and ends on its branch, which is deleted."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import run_cli, sh

from scripts.series import SeriesError
from scripts.series.rebase import checks, rebase, rehearsal
from scripts.series.rebase.state import HunkReport, StageReport, state_file


def test_the_rehearsal_merges_a_hunk_and_ends_on_a_branch(two_stages):
    """It runs on a project with uncommitted edits (left as they are), ends
    on its branch, in a namespace of its own, and deletes it; --keep keeps
    it until the next rehearsal, which deletes it first."""
    two_stages.commit_all()
    (two_stages.root / "notes.txt").write_text("uncommitted\n")
    series = two_stages.series()
    assert run_cli(["--series", str(two_stages.series_file), "apply"]).returncode == 0
    branch = rehearsal.rehearse(series, sys.executable)
    assert branch.startswith("rehearsal/vllm-git-")
    assert sh(two_stages.root, "git", "branch", "--list", "rehearsal/*") == ""
    assert (two_stages.root / "notes.txt").read_text() == "uncommitted\n"
    target = rehearsal.target_dir(series)
    log = sh(target, "git", "log", "--format=%s").splitlines()
    assert len(log) == 4 and log[0] == "upstream: README.md"
    # Each upstream commit changes the one file it names.
    for back, subject in enumerate(log[:3]):
        changed = sh(target, "git", "diff", "--name-only", f"HEAD~{back + 1}",
                     f"HEAD~{back}").split()  # fmt: skip
        named = re.search(r"(?:of|upstream:) (\S+?)(?:'s hunk)?$", subject)
        assert changed == [named.group(1)], subject
    # The context line landed inside stage 0001's hunk of vllm/envs.py.
    envs = (target / "vllm" / "envs.py").read_text().splitlines()
    assert envs[2] == rehearsal.UPSTREAM_NOTE.strip()
    assert rehearsal.rehearse(series, sys.executable, keep=True) == branch
    assert sh(two_stages.root, "git", "branch", "--list", branch).strip()
    assert rehearsal.rehearse(series, sys.executable) == branch
    assert sh(two_stages.root, "git", "branch", "--list", "rehearsal/*") == ""


def test_every_outcome_but_applied_or_merged_fails_it(two_stages):
    series = two_stages.series()
    merged = [HunkReport("vllm/envs.py", "@@", "merged")]
    reports = [
        StageReport("0001", "Striped indexer", "applied cleanly", hunks=merged),
        StageReport("0002", "Top-k gate", "already upstream", "its probe passes"),
    ]
    assert rehearsal.problems(reports, series) == [
        "stage 0002: already upstream (its probe passes)"
    ]
    reports[1].outcome = "merged"
    assert rehearsal.problems(reports, series) == []
    reports[0].hunks = [HunkReport("vllm/envs.py", "@@", "applied cleanly")]
    assert rehearsal.problems(reports, series) == [
        "no hunk went through the three-way merge"
    ]
    assert rehearsal.problems(reports[:1], series) == [
        "stage 0002: not in the report",
        "no hunk went through the three-way merge",
    ]


def test_a_stopped_rehearsal_is_aborted_with_its_logs_kept(
    project, monkeypatch, capsys
):
    _a_merge_makes_other_code(monkeypatch, "0001", "vllm/envs.py")
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        {"vllm/cp_indexer.py": "raise ImportError('planted by the test')\n"},
    )
    project.commit_all()
    series = project.series()
    assert run_cli(["--series", str(project.series_file), "apply"]).returncode == 0
    with pytest.raises(SeriesError) as stopped:
        rehearsal.rehearse(series, sys.executable)
    assert "does not import: vllm.cp_indexer: ImportError: planted" in str(
        stopped.value
    )
    assert "rebase was aborted" in str(stopped.value)
    assert not state_file(series).exists(), "a real rebase would be refused"
    logs = rehearsal.target_dir(series).parent / "logs"
    assert logs.is_dir()
    # --keep keeps the stopped rebase to look into.
    with pytest.raises(SeriesError, match="kept for a look"):
        rehearsal.rehearse(series, sys.executable, keep=True)
    assert state_file(series).exists()
    # The next rehearsal drops the one kept, then stops (and drops) anew.
    capsys.readouterr()
    with pytest.raises(SeriesError, match="rebase was aborted"):
        rehearsal.rehearse(series, sys.executable)
    assert "a rehearsal stopped earlier left its rebase; dropping it" in (
        capsys.readouterr().out
    )
    assert not state_file(series).exists()

    # Interrupted with its own rebase stopped: dropped, unless --keep.
    start = rebase.start

    def interrupted(*args, **kwargs):
        try:
            start(*args, **kwargs)
        except SeriesError:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(rebase, "start", interrupted)
    for keep in (False, True):
        with pytest.raises(KeyboardInterrupt):
            rehearsal.rehearse(series, sys.executable, keep=keep)
        assert state_file(series).exists() is keep


def test_it_tests_a_stage_only_where_the_merge_made_other_code(
    project, capsys, monkeypatch
):
    """The target is the release plus comment lines: a rebased stage whose
    files hold the applied stages plus those lines holds the code
    apply-and-test tests, and is not tested again (a planted failing test
    does not stop it); a merge that made other code is (it does)."""
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        {"vllm/cp_indexer.py": "def split():\n    return 'striped'\n"},
    )
    project.add_stage(
        "0002",
        {"vllm/ops.py": ("    return 20\n", "    return 2020\n")},
        depends_on=("0001",),
    )
    failing = "def test_planted():\n    assert False, 'planted by the test'\n"
    for stage in ("0001", "0002"):
        (project.root / "tests" / f"stage_{stage}").mkdir()
        (project.root / "tests" / f"stage_{stage}" / "test_planted.py").write_text(
            failing
        )
    project.commit_all()
    series = project.series()
    assert run_cli(["--series", str(project.series_file), "apply"]).returncode == 0
    rehearsal.rehearse(series, sys.executable)
    out = capsys.readouterr().out
    assert "| 0001 Stage 0001 | merged |" in out
    for stage in ("0001", "0002"):
        assert f"stage {stage} on the target: its files hold the applied" in out

    _a_merge_makes_other_code(monkeypatch, "0002", "vllm/ops.py")
    with pytest.raises(SeriesError, match="0002 merged onto the target but its tests"):
        rehearsal.rehearse(series, sys.executable)
    out = capsys.readouterr().out
    assert "stage 0001 on the target: its files hold the applied" in out
    assert "stage 0002 on the target: importing" in out


def _a_merge_makes_other_code(monkeypatch, stage_id: str, path: str) -> None:
    """Plant a merge that adds a line to ``path`` as it makes ``stage_id``'s
    commit on the target."""
    commit_stage = rebase._commit_stage

    def merged_wrong(series, repo, stage, state):
        if stage.id == stage_id:
            changed = repo / path
            changed.write_text(changed.read_text() + "MADE_BY_THE_MERGE = 1\n")
        commit_stage(series, repo, stage, state)

    monkeypatch.setattr(rebase, "_commit_stage", merged_wrong)


@pytest.mark.parametrize(
    ("change", "holds"),
    [
        ("the rehearsal's line in a lower stage's file", True),
        ("a file no stage touches", True),
        ("other code in a lower stage's file", False),
        ("other code in the top stage's file", False),
        ("a lower stage's new file gone", False),
        ("a file a stage deletes, still gone", True),
        ("a file a stage deletes, back", False),
    ],
)
def test_the_exact_merge_check_reads_every_stages_files(tmp_path, change, holds):
    """A stage is left to apply-and-test only where every file the stages up
    to it change (the lower stages' too) holds what they hold on the release,
    give or take the rehearsal's comment lines."""
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(repo, "git", "init", "-q", "-b", "main")
    for name in ("lower.py", "top.py", "other.py", "gone.py"):
        (repo / name).write_text("a = 1\nb = 2\n")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "release")
    old_base = sh(repo, "git", "rev-parse", "HEAD").strip()
    (repo / "lower.py").write_text("a = 1\nlower = 1\nb = 2\n")
    (repo / "new.py").write_text("new = 1\n")
    (repo / "gone.py").unlink()
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "lower stage")
    (repo / "top.py").write_text("a = 1\ntop = 1\nb = 2\n")
    sh(repo, "git", "commit", "-qam", "top stage")
    old = sh(repo, "git", "rev-parse", "HEAD").strip()
    note = rehearsal.UPSTREAM_NOTE
    if change == "a lower stage's new file gone":
        (repo / "new.py").unlink()
    elif change == "a file a stage deletes, back":
        (repo / "gone.py").write_text("a = 1\nb = 2\n")
        sh(repo, "git", "add", "gone.py")
    elif change == "a file a stage deletes, still gone":
        (repo / "other.py").write_text("c = 3\n")
    else:
        path, added = {
            "the rehearsal's line in a lower stage's file": ("lower.py", note),
            "a file no stage touches": ("other.py", "c = 3\n"),
            "other code in a lower stage's file": ("lower.py", "c = 3\n"),
            "other code in the top stage's file": ("top.py", "c = 3\n"),
        }[change]
        (repo / path).write_text(added + (repo / path).read_text())
    sh(repo, "git", "commit", "-qam", "rebased")
    assert checks.holds_the_applied_stages(repo, old_base, old) is holds


def test_the_rehearsal_command_says_how_it_ended(two_stages, capsys, monkeypatch):
    """``python3 -m scripts.series.rebase.rehearsal`` (nox -s rehearse-rebase):
    0 when it passed; an error is one line on standard error and status 1;
    an interrupt says what became of its rebase, status 130."""
    two_stages.commit_all()
    assert run_cli(["--series", str(two_stages.series_file), "apply"]).returncode == 0
    args = ["--series", str(two_stages.series_file), "--test-python"]
    assert rehearsal.main([*args, sys.executable]) == 0
    assert "rebase rehearsal passed: 2 stage(s)" in capsys.readouterr().out
    assert rehearsal.main([*args, "/nonexistent/python3"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("error: ") and "--test-python /nonexistent/python3" in said

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit):
        rehearsal.main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--keep keep the rebase's branch, or a stopped rebase" in usage
    monkeypatch.setattr(rehearsal, "rehearse", interrupted)
    for extra, kept in (([], "dropped"), (["--keep"], "kept (--keep)")):
        assert rehearsal.main([*args, sys.executable, *extra]) == 130
        assert capsys.readouterr().err == (
            f"error: the rebase rehearsal was interrupted; its rebase is {kept}, "
            "and the next rehearsal clears what is left\n"
        )


def test_a_hunk_from_line_5_is_moved_by_the_line_at_the_top(project):
    """The rehearsal's top-of-file line goes into a file whose stage hunk
    starts at line 5 or later: four lines apart, git still merges the two,
    and the rehearsal passes with the hunk moved."""
    project.add_stage(
        "0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")}
    )
    # Line 8 of ops.py (a blank line before op_2): the hunk starts at line 5.
    project.add_stage(
        "0002",
        {"vllm/ops.py": ("return 1\n\n\ndef op_2", "return 1\n\n# two\ndef op_2")},
    )
    project.commit_all()
    series = project.series()
    assert run_cli(["--series", str(project.series_file), "apply"]).returncode == 0
    _, changes = rehearsal.make_target(series)
    assert "vllm/ops.py: a line at the top (its hunks move)" in changes
    rehearsal.rehearse(series, sys.executable)
