# SPDX-License-Identifier: Apache-2.0
"""The three file operations several commands share: a write that is whole
or not at all, a file's sha256, and an exclusive lock that says what it
waits for."""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_whole(path: Path, data: bytes, mode: int | None = None) -> None:
    """``path`` holds ``data`` or its old content, never a part: a temporary
    file in the same folder, flushed to disk, renamed over it. ``mode``:
    its permission bits (default: a new file's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = partial_of(path)
    write_synced(temp, data, mode)
    os.replace(temp, path)


def partial_of(path: Path) -> Path:
    """Where ``write_whole`` writes ``path`` first (a kill may leave it)."""
    return path.with_name(f".{path.name}.partial")


def write_synced(path: Path, data: bytes, mode: int | None = None) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if mode is not None:
        os.chmod(path, mode & 0o7777)


def sha256_of(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def lock(fd: int | IO, waiting: Callable[[], str]) -> None:
    """Take an exclusive lock on ``fd`` (dropped when it is closed, or its
    holder dies); if another holds it, say ``waiting()`` on stderr first."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(waiting(), file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
