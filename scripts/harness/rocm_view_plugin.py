# SPDX-License-Identifier: Apache-2.0
"""pytest plugin: a PR's tests as an AMD CI machine sees them, on the CPU.

``-p scripts.harness.rocm_view_plugin`` with ``DSA_ROCM_VIEW`` naming the
arch (``gfx942``: MI300, ``gfx950``: MI355). ``VLLM_ROCM_USE_AITER`` is left
as the run's environment sets it, as a Buildkite step sets it: the export's
maintainer check runs each arch with it at 1 and at 0. Without
``DSA_ROCM_VIEW`` the plugin does nothing.

Before vLLM's conftest or any test module is imported, for the whole
session, as on that machine:

- ``vllm.platforms.rocm`` is vLLM's own module from the tree under test,
  loaded with an AMD SMI stand-in that reports the arch, so ``on_gfx950()``,
  ``get_cdna_version()`` and the module constants read at import answer for
  it (``rocm_platform.rocm_platform_module``);
- the platform object says ``is_rocm()``, with ``RocmPlatform``'s FP8 dtype
  for the arch (fnuz on gfx942);
- AITER is installed (vLLM's ROCm image ships it): the ``fake_aiter``
  stand-in is in ``sys.modules``, so ``IS_AITER_FOUND`` is true.

What stays the CPU's: the device (no GPU: ``is_cuda_alike()`` is false, and
Triton kernels run through the interpreter) and vLLM's compiled ops (not
built). A test that needs the AMD GPU itself must skip, saying so, as it
does on any machine without one.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack

import pytest

VIEW_ENV = "DSA_ROCM_VIEW"
# Which AMD CI machine each arch stands for.
MACHINES = {"gfx942": "MI300", "gfx950": "MI355"}

_STACK = ExitStack()


def _arch() -> str | None:
    arch = os.environ.get(VIEW_ENV) or None
    if arch is not None and arch not in MACHINES:
        raise pytest.UsageError(
            f"{VIEW_ENV}={arch!r}: expected one of {', '.join(MACHINES)}"
        )
    return arch


def emulate(arch: str) -> None:
    """Make this process the ``arch`` machine, as the module docstring says,
    until ``pytest_unconfigure``."""
    import torch  # noqa: F401  (before AITER's stand-in, which needs it)

    from scripts.harness import fake_aiter
    from scripts.harness.rocm_platform import rocm_platform_module

    _STACK.enter_context(fake_aiter.installed())
    import vllm.platforms

    rocm = rocm_platform_module(arch)
    patch = _STACK.enter_context(pytest.MonkeyPatch.context())
    patch.setitem(sys.modules, "vllm.platforms.rocm", rocm)
    platform = vllm.platforms.current_platform
    patch.setattr(platform, "is_rocm", lambda: True)
    patch.setattr(platform, "fp8_dtype", rocm.RocmPlatform.fp8_dtype)
    patch.setattr(platform, "is_fp8_fnuz", rocm.RocmPlatform.is_fp8_fnuz)
    # Imported only now, so that it finds AITER and the platform as the
    # machine would at import.
    import vllm._aiter_ops as aiter_ops

    if not aiter_ops.IS_AITER_FOUND:
        raise pytest.UsageError(
            f"{VIEW_ENV}: vllm._aiter_ops was imported before the view started "
            "and did not find AITER's stand-in"
        )
    aiter_ops.rocm_aiter_ops.refresh_env_variables()


def check(arch: str) -> str:
    """What the view looks like from vLLM, as one line; raises if it did not
    take (the tests would then see the CPU and pass for the wrong reason)."""
    import vllm._aiter_ops as aiter_ops
    from vllm.platforms import current_platform
    from vllm.platforms.rocm import get_cdna_version, on_gfx950

    cdna = get_cdna_version()
    expected = 4 if arch == "gfx950" else 3
    if not current_platform.is_rocm() or cdna != expected:
        raise pytest.UsageError(
            f"{VIEW_ENV}={arch}: vLLM sees is_rocm()={current_platform.is_rocm()}, "
            f"CDNA {cdna}; the view did not take"
        )
    return (
        f"AMD CI view: {MACHINES[arch]} ({arch}, CDNA {cdna}, "
        f"on_gfx950()={on_gfx950()}), AITER found={aiter_ops.IS_AITER_FOUND}, "
        f"VLLM_ROCM_USE_AITER={os.environ.get('VLLM_ROCM_USE_AITER', '(unset)')}, "
        f"rocm_aiter_ops.is_enabled()={aiter_ops.rocm_aiter_ops.is_enabled()}"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # vLLM's conftest imports vLLM: the view must be in place before it.
    if arch := _arch():
        emulate(arch)


def pytest_report_header(config):
    if arch := _arch():
        return check(arch)
    return None


def pytest_unconfigure(config):
    _STACK.close()
