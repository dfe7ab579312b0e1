# SPDX-License-Identifier: Apache-2.0
"""Sessions of the DSA indexer patch series for vLLM.

Each one is a thin wrapper over the series tool, python -m scripts.series: it
checks its arguments with the tool's parser first, then sets up Python and
runs the tool. README.md says which session to run when.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent


def _stage_ids() -> list[str]:
    """'base' and the stage ids of the series, in order."""
    stages = subprocess.run(
        [sys.executable, "-m", "scripts.series", "stages"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if stages.returncode != 0:
        sys.exit(stages.stderr.strip() or "python -m scripts.series stages failed")
    return stages.stdout.split()


STAGE_IDS = _stage_ids()
REQUIREMENTS = ROOT / "tests" / "requirements-cpu.txt"

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["apply-and-test"]


def _check_args(session: nox.Session, command: str, *args: str) -> dict:
    """Check the arguments a session passes on with the series tool's own
    parser (stage ids included) before anything is applied or installed;
    return them as the tool parsed them."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.series",
            "--check-args",
            command,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["(no message)"]
        # argparse's "PROG: error: ..." or the tool's "error: ..."
        error = lines[-1].split("error: ", 1)[-1].rstrip(".")
        session.error(
            f"nox -s {session.name}: {error}. The arguments after -- go to "
            f"python -m scripts.series {command}; its --help lists them"
        )
    try:
        return dict(json.loads(result.stdout))
    except json.JSONDecodeError:
        # -- --help: the tool printed the command's help instead.
        print(result.stdout, end="")
        session.skip(f"printed python -m scripts.series {command} --help")


def _no_args(session: nox.Session) -> None:
    if session.posargs:
        session.error(
            f"nox -s {session.name} takes no arguments; got "
            + " ".join(session.posargs)
        )


def _python(session: nox.Session) -> str:
    """The session's own interpreter: its virtualenv's, or for a session
    without one the Python nox runs on (a host may have ``python3`` and no
    ``python``)."""
    if session.venv_backend == "none":
        return sys.executable
    return str(Path(session.virtualenv.location) / "bin" / "python")


def _series(session: nox.Session, *args: str) -> None:
    """Run the series CLI with the session's interpreter (stdlib only)."""
    session.run(_python(session), "-m", "scripts.series", *args, external=True)


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


def _install_cpu_deps(session: nox.Session) -> None:
    """Install what the indexer modules need (vLLM's own pins as
    constraints), once per change of inputs."""
    constraints = _stage_tree(session, "base") / "requirements" / "common.txt"
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


def _stage_tree(session: nox.Session, stage_id: str) -> Path:
    tree = session.run(
        _python(session),
        "-m",
        "scripts.series",
        "tree",
        stage_id,
        silent=True,
        external=True,
    )
    return Path(str(tree).strip())


@nox.session(venv_backend="none")
def apply(session: nox.Session) -> None:
    """Apply the stages to the pinned vLLM: all of them, or up to one.

    nox -s apply -- 0001 stops after stage 0001 (base: none). After a stage
    change, nox -s apply -- --carry merges a later stage that no longer
    applies; --continue commits it once resolved, --abort drops it.
    """
    args = list(session.posargs)
    if args and not args[0].startswith("-"):
        args[:1] = ["--upto", args[0]]
    _check_args(session, "apply", *args)
    _series(session, "apply", *args)


def _test_args(session: nox.Session) -> list[str]:
    """-- and the session's arguments, for pytest. Every test runs every
    time; --rerun, which once overrode a result cache, is still taken (and
    dropped) so that older commands and scripts keep working."""
    posargs = list(session.posargs)
    if "--rerun" in posargs:
        session.log("--rerun is no longer needed: every test runs every time")
    return ["--", *(arg for arg in posargs if arg != "--rerun")]


@nox.session
@nox.parametrize("stage", STAGE_IDS, ids=STAGE_IDS)
def tests(session: nox.Session, stage: str) -> None:
    """Test one stage's tree: the base and the stages up to it.

    Arguments after -- go to pytest.
    """
    _check_args(session, "test", stage, *_test_args(session))
    _series(session, "apply", "--upto", stage)
    _install_cpu_deps(session)
    _series(session, "test", stage, *_test_args(session))


@nox.session(name="apply-and-test")
def apply_and_test(session: nox.Session) -> None:
    """Apply every stage, test each stage's tree, and print one summary table.

    Arguments after -- go to pytest.
    """
    _check_args(session, "test", "--tooling", *_test_args(session))
    started = time.monotonic()
    _series(session, "apply")
    _install_cpu_deps(session)
    try:
        _series(session, "test", "--tooling", *_test_args(session))
    finally:
        session.log(f"apply-and-test took {time.monotonic() - started:.0f} s")


def _rebase_runs_no_tests() -> bool:
    """Whether this is ``nox -s rebase -- --version V`` without --sha256
    (it only prints the hash the package index lists) or ``-- --abort``:
    nox then makes no virtualenv for it (a session's backend is chosen
    before it runs)."""
    args = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    if "--abort" in args:
        return True
    return "--version" in args and not {"--sha256", "--git", "--rev"} & set(args)


