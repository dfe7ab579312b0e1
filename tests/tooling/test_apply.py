# SPDX-License-Identifier: Apache-2.0
"""apply: order, zero fuzz, failure reporting, dirty trees, idempotence,
interruption, determinism."""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from scripts.series import SeriesError
from scripts.series.git import changed_files, git_out
from scripts.series.layout import workdir
from scripts.series.stages.apply import StageApplyError, apply
from scripts.series.stages.status import format_status, tree_status
from tests.tooling.conftest import Project, sh


def _log(repo):
    return git_out(repo, "log", "--format=%s|%an|%ad", "--date=iso-strict").splitlines()


def test_stages_apply_in_order_one_commit_each(two_stages: Project):
    repo = apply(two_stages.series())
    assert _log(repo) == [
        "Top-k gate|Ada Dev|2026-02-03T04:05:06+00:00",
        "Striped indexer|Ada Dev|2026-02-03T04:05:06+00:00",
        f"vllm from {two_stages.upstream} at v1|dsa-indexer-series|"
        "2000-01-01T00:00:00+00:00",
    ]
    message = git_out(repo, "log", "-1", "--format=%B", "stage/0001")
    assert message.startswith("Striped indexer\n\nWhy this stage exists.")
    assert "Signed-off-by: Ada Dev <ada@example.com>" in message
    assert (
        repo / "vllm/cp_indexer.py"
    ).read_text() == "def split():\n    return 'striped'\n"
    assert "CP_INDEXER = True" in (repo / "vllm/envs.py").read_text()
    assert "return 2020" in (repo / "vllm/ops.py").read_text()
    assert not changed_files(repo)


def test_stage_order_matters(two_stages: Project):
    """Stage 0002 edits a line stage 0001 adds: applied alone it must fail."""
    two_stages.stages.reverse()
    two_stages.stages[0]["id"], two_stages.stages[1]["id"] = "0001", "0002"
    two_stages.stages[0]["depends_on"] = []
    two_stages.write_series()
    with pytest.raises(StageApplyError, match="stage 0001 .*file vllm/envs.py, hunk 1"):
        apply(two_stages.series())


def test_commit_ids_are_the_same_on_every_machine(two_stages: Project, tmp_path):
    first = apply(two_stages.series())
    ids = git_out(first, "rev-parse", "base", "stage/0001", "stage/0002")
    # A second checkout of the same series elsewhere.
    import shutil

    other = tmp_path / "elsewhere"
    shutil.copytree(two_stages.root, other, ignore=shutil.ignore_patterns("build"))
    from scripts.series.config import load_series

    second = apply(load_series(other / "patches" / "series.toml"))
    assert second != first
    assert git_out(second, "rev-parse", "base", "stage/0001", "stage/0002") == ids


def test_a_failing_hunk_is_named_and_the_tree_stays_at_the_last_good_stage(
    two_stages: Project,
):
    patch = two_stages.root / "patches" / two_stages.stages[1]["patch"]
    # Break the context of the second file's hunk: it no longer matches vLLM.
    text = patch.read_text().replace(" def op_21():", " def op_twenty_one():")
    patch.write_text(text)
    with pytest.raises(StageApplyError) as failure:
        apply(two_stages.series())
    message = str(failure.value)
    assert "stage 0002 (Top-k gate)" in message
    assert two_stages.stages[1]["patch"] in message
    assert "file vllm/ops.py, hunk 1 (@@ -" in message
    repo = workdir(two_stages.series())
    assert git_out(repo, "rev-parse", "HEAD") == git_out(
        repo, "rev-parse", "stage/0001"
    )
    assert not changed_files(repo), "a failed stage must leave no partial edits"
    assert "CP_INDEXER = False" in (repo / "vllm/envs.py").read_text()


def test_a_context_line_changed_by_an_earlier_stage_fails_exactly(
    two_stages: Project,
):
    """Stage 0001 now changes a line that is only context in stage 0002's
    envs.py hunk. A three-way merge would take it silently (the preimage blob
    is in the repo); the exact apply must stop and name the hunk."""
    from scripts.series.stages.refresh import refresh

    series = two_stages.series()
    repo = apply(series, "0001")
    envs = repo / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_5 = 5\n", "VAR_5 = 55\n"))
    refresh(series)
    with pytest.raises(StageApplyError, match=r"file vllm/envs.py, hunk 1 \(@@ -"):
        apply(series)


