# SPDX-License-Identifier: Apache-2.0
"""refresh / check: byte-identical exports, stale patches, edits into stages."""

from __future__ import annotations

import pytest

from scripts.series import SeriesError
from scripts.series.git import changed_files, git_out
from scripts.series.stages.apply import apply
from scripts.series.stages.check import stale_files
from scripts.series.stages.patchfile import read_patch
from scripts.series.stages.refresh import FORMAT_PATCH_FLAGS, refresh
from scripts.series.stages.status import format_status, tree_status
from tests.tooling.conftest import Project, sh


def _patch_bytes(project: Project) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (project.root / "patches").glob("*.patch")}


def test_two_exports_are_byte_identical(two_stages: Project):
    series = two_stages.series()
    apply(series)
    refresh(series)
    first = _patch_bytes(two_stages)
    refresh(series)
    assert _patch_bytes(two_stages) == first
    assert stale_files(series) == []


def test_exported_patches_are_canonical(two_stages: Project):
    series = two_stages.series()
    apply(series)
    refresh(series)
    text = (two_stages.root / "patches" / two_stages.stages[0]["patch"]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: Striped indexer\n" in text  # --keep-subject: no [PATCH]
    assert " 1 file changed" not in text  # --no-stat
    assert "vllm/cp_indexer.py" not in text  # overlays stay out of the patch
    assert "Signed-off-by: Ada Dev <ada@example.com>" in text
    index_lines = [line for line in text.splitlines() if line.startswith("index ")]
    assert index_lines and all(len(line.split()[1]) == 82 for line in index_lines)
    assert not text.rstrip().endswith(
        git_out(two_stages.root.parent, "--version").split()[-1]
    )  # --no-signature
    assert "--full-index" in FORMAT_PATCH_FLAGS


def test_user_git_config_does_not_change_the_bytes(
    two_stages: Project, monkeypatch, tmp_path
):
    series = two_stages.series()
    apply(series)
    refresh(series)
    first = _patch_bytes(two_stages)
    home = tmp_path / "home"
    home.mkdir()
    config = home / ".gitconfig"
    config.write_text(
        "[format]\n\tsignOff = true\n\tnumbered = true\n"
        "[diff]\n\tmnemonicPrefix = true\n\tnoprefix = true\n"
        "[core]\n\tabbrev = 7\n"
    )
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    refresh(series)
    assert _patch_bytes(two_stages) == first


def test_check_detects_a_stale_patch(two_stages: Project):
    """A patch that applies but is not what the stage commit exports (here:
    hand-written with default flags, stat and all) is reported stale."""
    series = two_stages.series()
    apply(series)
    assert stale_files(series) == [f"patches/{s['patch']}" for s in two_stages.stages]
    refresh(series)
    assert stale_files(series) == []
    patch = two_stages.root / "patches" / two_stages.stages[1]["patch"]
    patch.write_text(
        patch.read_text().replace("Subject: Top-k gate", "Subject: Top-k gate, edited")
    )
    apply(series)  # the new message makes a new commit; the bytes still differ
    assert stale_files(series) == []
    patch.write_text(patch.read_text() + "\n")
    apply(series)
    assert stale_files(series) == [f"patches/{two_stages.stages[1]['patch']}"]


def test_check_detects_a_stale_overlay(two_stages: Project):
    series = two_stages.series()
    apply(series)
    refresh(series)
    repo = apply(series)
    (repo / "vllm/cp_indexer.py").write_text("edited in the tree\n")
    with pytest.raises(SeriesError, match="edits beyond the last stage"):
        stale_files(series)


def test_refresh_folds_tree_edits_into_the_top_stage(two_stages: Project):
    """Edits to vLLM files join the top stage's patch; an edit to stage 0001's
    overlay module goes to stage 0001's overlay, not into stage 0002."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)  # make the hand-made patches canonical first
    (repo / "vllm/ops.py").write_text(
        (repo / "vllm/ops.py").read_text().replace("return 7\n", "return 77\n")
    )
    (repo / "vllm/cp_indexer.py").write_text("def split():\n    return 'mirrored'\n")
    written = refresh(series)
    assert [s.id for s in written] == ["0001", "0002"]
    patch = read_patch(two_stages.root / "patches" / two_stages.stages[1]["patch"])
    assert patch.files == ("vllm/envs.py", "vllm/ops.py")
    assert (
        two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    ).read_text() == "def split():\n    return 'mirrored'\n"
    assert not changed_files(repo)
    head = git_out(repo, "rev-parse", "HEAD")
    apply(series)  # the tree is exactly what the files describe: a no-op
    assert git_out(repo, "rev-parse", "HEAD") == head
    assert stale_files(series) == []
    assert "return 77" in (repo / "vllm/ops.py").read_text()


def test_an_edit_to_a_lower_stages_lines_from_the_top_names_that_stage(
    project: Project,
):
    """With the tree at the top stage, an edit to a line that stage 0001 adds
    would become a new hunk of stage 0002: refresh stops, naming 0001, and
    writes nothing; made at stage 0001 as it says, the edit lands there;
    --into-top takes it into stage 0002 on purpose."""
    project.add_stage(
        "0001", {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")}
    )
    old_op, new_op = "def op_20():\n    return 20\n", "def op_20():\n    return 2020\n"
    project.add_stage("0002", {"vllm/ops.py": (old_op, new_op)}, depends_on=("0001",))
    series = project.series()
    patches = project.root / "patches"
    first, top = (patches / s["patch"] for s in project.stages)
    repo = apply(series)
    refresh(series)
    before = {p.name: p.read_bytes() for p in patches.iterdir()}
    envs = repo / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("CP_INDEXER = False", "CP_INDEXER = 1"))
    with pytest.raises(SeriesError, match="vllm/envs.py line 5: stage 0001") as refusal:
        refresh(series)
    assert "apply --upto 0001" in str(refusal.value)
    assert {p.name: p.read_bytes() for p in patches.iterdir()} == before
    assert "CP_INDEXER = 1" in envs.read_text()  # the edit is still there
    # As the README says: stash, apply up to the stage, pop, refresh, apply.
    sh(repo, "git", "stash", "-q")
    apply(series, "0001")
    sh(repo, "git", "stash", "pop", "-q")
    assert [s.id for s in refresh(series)] == ["0001"]
    assert "+CP_INDEXER = 1" in first.read_text()
    apply(series)
    assert "CP_INDEXER" not in top.read_text()
    # On purpose, into the top stage.
    envs.write_text(envs.read_text().replace("CP_INDEXER = 1", "CP_INDEXER = 2"))
    refresh(series, into_top=True)
    assert "+CP_INDEXER = 2" in top.read_text()


def test_refresh_turns_a_commit_on_top_into_the_next_stage(two_stages: Project):
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    (repo / "vllm/ops.py").write_text(
        (repo / "vllm/ops.py").read_text().replace("return 9\n", "return 99\n")
    )
    (repo / "vllm/mxfp4.py").write_text("ROW_BYTES = 68\n")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-q", "-s", "-m", "MXFP4 cache", "-m", "68-byte rows.")
    two_stages.stages.append(
        dict(
            id="0003",
            title="MXFP4 cache",
            patch="0003-mxfp4-cache.patch",
            overlays=["vllm/mxfp4.py"],
        )
    )
    two_stages.write_series()
    series = two_stages.series()
    written = refresh(series)
    assert [s.id for s in written] == ["0003"]
    patch = read_patch(two_stages.root / "patches/0003-mxfp4-cache.patch")
    assert patch.message.startswith("MXFP4 cache\n\n68-byte rows.")
    assert patch.files == ("vllm/ops.py",)
    assert (
        two_stages.root / "vllm_overlay/vllm/mxfp4.py"
    ).read_text() == "ROW_BYTES = 68\n"
    assert git_out(repo, "rev-parse", "HEAD") == git_out(
        repo, "rev-parse", "stage/0003"
    )


def test_refresh_refuses_commits_without_a_stage_entry(two_stages: Project):
    series = two_stages.series()
    repo = apply(series)
    (repo / "vllm/ops.py").write_text("x\n")
    sh(repo, "git", "commit", "-qam", "unplanned")
    with pytest.raises(SeriesError, match=r"add a \[\[stage\]\] entry"):
        refresh(series)
    assert (repo / "vllm/ops.py").read_text() == "x\n"


def test_a_later_stage_may_not_edit_an_earlier_stages_overlay(two_stages: Project):
    series = two_stages.series()
    repo = apply(series)
    (repo / "vllm/ops.py").write_text("x\n")
    (repo / "vllm/cp_indexer.py").write_text("rewritten by stage 0003\n")
    sh(repo, "git", "commit", "-qam", "stage three")
    two_stages.stages.append(
        dict(id="0003", title="Three", patch="0003-three.patch", overlays=[])
    )
    two_stages.write_series()
    with pytest.raises(
        SeriesError, match="changes vllm/cp_indexer.py, an overlay of stage 0001"
    ):
        refresh(two_stages.series())
    assert not (two_stages.root / "patches/0003-three.patch").exists()


def test_a_new_module_in_the_patch_gets_a_warning(two_stages: Project, capsys):
    series = two_stages.series()
    repo = apply(series)
    (repo / "vllm/helper.py").write_text("logic = 'belongs in an overlay'\n")
    refresh(series)
    assert (
        "adds vllm/helper.py; new modules belong in vllm_overlay/"
        in capsys.readouterr().err
    )


def test_the_readme_flow_for_changing_an_earlier_stage(two_stages: Project):
    """docs/maintaining.md, 'Change a stage': apply up to a stage, edit, refresh, then
    apply the rest on top."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    apply(series, "0001")
    (repo / "vllm/ops.py").write_text(
        (repo / "vllm/ops.py").read_text().replace("return 3\n", "return 33\n")
    )
    written = refresh(series)
    assert [s.id for s in written] == ["0001"]
    assert (
        "vllm/ops.py"
        in read_patch(two_stages.root / "patches" / two_stages.stages[0]["patch"]).files
    )
    apply(series)
    text = (repo / "vllm/ops.py").read_text()
    assert "return 33" in text and "return 2020" in text
    # Stage 0002's patch names the blobs it changes, one of which stage 0001
    # just changed: a last refresh brings its patch file up to date.
    assert stale_files(series) == [f"patches/{two_stages.stages[1]['patch']}"]
    assert [s.id for s in refresh(series)] == ["0002"]
    assert stale_files(series) == []


def test_a_later_stage_that_no_longer_applies_is_carried_then_continued(
    two_stages: Project,
):
    """docs/maintaining.md, 'Change a stage': stage 0001 changes the line stage 0002
    edits next to. apply stops naming --carry; --carry leaves the three-way
    conflict; --continue commits the stage as its own; refresh writes its
    patch; the next apply is a no-op and check finds nothing stale. --abort
    goes back to stage 0001 as it was."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    apply(series, "0001")
    envs = repo / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("CP_INDEXER = False", "CP_INDEXER = None"))
    refresh(series)
    with pytest.raises(SeriesError, match="apply -- --carry"):
        apply(series)
    with pytest.raises(SeriesError, match="carried with conflicts in vllm/envs.py"):
        apply(series, carry=True)
    assert "<<<<<<<" in envs.read_text()
    with pytest.raises(SeriesError, match="waits for its conflicts"):
        apply(series)
    with pytest.raises(SeriesError, match="carried stage waits"):
        refresh(series)  # would fold the conflict markers into a stage
    assert "a carried stage waits" in format_status(series, tree_status(series))
    # --abort: back to stage 0001, then carry again.
    apply(series, abort=True)
    assert git_out(repo, "rev-parse", "HEAD") == git_out(
        repo, "rev-parse", "stage/0001"
    )
    assert not changed_files(repo) and "CP_INDEXER = None" in envs.read_text()
    with pytest.raises(SeriesError, match="carried with conflicts"):
        apply(series, carry=True)
    with pytest.raises(
        SeriesError, match="conflict markers are still in: vllm/envs.py"
    ):
        apply(series, resume=True)
    text = envs.read_text()
    resolved = text[: text.index("<<<<<<<")] + "CP_INDEXER = True\n"
    resolved += text[text.index(">>>>>>>") :].split("\n", 1)[1]
    envs.write_text(resolved)
    apply(series, resume=True)
    assert "return 2020" in (repo / "vllm/ops.py").read_text()
    assert (repo / "vllm/cp_indexer.py").exists()
    assert git_out(repo, "log", "-1", "--format=%s") == "Top-k gate"
    assert [s.id for s in refresh(series)] == ["0002"]
    top = (two_stages.root / "patches" / two_stages.stages[1]["patch"]).read_text()
    assert "-CP_INDEXER = None\n+CP_INDEXER = True" in top
    head = git_out(repo, "rev-parse", "HEAD")
    apply(series)
    assert git_out(repo, "rev-parse", "HEAD") == head
    assert stale_files(series) == []
    with pytest.raises(SeriesError, match="no carried stage is waiting"):
        apply(series, resume=True)


def test_an_amended_stage_commit_is_taken_as_the_stage(two_stages: Project):
    """`git commit --amend` of the top stage's commit: refresh takes it as
    that stage (same subject), not as a new stage; with another subject it
    refuses, writing nothing."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    ops = repo / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 2020\n", "return 2021\n"))
    sh(repo, "git", "commit", "-q", "-a", "--amend", "--no-edit")
    with pytest.raises(SeriesError, match="not a stage commit"):
        apply(series)
    patch = two_stages.root / "patches" / two_stages.stages[1]["patch"]
    assert [s.id for s in refresh(series)] == ["0002"]
    assert "+    return 2021" in patch.read_text()
    head = git_out(repo, "rev-parse", "HEAD")
    apply(series)
    assert git_out(repo, "rev-parse", "HEAD") == head and stale_files(series) == []
    before = patch.read_bytes()
    sh(repo, "git", "commit", "-q", "--amend", "-m", "something else")
    with pytest.raises(SeriesError, match="its subject is not the stage's"):
        refresh(series)
    assert patch.read_bytes() == before


