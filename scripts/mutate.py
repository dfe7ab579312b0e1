# SPDX-License-Identifier: Apache-2.0
"""Mutation-test one module with mutmut, and print its score.

``python3 -m scripts.mutate MODULE [--since REV | --lines A-B ... |
--sample N] -- PYTEST...`` (``nox -s mutate`` installs mutmut and the test
dependencies first). MODULE is a file of the project, or a folder of it
outside ``vllm_overlay/`` (every module in it); a file under
``vllm_overlay/`` is mutated in the top stage's test tree, where its tests
run with the stage tree's environment, as the test runner runs them.
mutmut mutates the code of functions and methods: ``--since REV`` takes the
functions holding a line changed since REV, ``--lines`` those holding the
ranges given, ``--sample N`` N of the mutants drawn at random (``--seed``),
for a score with its 95% interval where running every mutant would take
hours (a folder of modules whose tests drive git).

mutmut imports the tests once and runs each mutant in a fork of that
process, with only the tests that reach its function: a mutant costs its
tests' time, not an import of vLLM. It writes its mutants in mutants/ of
the folder it runs in, and that folder is a scratch copy
(build/mutate/work/): a git worktree of the project (or of the test tree)
holding its uncommitted edits and untracked files, with the project's
``build/`` linked. The checkout is never written, whatever happens
meanwhile (a commit, an editor's save, a kill); the next run clears what a
killed one left. Each mutant's outcome and each survivor's diff are kept in
build/mutate/MODULE.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.mutmut_forks import HITS_ENV
from scripts.series.config import REPO_ROOT

OVERLAY = "vllm_overlay/"
# scripts/mutmut_forks.py, copied beside the mutants under this name.
FORKS_PLUGIN = "dsa_mutmut_forks"
# mutmut's outcomes that count as a kill: a test failed, the tests ran out
# of time (a mutant that loops), or the interpreter died.
KILLED = ("killed", "timeout", "segfault", "caught by type check")
# Outcomes that count as surviving: no test failed, or none reached it.
SURVIVED = ("survived", "no tests", "suspicious")


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


def _line_range(text: str) -> str:
    if not re.fullmatch(r"[1-9][0-9]*-[1-9][0-9]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is no A-B line range")
    return text


def _functions(source: str, ranges: list[str]) -> list[str]:
    """mutmut's names of the module's functions and methods (``x_NAME``,
    ``xǁCLASSǁNAME``) that hold a line of ``ranges`` (``A-B``)."""
    spans = [tuple(int(n) for n in r.split("-", 1)) for r in ranges]

    def touched(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        last = node.end_lineno or node.lineno
        return any(a <= last and first <= b for a, b in spans)

    names = []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.parse(source).body:
        if isinstance(node, kinds) and touched(node):
            names.append(f"x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, kinds) and touched(item):
                    names.append(f"x\u01c1{node.name}\u01c1{item.name}")
    return names


def _config(scratch: Path, relative: Path, tests: list[str], extra: list[str]) -> None:
    """mutmut's settings, in the scratch copy's setup.cfg (read when its
    pyproject.toml has none): the module's top package, copied to mutants/,
    the module (or every module of the folder) as what it mutates, the
    tests, what they read, and the plugin that counts what forked ranks
    reach (``mutmut_forks``)."""
    only = relative.as_posix() + ("/*" if relative.suffix != ".py" else "")

    def listed(values: list[str]) -> str:
        return "".join(f"\n    {value}" for value in values)

    section = [
        "[mutmut]",
        f"source_paths = {relative.parts[0]}",
        f"only_mutate = {only}",
        f"pytest_add_cli_args_test_selection ={listed(tests)}",
        f"pytest_add_cli_args ={listed(['-p', FORKS_PLUGIN])}",
    ]
    if extra:  # an empty also_copy would read as "." (the whole folder)
        section.append(f"also_copy ={listed(extra)}")
    with (scratch / "setup.cfg").open("a") as config:
        config.write("\n" + "\n".join(section) + "\n")


def _sample_size(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no count of mutants")
    return int(text)


def _interval(killed: int, count: int) -> tuple[float, float]:
    """The Wilson 95% interval of a score of ``killed`` in ``count``."""
    z = 1.96
    share = killed / count
    centre = share + z * z / (2 * count)
    half = z * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count))
    scale = 1 + z * z / count
    return max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)


def _outcomes(mutmut: list[str], scratch: Path, env: dict, dotted: str) -> dict:
    """Every mutant of ``dotted`` mutmut has made, with its outcome."""
    listing = subprocess.run(
        [*mutmut, "results", "--all", "1"],
        cwd=scratch, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return dict(
        line.strip().rsplit(": ", 1)
        for line in listing.splitlines()
        if line.strip().startswith(f"{dotted}.")
    )


def _draw(
    mutmut: list[str], scratch: Path, env: dict, dotted: str, args
) -> tuple[list[str], int]:
    """``args.sample`` of the mutants, drawn with ``args.seed``, and how
    many there are. mutmut makes its mutants (and its map of tests to
    functions) at the start of a run: one asked to run a mutant that does
    not exist stops there."""
    subprocess.run(
        [*mutmut, "run", f"{dotted}.x_no_such_function__mutmut_0"],
        cwd=scratch, env=env, capture_output=True,
    )  # fmt: skip
    names = sorted(_outcomes(mutmut, scratch, env, dotted))
    if not names:
        raise SystemExit(f"mutmut made no mutants of {args.module}")
    count = min(args.sample, len(names))
    print(f"{count} of {len(names)} mutants, seed {args.seed}")
    return random.Random(args.seed).sample(names, count), len(names)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m scripts.mutate", usage="%(prog)s MODULE [options] -- PYTEST"
    )
    parser.add_argument("module")
    parser.add_argument("--since", help="only the functions changed since this commit")
    parser.add_argument(
        "--lines", nargs="+", default=[], type=_line_range, help="only these A-B ranges"
    )
    parser.add_argument(
        "--sample", type=_sample_size, help="only N mutants drawn at random"
    )
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed")
    split = argv.index("--") if "--" in argv else len(argv)
    args, tests = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not tests:
        parser.error("give the pytest arguments that should kill its mutants after --")
    checkout, relative, env = _where(args.module.rstrip("/"))
    folder = checkout == REPO_ROOT and (checkout / relative).is_dir()
    if not folder and (not (checkout / relative).is_file() or relative.suffix != ".py"):
        parser.error(f"{args.module} is no Python file or folder of the project")
    if folder and (args.since or args.lines):
        parser.error("--since and --lines take one module, not a folder")
    if args.sample and (args.since or args.lines):
        parser.error("--sample draws from every mutant: no --since or --lines")
    lines = args.lines + (_changed_lines(args.module, args.since) if args.since else [])
    dotted = ".".join(relative.with_suffix("").parts)
    chosen = None
    if args.since or args.lines:
        chosen = _functions((checkout / relative).read_text(), lines)
        if not chosen:
            print(
                f"no function of {args.module} holds {', '.join(lines) or 'a change'}"
            )
            return 0
    out = REPO_ROOT / "build" / "mutate"
    out.mkdir(parents=True, exist_ok=True)
    name = args.module.rstrip("/").replace("/", "_")
    scratch = out / "work" / name
    _scratch_copy(checkout, scratch)
    # What the tests read besides the package and tests/: every top-level
    # entry of the project; of a test tree, the package's metadata (vLLM
    # reads its own version, and without it takes another platform).
    skip = {relative.parts[0], "build", ".git", "mutants", "tests"}
    extra = sorted(
        p.name
        for p in scratch.iterdir()
        if p.name not in skip
        and (checkout == REPO_ROOT or p.name.endswith(".egg-info"))
    )
    _config(scratch, relative, tests, extra)
    (scratch / "mutants").mkdir()
    # The plugin, and a sitecustomize that loads it in the Python processes
    # a test starts while mutmut maps tests to functions (on PYTHONPATH, so
    # pytest finds the plugin there too).
    hooks = scratch / "hooks"
    hooks.mkdir()
    plugin = Path(__file__).with_name("mutmut_forks.py")
    shutil.copy2(plugin, hooks / f"{FORKS_PLUGIN}.py")
    (hooks / "sitecustomize.py").write_text(
        'import os\n\nif os.environ.get("MUTANT_UNDER_TEST") == "stats":\n'
        f"    import {FORKS_PLUGIN}\n\n    {FORKS_PLUGIN}.in_subprocess()\n"
    )
    paths = [str(hooks), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    (scratch / "hits").mkdir()
    env[HITS_ENV] = str(scratch / "hits")
    if checkout == REPO_ROOT:
        (scratch / "mutants" / "build").symlink_to(REPO_ROOT / "build")
        # The tool finds the project by its git top level: mutants/ is one.
        _git(scratch, "init", "-q", "mutants")
    else:
        env["DSA_VLLM_TREE"] = str(scratch / "mutants")
    globs = [f"{dotted}.{function}__mutmut_*" for function in chosen or []]
    print(
        f"mutating {args.module} ({', '.join(chosen or ['every function'])}) in "
        f"the scratch copy {scratch}; tests: {shlex.join(tests)}",
        flush=True,
    )
    mutmut = [sys.executable, "-m", "mutmut"]
    drawn: list[str] = []
    made = 0
    try:
        if args.sample:
            drawn, made = _draw(mutmut, scratch, env, dotted, args)
            globs = drawn
        subprocess.run(
            [*mutmut, "run", "--max-children", str(os.cpu_count() or 1), *globs],
            cwd=scratch, env=env, check=True,
        )  # fmt: skip
        outcomes = _outcomes(mutmut, scratch, env, dotted)
        if chosen:
            wanted = tuple(f"{dotted}.{function}__mutmut_" for function in chosen)
            outcomes = {k: v for k, v in outcomes.items() if k.startswith(wanted)}
        if drawn:
            outcomes = {k: v for k, v in outcomes.items() if k in drawn}
        survivors = {k: v for k, v in outcomes.items() if v in SURVIVED}
        diffs = {
            mutant: subprocess.run(
                [*mutmut, "show", mutant],
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout  # fmt: skip
            for mutant in survivors
        }
    finally:
        _drop_scratch(checkout, scratch)
    for diff in diffs.values():
        print(f"\n{diff}")
    record = out / f"{name}.json"
    summary: dict = {"outcomes": outcomes, "survivors": diffs}
    if drawn:
        summary["sample"] = {"seed": args.seed, "drawn": len(drawn), "of": made}
    record.write_text(json.dumps(summary, indent=1) + "\n")
    killed = sum(outcome in KILLED for outcome in outcomes.values())
    counted = killed + len(survivors)
    which = f"sampled mutants of {made}" if drawn else "mutants"
    interval = ""
    if drawn and counted:
        low, high = _interval(killed, counted)
        interval = f"; 95% interval {100 * low:.1f}-{100 * high:.1f}%"
    print(
        f"mutation score of {args.module}: {100 * killed / max(counted, 1):.1f}% "
        f"({killed} of {counted} {which} killed{interval}; {len(survivors)} "
        f"survived, listed above; every outcome in {record})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
