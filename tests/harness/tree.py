# SPDX-License-Identifier: Apache-2.0
"""The applied vLLM tree a test runs against.

``nox -s tests`` puts the tree of the stage under test first on ``sys.path``
and names it in ``DSA_VLLM_TREE``; ``DSA_STAGES`` lists what it holds
("base,0001,..."). A test module asks for the stage it needs; without such a
tree it is skipped with the reason, never run against some other vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

TREE_ENV = "DSA_VLLM_TREE"
STAGES_ENV = "DSA_STAGES"


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
