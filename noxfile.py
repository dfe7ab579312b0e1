# SPDX-License-Identifier: Apache-2.0
"""nox sessions: thin wrappers over scripts/series (see README).

nox -s apply-and-test     fetch, apply every stage, test each stage's tree
nox -s apply [-- STAGE]   the patched tree, optionally only up to STAGE
nox -s "tests(base)"      test one stage's tree (also tests(0001), ...)
nox -s lint               pre-commit on every file
nox -s check-patches      committed patches == a fresh export
nox -s refresh | status   write patches/ from the tree | show the tree
nox -s rebase -- TARGET   rebase the stages onto a newer vLLM (see README)
nox -s rebased            apply and test each rebased series under review
                          (patches/next/<target>/) on its target
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from scripts.series.config import Series, load_series  # noqa: E402
from scripts.series.prepare import workdir  # noqa: E402
from scripts.series.rebase import review_is_current  # noqa: E402
from scripts.series.testrun import (  # noqa: E402
    PytestRun,
    Tally,
    format_summary,
    read_junit,
    results_dir,
    stage_runs,
    tooling_run,
)

SERIES_FILE = ROOT / "patches" / "series.toml"
SERIES = load_series(SERIES_FILE)
STAGE_IDS = ["base", *(s.id for s in SERIES.stages)]
# Rebased series written by `rebase` for review, one folder per target.
REBASED = sorted((ROOT / "patches" / "next").glob("*/series.toml"))
REQUIREMENTS = ROOT / "tests" / "requirements-cpu.txt"

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["apply-and-test"]


def _series(session: nox.Session, *args: str, series: Path = SERIES_FILE) -> None:
    """Run the series CLI with the session's interpreter (stdlib only)."""
    session.run(
        "python", "-m", "scripts.series", "--series", str(series), *args, external=True
    )


def _find_links() -> list[str]:
    """pip's find-links (where a local CPU torch wheel may be); uv ignores
    pip's configuration, so pass it on."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if not links:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if key.endswith("find-links"):
                links += value.strip("'\"").split()
    return [arg for link in links for arg in ("--find-links", link)]


def _install_cpu_deps(session: nox.Session, series: Series = SERIES) -> None:
    """Install what the indexer modules need, once per change of inputs."""
    constraints = workdir(series) / "requirements" / "common.txt"
    find_links = _find_links()
    key = hashlib.sha256(
        REQUIREMENTS.read_bytes()
        + constraints.read_bytes()
        + " ".join(find_links).encode()
    ).hexdigest()
    venv = Path(session.virtualenv.location)
    stamp = venv / ".dsa-series-deps"
    if stamp.exists() and stamp.read_text() == key:
        return
    if session.venv_backend != "uv":
        session.install("uv")
    session.run(
        "uv",
        "pip",
        "install",
        "--python",
        str(venv / "bin" / "python"),
        "-r",
        str(REQUIREMENTS),
        "-c",
        str(constraints),
        *find_links,
        env={"UV_COMPILE_BYTECODE": "1"},
        external=True,
    )
    stamp.write_text(key)


def _run_pytest(session: nox.Session, run: PytestRun) -> Tally:
    run.junit.parent.mkdir(parents=True, exist_ok=True)
    run.junit.unlink(missing_ok=True)
    session.log(f"{run.label}")
    session.run(
        "python",
        "-m",
        "pytest",
        *run.args,
        *session.posargs,
        env=run.env,
        success_codes=[0, 1, 5],
    )
    return read_junit(run.junit)


def _stage_tree(
    session: nox.Session, stage_id: str, series: Path = SERIES_FILE
) -> Path:
    tree = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.series",
            "--series",
            str(series),
            "tree",
            stage_id,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if tree.returncode != 0:
        session.error(tree.stderr.strip())
    return Path(tree.stdout.strip())


def _test_stage(
    session: nox.Session, stage_id: str, series_file: Path = SERIES_FILE
) -> Tally:
    series = load_series(series_file)
    tree = _stage_tree(session, stage_id, series_file)
    base_tree = _stage_tree(session, "base", series_file)
    tally = Tally()
    for run in stage_runs(series, stage_id, tree, base_tree):
        tally.add(_run_pytest(session, run))
    return tally


def _report(
    session: nox.Session, rows: list[tuple[str, Tally]], series: Series = SERIES
) -> None:
    summary = format_summary(rows)
    out = results_dir(series) / "summary.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(summary + "\n")
    print("\n" + summary + "\n", flush=True)
    session.log(f"summary written to {out.relative_to(ROOT)}")
    if any(t.failed for _, t in rows):
        session.error("some tests failed (see the table above)")


@nox.session(venv_backend="none")
def apply(session: nox.Session) -> None:
    """Fetch the pinned vLLM and apply the stages (-- STAGE: only up to it)."""
    upto = ["--upto", session.posargs[0]] if session.posargs else []
    _series(session, "apply", *upto)


@nox.session
@nox.parametrize("stage", STAGE_IDS, ids=STAGE_IDS)
def tests(session: nox.Session, stage: str) -> None:
    """Test one stage's tree (base + stages up to it); -- ARGS go to pytest."""
    _series(session, "apply", "--upto", stage)
    _install_cpu_deps(session)
    _report(session, [(stage, _test_stage(session, stage))])


