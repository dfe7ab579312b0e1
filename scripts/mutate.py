# SPDX-License-Identifier: Apache-2.0
"""Mutation-test one module with cosmic-ray, and print its score.

``python -m scripts.mutate MODULE [--since REV | --lines A-B ...] -- PYTEST...``
(``nox -s mutate`` installs cosmic-ray and the test dependencies first).
MODULE is a file of the project; one under ``vllm_overlay/`` is mutated in
the top stage's test tree, where its tests run with the stage tree's
environment, as the test runner runs them. ``--since REV`` mutates only the
lines changed since REV, ``--lines`` only the ranges given. cosmic-ray
changes the file in place while a mutant's tests run and puts it back; a
module with uncommitted edits is refused, so that a run stopped part way is
undone with ``git checkout -- MODULE`` (in the test tree for an overlay).
The session is kept in build/mutate/ (``cr-report`` reads it again).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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
    """The folder the tests run in, the file to mutate, and their env."""
    if not module.startswith(OVERLAY):
        return REPO_ROOT, REPO_ROOT / module, dict(os.environ)
    top = _series("stages").split()[-1]
    tree = Path(_series("tree", top).strip())
    env = dict(os.environ)
    for line in _series("env", top).splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    return tree, tree / module.removeprefix(OVERLAY), env


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
        prog="python -m scripts.mutate", usage="%(prog)s MODULE [options] -- PYTEST"
    )
    parser.add_argument("module")
    parser.add_argument("--since", help="only the lines changed since this commit")
    parser.add_argument("--lines", nargs="+", default=[], help="only these A-B ranges")
    split = argv.index("--") if "--" in argv else len(argv)
    args, tests = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not tests:
        parser.error("give the pytest arguments that should kill its mutants after --")
    cwd, target, env = _where(args.module)
    edited = subprocess.run(["git", "diff", "--quiet", "--", target], cwd=cwd)
    if edited.returncode:
        sys.exit(f"error: {target} has uncommitted edits; commit or drop them first")
    lines = args.lines + (_changed_lines(args.module, args.since) if args.since else [])
    out = REPO_ROOT / "build" / "mutate"
    out.mkdir(parents=True, exist_ok=True)
    name = args.module.replace("/", "_")
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
    print(f"mutating {target} ({', '.join(lines) or 'every line'}); tests: {command}")
    print(f"if this run is stopped, `git -C {cwd} checkout -- {target}` undoes it")
    for step in steps:
        subprocess.run(
            [str(bin_dir / step[0]), *step[1:]], cwd=cwd, env=env, check=True
        )
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
