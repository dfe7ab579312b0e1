# SPDX-License-Identifier: Apache-2.0
"""The MI355X validation kit's command line: python3 -m scripts.validate."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.install.install import check_site
from scripts.validate.matrix import (
    SEEDS,
    Experiment,
    MatrixError,
    load_experiment,
    shell_line,
)
from scripts.validate.report import write_report
from scripts.validate.runner import install_command, run_experiment


def dry_run(stage: str, config: Path, out: Path, site: Path | None = None) -> str:
    """Every command the run would make, in order, one per line."""
    experiment = load_experiment(stage, config)
    where = site or "SITE"
    lines = []
    for variant in experiment.variants:
        folder = out / variant.name
        lines.append(f"# {variant.name}")
        if variant.install:
            command = install_command(where, variant.install)
            lines.append(shell_line(["python3", *command[1:]]))
        serve = experiment.serve_command(variant)
        lines.append(shell_line(serve, experiment.serve_env(variant)) + " &")
        lines += [
            shell_line(experiment.bench_command(p, folder)) for p in experiment.points
        ]
        lines += [shell_line(e) for e in experiment.eval_commands(folder)]
    if any(v.install for v in experiment.variants):
        lines.append(
            "# then SITE is put back as the run found it (install --upto/--undo)"
        )
    return "\n".join(lines)


def default_site() -> Path | None:
    """The folder that holds the vllm package this Python imports."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parents[1]


def _report(experiment: Experiment, out: Path) -> Path:
    command = "python3 -m scripts.validate " + " ".join(sys.argv[1:])
    variants = [v.name for v in experiment.variants]
    return write_report(experiment.stage, out, variants, command)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m scripts.validate",
        description="Reproduce a stage's PR experiments on an MI355X machine: "
        "per variant, install its code into the machine's vLLM, serve the "
        "model, run the benchmark sweep and the accuracy tasks, check every "
        "result and write a report. The machine's vLLM is put back as it was.",
    )
    parser.add_argument(
        "--stage",
        required=True,
        help="the experiment: 0001, 0001-serving or 0003 (the tables of the "
        "matrix file)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=SEEDS,
        help="the matrix file (default: scripts/validate/seeds.toml, the PR "
        "texts' models, flags, input lengths and concurrencies)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where the results go (default: build/validate/<stage>-<time>)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the commands only"
    )
    parser.add_argument(
        "--report", type=Path, metavar="OUT", help="redraw the report of a run"
    )
    parser.add_argument(
        "--site",
        type=Path,
        help="the machine's vLLM, the folder that holds vllm/, where each "
        "variant's code is installed (default: the vllm this Python imports)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (args.out or Path("build") / "validate" / f"{args.stage}-{stamp}").resolve()
    try:
        site = args.site or default_site()
        if args.dry_run:
            print(dry_run(args.stage, args.config, out, site))
            return 0
        experiment = load_experiment(args.stage, args.config)
        if args.report:
            print(_report(experiment, args.report.resolve()))
            return 0
        if any(v.install for v in experiment.variants):
            if site is None:
                raise MatrixError(
                    "the variants name the code they serve, and this Python has "
                    "no vllm to install it into; give --site"
                )
            site = check_site(site)
        out.mkdir(parents=True, exist_ok=True)
        outcomes = run_experiment(experiment, out, site)
        print(_report(experiment, out))
    except (MatrixError, SeriesError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # An output folder that cannot be written, a --report folder with
        # no summary.json: say which.
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"interrupted; the server is stopped, results so far in {out}",
            file=sys.stderr,
        )
        return 130
    failed = [o for o in outcomes if o.problems]
    for o in failed:
        print(f"{o.variant} {o.run}: " + "; ".join(o.problems))
    passed = len(outcomes) - len(failed)
    print(f"{passed} of {len(outcomes)} runs pass their checks; {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
