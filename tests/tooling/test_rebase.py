# SPDX-License-Identifier: Apache-2.0
"""`rebase`: the stages onto a newer synthetic vLLM (a local git checkout at
a revision), with conflicts, recorded resolutions, upstreamed stages and a
dropped hunk, ending on the project branch that merging adopts."""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import Project, add_two_stages, needs_release_pin, sh, write_files

from scripts.series import SeriesError, files
from scripts.series.config import GitBase, Series, load_series
from scripts.series.layout import rebase_branch
from scripts.series.rebase import branch, rebase
from scripts.series.rebase.state import format_report, load_state, state_file
from scripts.series.rebase.tree_tester import TreeTester, check_log
from scripts.series.stages.apply import apply
from scripts.series.stages.patchfile import read_patch

TARGET = "v2"


def _target(project: Project, edits: dict[str, tuple[str, str]], files=None):
    """Tag ``TARGET`` on the synthetic upstream: v1 plus ``edits``."""
    for rel, (old, new) in edits.items():
        path = project.upstream / rel
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))
    write_files(project.upstream, files or {})
    sh(project.upstream, "git", "add", "-A")
    sh(project.upstream, "git", "commit", "-q", "-m", "upstream v2")
    sh(project.upstream, "git", "tag", TARGET)
    return GitBase("vllm", project.upstream, TARGET)


def _pinned(target: GitBase) -> GitBase:
    """The target as a rebase pins it: at its commit, not a moving ref."""
    commit = sh(target.path, "git", "rev-parse", f"{target.rev}^{{commit}}").strip()
    return GitBase(target.name, target.path, commit)


@pytest.fixture
def two_stages(two_stages: Project) -> Project:
    """The synthetic project, committed: a rebase ends on a branch of it."""
    two_stages.commit_all()
    return two_stages


def _branch(target: GitBase) -> str:
    return rebase_branch(_pinned(target))


def _rebased(project: Project, target: GitBase) -> Series:
    """The rebased series, as a checkout of the rebase's branch has it."""
    sh(project.root, "git", "switch", "-q", _branch(target))
    return project.series()


def _conflicting_target(two_stages: Project) -> GitBase:
    """A target whose change to vllm/envs.py conflicts with both stages."""
    return _target(
        two_stages, {"vllm/envs.py": ("VAR_3 = 3\nVAR_4", "VAR_3 = 33\nVAR_4")}
    )


def _past_the_first_conflict(two_stages: Project) -> GitBase:
    """A rebase onto ``_conflicting_target`` stopped at stage 0001, with the
    conflict resolved in its work repo (not yet continued)."""
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("False"))
    return target


def _report(project: Project, target: GitBase) -> str:
    name = f"docs/rebased_onto_{_pinned(target).label}.md"
    return sh(project.root, "git", "show", f"{_branch(target)}:{name}")


def _outcomes(reports):
    return {r.id: r.outcome for r in reports}


def _snapshot(project: Project) -> dict[str, bytes]:
    return {
        str(p.relative_to(project.root)): p.read_bytes()
        for folder in ("patches", "vllm_overlay")
        for p in sorted((project.root / folder).rglob("*"))
        if p.is_file()
    }


def _work_repo(project: Project) -> Path:
    return project.root / "build" / "rebase" / f"vllm-git-{TARGET}" / "vllm"


