# SPDX-License-Identifier: Apache-2.0
"""Small synthetic series projects: a base, stages made by plain git, and the
tooling pointed at them; and a real install of the pinned vLLM (the one thing
here that downloads: its wheel, once, into build/cache/)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.series import cli
from scripts.series.config import REPO_ROOT, SERIES_FILE, Series, load_series
from scripts.series.git import git_env
from scripts.series.install.install import stage_files
from scripts.series.stages.fetch import index_url, listed_files

BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/envs.py": "".join(f"VAR_{i} = {i}\n" for i in range(40)),
    "vllm/ops.py": "".join(f"def op_{i}():\n    return {i}\n\n\n" for i in range(30)),
    "README.md": "synthetic vLLM\n",
    ".gitignore": "/vllm/_version.py\n",
    "vllm/_version.py": "__version__ = '0.0.1'\n",
}


def sh(cwd: Path, *args: str, date: str = "2026-01-02T03:04:05+00:00") -> str:
    env = git_env()
    env.update(
        GIT_AUTHOR_NAME="Ada Dev",
        GIT_AUTHOR_EMAIL="ada@example.com",
        GIT_COMMITTER_NAME="Ada Dev",
        GIT_COMMITTER_EMAIL="ada@example.com",
        GIT_AUTHOR_DATE=date,
        GIT_COMMITTER_DATE=date,
    )
    return subprocess.run(
        args, cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run_cli(
    argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m scripts.series ARGV`` run in this process (the same
    ``main``, with its output captured): a new interpreter per call costs
    more than most of the commands the tests run. Tests of what only a
    process shows (a missing git, an old Python, the lock) start one."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(argv))
            except SystemExit as exc:  # argparse: usage errors and --help
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


class Project:
    """A series repo (patches/, vllm_overlay/) over a local git base."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "series"
        self.upstream = tmp / "upstream"
        self.scratch = tmp / "scratch"
        self.stages: list[dict] = []
        write_files(self.upstream, BASE_FILES)
        sh(self.upstream, "git", "init", "-q", "-b", "main")
        sh(self.upstream, "git", "add", "-A", "-f")
        sh(self.upstream, "git", "commit", "-q", "-m", "upstream base")
        sh(self.upstream, "git", "tag", "v1")
        (self.root / "patches").mkdir(parents=True)
        (self.root / "vllm_overlay").mkdir()
        (self.root / "tests").mkdir()
        sh(self.tmp, "git", "clone", "-q", str(self.upstream), str(self.scratch))
        self.write_series()

    @property
    def series_file(self) -> Path:
        return self.root / "patches" / "series.toml"

    def write_series(self) -> None:
        text = f'[base]\nname = "vllm"\ngit = "{self.upstream}"\nrev = "v1"\n'
        for stage in self.stages:
            overlays = ", ".join(f'"{o}"' for o in stage["overlays"])
            depends = ", ".join(f'"{d}"' for d in stage.get("depends_on", []))
            text += textwrap.dedent(f"""
                [[stage]]
                id = "{stage["id"]}"
                title = "{stage["title"]}"
                patch = "{stage["patch"]}"
                overlays = [{overlays}]
                depends_on = [{depends}]
                tests = "stage_{stage["id"]}"
                """)
        self.series_file.write_text(text)

    def series(self) -> Series:
        return load_series(self.series_file)

    def commit_all(self) -> None:
        """Commit the project as it is (a git checkout from the first call):
        a rebase ends on a branch of it."""
        if not (self.root / ".git").exists():
            (self.root / ".gitignore").write_text("build/\n")
            sh(self.root, "git", "init", "-q")
        sh(self.root, "git", "add", "-A")
        sh(self.root, "git", "commit", "-q", "--allow-empty", "-m", "project")

    def add_stage(
        self,
        stage_id: str,
        edits: dict[str, tuple[str, str]],
        overlays: dict[str, str] | None = None,
        *,
        title: str | None = None,
        body: str = "Why this stage exists.",
        date: str = "2026-02-03T04:05:06+00:00",
        depends_on: tuple[str, ...] = (),
    ) -> Path:
        """Make a stage the way a developer would: edit, commit with a
        Signed-off-by, ``git format-patch`` (default flags) the glue."""
        overlays = overlays or {}
        for rel, (old, new) in edits.items():
            path = self.scratch / rel
            text = path.read_text()
            assert old in text, f"{old!r} not in {rel}"
            path.write_text(text.replace(old, new, 1))
        write_files(self.scratch, overlays)
        title = title or f"Stage {stage_id}"
        sh(self.scratch, "git", "add", "-A")
        sh(
            self.scratch,
            "git",
            "commit",
            "-q",
            "-s",
            "-m",
            title,
            "-m",
            body,
            date=date,
        )
        excludes = [f":(exclude){o}" for o in overlays]
        patch_text = sh(
            self.scratch,
            "git",
            "format-patch",
            "-1",
            "--stdout",
            "HEAD",
            "--",
            ".",
            *excludes,
        )
        name = f"{stage_id}-{title.lower().replace(' ', '-')}.patch"
        patch = self.root / "patches" / name
        patch.write_text(patch_text)
        write_files(self.root / "vllm_overlay", overlays)
        self.stages.append(
            dict(
                id=stage_id,
                title=title,
                patch=name,
                overlays=list(overlays),
                depends_on=list(depends_on),
            )
        )
        self.write_series()
        return patch


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)