def test_a_test_tree_with_edits_is_refused(two_stages: Project):
    from scripts.series.stages.trees import stage_tree

    series = two_stages.series()
    apply(series)
    tree = stage_tree(series, "0001")
    (tree / "vllm/ops.py").write_text("edited in the test tree\n")
    with pytest.raises(SeriesError, match="has edits"):
        stage_tree(series, "0001")
    assert (tree / "vllm/ops.py").read_text() == "edited in the test tree\n"


def test_uncommitted_edits_are_never_overwritten(two_stages: Project):
    series = two_stages.series()
    repo = apply(series, "0001")
    (repo / "vllm/ops.py").write_text("my precious edit\n")
    (repo / "notes.txt").write_text("also mine\n")
    with pytest.raises(SeriesError, match="uncommitted edits") as refusal:
        apply(series)
    assert "refresh" in str(refusal.value)
    assert "vllm/ops.py" in str(refusal.value)
    assert (repo / "vllm/ops.py").read_text() == "my precious edit\n"
    assert (repo / "notes.txt").read_text() == "also mine\n"
    assert git_out(repo, "rev-parse", "HEAD") == git_out(
        repo, "rev-parse", "stage/0001"
    )
    # The commands it names work as given: stash sets both files aside.
    message = str(refusal.value)
    assert "<tree>" not in message
    stash = message.split("aside, `")[1].split("`")[0]
    subprocess.run(shlex.split(stash), check=True, capture_output=True)
    apply(series)
    assert not (repo / "notes.txt").exists()


def test_a_staged_rename_is_named_by_both_its_paths(two_stages: Project):
    """git mv in the tree: the refusal names the file's old and new paths
    as they are, not a path cut from git's rename record."""
    series = two_stages.series()
    repo = apply(series)
    sh(repo, "git", "mv", "vllm/ops.py", "vllm/ops_moved.py")
    with pytest.raises(SeriesError, match="uncommitted edits") as refusal:
        apply(series)
    listed = str(refusal.value).split(":\n", 1)[1].split("\nTo keep")[0].split()
    assert listed == ["vllm/ops.py", "vllm/ops_moved.py"]


def test_reapplying_an_up_to_date_tree_is_a_no_op(two_stages: Project, capsys):
    series = two_stages.series()
    repo = apply(series)
    head = git_out(repo, "rev-parse", "HEAD")
    reflog = git_out(repo, "reflog")
    mtime = (repo / "vllm/envs.py").stat().st_mtime_ns
    capsys.readouterr()
    apply(series)
    assert capsys.readouterr().out.splitlines() == [
        "stage 0001: up to date",
        "stage 0002: up to date",
    ]
    assert git_out(repo, "rev-parse", "HEAD") == head
    assert git_out(repo, "reflog") == reflog
    assert (repo / "vllm/envs.py").stat().st_mtime_ns == mtime


def test_a_changed_stage_is_reapplied_with_the_ones_after_it(two_stages: Project):
    series = two_stages.series()
    repo = apply(series)
    old_0001 = git_out(repo, "rev-parse", "stage/0001")
    overlay = two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    overlay.write_text("def split():\n    return 'stripes of 1024'\n")
    apply(series)
    assert git_out(repo, "rev-parse", "stage/0001") != old_0001
    assert "1024" in (repo / "vllm/cp_indexer.py").read_text()
    assert git_out(repo, "rev-parse", "stage/0002^") == git_out(
        repo, "rev-parse", "stage/0001"
    )


def test_apply_upto_and_back_keeps_the_commits(two_stages: Project):
    series = two_stages.series()
    repo = apply(series)
    tip = git_out(repo, "rev-parse", "HEAD")
    apply(series, "0001")
    assert "CP_INDEXER = False" in (repo / "vllm/envs.py").read_text()
    apply(series, "base")
    assert not (repo / "vllm/cp_indexer.py").exists()
    apply(series)
    assert git_out(repo, "rev-parse", "HEAD") == tip


def _clean_ids(project: Project, tmp_path) -> str:
    """Stage commit ids of an uninterrupted apply of a copy of the project."""
    import shutil

    from scripts.series.config import load_series

    clean = tmp_path / "clean"
    shutil.copytree(project.root, clean, ignore=shutil.ignore_patterns("build"))
    repo = apply(load_series(clean / "patches" / "series.toml"), quiet=True)
    return git_out(repo, "rev-parse", "stage/0001", "stage/0002")


def _interrupt(monkeypatch, name: str, calls: int) -> None:
    """Raise KeyboardInterrupt in scripts.series.stages.apply's ``name`` on
    its ``calls``-th call, as a kill at that point would leave things."""
    import scripts.series.stages.apply as apply_module

    real = getattr(apply_module, name)
    seen = []

    def interrupted(*args, **kwargs):
        seen.append(1)
        if len(seen) == calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(apply_module, name, interrupted)


