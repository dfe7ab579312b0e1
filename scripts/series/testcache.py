# SPDX-License-Identifier: Apache-2.0
"""Reuse a pytest run's last green result while none of its inputs changed.

A pytest run of ``test`` reads: its command line and environment, the
Python it runs with and the packages installed for it, the project's files
(tests/, scripts/, the series files, the pytest configuration) and the vLLM
trees it is pointed at. The key below hashes all of them:

- the arguments, the working folder and the whole environment the process
  gets, except variables a shell or nox changes between identical runs
  (``VOLATILE_ENV``);
- the interpreter (its path, version and prefix) and every installed
  distribution with its version and its RECORD (the installed files'
  hashes, as pip and uv wrote them);
- every file of the project that git tracks or would track (untracked but
  not ignored), by content (outside a git repository: every file but
  build/, __pycache__ and dot-folders);
- each vLLM tree the run names (the stage's tree, the base tree, the folder
  it runs in) by its commit; a tree with any change or untracked file
  beyond its commit has no key, so such a run always runs;
- what the machine offers the tests: its architecture, whether an NVIDIA
  or AMD GPU device is present, and git's version.

Not covered, and so not to be relied on: files edited by hand inside the
virtual environment without reinstalling (RECORD keeps the hashes of the
install), and anything a test reads outside the project, the trees and the
environment (none does). ``--rerun`` runs everything regardless.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.git import git

# Set per shell or per nox invocation; no test reads them.
VOLATILE_ENV = frozenset(
    {"PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLUMNS", "LINES", "TMUX_PANE"}
)

_ENVIRONMENT = """
import hashlib, importlib.metadata as md, json, sys
dists = []
for d in md.distributions():
    record = d.read_text("RECORD") or ""
    dists.append((d.metadata["Name"] or "", d.version,
                  hashlib.sha256(record.encode()).hexdigest()))
print(json.dumps([sys.executable, sys.version, sys.prefix, sorted(dists)]))
"""


@cache
def python_environment(python: str) -> str:
    """The interpreter and its installed distributions, hashed."""
    done = subprocess.run(
        [python, "-c", _ENVIRONMENT], capture_output=True, text=True, check=False
    )
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise SeriesError(
            f"{python} cannot list its installed packages: "
            f"{lines[-1] if lines else done.returncode}"
        )
    return hashlib.sha256(done.stdout.encode()).hexdigest()


def _listed_files(root: Path) -> set[str]:
    """The files git tracks or would track under ``root``; outside a git
    repository, every file but build/, __pycache__ and dot-folders."""
    inside = git(root, "rev-parse", "--is-inside-work-tree", check=False)
    if inside.returncode == 0:
        listed = git(root, "ls-files", "-z", "-c", "-o", "--exclude-standard")
        return set(listed.stdout.decode().split("\0")) - {""}
    names = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d not in ("build", "__pycache__")
        ]
        names |= {str((Path(folder) / f).relative_to(root)) for f in files}
    return names


def project_files(root: Path) -> str:
    """Every file of the project git tracks or would track, by content."""
    digest = hashlib.sha256()
    for name in sorted(_listed_files(root)):
        path = root / name
        digest.update(name.encode() + b"\0")
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def tree_state(tree: Path) -> str | None:
    """A vLLM tree's commit, or None if it has anything beyond it."""
    status = git(tree, "status", "--porcelain", "--untracked-files=all")
    if status.stdout.strip():
        return None
    return git(tree, "rev-parse", "HEAD").stdout.decode().strip()


def machine() -> list:
    """What the machine offers the tests: the tooling tests run git."""
    git_version = subprocess.run(
        ["git", "--version"], capture_output=True, text=True, check=False
    ).stdout
    return [
        platform.machine(),
        any(Path("/dev").glob("nvidia[0-9]*")),
        Path("/dev/kfd").exists(),
        git_version,
    ]


@dataclass(frozen=True)
class CachedRun:
    """Where a run's key lives: next to its JUnit file."""

    junit: Path

    @property
    def key_file(self) -> Path:
        return self.junit.with_suffix(".key")

    def matches(self, key: str) -> str | None:
        """When the last green run with this key finished, if it did."""
        try:
            recorded = json.loads(self.key_file.read_text())
        except (OSError, ValueError):
            return None
        if recorded.get("key") != key or not self.junit.is_file():
            return None
        return str(recorded.get("finished", "?"))

    def record(self, key: str, finished: str) -> None:
        self.key_file.write_text(json.dumps({"key": key, "finished": finished}))

    def forget(self) -> None:
        self.key_file.unlink(missing_ok=True)


def run_key(
    *,
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    python: str,
    project: str,
    trees: Sequence[Path],
) -> str | None:
    """The key of one pytest run, or None when it must run (a tree with
    changes beyond its commit)."""
    states = []
    for tree in sorted(set(trees)):
        state = tree_state(tree) if (tree / ".git").exists() else "absent"
        if state is None:
            return None
        states.append([str(tree), state])
    material = {
        "args": list(args),
        "cwd": str(cwd),
        "env": {k: v for k, v in sorted(env.items()) if k not in VOLATILE_ENV},
        "python": python_environment(python),
        "project": project,
        "trees": states,
        "machine": machine(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def environment_of(run_env: Mapping[str, str]) -> dict[str, str]:
    """The environment a pytest run gets (as ``testrun`` starts it)."""
    return {**os.environ, **run_env}
