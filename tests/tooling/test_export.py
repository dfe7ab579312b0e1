# SPDX-License-Identifier: Apache-2.0
"""export: one commit per stage with its overlays folded in, a PR
description, the standalone check, determinism, an untouched work tree."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.series import SeriesError
from scripts.series.config import REPO_ROOT, load_series
from scripts.series.export import pr_check
from scripts.series.export.export import export_stages
from scripts.series.export.pr_check import check_prs
from scripts.series.git import Identity, changed_files, git_out
from scripts.series.stages.apply import apply
from tests.tooling.conftest import Project, sh, write_files

EXPORTER = Identity("Eve Exporter", "eve@example.org", "")


def test_each_stage_is_one_commit_with_its_overlays(two_stages: Project):
    repo = apply(two_stages.series())
    head = git_out(repo, "rev-parse", "HEAD")
    first, second = export_stages(two_stages.series(), EXPORTER)
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


def test_the_description_follows_the_targets_pr_template(two_stages: Project):
    """Read from the target tree: its sections filled (a dependency named),
    its checklist kept; the commit message is the plain-text one, signed off
    by the exporter instead of the series' identity."""
    template = (
        "<!-- markdownlint-disable -->\n\n## Overview\n\n<!-- Summarize. -->\n\n"
        "## Claims\n\n<!-- Bullets. -->\n\n## Validation\n\n<!-- Evidence. -->\n\n"
        "## Details\n\n<!-- Why. -->\n\n---\n\n<details>checklist</details>\n"
    )
    up = two_stages.upstream
    write_files(up, {".github/PULL_REQUEST_TEMPLATE.md": template})
    sh(up, "git", "add", "-A")
    sh(up, "git", "commit", "-qm", "template")
    sh(up, "git", "tag", "-f", "v1")
    write_files(
        two_stages.root,
        {
            "docs/stage_0001.md": "# Stage 0001\n\n## Results\n\n"
            "| what | where |\n|---|---|\n| gloo | `tests/stage_0001/t.py`, "
            "`nox -s apply-and-test` |\n| kernel | `tests/v1/test_x.py` |\n\n"
            "See [the bench](bench.md).\n\n## Design\n\nnot in the PR\n"
        },
    )
    apply(two_stages.series())
    first, second = export_stages(two_stages.series(), EXPORTER)
    text = first.description.read_text()
    assert text.startswith("Striped indexer\n\n<!-- markdownlint-disable -->")
    # A reader of the PR gets what was checked and how it went; the series'
    # own files and commands (the `where` column) and links stay out.
    assert "| what |\n| --- |\n| gloo |\n| kernel |\n\nSee the bench." in text
    assert "tests/stage_0001" not in text and "DSA series" not in text
    assert "bench.md" not in text
    assert "not in the PR" not in text
    assert "This PR adds no tests to vLLM's tests/." in text
    assert "`nox" not in text and "`tests/stage" not in text
    assert "## Overview\n\nWhy this stage exists.\n\n## Claims" in text
    assert "<!-- Summarize. -->" not in text
    assert "measured outside vLLM's tree on vllm-git-v1" in text
    assert text.rstrip().endswith("<details>checklist</details>")
    assert 'Depends on "Striped indexer" (its PR is not opened yet)' in (
        second.description.read_text()
    )
    # A stage without docs/stage_<id>.md (a new one): only what is true.
    bare = second.description.read_text()
    assert "## Claims\n\nSee Validation.\n" in bare
    assert "No recorded results yet." in bare
    assert "This PR adds no tests to vLLM's tests/." in bare
    assert "gloo" not in bare and "Quoted from" not in bare
    repo = two_stages.root / "build" / "vllm-git-v1"
    message = git_out(repo, "log", "-1", "--format=%B", first.commit)
    assert message.startswith("Striped indexer\n\nWhy this stage exists.\n\n")
    # Short: the first paragraph; the rest is the description's Details.
    assert "How it works." not in message
    assert "## Details\n\nHow it works." in text
    assert "## " not in message and "Ada Dev" not in message
    assert message.endswith("Signed-off-by: Eve Exporter <eve@example.org>")
    assert git_out(repo, "log", "-1", "--format=%an <%ae>", first.commit) == (
        "Eve Exporter <eve@example.org>"
    )
    patch = first.patch.read_text()
    assert "Subject: Striped indexer" in patch
    assert "vllm/cp_indexer.py" in patch  # folded in, unlike patches/


