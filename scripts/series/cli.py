# SPDX-License-Identifier: Apache-2.0
"""Command line of the series tool: python3 -m scripts.series COMMAND. The
commands, their arguments and what each runs are the table in
``commands.py``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.commands import BY_NAME, COMMANDS
from scripts.series.config import SERIES_FILE, Series, load_series
from scripts.series.lock import project_lock
from scripts.series.rebase.state import rebase_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m scripts.series",
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
    for command in COMMANDS:
        command.arguments(
            sub.add_parser(
                command.name, help=command.help, description=command.description
            )
        )
    return parser


def _check_arguments(series: Series, args: argparse.Namespace) -> None:
    """What a command would refuse at once, found without running it: stage
    ids the series does not know, a rebase without a target."""
    for stage_id in BY_NAME[args.command].stage_ids(args):
        if stage_id != "base":
            series.stage(stage_id)


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
        if not BY_NAME[args.command].writes:
            return _run(series, args, extra)
        with project_lock(series, " ".join(argv)):
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
    command = BY_NAME[args.command]
    _check_arguments(series, args)
    return command.run(series, args, extra) or 0
