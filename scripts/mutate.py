# SPDX-License-Identifier: Apache-2.0
"""Mutation-test one module with cosmic-ray, and print its score.

``python3 -m scripts.mutate MODULE [--since REV | --lines A-B ...] -- PYTEST...``
(``nox -s mutate`` installs cosmic-ray and the test dependencies first).
MODULE is a file of the project; one under ``vllm_overlay/`` is mutated in
the top stage's test tree, where its tests run with the stage tree's
environment, as the test runner runs them. ``--since REV`` mutates only the
lines changed since REV, ``--lines`` only the ranges given.

cosmic-ray writes each mutant into the file it mutates, so the mutants run
in a scratch copy (build/mutate/work/): a git worktree of the project (or
of the test tree) holding its uncommitted edits and untracked files, with
the project's ``build/`` linked. The checkout is never written, whatever
happens meanwhile (a commit, an editor's save, a kill); the next run
clears what a killed one left. The session is kept in build/mutate/
(``cr-report`` reads it again).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from scripts.series.config import REPO_ROOT

OVERLAY = "vllm_overlay/"


def _series(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "scripts.series", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def _where(module: str) -> tuple[Path, Path, dict[str, str]]:
    """The checkout the module lives in, the module's path in it, and the
    environment its tests run with."""
    if not module.startswith(OVERLAY):
        return REPO_ROOT, Path(module), dict(os.environ)
    top = _series("stages").split()[-1]
    tree = Path(_series("tree", top).strip())
    env = dict(os.environ)
    for line in _series("env", top).splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    return tree, Path(module.removeprefix(OVERLAY)), env


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout


def _drop_scratch(checkout: Path, scratch: Path) -> None:
    """Remove a scratch copy, and the worktree entry a killed run left."""
    if scratch.is_symlink() or scratch.is_file():
        scratch.unlink()
    elif scratch.exists():
        shutil.rmtree(scratch)
    _git(checkout, "worktree", "prune")


def _scratch_copy(checkout: Path, scratch: Path) -> None:
    """A worktree of ``checkout`` at what it holds now: its commit, its
    uncommitted edits (``git stash create`` records them without touching
    the checkout) and its untracked files; the project's build/ linked."""
    _drop_scratch(checkout, scratch)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    snapshot = _git(checkout, "stash", "create").strip() or "HEAD"
    _git(checkout, "worktree", "add", "--detach", str(scratch), snapshot)
    untracked = _git(checkout, "ls-files", "-z", "--others", "--exclude-standard")
    for name in filter(None, untracked.split("\0")):
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(checkout / name, scratch / name, follow_symlinks=False)
    if checkout == REPO_ROOT:
        (scratch / "build").symlink_to(REPO_ROOT / "build", target_is_directory=True)


def _changed_lines(module: str, since: str) -> list[str]:
    """The line ranges of ``module`` (a project file) changed since ``since``."""
    diff = subprocess.run(
        ["git", "diff", "-U0", since, "--", module],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    ranges = []
    for start, count in re.findall(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.M):
        length = 1 if count == "" else int(count)
        if length:
            ranges.append(f"{start}-{int(start) + length - 1}")
    return ranges


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m scripts.mutate", usage="%(prog)s MODULE [options] -- PYTEST"
    )
    parser.add_argument("module")
    parser.add_argument("--since", help="only the lines changed since this commit")
    parser.add_argument("--lines", nargs="+", default=[], help="only these A-B ranges")
    split = argv.index("--") if "--" in argv else len(argv)
    args, tests = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not tests:
        parser.error("give the pytest arguments that should kill its mutants after --")
    checkout, relative, env = _where(args.module)
    if not (checkout / relative).is_file():
        parser.error(f"{args.module} is no file of the project")
    lines = args.lines + (_changed_lines(args.module, args.since) if args.since else [])
    out = REPO_ROOT / "build" / "mutate"
    out.mkdir(parents=True, exist_ok=True)
    name = args.module.replace("/", "_")
    scratch = out / "work" / name
    _scratch_copy(checkout, scratch)
    target = scratch / relative
    if checkout != REPO_ROOT:
        env["DSA_VLLM_TREE"] = str(scratch)
    config, session = out / f"{name}.toml", out / f"{name}.sqlite"
    command = shlex.join([sys.executable, "-m", "pytest", "-x", "-q", *tests])
    toml = [
        "[cosmic-ray]",
        f"module-path = {json.dumps(str(target))}",
        "timeout = 600.0",
        "excluded-modules = []",
        f"test-command = {json.dumps(command)}",
        "[cosmic-ray.distributor]",
        'name = "local"',
    ]
    if args.since or args.lines:
        toml += [
            "[cosmic-ray.filters.line-filter]",
            f"lines = {{ {json.dumps(str(target))} = {json.dumps(lines)} }}",
        ]
    config.write_text("\n".join(toml) + "\n")
    session.unlink(missing_ok=True)
    bin_dir = Path(sys.executable).parent
    steps = [["cosmic-ray", "init", str(config), str(session)]]
    if args.since or args.lines:
        steps.append(["cr-filter-lines", "--config", str(config), str(session)])
    steps += [
        ["cosmic-ray", "exec", str(config), str(session)],
        ["cr-report", "--surviving-only", "--show-diff", str(session)],
    ]
    print(
        f"mutating {args.module} ({', '.join(lines) or 'every line'}) in the "
        f"scratch copy {scratch}; tests: {command}"
    )
    try:
        for step in steps:
            subprocess.run(
                [str(bin_dir / step[0]), *step[1:]], cwd=scratch, env=env, check=True
            )
    finally:
        _drop_scratch(checkout, scratch)
    # cosmic-ray 8's session: one result per mutant run (the line filter's
    # skipped ones have none); cr-rate would count those as not surviving.
    with sqlite3.connect(session) as db:
        outcomes = dict(
            db.execute(
                "SELECT test_outcome, COUNT(*) FROM work_results "
                "WHERE test_outcome IS NOT NULL GROUP BY test_outcome"
            ).fetchall()
        )
    killed, survived = outcomes.get("KILLED", 0), outcomes.get("SURVIVED", 0)
    score = 100 * killed / max(killed + survived, 1)
    print(
        f"mutation score of {args.module}: {score:.1f}% ({killed} of "
        f"{killed + survived} mutants killed; {survived} survived, listed above; "
        f"session: {session})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
