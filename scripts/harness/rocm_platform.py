# SPDX-License-Identifier: Apache-2.0
"""Make the applied vLLM tree believe it runs on ROCm (gfx950 or gfx942).

Only the platform *checks* change: ``current_platform.is_rocm()``, the
``vllm.platforms.rocm`` module (the tree's own, loaded with an AMD SMI
stand-in that reports the arch), AITER's presence and its enable switch.
Kernels still run on the CPU through the stand-ins in ``fake_aiter`` and
``topk_reference``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from scripts.harness import fake_aiter, topk_reference

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


# What stage 0003 and its gfx950 tests call in AITER: module -> {function:
# keyword parameters} (vllm-project/vllm v0.32.0,
# vllm/v1/attention/ops/rocm_paged_mxfp4_indexer.py lines 50-150 and 405-470;
# ROCm/aiter 689b79d5, aiter/ops/triton/fusions/k_norm_rope_mxfp4_cache.py).
AITER_MXFP4_API: dict[str, dict[str, tuple[str, ...]]] = {
    "aiter.ops.triton.attention.pa_mqa_logits_mxfp4": {
        "cache_format": (),
        "select_config": (),
        "build_schedule": (),
        "paged_mxfp4_mqa_logits": (
            "out_logits",
            "clean_logits",
            "row_ends",
            "query_start_loc",
            "schedule",
        ),
    },
    "aiter.ops.triton.fusions.k_norm_rope_mxfp4_cache": {
        "k_norm_rope_mxfp4_cache": ("shuffle",),
    },
}


def missing_aiter_mxfp4_api() -> list[str]:
    """What of ``AITER_MXFP4_API`` the installed AITER lacks (an older AITER
    than stage 0003 needs), as "module.function(param)" strings."""
    missing = []
    for module_name, functions in AITER_MXFP4_API.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for name, params in functions.items():
            function = getattr(module, name, None)
            if function is None:
                missing.append(f"{module_name}.{name}")
                continue
            accepted = inspect.signature(function).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
            missing += [
                f"{module_name}.{name}({param}=)"
                for param in params
                if param not in accepted and not takes_any
            ]
    return missing


def gfx950_aiter_mxfp4_skip_reason() -> str | None:
    """Why stage 0003's gfx950 tests cannot run here, or None."""
    if not real_gfx950_with_aiter():
        return "needs a gfx950 GPU (MI355X) with AITER"
    if missing := missing_aiter_mxfp4_api():
        return (
            "this AITER is older than stage 0003 needs (README, 'On an MI355X'); "
            "it lacks " + ", ".join(missing)
        )
    return None


def amdsmi_stand_in(arch: str) -> types.ModuleType:
    """AMD SMI as ``vllm.platforms.rocm`` uses it at import: one GPU whose
    ``target_graphics_version`` is ``arch`` (vllm-project/vllm v0.32.0,
    vllm/platforms/rocm.py lines 39-53 import these names, 178-190 read the
    arch). Memory, UUID, link and NUMA answers are assumptions."""
    module = types.ModuleType("amdsmi")
    module.AmdSmiException = type("AmdSmiException", (Exception,), {})  # type: ignore[attr-defined]
    module.AmdSmiMemoryType = types.SimpleNamespace(VRAM="VRAM")  # type: ignore[attr-defined]
    module.amdsmi_init = lambda *args: None  # type: ignore[attr-defined]
    module.amdsmi_shut_down = lambda *args: None  # type: ignore[attr-defined]
    module.amdsmi_get_processor_handles = lambda: ["gpu0"]  # type: ignore[attr-defined]
    module.amdsmi_get_gpu_asic_info = lambda handle: {  # type: ignore[attr-defined]
        "target_graphics_version": arch
    }
    module.amdsmi_get_gpu_device_uuid = lambda handle: "stand-in-0"  # type: ignore[attr-defined]
    module.amdsmi_get_gpu_memory_total = lambda handle, kind: 288 << 30  # type: ignore[attr-defined]
    module.amdsmi_topo_get_link_type = lambda a, b: {"type": "XGMI"}  # type: ignore[attr-defined]
    module.amdsmi_topo_get_numa_node_number = lambda handle: 0  # type: ignore[attr-defined]
    return module


@functools.cache
def rocm_platform_module(arch: str) -> types.ModuleType:
    """vLLM's own ``vllm.platforms.rocm`` from the tree under test, loaded as
    on a machine whose GPU is ``arch``: AMD SMI (which this machine lacks)
    is the stand-in above; everything else is the real module."""
    import vllm.platforms

    path = Path(vllm.platforms.__file__).with_name("rocm.py")
    spec = importlib.util.spec_from_file_location("vllm.platforms.rocm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setitem(sys.modules, "amdsmi", amdsmi_stand_in(arch))
        spec.loader.exec_module(module)
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
    monkeypatch.setitem(sys.modules, "vllm.platforms.rocm", rocm_platform_module(arch))
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    # As on ROCm: a CUDA machine must not pick its CUDA-only code (the
    # DeepSeek-V3.2 package would import its NVIDIA model and FlashAttention).
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
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


def use_rocm_fp8_encoding(monkeypatch, arch: str) -> torch.dtype:
    """The FP8 dtype vLLM's ROCm platform picks on ``arch`` (fnuz on gfx942,
    OCP on gfx950: ``RocmPlatform.fp8_dtype``), given to the platform and to
    the module constants that were read from it at import on this CPU
    (``FP8_DTYPE`` in rocm_aiter_mla_sparse.py; ``_FP8_DTYPE``, ``_USE_FNUZ``
    and ``_FP8_MAX`` in deepseek_v32/common/kernels.py, whose lines 29-33
    derive them so: 224 keeps the ue8m0 scale inside the fnuz range)."""
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as mla_sparse
    from vllm.platforms import current_platform

    fp8 = rocm_platform_module(arch).RocmPlatform.fp8_dtype()
    monkeypatch.setattr(current_platform, "fp8_dtype", lambda: fp8)
    monkeypatch.setattr(mla_sparse, "FP8_DTYPE", fp8)
    kernels = sys.modules.get("vllm.models.deepseek_v32.common.kernels")
    if kernels is not None:
        fnuz = fp8 == torch.float8_e4m3fnuz
        monkeypatch.setattr(kernels, "_FP8_DTYPE", fp8)
        monkeypatch.setattr(kernels, "_USE_FNUZ", fnuz)
        monkeypatch.setattr(kernels, "_FP8_MAX", 224.0 if fnuz else 448.0)
    return fp8
