# SPDX-License-Identifier: Apache-2.0
"""nox sessions: thin wrappers that call the series tool, scripts/series
(see README); they only set up Python environments.

nox -s apply-and-test     fetch, apply every stage, test each stage's tree
nox -s apply [-- STAGE]   the patched tree, optionally only up to STAGE
nox -s "tests(base)"      test one stage's tree (also tests(0001), ...);
                          both run `python -m scripts.series test`
nox -s lint               pre-commit on every file
nox -s check-patches      committed patches == a fresh export
nox -s refresh | status   write patches/ from the tree | show the tree
nox -s rebase -- TARGET   rebase the stages onto a newer vLLM (see README)
nox -s roll               rebase onto the newest vLLM release, if newer
nox -s refresh-reviews    rebase each review under patches/next/ again
                          after a stage change
nox -s rebased            apply and test each rebased series under review
                          (patches/next/<target>/) on its target
nox -s export [-- STAGE]  each stage as an upstream PR (build/export/<base>/)
nox -s cost-model         stage 0001's row-assignment cost model (docs/)
nox -s install -- --into SITE [--upto STAGE | --undo]   the stages written
                          into an installed vLLM 0.32.0 (no rebuild)
nox -s validate -- --stage 0001 [--dry-run]   the MI355X serving runs (README)
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
SERIES_FILE = ROOT / "patches" / "series.toml"
_stages = subprocess.run(
    [sys.executable, "-m", "scripts.series", "stages"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
)
if _stages.returncode != 0:
    sys.exit(_stages.stderr.strip() or "python -m scripts.series stages failed")
STAGE_IDS = _stages.stdout.split()
# Rebased series written by `rebase` for review, one folder per target.
REBASED = sorted((ROOT / "patches" / "next").glob("*/series.toml"))
REQUIREMENTS = ROOT / "tests" / "requirements-cpu.txt"

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["apply-and-test"]


def _note_if_uncommitted(session: nox.Session, series_file: Path) -> None:
    """A review under patches/next/ that git does not track is run here but
    not in CI (a clean clone): say so, not to sweep it in unnoticed."""
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--error-unmatch", str(series_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    # Exit status 1 with git's "did not match" message: not tracked (any
    # other failure, such as no git checkout, says nothing about it).
    if tracked.returncode == 1 and "did not match" in tracked.stderr:
        folder = series_file.parent.relative_to(ROOT)
        session.warn(
            f"{folder}/ is not committed: it runs here, but CI (a clean clone) "
            "does not see it; commit it, or delete it if it is a leftover"
        )


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


def _install_cpu_deps(session: nox.Session, series: Path = SERIES_FILE) -> None:
    """Install what the indexer modules need (vLLM's own pins as
    constraints), once per change of inputs."""
    constraints = _stage_tree(session, "base", series) / "requirements" / "common.txt"
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


def _stage_tree(
    session: nox.Session, stage_id: str, series: Path = SERIES_FILE
) -> Path:
    tree = session.run(
        "python",
        "-m",
        "scripts.series",
        "--series",
        str(series),
        "tree",
        stage_id,
        silent=True,
        external=True,
    )
    return Path(str(tree).strip())


@nox.session(venv_backend="none")
def apply(session: nox.Session) -> None:
    """Fetch the pinned vLLM and apply the stages (-- STAGE: only up to it;
    -- --carry, --continue, --abort: carry a stage that no longer applies)."""
    args = list(session.posargs)
    if args and not args[0].startswith("-"):
        args[:1] = ["--upto", args[0]]
    _series(session, "apply", *args)


def _test_args(session: nox.Session) -> list[str]:
    """``test``'s own --rerun, then -- and the rest for pytest."""
    posargs = list(session.posargs)
    rerun = ["--rerun"] if "--rerun" in posargs else []
    return [*rerun, "--", *(arg for arg in posargs if arg != "--rerun")]


@nox.session
@nox.parametrize("stage", STAGE_IDS, ids=STAGE_IDS)
def tests(session: nox.Session, stage: str) -> None:
    """Test one stage's tree (base + stages up to it); -- --rerun runs
    unchanged runs again; other ARGS go to pytest."""
    _series(session, "apply", "--upto", stage)
    _install_cpu_deps(session)
    _series(session, "test", stage, *_test_args(session))


