# SPDX-License-Identifier: Apache-2.0
"""The noxfile run by nox itself, in a copy of the project, on a host the
way Debian and Ubuntu ship it: ``python3`` and no ``python`` on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sh
from test_roll import Releases

from scripts.series.config import REPO_ROOT
from scripts.series.stages.fetch import CACHE_ENV, INDEX_ENV


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """The project's noxfile, tool and series in a fresh git checkout."""
    copy = tmp_path / "project"
    shutil.copytree(
        REPO_ROOT / "scripts",
        copy / "scripts",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for folder in ("patches", "vllm_overlay"):
        shutil.copytree(REPO_ROOT / folder, copy / folder)
    for name in ("noxfile.py", "README.md"):
        shutil.copy(REPO_ROOT / name, copy / name)
    sh(copy, "git", "init", "-q")
    sh(copy, "git", "add", "-A")
    sh(copy, "git", "commit", "-q", "-m", "project")
    return copy


def _python3_only_path(tmp_path: Path) -> str:
    """A PATH with git and a ``python3``, and no ``python`` (nor uv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    git = shutil.which("git")
    assert git
    (bin_dir / "git").symlink_to(git)
    assert shutil.which("python", path=str(bin_dir)) is None
    return str(bin_dir)


def _nox(project: Path, tmp_path: Path, *args: str, **env: str):
    return subprocess.run(
        [sys.executable, "-m", "nox", "--envdir", str(tmp_path / "envs"), *args],
        cwd=project,
        env={
            **os.environ,
            "PATH": _python3_only_path(tmp_path),
            CACHE_ENV: str(tmp_path / "cache"),
            **env,
        },
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_session_without_a_venv_runs_on_a_host_without_python(
    project_copy: Path, tmp_path: Path
):
    done = _nox(project_copy, tmp_path, "-s", "status")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Program python not found" not in out
    assert "not prepared (run `nox -s apply`)" in out


def test_rebase_with_a_version_alone_answers_and_sets_nothing_up(
    project_copy: Path, tmp_path: Path
):
    """It prints the hash the index lists and the command, exits 0, and
    nox makes no virtualenv for it."""
    index = Releases({"0.35.0": b"an sdist"})
    try:
        done = _nox(
            project_copy,
            tmp_path,
            "-s",
            "rebase",
            "--",
            "--version",
            "0.35.0",
            **{INDEX_ENV: index.url},
        )
    finally:
        index.server.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    sha = index.sha("0.35.0")
    assert f"--version 0.35.0 --sha256 {sha}`" in done.stdout
    assert not (tmp_path / "envs" / "rebase").exists()