def test_an_apply_killed_before_its_commit_leaves_the_tree_clean_and_resumes(
    two_stages: Project, monkeypatch, tmp_path
):
    """Killed before stage 0002's commit is made: the stage was built in
    git's object store, so the tree is clean (at the base, where it was);
    the next apply ends with the same commits as an uninterrupted one."""
    series = two_stages.series()
    _interrupt(monkeypatch, "commit_tree", 2)
    with pytest.raises(KeyboardInterrupt):
        apply(series)
    repo = workdir(series)
    assert not changed_files(repo)
    monkeypatch.undo()
    apply(series)
    assert not changed_files(repo)
    assert git_out(repo, "rev-parse", "HEAD") == git_out(
        repo, "rev-parse", "stage/0002"
    )
    assert git_out(repo, "rev-parse", "stage/0001", "stage/0002") == _clean_ids(
        two_stages, tmp_path
    )


def test_an_apply_killed_after_its_commit_goes_on_from_it(
    two_stages: Project, monkeypatch, tmp_path
):
    """Killed after stage 0002's commit, before it is recorded: the commit is
    remade (the same id) by the next apply; refresh and check work after."""
    from scripts.series.stages.check import stale_files
    from scripts.series.stages.refresh import refresh

    series = two_stages.series()
    _interrupt(monkeypatch, "_record_stage", 2)
    with pytest.raises(KeyboardInterrupt):
        apply(series)
    repo = workdir(series)
    assert not changed_files(repo)
    monkeypatch.undo()
    apply(series)
    assert git_out(repo, "rev-parse", "stage/0001", "stage/0002") == _clean_ids(
        two_stages, tmp_path
    )
    assert git_out(repo, "rev-parse", "HEAD") == git_out(
        repo, "rev-parse", "stage/0002"
    )
    refresh(series)
    assert stale_files(series) == []


def test_edits_made_after_a_killed_apply_are_refused_not_stashed(
    two_stages: Project, monkeypatch
):
    """A kill leaves no half-applied stage to tell apart from your edits, so
    edits made after it are refused like any others, and kept."""
    series = two_stages.series()
    _interrupt(monkeypatch, "commit_tree", 2)
    with pytest.raises(KeyboardInterrupt):
        apply(series)
    monkeypatch.undo()
    repo = workdir(series)
    (repo / "README.md").write_text("my notes\n")
    with pytest.raises(SeriesError, match="uncommitted edits"):
        apply(series)
    assert (repo / "README.md").read_text() == "my notes\n"
    assert git_out(repo, "stash", "list") == ""


def test_commits_on_top_are_not_overwritten(two_stages: Project):
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series, "0001")
    (repo / "vllm/ops.py").write_text("committed work\n")
    sh(repo, "git", "commit", "-qam", "my work")
    with pytest.raises(SeriesError, match="commits on top of the series"):
        apply(series)
    assert (repo / "vllm/ops.py").read_text() == "committed work\n"


def test_a_commit_on_the_series_branch_survives_a_detached_head(
    two_stages: Project,
):
    """A commit made on the series branch, then HEAD detached at a stage tag:
    apply must not reset the branch under it."""
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series)
    (repo / "README.md").write_text("my work\n")
    sh(repo, "git", "commit", "-qam", "my work")
    mine = git_out(repo, "rev-parse", "series")
    sh(repo, "git", "checkout", "-q", "--detach", "stage/0001")
    with pytest.raises(SeriesError, match="branch holds commits that are not"):
        apply(series)
    assert git_out(repo, "rev-parse", "series") == mine


def test_a_users_tag_named_series_does_not_stand_in_for_the_branch(
    two_stages: Project,
):
    """The same, with a tag called "series" at the stage tip: refs are read
    by their full names, so the branch's commit is still seen and kept."""
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series)
    sh(repo, "git", "tag", "series", "stage/0002")
    (repo / "README.md").write_text("my work\n")
    sh(repo, "git", "commit", "-qam", "my work")
    mine = git_out(repo, "rev-parse", "refs/heads/series")
    sh(repo, "git", "checkout", "-q", "--detach", "stage/0001")
    with pytest.raises(SeriesError, match="branch holds commits that are not"):
        apply(series)
    assert git_out(repo, "rev-parse", "refs/heads/series") == mine


