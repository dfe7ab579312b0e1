# SPDX-License-Identifier: Apache-2.0
"""Command line of the series tool: python -m scripts.series COMMAND."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import sys
from pathlib import Path

from scripts.series import SeriesError, rebase, review, roll
from scripts.series.apply import apply
from scripts.series.check import (
    HUNK_BUDGET,
    format_hunk_sizes,
    hunk_budget,
    stale_files,
)
from scripts.series.config import (
    SERIES_FILE,
    Base,
    GitBase,
    SdistBase,
    Series,
    load_series,
)
from scripts.series.contract import tree_env
from scripts.series.export import export_stages, exporter_identity
from scripts.series.fetch import fetch_sdist
from scripts.series.git import is_repo
from scripts.series.install import install, stage_files
from scripts.series.layout import (
    INSTALL_RECORD_DIR,
    NEXT_DIR,
    results_dir,
    review_dir,
    workdir,
)
from scripts.series.lock import project_lock
from scripts.series.overview import (
    readme_table_is_current,
    stage_table,
    wide_stage_table,
)
from scripts.series.pr_check import check_prs
from scripts.series.prepare import prepare
from scripts.series.rebase_state import rebase_command
from scripts.series.refresh import (
    recover_interrupted_refresh,
    refresh,
    refresh_is_pending,
)
from scripts.series.status import format_status, tree_status
from scripts.series.testrun import (
    compile_summary,
    format_summary,
    format_timings,
    run_tests,
)
from scripts.series.trees import copy_tree, stage_tree

# Commands that only read; every other one holds the project lock.
READ_ONLY = ("check", "status", "stages", "overview")
# `install` writes only into the installed vLLM (it locks that itself) and
# reads the stage commits, so a run of the validation kit can install while
# another command holds the project (the tests, for one).
LOCK_FREE = (*READ_ONLY, "install")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.series",
        description="The DSA indexer patch series for vLLM: fetch the pinned "
        "vLLM, apply the stages, test them, write them back to patches/, "
        "export them as upstream PRs, install them into a vLLM, or rebase them "
        "onto a newer vLLM. Run it from the project's root; each command has "
        "its own --help.",
    )
    parser.add_argument(
        "--series",
        type=Path,
        default=SERIES_FILE,
        help="series file (default: patches/series.toml)",
    )
    parser.add_argument(
        "--check-args",
        action="store_true",
        help="only check the command's arguments, stage ids included, and "
        "print them as JSON; run nothing (the nox sessions do this first)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    offline = "use only the cached sdist; fail if it is not cached"
    fetch = sub.add_parser("fetch", help="download and verify the pinned sdist")
    fetch.add_argument("--offline", action="store_true", help=offline)
    prep = sub.add_parser("prepare", help="make the work repo with the base commit")
    prep.add_argument("--offline", action="store_true", help=offline)
    app = sub.add_parser("apply", help="apply the stages, one commit each")
    app.add_argument("--upto", help="stop after this stage ('base' for none)")
    app.add_argument("--offline", action="store_true", help=offline)
    carry = app.add_mutually_exclusive_group()
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
    refresh_cmd = sub.add_parser(
        "refresh", help="write patches/ and vllm_overlay/ from the tree"
    )
    refresh_cmd.add_argument(
        "--into-top",
        action="store_true",
        help="take uncommitted edits to lines a lower stage adds into the top stage",
    )
    sub.add_parser(
        "check",
        help="fail if patch files differ from a fresh export, a hunk is over "
        "the glue budget, or the README's stage table is out of date",
    )
    sub.add_parser("status", help="which stages are applied; edits beyond them")
    pr = sub.add_parser("export", help="each stage as one upstream PR commit")
    pr.add_argument("stage", nargs="?", help="only this stage (and what it needs)")
    pr.add_argument(
        "--signoff",
        metavar="'NAME <EMAIL>'",
        help="who signs the PRs off (DCO); default: your git user.name/user.email",
    )
    pr.add_argument(
        "--test-python",
        metavar="PYTHON",
        help="then check each PR as a maintainer would: git am on the base "
        "(after the PRs it needs), and the tests it adds, with plain pytest in "
        "this Python on a CPU and as AMD CI's MI300/MI355 machines run them "
        "(ROCm emulated, AITER on and off)",
    )
    sub.add_parser("stages", help="print 'base' and the stage ids, in order")
    view = sub.add_parser("overview", help="print the README's stage table")
    view.add_argument(
        "--wide",
        action="store_true",
        help="every column: the files each stage hooks into, its overlay "
        "modules and tests, and where it was validated",
    )
    tree = sub.add_parser("tree", help="print the path of a stage's test tree")
    tree.add_argument("stage", help="'base' or a stage id")
    copy = sub.add_parser(
        "copy-tree",
        help="copy a stage's tree (no .git) to build and install vLLM from",
    )
    copy.add_argument("stage", help="'base' or a stage id (all up to it)")
    copy.add_argument("dest", type=Path, help="a new or empty folder")
    inst = sub.add_parser(
        "install",
        help="write the stages' changes into an installed vLLM of the pinned "
        "release (no rebuild), or --undo them",
        description="Checks first that SITE holds the pinned vLLM and that each "
        "file it changes is the release's own; records what it wrote in "
        f"SITE/{INSTALL_RECORD_DIR}/; all or nothing. Files of the tree outside "
        "the package (tests/, .buildkite/) are not written.",
    )
    inst.add_argument(
        "--into",
        type=Path,
        required=True,
        metavar="SITE",
        help="the folder that holds vllm/ (a site-packages, or a source "
        "checkout installed in develop mode)",
    )
    which = inst.add_mutually_exclusive_group()
    which.add_argument(
        "--upto", help="install the stages up to this one (default: all; 'base': none)"
    )
    which.add_argument(
        "--undo", action="store_true", help="restore SITE as vLLM shipped it"
    )
    env = sub.add_parser(
        "env", help="print the environment a stage's tests run with (shell exports)"
    )
    env.add_argument("stage", help="'base' or a stage id")
    env.add_argument(
        "--tree",
        type=Path,
        help="a copy of the stage's tree elsewhere (a GPU machine); default: "
        "its test tree, built if needed",
    )
    env.add_argument(
        "--gpu", action="store_true", help="leave out the CPU platform's variables"
    )
    test = sub.add_parser(
        "test",
        help="test stages' trees (default: all) with this Python; -- ARGS go to pytest",
    )
    test.add_argument("stages", nargs="*", help="'base' and/or stage ids")
    test.add_argument("--tooling", action="store_true", help="also test the tool")
    test.add_argument(
        "--jobs",
        type=_positive_int,
        default=0,
        help="pytest runs at once (default: one per CPU)",
    )
    rolled = sub.add_parser(
        "roll",
        help="rebase onto the newest vLLM release, if newer than the pin",
        description="Asks the package index for the newest vLLM release; if it "
        "is newer than the pin, rebases the series onto it for review "
        "(patches/next/) and prints what needs a person. Exit status 1 when "
        "the rebase stopped on a conflict or a failed check.",
    )
    rolled.add_argument(
        "--test-python",
        help="a Python with the test dependencies, to check each stage on the "
        "release (the nox session passes its own)",
    )
    reb = sub.add_parser(
        "rebase",
        help="rebase the stages onto a newer vLLM (sdist or git checkout)",
        description="Targets: --version V --sha256 H (a release's PyPI sdist) or "
        "--git PATH --rev REV (a local checkout). Then --continue after "
        "resolving conflicts, --abort to drop it, --accept to adopt the "
        "reviewed series, --refresh to rebase each review again after a "
        "stage change.",
    )
    action = reb.add_mutually_exclusive_group()
    action.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="go on with a stopped rebase once its conflicts are resolved (or "
        "its failed check fixed) in the work repo",
    )
    action.add_argument(
        "--abort",
        action="store_true",
        help="drop a stopped rebase; the conflicts resolved so far are kept "
        "for the next one",
    )
    action.add_argument(
        "--refresh",
        action="store_true",
        help="rebase again onto each target under patches/next/ whose review "
        "is older than patches/ (after a stage change; recorded resolutions "
        "replay)",
    )
    action.add_argument(
        "--accept",
        nargs="?",
        const="",
        metavar="TARGET",
        help="adopt the rebased series under patches/next/ (TARGET: which one)",
    )
    reb.add_argument("--version", help="target vLLM release (its PyPI sdist)")
    reb.add_argument(
        "--sha256",
        help="the target sdist's sha256 (--version alone prints the one the "
        "package index lists)",
    )
    reb.add_argument("--git", type=Path, help="target: a local vLLM git checkout")
    reb.add_argument("--rev", help="the revision of --git")
    reb.add_argument(
        "--test-python",
        help="a Python with the test dependencies; with it a stage whose "
        "upstream probe passes on the target without it counts as upstreamed "
        "(kept by --continue)",
    )
    reb.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="STAGE",
        help="leave this stage out (upstream has it in another form); with "
        "--continue, also the stage in conflict",
    )
    return parser


def _rebase(series: Series, args: argparse.Namespace) -> int:
    options = {"test_python": args.test_python, "drop": args.drop}
    if args.abort:
        rebase.abort(series)
    elif args.accept is not None:
        review.accept(series, args.accept or None)
    elif args.resume:
        rebase.resume(series, **options)
    elif args.refresh:
        _refresh_reviews(series, options)
    else:
        name = series.base.name
        target: Base
        form = _rebase_target_form(args)
        if form == "git":
            target = GitBase(name, args.git.resolve(), args.rev)
        elif form == "sdist":
            target = SdistBase(name, args.version, args.sha256.lower())
        else:
            sha256 = roll.sdist_sha256(name, args.version)
            raise SeriesError(
                f"--version needs the sdist's --sha256 as well; the package "
                f"index lists {sha256} for {name} {args.version}. Check it "
                "against the release page, then run "
                + rebase_command(f"--version {args.version} --sha256 {sha256}")
            )
        rebase.start(series, target, **options)
    return 0


def _rebase_target_form(args: argparse.Namespace) -> str:
    """Which target a new rebase names: "git", "sdist", or "version" (a
    release without its hash: the command prints the index's hash)."""
    if args.git and args.rev and not (args.version or args.sha256):
        return "git"
    if args.version and args.sha256 and not (args.git or args.rev):
        return "sdist"
    if args.version and not (args.sha256 or args.git or args.rev):
        return "version"
    raise SeriesError("give a target: --version V --sha256 H, or --git PATH --rev REV")


def _check_arguments(series: Series, args: argparse.Namespace) -> None:
    """What a command would refuse at once, found without running it: stage
    ids the series does not know, a rebase without a target."""
    named = []
    if args.command in ("apply", "install") and args.upto:
        named.append(args.upto)
    if args.command in ("tree", "env", "copy-tree"):
        named.append(args.stage)
    if args.command == "test":
        named += args.stages
    if args.command == "export" and args.stage:
        if args.stage == "base":
            raise SeriesError("the base is not a stage: name a stage to export")
        named.append(args.stage)
    if args.command == "rebase":
        named += [d for d in args.drop if d != "base"]
        if not (args.resume or args.abort or args.refresh) and args.accept is None:
            _rebase_target_form(args)
    for stage_id in named:
        if stage_id != "base":
            series.stage(stage_id)


def _refresh_reviews(series: Series, options: dict) -> None:
    """Each review under patches/next/ made from an older patches/, rebased
    again onto its own target; one that stops on a conflict stops here."""
    folders = sorted(
        p.parent for p in (series.patches_dir / NEXT_DIR).glob("*/series.toml")
    )
    if not folders:
        print("no rebased series under review (patches/next/)")
    for folder in folders:
        if review.review_is_current(series, folder):
            print(f"{folder.name}: up to date with patches/")
            continue
        target = review.load_review(folder).base
        print(f"{folder.name}: rebasing again onto {target.label}")
        rebase.start(series, target, **options)
        # A git target is recorded by its commit: keep the review's own name.
        written = review_dir(series, target)
        if written != folder:
            shutil.rmtree(folder)
            written.rename(folder)


def _test(series: Series, args: argparse.Namespace, extra: list[str]) -> int:
    if importlib.util.find_spec("pytest") is None:
        raise SeriesError(
            f"pytest is not installed for {sys.executable}; run the tests "
            "through nox (nox -s apply-and-test, or tests(STAGE)), which "
            "installs tests/requirements-cpu.txt"
        )
    stage_ids = args.stages or ["base", *(s.id for s in series.stages)]
    for stage_id in stage_ids:
        if stage_id != "base":
            series.stage(stage_id)
    results = run_tests(
        series,
        stage_ids,
        tooling=args.tooling,
        jobs=args.jobs,
        extra=extra,
    )
    rows = results.rows
    compiled = [(stage_id, compile_summary(series, stage_id)) for stage_id in stage_ids]
    summary = format_summary(rows, compiled)
    out = results_dir(series) / "summary.md"
    out.write_text(f"{summary}\n")
    timings = format_timings(rows, results.wall_s)
    (results_dir(series) / "timings.md").write_text(f"{timings}\n")
    print(
        f"\n{series.base.label}\n\n{summary}\n\nwritten to {out} (per-run times: "
        "timings.md beside it)"
    )
    return 1 if any(tally.failed for _, tally in rows) else 0


def _env(series: Series, stage_id: str, tree: Path | None, *, gpu: bool) -> str:
    stages = ["base", *(s.id for s in series.stages_upto(stage_id))]
    base_tree = None
    if tree is None:
        tree, base_tree = stage_tree(series, stage_id), stage_tree(series, "base")
    variables = tree_env(tree.resolve(), stages, base_tree, cpu=not gpu)
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in variables.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    if extra and args.command != "test":
        _parser().error(f"{args.command} takes no arguments after --")
    try:
        series = load_series(args.series)
        if args.check_args:
            _check_arguments(series, args)
            parsed = {k: v for k, v in vars(args).items() if k != "check_args"}
            print(json.dumps({**parsed, "pytest_args": extra}, default=str))
            return 0
        if args.command in LOCK_FREE:
            pending = []
            if review.AcceptJournal.pending(series.patches_dir):
                pending.append(
                    "an interrupted `rebase --accept` is pending; the next "
                    "writing command finishes it"
                )
            if is_repo(workdir(series)) and refresh_is_pending(workdir(series)):
                pending.append(
                    "an interrupted refresh is pending; the next writing "
                    "command undoes it (edits made since are kept, and it says "
                    "where)"
                )
            if pending and args.command == "install":
                raise SeriesError(
                    f"{pending[0]}: run `python -m scripts.series apply` first, "
                    "then install"
                )
            for note in pending:
                print(f"note: {note}", file=sys.stderr)
            return _run(series, args, extra)
        with project_lock(series, " ".join(argv)):
            if review.finish_interrupted_accept(series.patches_dir):
                series = load_series(args.series)
            return _run(series, args, extra)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # A full disk, a read-only folder, a path that is a file: say which.
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        again = (
            f"{rebase_command('--continue')} to resume, "
            f"{rebase_command('--abort')} to drop it"
            if args.command == "rebase"
            else "the same command again to resume"
        )
        print(f"interrupted; run {again}", file=sys.stderr)
        return 130


def _run(series: Series, args: argparse.Namespace, extra: list[str]) -> int:
    if args.command not in LOCK_FREE and is_repo(workdir(series)):
        recover_interrupted_refresh(workdir(series))
    if args.command in ("apply", "test"):
        review.check_review_is_current(series)
    if args.command == "fetch":
        if not isinstance(series.base, SdistBase):
            raise SeriesError("the base is a git checkout; nothing to fetch")
        print(fetch_sdist(series.base, offline=args.offline))
    elif args.command == "prepare":
        print(prepare(series, offline=args.offline))
    elif args.command == "apply":
        repo = apply(
            series,
            args.upto,
            offline=args.offline,
            carry=args.carry,
            resume=args.resume,
            abort=args.abort,
        )
        print(f"work tree: {repo}")
    elif args.command == "refresh":
        written = refresh(series, into_top=args.into_top)
        print("refreshed: " + (", ".join(s.id for s in written) or "no change"))
    elif args.command == "check":
        stale = stale_files(series)
        if stale:
            print("stale (differ from a fresh export; run refresh):")
            print("\n".join(f"  {path}" for path in stale))
            return 1
        print("patch files match a fresh export of the stage commits")
        sizes, problems = hunk_budget(series)
        print(f"hunks in vLLM's files (budget {HUNK_BUDGET} changed lines):")
        print(format_hunk_sizes(sizes))
        readme = series.root / "README.md"
        if readme.exists() and not readme_table_is_current(series, readme):
            problems.append(
                "README.md's stage table differs from series.toml; paste "
                "`python -m scripts.series overview` between its markers"
            )
        if problems:
            print("\n".join(f"error: {problem}" for problem in problems))
            return 1
    elif args.command == "status":
        print(format_status(series, tree_status(series)))
    elif args.command == "export":
        exporter = exporter_identity(series.root, args.signoff)
        prs = export_stages(series, exporter, args.stage)
        for pr in prs:
            where = (
                f"needs {pr.needs} first" if pr.needs else "applies on the base alone"
            )
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
    elif args.command == "overview":
        print(wide_stage_table(series) if args.wide else stage_table(series))
    elif args.command == "stages":
        print(" ".join(["base", *(s.id for s in series.stages)]))
    elif args.command == "tree":
        print(stage_tree(series, args.stage))
    elif args.command == "copy-tree":
        print(copy_tree(series, args.stage, args.dest.resolve()))
    elif args.command == "install":
        want = None if args.undo else stage_files(series, args.upto)
        outcome = install(args.into, want)
        print(outcome.note)
        if want is not None and want.outside and outcome.changed:
            print(
                "not written (outside the installed package): "
                + ", ".join(want.outside)
            )
    elif args.command == "env":
        print(_env(series, args.stage, args.tree, gpu=args.gpu))
    elif args.command == "test":
        return _test(series, args, extra)
    elif args.command == "rebase":
        return _rebase(series, args)
    elif args.command == "roll":
        return roll.roll(series, test_python=args.test_python)
    return 0
