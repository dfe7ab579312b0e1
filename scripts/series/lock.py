# SPDX-License-Identifier: Apache-2.0
"""One writer at a time per checkout: an exclusive lock on
build/series.lock, which the kernel drops when its holder exits or dies."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from scripts.series import SeriesError
from scripts.series.config import Series
from scripts.series.files import lock
from scripts.series.layout import LOCK_FILE, build_dir


@contextmanager
def project_lock(series: Series, command: str) -> Iterator[None]:
    """Hold the project's lock for ``command``; wait while another holds it."""
    path = build_dir(series) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+", encoding="utf-8")
    except OSError as exc:
        raise SeriesError(
            f"cannot create the lock file {path} ({exc.strerror}); "
            f"{path.parent} must be a writable folder"
        ) from None
    with handle:
        lock(
            handle,
            lambda: f"waiting for {_holder(handle)} to finish (it holds {path})...",
        )
        handle.seek(0)
        handle.truncate()
        handle.write(f"`python3 -m scripts.series {command}` (pid {os.getpid()})")
        handle.flush()
        yield


def _holder(handle: TextIO) -> str:
    """The command named in the lock file. A holder that has just taken the
    lock writes its name a moment later, so an empty file is read again."""
    for _ in range(20):
        handle.seek(0)
        if holder := handle.read().strip():
            return holder
        time.sleep(0.05)
    return "another command"
