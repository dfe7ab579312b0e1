# SPDX-License-Identifier: Apache-2.0
"""Put the applied vLLM tree under test (if any) first on sys.path."""

import os
import sys

from harness.tree import TREE_ENV

_tree = os.environ.get(TREE_ENV)
if _tree and _tree not in sys.path:
    sys.path.insert(0, _tree)