def test_a_results_row_names_the_prs_own_test_instead_of_the_series_files():
    from types import SimpleNamespace

    from scripts.series.export.export import _without_where

    stage = SimpleNamespace(vllm_tests=["tests/v1/test_x.py"])
    section = (
        "Intro.\n\n| what | where | result |\n|---|---|---|\n"
        "| merge | `tests/v1/test_x.py` (this stage's PR test) | passes |\n"
        "| gloo | `tests/stage_0001/` | all pass |\n\nAfter."
    )
    assert _without_where(section, stage) == (
        "Intro.\n\n| what | result |\n| --- | --- |\n"
        "| merge (this PR's `tests/v1/test_x.py`) | passes |\n"
        "| gloo | all pass |\n\nAfter."
    )


def test_a_stage_without_dependencies_applies_alone(project: Project):
    project.add_stage("0001", {"vllm/envs.py": ("VAR_1 = 1\n", "VAR_1 = 11\n")})
    project.add_stage("0002", {"vllm/ops.py": ("return 5\n", "return 55\n")})
    apply(project.series())
    prs = export_stages(project.series(), EXPORTER)
    assert [pr.needs for pr in prs] == [None, None]
    repo = project.root / "build" / "vllm-git-v1"
    assert git_out(repo, "rev-parse", "pr/0002^") == git_out(repo, "rev-parse", "base")


def test_two_exports_are_byte_identical(two_stages: Project, tmp_path):
    apply(two_stages.series())
    first = [
        (p.commit, p.patch.read_bytes(), p.description.read_bytes())
        for p in export_stages(two_stages.series(), EXPORTER)
    ]
    again = [
        (p.commit, p.patch.read_bytes(), p.description.read_bytes())
        for p in export_stages(two_stages.series(), EXPORTER)
    ]
    assert first == again
    other = tmp_path / "elsewhere"
    shutil.copytree(two_stages.root, other, ignore=shutil.ignore_patterns("build"))
    series = load_series(other / "patches" / "series.toml")
    apply(series)
    elsewhere = [
        (p.commit, p.patch.read_bytes(), p.description.read_bytes())
        for p in export_stages(series, EXPORTER)
    ]
    assert elsewhere == first


def test_exporting_one_stage_exports_what_it_needs(two_stages: Project):
    apply(two_stages.series())
    first, second = export_stages(two_stages.series(), EXPORTER, "0002")
    assert second.stage.id == "0002" and second.needs == "0001"
    assert first.stage.id == "0001" and first.needs is None
    (alone,) = export_stages(two_stages.series(), EXPORTER, "0001")
    assert alone.commit == first.commit


def test_an_undeclared_dependency_is_named(two_stages: Project):
    import pytest

    from scripts.series import SeriesError

    two_stages.stages[1]["depends_on"] = []
    two_stages.write_series()
    apply(two_stages.series())
    with pytest.raises(SeriesError, match=r'add depends_on = \["0001"\]'):
        export_stages(two_stages.series(), EXPORTER)


def test_a_pr_branch_with_a_users_commit_is_not_moved(two_stages: Project):
    """Export moves pr/<id> only from what it last wrote there: a commit of
    the user's on it, or the branch checked out, stops the export instead."""
    import pytest

    from scripts.series import SeriesError
    from tests.tooling.conftest import sh

    series = two_stages.series()
    repo = apply(series)
    first, _ = export_stages(series, EXPORTER)
    # As if an older version of the stage had been exported: export may move
    # the branch, but not while it is checked out.
    for ref in (f"refs/heads/{first.branch}", "refs/dsa-series/exported/0001"):
        sh(repo, "git", "update-ref", ref, "stage/0001")
    sh(repo, "git", "worktree", "add", "-q", str(two_stages.tmp / "pr"), first.branch)
    with pytest.raises(SeriesError, match="is checked out in a work tree"):
        export_stages(series, EXPORTER, "0001")
    sh(repo, "git", "worktree", "remove", str(two_stages.tmp / "pr"))
    assert export_stages(series, EXPORTER, "0001")[0].commit == first.commit
    # A commit export did not make stays where it is.
    sh(repo, "git", "branch", "-f", first.branch, "stage/0002")
    with pytest.raises(SeriesError, match="holds commits export did not make"):
        export_stages(series, EXPORTER, "0001")
    assert git_out(repo, "rev-parse", first.branch) == git_out(
        repo, "rev-parse", "stage/0002"
    )
    with pytest.raises(SeriesError, match="the base is not a stage"):
        export_stages(series, EXPORTER, "base")


