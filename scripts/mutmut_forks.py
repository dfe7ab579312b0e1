# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin ``scripts/mutate.py`` loads under mutmut: the functions
that forked processes of a test call (the TP ranks of the gloo tests) count
as reached by that test.

mutmut maps each test to the functions it reaches from the calls recorded
in its own process; calls made in a forked rank are lost with the rank, so
their mutants would be "no tests", never run. Here every forked child
writes each function it reaches to a file named after its parent's pid, at
once (a rank may leave by ``os._exit``), and the parent adds the file's
names to its own record before mutmut reads it at the test's teardown.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The folder of the hit files (set by scripts/mutate.py).
HITS_ENV = "DSA_MUTMUT_HITS"


def _hits_of(pid: int) -> Path:
    return Path(os.environ[HITS_ENV]) / f"{pid}.hits"


class _WrittenThrough(set):
    """mutmut's record of reached functions, each new name also appended
    to the parent's hit file."""

    def __init__(self, names, path: Path):
        super().__init__(names)
        self.path = path

    def add(self, name) -> None:
        if name not in self:
            super().add(name)
            with self.path.open("a") as hits:
                hits.write(f"{name}\n")


def _in_child() -> None:
    from mutmut.state import state

    state()._stats = _WrittenThrough(state()._stats, _hits_of(os.getppid()))


_REGISTERED: list[bool] = []


def pytest_configure(config: pytest.Config) -> None:
    # mutmut runs pytest more than once in a process: register once.
    if HITS_ENV in os.environ and not _REGISTERED:
        os.register_at_fork(after_in_child=_in_child)
        _REGISTERED.append(True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Before mutmut reads this process's record: add its children's."""
    if HITS_ENV not in os.environ:
        return
    path = _hits_of(os.getpid())
    if path.exists():
        from mutmut.state import state

        for name in path.read_text().split():
            state()._stats.add(name)
        path.unlink()
