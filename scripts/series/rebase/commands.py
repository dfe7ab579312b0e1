# SPDX-License-Identifier: Apache-2.0
"""The ``rebase`` and ``roll`` commands' arguments, and what ``rebase`` runs
for each of its forms (start, --continue, --abort)."""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import Base, GitBase, SdistBase, Series, is_version
from scripts.series.rebase import rebase, roll
from scripts.series.rebase.state import rebase_command


def roll_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--test-python",
        help="a Python with the test dependencies, to check each stage on the "
        "release (the nox session passes its own)",
    )


def arguments(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group()
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
    parser.add_argument("--version", help="target vLLM release (its PyPI sdist)")
    parser.add_argument(
        "--sha256",
        help="the target sdist's sha256 (--version alone prints the one the "
        "package index lists)",
    )
    parser.add_argument("--git", type=Path, help="target: a local vLLM git checkout")
    parser.add_argument("--rev", help="the revision of --git")
    parser.add_argument(
        "--test-python",
        help="a Python with the test dependencies; with it a stage whose "
        "upstream probe passes on the target without it counts as upstreamed "
        "(kept by --continue)",
    )
    parser.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="STAGE",
        help="leave this stage out (upstream has it in another form); with "
        "--continue, also the stage in conflict",
    )


def stage_ids(args: argparse.Namespace) -> list[str]:
    """The stages ``--drop`` names; a new rebase must also name a target."""
    if not (args.resume or args.abort):
        _target_form(args)
    return [d for d in args.drop if d != "base"]


def run(series: Series, args: argparse.Namespace, extra: list[str]) -> None:
    options = {"test_python": args.test_python, "drop": args.drop}
    if args.abort:
        rebase.abort(series)
    elif args.resume:
        rebase.resume(series, **options)
    elif _target_form(args) == "version":
        print(_release_hash(series, args.version))
    else:
        rebase.start(series, _target(series, args), **options)


def _target(series: Series, args: argparse.Namespace) -> Base:
    name = series.base.name
    if _target_form(args) == "git":
        return GitBase(name, args.git.resolve(), args.rev)
    return SdistBase(name, args.version, args.sha256.lower())


def _release_hash(series: Series, version: str) -> str:
    """What ``--version V`` alone answers: the sdist's sha256 as the
    package index lists it, and the command that rebases onto it."""
    name = series.base.name
    sha256 = roll.sdist_sha256(name, version)
    return (
        f"the package index lists sha256 {sha256} for {name} {version}'s "
        "sdist; check it against the release page, then run\n  "
        + rebase_command(f"--version {version} --sha256 {sha256}")
    )


def _target_form(args: argparse.Namespace) -> str:
    """Which target a new rebase names: "git", "sdist", or "version" (a
    release without its hash: the command prints the index's hash)."""
    release, checkout = args.version or args.sha256, args.git or args.rev
    if release and checkout:
        raise SeriesError(
            "give one target, a release (--version V --sha256 H) or a git "
            "checkout (--git PATH --rev REV), not both"
        )
    if checkout:
        if not (args.git and args.rev):
            missing = (
                "--rev REV (a branch, tag or commit)" if args.git else "--git PATH"
            )
            raise SeriesError(f"--git and --rev go together; add {missing}")
        return "git"
    if args.sha256 and not args.version:
        raise SeriesError("--sha256 is the hash of --version's sdist; add --version V")
    if args.version:
        if not is_version(args.version):
            raise SeriesError(
                f"--version takes a release number (X.Y.Z), got {args.version!r}"
            )
        return "sdist" if args.sha256 else "version"
    raise SeriesError("give a target: --version V --sha256 H, or --git PATH --rev REV")