def test_exported_prs_apply_with_plain_git_am_and_their_tests_pass(
    project: Project, tmp_path
):
    """As a maintainer applies them: each patch with plain `git am` onto a
    clone of the base (the second onto the first, which it needs); title and
    sign-off intact; the tests each PR adds to the tree pass there with plain
    pytest, nothing of the series on the path."""
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        {
            "vllm/cp_indexer.py": "def split():\n    return 'striped'\n",
            "tests/test_cp_indexer.py": (
                "from vllm.cp_indexer import split\n\n\n"
                "def test_split():\n    assert split() == 'striped'\n"
            ),
        },
        title="[ROCm][Perf] Striped indexer",
    )
    project.add_stage(
        "0002",
        {"vllm/envs.py": ("CP_INDEXER = False\n", "CP_INDEXER = True\n")},
        {
            "tests/test_envs.py": (
                "from vllm import envs\n\n\n"
                "def test_on():\n    assert envs.CP_INDEXER\n"
            )
        },
        title="[ROCm] Top-k gate",
        depends_on=("0001",),
    )
    series = project.series()
    assert [s.vllm_tests for s in series.stages] == [
        ("tests/test_cp_indexer.py",),
        ("tests/test_envs.py",),
    ]
    apply(series)
    # The last `test` run's results of stage 0001's tree (junit of its PR tests).
    results = project.root / "build/results/vllm-git-v1/0001"
    results.mkdir(parents=True)
    (results / "pr-tests.xml").write_text(
        '<testsuites><testsuite timestamp="2026-11-30T10:00:00.123">'
        '<testcase classname="tests.test_cp_indexer" name="test_split"/>'
        '<testcase classname="tests.test_other" name="t"><failure/></testcase>'
        "</testsuite></testsuites>"
    )
    first, second = export_stages(series, EXPORTER)
    assert (
        "```\npytest -q tests/test_cp_indexer.py\n```" in first.description.read_text()
    )
    assert "CPU, vllm-git-v1 (run of 2026-11-30T10:00:00): 1 passed, 0 failed" in (
        first.description.read_text()
    )
    assert "Not yet run on vllm-git-v1" in second.description.read_text()
    clone = tmp_path / "vllm"
    sh(tmp_path, "git", "clone", "-q", str(project.upstream), str(clone))
    sh(clone, "git", "checkout", "-q", "v1")
    for pr in (first, second):
        sh(clone, "git", "am", "-q", str(pr.patch))
    fields = "%s|%an|%(trailers:key=Signed-off-by,valueonly)"
    log = sh(clone, "git", "log", "-2", f"--format={fields}").split("\n\n")
    assert log[0].startswith("Top-k gate|Eve Exporter|Eve Exporter <eve")
    assert log[1].startswith("Striped indexer|Eve Exporter|Eve Exporter <eve")
    # The tags stay in the PR title, the description's first line.
    assert first.description.read_text().startswith("[ROCm][Perf] Striped indexer\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout
    assert "2 passed" in done.stdout


def _stage_with_a_pr_test(project: Project, test_body: str) -> None:
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = True\n")},
        {"tests/test_envs.py": f"from vllm import envs\n\n\n{test_body}"},
        title="[ROCm] Switch",
    )


def test_the_maintainers_check_passes_a_good_pr(project: Project):
    _stage_with_a_pr_test(project, "def test_on():\n    assert envs.CP_INDEXER\n")
    apply(project.series())
    prs = export_stages(project.series(), EXPORTER)
    check_prs(project.series(), prs, sys.executable)
    assert (
        git_out(project.root / "build/vllm-git-v1", "worktree", "list").count("\n") == 0
    ), "the check's checkouts are removed"
    # The description states this export's own checks, not "not yet run".
    text = prs[0].description.read_text()
    assert "Not yet run" not in text
    # This target has no pre-commit config: said so, not claimed as passed.
    assert "| vLLM's pre-commit | not run |" in text
    assert (
        "| its tests with plain pytest on a CPU (tests/test_envs.py) | passed |" in text
    )
    # No vllm/platforms/rocm.py in this target: AMD CI's views are not run.
    assert (
        text.count("runs them, emulated on a CPU (tests/test_envs.py) | not run |") == 4
    )
    assert text.index("| `git am` | passed |") < text.index("## Details")


