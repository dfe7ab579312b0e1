# SPDX-License-Identifier: Apache-2.0
"""Empty stand-ins for vLLM's compiled extension modules.

The applied tree is never compiled. On a CUDA machine vLLM's platform module
imports ``vllm._C_stable_libtorch`` just to register its ops; the ops the
stages call get contract-faithful references instead (``topk_reference``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

COMPILED_MODULES = ("vllm._C_stable_libtorch",)


def install() -> None:
    """Register an empty module for each compiled module that is missing."""
    for name in COMPILED_MODULES:
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