def test_clean_rebase_ends_on_a_branch_that_merging_adopts(two_stages):
    target = _target(two_stages, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    before = _snapshot(two_stages)
    head = sh(two_stages.root, "git", "rev-parse", "HEAD")
    reports = rebase.start(two_stages.series(), target)
    assert _outcomes(reports) == {"0001": "applied cleanly", "0002": "applied cleanly"}
    assert {h.outcome for r in reports for h in r.hunks} == {"applied cleanly"}
    # the checkout is untouched: same commit, same files, nothing uncommitted
    assert _snapshot(two_stages) == before
    assert sh(two_stages.root, "git", "rev-parse", "HEAD") == head
    assert sh(two_stages.root, "git", "status", "--porcelain") == ""
    # one commit on the project's HEAD
    assert sh(two_stages.root, "git", "rev-parse", f"{_branch(target)}~1") == head
    report = _report(two_stages, target)
    assert "| 0001 Striped indexer | applied cleanly |" in report
    # Every hunk as rebased, none with lines the rebase added; no deleted
    # regression tests; what CI's check will say.
    assert re.search(
        r"\| vllm/ops\.py \| `@@ [^`]*` \| \+1 -1 \| - \|\n\nNo overlay changed\.\n\n"
        r"CI's check-patches will fail on this branch until series\.toml "
        r"\(large_hunks, with the reason\) or the stages fix it:\n\n- stage 0002 "
        r"changes 1 line\(s\) of vllm/envs\.py that stage 0001 adds",
        report,
    ), report
    assert "`[[regression]]`" not in report
    # the finished rebase leaves no work area or worktree behind
    assert not _work_repo(two_stages).parent.exists()
    assert sh(two_stages.root, "git", "worktree", "list").count("\n") == 1
    # merging it is adopting it
    sh(two_stages.root, "git", "merge", "-q", "--ff-only", _branch(target))
    merged = two_stages.series()
    # The upstream has no remote: pinned by its own file:// URL, at the commit.
    assert isinstance(merged.base, GitBase) and merged.root == two_stages.root
    assert merged.base.url == target.path.resolve().as_uri()
    assert merged.base.rev == _pinned(target).rev
    tree = apply(merged, quiet=True)
    assert "return 55" in (tree / "vllm/ops.py").read_text()
    assert "return 2020" in (tree / "vllm/ops.py").read_text()
    assert (tree / "vllm/cp_indexer.py").exists()
    assert (two_stages.root / f"docs/rebased_onto_{merged.base.label}.md").is_file()


def _envs(cp_indexer: str) -> str:
    return (
        "".join(f"VAR_{i} = {i}\n" for i in range(3))
        + f"VAR_3 = 33\nCP_INDEXER = {cp_indexer}\n"
        + "".join(f"VAR_{i} = {i}\n" for i in range(4, 40))
    )


def test_conflict_then_continue(two_stages):
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    envs = _work_repo(two_stages) / "vllm/envs.py"
    assert "<<<<<<<" in envs.read_text()
    with pytest.raises(SeriesError, match="conflict markers are still in"):
        rebase.resume(two_stages.series())
    envs.write_text(_envs("False"))
    # 0002 flips the line 0001 added, next to upstream's change: resolve again
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    envs.write_text(_envs("True"))
    reports = rebase.resume(two_stages.series())
    assert _outcomes(reports) == {
        "0001": "conflicted, resolved by hand",
        "0002": "conflicted, resolved by hand",
    }
    ops_hunk = [h for h in reports[1].hunks if h.path == "vllm/ops.py"]
    assert [h.outcome for h in ops_hunk] == ["applied cleanly"]
    # The conflicted hunks, each resolved by hand.
    for report in reports:
        envs_hunks = [h.outcome for h in report.hunks if h.path == "vllm/envs.py"]
        assert envs_hunks == ["conflicted, resolved by hand"], report.id
    tree = apply(_rebased(two_stages, target), quiet=True)
    text = (tree / "vllm/envs.py").read_text()
    assert "VAR_3 = 33\nCP_INDEXER = True\n" in text
    sh(two_stages.root, "git", "switch", "-q", "-")


def test_a_rebase_killed_while_saving_its_state_continues(two_stages, monkeypatch):
    """Killed while writing its state (half the bytes written), a stopped
    rebase still continues from the state it had."""
    _past_the_first_conflict(two_stages)
    write_synced = files.write_synced

    def killed(path, data, *args, **kwargs):
        if "state." in path.name:
            path.write_bytes(data[: len(data) // 2])
            raise KeyboardInterrupt
        return write_synced(path, data, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(files, "write_synced", killed)
        with pytest.raises(KeyboardInterrupt):
            rebase.resume(two_stages.series())
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    # Killed again, then dropped: --abort leaves no state behind.
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("True"))
    with monkeypatch.context() as patch:
        patch.setattr(files, "write_synced", killed)
        with pytest.raises(KeyboardInterrupt):
            rebase.resume(two_stages.series())
    rebase.abort(two_stages.series())
    assert not list((two_stages.root / "build" / "rebase").glob("*state.*"))


def test_recorded_resolution_is_replayed(two_stages):
    """A second rebase onto the same target replays the hand resolution kept
    from the first, and stops nowhere."""
    test_conflict_then_continue(two_stages)
    for name in sh(two_stages.root, "git", "branch", "--list", "rebase/*").split():
        sh(two_stages.root, "git", "branch", "-q", "-D", name)
    reports = rebase.start(
        two_stages.series(), GitBase("vllm", two_stages.upstream, TARGET)
    )
    assert _outcomes(reports) == {
        "0001": "conflicted, recorded resolution replayed",
        "0002": "conflicted, recorded resolution replayed",
    }


def test_abort_keeps_a_hand_resolution_for_the_next_rebase(two_stages, capsys):
    """A conflict resolved in the work repo, then --abort instead of
    --continue: the project is as before, and the next rebase replays that
    resolution rather than asking for it again."""
    target = _conflicting_target(two_stages)
    before = _snapshot(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("False"))
    rebase.abort(two_stages.series())
    assert re.search(
        r"aborted; the series and its tree are as before; 1 conflict "
        r"resolution\(s\) kept in build/rebase/\S+, replayed by the next rebase\n",
        capsys.readouterr().out,
    )
    assert _snapshot(two_stages) == before
    assert not _work_repo(two_stages).exists()
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.start(two_stages.series(), target)
    assert load_state(two_stages.series()).reports[0].outcome == (
        "conflicted, recorded resolution replayed"
    )
    # Aborted again with nothing new resolved: the replayed one is not
    # counted or copied a second time.
    capsys.readouterr()
    rebase.abort(two_stages.series())
    assert "kept in" not in capsys.readouterr().out


def test_a_resolution_moved_off_the_last_stage_is_refused_with_the_way_on(
    two_stages,
):
    """A resolution committed on a history without the last rebased stage
    (here the same files, committed with no parent): --continue refuses,
    naming the commit to put it back on, and after that reset it goes on."""
    _past_the_first_conflict(two_stages)
    repo = _work_repo(two_stages)
    sh(repo, "git", "commit", "-qam", "resolved")
    elsewhere = sh(repo, "git", "commit-tree", "HEAD^{tree}", "-m", "elsewhere")
    sh(repo, "git", "update-ref", "--no-deref", "HEAD", elsewhere.strip())
    with pytest.raises(SeriesError, match="HEAD is no longer on top") as refused:
        rebase.resume(two_stages.series())
    start = re.search(r"reset --soft (\S+)`", str(refused.value)).group(1)
    sh(repo, "git", "reset", "-q", "--soft", start)
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    assert load_state(two_stages.series()).reports[0].outcome == (
        "conflicted, resolved by hand"
    )


def test_abort_with_its_work_area_already_gone(two_stages, capsys):
    """The rebase's folder under build/rebase/ deleted by hand (or never
    made, after a kill): --abort still drops the rebase and its record."""
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    shutil.rmtree(_work_repo(two_stages).parent)
    rebase.abort(two_stages.series())
    assert "aborted; the series and its tree are as before" in capsys.readouterr().out
    with pytest.raises(SeriesError, match="no rebase in progress"):
        rebase.abort(two_stages.series())


def test_abort_restores_everything(two_stages):
    target = _conflicting_target(two_stages)
    before = _snapshot(two_stages)
    old_tree = apply(two_stages.series(), quiet=True)
    old_head = sh(old_tree, "git", "rev-parse", "HEAD")
    with pytest.raises(SeriesError, match="conflicts"):
        rebase.start(two_stages.series(), target)
    with pytest.raises(SeriesError, match="already in progress"):
        rebase.start(two_stages.series(), target)
    rebase.abort(two_stages.series())
    assert not _work_repo(two_stages).parent.exists()
    assert sh(two_stages.root, "git", "branch", "--list", "rebase/*") == ""
    assert _snapshot(two_stages) == before
    assert sh(old_tree, "git", "rev-parse", "HEAD") == old_head
    with pytest.raises(SeriesError, match="no rebase in progress"):
        rebase.abort(two_stages.series())


def test_dropped_hunk_is_reported(two_stages, monkeypatch):
    """A merge that resolves a conflict by discarding the stage's side (here
    git's ``-X ours``) is caught: the hunk's lines are not in the result."""
    target = _target(
        two_stages,
        {
            "vllm/ops.py": (
                "def op_20():\n    return 20\n",
                "def op_20():\n    return -20\n",
            )
        },
    )
    real_git = rebase.git

    def discarding_git(repo, *args, **kwargs):
        if args[:1] == ("cherry-pick",):
            args = ("cherry-pick", "-X", "ours", *args[1:])
        return real_git(repo, *args, **kwargs)

    monkeypatch.setattr(rebase, "git", discarding_git)
    reports = rebase.start(two_stages.series(), target)
    stage = next(r for r in reports if r.id == "0002")
    assert stage.outcome == "merged, with dropped hunks"
    dropped = [h for h in stage.hunks if h.outcome == "dropped"]
    assert [h.path for h in dropped] == ["vllm/ops.py"]
    assert "hunk(s) dropped by the merge" in format_report(reports)


def test_stage_already_present_upstream_is_dropped(two_stages):
    """Upstream took stage 0001 verbatim: it leaves the series, with the
    evidence, and 0002 no longer names it as a dependency."""
    target = _target(
        two_stages,
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        {"vllm/cp_indexer.py": "def split():\n    return 'striped'\n"},
    )
    reports = rebase.start(two_stages.series(), target)
    assert _outcomes(reports)["0001"] == "already upstream"
    assert "reverse-applies" in reports[0].evidence
    rebased = _rebased(two_stages, target)
    assert [s.id for s in rebased.stages] == ["0002"]
    assert rebased.stages[0].depends_on == ()


def test_stage_whose_probe_passes_without_it_is_upstreamed(two_stages):
    """Upstream has stage 0002's behaviour in its own code: the stage's
    upstream probe, run by pytest on the target without the stage, passes."""
    probe = two_stages.root / "tests" / "stage_0002" / "test_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        textwrap.dedent("""
        import os
        from pathlib import Path

        def test_op_20_returns_2020():
            tree = Path(os.environ["DSA_VLLM_TREE"])
            assert "return 2020" in (tree / "vllm/ops.py").read_text()
        """)
    )
    two_stages.commit_all()
    target = _target(
        two_stages,
        {
            "vllm/ops.py": (
                "def op_20():\n    return 20\n",
                "def op_20():\n    # upstream's own take\n    return 2020\n",
            )
        },
    )
    reports = rebase.start(two_stages.series(), target, test_python=sys.executable)
    assert _outcomes(reports)["0001"] == "applied cleanly"
    assert _outcomes(reports)["0002"] == "already upstream"
    assert "1 passed, 0 failed" in reports[1].evidence


def test_a_probe_stops_at_its_first_failure(two_stages, monkeypatch):
    """One failing test of the probe keeps the stage: the rest of the probe
    is not run (a probe can take a minute of a rebase)."""
    probe = two_stages.root / "tests" / "stage_0002" / "test_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        textwrap.dedent("""
        import os
        from pathlib import Path

        def _ops():
            return (Path(os.environ["DSA_VLLM_TREE"]) / "vllm/ops.py").read_text()

        def test_first():
            assert "return 2020" in _ops()

        def test_second():
            assert "return 2020" in _ops()
        """)
    )
    two_stages.commit_all()
    target = _target(two_stages, {"vllm/envs.py": ("VAR_5 = 5\n", "VAR_5 = 50\n")})
    tallies = []
    real = TreeTester.pytest

    def recorded(self, series, repo, stages, paths, first_failure=False):
        tallies.append(real(self, series, repo, stages, paths, first_failure))
        return tallies[-1]

    monkeypatch.setattr(TreeTester, "pytest", recorded)
    reports = rebase.start(two_stages.series(), target, test_python=sys.executable)
    assert _outcomes(reports)["0002"] != "already upstream"
    assert reports[1].evidence.startswith(
        "upstream probe without it: fails (0 passed before the first failure)"
    )
    assert [t.failed for t in tallies if t.failed] == [1]


def test_the_branch_leaves_what_ci_checks_passing(project):
    """The branch's README has the stage table of the new series and its
    report says what check-patches will find: it passes, or it fails naming
    why (a large_hunks entry for a hunk within the budget; a stage that
    changes a line an earlier one adds)."""
    from scripts.series.stages.overview import BEGIN, END, readme_table_is_current

    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        title="Striped indexer",
    )
    project.add_stage(
        "0002",
        {"vllm/ops.py": ("return 20\n", "return 2020\n")},
        title="Top-k gate",
        depends_on=("0001",),
    )
    readme = project.root / "README.md"
    readme.write_text(f"# Project\n\n{BEGIN}\nan old table\n{END}\n\nmore\n")
    project.commit_all()
    target = _target(project, {"vllm/ops.py": ("return 5\n", "return 55\n")})

    def rebased_report() -> str:
        rebase.start(project.series(), target)
        report = _report(project, target)
        sh(project.root, "git", "branch", "-q", "-D", _branch(target))
        return report

    rebase.start(project.series(), target)
    assert "the glue budget holds, no stage changes" in _report(project, target)
    rebased = _rebased(project, target)
    assert readme_table_is_current(rebased, readme)
    assert readme.read_text().startswith("# Project\n\n") and "\nmore\n" in (
        readme.read_text()
    )
    sh(project.root, "git", "switch", "-q", "-")
    sh(project.root, "git", "branch", "-q", "-D", _branch(target))
    project.series_file.write_text(
        project.series_file.read_text().replace(
            'title = "Top-k gate"',
            'title = "Top-k gate"\nlarge_hunks = [{ file = "vllm/ops.py", '
            'hunk = 1, reason = "none" }]',
        )
    )
    project.commit_all()
    report = rebased_report()
    assert "CI's check-patches will fail on this branch" in report
    assert "large_hunks names vllm/ops.py hunk 1" in report
    project.add_stage(
        "0003",
        {"vllm/envs.py": ("CP_INDEXER = False\n", "CP_INDEXER = True\n")},
        title="Flip",
    )
    project.commit_all()
    report = rebased_report()
    assert "CI's check-patches will fail on this branch" in report
    assert "stage 0003 changes 1 line(s) of vllm/envs.py that stage 0001 adds" in (
        report
    )


def test_a_rebase_needs_a_committed_project(two_stages, capsys):
    """The branch is made from the last commit: a project outside git, or
    with uncommitted changes, is refused before anything is done (no state,
    no work area); so is an existing branch of the same name. Changes made
    while a rebase is stopped are refused at its end, and --continue after
    committing them finishes it."""
    target = _conflicting_target(two_stages)
    notes = two_stages.root / "notes.txt"
    notes.write_text("mine\n")
    with pytest.raises(SeriesError, match="uncommitted changes \\(notes.txt\\)"):
        rebase.start(two_stages.series(), target)
    assert not (two_stages.root / "build" / "rebase").exists()
    assert notes.read_text() == "mine\n"
    two_stages.commit_all()
    sh(two_stages.root, "git", "branch", _branch(target))
    with pytest.raises(SeriesError, match=f"already has a branch {_branch(target)}"):
        rebase.start(two_stages.series(), target)
    sh(two_stages.root, "git", "branch", "-q", "-D", _branch(target))
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("False"))
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("True"))
    notes.write_text("a fix the rebase needs\n")
    with pytest.raises(SeriesError, match="then `nox -s rebase -- --continue`"):
        rebase.resume(two_stages.series())
    assert load_state(two_stages.series())
    two_stages.commit_all()
    rebase.resume(two_stages.series())
    shown = sh(two_stages.root, "git", "show", f"{_branch(target)}:notes.txt")
    assert shown == "a fix the rebase needs\n"


def test_files_the_users_global_ignore_file_hides_do_not_block_a_rebase(
    two_stages, tmp_path, monkeypatch
):
    """The clean-project check reads git status as the user does: an
    editor's folder their global ignore file hides is not an uncommitted
    change (the tool's other git calls ignore that configuration)."""
    ignore = tmp_path / "global-ignore"
    ignore.write_text(".idea/\n")
    config = tmp_path / "gitconfig"
    config.write_text(f"[core]\n\texcludesFile = {ignore}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    (two_stages.root / ".idea").mkdir()
    (two_stages.root / ".idea" / "workspace.xml").write_text("<x/>\n")
    target = _target(two_stages, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    rebase.start(two_stages.series(), target)
    assert branch.branch_commit(two_stages.series(), _branch(target))


def test_a_rebase_ends_only_on_a_head_that_holds_its_start(two_stages):
    """Switched, while the rebase is stopped, to a history without the
    commit it started from: its end refuses, saying what to do, and makes
    the branch once HEAD holds that commit again."""
    target = _past_the_first_conflict(two_stages)
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("True"))
    started = sh(two_stages.root, "git", "rev-parse", "--abbrev-ref", "HEAD").strip()
    sh(two_stages.root, "git", "checkout", "-q", "--orphan", "elsewhere")
    sh(two_stages.root, "git", "commit", "-q", "-m", "another history")
    with pytest.raises(SeriesError, match="no longer contains the commit") as moved:
        rebase.resume(two_stages.series())
    assert str(moved.value).endswith(
        "; the branch is made on HEAD: switch back to a branch that contains "
        "it, then `nox -s rebase -- --continue`"
    )
    assert branch.branch_commit(two_stages.series(), _branch(target)) is None
    sh(two_stages.root, "git", "switch", "-q", started)
    rebase.resume(two_stages.series())
    assert branch.branch_commit(two_stages.series(), _branch(target))


def test_a_rebase_outside_git_is_refused(project):
    project.add_stage(
        "0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = 1\n")}
    )
    target = _target(project, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    with pytest.raises(SeriesError, match="is not a git checkout: a rebase writes"):
        rebase.start(project.series(), target)
    assert not (project.root / "build" / "rebase").exists()


def test_a_target_owned_by_another_user_is_named_as_such(two_stages, monkeypatch):
    """git refuses a checkout another user owns (safe.directory; simulated
    with git's own GIT_TEST_ASSUME_DIFFERENT_OWNER, for that checkout
    only): the rebase says so and how to go on, not "not a commit"."""
    from scripts.series import git as git_module

    target = _target(two_stages, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    real_run = git_module.subprocess.run

    def run(command, *args, env=None, **kwargs):
        if str(target.path) in command[:3]:
            env = {**(env or {}), "GIT_TEST_ASSUME_DIFFERENT_OWNER": "1"}
        return real_run(command, *args, env=env, **kwargs)

    monkeypatch.setattr(git_module.subprocess, "run", run)
    before = _snapshot(two_stages)
    with pytest.raises(SeriesError) as error:
        rebase.start(two_stages.series(), target)
    message = str(error.value)
    assert message.startswith(
        f"git refuses to read {target.path}: the checkout belongs to another user"
    ), message
    assert f"git clone {target.path} DEST" in message
    assert _snapshot(two_stages) == before
    assert not state_file(two_stages.series()).exists()


def test_an_overlay_changed_in_the_rebase_is_on_the_branch(two_stages):
    """An overlay edited while resolving is the branch's (the checkout's
    stays as it was), and the report names it."""
    target = _past_the_first_conflict(two_stages)
    adapted = "def split():\n    return 'striped v2'\n"
    (_work_repo(two_stages) / "vllm/cp_indexer.py").write_text(adapted)
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("True"))
    rebase.resume(two_stages.series())
    project_copy = two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    assert project_copy.read_text() != adapted
    assert "Overlays changed by the rebase: `vllm/cp_indexer.py`" in _report(
        two_stages, target
    )
    tree = apply(_rebased(two_stages, target), quiet=True)
    assert project_copy.read_text() == adapted
    assert (tree / "vllm/cp_indexer.py").read_text() == adapted


class _Killed(BaseException):
    """A kill at one step of the rebase's end."""


def _end_with_git(wrapper):
    """rebase's end (branch.finish) with its git calls made through
    ``wrapper(real_git, *args, **kwargs)``."""
    real_finish, real_git = branch.finish, branch.git

    def finish(series, state):
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(branch, "git", lambda *a, **k: wrapper(real_git, *a, **k))
            return real_finish(series, state)

    return finish


def _kill(step: int, after: bool):
    """A git wrapper that kills the run before (or after) git call
    ``step`` (from 0)."""
    calls = []

    def killing(real, *args, **kwargs):
        calls.append(args)
        if len(calls) == step + 1 and not after:
            raise _Killed
        result = real(*args, **kwargs)
        if len(calls) == step + 1:
            raise _Killed
        return result

    return killing


def test_a_rebase_killed_at_any_step_of_its_end_continues_to_the_same_branch(
    tmp_path, monkeypatch
):
    """Killed before any git step of making its branch (the worktree, the
    commit, the ref, the cleanup), or after the last (a kill after one step
    is one before the next): the checkout is as it was, and --continue ends
    with a branch whose tree is an uninterrupted rebase's, with no state or
    worktree left."""

    def fresh(name: str) -> tuple[Project, GitBase]:
        made = add_two_stages(Project(tmp_path / name))
        made.commit_all()
        return made, _target(made, {"vllm/ops.py": ("return 5\n", "return 55\n")})

    calls: list[tuple] = []

    def counting(real, *args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    reference, target = fresh("reference")
    with monkeypatch.context() as patched:
        patched.setattr(rebase, "finish", _end_with_git(counting))
        rebase.start(reference.series(), target)
    steps = len(calls)
    assert steps >= 6

    def branch_content(project: Project, target: GitBase) -> tuple[str, str]:
        """The branch's files, its series.toml apart with the project's own
        folder (in the pin's file:// URL) written as PROJECT."""
        files = sh(project.root, "git", "ls-tree", "-r", _branch(target))
        series = sh(
            project.root, "git", "show", f"{_branch(target)}:patches/series.toml"
        )
        return (
            "\n".join(line for line in files.splitlines() if "series.toml" not in line),
            series.replace(project.root.parent.as_uri(), "PROJECT"),
        )

    want = branch_content(reference, target)
    assert "PROJECT" in want[1]
    for step, after in [*((s, False) for s in range(steps)), (steps - 1, True)]:
        made, target = fresh(f"kill-{step}-{after}")
        head = sh(made.root, "git", "rev-parse", "HEAD")
        with monkeypatch.context() as patched:
            patched.setattr(rebase, "finish", _end_with_git(_kill(step, after)))
            with pytest.raises(_Killed):
                rebase.start(made.series(), target)
        assert sh(made.root, "git", "rev-parse", "HEAD") == head
        assert sh(made.root, "git", "status", "--porcelain") == ""
        rebase.resume(made.series())
        assert branch_content(made, target) == want, (step, after)
        assert not state_file(made.series()).exists()
        assert sh(made.root, "git", "worktree", "list").count("\n") == 1


def test_a_resolution_the_user_committed_is_the_stages_resolution(two_stages):
    """Resolving a conflict, then `git add -A && git commit` in the work repo
    as git habit goes: --continue takes the commit as the resolution (it is
    not read as "nothing changed", and the stage is kept)."""
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    work = _work_repo(two_stages)
    (work / "vllm/envs.py").write_text(_envs("False"))
    sh(work, "git", "add", "-A")
    sh(
        work,
        "git",
        "-c",
        "user.name=u",
        "-c",
        "user.email=u@u",
        "commit",
        "-qm",
        "mine",
    )
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    (work / "vllm/envs.py").write_text(_envs("True"))
    reports = rebase.resume(two_stages.series())
    assert _outcomes(reports)["0001"] == "conflicted, resolved by hand"
    _rebased(two_stages, target)
    patch = (two_stages.root / "patches" / two_stages.stages[0]["patch"]).read_text()
    assert "Subject: Striped indexer" in patch, "kept under the stage's message"
    assert "VAR_3 = 33" in patch


def test_a_continue_killed_right_after_committing_the_resolution(
    two_stages, monkeypatch
):
    """Killed after git committed the resolution but before the rebase
    recorded it: the next --continue takes that commit as the resolution
    and keeps the stage."""
    _past_the_first_conflict(two_stages)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rebase, "_stop_unless_checked", killed)
    with pytest.raises(KeyboardInterrupt):
        rebase.resume(two_stages.series())
    monkeypatch.undo()
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("True"))
    reports = rebase.resume(two_stages.series())
    assert _outcomes(reports)["0001"] == "conflicted, resolved by hand"


def test_a_series_edited_while_the_rebase_is_stopped_is_refused(two_stages):
    """Removing a stage from series.toml while a rebase is stopped (here the
    one after the stopped stage): --continue says the series changed and
    changes nothing; put back, it continues; --abort still works."""
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    original = two_stages.series_file.read_text()
    first, _, rest = original.partition("[[stage]]")
    two_stages.series_file.write_text(first + "[[stage]]" + rest.split("[[stage]]")[0])
    (_work_repo(two_stages) / "vllm/envs.py").write_text(_envs("False"))
    with pytest.raises(SeriesError, match="changed while the rebase was stopped") as e:
        rebase.resume(two_stages.series())
    assert str(e.value) == (
        "patches/ or vllm_overlay/ changed while the rebase was stopped "
        "(patches/series.toml, a patch or an overlay); the rebase goes on with "
        "the series it started from: put them back (`git checkout -- patches "
        "vllm_overlay`, or undo your edit) and continue, or abort (`nox -s "
        "rebase -- --abort`) and rebase the edited series"
    )
    two_stages.series_file.write_text(original)
    # A patch's text edited (its message here), then put back.
    patch = two_stages.root / "patches" / two_stages.stages[1]["patch"]
    kept = patch.read_bytes()
    patch.write_bytes(kept.replace(b"Why this stage exists.", b"Why it exists."))
    with pytest.raises(SeriesError, match="changed while the rebase was stopped"):
        rebase.resume(two_stages.series())
    patch.write_bytes(kept)
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    rebase.abort(two_stages.series())
    assert not (two_stages.root / "patches" / "next").exists()


def test_target_equal_to_base_is_refused(two_stages):
    with pytest.raises(SeriesError, match="already on"):
        rebase.start(two_stages.series(), two_stages.series().base)


def test_split_hunks_round_trip(two_stages):
    patch = two_stages.root / "patches" / two_stages.stages[1]["patch"]
    hunks = read_patch(patch).hunks
    assert [h.path for h in hunks] == ["vllm/envs.py", "vllm/ops.py"]
    for hunk in hunks:
        assert hunk.text.startswith("diff --git ")
        assert hunk.header.startswith("@@ ")


def test_interrupted_rebase_continues(two_stages, monkeypatch):
    """Killed in the middle of a stage's merge: --continue drops the
    half-made merge and redoes that stage."""
    target = _target(two_stages, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    real = rebase.added_lines_present
    calls = []

    def interrupted(path, hunk):
        calls.append(hunk)
        if len(calls) == 2:  # stage 0002's first hunk, after its cherry-pick
            raise KeyboardInterrupt
        return real(path, hunk)

    monkeypatch.setattr(rebase, "added_lines_present", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rebase.start(two_stages.series(), target)
    assert sh(_work_repo(two_stages), "git", "status", "--porcelain").strip()
    reports = rebase.resume(two_stages.series())
    assert _outcomes(reports) == {"0001": "applied cleanly", "0002": "applied cleanly"}
    tree = apply(_rebased(two_stages, target), quiet=True)
    assert "return 2020" in (tree / "vllm/ops.py").read_text()


def test_missing_test_python_is_a_clear_error():
    with pytest.raises(SeriesError, match="no such Python"):
        TreeTester("/nonexistent/python3")


def test_a_replayed_file_is_reported_while_another_conflicts(two_stages):
    """Stage 0002's envs.py conflict is replayed from its recorded resolution
    while its ops.py hunk meets a new conflict: the report says which is
    which (the replayed file is not reported as merged or dropped)."""
    test_conflict_then_continue(two_stages)
    sh(two_stages.upstream, "git", "tag", "-d", TARGET)
    target = _target(
        two_stages,
        {
            "vllm/ops.py": (
                "def op_20():\n    return 20\n",
                "def op_20():\n    return -20\n",
            )
        },
    )
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.start(two_stages.series(), target)
    state = load_state(two_stages.series())
    outcomes = {h.path: h.outcome for h in state.reports[-1].hunks}
    assert outcomes == {
        "vllm/envs.py": "conflicted, recorded resolution replayed",
        "vllm/ops.py": "conflicted",
    }


def _upstream_merged_0001_differently(project: Project) -> GitBase:
    """The target has stage 0001's env line, and its own cp_indexer.py: the
    probe-less check cannot call the stage upstream (the overlay differs)."""
    return _target(
        project,
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        {"vllm/cp_indexer.py": "def split():\n    return 'upstream'\n"},
    )


def test_a_stage_dropped_on_request_is_left_out_and_later_stages_rebase(two_stages):
    target = _upstream_merged_0001_differently(two_stages)
    reports = rebase.start(two_stages.series(), target, drop=["0001"])
    assert _outcomes(reports) == {
        "0001": "dropped on request",
        "0002": "applied cleanly",
    }
    rebased = _rebased(two_stages, target)
    assert [(s.id, s.depends_on) for s in rebased.stages] == [("0002", ())]
    tree = apply(rebased, quiet=True)
    assert "return 'upstream'" in (tree / "vllm/cp_indexer.py").read_text()
    assert "CP_INDEXER = True" in (tree / "vllm/envs.py").read_text()
    with pytest.raises(SeriesError, match="unknown stage '0009'"):
        rebase.start(load_series(two_stages.series_file), target, drop=["0009"])


def test_a_conflicted_stage_can_be_dropped_or_resolved_to_nothing(two_stages):
    """At the stage's conflict: `--continue --drop` leaves it out; so does a
    resolution that keeps the target's version of every file (it used to
    fail forever: "its commit changes no vLLM file outside its overlays")."""
    target = _upstream_merged_0001_differently(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    reports = rebase.resume(two_stages.series(), drop=["0001"])
    assert _outcomes(reports) == {
        "0001": "dropped on request",
        "0002": "applied cleanly",
    }
    sh(two_stages.root, "git", "branch", "-q", "-D", _branch(target))
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    sh(_work_repo(two_stages), "git", "checkout", "--ours", "--", "vllm/cp_indexer.py")
    reports = rebase.resume(two_stages.series())
    assert _outcomes(reports)["0001"] == "already upstream"
    assert "target's version of every file" in reports[0].evidence
    assert [s.id for s in _rebased(two_stages, target).stages] == ["0002"]


class _Stop(BaseException):
    """A kill at one step (nothing after it runs)."""


def test_a_rebase_killed_while_it_deletes_its_work_area_is_over(
    two_stages, monkeypatch
):
    """Killed while deleting its work area, the finished rebase has already
    dropped its state and made its branch: nothing to continue, and the
    next rebase onto the target deletes what the kill left."""
    target = _target(two_stages, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    real_rmtree = rebase.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == target.label and not kwargs.get("ignore_errors"):
            real_rmtree(Path(path) / "vllm" / ".git" / "objects")
            raise _Stop
        return real_rmtree(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(rebase.shutil, "rmtree", rmtree)
        with pytest.raises(_Stop):
            rebase.start(two_stages.series(), target)
    assert not state_file(two_stages.series()).exists()
    assert "applied cleanly" in _report(two_stages, target)
    with pytest.raises(SeriesError, match="no rebase in progress"):
        rebase.resume(two_stages.series())
    sh(two_stages.root, "git", "branch", "-q", "-D", _branch(target))
    reports = rebase.start(two_stages.series(), target)
    assert _outcomes(reports)["0001"] == "applied cleanly"


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_continue_without_the_work_repo_says_what_to_run(two_stages, damage):
    """A state whose work repo is gone or damaged (what an older version of
    the tool left when killed at its end): --continue names the state file
    and the repo and says to abort, instead of git's own error; --abort
    then drops it, with the project as it was."""
    target = _upstream_merged_0001_differently(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    repo = _work_repo(two_stages)
    if damage == "missing":
        shutil.rmtree(repo)
    else:
        shutil.rmtree(repo / ".git" / "objects")
    before = _snapshot(two_stages)
    with pytest.raises(SeriesError) as error:
        rebase.resume(two_stages.series())
    message = str(error.value)
    assert f"its work repo {repo} is {damage}" in message, message
    assert str(state_file(two_stages.series())) in message
    assert "`nox -s rebase -- --abort`" in message
    rebase.abort(two_stages.series())
    assert not state_file(two_stages.series()).exists()
    assert _snapshot(two_stages) == before


def test_continue_keeps_the_unmerged_state_and_the_options(two_stages):
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target, test_python=sys.executable)
    repo = _work_repo(two_stages)
    with pytest.raises(SeriesError, match="conflict markers are still in"):
        rebase.resume(two_stages.series())
    # git still knows the conflict: mergetool and `git diff` work on it
    unmerged = sh(repo, "git", "diff", "--name-only", "--diff-filter=U").split()
    assert unmerged == ["vllm/envs.py"]
    (repo / "vllm/envs.py").write_text(_envs("False"))
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    state = load_state(two_stages.series())
    assert state.test_python == sys.executable
    # the probe ran for stage 0002 too, without --test-python being repeated
    assert "upstream probe without it" in state.reports[-1].evidence


def test_the_work_tree_keeps_its_stage_through_a_rebase_and_abort(two_stages):
    series = two_stages.series()
    repo = apply(series, "0001")
    at_0001 = sh(repo, "git", "rev-parse", "HEAD")
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="conflicts"):
        rebase.start(series, target)
    assert sh(repo, "git", "rev-parse", "HEAD") == at_0001
    rebase.abort(series)
    assert sh(repo, "git", "rev-parse", "HEAD") == at_0001
    assert sh(repo, "git", "rev-parse", "--verify", "-q", "stage/0002")


def test_a_rebase_killed_while_it_starts_leaves_the_tree_where_it_was(tmp_path):
    """The work tree at stage 0001; a rebase killed at every eighth git call
    while it starts and runs: after --abort (when there is a rebase to
    abort), the tree is at stage 0001 and clean, as the user left it."""
    from scripts.series import git as git_module

    real_run = git_module.subprocess.run

    def killed_at(step: int | None, calls: list[int]):
        def run(command, *args, **kwargs):
            if command and command[0] == "git":
                calls.append(1)
                if len(calls) == step:
                    raise _Killed
            return real_run(command, *args, **kwargs)

        return run

    def fresh(name: str):
        made = add_two_stages(Project(tmp_path / name))
        made.commit_all()
        repo = apply(made.series(), quiet=True)
        apply(made.series(), "0001", quiet=True)
        at_0001 = sh(repo, "git", "rev-parse", "HEAD")
        target = _target(made, {"vllm/ops.py": ("return 5\n", "return 55\n")})
        return made, repo, at_0001, target

    made, repo, at_0001, target = fresh("count")
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(git_module.subprocess, "run", killed_at(None, calls))
        rebase.start(made.series(), target)
    assert sh(repo, "git", "rev-parse", "HEAD") == at_0001
    for step in range(1, len(calls), 8):
        made, repo, at_0001, target = fresh(f"kill-{step}")
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(git_module.subprocess, "run", killed_at(step, []))
            with pytest.raises(_Killed):
                rebase.start(made.series(), target)
        if state_file(made.series()).exists():
            rebase.abort(made.series())
        assert sh(repo, "git", "rev-parse", "HEAD") == at_0001, step
        assert sh(repo, "git", "status", "--porcelain") == "", step


def test_recorded_resolutions_are_offered_on_another_target(two_stages):
    """Resolved once onto v2; a rebase onto v3 (v2 plus unrelated drift) meets
    the same conflicts and replays those resolutions."""
    test_conflict_then_continue(two_stages)
    ops = two_stages.upstream / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 5\n", "return 555\n"))
    sh(two_stages.upstream, "git", "commit", "-qam", "drift")
    sh(two_stages.upstream, "git", "tag", "v3")
    reports = rebase.start(
        two_stages.series(), GitBase("vllm", two_stages.upstream, "v3")
    )
    assert _outcomes(reports) == {
        "0001": "conflicted, recorded resolution replayed",
        "0002": "conflicted, recorded resolution replayed",
    }


def _upstream_moves_ops(project: Project, how: str) -> GitBase:
    """The target renames vllm/ops.py (stage 0002 changes op_20 in it) or
    deletes it, moving op_20 to vllm/kernels.py."""
    up = project.upstream
    if how == "rename":
        sh(up, "git", "mv", "vllm/ops.py", "vllm/operations.py")
    else:
        (up / "vllm/kernels.py").write_text("def op_20():\n    return 20\n")
        sh(up, "git", "rm", "-q", "vllm/ops.py")
    sh(up, "git", "add", "-A")
    sh(up, "git", "commit", "-qm", f"upstream {how}s ops.py")
    sh(up, "git", "tag", TARGET)
    return GitBase("vllm", up, TARGET)


def test_a_file_renamed_on_the_target_is_reported_where_the_hunk_went(two_stages):
    target = _upstream_moves_ops(two_stages, "rename")
    reports = rebase.start(two_stages.series(), target)
    (ops,) = [h for h in reports[1].hunks if h.path == "vllm/ops.py"]
    assert ops.outcome == "merged into vllm/operations.py (renamed on the target)"
    tree = apply(_rebased(two_stages, target), quiet=True)
    assert "return 2020" in (tree / "vllm/operations.py").read_text()


def test_a_file_deleted_on_the_target_needs_a_decision(two_stages):
    """Reported as a deletion with what to do; a bare --continue refuses
    instead of putting the whole file back into the stage."""
    target = _upstream_moves_ops(two_stages, "delete")
    with pytest.raises(SeriesError) as conflict:
        rebase.start(two_stages.series(), target)
    assert "vllm/ops.py is deleted on the target" in str(conflict.value)
    assert "git rm vllm/ops.py" in str(conflict.value)
    (ops,) = [
        h
        for h in load_state(two_stages.series()).reports[-1].hunks
        if h.path == "vllm/ops.py"
    ]
    assert ops.outcome == "conflicted: the file is deleted on the target"
    with pytest.raises(SeriesError, match="deleted on the target and changed") as e:
        rebase.resume(two_stages.series())
    assert str(e.value) == (
        "deleted on the target and changed by the stage: vllm/ops.py; port the "
        "change to where the code went and `git rm` the file, or `git add` it "
        "to keep the whole file in the stage"
    )
    repo = _work_repo(two_stages)
    kernels = repo / "vllm/kernels.py"
    kernels.write_text(kernels.read_text().replace("return 20", "return 2020"))
    sh(repo, "git", "rm", "-q", "vllm/ops.py")
    reports = rebase.resume(two_stages.series())
    assert reports[1].outcome == "conflicted, resolved by hand"
    tree = apply(_rebased(two_stages, target), quiet=True)
    assert not (tree / "vllm/ops.py").exists()
    assert "return 2020" in (tree / "vllm/kernels.py").read_text()


def test_a_resolution_that_does_not_compile_stops_the_rebase(two_stages):
    """A stray '=======' left in a hand resolution: the file is named with
    the line, and --continue after the fix goes on."""
    target = _conflicting_target(two_stages)
    with pytest.raises(SeriesError, match="stage 0001 has conflicts"):
        rebase.start(two_stages.series(), target)
    envs = _work_repo(two_stages) / "vllm/envs.py"
    envs.write_text(
        "".join(
            line
            for line in envs.read_text().splitlines(keepends=True)
            if not line.startswith(("<<<<<<<", ">>>>>>>"))
        )
    )
    with pytest.raises(
        SeriesError, match=r"vllm/envs.py, line \d+: does not compile"
    ) as e:
        rebase.resume(two_stages.series())
    assert str(e.value).endswith(
        f"Fix it in {_work_repo(two_stages)} (the stage is its HEAD commit), then "
        "`nox -s rebase -- --continue`; or `nox -s rebase -- --continue --drop "
        "0001`, or `nox -s rebase -- --abort`"
    )
    assert load_state(two_stages.series()).reports[-1].outcome == (
        "merged, but fails its checks"
    )
    # A fix that does not fix it: stopped again, as the first time.
    envs.write_text(_envs("False") + "=======\n")
    with pytest.raises(SeriesError, match=r"vllm/envs.py, line \d+: does not compile"):
        rebase.resume(two_stages.series())
    assert load_state(two_stages.series()).reports[-1].outcome == (
        "merged, but fails its checks"
    )
    envs.write_text(_envs("False"))
    with pytest.raises(SeriesError, match="stage 0002 has conflicts"):
        rebase.resume(two_stages.series())
    assert load_state(two_stages.series()).reports[0].outcome == (
        "merged, fixed by hand after its checks"
    )


def test_a_stage_that_no_longer_imports_on_the_target_stops_the_rebase(two_stages):
    """Stage 0001's module imports a helper the target moved: the merge is
    clean, the import is not. Fixed in the work repo, --continue re-checks,
    and the branch has the adapted overlay."""
    overlay = two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    overlay.write_text("from vllm.ops import op_5\n\n\ndef split():\n    return op_5\n")
    two_stages.commit_all()
    up = two_stages.upstream
    ops = up / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("def op_5():\n    return 5\n", ""))
    (up / "vllm/helpers.py").write_text("def op_5():\n    return 5\n")
    sh(up, "git", "add", "-A")
    sh(up, "git", "commit", "-qm", "op_5 moves to helpers")
    sh(up, "git", "tag", TARGET)
    target = GitBase("vllm", up, TARGET)
    with pytest.raises(SeriesError, match="does not import: vllm.cp_indexer: Import"):
        rebase.start(two_stages.series(), target, test_python=sys.executable)
    fixed = "from vllm.helpers import op_5\n\n\ndef split():\n    return op_5\n"
    (_work_repo(two_stages) / "vllm/cp_indexer.py").write_text(fixed)
    reports = rebase.resume(two_stages.series())
    assert [r.outcome for r in reports] == [
        "merged, fixed by hand after its checks",
        "applied cleanly",
    ]
    _rebased(two_stages, target)
    assert (two_stages.root / "vllm_overlay/vllm/cp_indexer.py").read_text() == fixed


def test_a_stage_whose_pr_tests_fail_on_the_target_stops_the_rebase(project):
    """The tests a stage adds to vLLM's tests/ run on the target with plain
    pytest: a value they rely on changed upstream (no conflict), the rebase
    stops; the test adapted in the work repo, --continue passes."""
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = True\n")},
        {
            "tests/test_cp.py": (
                "from vllm import envs\n\n\n"
                "def test_next_to_var_5():\n    assert envs.VAR_5 == 5\n"
            )
        },
    )
    project.commit_all()
    target = _target(project, {"vllm/envs.py": ("VAR_5 = 5\n", "VAR_5 = 50\n")})
    with pytest.raises(SeriesError, match="its PR's tests fail on the target"):
        rebase.start(project.series(), target, test_python=sys.executable)
    test = _work_repo(project) / "tests/test_cp.py"
    test.write_text(test.read_text().replace("== 5", "== 50"))
    (report,) = rebase.resume(project.series())
    assert report.outcome == "merged, fixed by hand after its checks"
    assert re.search(
        r"\nCI's check-patches: the glue budget holds, no stage changes an "
        r"earlier one's lines, and the README's stage table and the pin in .* are "
        r"written for the new pin\.\n$",
        _report(project, target),
    )


def test_a_stage_that_applies_as_it_is_is_still_tested_by_a_rebase(project):
    """Only the rehearsal, whose target adds comments, leaves the tests of a
    stage that applied as it is to apply-and-test: a real target changes
    what a stage's tests rely on without touching its hunks."""
    project.add_stage(
        "0001",
        {"vllm/ops.py": ("    return 20\n", "    return 2020\n")},
        {"tests/test_ops.py": OP_20_PR_TEST},
    )
    (project.root / "tests" / "stage_0001").mkdir()
    (project.root / "tests" / "stage_0001" / "test_envs.py").write_text(
        "from vllm import envs\n\n\ndef test_var_5():\n    assert envs.VAR_5 == 5\n"
    )
    project.commit_all()
    target = _target(project, {"vllm/envs.py": ("VAR_5 = 5\n", "VAR_5 = 50\n")})
    with pytest.raises(SeriesError, match="0001 merged onto the target but its tests"):
        rebase.start(project.series(), target, test_python=sys.executable)
    assert load_state(project.series()).reports[0].hunks[0].outcome == (
        "applied cleanly"
    )
    # Its PR's tests ran beside them, in a checkout of their own.
    pr_log = _work_repo(project).parent / "check-pr-tests.log"
    assert "1 passed" in pr_log.read_text()


OP_20_PR_TEST = (
    "from vllm import ops\n\n\ndef test_op_20():\n    assert ops.op_20() == 2020\n"
)


def test_the_branch_keeps_the_resolutions_and_they_replay_once_merged(
    two_stages, capsys
):
    test_conflict_then_continue(two_stages)  # a branch onto v2, hand-resolved
    target = GitBase("vllm", two_stages.upstream, TARGET)
    _rebased(two_stages, target)
    kept = two_stages.root / "patches/resolutions"
    assert kept.is_dir() and any(kept.iterdir())
    sh(two_stages.root, "git", "switch", "-q", "-")
    sh(two_stages.root, "git", "merge", "-q", "--ff-only", _branch(target))
    # the merged resolutions replay on the next rebase, with none under build/
    shutil.rmtree(two_stages.root / "build" / "rebase")
    up = two_stages.upstream
    (up / "README.md").write_text("v4\n")
    sh(up, "git", "commit", "-qam", "v4")
    sh(up, "git", "tag", "v4")
    capsys.readouterr()
    reports = rebase.start(two_stages.series(), GitBase("vllm", up, "v4"))
    assert "patches/resolutions" in capsys.readouterr().out
    assert _outcomes(reports)["0001"] == "applied cleanly"


def test_a_dropped_stage_leaves_the_series_file_edited_in_place(two_stages):
    """The stage's entry goes, the later stage's dependencies follow, and the
    file's comments stay."""
    text = two_stages.series_file.read_text()
    two_stages.series_file.write_text(
        text.replace("[[stage]]", "# why this stage exists\n[[stage]]", 1)
        + "# a trailing note\n"
    )
    two_stages.commit_all()
    target = _upstream_merged_0001_differently(two_stages)
    rebase.start(two_stages.series(), target, drop=["0001"])
    series = _rebased(two_stages, target)
    written = two_stages.series_file.read_text()
    assert "# a trailing note\n" in written and "# why this stage exists" in written
    assert [(s.id, s.depends_on) for s in series.stages] == [("0002", ())]
    assert not (two_stages.root / "patches" / two_stages.stages[0]["patch"]).exists()
    assert not (two_stages.root / "vllm_overlay/vllm/cp_indexer.py").exists()


def test_regression_tests_the_target_deleted_leave_the_series(two_stages):
    """A [[regression]] test the target deleted is reported and left out of
    the branch's series.toml (vLLM 0.34.0 deleted one the series ran), so
    its tests run the rest instead of failing to collect it."""
    text = two_stages.series_file.read_text()
    two_stages.series_file.write_text(
        '# vLLM\'s own tests\n[[regression]]\nname = "upstream"\n'
        'paths = ["tests/test_kept.py", "tests/test_gone.py"]\n\n' + text
    )
    two_stages.commit_all()
    target = _target(
        two_stages,
        {"vllm/ops.py": ("return 5\n", "return 55\n")},
        files={"tests/test_kept.py": "def test_it():\n    pass\n"},
    )
    rebase.start(two_stages.series(), target)
    assert (
        "vLLM's own tests in `[[regression]]` that the target deleted, left out "
        "of series.toml (add the target's tests that cover the same code): "
        "`tests/test_gone.py`.\n\nNo overlay changed."
    ) in _report(two_stages, target)
    rebased = _rebased(two_stages, target)
    assert [s.paths for s in rebased.regression] == [("tests/test_kept.py",)]
    assert "# vLLM's own tests\n" in two_stages.series_file.read_text()


@needs_release_pin
def test_the_projects_series_file_is_edited_line_for_line():
    """On the project's own series.toml: a new pin changes only [base]'s
    lines; a dropped stage takes its lines and nothing else (every comment
    stays); a changed stage gets its new values; each result reads back as
    the series it must say."""
    import dataclasses
    import tomllib

    from scripts.series.rebase.series_toml import series_toml, updated_series_file

    series = load_series()
    folder = series.patches_dir
    text = (folder / "series.toml").read_text()
    # A comment inside the stage that is dropped below stays.
    text = text.replace(
        'upstream = { pr = "vllm-project/', '# a note\nupstream = { pr = "vllm-project/'
    )
    assert "# a note" in text
    comments = [line for line in text.splitlines() if line.startswith("#")]

    def edited(new: Series) -> str:
        out = updated_series_file(text, series_toml(new, folder))
        assert [line for line in out.splitlines() if line.startswith("#")] == comments
        assert tomllib.loads(out) == tomllib.loads(series_toml(new, folder))
        return out

    assert edited(series) == text
    target = dataclasses.replace(series.base, version="0.35.0", sha256="ab" * 32)
    moved = edited(dataclasses.replace(series, base=target))
    changed = [
        a for a, b in zip(text.splitlines(), moved.splitlines(), strict=True) if a != b
    ]
    assert changed == [
        f'version = "{series.base.version}"',
        f'sha256 = "{series.base.sha256}"',
    ]
    checkout = GitBase("vllm", folder.parent / "vllm", "cd" * 20)
    to_git = edited(dataclasses.replace(series, base=checkout)).splitlines()
    at = to_git.index("[base]")
    assert to_git[at + 1 : at + 4] == [
        'name = "vllm"',
        'git = "../vllm"',
        f'rev = "{"cd" * 20}"',
    ]
    kept = tuple(s for s in series.stages if s.id != "0003")
    dropped = edited(dataclasses.replace(series, stages=kept))
    assert 'id = "0003"' not in dropped and 'id = "0004"' in dropped
    retitled = tuple(
        dataclasses.replace(s, title="New title") if s.id == "0003" else s
        for s in series.stages
    )
    assert 'title = "New title"' in edited(dataclasses.replace(series, stages=retitled))


@needs_release_pin
@pytest.mark.parametrize(
    "form",
    [
        ("[base]", "[ base ]"),
        ("[base]", '["base"]'),
        ("[base]", "  [base]  # the pin"),
        ("[[stage]]", "[[ stage ]]  # one stage"),
        ('id = "0001"', "id = '0001'"),
        ("\n", "\r\n"),
    ],
    ids=["spaced", "quoted", "indented, a comment", "array spaced", "literal", "CRLF"],
)
def test_a_series_file_in_any_valid_toml_form_is_edited_in_place(form):
    """TOML a user may write (headers spaced, quoted or commented, literal
    strings, CRLF line ends): a pin move edits [base]'s values and keeps
    every other line as it was, comments on header lines included."""
    import dataclasses
    import tomllib

    from scripts.series.rebase.series_toml import series_toml, updated_series_file

    series = load_series()
    folder = series.patches_dir
    text = (folder / "series.toml").read_text().replace(*form)
    target = dataclasses.replace(series.base, version="0.35.0", sha256="ab" * 32)
    new = series_toml(dataclasses.replace(series, base=target), folder)
    out = updated_series_file(text, new)
    assert tomllib.loads(out) == tomllib.loads(new)
    changed = [
        (a, b)
        for a, b in zip(text.splitlines(), out.splitlines(), strict=True)
        if a != b
    ]
    assert [b for _, b in changed] == [
        'version = "0.35.0"',
        f'sha256 = "{"ab" * 32}"',
    ]


def test_drop_names_each_stage_given_but_the_base():
    """``--drop`` may be given once per stage; ``base`` is never dropped."""
    import argparse

    from scripts.series.rebase import commands

    parser = argparse.ArgumentParser()
    commands.arguments(parser)
    given = ["--continue", "--drop", "0001", "--drop", "base", "--drop", "0002"]
    assert commands.stage_ids(parser.parse_args(given)) == ["0001", "0002"]
    assert commands.stage_ids(parser.parse_args(["--abort"])) == []


PROBE = """\
import atexit
import os
import sys

import treemark

# After pytest has finished and released the terminal: the process's own
# standard error.
atexit.register(os.write, 2, b"written to stderr at exit\\n")


def test_runs_on_the_tree():
    assert os.path.dirname(treemark.__file__) == os.environ["PYTHONPATH"]


def test_fails_with_output():
    print("written to stdout")
    raise RuntimeError("the probe's own failure")
"""


def test_a_stages_tests_run_on_the_rebase_tree_into_their_log(two_stages, tmp_path):
    """The rebase runs a stage's tests on a checkout of its work repo's
    HEAD (first on PYTHONPATH) and keeps all they print, standard output
    and error, in the check log beside the work repo, not on the terminal."""
    repo = tmp_path / "rebase" / "vllm"
    repo.mkdir(parents=True)
    write_files(repo, {"treemark.py": "WHERE = 'the tree'\n"})
    sh(repo, "git", "init", "-q")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "tree")
    write_files(two_stages.root, {"tests/probe/test_probe.py": PROBE})
    series = two_stages.series()
    tally = TreeTester(sys.executable).pytest(series, repo, ["base"], ["probe"])
    assert (tally.passed, tally.failed) == (1, 1), tally
    assert "the probe's own failure" in tally.first_error
    log = check_log(repo, "tests").read_text()
    assert "written to stdout" in log and "written to stderr at exit" in log
    assert "1 failed, 1 passed" in log


def test_a_branch_git_would_not_make_is_named_with_the_way_on(two_stages):
    """No other rebase's branch and no lock file: git's own reason, and how
    to go on."""
    said = branch._branch_not_made(
        two_stages.series(), "rebase/vllm-x", "c" * 40, "fatal: planted"
    )
    assert said == (
        "git could not create the branch rebase/vllm-x (fatal: planted); the "
        "rebase is kept: fix that, then `nox -s rebase -- --continue`"
    )


def test_the_project_files_a_check_log_names(two_stages, tmp_path):
    """The project's own files in a failed check's tracebacks (absolute or
    relative, each once, in order), not vLLM's and not files it lacks."""
    from scripts.series.rebase import checks

    root = two_stages.root
    write_files(root, {"tests/probe/test_x.py": "", "scripts/harness/h.py": ""})
    log = tmp_path / "check.log"
    log.write_text(
        f"{root}/scripts/harness/h.py:3: in helper\n"
        "tests/probe/test_x.py:12: AssertionError\n"
        "vllm/ops.py:5: in op\n"
        "tests/gone.py:1: in gone\n"
        f"{root}/scripts/harness/h.py:9: in helper\n"
    )
    series = two_stages.series()
    assert checks._project_files_in(series, log) == [
        "scripts/harness/h.py",
        "tests/probe/test_x.py",
    ]
    assert checks._project_files_in(series, tmp_path / "no.log") == []


def test_every_rebase_option_says_what_it_does():
    """``rebase --help``: each option with its sentence (a user's only
    reference at the terminal; the README names the command)."""
    import argparse

    from scripts.series.rebase import commands

    parser = argparse.ArgumentParser()
    commands.arguments(parser)
    helps = {
        action.option_strings[-1]: action.help
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }
    assert helps == {
        "--continue": "go on with a stopped rebase once its conflicts are "
        "resolved (or its failed check fixed) in the work repo",
        "--abort": "drop a stopped rebase; the conflicts resolved so far are "
        "kept for the next one",
        "--version": "target vLLM release (its PyPI sdist)",
        "--sha256": "the target sdist's sha256 (--version alone prints the one "
        "the package index lists)",
        "--git": "target: a local vLLM git checkout",
        "--rev": "the revision of --git",
        "--test-python": "a Python with the test dependencies; with it a stage "
        "whose upstream probe passes on the target without it counts as "
        "upstreamed (kept by --continue)",
        "--drop": "leave this stage out (upstream has it in another form); "
        "with --continue, also the stage in conflict",
    }


def test_a_table_only_the_new_series_file_has_is_added_at_its_end():
    """``updated_series_file``: a table the new file adds (a stage) comes
    after the old file's text, comments kept, one blank line between."""
    from scripts.series.rebase.series_toml import updated_series_file

    old = '# the pin\n[base]\nname = "vllm"\nversion = "0.1.0"\n'
    added = '[[stage]]\nid = "0001"\ntitle = "t"\n'
    new = '[base]\nname = "vllm"\nversion = "0.1.0"\n\n' + added
    assert updated_series_file(old, new) == old + "\n" + added + "\n"


def test_a_stage_that_changes_a_file_other_than_python_is_not_compiled(project):
    """The compile check reads the Python files a stage changes, not the
    others it may carry (a README line here)."""
    project.add_stage(
        "0001",
        {
            "README.md": ("synthetic vLLM\n", "synthetic vLLM, indexed\n"),
            "vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n"),
        },
    )
    project.commit_all()
    target = _target(project, {"vllm/ops.py": ("return 5\n", "return 55\n")})
    (report,) = rebase.start(project.series(), target)
    assert report.outcome == "applied cleanly", report.evidence


def test_a_worktree_left_locked_without_its_folder_is_removed(two_stages, tmp_path):
    """What a kill inside `git worktree add` leaves: a registration locked
    ("initializing") whose folder is gone; removing the rebase's worktree
    clears it too."""
    tree = tmp_path / "project"
    sh(two_stages.root, "git", "worktree", "add", "-q", "--detach", str(tree))
    sh(
        two_stages.root,
        "git",
        "worktree",
        "lock",
        "--reason",
        "initializing",
        str(tree),
    )
    shutil.rmtree(tree)
    branch.remove_worktree(two_stages.series(), tree)
    listed = sh(two_stages.root, "git", "worktree", "list", "--porcelain")
    assert str(tree) not in listed


def test_a_stage_whose_own_tests_fail_names_them_and_the_projects_files(project):
    """A stage's own tests (the project's tests/stage_0001/) fail on the
    target: the stop names the failed test, the log, and that the traceback
    goes through the project's file, which is fixed in the project."""
    project.add_stage(
        "0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = True\n")}
    )
    write_files(
        project.root,
        {
            "tests/stage_0001/test_probe.py": (
                "from vllm import envs\n\n\n"
                "def test_var_5():\n    assert envs.VAR_5 == 5, 'VAR_5 moved'\n"
            )
        },
    )
    project.commit_all()
    target = _target(project, {"vllm/envs.py": ("VAR_5 = 5\n", "VAR_5 = 50\n")})
    with pytest.raises(SeriesError, match="its tests fail on the target") as e:
        rebase.start(project.series(), target, test_python=sys.executable)
    log = _work_repo(project).parent / "check-tests.log"
    assert re.search(
        r"its tests fail on the target \(1 failed: \S*test_probe\S*test_var_5; "
        rf"first error: [^;]+; output in {re.escape(str(log))}\); "
        r"its tracebacks go through the project's tests/stage_0001/test_probe\.py "
        r"\(a break there is fixed in the project, not the work repo\)",
        str(e.value),
    ), str(e.value)


def test_added_lines_are_found_in_a_file_that_is_not_utf8(tmp_path):
    """The check that a merge kept a hunk's added lines reads a file with
    bytes that are not UTF-8 (a Latin-1 comment) without failing."""
    from types import SimpleNamespace

    from scripts.series.rebase.hunks import added_lines_present

    merged = tmp_path / "envs.py"
    merged.write_bytes(b"# 20\xb0C\nVAR_3 = 3\nCP_INDEXER = True\n")
    hunk = SimpleNamespace(text="@@ -1 +1,2 @@\n VAR_3 = 3\n+CP_INDEXER = True\n")
    assert added_lines_present(merged, hunk)
    hunk.text = hunk.text.replace("True", "False")
    assert not added_lines_present(merged, hunk)