def test_the_maintainers_check_names_a_failing_pr_test(project: Project):
    _stage_with_a_pr_test(project, "def test_off():\n    assert not envs.CP_INDEXER\n")
    apply(project.series())
    prs = export_stages(project.series(), EXPORTER)
    with pytest.raises(
        SeriesError,
        match=r"its tests with plain pytest on a CPU \(tests/test_envs.py\): "
        r"0 passed, 1 failed",
    ):
        check_prs(project.series(), prs, sys.executable)
    with pytest.raises(SeriesError, match="no such Python"):
        check_prs(project.series(), prs, "/no/python")


def test_the_maintainers_check_names_a_message_an_editor_would_change(project):
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 33\n")},
        # An issue number at the start of a line: an editor strips it.
        body="Raise VAR_3, as asked in\n#3, for the new\ndefault.",
    )
    apply(project.series())
    prs = export_stages(project.series(), EXPORTER)
    with pytest.raises(SeriesError, match="message: changes when edited"):
        check_prs(project.series(), prs, sys.executable)


# A target's own hook, as vLLM's local hooks are declared (a Python script
# of the tree's tools/pre_commit/, run by pre-commit on the matching files),
# ruff from its hook repository (run from the package index at the pinned
# version, as vLLM pins it) and a hook repository whose tool is not on the
# index.
PRECOMMIT_CONFIG = """\
default_stages: [pre-commit, manual]
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.17.2
  hooks:
  - id: ruff-check
- repo: https://github.com/example/checker
  rev: v1.0.0
  hooks:
  - id: unknown-checker
- repo: local
  hooks:
  - id: no-print
    name: No print calls
    entry: python tools/pre_commit/check_no_print.py
    language: python
    types: [python]
  - id: commit-msg-only
    name: Runs on commit messages, not files
    entry: "false"
    language: system
    stages: [commit-msg]
"""
NO_PRINT = """\
import sys

found = [
    f"{name}:{number}: print() call"
    for name in sys.argv[1:]
    for number, line in enumerate(open(name), 1)
    if "print(" in line
]
# Coloured, as vLLM's hooks print their findings.
print("\\n".join(f"\\x1b[91merror:\\x1b[0m {line}" for line in found))
sys.exit(1 if found else 0)
"""


# The hooks' virtualenv for PRECOMMIT_CONFIG, kept between runs like the
# wheel (a virtualenv costs seconds; the first run, or a changed config,
# makes it anew).
HOOKS_CACHE = REPO_ROOT / "build" / "cache" / "precommit-tooling-tests"


def test_the_targets_own_precommit_fails_a_pr_with_the_hooks_message(
    project, monkeypatch
):
    real_precommit = pr_check._precommit
    monkeypatch.setattr(
        pr_check, "_precommit", lambda _, *args: real_precommit(HOOKS_CACHE, *args)
    )
    write_files(
        project.upstream,
        {
            ".pre-commit-config.yaml": PRECOMMIT_CONFIG,
            "tools/pre_commit/check_no_print.py": NO_PRINT,
        },
    )
    sh(project.upstream, "git", "add", "-A")
    sh(project.upstream, "git", "commit", "-q", "-m", "hooks")
    sh(project.upstream, "git", "tag", "-f", "v1")
    sh(project.scratch, "git", "pull", "-q", "--tags", "--force")
    project.add_stage(
        "0001",
        {
            "vllm/ops.py": (
                "    return 20\n",
                "    import os\n    print(20)\n    return 20\n",
            )
        },
        title="[ROCm] Louder op",
    )
    apply(project.series())
    prs = export_stages(project.series(), EXPORTER)
    with pytest.raises(
        SeriesError,
        match=r"pre-commit `no-print`: error: vllm/ops.py:\d+: print\(\) call",
    ) as failed:
        check_prs(project.series(), prs, sys.executable)
    assert "\x1b" not in str(failed.value), "the hook's colour codes are dropped"
    review = prs[0].review.read_text()
    assert "| pre-commit `no-print` | FAILED |" in review
    assert re.search(r"\| pre-commit `ruff-check` \| FAILED \|.*F401", review)
    assert re.search(
        r"\| pre-commit `unknown-checker` \| FAILED \| https://github.com/"
        r"example/checker unknown-checker is not run here; it applies to "
        r"vllm/ops.py",
        review,
    )
    assert "| `git am` | ok |" in review
    assert "commit-msg-only" not in review  # not a hook of a commit's files


