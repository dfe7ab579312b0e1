# SPDX-License-Identifier: Apache-2.0
"""The layering check of a maintainer's first pass: a module-level import of a
ROCm-only module that a PR adds to a platform-neutral file is reported; the
same import inside a function or under TYPE_CHECKING, one the base already
had, and one in a ROCm file are not; vllm/config/ may not gain vllm.v1."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.series import SeriesError
from scripts.series.export.maintainer_checks import layering
from tests.tooling.conftest import sh, write_files

BASE = {
    "vllm/v1/indexer.py": "import torch\nfrom vllm.v1.ops.rocm_old import a\n",
    "vllm/config/vllm.py": "import os\n",
    "vllm/v1/ops/rocm_new.py": "import os\n",
}


def _tree(tmp_path: Path, changed: dict[str, str]) -> tuple[Path, list[str]]:
    write_files(tmp_path, BASE)
    sh(tmp_path, "git", "init", "-q")
    sh(tmp_path, "git", "add", "-A")
    sh(tmp_path, "git", "commit", "-q", "-m", "base")
    write_files(tmp_path, changed)
    return tmp_path, sorted(changed)


def test_an_added_module_level_rocm_import_is_reported(tmp_path):
    tree, files = _tree(
        tmp_path,
        {
            "vllm/v1/indexer.py": BASE["vllm/v1/indexer.py"]
            + "from vllm.v1.ops.rocm_cp import plan\n"
            + "from vllm.v1.ops.sparse_utils import bounds\n",
            "vllm/config/vllm.py": "import os\nfrom vllm.v1.backends import x\n",
        },
    )
    results = {r["check"]: r for r in layering(tree, "HEAD", files)}
    indexer = results["imports of vllm/v1/indexer.py"]
    assert not indexer["ok"]
    assert indexer["detail"].endswith("vllm.v1.ops.rocm_cp.plan")
    assert "rocm_old" not in indexer["detail"]  # the base had it
    assert "sparse_utils" not in indexer["detail"]
    assert "vllm.v1.backends.x" in results["imports of vllm/config/vllm.py"]["detail"]


def test_lazy_imports_and_rocm_files_pass(tmp_path):
    tree, files = _tree(
        tmp_path,
        {
            "vllm/v1/indexer.py": BASE["vllm/v1/indexer.py"]
            + "from typing import TYPE_CHECKING\n"
            + "if TYPE_CHECKING:\n    from vllm.v1.ops.rocm_cp import Split\n"
            + "def build():\n    from vllm.v1.ops.rocm_cp import plan\n"
            + "    return plan\n",
            "vllm/v1/ops/rocm_new.py": "import aiter\n",
        },
    )
    assert [r["ok"] for r in layering(tree, "HEAD", files)] == [True]


def test_hook_tools_pinned_by_frozen_commits_take_the_tagged_version(tmp_path):
    """vLLM 0.34.0 pins its hook repositories by commit with a `# frozen:`
    tag comment (pre-commit autoupdate --freeze); the rewritten config takes
    the tool from the package index at that tag's version, keeps the
    target's own settings, and makes a hook whose tool is not on the index
    one that fails on its files. A bare commit is a clear error."""
    import pytest

    from scripts.series import SeriesError
    from scripts.series.export.vllm_precommit import rewritten_config

    config = (
        "exclude: 'vllm/third_party/.*'\n"
        "repos:\n"
        "- repo: https://github.com/astral-sh/ruff-pre-commit\n"
        f"  rev: {'f3' * 20}  # frozen: v0.17.2\n"
        "  hooks:\n  - id: ruff-check\n    args: [--fix]\n"
        "- repo: https://github.com/crate-ci/typos\n"
        "  rev: v1.43.5\n"
        "  hooks:\n  - id: typos\n"
        "- repo: https://github.com/rhysd/actionlint\n"
        "  rev: v1.7.12\n"
        "  hooks:\n  - id: actionlint\n    language_version: 1.2.3\n"
        "- repo: local\n"
        "  hooks:\n  - {id: own, entry: python own.py, language: python}\n"
    )
    (tmp_path / ".pre-commit-config.yaml").write_text(config)
    rewritten = rewritten_config(tmp_path)
    assert rewritten["exclude"] == "vllm/third_party/.*"
    [ruff], [typos], [actionlint], [own] = (r["hooks"] for r in rewritten["repos"])
    assert {r["repo"] for r in rewritten["repos"]} == {"local"}
    assert ruff["entry"] == "ruff check --force-exclude"
    assert ruff["name"] == "ruff-check"  # pre-commit requires a local hook's name
    assert ruff["additional_dependencies"] == ["ruff==0.17.2"]
    assert ruff["args"] == ["--fix"]
    assert typos["additional_dependencies"] == ["typos==1.43.5"]
    assert actionlint["language"] == "fail"
    assert actionlint["files"] == r"^\.github/workflows/"
    assert "language_version" not in actionlint
    assert own == {"id": "own", "entry": "python own.py", "language": "python"}
    (tmp_path / ".pre-commit-config.yaml").write_text(
        config.replace("  # frozen: v0.17.2", "")
    )
    with pytest.raises(SeriesError, match="no `# frozen: vX.Y.Z` comment"):
        rewritten_config(tmp_path)


def test_pre_commits_verbose_report_is_read_hook_by_hook():
    """pre-commit 4's `run --verbose` report: each hook's status, its id
    (the name may differ), and what it printed without pre-commit's own
    `- hook id` lines; nothing read is an error, not a pass."""
    from scripts.series.export.vllm_precommit import parse_run

    report = (
        "ruff check...............................................Failed\n"
        "- hook id: ruff-check\n- duration: 0.1s\n- exit code: 1\n\n"
        "vllm/ops.py:3:12: F401 `os` imported but unused\n\n"
        "typos.......................................(no files to check)Skipped\n"
        "- hook id: typos\n"
        "Format....................................................Failed\n"
        "- hook id: ruff-format\n- files were modified by this hook\n"
    )
    results = [(r.id, r.status, r.output) for r in parse_run(report)]
    assert results == [
        ("ruff-check", "failed", "vllm/ops.py:3:12: F401 `os` imported but unused"),
        ("typos", "skipped", ""),
        ("ruff-format", "failed", "files were modified by this hook"),
    ]
    assert parse_run("An error has occurred: InvalidConfigError\n") == []


# `pre-commit run --verbose --color never` (4.x) on three local hooks, the
# second of which interrupts pre-commit (kill -INT $PPID): exit 130.
_PASSED_THEN_STOPPED = (
    "first....................................................................Passed\n"
    "- hook id: first\n- duration: 0.01s\n"
    "second...................................................................Interrupted"
    " (^C): KeyboardInterrupt: \n"
    "Check the log at /root/.cache/pre-commit/pre-commit.log\n"
)
_FAILED_THEN_STOPPED = (
    "first....................................................................Failed\n"
    "- hook id: first\n- duration: 0s\n- exit code: 1\n\nfirst failed\n\n"
    "second...................................................................Interrupted"
    " (^C): KeyboardInterrupt: \n"
    "Check the log at /root/.cache/pre-commit/pre-commit.log\n"
)


@pytest.mark.parametrize(
    "returncode, stdout",
    [
        (130, _PASSED_THEN_STOPPED),
        (130, _FAILED_THEN_STOPPED),
        # A failed hook, then an error of pre-commit's own (exit 1 for both).
        (1, _FAILED_THEN_STOPPED.split("second")[0]
         + "An error has occurred: FatalError: git failed. Is it installed?\n"),
        (3, "An unexpected error has occurred: CalledProcessError: git diff\n"),
    ],
    ids=["passed, then Ctrl-C", "failed, then Ctrl-C", "failed, then an error",
         "an error before any hook"],
)  # fmt: skip
def test_a_pre_commit_that_stopped_part_way_is_no_review(returncode, stdout):
    """Hooks that ran before pre-commit stopped are not the review: the
    hooks after them never ran. The error says so, with pre-commit's line."""
    from scripts.series.export.vllm_precommit import checked_results

    with pytest.raises(SeriesError, match=r"did not run to its end \(exit "):
        checked_results(returncode, stdout, "")


def test_a_pre_commit_that_ran_to_its_end_is_the_review():
    from scripts.series.export.vllm_precommit import checked_results

    failed = _FAILED_THEN_STOPPED.split("second")[0]
    assert [r.status for r in checked_results(1, failed, "")] == ["failed"]
    passed = _PASSED_THEN_STOPPED.split("second")[0]
    assert [r.status for r in checked_results(0, passed, "")] == ["passed"]
