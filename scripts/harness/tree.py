# SPDX-License-Identifier: Apache-2.0
"""The applied vLLM tree a test runs against.

The tool names the tree of the stage under test in ``DSA_VLLM_TREE`` and
what it holds in ``DSA_STAGES`` ("base,0001,..."): the test contract of
scripts/series/contract.py, set by ``python3 -m scripts.series test`` and
printed by ``... env STAGE``. tests/conftest.py puts the tree first on
``sys.path``. A test module asks for the stage it needs; without such a tree
it is skipped with the reason, never run against some other vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.series.contract import STAGES_ENV, TREE_ENV


@dataclass(frozen=True)
class AppliedTree:
    path: Path
    stages: tuple[str, ...]  # "base" first, then the applied stage ids

    @property
    def stage(self) -> str:
        return self.stages[-1]


def current_tree() -> AppliedTree | None:
    path = os.environ.get(TREE_ENV)
    if not path:
        return None
    stages = tuple(os.environ.get(STAGES_ENV, "base").split(","))
    return AppliedTree(Path(path), stages)


def applied_tree(stage: str = "base") -> AppliedTree:
    """The tree under test; skip the calling module unless it holds ``stage``."""
    tree = current_tree()
    if tree is None:
        pytest.skip(
            f"needs an applied vLLM tree ({TREE_ENV}); run it through "
            "`nox -s tests` or `nox -s apply-and-test`",
            allow_module_level=True,
        )
    if stage not in tree.stages:
        pytest.skip(
            f"stage {stage} is not applied in this tree (tree at {tree.stage})",
            allow_module_level=True,
        )
    import vllm

    vllm_file = Path(vllm.__file__).resolve()
    if tree.path.resolve() not in vllm_file.parents:
        raise RuntimeError(f"vllm was imported from {vllm_file}, not from {tree.path}")
    return tree
