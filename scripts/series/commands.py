# SPDX-License-Identifier: Apache-2.0
"""The series tool's commands: each one's arguments and what it runs, in
one table (``COMMANDS``) that the command line is built from and
dispatches by."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import SdistBase, Series
from scripts.series.contract import tree_env
from scripts.series.export.export import export_stages, exporter_identity
from scripts.series.export.pr_check import check_prs
from scripts.series.files import write_whole
from scripts.series.install.install import install, stage_files
from scripts.series.layout import INSTALL_RECORD_DIR, results_dir, workdir
from scripts.series.pin_sites import pin_mismatches
from scripts.series.rebase import commands as rebase_commands
from scripts.series.rebase import roll
from scripts.series.stages.apply import apply
from scripts.series.stages.check import (
    HUNK_BUDGET,
    format_hunk_sizes,
    hunk_budget,
    later_stage_edits,
    pin_problems,
    stale_files,
)
from scripts.series.stages.fetch import fetch_sdist
from scripts.series.stages.overview import (
    BEGIN,
    END,
    readme_table_is_current,
    stage_table,
    with_stage_table,
)
from scripts.series.stages.prepare import prepare
from scripts.series.stages.refresh import refresh
from scripts.series.stages.state import read_chain
from scripts.series.stages.status import format_status, tree_status
from scripts.series.stages.trees import stage_tree
from scripts.series.testing.results import (
    format_summary,
    format_timings,
    format_verdict,
)
from scripts.series.testing.testrun import compile_summary, run_tests

Run = Callable[[Series, argparse.Namespace, list[str]], int | None]
Arguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """One command: its name, its one-line help, what it runs (exit status;
    None for 0), how it adds its arguments, and whether it takes the
    project lock (``writes``): commands that only read never wait, and
    ``install`` writes only into the installed vLLM, which it locks itself."""

    name: str
    help: str
    run: Run
    arguments: Arguments = lambda parser: None
    writes: bool = True
    description: str | None = None
    # The stage ids among its arguments, checked against the series first.
    stage_ids: Callable[[argparse.Namespace], list[str]] = lambda args: []


OFFLINE = "use only the cached sdist; fail if it is not cached"


def _offline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offline", action="store_true", help=OFFLINE)


def _stage_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stage", help="'base' or a stage id")


# -- the stage commits --------------------------------------------------------


def _fetch(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    if not isinstance(series.base, SdistBase):
        raise SeriesError("the base is a git checkout; nothing to fetch")
    print(fetch_sdist(series.base, offline=args.offline))


def _prepare(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    print(prepare(series, offline=args.offline))


def _apply_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upto", help="stop after this stage ('base' for none)")
    _offline(parser)
    carry = parser.add_mutually_exclusive_group()
    carry.add_argument(
        "--carry",
        action="store_true",
        help="carry a stage whose patch no longer applies with a three-way "
        "merge, stopping on its conflicts",
    )
    carry.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="commit the carried stage once its conflicts are resolved; go on",
    )
    carry.add_argument(
        "--abort", action="store_true", help="drop the carried stage's merge"
    )


def _apply(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    repo = apply(
        series,
        args.upto,
        offline=args.offline,
        carry=args.carry,
        resume=args.resume,
        abort=args.abort,
    )
    print(f"work tree: {repo}")


def _refresh_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--into-top",
        action="store_true",
        help="take uncommitted edits to lines a lower stage adds into the top stage",
    )


def _refresh(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    written = refresh(series, into_top=args.into_top)
    if written and read_chain(series, workdir(series)).current < len(series.stages):
        # A lower stage changed: the stages above it follow, applied on it
        # and written again (a patch names the blobs it applies to).
        apply(series, quiet=True)
        written += [s for s in refresh(series) if s not in written]
    print("refreshed: " + (", ".join(s.id for s in written) or "no change"))


def _check(series: Series, args: argparse.Namespace, extra: list[str]) -> int:
    stale = stale_files(series)
    if stale:
        print("stale (differ from a fresh export; run `nox -s refresh`):")
        print("\n".join(f"  {path}" for path in stale))
        return 1
    print("patch files match a fresh export of the stage commits")
    sizes, problems = hunk_budget(series)
    print(f"hunks in vLLM's files (budget {HUNK_BUDGET} changed lines):")
    print(format_hunk_sizes(sizes))
    readme = series.root / "README.md"
    if readme.exists() and not readme_table_is_current(series, readme):
        problems.append(
            "README.md's stage table differs from series.toml; write it "
            "with `python3 -m scripts.series overview --write`"
        )
    problems += [
        f"{mismatch}; a rebase's branch writes these (scripts/series/pin_sites.py)"
        for mismatch in pin_mismatches(series.root, series.base)
    ]
    problems += later_stage_edits(series)
    problems += pin_problems(series)
    if problems:
        print("\n".join(f"error: {problem}" for problem in problems))
        return 1
    return 0


def _status(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    print(format_status(series, tree_status(series)))


def _stages(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    print(" ".join(["base", *(s.id for s in series.stages)]))


def _overview_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--write",
        action="store_true",
        help="write it into README.md, between the table's markers",
    )


def _overview(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    if not args.write:
        print(stage_table(series))
        return
    readme = series.root / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    written = with_stage_table(text, series)
    if written is None:
        raise SeriesError(
            f"{readme} has no stage table to write: put the lines {BEGIN} and "
            f"{END} where it goes"
        )
    if written == text:
        print(f"{readme}'s stage table is current")
        return
    write_whole(readme, written.encode("utf-8"), readme.stat().st_mode & 0o777)
    print(f"wrote the stage table into {readme}")


def _tree(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    print(stage_tree(series, args.stage))


# -- export and install -------------------------------------------------------


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stage", nargs="?", help="only this stage (and what it needs)")
    parser.add_argument(
        "--signoff",
        metavar="'NAME <EMAIL>'",
        help="who signs the PRs off (DCO); default: your git user.name/user.email",
    )
    parser.add_argument(
        "--test-python",
        metavar="PYTHON",
        help="then check each PR as a maintainer would: git am on the base "
        "(after the PRs it needs), and the tests it adds, with plain pytest in "
        "this Python on a CPU and as AMD CI's MI300/MI355 machines run them "
        "(ROCm emulated, AITER on and off)",
    )


def _export_stage_ids(args: argparse.Namespace) -> list[str]:
    if args.stage == "base":
        raise SeriesError("the base is not a stage: name a stage to export")
    return [args.stage] if args.stage else []


def _export(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    exporter = exporter_identity(series.root, args.signoff)
    prs = export_stages(series, exporter, args.stage)
    for pr in prs:
        where = f"needs {pr.needs} first" if pr.needs else "applies on the base alone"
        print(f"{pr.stage.id}: {pr.branch} {pr.commit[:12]} ({where})")
        print(f"  {pr.patch}\n  {pr.description}")
    if args.test_python:
        check_prs(series, prs, args.test_python)
        print(
            f"each PR applies with `git am` on {series.base.label}, passes "
            "its pre-commit and first-pass checks, and its tests pass or "
            "skip with a reason there, on a CPU and as MI300/MI355 with "
            "AITER on and off (each PR's items: <patch>.review.md)"
        )


def _install_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--into",
        type=Path,
        required=True,
        metavar="SITE",
        help="the folder that holds vllm/ (a site-packages, or a source "
        "checkout installed in develop mode)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--upto", help="install the stages up to this one (default: all; 'base': none)"
    )
    which.add_argument(
        "--undo", action="store_true", help="restore SITE as vLLM shipped it"
    )
    which.add_argument(
        "--stages",
        type=lambda text: [part for part in text.split(",") if part],
        metavar="ID,ID",
        help="install only these stages (0001,0004: stage 0001 and the fix, "
        "without 0003), where each applies without those left out",
    )


def _install(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    want = None if args.undo else stage_files(series, args.upto, args.stages)
    outcome = install(args.into, want)
    print(outcome.note)
    if want is not None and (
        left := [s for s in series.stages if s.id not in want.commits]
    ):
        how = f"--stages {want.stage}" if args.stages else f"after --upto {want.stage}"
        print(
            f"not installed ({how}): " + ", ".join(f"{s.id} ({s.title})" for s in left)
        )
    if want is not None and want.outside and outcome.changed:
        print("not written (outside the installed package): " + ", ".join(want.outside))


# -- tests ----------------------------------------------------------------------


def _env_args(parser: argparse.ArgumentParser) -> None:
    _stage_arg(parser)
    parser.add_argument(
        "--tree",
        type=Path,
        help="a copy of the stage's tree elsewhere (a GPU machine); default: "
        "its test tree, built if needed",
    )
    parser.add_argument(
        "--gpu", action="store_true", help="leave out the CPU platform's variables"
    )


def _env(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    stages = ["base", *(s.id for s in series.stages_upto(args.stage))]
    tree, base_tree = args.tree, None
    if tree is None:
        tree, base_tree = stage_tree(series, args.stage), stage_tree(series, "base")
    variables = tree_env(tree.resolve(), stages, base_tree, cpu=not args.gpu)
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in variables.items()))


def _test_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stages", nargs="*", help="'base' and/or stage ids")
    parser.add_argument("--tooling", action="store_true", help="also test the tool")


def _test(series: Series, args: argparse.Namespace, extra: list[str]) -> int:
    if importlib.util.find_spec("pytest") is None:
        raise SeriesError(
            f"pytest is not installed for {sys.executable}; run the tests "
            "through nox (nox -s apply-and-test, or tests(STAGE)), which "
            "installs tests/requirements-cpu.txt"
        )
    stage_ids = args.stages or ["base", *(s.id for s in series.stages)]
    results = run_tests(series, stage_ids, tooling=args.tooling, extra=extra)
    rows = results.rows
    compiled = [(stage_id, compile_summary(series, stage_id)) for stage_id in stage_ids]
    summary = format_summary(rows, compiled)
    out = results_dir(series) / "summary.md"
    out.write_text(f"{summary}\n")
    timings = format_timings(rows, results.wall_s)
    (results_dir(series) / "timings.md").write_text(f"{timings}\n")
    print("\n" + format_verdict(series.base.label, rows, compiled, out))
    return 1 if any(tally.failed for _, tally in rows) else 0


# -- the table ----------------------------------------------------------------

COMMANDS = (
    Command("fetch", "download and verify the pinned sdist", _fetch, _offline),
    Command("prepare", "make the work repo with the base commit", _prepare, _offline),
    Command(
        "apply",
        "apply the stages, one commit each",
        _apply,
        _apply_args,
        stage_ids=lambda args: [args.upto] if args.upto else [],
    ),
    Command(
        "refresh",
        "write patches/ and vllm_overlay/ from the tree",
        _refresh,
        _refresh_args,
    ),
    Command(
        "check",
        "fail if patch files differ from a fresh export, a hunk is over "
        "the glue budget, a stage changes an earlier one's lines, the README's "
        "stage table or a file naming the pin is out of date, or main pins "
        "a git commit",
        _check,
        writes=False,
    ),
    Command(
        "status",
        "which stages are applied; edits beyond them",
        _status,
        writes=False,
    ),
    Command(
        "export",
        "each stage as one upstream PR commit",
        _export,
        _export_args,
        stage_ids=_export_stage_ids,
    ),
    Command(
        "stages", "print 'base' and the stage ids, in order", _stages, writes=False
    ),
    Command(
        "overview",
        "print the README's stage table (--write: into README.md)",
        _overview,
        _overview_args,
    ),
    Command(
        "tree",
        "print the path of a stage's test tree",
        _tree,
        _stage_arg,
        stage_ids=lambda args: [args.stage],
    ),
    Command(
        "install",
        "write the stages' changes into an installed vLLM of the pinned "
        "release (no rebuild), or --undo them",
        _install,
        _install_args,
        writes=False,
        description="Checks first that SITE holds the pinned vLLM and that each "
        "file it changes is the release's own; records what it wrote in "
        f"SITE/{INSTALL_RECORD_DIR}/; all or nothing. Files of the tree outside "
        "the package (tests/, .buildkite/) are not written.",
        stage_ids=lambda args: [args.upto] if args.upto else (args.stages or []),
    ),
    Command(
        "env",
        "print the environment a stage's tests run with (shell exports)",
        _env,
        _env_args,
        stage_ids=lambda args: [args.stage],
    ),
    Command(
        "test",
        "test stages' trees (default: all) with this Python; -- ARGS go to pytest",
        _test,
        _test_args,
        stage_ids=lambda args: list(args.stages),
    ),
    Command(
        "roll",
        "rebase onto the newest vLLM release, if newer than the pin",
        lambda series, args, extra: roll.roll(series, test_python=args.test_python),
        rebase_commands.roll_arguments,
        description="Asks the package index for the newest vLLM release; if it "
        "is newer than the pin, rebases the series onto it (a project branch, "
        "rebase/vllm-VERSION) and prints what needs a person. Exit status 1 when "
        "the rebase stopped on a conflict or a failed check.",
    ),
    Command(
        "rebase",
        "rebase the stages onto a newer vLLM (sdist or git checkout)",
        rebase_commands.run,
        rebase_commands.arguments,
        description="Targets: --version V --sha256 H (a release's PyPI sdist) or "
        "--git PATH --rev REV (a local checkout). Then --continue after "
        "resolving conflicts, or --abort to drop it. The rebased series is a "
        "commit on a new project branch, rebase/<target>: merge a release's "
        "branch to adopt its pin; a git checkout's branch is for testing "
        "against vLLM main, never merged.",
        stage_ids=rebase_commands.stage_ids,
    ),
)
BY_NAME = {command.name: command for command in COMMANDS}