def test_a_fixup_autosquashed_into_a_lower_stage_is_taken_by_refresh(
    two_stages: Project,
):
    """docs/maintaining.md, 'Change a stage', the plain-git route: with the tree at the
    top stage, commit the edit as a fixup of stage 0001, autosquash it with
    git's own rebase onto the base tag, then refresh: stage 0001's patch
    takes the edit, stage 0002 keeps its own, and the tree is canonical."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    ops = repo / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 3\n", "return 33\n"))
    sh(repo, "git", "commit", "-q", "-a", "--fixup", "stage/0001")
    sh(
        repo,
        "env",
        "GIT_SEQUENCE_EDITOR=:",
        "git",
        "rebase",
        "-q",
        "-i",
        "--autosquash",
        "base",
    )
    assert [s.id for s in refresh(series)] == ["0001", "0002"]
    first = two_stages.root / "patches" / two_stages.stages[0]["patch"]
    assert "vllm/ops.py" in read_patch(first).files
    assert "+    return 33" in first.read_text()
    assert "return 2020" in ops.read_text() and "return 33" in ops.read_text()
    head = git_out(repo, "rev-parse", "HEAD")
    apply(series)
    assert git_out(repo, "rev-parse", "HEAD") == head and stale_files(series) == []


def test_refresh_keeps_hand_edits_to_the_series_files(two_stages: Project):
    """A patch edited by hand after the tree was applied is newer than the
    tree: refresh must not overwrite it with the tree's older state."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    patch = two_stages.root / "patches" / two_stages.stages[0]["patch"]
    edited = patch.read_text().replace("Why this stage exists.", "Hand-edited.")
    patch.write_text(edited)
    (repo / "vllm/ops.py").write_text("tree edit\n")
    with pytest.raises(SeriesError, match="changed since the tree was applied"):
        refresh(series)
    assert patch.read_text() == edited
    assert (repo / "vllm/ops.py").read_text() == "tree edit\n"