@nox.session(name="apply-and-test")
def apply_and_test(session: nox.Session) -> None:
    """The main job: apply every stage, test each stage's tree, one table."""
    started = time.monotonic()
    _series(session, "apply")
    _install_cpu_deps(session)
    rows = [("tooling", _run_pytest(session, tooling_run(SERIES)))]
    for stage_id in STAGE_IDS:
        rows.append((stage_id, _test_stage(session, stage_id)))
    session.log(f"apply-and-test took {time.monotonic() - started:.0f} s")
    _report(session, rows)


@nox.session
def rebase(session: nox.Session) -> None:
    """Rebase the stages onto a newer vLLM: -- --version V --sha256 H, or
    -- --git PATH --rev REV; then -- --continue | --abort | --accept."""
    _series(session, "apply")
    _install_cpu_deps(session)
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    _series(session, "rebase", "--test-python", python, *session.posargs)


@nox.session
def rebased(session: nox.Session) -> None:
    """Apply and test each rebased series under review (patches/next/*) on
    its own target: the series checked against the next vLLM."""
    if not REBASED:
        session.skip("no rebased series under patches/next/")
    for series_file in REBASED:
        if not review_is_current(SERIES, series_file.parent):
            session.error(
                f"{series_file.parent} was rebased from an older version of "
                "patches/; rebase again (nox -s rebase -- ...): the recorded "
                "conflict resolutions are replayed"
            )
        series = load_series(series_file)
        _series(session, "apply", series=series_file)
        _install_cpu_deps(session, series)
        rows = [
            (
                f"{series.base.label} {stage_id}",
                _test_stage(session, stage_id, series_file),
            )
            for stage_id in ["base", *(s.id for s in series.stages)]
        ]
        _report(session, rows, series)


@nox.session
def lint(session: nox.Session) -> None:
    """pre-commit on every file (ruff, ruff-format, typos, mypy, headers)."""
    session.install("pre-commit")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure")


@nox.session(name="cost-model")
def cost_model(session: nox.Session) -> None:
    """Stage 0001's row-assignment cost model: docs/cp_indexer_cost_model.*"""
    _series(session, "apply")
    _install_cpu_deps(session)
    session.install("matplotlib")
    tree = _stage_tree(session, "0001")
    session.run(
        "python",
        "scripts/cp_indexer_cost_model.py",
        "--tree",
        str(tree),
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


@nox.session(name="check-patches", venv_backend="none")
def check_patches(session: nox.Session) -> None:
    """Fail when patches/ or vllm_overlay/ differ from a fresh export."""
    _series(session, "apply")
    _series(session, "check")


@nox.session(venv_backend="none")
def export(session: nox.Session) -> None:
    """Each stage (-- STAGE: one) as an upstream PR: build/export/, pr/<id>."""
    _series(session, "apply")
    _series(session, "export", *session.posargs)


@nox.session(venv_backend="none")
def refresh(session: nox.Session) -> None:
    """Write patches/ and vllm_overlay/ from the work tree's stage commits."""
    _series(session, "refresh")


@nox.session(venv_backend="none")
def status(session: nox.Session) -> None:
    """Which stages the work tree holds, and edits beyond them."""
    _series(session, "status")
