# SPDX-License-Identifier: Apache-2.0
"""Make the applied vLLM tree believe it runs on ROCm (gfx950 or gfx942).

Only the platform *checks* change: ``current_platform.is_rocm()``, the gfx
flags and probes from ``vllm.platforms.rocm`` (whose real import needs a ROCm
torch), AITER's presence and its enable switch. Kernels still run on the CPU
through the stand-ins in ``fake_aiter`` and ``topk_reference``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from harness import fake_aiter, topk_reference

ARCHS = ("gfx950", "gfx942")


def real_gfx950_with_aiter() -> bool:
    """Whether this machine really is ROCm gfx950 with AITER installed, for
    the tests that need the hardware. Asks rocminfo rather than torch, so the
    GPU is not initialised in a process that later forks ranks."""
    if torch.version.hip is None or importlib.util.find_spec("aiter") is None:
        return False
    rocminfo = shutil.which("rocminfo")
    if rocminfo is None:
        return False
    out = subprocess.run([rocminfo], capture_output=True, text=True, check=False)
    return "gfx950" in out.stdout


def _platform_module(arch: str) -> types.ModuleType:
    module = types.ModuleType("vllm.platforms.rocm")
    flags = {"gfx950": arch == "gfx950", "gfx942": arch == "gfx942"}
    module._ON_GFX950 = flags["gfx950"]  # type: ignore[attr-defined]
    module._ON_GFX942 = flags["gfx942"]  # type: ignore[attr-defined]
    module.on_gfx950 = lambda: flags["gfx950"]  # type: ignore[attr-defined]
    module.on_gfx942 = lambda: flags["gfx942"]  # type: ignore[attr-defined]
    module.on_gfx11 = lambda: False  # type: ignore[attr-defined]
    module.on_gfx9 = lambda: True  # type: ignore[attr-defined]
    module.get_cdna_version = lambda: 4 if flags["gfx950"] else 3  # type: ignore[attr-defined]
    return module


@contextmanager
def emulate_rocm(arch: str = "gfx950", aiter: bool = True) -> Iterator[None]:
    """ROCm on ``arch``; with ``aiter`` the AITER stand-in is found and enabled.

    Everything is restored on exit."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    import vllm._aiter_ops as aiter_ops
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as mla_sparse
    import vllm.v1.attention.ops.rocm_paged_mxfp4_indexer as mxfp4_ops
    from vllm.platforms import current_platform

    topk_reference.register_vllm_c_ops()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setitem(sys.modules, "vllm.platforms.rocm", _platform_module(arch))
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(mla_sparse, "_ON_GFX950", arch == "gfx950")
    monkeypatch.setattr(mla_sparse, "_ON_GFX942", arch == "gfx942")
    monkeypatch.setattr(aiter_ops, "IS_AITER_FOUND", aiter)
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1" if aiter else "0")
    aiter_ops.rocm_aiter_ops.refresh_env_variables()
    caches = (
        mla_sparse.mqa_logits_module,
        mla_sparse.paged_mqa_logits_module,
        mxfp4_ops._aiter,
        mxfp4_ops.rocm_paged_mxfp4_cache_layout,
    )
    for cache in caches:
        cache.cache_clear()
    try:
        if aiter:
            with fake_aiter.installed():
                yield
        else:
            yield
    finally:
        for cache in caches:
            cache.cache_clear()
        monkeypatch.undo()
        aiter_ops.rocm_aiter_ops.refresh_env_variables()