def _series_files(project: Project) -> dict[str, bytes]:
    return {
        str(p.relative_to(project.root)): p.read_bytes()
        for folder in ("patches", "vllm_overlay")
        for p in sorted((project.root / folder).rglob("*"))
        if p.is_file()
    }


def _edit_tree(repo) -> None:
    ops = repo / "vllm/ops.py"
    ops.write_text(ops.read_text().replace("return 7\n", "return 77\n"))


def test_a_refresh_that_fails_after_folding_the_edits_changes_nothing(
    two_stages: Project,
):
    """An overlay renamed in the tree fails the refresh after it folded the
    tree edits into a commit (in git's object store only): the series
    files, HEAD and the uncommitted edits are as they were, and apply and
    refresh work again."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    files, head = _series_files(two_stages), git_out(repo, "rev-parse", "HEAD")
    _edit_tree(repo)
    sh(repo, "git", "mv", "vllm/cp_indexer.py", "vllm/cp_indexer_renamed.py")
    with pytest.raises(SeriesError, match="overlay vllm/cp_indexer.py is not in"):
        refresh(series)
    assert _series_files(two_stages) == files
    assert git_out(repo, "rev-parse", "HEAD") == head
    assert git_out(repo, "symbolic-ref", "--short", "HEAD") == "series"
    assert "return 77" in (repo / "vllm/ops.py").read_text()
    assert (repo / "vllm/cp_indexer_renamed.py").exists()
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "mv", "vllm/cp_indexer_renamed.py", "vllm/cp_indexer.py")
    assert [s.id for s in refresh(series)] == ["0002"]
    assert stale_files(series) == []


def _kill_refresh_after_writing_one_file(series, monkeypatch) -> None:
    """A refresh killed after it wrote its first series file (a kill runs
    no clean-up, as an exception here does none either)."""
    import scripts.series.stages.refresh as refresh_module

    real_write = refresh_module.write_whole
    written = []

    def write_then_die(path, data):
        if written:
            raise KeyboardInterrupt
        real_write(path, data)
        written.append(path)

    monkeypatch.setattr(refresh_module, "write_whole", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        refresh(series)
    monkeypatch.undo()
    assert len(written) == 1


def _edit_both_stages(repo) -> None:
    """Edits that change a file of each stage: stage 0001's overlay module
    (an overlay edit goes to the stage that owns it) and the top stage's
    glue."""
    _edit_tree(repo)
    overlay = repo / "vllm/cp_indexer.py"
    overlay.write_text(overlay.read_text() + "\n# edited\n")


def test_a_killed_refresh_is_finished_by_running_it_again(
    two_stages: Project, monkeypatch
):
    """Killed after writing one series file of two: the tree, its HEAD and
    the uncommitted edits are untouched, and the next refresh writes the
    rest, ending where an uninterrupted refresh ends. No journal: the
    first file already holds what refresh writes, so it is no edit."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    head = git_out(repo, "rev-parse", "HEAD")
    _edit_both_stages(repo)
    before = _series_files(two_stages)

    _kill_refresh_after_writing_one_file(series, monkeypatch)
    assert git_out(repo, "rev-parse", "HEAD") == head
    assert "return 77" in (repo / "vllm/ops.py").read_text()
    assert [s.id for s in refresh(series)] == ["0002"]
    after = _series_files(two_stages)
    assert after["vllm_overlay/vllm/cp_indexer.py"].endswith(b"# edited\n")
    assert after != before and stale_files(series) == []
    assert not changed_files(repo) and "return 77" in (repo / "vllm/ops.py").read_text()


