# SPDX-License-Identifier: Apache-2.0
"""Put the applied vLLM tree under test (if any) first on sys.path."""

import os
import sys

from harness import compiled_stub
from harness.tree import TREE_ENV

_tree = os.environ.get(TREE_ENV)
if _tree:
    if _tree not in sys.path:
        sys.path.insert(0, _tree)
    compiled_stub.install()
