# SPDX-License-Identifier: Apache-2.0
"""Put the applied vLLM tree under test (if any) first on sys.path, and the
project last (for the shared stand-ins in scripts/harness and the test
contract, scripts/series/contract.py). vLLM's compiled extension is stood in,
except on AMD hardware, where the tree's own build is required."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1]))

from scripts.harness import compiled_stub, triton_fp8_shim  # noqa: E402
from scripts.harness.own_tree import (  # noqa: E402, F401
    pytest_collection_modifyitems,
    pytest_configure,
)
from scripts.harness.tree import TREE_ENV  # noqa: E402


def _on_amd_hardware() -> bool:
    """A ROCm torch on a machine with AMD GPUs (rocminfo answers there)."""
    import torch

    return torch.version.hip is not None and shutil.which("rocminfo") is not None


_tree = os.environ.get(TREE_ENV)
if _tree:
    if _tree not in sys.path:
        sys.path.insert(0, _tree)
    if not _on_amd_hardware():
        compiled_stub.install()
    elif not any((Path(_tree) / "vllm").glob("_C*.so")):
        # The stand-in would hide the real torch.ops._C: stop instead.
        pytest.exit(
            f"{_tree} has no compiled vLLM extension (vllm/_C*.so): on AMD "
            "hardware the tests need the real one. Build the tree you test "
            "(README, 'On an MI355X'), then point DSA_VLLM_TREE at it.",
            returncode=4,
        )
if os.environ.get("TRITON_INTERPRET") == "1":
    triton_fp8_shim.install()