def test_the_description_says_what_upstream_already_has(two_stages: Project):
    """A merged change is exported as a backport (not to open upstream), an
    open one names its upstream PR, and a dependency says where it stands."""
    text = two_stages.series_file.read_text()
    text = text.replace(
        'tests = "stage_0001"\n',
        'tests = "stage_0001"\nupstream = { pr = "org/vllm#7", status = "open" }\n',
    ).replace(
        'tests = "stage_0002"\n',
        'tests = "stage_0002"\nupstream = { pr = "org/vllm#9", status = "merged" }\n',
    )
    two_stages.series_file.write_text(text)
    apply(two_stages.series())
    first, second = export_stages(two_stages.series(), EXPORTER)
    one, two = first.description.read_text(), second.description.read_text()
    assert "Upstream PR org/vllm#7 is open for the same feature" in one
    assert "backport" not in one
    assert "This is a backport: upstream merged this change as org/vllm#9" in two
    assert "not to be opened upstream" in two
    assert 'Depends on "Striped indexer" (upstream as org/vllm#7)' in two


def test_a_download_cache_that_is_no_folder_is_a_clear_error(tmp_path, monkeypatch):
    """vLLM's pre-commit lives in the download cache: one that cannot be
    made says which and what to set, with no traceback."""
    from scripts.series.export.pr_check import precommit_cache
    from scripts.series.export.vllm_precommit import hook_python
    from scripts.series.stages.fetch import CACHE_ENV

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file"))
    with pytest.raises(SeriesError, match=f"set {CACHE_ENV} to a writable folder"):
        hook_python(precommit_cache(), sys.executable)


def test_a_half_made_hook_virtualenv_is_made_again(tmp_path, monkeypatch):
    """The hooks' virtualenv counts as made only once pre-commit is in it:
    one whose install failed, or that a kill left without its mark, is
    made again from scratch (``--clear``); a whole one is kept."""
    from scripts.series.export import vllm_precommit

    made: list[list[str]] = []
    failing = [True]

    def run(command: list[str], what: str) -> str:
        made.append(command)
        if what == "make a virtualenv":
            Path(command[-1], "bin").mkdir(parents=True, exist_ok=True)
        if what == "install pre-commit" and failing[0]:
            raise SeriesError("vLLM's pre-commit: cannot install pre-commit: offline")
        return ""

    monkeypatch.setattr(vllm_precommit, "run_in_project", run)
    cache = tmp_path / "precommit"
    with pytest.raises(SeriesError, match="cannot install pre-commit"):
        vllm_precommit.hook_python(cache, sys.executable)
    failing[0] = False
    for _ in range(2):
        made.clear()
        vllm_precommit.hook_python(cache, sys.executable)
        assert [c[1:3] for c in made] == [["-m", "venv"], ["-m", "pip"]]
        assert "--clear" in made[0]
        (venv,) = cache.glob("venv-*")
        (venv / "ready").unlink()  # as a kill before the mark leaves it
    (venv / "ready").touch()
    made.clear()
    assert vllm_precommit.hook_python(cache, sys.executable) == venv / "bin/python"
    assert made == []


def test_each_pr_check_writes_its_hook_config_beside_its_own_tree(
    tmp_path, monkeypatch
):
    """PR checks run side by side with one shared cache: each writes the
    rewritten pre-commit config beside its own tree, never in the cache."""
    from scripts.series.export import vllm_precommit

    configs: list[str] = []

    def run(command: list[str], what: str) -> str:
        if what == "rewrite the config":
            configs.append(command[-1])
        return ""

    monkeypatch.setattr(vllm_precommit, "run_in_project", run)
    monkeypatch.setattr(vllm_precommit, "hook_python", lambda cache, py: Path(py))
    monkeypatch.setattr(
        vllm_precommit.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""),
    )
    monkeypatch.setattr(vllm_precommit, "checked_results", lambda *a: [])
    cache = tmp_path / "cache"
    trees = [tmp_path / "checks" / stage / "vllm" for stage in ("0001", "0003")]
    for tree in trees:
        vllm_precommit.hook_results(cache, tree, ["a.py"], sys.executable)
    assert len(set(configs)) == 2
    for tree, config in zip(trees, configs, strict=True):
        assert Path(config).parent == tree.parent
