# SPDX-License-Identifier: Apache-2.0
"""The rebase's import check on the real series: on a CPU, a stage's vLLM
modules import as the tests see them (ROCm emulated), and a module that is
really broken still stops the rebase with its own error.

vLLM 0.34.0's ``vllm/platforms/rocm.py`` asks the GPU for its arch at import
and fails on any CPU machine ("Torch not compiled with CUDA enabled"); stage
0003 touches it, so an import check without the emulated platform stops every
rebase at stage 0003 and blames the stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.series.config import SERIES_FILE, load_series
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
def top_stage_repo(tmp_path: Path) -> Path:
    """A clone of the work repo at the top stage, to commit into."""
    work = workdir(SERIES)
    if not (work / ".git").exists():
        pytest.skip(f"needs the applied series in {work}: run `nox -s apply`")
    clone = tmp_path / "vllm"
    subprocess.run(
        ["git", "clone", "-q", "--shared", str(work), str(clone)], check=True
    )
    _git(clone, "checkout", "-q", "--detach", SERIES_REF)
    _git(clone, "fetch", "-q", str(work), f"+{BASE_REF}:{BASE_REF}")
    return clone


def test_every_stage_module_passes_the_rebase_import_check(top_stage_repo):
    changed = _git(top_stage_repo, "diff", "--name-only", BASE_REF, "HEAD").split()
    modules = package_modules(SERIES.base.name, changed)
    assert "vllm.platforms.rocm" in modules, "the case this test was written for"
    tester = TreeTester(sys.executable)
    assert tester.imports(SERIES, top_stage_repo, STAGES, modules) is None


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