@nox.session(name="apply-and-test")
def apply_and_test(session: nox.Session) -> None:
    """The main job: apply every stage, test each stage's tree, one table
    (-- --rerun: also the runs whose inputs are unchanged since they passed)."""
    started = time.monotonic()
    _series(session, "apply")
    _install_cpu_deps(session)
    try:
        _series(session, "test", "--tooling", *_test_args(session))
    finally:
        session.log(f"apply-and-test took {time.monotonic() - started:.0f} s")


@nox.session
def rebase(session: nox.Session) -> None:
    """Rebase the stages onto a newer vLLM: -- --version V --sha256 H, or
    -- --git PATH --rev REV; then -- --continue | --abort | --accept."""
    _series(session, "apply")
    _install_cpu_deps(session)
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    _series(session, "rebase", "--test-python", python, *session.posargs)


@nox.session
def roll(session: nox.Session) -> None:
    """Rebase onto the newest vLLM release when it is newer than the pin, and
    print what needs a person (made to run on a schedule)."""
    _series(session, "apply")
    _install_cpu_deps(session)
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    _series(session, "roll", "--test-python", python)


@nox.session(name="refresh-reviews")
def refresh_reviews(session: nox.Session) -> None:
    """After a stage change: rebase again onto each target under
    patches/next/ whose review is older than patches/ (resolutions replay)."""
    _series(session, "apply")
    _install_cpu_deps(session)
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    _series(session, "rebase", "--refresh", "--test-python", python)


@nox.session
def rebased(session: nox.Session) -> None:
    """Apply and test each rebased series under review (patches/next/*) on
    its own target: the series checked against the next vLLM."""
    if not REBASED:
        session.skip("no rebased series under patches/next/")
    for series_file in REBASED:
        _note_if_uncommitted(session, series_file)
        _series(session, "apply", series=series_file)
        _install_cpu_deps(session, series_file)
        _series(session, "test", *_test_args(session), series=series_file)


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
        "-m",
        "scripts.bench.cp_indexer_cost_model",
        "--tree",
        str(tree),
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


@nox.session(venv_backend="none")
def install(session: nox.Session) -> None:
    """Write the stages into an installed vLLM of the pinned release, no
    rebuild: -- --into SITE [--upto STAGE], or -- --into SITE --undo."""
    if "--undo" not in session.posargs:
        _series(session, "apply")
    _series(session, "install", *session.posargs)


@nox.session(venv_backend="none")
def validate(session: nox.Session) -> None:
    """On the GPU box, with the patched vLLM installed in this Python: the
    seeds' serving benchmarks and accuracy tasks, -- --stage 0001 [--dry-run]."""
    session.run("python", "-m", "scripts.validate", *session.posargs, external=True)


@nox.session(name="check-patches", venv_backend="none")
def check_patches(session: nox.Session) -> None:
    """Fail when patches/ or vllm_overlay/ differ from a fresh export."""
    _series(session, "apply")
    _series(session, "check")


@nox.session
def export(session: nox.Session) -> None:
    """Each stage as an upstream PR, on the pinned vLLM and on each rebased
    series' target (build/export/<base>/, pr/<id>), checked as a maintainer
    takes it: `git am`, then its tests with plain pytest on a CPU and as AMD
    CI's MI300/MI355 machines run them (ROCm emulated, AITER on and off);
    -- --signoff 'NAME <EMAIL>' (default: your git identity)."""
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    for series_file in (SERIES_FILE, *REBASED):
        if series_file != SERIES_FILE:
            _note_if_uncommitted(session, series_file)
        _series(session, "apply", series=series_file)
        _install_cpu_deps(session, series_file)
        _series(
            session,
            "export",
            "--test-python",
            python,
            *session.posargs,
            series=series_file,
        )


@nox.session(venv_backend="none")
def refresh(session: nox.Session) -> None:
    """Write patches/ and vllm_overlay/ from the work tree's stage commits
    (-- --into-top: edits to a lower stage's lines go to the top stage)."""
    _series(session, "refresh", *session.posargs)


@nox.session(venv_backend="none")
def status(session: nox.Session) -> None:
    """Which stages the work tree holds, and edits beyond them."""
    _series(session, "status")
