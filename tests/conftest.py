# SPDX-License-Identifier: Apache-2.0
"""Put the applied vLLM tree under test (if any) first on sys.path, and the
project last (for the shared stand-ins in scripts/harness and the test
contract, scripts/series/contract.py)."""

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from scripts.harness import compiled_stub, triton_fp8_shim  # noqa: E402
from scripts.harness.tree import TREE_ENV  # noqa: E402

_tree = os.environ.get(TREE_ENV)
if _tree:
    if _tree not in sys.path:
        sys.path.insert(0, _tree)
    compiled_stub.install()
if os.environ.get("TRITON_INTERPRET") == "1":
    triton_fp8_shim.install()
