# SPDX-License-Identifier: Apache-2.0
"""export: one commit per stage with its overlays folded in, a PR
description, the standalone check, determinism, an untouched work tree."""

from __future__ import annotations

import shutil

from scripts.series.apply import apply
from scripts.series.config import load_series
from scripts.series.export import export_stages
from scripts.series.git import changed_files, git_out
from tests.tooling.conftest import Project


def test_each_stage_is_one_commit_with_its_overlays(two_stages: Project):
    repo = apply(two_stages.series())
    head = git_out(repo, "rev-parse", "HEAD")
    first, second = export_stages(two_stages.series())
    assert first.patch.parent == two_stages.root / "build/export/vllm-git-v1"
    assert first.needs is None  # applies on the base alone
    assert git_out(repo, "rev-parse", f"{first.branch}^") == git_out(
        repo, "rev-parse", "base"
    )
    files = git_out(repo, "diff", "--name-only", f"{first.commit}^", first.commit)
    assert files.split() == ["vllm/cp_indexer.py", "vllm/envs.py"]
    # Stage 0002 edits a line stage 0001 adds: it needs 0001's PR first.
    assert second.needs == "0001"
    assert git_out(repo, "rev-parse", f"{second.branch}^") == first.commit
    assert git_out(repo, "rev-parse", "HEAD") == head
    assert not changed_files(repo), "export must not touch the work tree"


def test_the_description_follows_vllms_pr_template(two_stages: Project):
    apply(two_stages.series())
    first, _ = export_stages(two_stages.series())
    text = first.description.read_text()
    assert text.startswith("Striped indexer\n\n## Purpose\n\nWhy this stage exists.")
    assert "## Test Plan" in text and 'nox -s "tests(0001)"' in text
    assert "## Test Result" in text
    assert text.rstrip().endswith("Signed-off-by: Ada Dev <ada@example.com>")
    patch = first.patch.read_text()
    assert "Subject: Striped indexer" in patch
    assert "vllm/cp_indexer.py" in patch  # folded in, unlike patches/


def test_a_stage_without_dependencies_applies_alone(project: Project):
    project.add_stage("0001", {"vllm/envs.py": ("VAR_1 = 1\n", "VAR_1 = 11\n")})
    project.add_stage("0002", {"vllm/ops.py": ("return 5\n", "return 55\n")})
    apply(project.series())
    prs = export_stages(project.series())
    assert [pr.needs for pr in prs] == [None, None]
    repo = project.root / "build" / "vllm-git-v1"
    assert git_out(repo, "rev-parse", "pr/0002^") == git_out(repo, "rev-parse", "base")


def test_two_exports_are_byte_identical(two_stages: Project, tmp_path):
    apply(two_stages.series())
    first = [
        (p.commit, p.patch.read_bytes(), p.description.read_bytes())
        for p in export_stages(two_stages.series())
    ]
    again = [
        (p.commit, p.patch.read_bytes(), p.description.read_bytes())
        for p in export_stages(two_stages.series())
    ]
    assert first == again
    other = tmp_path / "elsewhere"
    shutil.copytree(two_stages.root, other, ignore=shutil.ignore_patterns("build"))
    series = load_series(other / "patches" / "series.toml")
    apply(series)
    elsewhere = [
        (p.commit, p.patch.read_bytes(), p.description.read_bytes())
        for p in export_stages(series)
    ]
    assert elsewhere == first


def test_exporting_one_stage_exports_what_it_needs(two_stages: Project):
    apply(two_stages.series())
    (only,) = export_stages(two_stages.series(), "0002")
    assert only.stage.id == "0002" and only.needs == "0001"


def test_an_undeclared_dependency_is_named(two_stages: Project):
    import pytest

    from scripts.series import SeriesError

    two_stages.stages[1]["depends_on"] = []
    two_stages.write_series()
    apply(two_stages.series())
    with pytest.raises(SeriesError, match=r'add depends_on = \["0001"\]'):
        export_stages(two_stages.series())


def test_a_pr_branch_with_a_users_commit_is_not_moved(two_stages: Project):
    """Export moves pr/<id> only from what it last wrote there: a commit of
    the user's on it, or the branch checked out, stops the export instead."""
    import pytest

    from scripts.series import SeriesError
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series)
    first, _ = export_stages(series)
    # As if an older version of the stage had been exported: export may move
    # the branch, but not while it is checked out.
    for ref in (f"refs/heads/{first.branch}", "refs/dsa-series/exported/0001"):
        sh(repo, "git", "update-ref", ref, "stage/0001")
    sh(repo, "git", "worktree", "add", "-q", str(two_stages.tmp / "pr"), first.branch)
    with pytest.raises(SeriesError, match="is checked out in a work tree"):
        export_stages(series, "0001")
    sh(repo, "git", "worktree", "remove", str(two_stages.tmp / "pr"))
    assert export_stages(series, "0001")[0].commit == first.commit
    # A commit export did not make stays where it is.
    sh(repo, "git", "branch", "-f", first.branch, "stage/0002")
    with pytest.raises(SeriesError, match="holds commits export did not make"):
        export_stages(series, "0001")
    assert git_out(repo, "rev-parse", first.branch) == git_out(
        repo, "rev-parse", "stage/0002"
    )
    with pytest.raises(SeriesError, match="the base is not a stage"):
        export_stages(series, "base")
