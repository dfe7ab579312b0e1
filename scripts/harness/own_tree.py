# SPDX-License-Identifier: Apache-2.0
"""The ``own_tree`` marker: a test of a stage's own tools (its bench, which
runs on the stage's tree), which later stages cannot change. The top tree's
run leaves it out where its stage's tree ran in the same ``test``
(``OWN_TREE_RAN_ENV``); run alone, the top tree runs it."""

from __future__ import annotations

import os

import pytest

from scripts.series.contract import OWN_TREE_RAN_ENV


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "own_tree: runs on its stage's own tree, not again on the top"
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    ran = set(filter(None, os.environ.get(OWN_TREE_RAN_ENV, "").split(",")))
    left = [
        item
        for item in items
        if item.get_closest_marker("own_tree") and item.path.parent.name in ran
    ]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item not in left]
