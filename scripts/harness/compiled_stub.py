# SPDX-License-Identifier: Apache-2.0
"""Empty stand-ins for vLLM's compiled extension modules.

The applied tree is never compiled. On a CUDA machine vLLM's platform module
imports ``vllm._C_stable_libtorch`` just to register its ops; the ops the
stages call get contract-faithful references instead (``topk_reference``).
Some modules ask the compiled library at import time which CUTLASS kernels
it has; with nothing compiled the honest answer is none.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

COMPILED_MODULES = ("vllm._C_stable_libtorch",)
CAPABILITY_PROBES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
)
_LIBRARIES: list = []


def install() -> None:
    """Register an empty module for each compiled module that is missing,
    and answer the capability probes."""
    for name in COMPILED_MODULES:
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    # Finding the modules above imported the vllm package, and vLLM's imports
    # torch first thing (vllm/env_override.py). A package that does not (the
    # tool's synthetic trees) has nothing that asks the probes, and is not
    # made to import torch for them.
    if "torch" in sys.modules:
        _answer_capability_probes()


def _answer_capability_probes() -> None:
    import torch

    missing = [p for p in CAPABILITY_PROBES if not hasattr(torch.ops._C, p)]
    if not missing:
        return
    library = torch.library.Library("_C", "FRAGMENT")
    for probe in missing:
        library.define(f"{probe}(int cuda_device_capability) -> bool")
        library.impl(probe, lambda capability: False, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)  # the registrations live as long as the library


def use_generic_platform() -> None:
    """Resolve vLLM's platform as the generic one on a CUDA machine, for tests
    and benchmarks of Triton kernels only. Model packages then import their
    generic code instead of the CUDA model, whose imports need the compiled
    extensions (FlashAttention's among them). Triton still compiles for the
    GPU. Call before anything asks for ``current_platform``."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    if platforms._current_platform is None:
        platforms._current_platform = UnspecifiedPlatform()