def test_overlay_errors_are_clear(project: Project):
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_1 = 1\n", "VAR_1 = 11\n")},
        {"vllm/new_module.py": "x = 1\n"},
    )
    (project.root / "vllm_overlay/vllm/new_module.py").unlink()
    with pytest.raises(StageApplyError, match="overlay vllm/new_module.py is missing"):
        apply(project.series())
    repo = workdir(project.series())
    assert not changed_files(repo)
    assert git_out(repo, "rev-parse", "HEAD") == git_out(repo, "rev-parse", "base")


def test_an_overlay_may_not_replace_a_vllm_file(project: Project):
    project.add_stage("0001", {"vllm/envs.py": ("VAR_1 = 1\n", "VAR_1 = 11\n")})
    project.stages[0]["overlays"] = ["vllm/ops.py"]
    project.write_series()
    (project.root / "vllm_overlay/vllm").mkdir(parents=True)
    (project.root / "vllm_overlay/vllm/ops.py").write_text("replaced\n")
    with pytest.raises(StageApplyError, match="would overwrite a file"):
        apply(project.series())
    assert "def op_1" in (workdir(project.series()) / "vllm/ops.py").read_text()


def test_a_file_that_is_not_a_patch_is_reported(project: Project):
    project.add_stage("0001", {"vllm/envs.py": ("VAR_1 = 1\n", "VAR_1 = 11\n")})
    (project.root / "patches" / project.stages[0]["patch"]).write_text("hello\n")
    with pytest.raises(SeriesError, match="no Author, Email, Date, Subject header"):
        apply(project.series())


def test_a_work_dir_of_another_base_is_not_touched(two_stages: Project):
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series)
    (two_stages.upstream / "README.md").write_text("moved on\n")
    sh(two_stages.upstream, "git", "commit", "-qam", "newer")
    sh(two_stages.upstream, "git", "tag", "-f", "v1")
    with pytest.raises(SeriesError, match="does not hold this base"):
        apply(two_stages.series())
    assert (repo / "README.md").read_text() == "synthetic vLLM\n"


def test_status_reports_stages_and_edits(two_stages: Project):
    series = two_stages.series()
    text = format_status(series, tree_status(series))
    assert "not prepared" in text
    repo = apply(series, "0001")
    status = tree_status(series)
    assert [(s.id, s.state) for s in status.stages] == [
        ("0001", "applied"),
        ("0002", "not applied"),
    ]
    assert status.head_stage == "0001" and not status.edited_files
    (repo / "vllm/ops.py").write_text("edit\n")
    overlay = two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    overlay.write_text("changed = True\n")
    status = tree_status(series)
    assert [(s.id, s.state) for s in status.stages] == [
        ("0001", "stale"),
        ("0002", "not applied"),
    ]
    assert status.edited_files == ("vllm/ops.py",)
    assert "uncommitted edits in 1 file(s)" in format_status(series, status)


@pytest.mark.parametrize("on_series_branch", [True, False])
def test_commits_on_top_of_the_stages_are_refused_with_commands_that_work(
    two_stages: Project, on_series_branch: bool
):
    """A commit made on top of the stages (on the series branch, or on a
    branch of the user's): apply refuses, naming a command that keeps the
    commit and lets the next apply run."""
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series)
    if not on_series_branch:
        sh(repo, "git", "checkout", "-q", "-b", "mine")
    (repo / "notes.txt").write_text("mine\n")
    sh(repo, "git", "add", "notes.txt")
    sh(repo, "git", "commit", "-q", "-m", "my work")
    mine = git_out(repo, "rev-parse", "HEAD")
    with pytest.raises(SeriesError, match="is not a stage commit") as refusal:
        apply(series)
    command = str(refusal.value).split("`")[-2]
    subprocess.run(command, shell=True, check=True, capture_output=True)
    apply(series)
    branch = "my-work" if on_series_branch else "mine"
    assert git_out(repo, "rev-parse", branch) == mine
    assert not (repo / "notes.txt").exists()


def test_moving_down_says_so_and_status_shows_the_stages_above(
    two_stages: Project, capsys
):
    series = two_stages.series()
    apply(series)
    capsys.readouterr()
    apply(series, "0001")
    out = capsys.readouterr().out
    assert "stage 0001: up to date" in out
    assert "moved the tree from stage 0002 down to 0001" in out
    status = tree_status(series)
    assert [(s.id, s.state) for s in status.stages] == [
        ("0001", "applied"),
        ("0002", "above HEAD"),
    ]
    apply(series)  # back up: reuses the recorded commit
    assert "up to date" in capsys.readouterr().out
    assert [s.state for s in tree_status(series).stages] == ["applied", "applied"]


