# SPDX-License-Identifier: Apache-2.0
"""The files that name the pin follow patches/series.toml: check-patches
names a mention that differs, and a rebase's branch moves them with the
pin. The last test moves the real project's pin in a scratch copy, as the
end of a rebase onto a newer release would, and runs the project's
pin-dependent checks on that branch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.series.config import (
    REPO_ROOT,
    SERIES_FILE,
    GitBase,
    SdistBase,
    load_series,
)
from scripts.series.layout import rebase_branch, stage_tag, workdir
from scripts.series.pin_sites import PIN_FILES, moved_pin_files, pin_mismatches
from scripts.series.rebase import branch
from scripts.series.rebase.state import RebaseState, target_dict, work_repo
from scripts.series.stages.apply import apply
from tests.tooling.conftest import needs_release_pin, sh

PIN = SdistBase("vllm", "0.9.0", "ab" * 32)


def test_the_projects_pin_files_name_its_pin():
    series = load_series(SERIES_FILE)
    assert pin_mismatches(REPO_ROOT, series.base) == []


def _pin_files(root: Path, version: str) -> None:
    (root / "docs").mkdir()
    (root / "README.md").write_text(
        f"On a pinned release (now vLLM {version}).\n"
        f"docker build -t dsa-vllm:{version}-0001 .\n"
        f"cd build/vllm-{version} && $EDITOR vllm/...\n"
        f"Results in `build/results/vllm-{version}/summary.md`.\n"
        "Python 3.11.4 or newer; AITER v0.1.28.post1.\n"
    )
    (root / "Dockerfile").write_text(f"FROM vllm/vllm-openai-rocm:v{version}\n")


def test_a_mention_of_another_release_is_named_with_file_and_line(tmp_path):
    _pin_files(tmp_path, "0.9.0")
    readme = tmp_path / "README.md"
    readme.write_text(
        readme.read_text().replace("build/vllm-0.9.0", "build/vllm-0.8.0")
    )
    (tmp_path / "docs" / "serving.md").write_text("Since vLLM 0.90.0, it ...\n")
    assert pin_mismatches(tmp_path, PIN) == [
        "README.md:3 names 'build/vllm-0.8.0', but the pin is vllm-0.9.0",
        "docs/serving.md:1 names 'vLLM 0.90.0', but the pin is 0.9.0",
    ]


def test_moving_rewrites_every_form_and_nothing_else(tmp_path):
    """0.9.0 to 0.100.0 (the old one a prefix of neither, string order the
    other way); the Python and AITER versions stay."""
    _pin_files(tmp_path, "0.9.0")
    moved = moved_pin_files(tmp_path, replace(PIN, version="0.100.0"))
    assert sorted(p.name for p in moved) == ["Dockerfile", "README.md"]
    for path, data in moved.items():
        path.write_bytes(data)
    expected = tmp_path / "expected"
    expected.mkdir()
    _pin_files(expected, "0.100.0")
    for name in ("README.md", "Dockerfile"):
        assert (tmp_path / name).read_text() == (expected / name).read_text()
    assert pin_mismatches(tmp_path, replace(PIN, version="0.100.0")) == []
    assert moved_pin_files(tmp_path, replace(PIN, version="0.100.0")) == {}


def test_a_git_pin_moves_the_paths_and_leaves_the_release(tmp_path):
    _pin_files(tmp_path, "0.9.0")
    git_pin = GitBase("vllm", tmp_path, "b1b2329645f5" + "0" * 28)
    moved = moved_pin_files(tmp_path, git_pin)
    text = moved[tmp_path / "README.md"].decode()
    assert "build/vllm-git-b1b2329645f5 &&" in text
    assert "build/results/vllm-git-b1b2329645f5/summary.md" in text
    assert "now vLLM 0.9.0" in text and "dsa-vllm:0.9.0-0001" in text
    assert tmp_path / "Dockerfile" not in moved


# Where the old pin may still be named after a move: the records of what
# happened (the CHANGELOG, the archive, rebase reports, recorded resolutions),
# and, outside the pin files, a citation of that release ("vLLM X.Y.Z",
# "vllm-project/vllm vX.Y.Z").
HISTORY = re.compile(
    r"^(CHANGELOG\.md|docs/(archive|rebase[\w.-]*)\.md|patches/resolutions/)"
)


def _citation(version: str) -> re.Pattern[str]:
    escaped = re.escape(version)
    return re.compile(rf"(vLLM |vllm-project/vllm v){escaped}(?![\d])")


@needs_release_pin
def test_a_pin_moved_in_a_scratch_copy_leaves_no_stale_mention(tmp_path):
    """The project as it is (uncommitted files included) copied and committed;
    a rebase onto a made-up vLLM 0.35.0 (the same stage commits) ended on its
    branch. Then, on that branch: no pin file names the old pin, every other
    mention is history or a citation, and the pin-dependent checks pass (the
    Dockerfile's, these, the README's stage table)."""
    copy = tmp_path / "project"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    sh(copy, "git", "init", "-q")
    sh(copy, "git", "add", "-A")
    sh(copy, "git", "commit", "-q", "-m", "the project")

    series = load_series(copy / "patches" / "series.toml")
    old = series.base
    assert isinstance(old, SdistBase)
    new_pin = SdistBase(old.name, "0.35.0", "cd" * 32)
    state = RebaseState(target_dict(new_pin), "", "", next=len(series.stages))
    # The stage commits as the rebase's work repo would hold them.
    tree = workdir(load_series(SERIES_FILE))
    if not (tree / ".git").is_dir():
        tree = apply(series, quiet=True)
    sh(
        tree.parent,
        "git",
        "clone",
        "-q",
        "--no-checkout",
        str(tree),
        str(work_repo(series, state)),
    )
    for stage in series.stages:
        state.commits[stage.id] = sh(
            tree, "git", "rev-parse", f"{stage_tag(stage.id)}^{{commit}}"
        ).strip()
    assert branch.finish(series, state) == rebase_branch(new_pin)
    sh(copy, "git", "switch", "-q", rebase_branch(new_pin))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    assert load_series(copy / "patches" / "series.toml").base == new_pin

    stale = []
    mentions = subprocess.run(
        ["git", "grep", "-n", "-I", "-F", old.version],
        cwd=copy,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in mentions.splitlines():
        path, _, text = line.split(":", 2)
        if HISTORY.match(path):
            continue
        cited = _citation(old.version).sub("", text)
        if path in PIN_FILES or old.version in cited:
            stale.append(line)
    assert stale == [], "\n".join(stale)

    checks = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/tooling/test_dockerfile.py",
            "tests/tooling/test_pin_sites.py::test_the_projects_pin_files_name_its_pin",
        ],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert checks.returncode == 0, checks.stdout[-3000:]
    from scripts.series.stages.overview import readme_table_is_current

    assert readme_table_is_current(
        load_series(copy / "patches" / "series.toml"), copy / "README.md"
    )


@pytest.mark.parametrize("name", PIN_FILES)
def test_each_pin_file_exists(name):
    """A pin file renamed or removed would drop out of the check silently."""
    assert (REPO_ROOT / name).is_file()
