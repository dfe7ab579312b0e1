# SPDX-License-Identifier: Apache-2.0
"""The rebase's import check on the real series: on a CPU, a stage's vLLM
modules import as the tests see them (ROCm emulated), and a module that is
really broken still stops the rebase with its own error.

vLLM 0.34.0's ``vllm/platforms/rocm.py`` asks the GPU for its arch at import
and fails on any CPU machine ("Torch not compiled with CUDA enabled"); stage
0003 touches it, so an import check without the emulated platform stops every
rebase at stage 0003 and blames the stage."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.series.config import REPO_ROOT, SERIES_FILE, load_series
from scripts.series.layout import BASE_REF, SERIES_REF, workdir
from scripts.series.rebase.checks import package_modules
from scripts.series.rebase.tree_tester import TreeTester

SERIES = load_series(SERIES_FILE)
STAGES = ["base", *(stage.id for stage in SERIES.stages)]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture
def top_stage_repo(request, tmp_path: Path):
    """A clone of the work repo at the top stage, to commit into: outside
    the project, or under its build/ as a real rebase's work repo is (the
    blame rule must tell vLLM's frames there from the project's harness)."""
    work = workdir(SERIES)
    if not (work / ".git").exists():
        pytest.skip(f"needs the applied series in {work}: run `nox -s apply`")
    where = tmp_path
    if getattr(request, "param", None) == "under build/":
        where = REPO_ROOT / "build" / "import-check-tests" / tmp_path.name
        request.addfinalizer(lambda: shutil.rmtree(where, ignore_errors=True))
    clone = where / "vllm"
    subprocess.run(
        ["git", "clone", "-q", "--shared", str(work), str(clone)], check=True
    )
    _git(clone, "checkout", "-q", "--detach", SERIES_REF)
    _git(clone, "fetch", "-q", str(work), f"+{BASE_REF}:{BASE_REF}")
    return clone


def test_every_stage_module_passes_the_rebase_import_check(top_stage_repo):
    changed = _git(top_stage_repo, "diff", "--name-only", BASE_REF, "HEAD").split()
    kept = [path for path in changed if (top_stage_repo / path).is_file()]
    modules = package_modules(SERIES.base.name, kept)
    assert "vllm.platforms.rocm" in modules, "the case this test was written for"
    tester = TreeTester(sys.executable)
    assert tester.imports(SERIES, top_stage_repo, STAGES, modules) is None


@pytest.mark.parametrize(
    "top_stage_repo", ["outside the project", "under build/"], indirect=True
)
def test_a_broken_platform_module_fails_with_its_own_error(top_stage_repo):
    rocm = top_stage_repo / "vllm" / "platforms" / "rocm.py"
    rocm.write_text(rocm.read_text() + "\nraise RuntimeError('planted by the test')\n")
    identity = ("-c", "user.name=Ada Dev", "-c", "user.email=ada@example.com")
    _git(top_stage_repo, *identity, "commit", "-q", "-am", "break rocm.py")
    tester = TreeTester(sys.executable)
    failure = tester.imports(SERIES, top_stage_repo, STAGES, ["vllm.platforms.rocm"])
    assert failure is not None
    assert failure.startswith("vllm.platforms.rocm")
    assert failure.endswith("RuntimeError: planted by the test")


def test_a_broken_emulation_is_named_as_the_projects(top_stage_repo):
    """A stand-in out of step with the target's vLLM is the project's to fix:
    the message says so, instead of blaming vllm.platforms.rocm (and with
    it the stage being checked)."""
    check = (
        "import sys\n"
        "from scripts.harness import fake_aiter, import_check\n"
        "fake_aiter.installed = None  # what the emulation enters: now broken\n"
        "sys.exit(import_check.main(['vllm.envs']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check],
        env={**os.environ, "PYTHONPATH": f"{top_stage_repo}:{REPO_ROOT}"},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout.startswith(
        "the emulated ROCm platform could not be set up "
        "(scripts/harness/rocm_view_plugin.py:"
    ), done.stdout
    assert "the project's harness, not vLLM): TypeError" in done.stdout