def test_a_series_file_edited_after_a_killed_refresh_is_not_overwritten(
    two_stages: Project, monkeypatch
):
    """After a kill, the user edits a series file by hand before the next
    refresh: it refuses, naming the file, and the edit stays."""
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    _edit_both_stages(repo)
    _kill_refresh_after_writing_one_file(series, monkeypatch)
    first = two_stages.root / "patches" / two_stages.stages[0]["patch"]
    hand_edited = first.read_text() + "\n"
    first.write_text(hand_edited)
    with pytest.raises(SeriesError, match="changed since the tree was applied"):
        refresh(series)
    assert first.read_text() == hand_edited
    assert "return 77" in (repo / "vllm/ops.py").read_text()


def test_refresh_never_writes_through_a_symlink_out_of_the_project(
    two_stages: Project,
):
    series = two_stages.series()
    repo = apply(series)
    outside = two_stages.tmp / "outside.py"
    outside.write_text("not the project's\n")
    overlay = two_stages.root / "vllm_overlay/vllm/cp_indexer.py"
    overlay.unlink()
    overlay.symlink_to(outside)
    (repo / "vllm/cp_indexer.py").write_text("def split():\n    return 'x'\n")
    with pytest.raises(SeriesError, match="leads outside the project"):
        refresh(series)
    assert outside.read_text() == "not the project's\n"