def test_series_files_keep_their_bytes_in_a_crlf_clone(tmp_path):
    """A clone with core.autocrlf=true (Windows defaults) must not rewrite
    the patches or overlays: they apply and compare byte for byte."""
    import subprocess

    from scripts.series.config import REPO_ROOT

    if not (REPO_ROOT / ".git").exists():
        pytest.skip("the project is not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(
        ["git", "clone", "-q", "-c", "core.autocrlf=true", str(REPO_ROOT), str(clone)],
        check=True,
    )
    files = git_out(clone, "ls-files", "patches", "vllm_overlay").split()
    assert files
    for name in files:
        committed = subprocess.run(
            ["git", "-C", str(clone), "cat-file", "blob", f"HEAD:{name}"],
            capture_output=True,
            check=True,
        ).stdout
        assert (clone / name).read_bytes() == committed, name


def test_a_git_base_gets_the_version_metadata_an_install_would(project: Project):
    """A checkout has no vllm.egg-info (an sdist has): without a version vLLM
    turns Triton off. The base gets setuptools-scm's version of the commit."""
    import importlib.metadata
    from dataclasses import replace

    from scripts.series.config import GitBase
    from scripts.series.stages.prepare import git_version, prepare
    from tests.tooling.conftest import sh

    upstream = project.upstream
    sh(upstream, "git", "tag", "v0.33.0")
    assert git_version(upstream, "HEAD") == "0.33.0"
    (upstream / "vllm/ops.py").write_text("drift\n")
    sh(upstream, "git", "commit", "-qam", "drift")
    short = git_out(upstream, "rev-parse", "--short=9", "HEAD")
    assert git_version(upstream, "HEAD") == f"0.33.1.dev1+g{short}"
    sh(upstream, "git", "tag", "-d", "v0.33.0", "v1")
    assert git_version(upstream, "HEAD") == f"0.0.0.dev0+g{short}"
    sh(upstream, "git", "tag", "v0.33.0", "HEAD~1")
    (upstream / "vllm/_version.py").unlink()
    sh(upstream, "git", "commit", "-qam", "no version file, as in vLLM's repo")
    repo = prepare(replace(project.series(), base=GitBase("vllm", upstream, "HEAD")))
    found = list(importlib.metadata.distributions(name="vllm", path=[str(repo)]))
    assert [d.version for d in found] == [git_version(upstream, "HEAD")]
    assert "0.33.1.dev2" in (repo / "vllm/_version.py").read_text()
    assert git_out(repo, "ls-files", "vllm.egg-info", "vllm/_version.py").split() == [
        "vllm.egg-info/PKG-INFO",
        "vllm/_version.py",
    ]


@pytest.mark.parametrize(
    "error, why",
    [
        (RuntimeError("Symlink loop from '...'"), "a symlink loop"),  # Python < 3.13
        (OSError(errno.ELOOP, os.strerror(errno.ELOOP)), "a symlink loop"),  # 3.13+
        (OSError(errno.EACCES, os.strerror(errno.EACCES)), os.strerror(errno.EACCES)),
    ],
)
def test_a_path_that_cannot_be_followed_is_named_on_every_python(
    project: Project, monkeypatch, error, why
):
    """Path.resolve reports a symlink loop as RuntimeError before Python 3.13
    and as OSError(ELOOP) from 3.13: both are named a loop; another OSError
    gives its own reason."""
    series = project.series()
    link = project.root / "vllm_overlay" / "vllm" / "looped.py"

    def resolve(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(Path, "resolve", resolve)
    with pytest.raises(SeriesError) as e:
        series.inside(link)
    assert str(e.value) == (
        f"{link} cannot be followed ({why}); the series' files must be plain "
        "files, or links to files, inside the project"
    )


def test_an_overlay_that_is_a_symlink_loop_is_named(project: Project):
    """A listed overlay linked to itself cannot be followed: one line naming
    it (not Python's RuntimeError), and the tree stays at the last good
    stage, the link as it was."""
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_1 = 1\n", "VAR_1 = 11\n")},
        {"vllm/new_module.py": "x = 1\n"},
    )
    overlay = project.root / "vllm_overlay/vllm/new_module.py"
    overlay.unlink()
    overlay.symlink_to(overlay.name)
    with pytest.raises(SeriesError, match=r"vllm/new_module\.py .*symlink loop") as e:
        apply(project.series())
    assert "\n" not in str(e.value)
    assert overlay.is_symlink(), "the user's link is left as it is"
    repo = workdir(project.series())
    assert not changed_files(repo)
    assert git_out(repo, "rev-parse", "HEAD") == git_out(repo, "rev-parse", "base")