@pytest.fixture
def two_stages(project: Project) -> Project:
    return add_two_stages(project)


def add_two_stages(project: Project) -> Project:
    """Stage 0001 (an env line and an overlay) and 0002 (flips that line and
    changes an op), as most tooling tests use them."""
    project.add_stage(
        "0001",
        {"vllm/envs.py": ("VAR_3 = 3\n", "VAR_3 = 3\nCP_INDEXER = False\n")},
        {"vllm/cp_indexer.py": "def split():\n    return 'striped'\n"},
        title="Striped indexer",
        body="Why this stage exists.\n\nHow it works.",
    )
    project.add_stage(
        "0002",
        {
            "vllm/envs.py": ("CP_INDEXER = False\n", "CP_INDEXER = True\n"),
            "vllm/ops.py": (
                "def op_20():\n    return 20\n",
                "def op_20():\n    return 2020\n",
            ),
        },
        title="Top-k gate",
        depends_on=("0001",),
    )
    return project


# The pinned vLLM as pip installs it from the package index (a CUDA build:
# the compiled parts do not matter, install changes only Python files).
# None on a rebase's branch pinned to a git checkout: install takes releases.
PINNED = getattr(load_series(SERIES_FILE).base, "version", None)
VLLM_WHEEL = f"vllm-{PINNED}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_CACHE = REPO_ROOT / "build" / "cache" / f"vllm-{PINNED}-wheel"
# What only a release pin has (an image, a wheel, a version to move from).
needs_release_pin = pytest.mark.skipif(
    PINNED is None,
    reason="the series is pinned to a git checkout (a rebase's branch); "
    "this takes a release pin",
)


def _unavailable(reason: str) -> None:
    """Offline, say so and skip; in CI (which has the package index) fail."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def wheel_site() -> Path:
    """The pinned vLLM's wheel installed with ``pip install --no-deps
    --target``, kept under build/cache/ (about 240 MB download for vLLM 0.34.0).
    Never written to: tests take ``installed_vllm``, a copy. Its sha256 is
    checked against the one the package index lists."""
    if PINNED is None:
        pytest.skip(needs_release_pin.kwargs["reason"])
    site = WHEEL_CACHE / "site"
    if (site / "vllm" / "__init__.py").is_file():
        return site
    wheel = WHEEL_CACHE / VLLM_WHEEL
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if not wheel.is_file():
        fetched = subprocess.run(
            [
                *pip,
                "download",
                f"vllm=={PINNED}",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_28_x86_64",
                "--python-version",
                "3.11",
                "-d",
                str(WHEEL_CACHE),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if fetched.returncode or not wheel.is_file():
            _unavailable(f"cannot download {VLLM_WHEEL}: {fetched.stderr[-500:]}")
    try:
        listed = listed_files(f"{index_url()}/vllm/")[VLLM_WHEEL][1]
    except (OSError, KeyError) as error:
        _unavailable(f"the package index does not list {VLLM_WHEEL}'s hash: {error}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != listed:
        wheel.unlink()
        pytest.fail(f"{VLLM_WHEEL} has sha256 {digest}, the index lists {listed}")
    partial = WHEEL_CACHE / "site.partial"
    shutil.rmtree(partial, ignore_errors=True)
    installed = subprocess.run(
        [
            *pip,
            "install",
            "--no-deps",
            "--no-compile",
            "--target",
            str(partial),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if installed.returncode:
        _unavailable(f"pip cannot install {VLLM_WHEEL} here: {installed.stderr[-500:]}")
    partial.rename(site)
    return site


@functools.cache
def package_files(site: Path) -> list[str]:
    """The files the stages change in the installed package, as git lists
    them between the base and the last stage of the real series."""
    series = load_series(SERIES_FILE)
    return sorted(stage_files(series, None).files)


@pytest.fixture
def installed_vllm(wheel_site: Path, tmp_path: Path) -> Path:
    """A private copy of the installed vLLM: hard links to the cache, except
    the files the series changes (copied, so edits in place stay here)."""
    site = tmp_path / "site"
    shutil.copytree(wheel_site, site, copy_function=os.link, symlinks=True)
    for rel in package_files(wheel_site):
        if (site / rel).exists():
            (site / rel).unlink()
            shutil.copy2(wheel_site / rel, site / rel)
    return site