def test_a_refresh_that_fails_while_folding_keeps_the_edits(
    two_stages: Project, monkeypatch
):
    """Making the commit of the edits fails (a full disk, say): nothing was
    checked out or reset over the edits, and the next refresh works."""
    import scripts.series.stages.refresh as refresh_module

    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    _edit_tree(repo)
    files = _series_files(two_stages)

    def failing_commit(*args, **kwargs):
        raise SeriesError("git commit-tree failed: No space left on device")

    monkeypatch.setattr(refresh_module, "commit_tree", failing_commit)
    with pytest.raises(SeriesError, match="No space left"):
        refresh(series)
    monkeypatch.undo()
    assert "return 77" in (repo / "vllm/ops.py").read_text()
    assert _series_files(two_stages) == files
    assert [s.id for s in refresh(series)] == ["0002"]


def test_a_mode_change_the_series_cannot_carry_is_refused(two_stages: Project):
    """An overlay is kept as a plain file: a mode change to it cannot be
    carried, so refresh stops, naming the file, and undoes itself (the
    re-applied tree is really compared with the user's)."""
    import os
    import stat

    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    files = _series_files(two_stages)
    overlay = repo / "vllm/cp_indexer.py"
    overlay.chmod(overlay.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(SeriesError, match=r"vllm/cp_indexer\.py .*no mode change"):
        refresh(series)
    assert _series_files(two_stages) == files
    assert os.access(overlay, os.X_OK), "the user's tree keeps the mode"


def test_a_symlink_the_series_cannot_carry_is_refused(two_stages: Project):
    series = two_stages.series()
    repo = apply(series)
    refresh(series)
    files = _series_files(two_stages)
    overlay = repo / "vllm/cp_indexer.py"
    overlay.unlink()
    overlay.symlink_to("ops.py")
    with pytest.raises(SeriesError, match=r"vllm/cp_indexer\.py .*no symlink"):
        refresh(series)
    assert _series_files(two_stages) == files
    assert overlay.is_symlink(), "the user's tree keeps the link"


def test_refs_name_objects_not_object_types(two_stages: Project):
    from scripts.series.git import rev_parse, tree_id

    repo = apply(two_stages.series())
    assert tree_id(repo, "HEAD") == git_out(repo, "rev-parse", "HEAD^{tree}")
    assert rev_parse(repo, "HEAD") == git_out(repo, "rev-parse", "HEAD")
    with pytest.raises(ValueError, match="name the ref"):
        rev_parse(repo, "HEAD^{tree}")
