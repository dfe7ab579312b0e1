# SPDX-License-Identifier: Apache-2.0
"""The machines a PR's tests are run as by the export's maintainer check.

vLLM's CI runs a PR's tests on CPU and NVIDIA boxes and, through
``.buildkite/test-amd.yaml``, on MI300 (gfx942) and MI355 (gfx950) boxes,
from ``tests/`` with vLLM installed (``pytest -v -s v1/attention``; some
steps with ``VLLM_ROCM_USE_AITER=1``). A test that only ever ran on a CPU
box can take the ROCm branch there and fail. So each PR's tests run five
times: plain pytest from the tree's root as a CPU box runs them, and from
``tests/`` under vLLM's ROCm platform emulated as each AMD machine, with
AITER switched on and off (``scripts/harness/rocm_view_plugin.py``: the
platform's checks, vLLM's own ROCm module and AITER's stand-in; the device
stays the CPU). A view passes when nothing fails and every skip gives a
reason.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.series.config import REPO_ROOT
from scripts.series.contract import CPU_ENV
from scripts.series.testing.results import Tally, read_junit

PLUGIN = "scripts.harness.rocm_view_plugin"
VIEW_ENV = "DSA_ROCM_VIEW"  # the plugin's: the arch it emulates
NO_REASON = "no reason given"  # read_junit's word for a bare skip


@dataclass(frozen=True)
class View:
    """One machine the PR's tests run as. ``arch`` None: the CPU box."""

    key: str
    label: str
    arch: str | None = None
    aiter: bool = False

    def command(
        self, python: str, tree: Path, paths: Sequence[str], junit: Path
    ) -> tuple[list[str], dict[str, str], Path]:
        """pytest's command line, environment (over the caller's) and
        folder for ``paths`` (relative to the tree's root)."""
        args = ["-p", "no:cacheprovider", f"--junitxml={junit}", "-q", "-rs"]
        if self.arch is None:
            # Plain pytest from the tree's root, nothing of this project on
            # the path, as a vLLM checkout runs them.
            env = {**CPU_ENV, "PYTHONPATH": ""}
            return [python, "-m", "pytest", *args, *paths], env, tree
        # As test-amd.yaml's steps: from tests/, vLLM importable (installed
        # there; the tree here), the plugin from this project.
        env = {
            **CPU_ENV,
            # vLLM asks HIP_VISIBLE_DEVICES, not CUDA's, on ROCm: empty keeps
            # its Triton on without a GPU, as CUDA_VISIBLE_DEVICES does here.
            "HIP_VISIBLE_DEVICES": "",
            "PYTHONPATH": f"{tree}:{REPO_ROOT}",
            VIEW_ENV: self.arch,
            "VLLM_ROCM_USE_AITER": "1" if self.aiter else "0",
        }
        relative = [p.removeprefix("tests/") for p in paths]
        command = [python, "-m", "pytest", "-p", PLUGIN, *args, *relative]
        return command, env, tree / "tests"


CPU = View("cpu", "CPU")
AMD_CI = (
    View("mi300-aiter", "MI300 (gfx942), VLLM_ROCM_USE_AITER=1", "gfx942", True),
    View("mi300", "MI300 (gfx942), VLLM_ROCM_USE_AITER=0", "gfx942", False),
    View("mi355-aiter", "MI355 (gfx950), VLLM_ROCM_USE_AITER=1", "gfx950", True),
    View("mi355", "MI355 (gfx950), VLLM_ROCM_USE_AITER=0", "gfx950", False),
)
VIEWS = (CPU, *AMD_CI)


def run_view(
    view: View,
    python: str,
    tree: Path,
    paths: Sequence[str],
    junit: Path,
    log: Path,
) -> Tally:
    """Run ``paths`` as ``view`` now, output to ``log``; the tally."""
    junit.unlink(missing_ok=True)
    command, env, cwd = view.command(python, tree, paths, junit)
    with log.open("w") as out:
        done = subprocess.run(
            command,
            env={**os.environ, **env},
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    tally = read_junit(junit)
    # 0: passed, 1: some failed, 5: nothing collected; else pytest itself
    # failed (a plugin that refused: the view did not take).
    if done.returncode not in (0, 1, 5):
        tally.failed += 1
        tally.failures.append(f"pytest exited {done.returncode}")
    if not tally.first_error and (done.returncode not in (0, 1, 5) or tally.failed):
        lines = log.read_text(errors="replace").strip().splitlines()
        tally.first_error = lines[-1] if lines else ""
    return tally


def missing_platform(view: View, tree: Path) -> str | None:
    """Why ``view`` cannot run on ``tree``, or None: an AMD view needs the
    target's own ROCm platform module, which every vLLM has."""
    if view.arch is not None and not (tree / "vllm/platforms/rocm.py").is_file():
        return "the target has no vllm/platforms/rocm.py (no ROCm platform)"
    return None


def verdict(view: View, tally: Tally) -> tuple[bool, str]:
    """Whether the view passes, and its outcome in words."""
    bare = tally.skip_reasons.get(NO_REASON, 0)
    ran = tally.passed + tally.skipped
    ok = not tally.failed and not bare and ran > 0
    if view.arch is None:
        ok = ok and tally.passed > 0  # on a CPU box they must run somewhere
    detail = f"{tally.passed} passed, {tally.failed} failed, {tally.skipped} skipped"
    if tally.skip_reasons:
        detail += (
            " ("
            + "; ".join(
                f"{n}x {reason}" for reason, n in tally.skip_reasons.most_common()
            )
            + ")"
        )
    if bare:
        detail += f"; {bare} skipped without a reason"
    if not ran and not tally.failed:
        detail += "; no test ran"
    if tally.failures:
        detail += ": " + ", ".join(tally.failures[:5])
    if tally.first_error:
        detail += f"; first error: {tally.first_error}"
    return ok, detail
