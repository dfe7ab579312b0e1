# SPDX-License-Identifier: Apache-2.0
"""Import vLLM modules on the platform the series' tests emulate.

``python -m scripts.harness.import_check MODULE...`` with the tree under
test first on ``PYTHONPATH``. The process is set up as tests/conftest.py and
the ROCm tests set up theirs: vLLM's compiled ops stood in, Triton's FP8
shim under the interpreter, and vLLM's own ``vllm.platforms.rocm`` loaded as
on an MI355X (gfx950) with the AITER stand-in installed
(``rocm_view_plugin.emulate``). A module that only imports on a ROCm machine
(``vllm/platforms/rocm.py`` asks the GPU for its arch at import) imports
here; one that is broken still fails, with its own error.

Prints ``MODULE: ERROR: MESSAGE`` for the first module that fails and exits
1; exits 0 when all import. A rebase checks a stage's modules with it on the
target (scripts/series/rebase/tree_tester.py), and tests/base checks on the
pinned tree that every module the stages touch passes it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

# The arch the check emulates: the one stage 0003 requires, and a superset
# of gfx942's imports (the module constants differ, not what is imported).
ARCH = "gfx950"
PLATFORM_MODULE = "vllm.platforms.rocm"
PROJECT = Path(__file__).resolve().parents[2]
HARNESS = PROJECT / "scripts"  # not build/, where the trees under test are


def _has_rocm_platform() -> bool:
    try:
        return importlib.util.find_spec(PLATFORM_MODULE) is not None
    except ModuleNotFoundError as exc:  # a parent package is missing
        if exc.name and f"{PLATFORM_MODULE}.".startswith(f"{exc.name}."):
            return False
        raise


def _setup() -> None:
    from scripts.harness import compiled_stub, triton_fp8_shim

    compiled_stub.install()
    if os.environ.get("TRITON_INTERPRET") == "1":
        triton_fp8_shim.install()
    # A tree without vLLM's ROCm platform (the tool's own synthetic trees)
    # has nothing to emulate.
    if not _has_rocm_platform():
        return
    from scripts.harness.rocm_view_plugin import emulate

    emulate(ARCH)


def _setup_failure(exc: BaseException) -> str:
    """Whose the failure is: the innermost frame in vLLM or in the project's
    harness decides (the standard library's and torch's frames are passed
    over). A stand-in out of step with this vLLM is the project's to fix,
    whatever module the check was asked for."""
    error = f"{type(exc).__name__}: {exc}"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        where = Path(frame.filename).resolve()
        if where.is_relative_to(HARNESS):
            return (
                "the emulated ROCm platform could not be set up "
                f"({where.relative_to(PROJECT)}:{frame.lineno}, the project's "
                f"harness, not vLLM): {error}"
            )
        if "vllm" in where.parts:
            break
    return f"{PLATFORM_MODULE} (emulated {ARCH}): {error}"


def main(modules: list[str]) -> int:
    # AITER enabled, as a ROCm serving image runs it (the view leaves the
    # switch to the environment, as a CI step sets it).
    os.environ.setdefault("VLLM_ROCM_USE_AITER", "1")
    try:
        _setup()
    except BaseException as exc:
        print(_setup_failure(exc))
        return 1
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            print(f"{name}: {type(exc).__name__}: {exc}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
