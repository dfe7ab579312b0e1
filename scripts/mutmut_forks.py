# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin ``scripts/mutate.py`` loads under mutmut: the functions
that forked processes of a test call (the TP ranks of the gloo tests), or
Python processes it starts (the tool's commands, run as a user runs them),
count as reached by that test.

mutmut maps each test to the functions it reaches from the calls recorded
in its own process; calls made in a forked rank or a subprocess are lost
with it, so their mutants would be "no tests", never run (the mutant
itself is active in both: they inherit ``MUTANT_UNDER_TEST``). Here every
forked child, and every subprocess (through the ``sitecustomize`` that
``scripts/mutate.py`` puts on ``PYTHONPATH`` beside this module), writes
each function it reaches to a file named after the test's process, at once
(a rank may leave by ``os._exit``), and the test's process adds the file's
names to its own record before mutmut reads it at the test's teardown.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The folder of the hit files (set by scripts/mutate.py).
HITS_ENV = "DSA_MUTMUT_HITS"
# The pid of the test's process, for the processes it starts.
TEST_PID_ENV = "DSA_MUTMUT_TEST_PID"


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


def in_subprocess() -> None:
    """In a process a test started, while mutmut maps tests to functions
    (``MUTANT_UNDER_TEST`` is "stats"): record through to its hit file."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    if HITS_ENV not in os.environ or TEST_PID_ENV not in os.environ:
        return
    try:
        from mutmut.state import state
    except ImportError:  # a Python without mutmut runs no mutant either
        return
    path = _hits_of(int(os.environ[TEST_PID_ENV]))
    state()._stats = _WrittenThrough(state()._stats, path)


_REGISTERED: list[bool] = []


def pytest_configure(config: pytest.Config) -> None:
    # mutmut runs pytest more than once in a process: register once.
    if HITS_ENV in os.environ and not _REGISTERED:
        os.register_at_fork(after_in_child=_in_child)
        _REGISTERED.append(True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if HITS_ENV in os.environ:
        os.environ[TEST_PID_ENV] = str(os.getpid())


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