@nox.session(venv_backend="none" if _rebase_runs_no_tests() else None)
def rebase(session: nox.Session) -> None:
    """Rebase the stages onto a newer vLLM release or git checkout.

    -- --version V --sha256 H (a release; --version alone prints the hash
    the package index lists), or -- --git PATH --rev REV; then -- --continue
    or --abort. It ends on a project branch, rebase/<target>: merge a
    release's branch to adopt its pin; a git checkout's is for testing,
    never merged.
    """
    python = _python(session)
    parsed = _check_args(session, "rebase", "--test-python", python, *session.posargs)
    if parsed["abort"] or (parsed["version"] and not parsed["sha256"]):
        # An abort, or only the hash and the command to run: nothing to set
        # up, and the work tree's edits are none of their business.
        _series(session, "rebase", *session.posargs)
        return
    if not parsed["resume"]:
        # --continue goes on from the stage commits it recorded.
        _series(session, "apply")
    _install_cpu_deps(session)
    _series(session, "rebase", "--test-python", python, *session.posargs)


@nox.session(name="rehearse-rebase")
def rehearse_rebase(session: nox.Session) -> None:
    """Rehearse the next rebase and delete its branch.

    The target: a git checkout of the pinned release plus upstream comment
    lines that move and touch the stages' hunks (build/rehearsal/). Every
    stage must apply or merge, and be imported and tested where its merge
    made other code than the applied stages; the rebase must end on its
    branch. -- --keep keeps the branch.
    """
    if set(session.posargs) - {"--keep"}:
        session.error(
            f"nox -s {session.name} takes only --keep; got " + " ".join(session.posargs)
        )
    python = _python(session)
    _series(session, "apply")
    _install_cpu_deps(session)
    session.run(
        python,
        "-m",
        "scripts.series.rebase.rehearsal",
        "--test-python",
        python,
        *session.posargs,
    )


@nox.session
def roll(session: nox.Session) -> None:
    """Rebase onto vLLM's newest release when it is newer than the pin.

    Prints what needs a person; made to run on a schedule.
    """
    python = _python(session)
    _check_args(session, "roll", "--test-python", python, *session.posargs)
    _series(session, "apply")
    _install_cpu_deps(session)
    _series(session, "roll", "--test-python", python)


@nox.session
def lint(session: nox.Session) -> None:
    """Run pre-commit on every file: ruff, typos, mypy and the SPDX headers."""
    _no_args(session)
    session.install("pre-commit")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure")


@nox.session(name="cost-model")
def cost_model(session: nox.Session) -> None:
    """Write stage 0001's row-assignment cost model to docs/.

    docs/cp_indexer_cost_model.md and .png.
    """
    _no_args(session)
    _series(session, "apply")
    _install_cpu_deps(session)
    session.install("matplotlib")
    tree = _stage_tree(session, "0001")
    session.run(
        _python(session),
        "-m",
        "scripts.bench.cp_indexer_cost_model",
        "--tree",
        str(tree),
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


@nox.session(venv_backend="none")
def install(session: nox.Session) -> None:
    """Write the stages into an installed vLLM of the pinned release, or undo it.

    -- --into SITE [--upto STAGE], or -- --into SITE --undo; SITE is the
    folder that holds vllm/. No rebuild: every change is Python.
    """
    parsed = _check_args(session, "install", *session.posargs)
    if not parsed["undo"]:
        _series(session, "apply")
    _series(session, "install", *session.posargs)


@nox.session(venv_backend="none")
def validate(session: nox.Session) -> None:
    """Run the PR texts' MI355X serving benchmarks and accuracy tasks.

    On the GPU machine, with the stages' vLLM installed in this Python:
    -- --stage 0001 (or 0001-serving, 0003) [--dry-run].
    """
    session.run(
        _python(session), "-m", "scripts.validate", *session.posargs, external=True
    )


@nox.session(name="check-patches", venv_backend="none")
def check_patches(session: nox.Session) -> None:
    """Fail when patches/ or vllm_overlay/ differ from a fresh export."""
    _no_args(session)
    _series(session, "apply")
    _series(session, "check")


@nox.session
def export(session: nox.Session) -> None:
    """Export each stage as an upstream PR and check it as a maintainer would.

    For the pinned vLLM (build/export/<base>/, branch pr/<id>): git am on
    the base, its pre-commit, its tests with plain pytest on a CPU and as AMD
    CI's MI300 and MI355 machines run them (ROCm emulated, AITER on and off).
    -- 0001 exports one stage (and those it needs); -- --signoff 'NAME
    <EMAIL>' signs off as someone other than your git identity.
    """
    python = _python(session)
    _check_args(session, "export", "--test-python", python, *session.posargs)
    _series(session, "apply")
    _install_cpu_deps(session)
    _series(session, "export", "--test-python", python, *session.posargs)


@nox.session(venv_backend="none")
def refresh(session: nox.Session) -> None:
    """Write patches/ and vllm_overlay/ from the work tree's stage commits.

    -- --into-top takes edits to lines a lower stage adds into the top stage.
    """
    _check_args(session, "refresh", *session.posargs)
    _series(session, "refresh", *session.posargs)


@nox.session(venv_backend="none")
def status(session: nox.Session) -> None:
    """Show which stages the work tree holds, and edits beyond them."""
    _no_args(session)
    _series(session, "status")


@nox.session
def mutate(session: nox.Session) -> None:
    """Mutation-test a module with mutmut and print its score (not CI).

    -- MODULE [--since REV | --lines A-B ...] -- PYTEST-ARGS: the tests that
    should kill its mutants; they run in a scratch worktree, never in the
    checkout (scripts/mutate.py).
    """
    if not session.posargs:
        session.error(
            "nox -s mutate -- MODULE [--since REV] -- PYTEST-ARGS (the tests that "
            "should kill its mutants)"
        )
    _series(session, "apply")
    _install_cpu_deps(session)
    session.run(_python(session), "-m", "scripts.mutate", *session.posargs)
